"""``ConditionedPoisson``'s numerics in torch: the probabilities ``p = rate / sum(rate)`` in
log space, Loader's saddle-point forms of Poisson log-probabilities
(`constrained_ppl.stirling`), the log-factorials of ``log_prob`` and the relative entropy
of KL. Everything here is branch-free in the rates (``torch.where``), so that it replays
correctly under ``torch.jit.trace``."""

from __future__ import annotations

import math

import torch

from constrained_ppl.conditioned_poisson import (
    KL_SERIES,
    KL_SERIES_MAX_D,
    UNDERFLOW_MARGIN,
    finite_log_zero,
    mode_candidate_slots,
)
from constrained_ppl.stirling import (
    BD0_SERIES_MAX_V,
    BD0_SERIES_TERMS,
    LOG_SQRT_2PI,
    STIRLING_ERROR_TABLE,
    STIRLING_SERIES,
    STIRLING_TABLE_MAX,
)
from pyro_constrained._conditioned_poisson_tracing import static_under_trace


def _finite_log_zero(dtype: torch.dtype) -> float:
    """`constrained_ppl.conditioned_poisson.finite_log_zero` for ``dtype``."""
    return finite_log_zero(torch.finfo(dtype).min)


def _normalized_log_probs(rate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p`` and ``log(1 - p)`` for ``p = rate / sum(rate)``, in float64.

    In log space relative to the largest rate, so that no sum of rates overflows (float32
    rates near 1e38) and no ratio underflows (1e-30 beside 1e30): with ``S`` the sum of
    the other rates over the largest, ``log p = log(rate / max) - log(1 + S)``, and
    ``1 - p`` is ``S / (1 + S)`` for the largest rate, exact where ``S`` is tiny, and
    ``log1p(-p)`` with ``p <= 1/2`` for every other. A single category has ``p = 1`` and
    ``log(1 - p) = -inf``.
    """
    log_rate = rate.to(torch.float64).log()
    with static_under_trace():  # a size
        single_category = bool(rate.shape[-1] == 1)
    if single_category:
        # 0 with a zero gradient, not a constant: rsample and entropy stay differentiable.
        return log_rate * 0.0, torch.full_like(log_rate, -math.inf)
    log_max, argmax = log_rate.max(-1, keepdim=True)
    shifted = log_rate - log_max
    # A comparison, not an in-place scatter_: this runs in log_prob and rsample under
    # torch.jit.trace (JitTrace_ELBO), which cannot record scatter_ with a bool.
    is_max = torch.arange(shifted.shape[-1], device=shifted.device) == argmax
    log_rest = torch.logsumexp(shifted.masked_fill(is_max, -math.inf), -1, keepdim=True)
    log1p_rest = torch.logaddexp(log_rest, torch.zeros_like(log_rest))
    log_p = shifted - log1p_rest
    # masked_fill, not where alone: log1p(-1) at the largest p would make a NaN gradient.
    log1m_p_others = torch.log1p(-log_p.masked_fill(is_max, -1.0).exp())
    log1m_p = torch.where(is_max, log_rest - log1p_rest, log1m_p_others)
    return log_p, log1m_p


def _log_probs_only(rate: torch.Tensor) -> torch.Tensor:
    """``log p`` for ``p = rate / sum(rate)`` in float64, as `_normalized_log_probs` gives it
    but in one logarithm pass (what ``log_prob``, ``mean`` and KL need).

    ``log p = log rate - log max - log(1 + S)`` with ``S`` the sum of the other rates over
    the largest, summed without the 1 (which would round a tiny ``S`` away); ratios below
    1e-308 of the largest, which vanish from it, change ``log(1 + S)`` by less than float64
    resolves. One form for every rate, no branch on their values (``torch.jit.trace``).
    """
    rate = rate.to(torch.float64)
    # One largest rate, by index: ties stay in S, so every rate keeps its gradient.
    largest, argmax = rate.max(-1, keepdim=True)
    # A comparison, not an in-place scatter_ (torch.jit.trace, see _normalized_log_probs).
    is_top = torch.arange(rate.shape[-1], device=rate.device) == argmax
    rest = torch.where(is_top, 0.0, rate / largest).sum(-1, keepdim=True)
    # log(rate / largest) exactly 0 for the largest (whose log p is then -log(1 + S)), even
    # where the vectorised log of rate and the log of largest round differently.
    log_ratio = torch.where(is_top, 0.0, rate.log() - largest.log())
    return log_ratio - torch.log1p(rest)


def _probs_only(rate: torch.Tensor) -> torch.Tensor:
    """``p = rate / sum(rate)`` in float64, as ``(rate / max) / sum(rate / max)``: no sum
    overflows, and no logarithm is needed (``mean``, ``probs``)."""
    ratio = rate.to(torch.float64)
    ratio = ratio / ratio.amax(-1, keepdim=True)
    return ratio / ratio.sum(-1, keepdim=True)


# Loader's saddle-point forms (constrained_ppl.stirling): Poisson log-probabilities from small
# pieces, so that nothing of the size of log k! is subtracted and a rate sum that overflows
# gives -inf, not inf - inf.


def _stirling_error(z: torch.Tensor) -> torch.Tensor:
    """``log z! - (z log z - z + log sqrt(2 pi z))`` for integers ``z >= 1`` (a placeholder 0
    at ``z = 0``), in ``z``'s float dtype: tabulated up to `STIRLING_TABLE_MAX`, else the
    asymptotic series (Horner in ``1 / z^2``)."""
    with static_under_trace():  # a constant of the trace
        table = torch.tensor(STIRLING_ERROR_TABLE, dtype=z.dtype, device=z.device)
    small = table[z.clamp(0, STIRLING_TABLE_MAX).long()]
    large = z.clamp(min=STIRLING_TABLE_MAX + 1.0)
    inverse_square = 1.0 / (large * large)
    series = torch.full_like(z, STIRLING_SERIES[-1])
    for coefficient in reversed(STIRLING_SERIES[:-1]):
        series = coefficient + inverse_square * series
    return torch.where(z <= STIRLING_TABLE_MAX, small, series / large)


def _bd0(x: torch.Tensor, m: torch.Tensor, log_m: torch.Tensor) -> torch.Tensor:
    """``x log(x / m) + m - x >= 0`` for ``x >= 1`` and ``m > 0`` (``log_m = log m``, used where
    ``m`` underflows), without cancellation: the series in ``v = (x - m) / (x + m)`` where
    ``|v|`` is small, else directly (``inf`` where ``m`` is)."""
    finite = torch.isfinite(m)
    m_safe = torch.where(finite, m, x)
    difference = x - m_safe
    v = difference / (x + m_safe)
    v2 = v * v
    odd = torch.full_like(v, 1.0 / (2 * BD0_SERIES_TERMS + 1))
    for j in range(BD0_SERIES_TERMS - 1, 0, -1):
        odd = 1.0 / (2 * j + 1) + v2 * odd
    series = difference * v + 2.0 * x * v * v2 * odd
    # log(x / m), exact near x = m, where m >= 1; below, log x - log m, two terms of one sign
    # (no cancellation), whose derivative 1 / m stays finite where the ratio's x / m^2
    # overflows (rates that underflow beside others).
    ratio_form = m_safe >= 1.0
    log_ratio = torch.where(
        ratio_form, torch.log(x / torch.where(ratio_form, m_safe, 1.0)), torch.log(x) - log_m
    )
    direct = x * log_ratio + m_safe - x
    value = torch.where(v.abs() < BD0_SERIES_MAX_V, series, direct)
    return torch.where(finite, value, math.inf)


def _log_poisson(z: torch.Tensor, m: torch.Tensor, log_m: torch.Tensor) -> torch.Tensor:
    """``log Poisson(z; m)`` for integers ``z >= 0``: ``-m`` at ``z = 0``, else
    ``-log sqrt(2 pi z) - stirling_error(z) - bd0(z, m)``."""
    z_safe = z.clamp(min=1.0)
    positive = -(LOG_SQRT_2PI + 0.5 * torch.log(z_safe) + _stirling_error(z_safe))
    positive = positive - _bd0(z_safe, m, log_m)
    return torch.where(z >= 1, positive, -m)


def _log_poisson_of_total(rate: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``log Poisson(k; sum(rate))`` in float64 without cancellation; the sum as
    ``max * sum(rate / max)`` (``inf`` only where the true sum overflows, where the result,
    about ``-sum(rate)``, is ``-inf``)."""
    rate = rate.to(torch.float64)
    largest = rate.amax(-1)
    ratio_sum = (rate / largest.unsqueeze(-1)).sum(-1)
    total = largest * ratio_sum
    log_total = largest.log() + ratio_sum.log()
    total, log_total, k = torch.broadcast_tensors(total, log_total, k.to(torch.float64))
    return _log_poisson(k, total, log_total)


def _relative_entropy(rate_p: torch.Tensor, rate_q: torch.Tensor) -> torch.Tensor:
    """``sum_i p_i log(p_i / q_i)`` for ``p = rate_p / sum(rate_p)``, ``q`` likewise, in
    float64, as ``sum_i q_i f(d_i)`` with ``d_i = log(p_i / q_i)`` and
    ``f(d) = (d - 1) e^d + 1 >= 0`` (``sum p = sum q = 1``): every term is non-negative, so
    the sum is, and nothing cancels between terms.

    Where the two are close, ``d_i`` comes from the rates' differences, which are exact (both
    scaled by one power of two; Sterbenz): ``p_i / q_i = 1 + (D_i B - b_i D) / (b_i A)`` with
    ``a, b`` the scaled rates, ``A, B`` their sums, ``D_i = a_i - b_i`` and ``D = sum D_i``,
    so a KL of 1e-14 keeps the working precision instead of the ``|log p|`` ulps of a
    difference of logarithms; ``f`` is a series in ``d`` for ``|d| < 1/2``. Elsewhere (far
    apart, ``|d| >= 1/2`` by the logarithms, where ``D_i B - b_i D`` would cancel, or rates
    whose scaled values underflow) ``d`` is the difference of the logarithms and
    ``q f(d) = p (d - 1) + q``."""
    rate_p, rate_q = torch.broadcast_tensors(rate_p.to(torch.float64), rate_q.to(torch.float64))
    log_p = _log_probs_only(rate_p)
    log_q = _log_probs_only(rate_q)
    largest = torch.maximum(rate_p.amax(-1, keepdim=True), rate_q.amax(-1, keepdim=True))
    _, exponent = torch.frexp(largest.detach())
    scale = torch.ldexp(torch.ones_like(largest), -exponent)
    a = rate_p * scale
    b = rate_q * scale
    total_a = a.sum(-1, keepdim=True)
    total_b = b.sum(-1, keepdim=True)
    difference = a - b
    numerator = difference * total_b - b * difference.sum(-1, keepdim=True)
    # Above sqrt(tiny): the derivative of the ratio below divides by the square of b.
    resolvable = math.sqrt(torch.finfo(torch.float64).tiny) * UNDERFLOW_MARGIN
    # Only where the two are close: far apart, D_i B - b_i D cancels (rates 1 beside 1e10),
    # and the difference of the logarithms, at least 1/2, is accurate.
    log_difference = log_p - log_q
    close = log_difference.detach().abs() < KL_SERIES_MAX_D
    precise = close & (a > resolvable) & (b > resolvable)
    denominator = torch.where(precise, b * total_a, 1.0)
    ratio_minus_one = torch.where(precise, numerator / denominator, 0.0)
    d = torch.where(precise, torch.log1p(ratio_minus_one), log_difference)
    small = d.abs() < KL_SERIES_MAX_D
    d_small = torch.where(small, d, 0.0)
    series = torch.full_like(d, KL_SERIES[-1])
    for coefficient in reversed(KL_SERIES[:-1]):
        series = coefficient + d_small * series
    q_prob = log_q.exp()
    near = q_prob * (d_small * d_small * series)
    far = log_p.exp() * (torch.where(small, 1.0, d) - 1.0) + q_prob
    return torch.where(small, near, far).clamp(min=0.0).sum(-1)


class _LogFactorialOfCounts(torch.autograd.Function):
    """``log z! = lgamma(z + 1)`` for integer ``0 <= z <= len(table) - 1`` by table lookup,
    with the exact derivative ``digamma(z + 1)``: a lookup alone (``table[z.long()]``)
    would silently cut the gradient with respect to ``z``. Written for ``torch.func`` as
    well (a separate ``setup_context``, a generated vmap rule and a ``jvp``); the
    derivative is built from differentiable operations, so it differentiates again."""

    generate_vmap_rule = True

    @staticmethod
    def forward(counts: torch.Tensor, log_factorials: torch.Tensor) -> torch.Tensor:
        # The caller guarantees 0 <= z <= len(table) - 1 (off-support rows are zeroed).
        return log_factorials[counts.long()]

    @staticmethod
    def setup_context(ctx, inputs, output):
        counts, _ = inputs
        ctx.save_for_backward(counts)
        ctx.save_for_forward(counts)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (counts,) = ctx.saved_tensors
        return grad_output * torch.digamma(counts + 1), None

    @staticmethod
    def jvp(ctx, counts_dot: torch.Tensor, _table_dot) -> torch.Tensor:
        (counts,) = ctx.saved_tensors
        return counts_dot * torch.digamma(counts + 1)


def _log_factorial_of_counts(counts: torch.Tensor, k_max: int) -> torch.Tensor:
    """``log z!`` for integer counts ``z`` in ``0..k_max`` (``log_prob`` zeroes the rows off
    the support before calling this): a table lookup when the table is smaller than the
    input, else ``lgamma``; differentiable in ``z`` either way."""
    with static_under_trace():  # sizes and the static bound
        small_table = bool(k_max + 1 < counts.numel())
    if not small_table:
        return torch.lgamma(counts + 1)
    table = torch.lgamma(torch.arange(k_max + 1, dtype=counts.dtype, device=counts.device) + 1)
    return _LogFactorialOfCounts.apply(counts, table)


def _mode_counts(log_p: torch.Tensor, k: torch.Tensor, k_bound: int) -> torch.Tensor:
    """A most likely composition of ``k`` (long, ``0 <= k <= k_bound``, shape ``batch``)
    for ``Multinomial(k, p)``, ``log_p`` in float64 (shape ``batch + (n,)``), as float64
    counts; with no loop and no decision on values (``torch.jit.trace``,
    ``torch.func.vmap``).

    The log-pmf is separable and concave in the counts, so a mode is a lower bound ``L`` on
    it plus the ``r = k - sum L`` further units of largest gain ``log p_i - log(z + 1)``,
    each coordinate's gains decreasing in ``z``: the units that handing them out one at a
    time to the largest gain would give, taken at once. ``L = floor(k p (1 - (n + 8) eps))``
    is at most the lower quota ``floor(k p / sum p)`` of every mode (the shrink covers the
    rounding of ``p`` and of the product, so ``sum L <= k``). A mode is at most
    ``(k + n) p_i / sum p`` entrywise (moving one unit cannot raise the pmf), so
    coordinate i has ``floor(p_i (n + 2 (n + 8) eps k) (1 + 2**-20)) + 1`` candidate units,
    a static number (from ``n`` and ``k_bound``) in all. The candidates are sorted stably
    by ``log(z + 1) - log p_i`` (the negated gain, as a greedy compares it) and the first
    ``r`` kept: candidates of equal gain stay in index order, so ties go to the lower
    index."""
    n = log_p.shape[-1]
    eps = torch.finfo(torch.float64).eps
    k = k.to(torch.float64)
    p = log_p.exp()
    lower = torch.floor(k[..., None] * p * (1 - (n + 8) * eps)).clamp(min=0)
    lower = torch.minimum(lower, k[..., None])
    remaining = (k - lower.sum(-1)).clamp(min=0)
    spread = n + 2 * (n + 8) * eps * k[..., None]
    width = (torch.floor(p * spread * (1 + 2.0**-20)) + 1).long()
    with static_under_trace():  # sizes and a static bound
        slots = mode_candidate_slots(n, k_bound, eps)
    ends = width.cumsum(-1)
    slot = torch.arange(slots, device=log_p.device).expand(log_p.shape[:-1] + (slots,))
    # contiguous: searchsorted would copy it, with a warning.
    owner = torch.searchsorted(ends, slot.contiguous(), right=True)
    valid = owner < n
    # Both bounds: under torch.jit.trace n is a CPU tensor, which as clamp's only bound
    # would be a tensor operand that a CUDA owner refuses; with two it is a Scalar.
    owner = owner.clamp(0, n - 1)
    # The count before the unit: the owner's lower bound plus the unit's place in its run.
    place = slot - (ends - width).gather(-1, owner)
    before = lower.gather(-1, owner) + place.to(torch.float64)
    key = torch.where(valid, torch.log1p(before) - log_p.gather(-1, owner), math.inf)
    order = torch.sort(key, dim=-1, stable=True).indices
    kept = (torch.arange(slots, device=log_p.device) < remaining[..., None]).to(torch.float64)
    return lower.scatter_add(-1, owner.gather(-1, order), kept)
