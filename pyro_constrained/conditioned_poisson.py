"""Independent Poissons conditioned on their sum: ``ConditionedPoisson(rate, k=k)``.

``z_i ~ Poisson(rate_i)`` independently, conditioned on ``sum_i z_i = k``, is
``Multinomial(k, p)`` with ``p = rate / sum(rate)`` (docs/distributions/conditioned_poisson.md).
Unlike ``torch.distributions.Multinomial``, ``k`` may vary over the batch (bags with different known
totals), the support check demands ``sum z == k`` exactly, ``rsample`` carries the straight-through
marginal-expectation gradient, and the entropy is exact and fast.
"""

from __future__ import annotations

import math

import torch
from pyro.distributions import Binomial, TorchDistribution
from torch.distributions import constraints
from torch.distributions.kl import register_kl

from constrained_ppl.arguments import (
    DISCRETE_GRAD_ESTIMATORS,
    check_count,
    check_grad_estimator,
    check_static_bound,
    check_value_shape,
    keyword_only,
)
from constrained_ppl.binomial_tails import bennett_deviation, entropy_log_inverse_tail
from constrained_ppl.enumeration import check_support_size, compositions, single_count
from constrained_ppl.exact_integers import (
    check_k_max_bounds_k,
    check_total_in_exact_range,
    largest_exact_integer,
)
from constrained_ppl.stirling import (
    BD0_SERIES_MAX_V,
    BD0_SERIES_TERMS,
    LOG_SQRT_2PI,
    STIRLING_ERROR_TABLE,
    STIRLING_SERIES,
    STIRLING_TABLE_MAX,
)
from pyro_constrained._repr import parameters_repr

__all__ = ["ConditionedPoisson", "integer_composition", "positive_finite"]

# Draw categorical indices (O(k log n) per event) unless k is this many times larger than n,
# where n sequential binomial draws (O(n) per event) are cheaper.
SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY = 32

_EMPTY_SIZE = torch.Size()


class _PositiveFinite(constraints.Constraint):
    """Real numbers in (0, inf): ``constraints.positive`` lets ``inf`` through."""

    def check(self, value: torch.Tensor) -> torch.Tensor:
        return (value > 0) & torch.isfinite(value)

    def __repr__(self) -> str:
        return "PositiveFinite()"


positive_finite = _PositiveFinite()


class _IntegerComposition(constraints.Constraint):
    """Integer vectors ``z >= 0`` (last dimension) with ``sum(z) == total`` exactly.

    ``torch.distributions.constraints.multinomial`` only checks ``sum(z) <= total``.
    """

    is_discrete = True
    event_dim = 1

    def __init__(self, total: torch.Tensor | int) -> None:
        self.total = total
        super().__init__()

    def check(self, value: torch.Tensor) -> torch.Tensor:
        return _is_integer_composition(value, self.total)[0]

    def __repr__(self) -> str:
        return f"IntegerComposition(total={self.total})"


integer_composition = _IntegerComposition


