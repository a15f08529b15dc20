"""``ConditionedPoisson``'s exact entropy in torch: ``E[log z_i!]`` for the binomial
marginals, summed over a window of outcomes around each mean that Bennett's inequality
bounds (`constrained_ppl.binomial_tails`)."""

from __future__ import annotations

import math

import torch

from constrained_ppl.binomial_tails import bennett_deviation, entropy_log_inverse_tail
from pyro_constrained._conditioned_poisson_tracing import static_under_trace


def _window_half_width(
    mean: torch.Tensor, log1m_p: torch.Tensor, k_bound: int, log_inverse_tail: float
) -> int:
    """Half-width of the windows of outcomes summed over: every outcome within ``t`` of its
    mean, ``t`` from Bennett's inequality at the largest variance of the batch, which bounds
    every element's tails. Under ``torch.jit.trace`` the variance bound ``k p (1 - p) <=
    k_bound / 4`` instead: a width read from the rates would be frozen by the trace, and
    too narrow for rates that spread the counts more than those of the first call."""
    if torch.jit.is_tracing():
        max_variance = k_bound / 4.0
    else:
        variance = mean * log1m_p.exp()
        max_variance = float(variance.max()) if variance.numel() else 0.0
    # +1: floor(mean) may be off by one from the exact floor through rounding.
    return math.ceil(bennett_deviation(max_variance, log_inverse_tail)) + 1


def _binomial_windows(
    mean: torch.Tensor, k: torch.Tensor, half_width: int, k_bound: int
) -> tuple[torch.Tensor, int]:
    """First outcome and common width of a window of outcomes of each Binomial(k, p) count
    holding every ``j`` in ``[0, k]`` with ``|j - floor(mean)| <= half_width``.

    ``mean`` and ``k`` (long) broadcast; the width is a Python int, the widest window of the
    batch, or under ``torch.jit.trace`` the width any window can have (`_window_half_width`).
    """
    floor_mean = mean.floor().long()
    first = (floor_mean - half_width).clamp(min=0)
    with static_under_trace():  # a size
        empty = not bool(first.numel())
    if torch.jit.is_tracing() or empty:
        width = 1 if empty else 2 * half_width + 2
    else:
        last = torch.minimum(floor_mean + half_width + 1, k)
        width = int((last - first).max()) + 1
    width = max(1, min(width, k_bound + 1))
    # A window running past k moves left, so that it holds no outcome beyond k if it can.
    first = torch.minimum(first, (k + 1 - width).clamp(min=0))
    return first, width


def _pair_tables(k_event, center, first, width: int, k_bound: int, dtype: torch.dtype):
    """``G[t]`` and ``D[t]`` over the window (`_expected_log_factorials`) for each distinct
    pair ``(k, c)``, tabulated in float64 and rounded to ``dtype``, with the row of each
    coordinate and ``log c!``, ``log(c + 1)`` and the odds shift per coordinate."""
    accumulation = torch.float64
    pair_key = k_event * (k_bound + 1) + center
    unique_keys, row_of_coordinate = torch.unique(pair_key, return_inverse=True)
    rows = row_of_coordinate.reshape(-1)
    unique_k = unique_keys // (k_bound + 1)
    unique_c = unique_keys % (k_bound + 1)
    # Coordinates with the same (k, c) have the same window.
    unique_first = torch.zeros_like(unique_keys).scatter(0, rows, first.reshape(-1))
    j = unique_first.unsqueeze(-1) + torch.arange(width, device=first.device)
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
    shape = k_event.shape + (width,)
    # index_select, not advanced indexing: it copies whole rows instead of gathering element
    # by element.
    g = g_rows.index_select(0, rows).view(shape)
    d = d_rows.index_select(0, rows).view(shape)
    per_coordinate = [
        column.squeeze(-1)[row_of_coordinate] for column in (log_c_factorial, log_shift, odds_shift)
    ]
    return g, d, *per_coordinate


def _expected_log_factorials(
    log_p: torch.Tensor, log1m_p: torch.Tensor, k: torch.Tensor, k_bound: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``E[log z_i!]`` for ``z_i ~ Binomial(k, p_i)``, per coordinate, in float64, as the
    two terms ``log c!`` and ``E[log z!] - log c!`` (defined below).

    ``log_p`` and ``log1m_p`` (float64, from `_normalized_log_probs`, ``n >= 2``) have shape
    ``batch + (n,)``, ``k`` (long) ``batch``, ``k_bound`` a static bound on ``k``. Sums
    over the outcomes in `_binomial_windows`; the rest are dropped, see
    `entropy_log_inverse_tail` (at the machine epsilon of ``dtype``, the dtype of the
    O(n w) loop).

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
    distinct pairs occur, so they are tabulated once per pair (`_pair_tables`) and gathered
    as rows. Normalising the weights over the window makes ``log Binomial(c; k, p)``
    unnecessary.
    """
    with static_under_trace():  # a size
        n = int(log_p.shape[-1])
    accumulation = log_p.dtype
    k_event = k.unsqueeze(-1).expand(log_p.shape)
    with torch.no_grad():
        mean = k_event.to(accumulation) * log_p.exp()
        log_inverse_tail = entropy_log_inverse_tail(n, k_bound, torch.finfo(dtype).eps)
        half_width = _window_half_width(mean, log1m_p, k_bound, log_inverse_tail)
        first, width = _binomial_windows(mean, k_event, half_width, k_bound)
        # k p <= k since p <= 1; the window holds c (see _binomial_windows).
        center = torch.minimum(mean.floor().long(), k_event)
        g, d, log_c_factorial, log_shift, odds_shift = _pair_tables(
            k_event, center, first, width, k_bound, dtype
        )
        steps = torch.arange(width, dtype=dtype, device=log_p.device)
        center_step = (center - first).to(accumulation)
    delta = log_p - log1m_p - odds_shift
    # t delta = s delta - (c - first) delta with s = j - first the shared step.
    log_weights = torch.addcmul(
        (-center_step * delta).to(dtype).unsqueeze(-1), steps, delta.to(dtype).unsqueeze(-1)
    )
    weights = (log_weights - g).exp()
    expected_d = torch.linalg.vecdot(weights, d) / weights.sum(-1)
    # k p - c without cancellation where p is near 1: (k - c) - k (1 - p) there.
    k_float = k_event.to(accumulation)
    center_float = center.to(accumulation)
    mean_minus_center = torch.where(
        log_p > -math.log(2),
        (k_float - center_float) - k_float * log1m_p.exp(),
        k_float * log_p.exp() - center_float,
    )
    return log_c_factorial, mean_minus_center * log_shift + expected_d.to(accumulation)
