"""Independent references for ExactlyKBernoulli: enumeration of all k-subsets, and SciPy.

NumPy / SciPy only (never the library). Logits are 1-D float64 arrays whose entries may be
``-inf`` (forced off) or ``+inf`` (forced on); the pmf is p(z) ∝ exp(logits . z) on k-hot z,
with forced entries handled by restricting the support instead of by infinite arithmetic.
"""

import itertools
import math

import numpy as np
from scipy import special, stats


def k_subsets(n: int, k: int) -> np.ndarray:
    """All 0/1 vectors of length n with exactly k ones, shape (C(n, k), n), float64."""
    rows = np.zeros((int(special.comb(n, k, exact=True)), n))
    for row, ones in enumerate(itertools.combinations(range(n), k)):
        rows[row, list(ones)] = 1.0
    return rows


def exactly_k_pmf(logits, k: int):
    """(subsets, probs): the support (k-subsets allowed by infinite logits) and their pmf."""
    logits = np.asarray(logits, dtype=np.float64)
    n = logits.shape[-1]
    subsets = k_subsets(n, k)
    forced_on = logits == np.inf
    forced_off = logits == -np.inf
    allowed = np.all(subsets[:, forced_on] == 1, axis=1) & np.all(
        subsets[:, forced_off] == 0, axis=1
    )
    subsets = subsets[allowed]
    finite = np.isfinite(logits)
    scores = subsets[:, finite] @ logits[finite]
    log_norm = special.logsumexp(scores)
    return subsets, np.exp(scores - log_norm)


def exactly_k_log_normalizer(logits, k: int) -> float:
    """log e_k(exp logits) by summing exp(logits . z) over all k-subsets (finite logits)."""
    logits = np.asarray(logits, dtype=np.float64)
    subsets = k_subsets(logits.shape[-1], k)
    with np.errstate(invalid="ignore"):
        scores = np.where(subsets == 1, logits, 0.0).sum(axis=1)
    return float(special.logsumexp(scores))


def exactly_k_marginals(logits, k: int) -> np.ndarray:
    """P(z_i = 1 | sum z = k) by enumeration."""
    subsets, probs = exactly_k_pmf(logits, k)
    return probs @ subsets


def log_elementary_symmetric(logits, k: int) -> np.ndarray:
    """log e_j(exp logits) for j = 0..k by the sequential log-space recursion
    e_j(x_1..x_i) = e_j(x_1..x_{i-1}) + exp(x_i) e_{j-1}(x_1..x_{i-1}) (finite logits): exact
    to float64 relative precision for values far below the smallest float64."""
    table = np.full(k + 1, -np.inf)
    table[0] = 0.0
    for logit in np.asarray(logits, dtype=np.float64):
        table[1:] = np.logaddexp(table[1:], logit + table[:-1])
    return table


def exactly_k_log_marginals(logits, k: int, indices) -> np.ndarray:
    """log P(z_i = 1 | sum z = k) = logits_i + log e_{k-1}(rest) - log e_k(all) for the given
    indices, by the log-space recursion (n up to a few hundred), so that marginals far below
    float64's smallest number are still compared to full relative precision."""
    logits = np.asarray(logits, dtype=np.float64)
    log_norm = log_elementary_symmetric(logits, k)[k]
    return np.array(
        [
            logits[i] + log_elementary_symmetric(np.delete(logits, i), k - 1)[k - 1] - log_norm
            for i in indices
        ]
    )


def exactly_k_entropy(logits, k: int) -> float:
    """-sum_z p(z) log p(z) over the support, by enumeration."""
    _, probs = exactly_k_pmf(logits, k)
    return float(-np.sum(special.xlogy(probs, probs)))


def exactly_k_kl(logits_p, logits_q, k: int) -> float:
    """KL(p || q) = sum_z p(z) log(p(z) / q(z)) by enumeration (inf if supp p not in supp q)."""
    subsets_p, probs_p = exactly_k_pmf(logits_p, k)
    subsets_q, probs_q = exactly_k_pmf(logits_q, k)
    q_of = {tuple(row): prob for row, prob in zip(subsets_q, probs_q, strict=True)}
    total = 0.0
    for row, prob in zip(subsets_p, probs_p, strict=True):
        if prob == 0.0:
            continue
        q = q_of.get(tuple(row), 0.0)
        if q == 0.0:
            return np.inf
        total += prob * (np.log(prob) - np.log(q))
    return float(total)


