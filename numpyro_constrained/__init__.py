"""Exactly-constrained distributions for NumPyro.

Importing this package registers the KL rules and the support constraints' bijections
with NumPyro; nothing is patched into ``numpyro.distributions``.
"""

# ruff: noqa: E402  (the framework check comes before the imports that need it)

from constrained_ppl import __version__ as __version__
from constrained_ppl.extras import require_framework as _require_framework

# The framework is an optional extra: without it, say which one to install (before the
# imports below, which would fail on it with a bare ModuleNotFoundError).
_require_framework(
    "numpyro_constrained", "numpyro", "JAX and NumPyro", ("jax", "jaxlib", "numpyro")
)

from numpyro_constrained import losses, nn
from numpyro_constrained.conditioned_poisson import ConditionedPoisson
from numpyro_constrained.count_constrained_bernoulli import CountConstrainedBernoulli
from numpyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli
from numpyro_constrained.linear_constrained_normal import LinearConstrainedNormal
from numpyro_constrained.linear_constraint import LinearConstraint
from numpyro_constrained.poisson_binomial import PoissonBinomial
from numpyro_constrained.reparam import LinearConstrainedNormalReparam

__all__ = [
    "ConditionedPoisson",
    "CountConstrainedBernoulli",
    "ExactlyKBernoulli",
    "LinearConstrainedNormal",
    "LinearConstrainedNormalReparam",
    "LinearConstraint",
    "PoissonBinomial",
    "losses",
    "nn",
]
