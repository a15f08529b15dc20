"""Batch-shape rules shared by the NumPyro classes: ``vmap_over`` for distributions whose
leaves are all stored broadcast to the batch shape, the batch shape of those leaves, and the
check of ``expand``."""

from __future__ import annotations

import jax.numpy as jnp
from numpyro.distributions.batch_util import vmap_over
from numpyro.distributions.distribution import Distribution


def vmap_over_broadcast_leaves(dist: Distribution, **axes: int | None) -> Distribution:
    """The axes of ``dist``'s leaves when the named constructor arguments are mapped, for a
    class that stores every leaf broadcast to its full batch shape (``ExactlyKBernoulli``,
    ``ConditionedPoisson``).

    Every leaf then holds every batch axis of ``dist``, so a batch axis of ``dist`` mapped on
    one parameter is mapped on all of them: a leaf left unmapped would keep that axis inside
    the vmapped function and broadcast each element against the whole batch (one row of
    results per element instead of one result). Batch axes lead, so an axis counted from
    the left names the same batch axis in every leaf; a negative one does not (the leaves
    have different event ranks) and is refused. An axis beyond ``dist``'s batch axes (a new
    axis, as ``out_axes`` of a vmapped constructor) maps only the parameters it is given for.
    """
    given = {name: axis for name, axis in axes.items() if axis is not None}
    for name, axis in given.items():
        if not isinstance(axis, int) or axis < 0:
            raise ValueError(
                f"vmap_over({type(dist).__name__}): {name}={axis!r}; give a non-negative "
                "axis (the parameters have different event ranks, so a negative axis names "
                "different batch axes in each)"
            )
    batch_ndim = len(dist.batch_shape)
    if any(axis < batch_ndim for axis in given.values()):
        if len(set(given.values())) > 1:
            raise ValueError(
                f"vmap_over({type(dist).__name__}): the parameters are stored broadcast to "
                f"the batch shape, so a batch axis is mapped on all of them together; got "
                f"different axes {given}"
            )
        axes = dict.fromkeys(axes, next(iter(given.values())))
    return vmap_over.dispatch(Distribution)(dist, **axes)


def stored_batch_shape(leaf, event_ndim: int) -> tuple[int, ...]:
    """The batch shape of a leaf stored broadcast to the batch shape: the distribution's
    ``batch_shape``, except inside a function vmapped over the distribution (``vmap_over``),
    where the leaves have lost the mapped axes and ``batch_shape`` (static pytree data) has
    not. The shapes of results are taken from it, so that each mapped element computes its
    own."""
    return tuple(jnp.shape(leaf)[: jnp.ndim(leaf) - event_ndim])


def check_expand(batch_shape: tuple[int, ...], new_shape: tuple[int, ...]) -> None:
    """NumPyro's error for an ``expand`` to a batch shape that ``batch_shape`` does not
    broadcast to (the message of ``Distribution.expand``): a new shape must keep every
    existing dimension, or replace a dimension of size 1."""
    compatible = len(new_shape) >= len(batch_shape) and all(
        old in (1, new)
        for old, new in zip(reversed(batch_shape), reversed(new_shape), strict=False)
    )
    if not compatible:
        raise ValueError(
            f"Cannot broadcast distribution of shape {batch_shape} to shape {new_shape}"
        )
