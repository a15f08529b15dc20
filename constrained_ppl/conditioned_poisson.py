"""Framework-free decisions of ``ConditionedPoisson``, shared by ``pyro_constrained`` and
``numpyro_constrained`` so that a numerical change made here holds in both.

The Loader / Stirling constants are in `constrained_ppl.stirling`, the entropy's truncation
bound in `constrained_ppl.binomial_tails`. Plain Python, no NumPy, torch or JAX.
"""

import math

__all__ = [
    "KL_SERIES",
    "KL_SERIES_MAX_D",
    "LOG_FACTORIAL_TABLE_MAX_SIZE",
    "SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY",
    "UNDERFLOW_MARGIN",
    "finite_log_zero",
]

#: The samplers draw ``k`` categorical indices per event (O(k log n)) unless ``k`` is this
#: many times larger than ``n``, where ``n`` sequential binomial draws (O(n) per event) are
#: cheaper.
SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY = 32

#: ``sum_{m >= 2} (m - 1) / m! d^(m - 2)``, the series of ``((d - 1) e^d + 1) / d^2`` that the
#: KL sums where ``|d| = |log(p_i / q_i)| < KL_SERIES_MAX_D``, to the term whose contribution
#: at ``|d| = 1/2`` is below 1e-18 of the sum.
KL_SERIES = tuple((m - 1) / math.factorial(m) for m in range(2, 20))

#: Below this ``|log(p_i / q_i)|`` the KL term is the series `KL_SERIES`; above it the direct
#: ``(d - 1) p/q + 1`` cancels by at most a factor of 8.
KL_SERIES_MAX_D = 0.5

#: Quantities below ``tiny * UNDERFLOW_MARGIN`` of their dtype are treated as underflowing
#: (a ratio or a Poisson mean whose reciprocal or logarithm would lose digits as a
#: subnormal): the computations take the logarithmic form there.
UNDERFLOW_MARGIN = 2.0**30

#: NumPyro's entropy gathers ``log m!`` from a table of ``m = 0..k_max`` up to this size, and
#: evaluates ``lgamma`` beyond (XLA needs the size statically; the Pyro entropy tabulates
#: only the distinct ``(k, floor(k p))`` pairs, which torch can size at run time).
LOG_FACTORIAL_TABLE_MAX_SIZE = 2**20


def finite_log_zero(smallest: float) -> float:
    """A finite stand-in for ``log 0`` given the most negative finite float of a dtype: up to
    1e8 times it, ``exp`` still underflows to 0, and unlike ``-inf`` it gives 0 (not NaN)
    times 0 and in gradients."""
    return smallest / 1e8


def mode_candidate_slots(n: int, k_bound: int, eps: float) -> int:
    """The static number of candidate units the sort-based ``mode`` considers beyond its
    lower bound ``floor(k p (1 - (n + 8) eps))``, for ``n`` categories and ``k <= k_bound``:
    a mode is at most ``(k + n) p_i`` entrywise, so coordinate ``i`` needs at most
    ``floor(p_i (n + 2 (n + 8) eps k) (1 + 2**-20)) + 1`` candidates, which sum to at most
    this (the extra ``2**-19`` covers the rounding of the per-coordinate widths)."""
    return n + 1 + math.ceil((n + 2 * (n + 8) * eps * k_bound) * (1 + 2.0**-19))
