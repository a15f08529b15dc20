"""ExactlyKBernoulli's formulas around the kernels (Pyro): exact values carrying their
formulas' gradients, the one-sided derivatives at probs of exactly 0 and 1, and the KL
(registered by :mod:`pyro_constrained.exactly_k_bernoulli`)."""

from contextlib import nullcontext
from typing import NamedTuple

import torch

from pyro_constrained import exactly_k_kernels as kernels
from pyro_constrained.exactly_k_tracing import static_under_trace


def _softplus(x: torch.Tensor) -> torch.Tensor:
    # F.softplus is the identity above a threshold (20 by default): off by up to 2e-9, not
    # float64-exact. relu(x) + log1p(exp(-|x|)) is exact but its autograd derivative is
    # wrong at x = 0 (the kinks of relu and |x| do not cancel there). logaddexp is exact,
    # and its derivatives are right for the finite inputs it gets here.
    return torch.logaddexp(x, torch.zeros_like(x))


def _value_with_gradient_of(value: torch.Tensor, formula: torch.Tensor) -> torch.Tensor:
    """``value`` (computed accurately, without gradient) carrying the gradient of
    ``formula``, an expression equal to it in exact arithmetic but with rounding error in
    floating point; where the formula is not finite, ``value`` alone."""
    difference = formula - formula.detach()
    return value + torch.where(torch.isfinite(formula), difference, 0.0)


class _OddsTangents(NamedTuple):
    """Terms that give the derivatives in ``probs`` at exact 0 and 1, where the logits are
    infinite and the chain rule through them would be ``0 * inf``. Every quantity is a
    rational function of the odds ``w_i = p_i / (1 - p_i)`` near ``w_i = 0`` (and of
    ``v_i = 1 / w_i`` near ``p_i = 1``). With ``Z`` the normaliser over the free variables
    (``k_free`` ones among them) and ``r_m = e_{k_free + m} / e_{k_free}`` (0 where the count
    is out of range),

        Z_all / Z = 1 + r_-1 sum w + r_+1 sum v + r_-2 e_2(w) + r_+2 e_2(v) + sum w sum v
                    + (terms of third order in w, v),

    and the marginals are the derivatives of ``log`` of that sum (see ``odds_tangents``,
    which builds them): values 0 at the point, first and second derivatives the one-sided
    ones. The fields are zero-valued tensors carrying these derivatives (their coefficients
    held to the dtype's finite range, so that a value is never ``0 * inf``)."""

    log_normalizer: torch.Tensor
    marginals: torch.Tensor
    # The constraint probability's extra term: d(-sum softplus) over the forced variables.
    softplus: torch.Tensor
    # Per variable: +1 where p = 0 and the variable could be switched on (r_- > 0), -1
    # where p = 1 and it could be switched off (r_+ > 0), else 0: the entropy's one-sided
    # derivative there is this sign times infinity (a -w log w term, as for a Bernoulli),
    # given as the dtype's largest finite number (see _infinite_slope).
    unbounded: torch.Tensor
    probs: torch.Tensor


def odds_tangents(probs, ratios, neighbours, mu, infeasible) -> _OddsTangents:
    """The ``_OddsTangents`` of a normaliser over the free variables whose neighbours, one
    or two more ones among the variables at ``probs`` of exactly 0 (or fewer at 1), have
    the ratios ``ratios[step]`` (shape ``batch``; ``step`` the change of the free
    variables' count: -1 and -2 for one and two variables at 0 switched on, +1 and +2 for
    variables at 1 switched off; 0 where impossible, at most the dtype's largest number)
    and the marginals ``neighbours[step]``; ``mu`` the marginals at the point.
    ``ExactlyKBernoulli`` (one count: ``e_{k + step} / e_k``) and
    ``CountConstrainedBernoulli`` (a range of counts: the range's sums shifted by ``step``)
    share it. With the odds ``w`` (at 0s) and ``v = 1 / w`` (at 1s) as real functions of
    the probs, ``Z_all / Z = 1 + ratio`` to second order, and the marginals are its
    derivatives: ``mu_j += d ratio / d theta_j / (1 + ratio)`` for a free j (``d r_s /
    d theta_j = r_s (M_s,j - mu_j)``), ``w_i d log(1 + ratio) / d w_i`` at a 0 and ``1 -
    v_i d log(1 + ratio) / d v_i`` at a 1: values, first and second derivatives (Hessians
    in the probs) are the one-sided ones."""
    off, on = probs == 0, probs == 1
    largest = torch.finfo(probs.dtype).max
    direction = torch.where(off & (ratios[-1][..., None] > 0), 1.0, 0.0)
    direction = torch.where(on & (ratios[1][..., None] > 0), -1.0, direction).to(probs.dtype)
    # The odds as real functions of the probs (0 at the point).
    at_zero = torch.where(off, probs, 0.0)
    at_one = torch.where(on, probs, 1.0)
    w, v = at_zero / (1 - at_zero), (1 - at_one) / at_one
    sum_w, sum_v = w.sum(-1), v.sum(-1)
    pairs_w = (sum_w**2 - (w**2).sum(-1)) / 2
    pairs_v = (sum_v**2 - (v**2).sum(-1)) / 2
    coefficients = {-1: sum_w, 1: sum_v, -2: pairs_w, 2: pairs_v}
    ratio = sum(ratios[step] * coefficients[step] for step in coefficients)
    ratio = torch.where(infeasible, 0.0, ratio + sum_w * sum_v)
    scale = (1 + ratio)[..., None]
    change = sum(
        coefficients[step][..., None]
        * torch.nan_to_num(
            ratios[step][..., None] * (neighbours[step] - mu), 0.0, largest, -largest
        )
        for step in coefficients
    )
    r = {step: ratios[step][..., None] for step in coefficients}
    at_off = w * (r[-1] + r[-2] * (sum_w[..., None] - w) + sum_v[..., None])
    at_on = -v * (r[1] + r[2] * (sum_v[..., None] - v) + sum_w[..., None])
    marginals = torch.where(off, at_off, torch.where(on, at_on, change)) / scale
    softplus = (torch.log1p(-at_zero) + torch.log(at_one)).sum(-1)
    return _OddsTangents(torch.log1p(ratio), marginals, softplus, direction, probs)


