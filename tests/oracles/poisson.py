"""References for ConditionedPoisson: independent Poissons conditioned on their sum.

Two independent routes: SciPy's multinomial (the closed form ``Multinomial(k, rate/sum)``),
and brute-force enumeration of every composition of ``k`` into ``n`` parts, weighted by the
product of the unconstrained Poisson pmfs and renormalised (the definition of the
conditional distribution, with no multinomial formula in it).
"""

import itertools
import math

import numpy as np
from scipy import special, stats


def compositions(n: int, k: int) -> np.ndarray:
    """Every integer vector of length ``n`` with entries ``>= 0`` summing to ``k``, one a row."""
    rows = [
        np.diff(np.concatenate([[-1], bars, [n + k - 1]])) - 1
        for bars in itertools.combinations(range(n + k - 1), n - 1)
    ]
    return np.array(rows, dtype=np.int64).reshape(-1, n)


def conditioned_poisson_pmf(rate, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(compositions, pmf)``: ``prod_i Poisson(z_i; rate_i)`` over the compositions of ``k``,
    normalised: ``P(z | sum z = k)`` by definition."""
    rate = np.asarray(rate, dtype=np.float64)
    support = compositions(rate.shape[-1], k)
    log_weights = stats.poisson.logpmf(support, rate).sum(-1)
    log_weights -= log_weights.max()
    weights = np.exp(log_weights)
    return support, weights / weights.sum()


def multinomial_logpmf(rate, k, value) -> np.ndarray:
    """SciPy's ``multinomial(k, rate / sum(rate)).logpmf(value)``, batched over leading axes."""
    rate = np.asarray(rate, dtype=np.float64)
    value = np.asarray(value, dtype=np.float64)
    rate, value = np.broadcast_arrays(rate, value)
    k = np.broadcast_to(np.asarray(k), rate.shape[:-1])
    out = np.empty(rate.shape[:-1])
    for index in np.ndindex(*rate.shape[:-1]):
        p = rate[index] / rate[index].sum()
        out[index] = stats.multinomial(int(k[index]), p).logpmf(value[index])
    return out


def multinomial_entropy(rate, k) -> np.ndarray:
    """SciPy's ``multinomial(k, rate / sum(rate)).entropy()``, batched over leading axes."""
    rate = np.asarray(rate, dtype=np.float64)
    k = np.broadcast_to(np.asarray(k), rate.shape[:-1])
    out = np.empty(rate.shape[:-1])
    for index in np.ndindex(*rate.shape[:-1]):
        p = rate[index] / rate[index].sum()
        out[index] = stats.multinomial(int(k[index]), p).entropy()
    return out


def enumerated_entropy(rate, k: int) -> float:
    _, pmf = conditioned_poisson_pmf(rate, k)
    pmf = pmf[pmf > 0]
    return float(-(pmf * np.log(pmf)).sum())


def enumerated_kl(rate_p, rate_q, k: int) -> float:
    """``sum_z p(z) log(p(z) / q(z))`` over all compositions."""
    _, pmf_p = conditioned_poisson_pmf(rate_p, k)
    _, pmf_q = conditioned_poisson_pmf(rate_q, k)
    return float((pmf_p * (np.log(pmf_p) - np.log(pmf_q))).sum())


def enumerated_expected_l1(rate, k: int, target) -> float:
    support, pmf = conditioned_poisson_pmf(rate, k)
    return float(pmf @ np.abs(support - np.asarray(target)).sum(-1))


def enumerated_expected_l2(rate, k: int, target) -> float:
    support, pmf = conditioned_poisson_pmf(rate, k)
    return float(pmf @ ((support - np.asarray(target)) ** 2).sum(-1))


def enumerated_mean_and_variance(rate, k: int) -> tuple[np.ndarray, np.ndarray]:
    support, pmf = conditioned_poisson_pmf(rate, k)
    mean = pmf @ support
    return mean, pmf @ (support - mean) ** 2


def composition_chi_square_pvalue(samples, rate, k: int, min_expected: float = 5.0) -> float:
    """Chi-square goodness-of-fit p-value of sampled vectors against the enumerated pmf.

    Outcomes with expected count below ``min_expected`` are pooled into one bin (with any
    sample that is not a composition of ``k`` at all, which therefore fails the test).
    """
    samples = np.asarray(samples)
    support, pmf = conditioned_poisson_pmf(rate, k)
    index = {tuple(row): i for i, row in enumerate(support)}
    observed = np.zeros(len(support) + 1)
    for row in samples.reshape(-1, support.shape[1]):
        observed[index.get(tuple(np.rint(row).astype(np.int64)), len(support))] += 1
    return binned_chi_square_pvalue(observed, np.append(pmf, 0.0), min_expected)


def binned_chi_square_pvalue(observed, probs, min_expected: float = 5.0) -> float:
    """Chi-square p-value of ``observed`` counts against ``probs``, pooling the bins whose
    expected count is below ``min_expected`` into one."""
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(probs, dtype=np.float64) * observed.sum()
    small = expected < min_expected
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        if observed[-1] > 0:
            return 0.0
        observed, expected = observed[:-1], expected[:-1]
    expected *= observed.sum() / expected.sum()
    return float(stats.chisquare(observed, expected).pvalue)


def mean_jacobian(rate, k) -> np.ndarray:
    """``d (k rate_i / sum rate) / d rate_j = k (delta_ij / S - rate_i / S^2)``, shape
    ``batch + (n, n)`` (output index first)."""
    rate = np.asarray(rate, dtype=np.float64)
    total = rate.sum(-1)[..., None, None]
    n = rate.shape[-1]
    k = np.asarray(k, dtype=np.float64)[..., None, None]
    return k * (np.eye(n) / total - rate[..., :, None] / total**2)


# Extended-precision and O(nk) references (for the property tests) ---------------------------
# mpmath works from the rates themselves, with 60 significant digits more than the decimal
# range of the rates, so that their sum is exact and every p_i = rate_i / sum keeps 60 digits
# (rates 1e30 and 1e-30 side by side need 60 digits just to hold 1e30 + 1e-30: at a fixed 60
# digits, log p of the large rate, about -1e-60, came out 1% off). Nothing here uses the
# library's formulas for normalising p in log space.

MPMATH_DIGITS = 60


def _digits_for(*rates) -> int:
    """``MPMATH_DIGITS`` plus the decimal range of the positive rates (at least 0)."""
    values = np.concatenate([np.ravel(np.asarray(r, dtype=np.float64)) for r in rates])
    values = values[values > 0]
    if values.size == 0:
        return MPMATH_DIGITS
    return MPMATH_DIGITS + max(0, math.ceil(math.log10(values.max() / values.min())))


def _mp_probs(rate) -> list:
    import mpmath

    # Called inside the caller's workdps(_digits_for(rate)).
    rate = [mpmath.mpf(float(r)) for r in np.asarray(rate, dtype=np.float64)]
    total = mpmath.fsum(rate)
    return [r / total for r in rate]


def mp_log_probs_and_complements(rate) -> tuple[np.ndarray, np.ndarray]:
    """``log p_i`` and ``log(1 - p_i)`` (``1 - p_i`` as the sum of the other rates over the
    total, so no cancellation), at 60 digits, rounded to float64."""
    import mpmath

    with mpmath.workdps(_digits_for(rate)):
        rate_mp = [mpmath.mpf(float(r)) for r in np.asarray(rate, dtype=np.float64)]
        total = mpmath.fsum(rate_mp)
        log_p = [mpmath.log(r / total) for r in rate_mp]
        log1m_p = [
            mpmath.log(mpmath.fsum(rate_mp[:i] + rate_mp[i + 1 :]) / total)
            if len(rate_mp) > 1
            else mpmath.mpf("-inf")
            for i in range(len(rate_mp))
        ]
        return np.array([float(x) for x in log_p]), np.array([float(x) for x in log1m_p])


def mp_multinomial_logpmf(rate, k: int, value) -> float:
    """``log k! - sum log z_i! + sum z_i log p_i`` at 60 digits (``-inf`` off the support)."""
    import mpmath

    value = [int(v) for v in np.asarray(value)]
    if min(value) < 0 or sum(value) != k:
        return -math.inf
    with mpmath.workdps(_digits_for(rate)):
        probs = _mp_probs(rate)
        log_pmf = mpmath.loggamma(k + 1) - mpmath.fsum(mpmath.loggamma(z + 1) for z in value)
        log_pmf += mpmath.fsum(z * mpmath.log(p) for z, p in zip(value, probs, strict=True) if z)
        return float(log_pmf)


def mp_enumerated_log_pmf(rate, k: int) -> tuple[np.ndarray, list]:
    """``(compositions, log pmf)`` by the definition: the product of the unconstrained
    Poisson pmfs over every composition of ``k``, normalised, at 60 digits (mpmath values)."""
    import mpmath

    support = compositions(len(rate), k)
    with mpmath.workdps(_digits_for(rate)):
        rate_mp = [mpmath.mpf(float(r)) for r in np.asarray(rate, dtype=np.float64)]
        # prod_i Poisson(z_i; r_i) = exp(-sum r) prod_i r_i^z_i / z_i!: the factor exp(-sum r)
        # is the same for every composition and cancels in the normalisation, so it is left
        # out (at 1e30 it would cost 30 of the 60 digits).
        log_weights = [
            mpmath.fsum(
                z * mpmath.log(r) - mpmath.loggamma(z + 1)
                for z, r in zip(row, rate_mp, strict=True)
            )
            for row in support.tolist()
        ]
        log_normaliser = mpmath.log(mpmath.fsum(mpmath.exp(w) for w in log_weights))
        return support, [w - log_normaliser for w in log_weights]


def mp_enumerated_entropy(rate, k: int) -> float:
    import mpmath

    _, log_pmf = mp_enumerated_log_pmf(rate, k)
    with mpmath.workdps(MPMATH_DIGITS):
        return float(-mpmath.fsum(mpmath.exp(w) * w for w in log_pmf))


def mp_enumerated_kl(rate_p, rate_q, k: int) -> float:
    import mpmath

    _, log_p = mp_enumerated_log_pmf(rate_p, k)
    _, log_q = mp_enumerated_log_pmf(rate_q, k)
    with mpmath.workdps(MPMATH_DIGITS):
        return float(
            mpmath.fsum(mpmath.exp(a) * (a - b) for a, b in zip(log_p, log_q, strict=True))
        )


def binomial_sum_entropy(rate, k: int) -> float:
    """``H = -log k! - k sum_i p_i log p_i + sum_i E[log z_i!]`` with every ``E[log z_i!]``
    summed over all ``k + 1`` outcomes of SciPy's ``Binomial(k, p_i)`` pmf: O(nk), float64,
    with ``p`` and ``log p`` from `mp_log_probs_and_complements`. Its own rounding error is
    about ``1e-16 log k!`` (absolute)."""
    log_p, _ = mp_log_probs_and_complements(rate)
    p = np.exp(log_p)
    outcomes = np.arange(k + 1)
    log_factorials = special.gammaln(outcomes + 1.0)
    expected = sum(float(stats.binom.pmf(outcomes, k, p_i) @ log_factorials) for p_i in p)
    return expected - float(special.gammaln(k + 1.0)) - k * float(np.sum(p * log_p))


def reference_log_p(rate: np.ndarray) -> np.ndarray:
    """``log(rate / sum(rate))`` in float64, written here (zero rates give ``-inf``)."""
    with np.errstate(divide="ignore"):
        log_rate = np.log(np.asarray(rate, dtype=np.float64))
    return log_rate - special.logsumexp(log_rate, axis=-1, keepdims=True)


# (rates, a k per batch element): settings whose modes tie or degenerate.
MODE_CASES = [
    ([1.0, 1.0, 1.0], [4, 0, 1, 2, 5]),  # all tied
    ([0.3, 0.3, 1.7, 1.7, 1.7], [6, 7, 3]),  # ties within two blocks
    ([2.0, 1.0], [2, 3, 5]),  # exact ties between different rates (2/2 = 1/1)
    ([0.0, 1.0, 2.0, 0.0], [5, 0, 3]),  # zero rates (validation off)
    ([1e-300, 1.0, 1e300], [4]),  # a rate that vanishes beside another
    ([5.0], [0, 3]),  # one category
    ([0.05, 0.9, 0.05, 2.2], [9, 1]),
]


def brute_force_modes(log_p: np.ndarray, k: int) -> tuple[float, list]:
    """(the largest multinomial log-pmf, every composition within 1e-12 of it) over all
    compositions of ``k`` into ``len(log_p)`` parts, by enumeration."""
    n = len(log_p)
    best, scored = -math.inf, []
    for cuts in itertools.combinations(range(k + n - 1), n - 1):
        parts = np.diff((-1, *cuts, k + n - 1)) - 1
        terms = [z * lp if z else 0.0 for z, lp in zip(parts, log_p, strict=True)]
        value = sum(terms) - sum(math.lgamma(z + 1) for z in parts)
        scored.append((value, tuple(int(z) for z in parts)))
        best = max(best, value)
    tolerance = 1e-12 * max(1.0, abs(best))
    return best, [parts for value, parts in scored if value >= best - tolerance]


def check_mode_against_brute_force(rate: np.ndarray, k: np.ndarray, mode: np.ndarray):
    """Each batch element's ``mode`` is one of its enumerated modes, and equal rates get
    non-increasing counts (ties go to the lower index)."""
    for index in np.ndindex(k.shape):
        modes = brute_force_modes(reference_log_p(rate[index]), int(k[index]))[1]
        assert tuple(mode[index].astype(int)) in modes, (rate[index], k[index], modes)
        # Ties to the lower index: equal rates get non-increasing counts.
        for i, j in itertools.combinations(range(rate.shape[-1]), 2):
            if rate[index][i] == rate[index][j]:
                assert mode[index][i] >= mode[index][j]


def is_locally_optimal(log_p: np.ndarray, mode: np.ndarray) -> bool:
    """No single unit moved from i to j raises the log-pmf (for a separable concave pmf,
    the condition for a global maximum): ``log p_i - log m_i >= log p_j - log(m_j + 1)``."""
    with np.errstate(divide="ignore"):
        give = np.where(mode > 0, log_p - np.log(np.maximum(mode, 1)), np.inf)
    take = log_p - np.log1p(mode)
    return bool((give.min(-1) >= take.max(-1) - 1e-12 * np.abs(take).max(-1)).all())
