"""``ConditionedPoisson``'s numerics in JAX: the probabilities ``p = rate / sum(rate)`` in
log space, Loader's saddle-point forms of Poisson log-probabilities
(`constrained_ppl.stirling`), ``log_prob`` and the relative entropy of KL."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy.special import digamma, logsumexp

from constrained_ppl.conditioned_poisson import (
    KL_SERIES,
    KL_SERIES_MAX_D,
    UNDERFLOW_MARGIN,
    finite_log_zero,
    mode_candidate_slots,
)
from constrained_ppl.stirling import (
    BD0_SERIES_MAX_V,
    BD0_SERIES_TERMS,
    LOG_SQRT_2PI,
    STIRLING_ERROR_TABLE,
    STIRLING_SERIES,
    STIRLING_TABLE_MAX,
)
from numpyro_constrained._conditioned_poisson_support import _is_integer_composition


def _finite_log_zero(dtype) -> float:
    """`constrained_ppl.conditioned_poisson.finite_log_zero` for ``dtype``."""
    return finite_log_zero(float(jnp.finfo(dtype).min))


def _accumulation_dtype():
    """float64 where JAX has it (``jax_enable_x64``), else float32."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)


def _normalized_log_probs(rate):
    """``log p`` and ``log(1 - p)`` for ``p = rate / sum(rate)``, in `_accumulation_dtype`.

    In log space relative to the largest rate, so that no sum of rates overflows (float32
    rates near 1e38) and no ratio underflows (1e-30 beside 1e30): with ``S`` the sum of
    the other rates over the largest, ``log p = log(rate / max) - log(1 + S)``, and
    ``1 - p`` is ``S / (1 + S)`` for the largest rate, exact where ``S`` is tiny, and
    ``log1p(-p)`` with ``p <= 1/2`` for every other. A single category has ``p = 1`` and
    ``log(1 - p) = -inf``.
    """
    log_rate = jnp.log(rate.astype(_accumulation_dtype()))
    n = rate.shape[-1]
    if n == 1:
        # 0 with a zero gradient, not a constant: sample and entropy stay differentiable.
        return log_rate * 0.0, jnp.full_like(log_rate, -jnp.inf)
    argmax = jnp.argmax(lax.stop_gradient(log_rate), axis=-1, keepdims=True)
    is_max = jnp.arange(n) == argmax
    shifted = log_rate - jnp.take_along_axis(log_rate, argmax, axis=-1)
    log_rest = logsumexp(jnp.where(is_max, -jnp.inf, shifted), axis=-1, keepdims=True)
    log1p_rest = jnp.logaddexp(log_rest, 0.0)
    log_p = shifted - log1p_rest
    # The inner where: log1p(-1) at the largest p would make a NaN gradient.
    log1m_p_others = jnp.log1p(-jnp.exp(jnp.where(is_max, -1.0, log_p)))
    log1m_p = jnp.where(is_max, log_rest - log1p_rest, log1m_p_others)
    return log_p, log1m_p


def _log_probs_only(rate):
    """``log p`` for ``p = rate / sum(rate)`` in `_accumulation_dtype`, as
    `_normalized_log_probs` gives it but in one logarithm pass (what ``log_prob``, ``mean``
    and KL need).

    ``log p = log rate - log max - log(1 + S)`` with ``S`` the sum of the other rates over
    the largest, summed directly (ratios below the dtype's smallest number, which vanish
    from it, change ``log(1 + S)`` by less than the dtype resolves).
    """
    rate = rate.astype(_accumulation_dtype())
    # One largest rate, by index: ties stay in S, so every rate keeps its gradient.
    argmax = jnp.argmax(lax.stop_gradient(rate), axis=-1, keepdims=True)
    is_top = jnp.arange(rate.shape[-1]) == argmax
    largest = jnp.take_along_axis(rate, argmax, axis=-1)
    rest = jnp.sum(jnp.where(is_top, 0.0, rate / largest), axis=-1, keepdims=True)
    # log(rate / largest) exactly 0 for the largest (whose log p is then -log(1 + S)), even
    # where the vectorised log of rate and the log of largest round differently.
    log_ratio = jnp.where(is_top, 0.0, jnp.log(rate) - jnp.log(largest))
    return log_ratio - jnp.log1p(rest)