def _is_integer_composition(
    value: torch.Tensor, total: torch.Tensor | int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each vector (last dimension) of ``value`` is in the support, and whether all
    its entries are ``>= 0``.

    Exact for any dtype of ``value``: a float sum that rounds (``2**24 - 1 + 1 + 1`` is
    ``2**24`` in float32) cannot pass for ``total``. Floats are summed as they are where
    ``total`` is below ``2**m`` (``m`` their significand bits), else, like integers,
    checked to lie in ``[0, total]`` and summed as int64.
    """
    total = torch.as_tensor(total, device=value.device)
    is_nonnegative = value >= 0
    entry_ok = is_nonnegative
    if value.is_floating_point():
        # frac is NaN for +-inf and NaN, which then fail the test.
        entry_ok = entry_ok & (torch.frac(value) == 0)
        largest_total = int(total.max()) if total.numel() else 0
        if largest_total < largest_exact_integer(str(value.dtype)):
            # Non-negative integers with a true sum up to 2**m are summed exactly in any
            # order; a larger true sum rounds to at least 2**m > total. So the float sum
            # tells exactly whether the sum is total.
            in_support = entry_ok.all(-1) & (value.sum(-1) == total)
            return in_support, is_nonnegative.all(-1)
    entry_ok = entry_ok & (value <= total.unsqueeze(-1))
    # Entries in [0, total], total <= 2**53: the cast is exact and the int64 sum cannot
    # overflow below 1024 entries; beyond, a sum that wrapped is far above total as a float.
    counts = torch.where(entry_ok, value, 0)
    in_support = entry_ok.all(-1) & (counts.long().sum(-1) == total.long())
    if value.shape[-1] >= 1024:
        in_support &= counts.double().sum(-1) <= 2 * total.double() + 1
    return in_support, is_nonnegative.all(-1)


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
    if rate.shape[-1] == 1:
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
    the largest, summed directly (ratios below 1e-308 of the largest, which vanish from
    it, change ``log(1 + S)`` by less than float64 resolves).
    """
    rate = rate.to(torch.float64)
    largest = rate.amax(-1, keepdim=True)
    ratio = rate / largest
    total = ratio.sum(-1, keepdim=True)
    if bool((total >= 1.5).all()):
        # No rate dominates (p <= 2/3, |log p| >= 0.4): log(1 + S) directly loses nothing,
        # and one subtraction of log(max) + log(1 + S) keeps log p's relative accuracy.
        return rate.log() - (largest.log() + total.log())
    # 1 + S rounds S away when S is tiny: sum S without the 1. One largest rate, by index:
    # ties stay in S, so every rate keeps its gradient.
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
    tiny = torch.finfo(x.dtype).tiny * 2.0**30
    finite = torch.isfinite(m)
    m_safe = torch.where(finite, m, x)
    difference = x - m_safe
    v = difference / (x + m_safe)
    v2 = v * v
    odd = torch.full_like(v, 1.0 / (2 * BD0_SERIES_TERMS + 1))
    for j in range(BD0_SERIES_TERMS - 1, 0, -1):
        odd = 1.0 / (2 * j + 1) + v2 * odd
    series = difference * v + 2.0 * x * v * v2 * odd
    normal = m_safe > tiny
    log_ratio = torch.where(
        normal, torch.log(x / torch.where(normal, m_safe, 1.0)), torch.log(x) - log_m
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


# sum_{m >= 2} (m - 1) / m! d^(m - 2), the series of ((d - 1) e^d + 1) / d^2, to the term whose
# contribution at |d| = 1/2 is below 1e-18 of the sum.
_KL_SERIES = tuple((m - 1) / math.factorial(m) for m in range(2, 20))
# Below this |log(p_i / q_i)| the series; above it (d - 1) p/q + 1 cancels by at most 8x.
_KL_SERIES_MAX_D = 0.5


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
    resolvable = torch.finfo(torch.float64).tiny * 2.0**30
    # Only where the two are close: far apart, D_i B - b_i D cancels (rates 1 beside 1e10),
    # and the difference of the logarithms, at least 1/2, is accurate.
    log_difference = log_p - log_q
    close = log_difference.detach().abs() < _KL_SERIES_MAX_D
    precise = close & (a > resolvable) & (b > resolvable)
    denominator = torch.where(precise, b * total_a, 1.0)
    ratio_minus_one = torch.where(precise, numerator / denominator, 0.0)
    d = torch.where(precise, torch.log1p(ratio_minus_one), log_difference)
    small = d.abs() < _KL_SERIES_MAX_D
    d_small = torch.where(small, d, 0.0)
    series = torch.full_like(d, _KL_SERIES[-1])
    for coefficient in reversed(_KL_SERIES[:-1]):
        series = coefficient + d_small * series
    q_prob = log_q.exp()
    near = q_prob * (d_small * d_small * series)
    far = log_p.exp() * (torch.where(small, 1.0, d) - 1.0) + q_prob
    return torch.where(small, near, far).clamp(min=0.0).sum(-1)


def _binomial_windows(
    mean: torch.Tensor, k: torch.Tensor, max_variance: float, log_inverse_tail: float
) -> tuple[torch.Tensor, int]:
    """First outcome and common width of a window of outcomes of each Binomial(k, p) count
    that holds all but ``2 exp(-log_inverse_tail)`` of its mass (Bennett's inequality).

    Every outcome ``j`` in ``[0, k]`` with ``|j - mean| <= t`` lies in
    ``[first, first + width - 1]``; ``t`` comes from the largest variance, which bounds
    every element's tails. ``mean`` and ``k`` (long) broadcast; the width is a Python int.
    """
    deviation = bennett_deviation(max_variance, log_inverse_tail)
    # +1: floor(mean) may be off by one from the exact floor through rounding.
    half_width = math.ceil(deviation) + 1
    floor_mean = mean.floor().long()
    first = (floor_mean - half_width).clamp(min=0)
    last = torch.minimum(floor_mean + half_width + 1, k)
    k_max = int(k.max()) if k.numel() else 0
    width = int((last - first).max()) + 1 if first.numel() else 1
    width = max(1, min(width, k_max + 1))
    # A window running past k moves left, so that it holds no outcome beyond k if it can.
    first = torch.minimum(first, (k + 1 - width).clamp(min=0))
    return first, width


def _finite_log_zero(dtype: torch.dtype) -> float:
    """A finite stand-in for ``log 0``: up to 1e8 times it, ``exp`` still underflows to 0, and
    unlike ``-inf`` it gives 0 (not NaN) times 0 and in gradients."""
    return torch.finfo(dtype).min / 1e8


def _expected_log_factorials(
    log_p: torch.Tensor, log1m_p: torch.Tensor, k: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``E[log z_i!]`` for ``z_i ~ Binomial(k, p_i)``, per coordinate, in float64, as the
    two terms ``log c!`` and ``E[log z!] - log c!`` (defined below).

    ``log_p`` and ``log1m_p`` (float64, from `_normalized_log_probs`, ``n >= 2``) have shape
    ``batch + (n,)``, ``k`` (long) ``batch``. Sums over the outcomes in `_binomial_windows`;
    the rest are dropped, see `entropy_log_inverse_tail` (at the machine epsilon of
    ``dtype``, the dtype of the O(n w) loop).

    Everything large is centred in float64 before that loop, so that float32 loses nothing
    at large k (``log k!`` is 1e6 at k = 1e5; its float32 rounding alone is 0.06 nats).
    With ``c = floor(k p)`` and ``j = c + t``::

        log Binomial(j; k, p) - log Binomial(c; k, p) = t delta - G[t],
        G[t] = log j! - log c! + log (k-j)! - log (k-c)! - t log((c + 1/2) / (k - c + 1/2)),
        delta = log(p / (1-p)) - log((c + 1/2) / (k - c + 1/2)),

    ``delta`` is O(1 / variance) and ``G`` about ``t^2 / (2 variance)``; and
    ``E[log z!] = log c! + (k p - c) log(c + 1) + E[D]`` with
    ``D[t] = log j! - log c! - t log(c + 1)``, about ``t^2 / (2c)`` and exactly 0 at the two
    outcomes ``c``, ``c + 1`` that can be the mode, so that a near-certain count (entropy
    1e-28, say) leaves nothing to cancel. ``G`` and ``D`` depend only on ``(k, c)``: few
    distinct pairs occur, so they are tabulated once per pair (in float64, then rounded to
    ``dtype``) and gathered as rows. Normalising the weights over the window makes
    ``log Binomial(c; k, p)`` unnecessary.
    """
    shape = log_p.shape
    n = shape[-1]
    accumulation = log_p.dtype
    device = log_p.device
    k_event = k.unsqueeze(-1).expand(shape)
    k_max = int(k.max()) if k.numel() else 0
    with torch.no_grad():
        mean = k_event.to(accumulation) * log_p.exp()
        variance = mean * log1m_p.exp()
        max_variance = float(variance.max()) if variance.numel() else 0.0
        log_inverse_tail = entropy_log_inverse_tail(n, k_max, torch.finfo(dtype).eps)
        first, width = _binomial_windows(mean, k_event, max_variance, log_inverse_tail)
        # k p <= k since p <= 1; the window holds c (see _binomial_windows).
        center = torch.minimum(mean.floor().long(), k_event)
        pair_key = k_event * (k_max + 1) + center
        unique_keys, row_of_coordinate = torch.unique(pair_key, return_inverse=True)
        rows = row_of_coordinate.reshape(-1)
        unique_k = unique_keys // (k_max + 1)
        unique_c = unique_keys % (k_max + 1)
        # Coordinates with the same (k, c) have the same window.
        unique_first = torch.zeros_like(unique_keys).scatter(0, rows, first.reshape(-1))
        j = unique_first.unsqueeze(-1) + torch.arange(width, device=device)
        in_range = j <= unique_k.unsqueeze(-1)
        j = torch.minimum(j, unique_k.unsqueeze(-1)).to(accumulation)
        k_rows = unique_k.to(accumulation).unsqueeze(-1)
        c_rows = unique_c.to(accumulation).unsqueeze(-1)
        t = j - c_rows
        log_c_factorial = torch.lgamma(c_rows + 1)
        log_j_over_c = torch.lgamma(j + 1) - log_c_factorial
        log_shift = torch.log1p(c_rows)
        odds_shift = torch.log(c_rows + 0.5) - torch.log(k_rows - c_rows + 0.5)
        g_rows = log_j_over_c + (torch.lgamma(k_rows - j + 1) - torch.lgamma(k_rows - c_rows + 1))
        # Outcomes beyond k get G = inf, hence weight 0.
        g_rows = torch.where(in_range, g_rows - t * odds_shift, math.inf).to(dtype)
        d_rows = torch.where(in_range, log_j_over_c - t * log_shift, 0.0).to(dtype)
        # index_select of whole rows is several times faster than advanced indexing.
        g = g_rows.index_select(0, rows).view(shape + (width,))
        d = d_rows.index_select(0, rows).view(shape + (width,))
        steps = torch.arange(width, dtype=dtype, device=device)
        center_step = (center - first).to(accumulation)
        center_float = center.to(accumulation)
        log_c_factorial = log_c_factorial.squeeze(-1)[row_of_coordinate]
        log_shift = log_shift.squeeze(-1)[row_of_coordinate]
        odds_shift = odds_shift.squeeze(-1)[row_of_coordinate]
    delta = log_p - log1m_p - odds_shift
    # t delta = s delta - (c - first) delta with s = j - first the shared step.
    log_weights = torch.addcmul(
        (-center_step * delta).to(dtype).unsqueeze(-1), steps, delta.to(dtype).unsqueeze(-1)
    )
    weights = (log_weights - g).exp()
    expected_d = torch.linalg.vecdot(weights, d) / weights.sum(-1)
    # k p - c without cancellation where p is near 1: (k - c) - k (1 - p) there.
    k_float = k_event.to(accumulation)
    mean_minus_center = torch.where(
        log_p > -math.log(2),
        (k_float - center_float) - k_float * log1m_p.exp(),
        k_float * log_p.exp() - center_float,
    )
    return log_c_factorial, mean_minus_center * log_shift + expected_d.to(accumulation)


def _sample_counts(rate: torch.Tensor, k: torch.Tensor, sample_shape: torch.Size) -> torch.Tensor:
    """Exact ``Multinomial(k, rate / sum(rate))`` counts of shape ``sample_shape + rate.shape``
    (``k`` is a long tensor of shape ``rate.shape[:-1]``), in ``rate``'s dtype."""
    batch_shape, n = rate.shape[:-1], rate.shape[-1]
    num_samples = sample_shape.numel()
    rate_rows = rate.reshape(-1, n)
    k_rows = k.reshape(-1)
    rows = rate_rows.shape[0]
    k_max = int(k_rows.max()) if rows else 0
    if rows == 0 or num_samples == 0 or k_max == 0:
        return rate.new_zeros(sample_shape + rate.shape)
    if k_max < SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY * n:
        # One multinomial call draws k_max categories for every (row, sample); the draws past
        # a row's own k are masked out, which keeps them exact for per-row k. The rates over
        # the largest, not the rates: their sum could overflow (float32 rates near 1e38). In
        # float64 whatever the rates' dtype: torch.multinomial accumulates its cumulative
        # distribution in the weights' dtype, and a float32 one rounds each small weight
        # after a large one to whole ulps of the running sum (3 * 2**-24 after 1 counted as
        # 2**-22, a third too much).
        weights = rate_rows.to(torch.float64)
        weights = weights / weights.amax(-1, keepdim=True)
        draws = torch.multinomial(weights, num_samples * k_max, replacement=True)
        draws = draws.view(rows, num_samples, k_max)
        if bool((k_rows == k_max).all()):
            weights = rate.new_ones(()).expand_as(draws)
        else:
            keep = torch.arange(k_max, device=rate.device) < k_rows.view(rows, 1, 1)
            weights = keep.to(rate.dtype).expand_as(draws)
        # Out of place, like everything sample runs: it runs under torch.jit.trace
        # (JitTrace_ELBO), whose graphs are only sound without in-place writes.
        counts = rate.new_zeros(rows, num_samples, n).scatter_add(-1, draws, weights)
    else:
        counts = _sample_counts_sequentially(_log_probs_only(rate_rows), k_rows, num_samples)
        counts = counts.to(rate.dtype)
    counts = counts.view(batch_shape + (num_samples, n)).movedim(-2, 0)
    return counts.reshape(sample_shape + rate.shape)


def _sample_counts_sequentially(
    log_p_rows: torch.Tensor, k_rows: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """``z_i ~ Binomial(k - z_1 - ... - z_{i-1}, p_i / sum_{j >= i} p_j)``, the last
    coordinate taking the remainder: O(n) binomial draws per event, whatever k is. In
    ``log_p_rows``' dtype (float64: exact counts up to 2**53)."""
    rows, n = log_p_rows.shape
    # Tail sums in log space, not 1 - cumsum(p): no cancellation for the last categories
    # and no underflow of tiny ones.
    log_tail = log_p_rows.flip(-1).logcumsumexp(-1).flip(-1)
    conditional_p = (log_p_rows - log_tail).exp().clamp(0.0, 1.0)
    conditional_p = conditional_p.expand(num_samples, rows, n)
    remaining = k_rows.to(log_p_rows.dtype).expand(num_samples, rows)
    # Stacked, not written into a buffer: no in-place op under torch.jit.trace.
    columns = []
    for i in range(n - 1):
        z_i = torch.binomial(remaining, conditional_p[..., i].contiguous())
        columns.append(z_i)
        remaining = remaining - z_i
    columns.append(remaining)
    return torch.stack(columns, -1).movedim(0, 1)


class _LogFactorialOfCounts(torch.autograd.Function):
    """``log z! = lgamma(z + 1)`` for integer ``0 <= z <= len(table) - 1`` by table lookup,
    with the exact derivative ``digamma(z + 1)``: a lookup alone (``table[z.long()]``)
    would silently cut the gradient with respect to ``z``."""

    @staticmethod
    def forward(ctx, counts: torch.Tensor, log_factorials: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(counts)
        # The caller guarantees 0 <= z <= len(table) - 1 (off-support rows are zeroed).
        return log_factorials[counts.long()]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        (counts,) = ctx.saved_tensors
        return grad_output * torch.digamma(counts + 1), None


def _log_factorial_of_counts(counts: torch.Tensor, k_max: int) -> torch.Tensor:
    """``log z!`` for integer counts ``z`` in ``0..k_max`` (``log_prob`` zeroes the rows off
    the support before calling this): a table lookup when the table is smaller than the
    input, else ``lgamma``; differentiable in ``z`` either way."""
    if k_max + 1 >= counts.numel():
        return torch.lgamma(counts + 1)
    table = torch.lgamma(torch.arange(k_max + 1, dtype=counts.dtype, device=counts.device) + 1)
    return _LogFactorialOfCounts.apply(counts, table)


class ConditionedPoisson(TorchDistribution):
    r"""Independent ``Poisson(rate_i)`` counts conditioned on summing to exactly ``k``.

    The conditional distribution is ``Multinomial(k, p)`` with ``p = rate / sum(rate)``
    (only the rates' proportions matter)::

        log_prob(z) = log k! - sum_i log z_i! + sum_i z_i log p_i

    on integer vectors ``z >= 0`` with ``sum_i z_i = k``, with respect to counting measure
    on that set. ``k`` is a count (below) broadcast with ``rate.shape[:-1]``: the batch
    shape is the broadcast of the two, the event shape ``rate.shape[-1:]``.

    ``rsample`` returns an exact sample whose gradient is the straight-through
    marginal-expectation estimator through ``E[z] = k p``
    (docs/distributions/gradient_estimators.md): the value is exactly integer and sums exactly to
    ``k``. It is biased wherever the downstream function of ``z`` is not linear in ``z``.
    With ``grad_estimator="score_function"``, ``has_rsample`` is ``False`` on the instance,
    so ``pyro.sample`` draws with :meth:`sample` (exact, no gradient) and Pyro's ELBOs
    differentiate the site by the score function (unbiased, higher variance; baselines
    through ``TraceGraph_ELBO`` and the site's ``infer={"baseline": ...}``); ``rsample``
    then raises ``NotImplementedError``. Which to choose:
    docs/distributions/choosing_gradient_estimator.md. ``marginals`` are
    ``Binomial(k, p_i)``. ``sample``, ``rsample`` and ``log_prob`` use no
    in-place op, so that they run under ``torch.jit.trace`` (``JitTrace_ELBO`` and its kin).

    Numerics: ``p`` is normalised in log space in float64 (rates from 1e-300 to 1e300
    side by side are fine), and ``log_prob``, ``entropy``, ``mean``, ``variance``, KL and
    ``log_constraint_prob`` accumulate in float64 before rounding to ``rate``'s dtype, so
    that float32 results keep float32 relative accuracy at large ``k``. ``k`` and the
    samples live in ``rate``'s dtype, which must hold every count exactly: ``k`` (or
    ``k_max``) above ``2**24`` (float32) or ``2**53`` (float64) is a ``ValueError``.

    ``k``: an int, an integer tensor, or whole-number floats (``3.0``, as
    ``Binomial.total_count``); ``3.5``, a bool, a complex number or NaN is a ``ValueError``
    whatever ``validate_args`` says (`constrained_ppl.arguments.check_count`), as in
    ``numpyro_constrained``. A negative ``k`` is a ``ValueError`` with validation on; with
    it off it gives ``-inf`` log-probabilities and NaN ``mean``, ``variance``, ``entropy``
    and samples, never a finite number.

    Parameter constraints: ``rate`` has event_dim 1 (its last dimension is the event),
    ``k`` event_dim 0.

    :param rate: positive, finite Poisson rates, shape ``batch + (n,)``.
    :param k: the known total, a non-negative integer (per batch element or shared), as
        above.
    :param k_max: an optional static upper bound on ``k`` (a Python int), for parity with
        ``numpyro_constrained``, where it sizes jitted tables when ``k`` is traced; here
        ``k`` is always concrete, so it is only checked: a ``k`` above it is a
        ``ValueError``.
    :param grad_estimator: ``"marginal_expectation"`` (default) or ``"score_function"``
        (above); anything else is a ``ValueError`` naming the two.

    Examples
    --------
    >>> import torch
    >>> from pyro_constrained import ConditionedPoisson
    >>> rate = torch.tensor([1.0, 2.0, 5.0])
    >>> d = ConditionedPoisson(rate, k=8)
    >>> d
    ConditionedPoisson(rate: torch.Size([3]), k: 8)
    >>> d.mean  # k p, with p = rate / sum(rate)
    tensor([1., 2., 5.])
    >>> z = d.sample((4,))  # exact integer draws summing to 8
    >>> z.shape, bool((z.sum(-1) == 8).all()), bool((z == z.round()).all())
    (torch.Size([4, 3]), True, True)
    >>> value = torch.tensor([1.0, 2.0, 5.0])
    >>> multinomial = torch.distributions.Multinomial(8, probs=rate / rate.sum())
    >>> bool(torch.isclose(d.log_prob(value), multinomial.log_prob(value)))
    True
    """

    arg_constraints = {
        "rate": constraints.independent(positive_finite, 1),
        "k": constraints.nonnegative_integer,
    }
    has_rsample = True
    has_enumerate_support = True
    #: The largest support that `enumerate_support` builds (a ``ValueError`` beyond it).
    max_support = 2**16

    @keyword_only("k", usage="ConditionedPoisson(rate, k=k)")
    def __init__(
        self,
        rate: torch.Tensor,
        *,
        k: int | float | torch.Tensor,
        k_max: int | None = None,
        grad_estimator: str = "marginal_expectation",
        validate_args: bool | None = None,
    ) -> None:
        self.grad_estimator = check_grad_estimator(grad_estimator, DISCRETE_GRAD_ESTIMATORS)
        # Per instance: Pyro's ELBOs read site["fn"].has_rsample to choose between the
        # pathwise and the score-function term.
        self.has_rsample = grad_estimator == "marginal_expectation"
        k_max = check_static_bound(k_max)
        rate = torch.as_tensor(rate)
        if not rate.is_floating_point():
            rate = rate.to(torch.get_default_dtype())
        if rate.dim() < 1:
            raise ValueError(
                "rate must have at least one dimension (the categories), got shape "
                f"{tuple(rate.shape)}"
            )
        if rate.shape[-1] < 1:
            raise ValueError("rate must have at least one category (rate.shape[-1] >= 1)")
        check_count(k, concrete=True, name="k")
        k = torch.as_tensor(k, device=rate.device)
        try:
            batch_shape = torch.broadcast_shapes(rate.shape[:-1], k.shape)
        except RuntimeError as error:
            raise ValueError(
                f"k of shape {tuple(k.shape)} does not broadcast with the batch shape "
                f"{tuple(rate.shape[:-1])} of rate (shape {tuple(rate.shape)})"
            ) from error
        _check_k_is_exact(k, rate.dtype, k_max)
        event_shape = rate.shape[-1:]
        self.rate = rate.expand(batch_shape + event_shape)
        # Stored in rate's dtype, as Binomial stores total_count (exact: checked above).
        self.k = k.to(rate.dtype).expand(batch_shape)
        self.k_max = k_max
        super().__init__(batch_shape, event_shape, validate_args=validate_args)

    @classmethod
    def infer_shapes(cls, rate: tuple[int, ...], k: tuple[int, ...] = ()):
        batch_shape = torch.broadcast_shapes(tuple(rate[:-1]), tuple(k))
        return batch_shape, tuple(rate[-1:])

    def expand(self, batch_shape, _instance=None) -> ConditionedPoisson:
        new = self._get_checked_instance(ConditionedPoisson, _instance)
        batch_shape = torch.Size(batch_shape)
        new.rate = self.rate.expand(batch_shape + self.event_shape)
        new.k = self.k.expand(batch_shape)
        new.k_max = self.k_max
        new.grad_estimator = self.grad_estimator
        new.has_rsample = self.has_rsample
        super(ConditionedPoisson, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self) -> constraints.Constraint:
        return _IntegerComposition(self.k)

    def _log_probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``log p`` and ``log(1 - p)`` in float64 (`_normalized_log_probs`)."""
        return _normalized_log_probs(self.rate)

    def _log_p(self) -> torch.Tensor:
        """``log p`` in float64 (`_log_probs_only`)."""
        return _log_probs_only(self.rate)

    @property
    def probs(self) -> torch.Tensor:
        """``p = rate / sum(rate)``, the multinomial probabilities."""
        return _probs_only(self.rate).to(self.rate.dtype)

    def enumerate_support(self, expand: bool = True) -> torch.Tensor:
        """Every composition of ``k`` into ``n`` non-negative parts once (all have positive
        probability), shape ``(count,) + batch_shape + (n,)`` (``expand=True``) or
        ``(count,) + (1,) * len(batch_shape) + (n,)`` (``expand=False``), as
        ``torch.distributions.OneHotCategorical``; in reverse lexicographic order (the
        first is ``(k, 0, ..., 0)``). Needs one ``k`` over the batch (else a
        ``ValueError``). ``count = C(k + n - 1, n - 1)`` is computed before anything is
        built; above ``max_support`` it is a ``ValueError``."""
        name = type(self).__name__
        k = single_count(self.k.detach().cpu().numpy(), name)
        if k < 0:
            raise ValueError(f"{name}.enumerate_support: k = {k} has an empty support")
        n = self.event_shape[0]
        count = math.comb(k + n - 1, n - 1)
        check_support_size(count, self.max_support, name)
        table = compositions(n, k)
        values = torch.as_tensor(table, dtype=self.rate.dtype, device=self.rate.device)
        values = values.reshape((count,) + (1,) * len(self.batch_shape) + self.event_shape)
        if expand:
            values = values.expand((count,) + self.batch_shape + self.event_shape)
        return values

    @property
    def mode(self) -> torch.Tensor:
        """The most likely composition (a multinomial mode), exact: every mode is at least
        ``floor(k p)`` entrywise (the log-pmf is separable and concave in the counts), so
        starting there and handing the remaining units one at a time to the count with the
        largest gain ``log p_i - log(z_i + 1)`` is exact. Ties go to the lower index, so
        among equally likely compositions the result is deterministic. NaN where
        ``k < 0`` (validation off)."""
        log_p = self._log_p()
        k = self._k_long
        n = self.event_shape[0]
        p = log_p.exp()
        # A hair below k p, so that rounding never starts above a mode.
        start = torch.floor(k[..., None].double() * p * (1 - 8 * torch.finfo(p.dtype).eps))
        start = start.clamp(min=0)
        start = torch.minimum(start, k[..., None].double())
        remaining = k.double() - start.sum(-1)
        counts = start
        index = torch.arange(n, device=counts.device)
        while bool((remaining > 0).any()):
            gain = log_p - torch.log1p(counts)
            best = torch.argmax(gain, dim=-1)  # the first maximum: ties to the lower index
            add = (remaining > 0).to(counts.dtype)
            counts = counts + add[..., None] * (index == best[..., None]).to(counts.dtype)
            remaining = remaining - add
        counts = counts.to(self.rate.dtype)
        return torch.where(self._k_is_negative[..., None], math.nan, counts)

    @property
    def _k_max(self) -> int:
        """The largest ``k``, at least 0 (the size of the log-factorial table)."""
        return max(int(self.k.max()), 0) if self.k.numel() else 0

    @property
    def _k_long(self) -> torch.Tensor:
        """``k`` as a long tensor, negative entries (validation off) as 0: what the
        samplers and the entropy's tables can take; `_k_is_negative` marks them."""
        return self.k.clamp(min=0).long()

    @property
    def _k_is_negative(self) -> torch.Tensor:
        """Where ``k < 0`` (possible with validation off), shape ``batch_shape``: those get
        ``-inf`` log-probabilities and NaN moments and samples. A mask, not a branch on its
        values, so that it stays right under ``torch.jit.trace``."""
        return self.k < 0

    @property
    def mean(self) -> torch.Tensor:
        """``k p``; NaN where ``k < 0``."""
        mean = (self.k.double().unsqueeze(-1) * _probs_only(self.rate)).to(self.rate.dtype)
        return mean.masked_fill(self._k_is_negative.unsqueeze(-1), math.nan)

    @property
    def variance(self) -> torch.Tensor:
        """``k p (1 - p)``; NaN where ``k < 0``."""
        # k p (1 - p) with 1 - p exact also where p rounds to 1.
        log_p, log1m_p = self._log_probs()
        variance = (self.k.double().unsqueeze(-1) * (log_p + log1m_p).exp()).to(self.rate.dtype)
        return variance.masked_fill(self._k_is_negative.unsqueeze(-1), math.nan)

    @property
    def marginals(self) -> Binomial:
        """The conditional marginal of each coordinate: ``z_i ~ Binomial(k, p_i)``."""
        p = self.probs
        return Binomial(total_count=self.k.unsqueeze(-1).expand_as(p), probs=p, validate_args=False)

    def log_constraint_prob(self) -> torch.Tensor:
        """``log P(sum_i z_i = k)`` under the unconstrained Poissons, ``log Poisson(k; sum(rate))``
        (the count likelihood of a bag of known total); ``-inf`` where ``k < 0``."""
        log_prob = _log_poisson_of_total(self.rate, self._k_long)
        return log_prob.to(self.rate.dtype).masked_fill(self._k_is_negative, -math.inf)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """``log k! - sum_i log z_i! + sum_i z_i log p_i``; ``-inf`` off the support (or a
        ``ValueError`` there with validation on). Differentiable in ``value`` too. A value
        whose shape does not end in the event shape, or whose leading dimensions do not
        broadcast with the batch shape, is a ``ValueError`` naming the expected shape.

        The support check is exact whatever ``value``'s dtype (an int64 count above
        ``2**24`` is not rounded into the support of a float32 distribution); the sum is
        accumulated in float64 and returned in the promotion of ``rate``'s and a floating
        ``value``'s dtypes (torch's type promotion).
        """
        value = torch.as_tensor(value, device=self.rate.device)
        check_value_shape(value.shape, self.batch_shape, self.event_shape, "ConditionedPoisson")
        if value.is_floating_point():
            dtype = torch.promote_types(self.rate.dtype, value.dtype)
        else:
            dtype = self.rate.dtype
        in_support, _ = _is_integer_composition(value, self.k)
        if self._validate_args and not bool(in_support.all()):
            raise ValueError(
                "The value argument to ConditionedPoisson.log_prob must be vectors of "
                f"integers >= 0 that sum to exactly k, got {value} with k = {self.k}"
            )
        # lgamma(z + 1) at a negative integer is inf and its derivative NaN: evaluate off
        # the support at 0 instead (those entries get -inf below; where keeps the gradient
        # of the others exact, unlike clamping, which halves it at 0). Always, not behind a
        # check of the values: torch.jit.trace would freeze that branch.
        value = torch.where(in_support.unsqueeze(-1), value, 0)
        counts = value.to(torch.float64)
        log_p = self._log_p()
        k = self.k.double()
        log_prob = (
            torch.lgamma(k + 1)
            - _log_factorial_of_counts(counts, self._k_max).sum(-1)
            + torch.linalg.vecdot(counts, log_p)
        )
        # A negative k (validation off) has no value in its support.
        log_prob = torch.where(in_support, log_prob, -math.inf)
        return log_prob.to(dtype)

    def __repr__(self) -> str:
        return parameters_repr(
            type(self).__name__, {"rate": self.rate, "k": self.k}, integers=("k",)
        )

    def sample(self, sample_shape=_EMPTY_SIZE) -> torch.Tensor:
        """An exact sample (no gradient); NaN where ``k < 0``."""
        # detach, not only no_grad: torch.jit.trace does not record no_grad, and a traced
        # sampler whose inputs required grad would be differentiated through its draws.
        with torch.no_grad():
            z = _sample_counts(self.rate.detach(), self._k_long, torch.Size(sample_shape))
            return z.masked_fill(self._k_is_negative.unsqueeze(-1), math.nan)

    def rsample(self, sample_shape=_EMPTY_SIZE) -> torch.Tensor:
        """An exact sample ``z`` returned as ``z + (m - m.detach())`` with ``m = k p``: the
        value is exactly ``z``, the gradient that of the conditional mean (zero, not absent,
        where ``k = 0``). ``NotImplementedError`` with ``grad_estimator="score_function"``
        (no reparameterised sampler)."""
        if not self.has_rsample:
            raise NotImplementedError(
                "ConditionedPoisson(grad_estimator='score_function') has no reparameterised "
                "sampler (has_rsample is False): use sample(); Pyro's ELBOs then "
                "differentiate the site by the score function"
            )
        z = self.sample(sample_shape)
        m = self.mean.expand(z.shape)
        return z + (m - m.detach())

    def entropy(self) -> torch.Tensor:
        """Exact entropy ``-log k! - k sum_i p_i log p_i + sum_i E[log z_i!]``,
        ``z_i ~ Binomial(k, p_i)``; NaN where ``k < 0``.

        The expectations sum only over binomial outcomes within a Bennett-inequality window
        around each mean; the dropped terms total at most ``0.01`` times the machine epsilon
        of ``rate``'s dtype (absolute), see `entropy_log_inverse_tail`. The O(n w) loop runs
        in ``rate``'s dtype on quantities centred in float64 (`_expected_log_factorials`),
        the O(n) sums in float64. Cost O(n w) per batch element with ``w <= k + 1`` the
        window width (about 20 for ``k = 100`` spread over ``n = 1000`` categories).
        """
        dtype = self.rate.dtype
        log_p, log1m_p = self._log_probs()
        if self.event_shape[0] == 1:
            # A single category: z = k surely. 0 with a zero gradient.
            entropy = (log_p.sum(-1) * self.k).to(dtype)
        else:
            k_long = self._k_long
            k = k_long.double()
            log_c_factorial, correction = _expected_log_factorials(log_p, log1m_p, k_long, dtype)
            cross_entropy = k * (log_p.exp() * log_p).sum(-1)
            # Grouped so that a near-certain outcome (entropy 1e-28 beside log k! = 8.5, say)
            # keeps its relative accuracy: the log-factorials cancel exactly there.
            log_factorials = log_c_factorial.sum(-1) - torch.lgamma(k + 1)
            entropy = (log_factorials + (correction.sum(-1) - cross_entropy)).to(dtype)
        return entropy.masked_fill(self._k_is_negative, math.nan)


def _check_k_is_exact(k: torch.Tensor, dtype: torch.dtype, k_max: int | None) -> None:
    """``ValueError`` when ``k`` exceeds ``k_max`` or the integers that ``dtype`` (and a
    floating ``k``'s own dtype) hold exactly, or ``k_max`` exceeds those of ``dtype``;
    negative ``k`` is left to the validation of ``k`` (NaN is refused by `check_count`)."""
    if k_max is not None:
        check_total_in_exact_range(k_max, str(dtype), argument="k_max")
    if k.numel() == 0:
        return
    largest = int(k.max())
    if k_max is not None:
        check_k_max_bounds_k(k_max, largest)
    if k.is_floating_point():
        check_total_in_exact_range(largest, str(k.dtype), argument="k")
    check_total_in_exact_range(largest, str(dtype), argument="k")


@register_kl(ConditionedPoisson, ConditionedPoisson)
def _kl_conditioned_poisson(p: ConditionedPoisson, q: ConditionedPoisson) -> torch.Tensor:
    """``KL(p || q) = k sum_i p_i log(p_i / q_i)`` for two with the same ``k`` and ``n``, in
    the promotion of their dtypes, never negative and accurate also where the two are close
    (`_relative_entropy`); NaN where ``k < 0``."""
    if p.event_shape != q.event_shape:
        raise ValueError(
            f"KL between ConditionedPoisson needs the same number of categories, got "
            f"{p.event_shape[0]} and {q.event_shape[0]}"
        )
    if not torch.equal(*torch.broadcast_tensors(p.k.double(), q.k.double())):
        raise ValueError("KL between ConditionedPoisson needs the same k")
    kl = p.k.double() * _relative_entropy(p.rate, q.rate)
    kl = kl.to(torch.promote_types(p.rate.dtype, q.rate.dtype))
    return kl.masked_fill(p._k_is_negative, math.nan)
