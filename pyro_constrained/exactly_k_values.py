"""The torch exactly-k kernels' log normaliser in two parts, and the quantities computed from
them without cancellation (log_prob, cross-entropy, log constraint probability)."""

from collections.abc import Callable
from typing import NamedTuple

import torch


class NormalizerParts(NamedTuple):
    """The log normaliser in two parts that keep their precision for logits of any size
    (float64, shape ``batch``, no gradient): with ``x = logits + tilt``,

        log e_k(exp logits) = log_reduced + sum_i max(x_i, 0) - k tilt,

    where ``log_reduced = log e_k(exp x) - sum_i max(x_i, 0)`` is the log of the root's
    entry k times the internal nodes' factors. Every quantity that is a small difference of
    large terms when written with the logits (log_prob, entropy, KL, the constraint
    probability) is a sum of terms of one sign when written with ``x`` and ``log_reduced``
    (the ``*_value`` functions below); a saturated variable (``|x_i|`` beyond the dtype's
    precision) then contributes exactly nothing, as conditioning on its value would."""

    tilt: torch.Tensor
    log_reduced: torch.Tensor
    # Where the parts come from an upward pass whose tables are kept: a function of no
    # arguments returning the marginals (no gradient, the logits' shape) by one downward
    # pass over them, so that log_normalizer's backward pass need not repeat the upward
    # pass; None otherwise. The tables live as long as the parts do.
    marginals: Callable[[], torch.Tensor] | None = None


def _tilted(logits: torch.Tensor, tilt: torch.Tensor) -> torch.Tensor:
    """``x = logits + tilt`` in float64 (``-inf`` stays ``-inf``)."""
    return logits.detach().to(torch.float64) + tilt[..., None]


def _positive_part_sum(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(min=0.0).sum(-1)


def log_normalizer_value(logits: torch.Tensor, k: torch.Tensor, parts: NormalizerParts):
    """``log e_k(exp logits)`` in float64 from its parts."""
    x = _tilted(logits, parts.tilt)
    return parts.log_reduced + _positive_part_sum(x) - k.to(torch.float64) * parts.tilt


def log_prob_value(logits: torch.Tensor, parts: NormalizerParts, value: torch.Tensor):
    """``logits . z - log e_k(exp logits)`` for k-hot ``z`` (float64, no gradient), as
    ``sum_i (x_i z_i - max(x_i, 0)) - log_reduced``: every term is 0 or has the sign of the
    penalty it stands for, so nothing cancels."""
    x = _tilted(logits, parts.tilt)
    z = value.detach().to(torch.float64)
    terms = torch.where(x > -torch.inf, x * z - x.clamp(min=0.0), 0.0)
    return terms.sum(-1) - parts.log_reduced


def cross_entropy_value(
    logits: torch.Tensor, parts: NormalizerParts, mu: torch.Tensor, mu_complement: torch.Tensor
) -> torch.Tensor:
    """``-E[log q(z)]`` for q the distribution of ``logits`` (with ``parts``) and z with
    marginals ``mu`` (``mu_complement = 1 - mu``, computed without rounding): with x the
    tilted logits of q, ``log_reduced + sum_i max(x_i, 0) (1 - mu_i) + max(-x_i, 0) mu_i``,
    a sum of non-negative terms after ``log_reduced``. With q the distribution of ``mu``
    itself this is its entropy. float64, no gradient."""
    x = _tilted(logits, parts.tilt)
    mu, mu_complement = (t.detach().to(torch.float64) for t in (mu, mu_complement))
    terms = x.clamp(min=0.0) * mu_complement + (-x).clamp(min=0.0) * mu
    return torch.where(x > -torch.inf, terms, 0.0).sum(-1) + parts.log_reduced


def log_constraint_prob_value(logits: torch.Tensor, k: torch.Tensor, parts: NormalizerParts):
    """``log P(sum z = k)`` for independent ``z_i ~ Bernoulli(sigmoid(logits_i))`` (float64,
    no gradient), without the cancellation of ``log e_k - sum softplus(logits)``. With
    ``softplus(w) = max(w, 0) + log1p(exp(-|w|))`` and ``x = logits + c``,

        log P = log_reduced + sum_i [max(x_i, 0) - max(logits_i, 0)] - k c
                - sum_i log1p(exp(-|logits_i|)),

    and the middle sum is ``c (P - k) + sum logits_i [x_i >= 0 > logits_i]
    - sum logits_i [logits_i >= 0 > x_i]``, P the number of non-negative ``x_i``: an
    integer multiple of c plus logits that change sides under the tilt. No term is formed
    as ``logits + c``, whose rounding would be relative to c, and the large terms are as
    large as the answer (each side-changing variable costs about its own logit)."""
    theta = logits.detach().to(torch.float64)
    x = theta + parts.tilt[..., None]
    finite = theta > -torch.inf
    x_on, theta_on = (x >= 0) & finite, (theta >= 0) & finite
    shift = parts.tilt * (x_on.sum(-1) - k) + torch.where(x_on & ~theta_on, theta, 0.0).sum(-1)
    shift = shift - torch.where(theta_on & ~x_on, theta, 0.0).sum(-1)
    tails = torch.where(finite, torch.log1p(torch.exp(-theta.abs())), 0.0).sum(-1)
    return parts.log_reduced + shift - tails
