"""The ``logits`` / ``probs`` argument of the classes built on independent Bernoullis
(``PoissonBinomial``, ``CountConstrainedBernoulli``), by the rules ``ExactlyKBernoulli``
applies, whose helpers it reuses: exactly one of the two, a floating dtype, at least one
dimension (the n Bernoullis), probabilities 0 and 1 as logits -inf and +inf (a variable
never or always on) with no NaN in the gradient there."""

import torch
from torch.distributions import constraints

from pyro_constrained.exactly_k_bernoulli import _ExtendedReal, _logits_from_probs

__all__ = ["LOGITS_PROBS_CONSTRAINTS", "forced_counts", "logits_argument"]

#: The ``arg_constraints`` entries of the two parameters (logits may be +-inf, not NaN).
LOGITS_PROBS_CONSTRAINTS = {
    "probs": constraints.independent(constraints.unit_interval, 1),
    "logits": constraints.independent(_ExtendedReal(), 1),
}


def logits_argument(logits, probs, owner: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, the probs as given or None): exactly one of ``logits`` and ``probs`` (else
    a ``ValueError`` naming ``owner``), as a floating tensor with at least one dimension."""
    if (logits is None) == (probs is None):
        raise ValueError(f"{owner}: give exactly one of `logits` or `probs`")
    name = "probs" if probs is not None else "logits"
    given = torch.as_tensor(probs if probs is not None else logits)
    if not given.is_floating_point():
        given = given.to(torch.get_default_dtype())
    if given.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension (the n Bernoullis)")
    if probs is not None:
        return _logits_from_probs(given), given
    return given, None


def forced_counts(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the number of variables forced on (+inf logits), forced off (-inf)), per batch."""
    return (logits == torch.inf).sum(-1), (logits == -torch.inf).sum(-1)
