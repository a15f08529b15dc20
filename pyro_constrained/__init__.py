"""Exactly-constrained distributions for Pyro.

Importing this package registers the KL rules and the support constraints' bijections
with ``torch.distributions`` / Pyro; nothing is patched into ``pyro.distributions``.
"""

from pyro_constrained import losses, nn
from pyro_constrained.conditioned_poisson import ConditionedPoisson
from pyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli
from pyro_constrained.linear_constrained_normal import LinearConstrainedNormal
from pyro_constrained.linear_constraint import LinearConstraint
from pyro_constrained.nn import LinearConstrainedNormalHead
from pyro_constrained.reparam import LinearConstrainedNormalReparam

__all__ = [
    "ConditionedPoisson",
    "ExactlyKBernoulli",
    "LinearConstrainedNormal",
    "LinearConstrainedNormalHead",
    "LinearConstrainedNormalReparam",
    "LinearConstraint",
    "losses",
    "nn",
]
__version__ = "0.1.0"
