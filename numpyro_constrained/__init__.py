"""Exactly-constrained distributions for NumPyro.

Importing this package registers the KL rules and the support constraints' bijections
with NumPyro; nothing is patched into ``numpyro.distributions``.
"""

from numpyro_constrained import losses, nn
from numpyro_constrained.conditioned_poisson import ConditionedPoisson
from numpyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli
from numpyro_constrained.linear_constrained_normal import LinearConstrainedNormal
from numpyro_constrained.linear_constraint import LinearConstraint
from numpyro_constrained.reparam import LinearConstrainedNormalReparam

__all__ = [
    "ConditionedPoisson",
    "ExactlyKBernoulli",
    "LinearConstrainedNormal",
    "LinearConstrainedNormalReparam",
    "LinearConstraint",
    "losses",
    "nn",
]
__version__ = "0.1.0"
