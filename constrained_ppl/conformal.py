"""Split-conformal calibration of the regression heads' scale (framework-free, shared by
``pyro_constrained.nn`` and ``numpyro_constrained.nn``): the rank of the conformal
quantile and the chi-square quantile that turns it into a scale factor.

The heads' predictive distribution is a Gaussian on the ``d = n - a`` dimensional
subspace ``{A y = k}``; its squared Mahalanobis distance ``M = ||(y - mean) / s||^2`` is
chi-square with ``d`` degrees of freedom when the model is right. Split conformal
prediction on the score ``M`` over ``N`` held-out examples takes the
``ceil((N + 1) c)``-th smallest score ``M_(r)`` as the radius of the region
``{M <= M_(r)}``; for a new example exchangeable with the held-out ones that region
contains it with probability at least ``c`` (Vovk et al. 2005; Lei et al. 2018), whatever
the distribution. Scaling the covariance by ``t^2 = M_(r) / chi2_d(c)`` makes the
predictive distribution's own ``c`` highest-density region that region.
"""

from __future__ import annotations

import math

CALIBRATIONS = ("conformal", "likelihood")


def conformal_rank(num_examples: int, coverage: float) -> int:
    """The 1-based rank ``ceil((N + 1) coverage)`` of the split-conformal quantile among
    ``N`` held-out scores; ``ValueError`` where it exceeds ``N`` (too few examples for
    the coverage: the conformal radius would be infinite)."""
    if not (0.0 < coverage < 1.0):
        raise ValueError(f"coverage must lie in (0, 1), got {coverage}")
    # The small slack keeps (N + 1) * 0.9 = 360.00000000000006 (N = 399) at rank 360.
    rank = math.ceil((num_examples + 1) * coverage - 1e-9)
    if rank > num_examples:
        need = math.ceil(coverage / (1.0 - coverage) - 1e-9)
        raise ValueError(
            f"calibrate: {num_examples} held-out examples are too few for a conformal "
            f"coverage of {coverage} (at least {need} are needed)"
        )
    return rank


def _regularised_gammas(a: float, x: float) -> tuple[float, float]:
    """``(P(a, x), Q(a, x) = 1 - P)``, the regularised incomplete gamma functions: the
    series of ``P`` for ``x < a + 1``, Lentz's continued fraction of ``Q`` otherwise
    (Numerical Recipes, 6.2), each to about 1e-15 relative; the other by complement."""
    if x <= 0.0:
        return 0.0, 1.0
    log_prefactor = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-17:
                break
        lower = total * math.exp(log_prefactor)
        return lower, 1.0 - lower
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    upper = math.exp(log_prefactor) * h
    return 1.0 - upper, upper


def chi2_quantile(probability: float, dof: int) -> float:
    """The ``probability`` quantile of the chi-square distribution with ``dof`` degrees of
    freedom, by bisection of its CDF ``P(dof / 2, x / 2)`` (of the complement ``Q`` above
    the median, so that quantiles near 1 keep their precision) to double precision."""
    if not (0.0 < probability < 1.0):
        raise ValueError(f"probability must lie in (0, 1), got {probability}")
    if dof < 1:
        raise ValueError(f"dof must be a positive integer, got {dof}")

    def below(x: float) -> bool:  # is x below the quantile?
        lower, upper = _regularised_gammas(dof / 2.0, x / 2.0)
        return lower < probability if probability <= 0.5 else upper > 1.0 - probability

    low, high = 0.0, float(dof) + 10.0 * math.sqrt(2.0 * dof) + 50.0
    while below(high):
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if below(mid):
            low = mid
        else:
            high = mid
        if high - low <= 1e-15 * high:
            break
    return 0.5 * (low + high)


def check_calibration(method: str, coverage: float) -> None:
    """The options of the heads' ``calibrate``: ``method`` one of :data:`CALIBRATIONS`,
    ``coverage`` in (0, 1)."""
    if method not in CALIBRATIONS:
        raise ValueError(f"method must be one of {CALIBRATIONS}, got {method!r}")
    if not (0.0 < coverage < 1.0):
        raise ValueError(f"coverage must lie in (0, 1), got {coverage}")
