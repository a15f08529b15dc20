"""The one-sided derivatives of the count distributions (``PoissonBinomial``,
``CountConstrainedBernoulli``) in ``probs`` of exactly 0 and 1 (Pyro).

There the logits are infinite, the kernels see the variable as removed, and the chain rule
through the logits would give 0 (or ``0 * inf``). Every quantity is a rational function of
the odds ``w = p / (1 - p)`` near ``p = 0`` (of ``1 / w`` near ``p = 1``), so its one-sided
derivative is finite (or, for the entropy and the KL, infinite with a known sign) and comes
from the neighbouring counts, as ``ExactlyKBernoulli``'s ``_OddsTangents`` give it: these
helpers add zero-valued terms that carry it. See docs/numerics.md.
"""

import torch

from pyro_constrained._autograd import is_differentiated
from pyro_constrained._ekb_terms import _OddsTangents, odds_tangents
from pyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli
from pyro_constrained.exactly_k_tracing import static_under_trace

__all__ = [
    "count_log_terms",
    "edge_probs",
    "new_count_tangents",
    "range_tangents",
    "traced_k_max",
    "unbounded",
]


def edge_probs(probs: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor | None:
    """``probs`` where they need the one-sided terms: given by the caller (``probs`` is None
    otherwise), differentiated (either mode), with an exact 0 or 1 (an infinite logit), or
    under ``torch.jit.trace`` whatever they hold."""
    if probs is None or not is_differentiated(probs):
        return None
    # Under torch.jit.trace the terms are always built (zero where no prob is 0 or 1), as
    # ExactlyKBernoulli's: a Python branch on the values would freeze the first call's answer.
    if not torch.jit.is_tracing() and not bool((~torch.isfinite(logits)).any()):
        return None
    return probs


def _static_size(size) -> int:
    """A size as a Python int (under torch.jit.trace a traced size, which a trace fixes)."""
    with static_under_trace():
        return int(size)


def traced_k_max(n) -> int | None:
    """The kernels' table size for ``ExactlyKBernoulli(..., k_max=...)``: n under
    torch.jit.trace, else None (sized by the counts). A trace fixes the table size, which
    must not follow the counts of the first call: a later count, or a count set by more 1s,
    may be larger."""
    return _static_size(n) if torch.jit.is_tracing() else None


def count_log_terms(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Zeros of ``counts``' broadcast shape with ``probs.shape[:-1]`` whose derivatives in
    the probs at exactly 0 and 1 are the one-sided ones of ``log P(K = counts)`` (to second
    order: ``ExactlyKBernoulli.log_constraint_prob``'s odds terms, the normalisers of the
    counts next to each). ``counts`` must be whole numbers in 0..n; where the probs rule a
    count out, the term is 0 (its log-probability is ``-inf``)."""
    n = probs.shape[-1]
    shape = torch.broadcast_shapes(counts.shape, probs.shape[:-1])
    exactly = ExactlyKBernoulli(
        probs=probs.expand(shape + (n,)),
        k=counts.expand(shape),
        k_max=traced_k_max(n),
        validate_args=False,
    )
    tangents = exactly._odds_tangents
    if tangents is None:
        return torch.zeros(shape, dtype=probs.dtype, device=probs.device)
    terms = tangents.log_normalizer + tangents.softplus
    return torch.where(exactly._infeasible, 0.0, terms)


def unbounded(probs: torch.Tensor) -> torch.Tensor:
    """+1 at a 0, -1 at a 1, else 0: a count distribution's entropy moves by ``-w log w``
    when such a variable moves (it opens a count the others cannot reach), an infinite
    one-sided slope with this sign."""
    return torch.where(probs == 0, 1.0, torch.where(probs == 1, -1.0, 0.0)).to(probs.dtype)


def _edge_moves(probs: torch.Tensor, keepdim: bool = False):
    """(sum of the moves of the probs at 0, of those at 1): zero-valued, their derivatives
    the sums of the probs' own."""
    delta = probs - probs.detach()
    d_off = torch.where(probs == 0, delta, 0.0).sum(-1, keepdim=keepdim)
    d_on = torch.where(probs == 1, delta, 0.0).sum(-1, keepdim=keepdim)
    return d_off, d_on


def new_count_tangents(probs: torch.Tensor, log_pmf: torch.Tensor) -> torch.Tensor:
    """Zeros of ``log_pmf``'s shape (``batch + (n + 1,)``, the law of K at the point) whose
    derivatives are those of ``P(K = j)`` at the two counts that are impossible at the
    point and possible to first order: ``last + 1`` (every variable not at 0 is one, and one
    at 0 switches on: ``P(K = last) sum_{p_i = 0} dp_i``) and ``first - 1`` (every variable
    at 1 but one, ``-P(K = first) sum_{p_i = 1} dp_i``). Log-probabilities of ``-inf``
    cannot carry these; the cumulative probabilities need them."""
    n = probs.shape[-1]
    off, on = probs == 0, probs == 1
    d_off, d_on = _edge_moves(probs, keepdim=True)
    last = (n - off.sum(-1, keepdim=True)).expand(log_pmf.shape[:-1] + (1,))
    first = on.sum(-1, keepdim=True).expand(log_pmf.shape[:-1] + (1,))
    p_last = log_pmf.gather(-1, last).exp()
    p_first = log_pmf.gather(-1, first).exp()
    j = torch.arange(n + 1, device=probs.device)
    above = torch.where(j == last + 1, p_last * d_off, 0.0)
    below = torch.where(j == first - 1, -p_first * d_on, 0.0)
    return above + below


def range_tangents(
    probs: torch.Tensor, logits: torch.Tensor, low: torch.Tensor, high: torch.Tensor
) -> tuple[_OddsTangents, torch.Tensor]:
    """The ``_OddsTangents`` of the normaliser ``P(low <= K <= high)`` (its log, less the
    probs' own ``log(1 - p)`` and ``log p`` at the 0s and 1s, which ``softplus`` carries):
    switching ``a`` variables at 0 on and ``b`` at 1 off moves the free variables' count
    range by ``b - a``, so the ratios are the range's sums of the free counts' probabilities
    shifted by that step, over the sum at the point, and the neighbour marginals the
    mixtures of the exactly-k marginals over the shifted range. Second: zeros of shape
    ``batch + (n + 1,)`` carrying the derivative of ``P(K = j | range)`` that the counts
    next to j contribute (``P(K = j - 1) / P(range)`` per 0 switched on, ``P(K = j + 1) /
    P(range)`` per 1 switched off); the normaliser's share is in the first."""
    n = logits.shape[-1]
    on_count = (logits == torch.inf).sum(-1)
    top = n - (logits == -torch.inf).sum(-1)  # the largest count the infinite logits allow
    first, last = torch.maximum(low, on_count), torch.minimum(high, top)
    infeasible = first > last
    if torch.jit.is_tracing():
        # A trace fixes this size: it must hold any range, not the one that the first call's
        # 0s and 1s leave (a later call with fewer of them needs a wider one).
        width = _static_size(n) + 5
    else:
        width = int((last - first).clamp(min=0).max()) + 5 if first.numel() else 5
    step = torch.arange(width, device=logits.device).reshape((-1,) + (1,) * first.dim())
    counts = first + step - 2  # every count a shifted range (|shift| <= 2) can reach
    possible = (counts >= on_count) & (counts <= top) & ~infeasible
    safe = torch.where(possible, counts, torch.where(infeasible, 0, first))
    finite = torch.where(infeasible[..., None], 0.0, logits)
    rows = ExactlyKBernoulli(
        logits=finite.expand((width,) + logits.shape),
        k=safe,
        k_max=traced_k_max(n),
        validate_args=False,
    )
    log_p = torch.where(possible, rows.log_constraint_prob(), -torch.inf)
    mu_rows = rows.mean
    largest = torch.finfo(logits.dtype).max
    log_sums, mixtures = {}, {}
    for shift in (-2, -1, 0, 1, 2):
        # shift: the change of the free variables' count (see _OddsTangents).
        inside = (counts >= low + shift) & (counts <= high + shift)
        log_w = torch.where(inside, log_p, -torch.inf)
        log_sums[shift] = torch.logsumexp(log_w, 0)
        weights = torch.softmax(log_w, 0).nan_to_num(0.0)[..., None]
        mixtures[shift] = torch.where(weights > 0, weights * mu_rows, 0.0).sum(0)
    ratios = {
        shift: (log_sums[shift] - log_sums[0]).exp().clamp(max=largest).nan_to_num(0.0)
        for shift in (-2, -1, 1, 2)
    }
    mu = mixtures.pop(0)  # the range's marginals at the point
    tangents = odds_tangents(probs, ratios, mixtures, mu, infeasible)
    relative = torch.where(possible, (log_p - log_sums[0]).exp().nan_to_num(0.0), 0.0)
    sum_off, sum_on = _edge_moves(probs)
    table = probs.new_zeros(first.shape + (n + 1,))
    for move, shift in ((sum_off, 1), (-sum_on, -1)):
        target = counts + shift
        inside = (target >= low) & (target <= high) & (target >= 0) & (target <= n)
        share = torch.where(inside, relative, 0.0) * move
        index = target.clamp(0, n).movedim(0, -1)
        table = table.scatter_add(-1, index, share.movedim(0, -1))
    return tangents, table
