"""The supports of ``ConditionedPoisson``: its rates (`positive_finite`) and its values
(`integer_composition`, integer vectors with an exact sum)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import constraints

from constrained_ppl.exact_integers import largest_exact_integer

__all__ = ["integer_composition", "positive_finite"]


class _PositiveFinite(type(constraints.positive)):
    """Real numbers in (0, inf): ``constraints.positive`` lets ``inf`` through.

    A ``constraints.greater_than`` with ``lower_bound = 0`` (as ``positive`` is), so that
    code reading that bound (the value generators of NumPyro's generic distribution tests)
    treats it as ``positive``. No ``biject_to``: ``exp`` overflows to ``inf``.
    """

    def __call__(self, x):
        xp = jnp if isinstance(x, jax.Array) else np
        return (x > 0) & xp.isfinite(x)

    def feasible_like(self, prototype):
        return jnp.ones_like(prototype)

    def eq(self, other, static: bool = False):
        return isinstance(other, _PositiveFinite)

    def __repr__(self) -> str:
        return "PositiveFinite()"


positive_finite = _PositiveFinite()


def _is_integer_composition(value, total, *, total_below_2_to_the_m: bool = False):
    """Whether each vector (last axis) of ``value`` is in the support, and whether all its
    entries are ``>= 0``.

    Exact for any dtype of ``value``: a float sum that rounds (``2**24 - 1 + 1 + 1`` is
    ``2**24`` in float32) cannot pass for ``total``. Floats are summed as they are where the
    caller knows ``total < 2**m`` (``m`` their significand bits), else, like integers,
    checked to lie in ``[0, total]`` and summed as integers.
    """
    is_jax = isinstance(value, jax.Array) or isinstance(total, jax.Array)
    xp = jnp if is_jax else np
    value = xp.asarray(value)
    total = xp.asarray(total)
    is_nonnegative = value >= 0
    entry_ok = is_nonnegative
    if xp.issubdtype(value.dtype, xp.floating):
        # floor(inf) == inf, so finiteness is checked separately; NaN fails every comparison.
        entry_ok = entry_ok & (value == xp.floor(value)) & xp.isfinite(value)
        if total_below_2_to_the_m:
            # Non-negative integers with a true sum up to 2**m are summed exactly in any
            # order; a larger true sum rounds to at least 2**m > total. (A traced total at
            # or above 2**m, beyond the static k_max the caller relied on, fails.)
            limit = largest_exact_integer(str(value.dtype))
            in_support = (
                xp.all(entry_ok, axis=-1) & (xp.sum(value, axis=-1) == total) & (total < limit)
            )
            return in_support, xp.all(is_nonnegative, axis=-1)
    entry_ok = entry_ok & (value <= total[..., None])
    counts = xp.where(entry_ok, value, 0)
    integer = jnp.result_type(int) if is_jax else np.int64
    # Entries in [0, total]: the cast is exact; a sum that wrapped around the integer range
    # is far above total as a float.
    in_support = (
        xp.all(entry_ok, axis=-1)
        & (xp.sum(counts.astype(integer), axis=-1) == total.astype(integer))
        & (xp.sum(counts, axis=-1) <= 2 * total + 1)
    )
    return in_support, xp.all(is_nonnegative, axis=-1)


class _IntegerComposition(constraints.Constraint):
    """Integer vectors ``z >= 0`` (last axis) with ``sum(z) == total`` exactly.

    NumPyro's ``constraints.multinomial`` does not check that the entries are integers.
    """

    is_discrete = True
    event_dim = 1

    def __init__(self, total) -> None:
        self.total = total

    def __call__(self, x):
        return _is_integer_composition(x, self.total)[0]

    def feasible_like(self, prototype):
        # All of the total in the first category.
        first = jnp.broadcast_to(jnp.asarray(self.total, prototype.dtype), prototype.shape[:-1])
        return jnp.zeros_like(prototype).at[..., 0].set(first)

    def tree_flatten(self):
        return (self.total,), (("total",), dict())

    def eq(self, other, static: bool = False):
        if not isinstance(other, _IntegerComposition):
            return False
        if static:
            return self.total is other.total
        return jnp.array_equal(self.total, other.total)

    def __repr__(self) -> str:
        return f"IntegerComposition(total={self.total})"


integer_composition = _IntegerComposition
