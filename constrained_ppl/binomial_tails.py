"""Framework-free bounds behind ConditionedPoisson's exact, truncated entropy.

Plain-Python float arithmetic on sizes and variances, shared by ``pyro_constrained`` and
``numpyro_constrained`` so that both truncate the binomial sums by the same stated bound.
"""

import math

# The entropy drops binomial terms whose total mass, times log(k!), is below this fraction
# of the working precision (see `entropy_log_inverse_tail`).
ENTROPY_TRUNCATION_FRACTION_OF_EPS = 1e-2


def bennett_deviation(variance: float, log_inverse_tail: float) -> float:
    """Smallest t with ``exp(-v h(t / v)) <= exp(-log_inverse_tail)``, ``h(u) = (1+u)log(1+u) - u``.

    Bennett's inequality for a sum of independent variables with increments bounded by 1
    and total variance ``v`` (a Binomial(k, p) count: ``v = k p (1 - p)``) bounds each tail:
    ``P(Z - E Z >= t) <= exp(-v h(t / v))`` and the same for ``E Z - Z``. The bound is
    decreasing in ``v``, so the largest variance of a batch covers every element of it.
    """
    if variance <= 0.0:
        return 0.0

    def exponent(t: float) -> float:
        u = t / variance
        return variance * ((1.0 + u) * math.log1p(u) - u)

    high = 1.0
    while exponent(high) < log_inverse_tail:
        high *= 2.0
    low = 0.0
    for _ in range(60):
        mid = 0.5 * (low + high)
        if exponent(mid) < log_inverse_tail:
            low = mid
        else:
            high = mid
    return high


def entropy_log_inverse_tail(n: int, k_max: int, eps: float) -> float:
    """``L`` such that dropping outcomes of mass ``2 exp(-L)`` from each coordinate changes
    ``sum_i E[log z_i!]`` by at most ``ENTROPY_TRUNCATION_FRACTION_OF_EPS * eps``.

    Each dropped term is ``pmf(j) log j!`` with ``log j! <= log k!``, and renormalising the
    kept mass ``1 - delta`` (``delta <= 2 exp(-L)``) changes the kept sum by at most
    ``delta / (1 - delta) log k!``, so the total error is at most ``4.1 n log(k!) exp(-L)``.
    """
    log_k_factorial = max(math.lgamma(k_max + 1.0), 1.0)
    return math.log(4.1 * n * log_k_factorial / (ENTROPY_TRUNCATION_FRACTION_OF_EPS * eps))
