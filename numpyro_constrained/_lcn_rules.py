"""The batching and KL rules of :class:`~numpyro_constrained.LinearConstrainedNormal`,
registered by ``linear_constrained_normal.py``: ``vmap_over`` and ``promote_batch_shape``
(used by ``jax.vmap`` with ``out_axes`` and by NumPyro's ``scan``), and ``kl_divergence``.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import Distribution
from numpyro.distributions.batch_util import vmap_over

from numpyro_constrained.validation import is_concrete

if TYPE_CHECKING:
    from numpyro_constrained.linear_constrained_normal import LinearConstrainedNormal


def _vmap_over_linear_constrained_normal(
    dist: LinearConstrainedNormal,
    loc=None,
    scale=None,
    covariance_matrix=None,
    scale_tril=None,
    A=None,
    k=None,
):
    """The axes of ``dist``'s leaves when the given constructor arguments are mapped.

    A parameter's own leaf gets its axis (``scale``, ``covariance_matrix`` and
    ``scale_tril`` all map the stored factor). A precomputed leaf is mapped, at axis 0, when a
    parameter it is computed from is: its own batch dimensions need not line up with a
    parameter's (the log normalizer of a (a, n) ``A`` mapped at axis 1 is a scalar), and any
    axis is right as long as the same ``out_axes`` is used to map over the result, as
    NumPyro's own rules do (``Beta._dirichlet``).
    """
    factor = next(
        (axis for axis in (scale, covariance_matrix, scale_tril) if axis is not None), None
    )

    def derived(*axes):
        return 0 if any(axis is not None for axis in axes) else None

    return vmap_over.dispatch(Distribution)(
        dist,
        loc=loc,
        _factor=factor,
        A=A,
        k=k,
        _basis_t=derived(factor, A),
        _r_inv_t=derived(factor, A),
        _prior_variance=derived(factor),
        _log_normalizer=derived(factor, A),
        _constraint_basis_t=derived(A),
        _constraint_r_inv_t=derived(A),
        _constraint_log_det_half=derived(A),
    )


def _promote_batch_shape_linear_constrained_normal(dist: LinearConstrainedNormal):
    """The batch shape after ``scan`` or ``vmap`` stacked leaves along new leading axes.

    The default rule cannot be used: it reads every ``arg_constraints`` attribute (with a
    diagonal covariance ``scale_tril`` and ``covariance_matrix`` would form n x n matrices,
    and the latter is the conditional covariance, broadcast to the stale batch shape), and it
    assumes every parameter is broadcast to the full batch shape, which the leaves here are
    not (an ``A`` shared by the batch stays (a, n): that is what keeps its products one
    matrix-matrix product). So the axes each leaf gained are its dimensions beyond those it
    was built with (``_leaf_batch_ndims``); the new batch shape is their broadcast followed
    by the old batch shape; and every leaf is reshaped (singleton axes between the stacked
    axes and its own, no copy of data) so that all of them line up with the new batch shape
    (a stacked (T, a, n) ``A`` beside a stacked (T, B, n) ``loc`` would otherwise broadcast
    T against B).
    """
    names = dist.pytree_data_fields
    old_ndim = len(dist.batch_shape)
    leaves = {name: dist.__dict__[name] for name in names}
    gained = {
        name: jnp.ndim(leaf) - dist._event_ndims(name) - built
        for (name, leaf), built in zip(leaves.items(), dist._leaf_batch_ndims, strict=True)
    }
    if not any(gained.values()):
        return copy.copy(dist)
    new_axes = jnp.broadcast_shapes(
        *(jnp.shape(leaf)[: gained[name]] for name, leaf in leaves.items())
    )
    batch_shape = tuple(new_axes) + tuple(dist.batch_shape)
    new = copy.copy(dist)
    for name, leaf in leaves.items():
        shape = jnp.shape(leaf)
        stacked, own = shape[: gained[name]], shape[gained[name] :]
        own_batch_ndim = len(own) - dist._event_ndims(name)
        aligned = (
            (1,) * (len(new_axes) - len(stacked))
            + stacked
            + (1,) * (old_ndim - own_batch_ndim)
            + own
        )
        if aligned != shape:
            setattr(new, name, jnp.reshape(leaf, aligned))
    # The LinearConstraint object kept for the unstacked leaves no longer matches them; the
    # constraint property rebuilds it from the new leaves.
    new.__dict__.pop("_constraint_object", None)
    new.__dict__.pop("_mean_cache", None)  # of the old batch shape; recomputed on use
    new._batch_shape = batch_shape
    new._leaf_batch_ndims = new._batch_ndims_of_leaves()
    return new


def _same_constraint(p: LinearConstrainedNormal, q: LinearConstrainedNormal) -> None:
    if p.event_shape != q.event_shape or p.A.shape[-2] != q.A.shape[-2]:
        raise ValueError(
            f"KL needs the same n and number of constraints, got A of shapes {p.A.shape} "
            f"and {q.A.shape}"
        )
    # Under jit A and k are tracers and cannot be compared: the caller is responsible.
    if is_concrete(p.A, q.A, p.k, q.k):
        try:
            same = bool(np.all(np.asarray(p.A) == np.asarray(q.A))) and bool(
                np.all(np.asarray(p.k) == np.asarray(q.k))
            )
        except ValueError:
            same = False
        if not same:
            raise ValueError(
                "KL between LinearConstrainedNormals needs the same A and k (different affine "
                "subspaces make the KL infinite or undefined)"
            )


def _kl_linear_constrained_normal(
    p: LinearConstrainedNormal, q: LinearConstrainedNormal
) -> jax.Array:
    """``KL(p || q) = -H_p - E_p[log q(z)]`` for two with the same A and k.

    ``E_p[(z - mu_bar_q)^T Sigma_q^{-1} (z - mu_bar_q)] = tr(Sigma_q^{-1} Sigma_bar_p)
    + (mu_bar_p - mu_bar_q)^T Sigma_q^{-1} (mu_bar_p - mu_bar_q)``, where, with
    ``Sigma_bar_p = (L_p N_p)(L_p N_p)^T`` (see ``variance``),
    ``tr(Sigma_q^{-1} Sigma_bar_p) = ||L_q^{-1} L_p N_p||_F^2``, a sum of squares:
    ``sum_i Sigma_bar_p,ii / s_q,i^2`` when q's covariance is diagonal (O(n a^2) when p's
    is too), O(n^3) otherwise. That A and k agree is
    checked when they are concrete; under ``jit`` it cannot be.
    """
    _same_constraint(p, q)
    mean_diff = p.mean - q.mean
    if q._diagonal:
        q_variance = jnp.square(q.scale)
        trace = jnp.sum(p._variance() / q_variance, -1)
        maha = jnp.sum(jnp.square(mean_diff) / q_variance, -1)
    else:
        p_factor, p_correction = p._second_moment_factors()
        q_tril = q.scale_tril
        # One triangular solve for the three right-hand sides: independent batched solves
        # may run at once and deadlock (see _after).
        right = jnp.broadcast_shapes(
            p_factor.shape[:-2], p_correction.shape[:-2], mean_diff.shape[:-1]
        )
        n = mean_diff.shape[-1]
        columns = [
            jnp.broadcast_to(p_factor, right + p_factor.shape[-2:]),
            jnp.broadcast_to(
                jnp.swapaxes(p_correction, -1, -2), right + (n, p_correction.shape[-2])
            ),
            jnp.broadcast_to(mean_diff[..., None], right + (n, 1)),
        ]
        stacked = jnp.concatenate(columns, -1)
        batch = jnp.broadcast_shapes(q_tril.shape[:-2], stacked.shape[:-2])
        whitened = jax.scipy.linalg.solve_triangular(
            jnp.broadcast_to(q_tril, batch + q_tril.shape[-2:]),
            jnp.broadcast_to(stacked, batch + stacked.shape[-2:]),
            lower=True,
        )
        trace = jnp.sum(jnp.square(whitened[..., :-1]), (-2, -1))
        maha = jnp.sum(jnp.square(whitened[..., -1]), -1)
    cross_entropy = 0.5 * (trace + maha) - q._log_normalizer
    return cross_entropy - p.entropy()
