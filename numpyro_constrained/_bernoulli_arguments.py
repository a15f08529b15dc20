"""The ``logits`` / ``probs`` argument of the classes built on independent Bernoullis
(``PoissonBinomial``, ``CountConstrainedBernoulli``), by the rules ``ExactlyKBernoulli``
applies, whose helpers it reuses: exactly one of the two, a floating dtype, at least one
dimension (the n Bernoullis), probabilities 0 and 1 as logits -inf and +inf (a variable
never or always on) with no NaN in the gradient there, the parameter given checked first
with validation on (concrete values only)."""

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import constraints
from numpyro.util import not_jax_tracer

from numpyro_constrained.exactly_k_bernoulli import _ExtendedReal, _logits_from_probs

__all__ = ["LOGITS_PROBS_CONSTRAINTS", "forced_counts", "logits_and_probs"]

#: The ``arg_constraints`` entries of the two parameters (logits may be +-inf, not NaN).
LOGITS_PROBS_CONSTRAINTS = {
    "probs": constraints.independent(constraints.unit_interval, 1),
    "logits": constraints.independent(_ExtendedReal(), 1),
}


def logits_and_probs(logits, probs, owner: str, validate: bool) -> tuple[jax.Array, jax.Array]:
    """(logits, probs): exactly one of the two given (else a ``ValueError`` naming
    ``owner``), as floating arrays with at least one dimension, the other derived from it.
    With ``validate``, a concrete given parameter outside its constraint is a
    ``ValueError``. Call under ``jax.ensure_compile_time_eval`` (constants stay concrete)."""
    if (logits is None) == (probs is None):
        raise ValueError(f"{owner}: give exactly one of `logits` or `probs`")
    name = "probs" if probs is not None else "logits"
    given = jnp.asarray(probs if probs is not None else logits)
    if not jnp.issubdtype(given.dtype, jnp.floating):
        given = given.astype(jnp.result_type(float))
    if given.ndim < 1:
        raise ValueError(f"{name} must have at least one dimension (the n Bernoullis)")
    if validate:
        verdict = LOGITS_PROBS_CONSTRAINTS[name](given)
        if not_jax_tracer(verdict) and not np.all(verdict):
            raise ValueError(f"{owner} distribution got invalid {name} parameter.")
    if probs is not None:
        return _logits_from_probs(given), given
    return given, jax.nn.sigmoid(given)


def forced_counts(logits) -> tuple[jax.Array, jax.Array]:
    """(the number of variables forced on (+inf logits), forced off (-inf)), per batch."""
    return (logits == jnp.inf).sum(-1), (logits == -jnp.inf).sum(-1)