def _probs_only(rate):
    """``p = rate / sum(rate)`` in `_accumulation_dtype`, as ``(rate / max) / sum(rate /
    max)``: no sum overflows, and no logarithm is needed (``mean``, ``probs``)."""
    rate = rate.astype(_accumulation_dtype())
    ratio = rate / jnp.max(rate, axis=-1, keepdims=True)
    return ratio / jnp.sum(ratio, axis=-1, keepdims=True)


# Loader's saddle-point forms (constrained_ppl.stirling): log-factorials and Poisson
# log-probabilities from small pieces, so that nothing of the size of log k! (1.3e7 at
# k = 1e6) is ever subtracted. This is what keeps float32 with x64 off (NumPyro's default,
# where the accumulation dtype is float32) exact to float32's own precision at large k.


def _stirling_error(z):
    """``log z! - (z log z - z + log sqrt(2 pi z))`` for integers ``z >= 1`` (a placeholder 0
    at ``z = 0``), in ``z``'s float dtype: tabulated up to `STIRLING_TABLE_MAX`, else the
    asymptotic series (Horner in ``1 / z^2``)."""
    table = jnp.asarray(STIRLING_ERROR_TABLE, z.dtype)
    small = table[jnp.clip(z, 0, STIRLING_TABLE_MAX).astype(jnp.int32)]
    large = jnp.maximum(z, STIRLING_TABLE_MAX + 1.0)
    inverse_square = 1.0 / (large * large)
    series = STIRLING_SERIES[-1]
    for coefficient in reversed(STIRLING_SERIES[:-1]):
        series = coefficient + inverse_square * series
    return jnp.where(z <= STIRLING_TABLE_MAX, small, series / large)


def _bd0(x, m, log_m):
    """``x log(x / m) + m - x >= 0`` for ``x >= 1`` and ``m > 0`` (``log_m = log m``, used where
    ``m`` underflows), without cancellation: the series in ``v = (x - m) / (x + m)`` where
    ``|v|`` is small, else directly (``inf`` where ``m`` is)."""
    finite = jnp.isfinite(m)
    m_safe = jnp.where(finite, m, x)
    difference = x - m_safe
    v = difference / (x + m_safe)
    v2 = v * v
    odd = 1.0 / (2 * BD0_SERIES_TERMS + 1)
    for j in range(BD0_SERIES_TERMS - 1, 0, -1):
        odd = 1.0 / (2 * j + 1) + v2 * odd
    series = difference * v + 2.0 * x * v * v2 * odd
    # log(x / m), exact near x = m, where m >= 1; below, log x - log m, two terms of one sign
    # (no cancellation), whose derivative 1 / m stays finite where the ratio's x / m^2
    # overflows (rates that underflow beside others).
    ratio_form = m_safe >= 1.0
    log_ratio = jnp.where(
        ratio_form, jnp.log(x / jnp.where(ratio_form, m_safe, 1.0)), jnp.log(x) - log_m
    )
    direct = x * log_ratio + m_safe - x
    value = jnp.where(jnp.abs(v) < BD0_SERIES_MAX_V, series, direct)
    return jnp.where(finite, value, jnp.inf)


def _log_sqrt_2pi_z_plus_stirling_error(z):
    """``log z! - z log z + z`` (``log sqrt(2 pi z) + stirling_error(z)``) for ``z >= 1``."""
    return LOG_SQRT_2PI + 0.5 * jnp.log(z) + _stirling_error(z)


def _log_poisson(z, m, log_m):
    """``log Poisson(z; m)`` for integers ``z >= 0``: ``-m`` at ``z = 0``, else
    ``-log sqrt(2 pi z) - stirling_error(z) - bd0(z, m)``."""
    z_safe = jnp.maximum(z, 1.0)
    positive = -_log_sqrt_2pi_z_plus_stirling_error(z_safe) - _bd0(z_safe, m, log_m)
    return jnp.where(z >= 1, positive, -m)


