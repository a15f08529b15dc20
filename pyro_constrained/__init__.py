"""Exactly-constrained distributions for Pyro.

Importing this package registers the KL rules and the support constraints' bijections
with ``torch.distributions`` / Pyro; nothing is patched into ``pyro.distributions``.
"""

from pyro_constrained import losses
from pyro_constrained.conditioned_poisson import ConditionedPoisson
from pyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli
from pyro_constrained.linear_constrained_normal import LinearConstrainedNormal
from pyro_constrained.linear_constraint import LinearConstraint
from pyro_constrained.reparam import LinearConstrainedNormalReparam

__all__ = [
    "ConditionedPoisson",
    "ExactlyKBernoulli",
    "LinearConstrainedNormal",
    "LinearConstrainedNormalReparam",
    "LinearConstraint",
    "losses",
]
__version__ = "0.1.0"
