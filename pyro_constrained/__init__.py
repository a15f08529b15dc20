"""Exactly-constrained distributions for Pyro.

Importing this package registers the KL rules and the support constraints' bijections
with ``torch.distributions`` / Pyro; nothing is patched into ``pyro.distributions``.
"""

# ruff: noqa: E402  (the framework check comes before the imports that need it)

from constrained_ppl import __version__ as __version__
from constrained_ppl.extras import require_framework as _require_framework

# The framework is an optional extra: without it, say which one to install (before the
# imports below, which would fail on it with a bare ModuleNotFoundError).
_require_framework("pyro_constrained", "pyro", "PyTorch and Pyro", ("torch", "pyro"))

from pyro_constrained import losses, nn
from pyro_constrained.conditioned_poisson import ConditionedPoisson
from pyro_constrained.count_constrained_bernoulli import CountConstrainedBernoulli
from pyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli
from pyro_constrained.linear_constrained_normal import LinearConstrainedNormal
from pyro_constrained.linear_constraint import LinearConstraint
from pyro_constrained.nn import LinearConstrainedNormalHead
from pyro_constrained.poisson_binomial import PoissonBinomial
from pyro_constrained.reparam import LinearConstrainedNormalReparam

__all__ = [
    "ConditionedPoisson",
    "CountConstrainedBernoulli",
    "ExactlyKBernoulli",
    "LinearConstrainedNormal",
    "LinearConstrainedNormalHead",
    "LinearConstrainedNormalReparam",
    "LinearConstraint",
    "PoissonBinomial",
    "losses",
    "nn",
]