def exactly_k_expected_losses(logits, k: int, target) -> tuple[float, float]:
    """(E ||z - target||_1, E ||z - target||_2^2) by enumeration."""
    subsets, probs = exactly_k_pmf(logits, k)
    target = np.asarray(target, dtype=np.float64)
    l1 = np.abs(subsets - target).sum(axis=1)
    l2 = ((subsets - target) ** 2).sum(axis=1)
    return float(probs @ l1), float(probs @ l2)


def log_constraint_prob(logits, k: int) -> float:
    """log P(sum z = k) for independent z_i ~ Bernoulli(sigmoid(logits_i)), by SciPy."""
    probs = special.expit(np.asarray(logits, dtype=np.float64))
    return float(stats.poisson_binom(probs).logpmf(k))


def chi_square_pvalue(samples, logits, k: int, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of 0/1 sample rows against the enumerated pmf.

    Subsets expected fewer than ``min_expected`` times are pooled into one bin (the
    chi-square approximation needs it); a sample outside the support raises ValueError.
    """
    subsets, probs = exactly_k_pmf(logits, k)
    index = {tuple(row): i for i, row in enumerate(subsets)}
    counts = np.zeros(len(subsets))
    for row in np.asarray(samples, dtype=np.float64):
        if tuple(row) not in index:
            raise ValueError(f"sample {row} is outside the support")
        counts[index[tuple(row)]] += 1
    expected = probs * counts.sum()
    small = expected < min_expected
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if len(counts) < 2:
        return 1.0
    return float(stats.chisquare(counts, expected).pvalue)


def exact_enumeration(logits, k: int):
    """(subsets, log_probs, log_normalizer, marginals, entropy) by enumeration, exact to
    float64 precision for finite logits of any size (and +-inf ones): each subset's score is
    taken relative to the best subset's with ``math.fsum`` (so 1e9 + 0.3 - 1e9 loses
    nothing), then normalised in log space. ``None`` if no k-subset is allowed."""
    logits = np.asarray(logits, dtype=np.float64)
    subsets = k_subsets(logits.shape[-1], k)
    allowed = np.all(subsets[:, logits == np.inf] == 1, axis=1) & np.all(
        subsets[:, logits == -np.inf] == 0, axis=1
    )
    subsets = subsets[allowed]
    if len(subsets) == 0:
        return None
    finite = np.isfinite(logits)
    terms = subsets[:, finite] * logits[finite]
    scores = [math.fsum(row) for row in terms]
    best = terms[int(np.argmax(scores))]
    relative = np.array([math.fsum(np.concatenate([row, -best])) for row in terms])
    log_total = math.log(math.fsum(np.exp(relative)))
    log_probs = relative - log_total
    probs = np.exp(log_probs)
    entropy = -math.fsum(special.xlogy(probs, probs))
    return subsets, log_probs, math.fsum(best) + log_total, probs @ subsets, entropy


def log_constraint_prob_by_enumeration(logits, k: int) -> float:
    """log P(sum z = k) for independent z_i ~ Bernoulli(sigmoid(logits_i)), by summing the
    probabilities of all k-subsets in log space (``log sigmoid`` by ``logaddexp``, exact for
    logits of any size; -inf if impossible)."""
    logits = np.asarray(logits, dtype=np.float64)
    subsets = k_subsets(logits.shape[-1], k)
    with np.errstate(invalid="ignore"):
        log_on = -np.logaddexp(0.0, -logits)
        log_off = -np.logaddexp(0.0, logits)
    terms = np.where(subsets == 1, log_on, log_off)
    scores = np.array([math.fsum(row) if np.all(row > -np.inf) else -np.inf for row in terms])
    if np.all(scores == -np.inf):
        return -np.inf
    return float(special.logsumexp(scores))


def hessian_by_differences(function, x: np.ndarray, step: float = 1e-4) -> np.ndarray:
    """Central second differences of ``function`` (scalar or array valued) at ``x``, shape
    ``function(x).shape + (n, n)``. The probs may move past 0 and 1, where the enumerated
    polynomials continue analytically."""
    n = x.shape[0]
    out = None
    for i, j in itertools.product(range(n), repeat=2):

        def at(a, b, i=i, j=j):
            moved = x.copy()
            moved[i] += a
            moved[j] += b
            return np.asarray(function(moved))

        entry = (at(step, step) - at(step, -step) - at(-step, step) + at(-step, -step)) / (
            4 * step * step
        )
        if out is None:
            out = np.zeros(entry.shape + (n, n))
        out[..., i, j] = entry
    return out