def _infinite_slope(probs: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """Zero (shape ``batch``) whose derivative in ``probs`` is ``direction`` times the
    dtype's largest finite number, standing for an infinite one-sided derivative: a true
    infinity would turn a zero incoming gradient into NaN."""
    largest = torch.finfo(probs.dtype).max
    return ((probs - probs.detach()) * (direction * largest)).sum(-1)


def _centred(logits: torch.Tensor, finite: torch.Tensor, tilt: torch.Tensor) -> torch.Tensor:
    """The finite logits plus the tilt (0 elsewhere). In a formula used for its gradient
    only (``theta . mu``, with ``sum mu = k`` fixed), adding a constant per row changes
    nothing in exact arithmetic; in floating point it keeps the products ``theta_j
    d mu_j`` as small as the tilted logits, where a shared offset (every logit near 1e6)
    would make them cancel to a fraction of the offset's rounding."""
    shifted = logits + tilt.to(logits.dtype)[..., None]
    return torch.where(finite, shifted, torch.zeros_like(shifted))


def _kl_exactly_k_bernoulli(p, q) -> torch.Tensor:
    """``KL(p || q) = mu_p . (theta_p - theta_q) - log e_k(p) + log e_k(q)`` over finite
    logits; ``+inf`` where p puts mass on a vector that q forbids. Evaluated as the
    difference of two cross-entropies of the tilted logits (``kernels.cross_entropy_value``),
    exactly 0 for p = q and exact for logits of any size; the gradient is the formula's."""
    with static_under_trace():  # sizes, which a trace fixes
        same_n = p.event_shape == q.event_shape
    if not same_n:
        raise ValueError(f"KL needs the same n, got {p.event_shape[0]} and {q.event_shape[0]}")
    constant_k = p._k_is_constant and q._k_is_constant
    with static_under_trace() if constant_k else nullcontext():
        same_k = torch.equal(*torch.broadcast_tensors(p.k, q.k))
    if not same_k:
        raise ValueError("KL between ExactlyKBernoulli needs the same k")
    mu, complement = p._marginal_pair
    cross = kernels.cross_entropy_value(q._kernel_logits, q._normalizer_parts, mu, complement)
    own = kernels.cross_entropy_value(p._kernel_logits, p._normalizer_parts, mu, complement)
    exact = torch.where(p._deterministic & q._deterministic, 0.0, cross - own)
    p_centred = _centred(p.logits, p._finite, p._normalizer_parts.tilt)
    q_centred = _centred(q.logits, q._finite, q._normalizer_parts.tilt)
    formula = (mu * p_centred).sum(-1) - (mu * q_centred).sum(-1)
    formula = formula - p._log_normalizer + q._log_normalizer
    if p._odds_tangents is not None:
        # -H(p)'s infinite slope, or +inf where q has the same infinite logit (moving p's
        # mass onto a vector q forbids makes the KL infinite).
        same = torch.where(q.logits == p.logits, -1.0, 1.0).to(p.logits.dtype)
        direction = -p._odds_tangents.unbounded * same
        formula = formula + _infinite_slope(p._odds_tangents.probs, direction)
    kl = _value_with_gradient_of(exact.to(formula.dtype), formula)
    forbidden = q.logits == -torch.inf
    required = q._forced_on
    escapes = ((mu > 0) & forbidden).any(-1) | ((mu < 1) & required).any(-1)
    kl = torch.where(escapes, torch.inf, kl)
    return torch.where(p._infeasible | q._infeasible, torch.nan, kl)
