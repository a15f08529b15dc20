"""ExactlyKBernoulli's parameters (NumPyro): the constraints it declares (its support
``KHot`` among them), the count rule for ``k``, and the logits of ``probs`` with exact 0 and
1 kept infinite."""

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import constraints
from numpyro.util import not_jax_tracer

from constrained_ppl.arguments import check_count


class _ExtendedReal(constraints.ParameterFreeConstraint):
    """The extended real line [-inf, +inf]: anything but NaN (infinite logits force a
    variable off or on). NumPyro's ``real`` excludes the infinities."""

    def __call__(self, x):
        return x == x

    def feasible_like(self, prototype):
        return jnp.zeros_like(prototype)


class KHot(constraints.Constraint):
    """0/1 vectors (last dimension) with exactly ``k`` ones; ``k`` broadcasts with the batch."""

    is_discrete = True
    event_dim = 1

    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        xp = jnp if isinstance(x, jax.Array) else np
        binary = xp.all((x == 0) | (x == 1), axis=-1)
        return binary & (xp.sum(x, axis=-1) == self.k)

    def feasible_like(self, prototype):
        n = jnp.shape(prototype)[-1]
        first_k = jnp.arange(n) < jnp.expand_dims(jnp.asarray(self.k), -1)
        return jnp.broadcast_to(first_k, jnp.shape(prototype)).astype(jnp.result_type(prototype))

    def tree_flatten(self):
        return (self.k,), (("k",), dict())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self.k})"


def _as_k(k) -> jax.Array:
    """``k`` as an array, after the count rule of ``check_count`` (an int, an integer array,
    or whole-number floats; 3.5, bools, complex numbers and NaN are a ``ValueError``). Its
    dtype is kept: a float ``k`` stays float, so that a distribution built from a concrete
    float ``k`` and one built from a traced one have the same pytree (a ``lax.scan`` carry)."""
    check_count(k, concrete=not_jax_tracer(k), name="k")
    return jnp.asarray(k)


def _bound(n: int, k_max: int | None) -> int:
    """The largest valid ``k``: n, or ``k_max`` if that is smaller."""
    return n if k_max is None else min(n, k_max)


class _ArgConstraints(dict):
    """``arg_constraints`` as a dict (NumPyro reads the class's as one) that, read from an
    instance, declares ``k``'s exact range ``integer_interval(0, min(n, k_max))``: the range
    the constructor checks, which depends on the instance's n. So every ``k`` that satisfies
    the declared constraint is accepted, and ``validate_args`` and the constructor's check
    agree. Read from the class (no n yet), ``k`` is a ``nonnegative_integer``."""

    def __get__(self, instance, owner=None):
        event_shape = None if instance is None else instance.__dict__.get("_event_shape")
        if not event_shape:
            return self
        bound = _bound(event_shape[0], instance.__dict__.get("k_max"))
        return {**self, "k": constraints.integer_interval(0, bound)}


def _logits_from_probs(probs: jax.Array) -> jax.Array:
    """Exact 0 and 1 map to -inf and +inf, invalid probs to NaN. The log is taken of
    interior probs only (the other branch of the where gets 1/2): log(0)'s infinite
    derivative times a zero cotangent would be NaN. The derivative at an exact 0 or 1 is
    supplied by ``_odds_terms`` instead."""
    interior = (probs > 0) & (probs < 1)
    safe = jnp.where(interior, probs, 0.5)
    edge = jnp.where(probs == 0, -jnp.inf, jnp.where(probs == 1, jnp.inf, jnp.nan))
    return jnp.where(interior, jnp.log(safe) - jnp.log1p(-safe), edge.astype(probs.dtype))
