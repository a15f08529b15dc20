"""``ConditionedPoisson``'s exact samplers in torch: categorical draws (O(k log n) per event)
or sequential binomials (O(n) per event, for k large beside n)."""

from __future__ import annotations

import torch

from constrained_ppl.conditioned_poisson import SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY
from pyro_constrained._conditioned_poisson_numerics import _log_probs_only
from pyro_constrained._conditioned_poisson_tracing import static_under_trace


def _sample_counts(
    rate: torch.Tensor, k: torch.Tensor, k_bound: int, sample_shape: torch.Size
) -> torch.Tensor:
    """Exact ``Multinomial(k, rate / sum(rate))`` counts of shape ``sample_shape + rate.shape``
    (``k`` is a long tensor of shape ``rate.shape[:-1]``, ``k_bound`` a static bound on it),
    in ``rate``'s dtype. Which sampler runs depends on sizes and ``k_bound`` only, never on
    the rates (`pyro_constrained._conditioned_poisson_tracing`)."""
    rate_rows = rate.reshape(-1, rate.shape[-1])
    k_rows = k.reshape(-1)
    # Sizes and the static bound on k only.
    with static_under_trace():
        batch_shape, n = rate.shape[:-1], int(rate.shape[-1])
        num_samples = sample_shape.numel()
        rows = int(rate_rows.shape[0])
        k_max = k_bound
        nothing_to_draw = rows == 0 or num_samples == 0 or k_max == 0
    if nothing_to_draw:
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
        # Under a trace always masked: k may be a traced input bounded by k_max.
        every_k_is_k_max = not torch.jit.is_tracing() and bool((k_rows == k_max).all())
        if every_k_is_k_max:
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