@jax.custom_jvp
def _multinomial_log_prob(counts, log_p, p, k):
    """``log k! - sum_i log z_i! + sum_i z_i log p_i`` for counts summing to ``k``, as
    ``sum_i log Poisson(z_i; k p_i) - log Poisson(k; k)`` (the Poissons' product over the
    law of their total): each term is small and exact, so nothing cancels. ``p`` (accurate
    where ``exp(log p)`` loses ``|log p|`` ulps) sets the means, ``log p`` their logarithms
    where ``k p`` underflows. The derivative is the definition's, ``log p_i - digamma(z_i +
    1)`` in ``z_i`` and ``z_i`` in ``log p_i`` (none in ``p``, ``k``): the rewrite uses
    ``sum z = k``, which a derivative in ``z`` leaves."""
    k_event = k[..., None]
    means = k_event * p
    log_means = jnp.log(jnp.maximum(k_event, 1.0)) + log_p
    log_total = jnp.where(k >= 1, _log_sqrt_2pi_z_plus_stirling_error(jnp.maximum(k, 1.0)), 0.0)
    # The Stirling parts first, then the small bd0 and -m terms: where one count holds all
    # of k (a near-certain outcome) the Stirling parts cancel exactly, and a log-probability
    # of -1e-20 is not added to and subtracted from -8.5.
    z_safe = jnp.maximum(counts, 1.0)
    stirling = jnp.where(counts >= 1, _log_sqrt_2pi_z_plus_stirling_error(z_safe), 0.0)
    deviations = jnp.where(counts >= 1, _bd0(z_safe, means, log_means), means)
    return (log_total - jnp.sum(stirling, -1)) - jnp.sum(deviations, -1)


@_multinomial_log_prob.defjvp
def _multinomial_log_prob_jvp(primals, tangents):
    counts, log_p, p, k = primals
    counts_dot, log_p_dot, _, _ = tangents
    value = _multinomial_log_prob(counts, log_p, p, k)
    slope = log_p - digamma(counts + 1.0)
    return value, jnp.sum(counts_dot * slope, -1) + jnp.sum(log_p_dot * counts, -1)


def _log_poisson_of_total(rate, k):
    """``log Poisson(k; sum(rate))`` in the accumulation dtype without cancellation; the sum
    as ``max * sum(rate / max)`` (``inf`` only where the true sum overflows, where the
    result, about ``-sum(rate)``, is ``-inf``)."""
    rate = rate.astype(_accumulation_dtype())
    largest = jnp.max(rate, axis=-1)
    ratio_sum = jnp.sum(rate / largest[..., None], axis=-1)
    total = largest * ratio_sum
    log_total = jnp.log(largest) + jnp.log(ratio_sum)
    return _log_poisson(k.astype(total.dtype), total, log_total)


def _log_prob_and_support(rate, k, value, *, dtype, total_below_2_to_the_m: bool):
    """``log_prob`` (``-inf`` off the support) in ``dtype``, accumulated in
    `_accumulation_dtype`, and the support indicator, one compiled call."""
    in_support, _ = _is_integer_composition(value, k, total_below_2_to_the_m=total_below_2_to_the_m)
    # gammaln(z + 1) at a negative integer is inf and its derivative NaN: evaluate off the
    # support at 0 instead (those entries get -inf below). where, not maximum:
    # maximum(z, 0) halves the gradient at z = 0.
    value = jnp.where(in_support[..., None], value, 0)
    log_p = _log_probs_only(rate)
    accumulation = log_p.dtype
    counts = value.astype(accumulation)
    k = jnp.broadcast_to(k, in_support.shape).astype(accumulation)
    # Off the support (or a negative k) the terms are finite placeholders: masked below.
    k = jnp.maximum(k, 0.0)
    log_prob = _multinomial_log_prob(counts, log_p, lax.stop_gradient(_probs_only(rate)), k)
    return jnp.where(in_support, log_prob, -jnp.inf).astype(dtype), in_support


