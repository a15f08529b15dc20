"""Constants for log-factorials and Poisson log-probabilities without cancellation.

``log z!`` is about ``z log z``: at ``z = 1e6`` it is 1.3e7, whose float32 rounding alone is
0.5. A log-probability that is a difference of such numbers (``log k! - sum log z_i!``) keeps
no digit in float32. Catherine Loader's saddle-point form ("Fast and accurate computation of
binomial probabilities", 2000) writes them from two small, accurately computable pieces::

    log z! = z log z - z + log sqrt(2 pi z) + stirling_error(z)             (z >= 1)
    log Poisson(z; m) = -log sqrt(2 pi z) - stirling_error(z) - bd0(z, m)   (z >= 1)
    bd0(z, m) = z log(z / m) + m - z >= 0

``stirling_error`` is tabulated for ``z <= STIRLING_TABLE_MAX`` and otherwise summed from its
asymptotic series; ``bd0`` is a series in ``v = (z - m) / (z + m)`` where ``|v|`` is small.
Both framework packages evaluate these with the constants here. Plain Python (``decimal``),
no NumPy, torch or JAX.
"""

from decimal import Decimal, localcontext

__all__ = [
    "BD0_SERIES_MAX_V",
    "BD0_SERIES_TERMS",
    "LOG_SQRT_2PI",
    "STIRLING_ERROR_TABLE",
    "STIRLING_SERIES",
    "STIRLING_TABLE_MAX",
]

# log(sqrt(2 pi)) to 50 digits.
_LOG_SQRT_2PI = Decimal("0.91893853320467274178032973640561763986139747363778")
LOG_SQRT_2PI = float(_LOG_SQRT_2PI)

#: Integers ``z <= STIRLING_TABLE_MAX`` take ``stirling_error(z)`` from `STIRLING_ERROR_TABLE`;
#: beyond it the series `STIRLING_SERIES` is accurate to float64 (its first omitted term is
#: below 2e-16 times the sum at ``z = 16``).
STIRLING_TABLE_MAX = 15


def _stirling_error_table() -> tuple[float, ...]:
    """``log z! - (z log z - z + log sqrt(2 pi z))`` for ``z = 0..STIRLING_TABLE_MAX``, from
    40-digit decimal logarithms (so each entry is the correctly rounded float64). Entry 0 is
    a placeholder 0.0 (the form needs ``z >= 1``; ``log 0! = 0`` is handled apart)."""
    table = [0.0]
    with localcontext() as context:
        context.prec = 40
        log_factorial = Decimal(0)
        for z in range(1, STIRLING_TABLE_MAX + 1):
            d = Decimal(z)
            log_factorial += d.ln()
            table.append(float(log_factorial - (d * d.ln() - d + _LOG_SQRT_2PI + d.ln() / 2)))
    return tuple(table)


STIRLING_ERROR_TABLE = _stirling_error_table()

#: ``stirling_error(z) = sum_j c_j / z^(2j + 1)`` (the Bernoulli-number series), highest
#: order last: ``1/12, -1/360, 1/1260, -1/1680, 1/1188, -691/360360``.
STIRLING_SERIES = (1 / 12, -1 / 360, 1 / 1260, -1 / 1680, 1 / 1188, -691 / 360360)

#: ``bd0(z, m) = (z - m) v + 2 z sum_{j >= 1} v^(2j + 1) / (2j + 1)``, ``v = (z - m) / (z + m)``,
#: for ``|v| < BD0_SERIES_MAX_V`` with `BD0_SERIES_TERMS` terms of the sum (the first omitted
#: is below ``0.25**28 / 29``, 1e-18 of the first); beyond, the direct form cancels by at most
#: a factor of about ``1 / v^2 = 16``.
BD0_SERIES_MAX_V = 0.25
BD0_SERIES_TERMS = 14
