"""Pyro's ELBO parts of a straight-through site (ExactlyKBernoulli, CountConstrainedBernoulli,
ConditionedPoisson), whose classes are both reparameterised (``has_rsample``) and
enumerable (``has_enumerate_support``).

Pyro decides between the pathwise and the score-function parts from ``has_rsample`` alone,
which is right for its reparameterised distributions, none of which enumerates. A guide
site enumerated by ``TraceEnum_ELBO`` (``config_enumerate``) takes its values from
``enumerate_support``, not from ``rsample``, and Pyro weights each of them by
``exp(score_function)``: the pathwise parts' zero score function weighted every value of the
support equally. So the pathwise parts go to the draws ``rsample`` returned, which Pyro
stores as a site's value unchanged, and any other value of a reparameterised site (an
enumerated one, or a draw of ``sample``) is scored.

The draws are recognised by identity, not by a property of the value: ``requires_grad``
is False for a straight-through draw under ``torch.no_grad`` (``SVI.evaluate_loss``) or
from constant parameters, where ``TraceMeanField_ELBO`` needs the pathwise parts.
"""

import weakref

import torch
from pyro.distributions import TorchDistribution

# The live straight-through draws, by id: an entry goes with its tensor (no reference is
# kept here), and one whose id a later tensor reuses is told apart by the identity check.
_DRAWS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def straight_through_draw(value: torch.Tensor) -> torch.Tensor:
    """``value``, recorded as a draw of ``rsample`` (see the module docstring)."""
    _DRAWS[id(value)] = value
    return value


def score_parts(self, value, *args, **kwargs):
    """Pyro's ``ScoreParts`` of ``value``: pathwise (no score-function term) for a draw that
    ``rsample`` returned, scored (the score function ``log q(value)``) for any other value
    of a reparameterised site, such as an enumerated one."""
    parts = TorchDistribution.score_parts(self, value, *args, **kwargs)
    if self.has_rsample and _DRAWS.get(id(value)) is not value:
        return parts._replace(score_function=parts.log_prob, entropy_term=0)
    return parts