def _relative_entropy(rate_p, rate_q):
    """``sum_i p_i log(p_i / q_i)`` for ``p = rate_p / sum(rate_p)``, ``q`` likewise, in the
    accumulation dtype, as ``sum_i q_i f(d_i)`` with ``d_i = log(p_i / q_i)`` and
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
    accumulation = _accumulation_dtype()
    rate_p, rate_q = jnp.broadcast_arrays(rate_p.astype(accumulation), rate_q.astype(accumulation))
    log_p = _log_probs_only(rate_p)
    log_q = _log_probs_only(rate_q)
    largest = jnp.maximum(jnp.max(rate_p, -1, keepdims=True), jnp.max(rate_q, -1, keepdims=True))
    _, exponent = jnp.frexp(lax.stop_gradient(largest))
    scale = jnp.ldexp(jnp.ones_like(largest), -exponent)
    a = rate_p * scale
    b = rate_q * scale
    total_a = jnp.sum(a, -1, keepdims=True)
    total_b = jnp.sum(b, -1, keepdims=True)
    difference = a - b
    numerator = difference * total_b - b * jnp.sum(difference, -1, keepdims=True)
    # Above sqrt(tiny): the derivative of the ratio below divides by the square of b.
    resolvable = math.sqrt(jnp.finfo(accumulation).tiny) * UNDERFLOW_MARGIN
    # Only where the two are close: far apart, D_i B - b_i D cancels (rates 1 beside 1e10),
    # and the difference of the logarithms, at least 1/2, is accurate.
    log_difference = log_p - log_q
    close = jnp.abs(lax.stop_gradient(log_difference)) < KL_SERIES_MAX_D
    precise = close & (a > resolvable) & (b > resolvable)
    denominator = jnp.where(precise, b * total_a, 1.0)
    ratio_minus_one = jnp.where(precise, numerator / denominator, 0.0)
    d = jnp.where(precise, jnp.log1p(ratio_minus_one), log_difference)
    small = jnp.abs(d) < KL_SERIES_MAX_D
    d_small = jnp.where(small, d, 0.0)
    series = KL_SERIES[-1]
    for coefficient in reversed(KL_SERIES[:-1]):
        series = coefficient + d_small * series
    q_prob = jnp.exp(log_q)
    near = q_prob * (d_small * d_small * series)
    far = jnp.exp(log_p) * (jnp.where(small, 1.0, d) - 1.0) + q_prob
    return jnp.sum(jnp.maximum(jnp.where(small, near, far), 0.0), -1)


def _mode_counts(log_p, k, k_bound: int):
    """A most likely composition of ``k`` (``0 <= k <= k_bound``, shape ``batch``) for
    ``Multinomial(k, p)``, as counts of ``log_p``'s dtype (shape ``batch + (n,)``); no loop,
    so its cost does not grow with the units to hand out. The algorithm of Pyro's
    ``_mode_counts`` (which says why it is exact): the lower bound
    ``floor(k p (1 - (n + 8) eps))``, then the ``k - sum L`` candidate units of largest gain
    ``log p_i - log(z + 1)``, chosen by one stable sort, ties to the lower index."""
    n = log_p.shape[-1]
    eps = float(jnp.finfo(log_p.dtype).eps)
    k = k.astype(log_p.dtype)
    p = jnp.exp(log_p)
    lower = jnp.clip(jnp.floor(k[..., None] * p * (1 - (n + 8) * eps)), 0, k[..., None])
    remaining = jnp.maximum(k - lower.sum(-1), 0)
    spread = n + 2 * (n + 8) * eps * k[..., None]
    width = (jnp.floor(p * spread * (1 + 2.0**-20)) + 1).astype(jnp.int32)
    slots = mode_candidate_slots(n, k_bound, eps)
    ends = jnp.cumsum(width, -1)
    slot = jnp.arange(slots, dtype=jnp.int32)
    search = jnp.vectorize(lambda e: jnp.searchsorted(e, slot, side="right"), signature="(n)->(m)")
    owner = search(ends)
    valid = owner < n
    owner = jnp.minimum(owner, n - 1)
    # The count before the unit: the owner's lower bound plus the unit's place in its run.
    place = slot - jnp.take_along_axis(ends - width, owner, -1)
    before = jnp.take_along_axis(lower, owner, -1) + place.astype(log_p.dtype)
    key = jnp.where(valid, jnp.log1p(before) - jnp.take_along_axis(log_p, owner, -1), jnp.inf)
    order = jnp.argsort(key, axis=-1, stable=True)
    kept = (slot < remaining[..., None]).astype(log_p.dtype)
    chosen = jnp.take_along_axis(owner, order, -1)
    add = jnp.vectorize(lambda low, at, w: low.at[at].add(w), signature="(n),(m),(m)->(n)")
    return add(lower, chosen, kept)
