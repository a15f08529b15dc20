"""Independent Poissons conditioned on their sum: ``ConditionedPoisson(rate, k=k)``.

``z_i ~ Poisson(rate_i)`` independently, conditioned on ``sum_i z_i = k``, is
``Multinomial(k, p)`` with ``p = rate / sum(rate)`` (docs/distributions/conditioned_poisson.md).
Unlike ``numpyro.distributions.Multinomial``, ``k`` may vary over the batch (bags with different
known totals) and be traced under ``jit`` / ``vmap``, the support check demands ``sum z == k``
exactly, ``sample`` carries the straight-through marginal-expectation gradient, and the entropy is
exact and fast.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.special import digamma, gammaln, logsumexp
from numpyro.distributions import Binomial, constraints
from numpyro.distributions.batch_util import vmap_over
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.kl import kl_divergence
from numpyro.util import not_jax_tracer

from constrained_ppl.arguments import (
    DISCRETE_GRAD_ESTIMATORS,
    check_count,
    check_grad_estimator,
    check_static_bound,
    check_value_shape,
    keyword_only,
)
from constrained_ppl.binomial_tails import bennett_deviation, entropy_log_inverse_tail
from constrained_ppl.enumeration import check_support_size, compositions, single_count
from constrained_ppl.exact_integers import (
    check_k_max_bounds_k,
    check_total_in_exact_range,
    largest_exact_integer,
)
from constrained_ppl.stirling import (
    BD0_SERIES_MAX_V,
    BD0_SERIES_TERMS,
    LOG_SQRT_2PI,
    STIRLING_ERROR_TABLE,
    STIRLING_SERIES,
    STIRLING_TABLE_MAX,
)
from numpyro_constrained._batching import check_expand, vmap_over_broadcast_leaves
from numpyro_constrained._compat import refuse_scalar_coordinate_consumers
from numpyro_constrained._repr import parameters_repr
from numpyro_constrained.validation import as_concrete_where_possible, warn_if_out_of_support

__all__ = ["ConditionedPoisson", "integer_composition", "positive_finite"]

# Draw categorical indices (O(k log n) per event) unless k is this many times larger than n,
# where n sequential binomial draws (O(n) per event) are cheaper.
SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY = 32


class _PositiveFinite(type(constraints.positive)):
    """Real numbers in (0, inf): ``constraints.positive`` lets ``inf`` through.

    A ``constraints.greater_than`` with ``lower_bound = 0`` (as ``positive`` is), so that
    code reading that bound (the value generators of NumPyro's generic distribution tests)
    treats it as ``positive``. No ``biject_to``: ``exp`` overflows to ``inf``.
    """

    def __call__(self, x):
        xp = jnp if isinstance(x, jax.Array) else np
        return (x > 0) & xp.isfinite(x)

    def feasible_like(self, prototype):
        return jnp.ones_like(prototype)

    def eq(self, other, static: bool = False):
        return isinstance(other, _PositiveFinite)

    def __repr__(self) -> str:
        return "PositiveFinite()"


positive_finite = _PositiveFinite()


def _is_integer_composition(value, total, *, total_below_2_to_the_m: bool = False):
    """Whether each vector (last axis) of ``value`` is in the support, and whether all its
    entries are ``>= 0``.

    Exact for any dtype of ``value``: a float sum that rounds (``2**24 - 1 + 1 + 1`` is
    ``2**24`` in float32) cannot pass for ``total``. Floats are summed as they are where the
    caller knows ``total < 2**m`` (``m`` their significand bits), else, like integers,
    checked to lie in ``[0, total]`` and summed as integers.
    """
    is_jax = isinstance(value, jax.Array) or isinstance(total, jax.Array)
    xp = jnp if is_jax else np
    value = xp.asarray(value)
    total = xp.asarray(total)
    is_nonnegative = value >= 0
    entry_ok = is_nonnegative
    if xp.issubdtype(value.dtype, xp.floating):
        # floor(inf) == inf, so finiteness is checked separately; NaN fails every comparison.
        entry_ok = entry_ok & (value == xp.floor(value)) & xp.isfinite(value)
        if total_below_2_to_the_m:
            # Non-negative integers with a true sum up to 2**m are summed exactly in any
            # order; a larger true sum rounds to at least 2**m > total. (A traced total at
            # or above 2**m, beyond the static k_max the caller relied on, fails.)
            limit = largest_exact_integer(str(value.dtype))
            in_support = (
                xp.all(entry_ok, axis=-1) & (xp.sum(value, axis=-1) == total) & (total < limit)
            )
            return in_support, xp.all(is_nonnegative, axis=-1)
    entry_ok = entry_ok & (value <= total[..., None])
    counts = xp.where(entry_ok, value, 0)
    integer = jnp.result_type(int) if is_jax else np.int64
    # Entries in [0, total]: the cast is exact; a sum that wrapped around the integer range
    # is far above total as a float.
    in_support = (
        xp.all(entry_ok, axis=-1)
        & (xp.sum(counts.astype(integer), axis=-1) == total.astype(integer))
        & (xp.sum(counts, axis=-1) <= 2 * total + 1)
    )
    return in_support, xp.all(is_nonnegative, axis=-1)


class _IntegerComposition(constraints.Constraint):
    """Integer vectors ``z >= 0`` (last axis) with ``sum(z) == total`` exactly.

    NumPyro's ``constraints.multinomial`` does not check that the entries are integers.
    """

    is_discrete = True
    event_dim = 1

    def __init__(self, total) -> None:
        self.total = total

    def __call__(self, x):
        return _is_integer_composition(x, self.total)[0]

    def feasible_like(self, prototype):
        # All of the total in the first category.
        first = jnp.broadcast_to(jnp.asarray(self.total, prototype.dtype), prototype.shape[:-1])
        return jnp.zeros_like(prototype).at[..., 0].set(first)

    def tree_flatten(self):
        return (self.total,), (("total",), dict())

    def eq(self, other, static: bool = False):
        if not isinstance(other, _IntegerComposition):
            return False
        if static:
            return self.total is other.total
        return jnp.array_equal(self.total, other.total)

    def __repr__(self) -> str:
        return f"IntegerComposition(total={self.total})"


integer_composition = _IntegerComposition


def _finite_log_zero(dtype) -> float:
    """A finite stand-in for ``log 0``: up to 1e8 times it, ``exp`` still underflows to 0, and
    unlike ``-inf`` it gives 0 (not NaN) times 0 and in gradients."""
    return float(jnp.finfo(dtype).min) / 1e8


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
    tiny = float(jnp.finfo(x.dtype).tiny) * 2.0**30
    finite = jnp.isfinite(m)
    m_safe = jnp.where(finite, m, x)
    difference = x - m_safe
    v = difference / (x + m_safe)
    v2 = v * v
    odd = 1.0 / (2 * BD0_SERIES_TERMS + 1)
    for j in range(BD0_SERIES_TERMS - 1, 0, -1):
        odd = 1.0 / (2 * j + 1) + v2 * odd
    series = difference * v + 2.0 * x * v * v2 * odd
    normal = m_safe > tiny
    log_ratio = jnp.where(normal, jnp.log(x / jnp.where(normal, m_safe, 1.0)), jnp.log(x) - log_m)
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


def _log_factorial_step(c, j):
    """``D = log j! - log c! - (j - c) log(c + 1)`` for integers ``c, j >= 0`` (floats in the
    accumulation dtype) without subtracting log-factorials: for ``c, j >= 1``,
    ``bd0(j, c) - t log(1 + 1/c) + log(j / c) / 2 + stirling_error(j) - stirling_error(c)``
    (``t = j - c``); ``c log(1 + 1/c) + c - log sqrt(2 pi c) - stirling_error(c)`` at
    ``j = 0``; ``log j!`` at ``c = 0``. What the float32 entropy sums (about ``t^2 / (2c)``,
    exactly 0 at ``t = 0``)."""
    c_safe = jnp.maximum(c, 1.0)
    j_safe = jnp.maximum(j, 1.0)
    t = j_safe - c_safe
    stirling_c = _stirling_error(c_safe)
    both = (
        _bd0(j_safe, c_safe, jnp.log(c_safe))
        - t * jnp.log1p(1.0 / c_safe)
        + 0.5 * jnp.log1p(t / c_safe)
        + (_stirling_error(j_safe) - stirling_c)
    )
    to_zero = c_safe * jnp.log1p(1.0 / c_safe) + c_safe - LOG_SQRT_2PI - 0.5 * jnp.log(c_safe)
    to_zero = to_zero - stirling_c
    from_zero = jnp.where(j <= 1, 0.0, gammaln(j_safe + 1.0))
    return jnp.where(c < 1, from_zero, jnp.where(j < 1, to_zero, both))


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


# Above this k_max the entropy evaluates log m! directly instead of tabulating m = 0..k_max.
LOG_FACTORIAL_TABLE_MAX_SIZE = 2**20


def _log_factorial(m, k_max: int, dtype):
    """``log m!`` for integer arrays ``0 <= m <= k_max`` in ``dtype``: gathered from a table
    for moderate ``k_max``, else ``gammaln``; ``log 0! = log 1! = 0`` exactly (JAX's float32
    ``gammaln(1)`` is not)."""
    if k_max + 1 <= LOG_FACTORIAL_TABLE_MAX_SIZE:
        return gammaln(jnp.arange(k_max + 1, dtype=dtype) + 1).at[:2].set(0.0)[m]
    return jnp.where(m <= 1, 0.0, gammaln(m.astype(dtype) + 1))


def _entropy_window(log_p, log1m_p, k, k_max: int, eps: float) -> tuple[int, int]:
    """Half-width and width (static) of the window of binomial outcomes summed over.

    A window ``[floor(mean) - half_width, floor(mean) + half_width + 1]`` clipped to
    ``[0, k]`` holds every outcome within ``t`` of the mean, ``t`` from Bennett's
    inequality (`bennett_deviation`) at the largest variance in the batch when the rates
    and ``k`` are concrete, else at the bound ``k p (1 - p) <= k_max / 4``.
    """
    n = log_p.shape[-1]
    log_inverse_tail = entropy_log_inverse_tail(n, k_max, eps)
    concrete = not_jax_tracer(log_p) and not_jax_tracer(k) and log_p.size > 0
    if concrete:
        k_np = np.broadcast_to(np.asarray(k)[..., None], log_p.shape)
        mean = k_np * np.exp(np.asarray(log_p, dtype=np.float64))
        max_variance = float(np.max(mean * np.exp(np.asarray(log1m_p, dtype=np.float64))))
    else:
        max_variance = k_max / 4.0
    # +1: floor(mean) may be off by one from the exact floor through rounding.
    half_width = math.ceil(bennett_deviation(max_variance, log_inverse_tail)) + 1
    if concrete:
        floor_mean = np.floor(mean)
        first = np.maximum(floor_mean - half_width, 0)
        last = np.minimum(floor_mean + half_width + 1, k_np)
        width = int(np.max(last - first)) + 1
    else:
        width = 2 * half_width + 2
    return half_width, max(1, min(width, k_max + 1))


@partial(jax.jit, static_argnames=("k_max", "half_width", "width", "dtype"))
def _entropy(log_p, log1m_p, k, *, k_max: int, half_width: int, width: int, dtype):
    """``-log k! - k sum_i p_i log p_i + sum_i E[log z_i!]`` from ``log p``, ``log(1 - p)``
    (`_normalized_log_probs`, ``n >= 2``), in `_accumulation_dtype`; NaN where ``k > k_max``.

    ``E[log z_i!]`` for ``z_i ~ Binomial(k, p_i)`` sums over the outcome windows of
    `_entropy_window`; the outcomes outside them are dropped, see
    `entropy_log_inverse_tail`. Everything large is centred in the accumulation dtype, so
    that float32 loses nothing at large k (``log k!`` is 1e6 at k = 1e5; its float32
    rounding alone is 0.06 nats). With ``c = floor(k p)`` and ``j = c + t``::

        log Binomial(j; k, p) - log Binomial(c; k, p) = t delta - G[t],
        G[t] = log j! - log c! + log (k-j)! - log (k-c)! - t log((c + 1/2) / (k - c + 1/2)),
        delta = log(p / (1-p)) - log((c + 1/2) / (k - c + 1/2)),

    ``delta`` is O(1 / variance) and ``G`` about ``t^2 / (2 variance)``; and
    ``E[log z!] = log c! + (k p - c) log(c + 1) + E[D]`` with
    ``D[t] = log j! - log c! - t log(c + 1)``, about ``t^2 / (2c)`` and exactly 0 at the two
    outcomes ``c``, ``c + 1`` that can be the mode, so that a near-certain count (entropy
    1e-28, say) leaves nothing to cancel. The window sums
    run in ``dtype`` on those small quantities; normalising the weights over the window
    makes ``log Binomial(c; k, p)`` unnecessary.
    """
    accumulation = log_p.dtype
    integer = jnp.result_type(int)
    k_event = jnp.broadcast_to(jnp.expand_dims(k, -1), log_p.shape).astype(integer)
    k_float = k_event.astype(accumulation)
    mean = k_float * jnp.exp(log_p)
    # k p <= k since p <= 1; the window holds c.
    center = jnp.clip(jnp.floor(lax.stop_gradient(mean)).astype(integer), 0, k_event)
    first = jnp.maximum(center - half_width, 0)
    # A window running past k moves left, so that it holds no outcome beyond k if it can.
    first = jnp.minimum(first, jnp.maximum(k_event + 1 - width, 0))
    j = first[..., None] + jnp.arange(width, dtype=integer)
    in_range = j <= k_event[..., None]
    j = jnp.minimum(j, k_event[..., None])
    t = (j - center[..., None]).astype(accumulation)
    c_float = center.astype(accumulation)[..., None]

    def log_factorial(m):
        return _log_factorial(m, k_max, accumulation)

    log_shift = jnp.log1p(c_float)
    odds_shift = jnp.log(c_float + 0.5) - jnp.log(k_float[..., None] - c_float + 0.5)
    # Without float64 (x64 off), log j! - log c! keeps no digit at large k: D and G from
    # Loader's small pieces instead (see _log_factorial_step), where float64 keeps the
    # tabulated log-factorials, whose exact cancellation the grouping at the end relies on.
    stable = accumulation == np.dtype(np.float32)
    if stable:
        k_column = k_float[..., None]
        j_float = j.astype(accumulation)
        d = _log_factorial_step(c_float, j_float)
        g = (
            d
            + _log_factorial_step(k_column - c_float, k_column - j_float)
            + t * (jnp.log1p(0.5 / (c_float + 0.5)) - jnp.log1p(0.5 / (k_column - c_float + 0.5)))
        )
    else:
        log_c_factorial = log_factorial(center)
        d = log_factorial(j) - log_c_factorial[..., None] - t * log_shift
        # G written from D (the same numbers): XLA fuses this form into the two sums below; G
        # and D each written from log j! ran twice as long.
        g = (
            d
            + (log_factorial(k_event[..., None] - j) - log_factorial(k_event - center)[..., None])
            - t * (odds_shift - log_shift)
        )
    delta = (log_p - log1m_p)[..., None] - odds_shift
    log_weights = t.astype(dtype) * delta.astype(dtype) - g.astype(dtype)
    weights = jnp.where(in_range, jnp.exp(log_weights), 0.0)
    expected_d = jnp.sum(weights * d.astype(dtype), axis=-1) / jnp.sum(weights, axis=-1)
    # k p - c without cancellation where p is near 1: (k - c) - k (1 - p) there.
    mean_minus_center = jnp.where(
        log_p > -math.log(2),
        (k_float - c_float[..., 0]) - k_float * jnp.exp(log1m_p),
        mean - c_float[..., 0],
    )
    if stable:
        entropy = _entropy_from_stirling_pieces(
            c_float[..., 0], mean_minus_center, expected_d, k_float[..., 0]
        )
        return jnp.where(k > k_max, jnp.nan, entropy)
    correction = mean_minus_center * log_shift[..., 0] + expected_d
    cross_entropy = k_float[..., 0] * jnp.sum(jnp.exp(log_p) * log_p, axis=-1)
    # Grouped so that a near-certain outcome (entropy 1e-28 beside log k! = 8.5, say)
    # keeps its relative accuracy: the log-factorials cancel exactly there.
    log_factorials = jnp.sum(log_c_factorial, axis=-1) - _log_factorial_of_total(k_float[..., 0])
    entropy = log_factorials + (jnp.sum(correction, axis=-1) - cross_entropy)
    # k_max is a static bound given by the user when k is traced: a k above it is
    # detected here, not silently computed with a table too short.
    return jnp.where(k > k_max, jnp.nan, entropy)


def _entropy_from_stirling_pieces(center, mean_minus_center, expected_d, k):
    """The entropy ``sum_i E[-log Poisson(z_i; m_i)] + log Poisson(k; k)`` (``m = k p``,
    ``z_i ~ Binomial(k, p_i)``; the multinomial as the Poissons' product over the law of
    their total) from ``c = floor(m)``, ``m - c`` and ``E[D]`` (`_entropy`), without a term
    of the size of ``log k!``: with ``delta = m - c``,
    ``E[-log Poisson(z; m)] = log c! + delta log(c + 1) - m log m + m + E[D]``, which is
    ``log sqrt(2 pi c) + stirling_error(c) + (delta - c log(1 + delta / c))
    + delta log(1 + (1 - delta) / m) + E[D]`` for ``c >= 1`` and ``m - m log m + E[D]`` for
    ``c = 0``. The largest ``c`` is taken together with ``log Poisson(k; k)``: equal to
    ``k`` (a near-certain outcome), their ``log sqrt(2 pi c)`` and Stirling errors cancel
    exactly, so that an entropy of 1e-28 keeps its relative accuracy."""
    n = center.shape[-1]
    c_safe = jnp.maximum(center, 1.0)
    m = center + mean_minus_center
    m_safe = jnp.where(center >= 1, m, 1.0)
    smooth = (mean_minus_center - c_safe * jnp.log1p(mean_minus_center / c_safe)) + (
        mean_minus_center * jnp.log1p((1.0 - mean_minus_center) / m_safe)
    )
    m_small = jnp.where(center >= 1, 0.0, m)
    # log of a placeholder 1 at m = 0 (k = 0, or p underflowing): xlogy's derivative there,
    # log m + 1, is -inf, and times dm = 0 NaN.
    log_m_small = jnp.log(jnp.where(m_small > 0, m_small, 1.0))
    rest = jnp.where(center >= 1, smooth, m_small - m_small * log_m_small)
    stirling = jnp.where(center >= 1, _log_sqrt_2pi_z_plus_stirling_error(c_safe), 0.0)
    k_safe = jnp.maximum(k, 1.0)
    stirling_total = jnp.where(k >= 1, _log_sqrt_2pi_z_plus_stirling_error(k_safe), 0.0)
    is_top = jnp.arange(n) == jnp.argmax(center, axis=-1)[..., None]
    c_top = jnp.sum(jnp.where(is_top, center, 0.0), axis=-1)
    c_top_safe = jnp.maximum(c_top, 1.0)
    top_minus_total = jnp.where(
        (c_top >= 1) & (k >= 1),
        0.5 * jnp.log1p((c_top_safe - k_safe) / k_safe)
        + (_stirling_error(c_top_safe) - _stirling_error(k_safe)),
        jnp.sum(jnp.where(is_top, stirling, 0.0), axis=-1) - stirling_total,
    )
    others = jnp.sum(jnp.where(is_top, 0.0, stirling), axis=-1)
    return others + top_minus_total + jnp.sum(rest + expected_d, axis=-1)


def _log_factorial_of_total(k):
    """``log k!`` for the (non-differentiable) total ``k``, exactly 0 for ``k <= 1``
    (JAX's float32 ``gammaln(1)`` is not)."""
    return jnp.where(k <= 1, 0.0, gammaln(k + 1))


@partial(jax.jit, static_argnames=("dtype", "total_below_2_to_the_m"))
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


@partial(jax.jit, static_argnames=("k_max", "sample_shape", "dtype"))
def _sample_counts_categorical(key, rate, k, *, k_max: int, sample_shape: tuple[int, ...], dtype):
    """Exact counts from ``k_max`` categorical draws per event, those past each event's own
    ``k`` masked out: inverse-CDF search (O(k log n)), not Gumbel-max (O(k n)). NaN where
    ``k > k_max`` (a traced ``k`` above the static bound)."""
    batch_shape, n = rate.shape[:-1], rate.shape[-1]
    rows = math.prod(batch_shape)
    num_samples = math.prod(sample_shape)
    # The rates over the largest, not the rates: their sum could overflow (float32 rates
    # near 1e38). In the accumulation dtype (float64 where JAX has it) whatever the rates'
    # dtype: a float32 cumulative sum of the categories in their order and float32 uniforms
    # resolve probabilities only to 2**-24 of the total, so that a category of probability
    # 3 * 2**-24 after a large one got one or two grid points (2/3 or 4/3 of its probability)
    # instead of 1.5.
    accumulation = _accumulation_dtype()
    weights = rate.astype(accumulation)
    weights = (weights / jnp.max(weights, axis=-1, keepdims=True)).reshape(rows, n)
    shape = (rows, num_samples * k_max)
    if accumulation == np.dtype(np.float32):
        # Without float64 (x64 off): the categories in increasing order, so that the small
        # ones lie near 0, where float32 resolves their cumulative sums to a few ulps of
        # their own size, and uniforms that keep float32's relative precision down to
        # 2**-64 (two 32-bit words; a plain float32 uniform is a grid of step 2**-23).
        order = jnp.argsort(weights, axis=-1)
        weights = jnp.take_along_axis(weights, order, axis=-1)
        high, low = jax.random.bits(key, (2,) + shape, jnp.uint32)
        uniforms = high.astype(accumulation) * 2.0**-32 + low.astype(accumulation) * 2.0**-64
    else:
        uniforms = jax.random.uniform(key, shape, dtype=accumulation)
    cumulative = jnp.cumsum(weights, axis=-1)
    # Scaling by the last cumulative sum (not 1) makes the search match the rounded cumsum.
    targets = uniforms * cumulative[:, -1:]
    draws = jax.vmap(lambda c, t: jnp.searchsorted(c, t, side="right"))(cumulative, targets)
    draws = jnp.minimum(draws, n - 1)
    if accumulation == np.dtype(np.float32):
        draws = jnp.take_along_axis(order, draws, axis=-1)
    draws = draws.reshape(rows, num_samples, k_max)
    k_rows = jnp.broadcast_to(k, batch_shape).reshape(rows, 1, 1)
    keep = (jnp.arange(k_max) < k_rows).astype(dtype)
    sample_index = jnp.arange(num_samples)[:, None]

    def count(row_draws, row_keep):
        return jnp.zeros((num_samples, n), dtype).at[sample_index, row_draws].add(row_keep)

    # One scatter per row under vmap, not one scatter with a row index: the vmapped scatter
    # carries the rows as a batching dimension, so a batch sharded over devices is counted
    # where it lives; XLA cannot partition a scatter whose row index is data, and made every
    # device build the whole batch's counts and all-reduce them.
    counts = jax.vmap(count)(draws, jnp.broadcast_to(keep, draws.shape))
    counts = jnp.where(k_rows > k_max, jnp.nan, counts)
    counts = jnp.moveaxis(counts, 1, 0)
    return counts.reshape(sample_shape + batch_shape + (n,))


@partial(jax.jit, static_argnames=("sample_shape", "dtype"))
def _sample_counts_sequentially(key, log_p, k, *, sample_shape: tuple[int, ...], dtype):
    """``z_i ~ Binomial(k - z_1 - ... - z_{i-1}, p_i / sum_{j >= i} p_j)``, the last
    coordinate taking the remainder: O(n) binomial draws per event whatever k is, and no
    static bound on k needed (k may be traced)."""
    shape = sample_shape + log_p.shape[:-1]
    n = log_p.shape[-1]
    # Tail sums in log space, not 1 - cumsum(p): no cancellation for the last categories
    # and no underflow of tiny ones.
    log_tail = lax.cumlogsumexp(log_p, axis=log_p.ndim - 1, reverse=True)
    conditional_p = jnp.clip(jnp.exp(log_p - log_tail), 0.0, 1.0).astype(dtype)
    conditional_p = jnp.moveaxis(jnp.broadcast_to(conditional_p, shape + (n,)), -1, 0)
    remaining = jnp.broadcast_to(jnp.asarray(k, dtype), shape)

    def draw(remaining, key_and_p):
        key_i, p_i = key_and_p
        z_i = jax.random.binomial(key_i, remaining, p_i, shape=shape, dtype=dtype)
        # The binomial sampler may round; the count can never exceed what is left.
        z_i = jnp.minimum(jnp.round(z_i), remaining)
        return remaining - z_i, z_i

    keys = jax.random.split(key, n - 1) if n > 1 else jnp.zeros((0,) + key.shape, key.dtype)
    remaining, counts = lax.scan(draw, remaining, (keys, conditional_p[:-1]))
    counts = jnp.concatenate([counts, remaining[None]], axis=0)
    return jnp.moveaxis(counts, 0, -1)


class ConditionedPoisson(Distribution):
    r"""Independent ``Poisson(rate_i)`` counts conditioned on summing to exactly ``k``.

    The conditional distribution is ``Multinomial(k, p)`` with ``p = rate / sum(rate)``
    (only the rates' proportions matter)::

        log_prob(z) = log k! - sum_i log z_i! + sum_i z_i log p_i

    on integer vectors ``z >= 0`` with ``sum_i z_i = k``, with respect to counting measure
    on that set. ``k`` is a count (below) broadcast with ``rate.shape[:-1]``: the batch
    shape is the broadcast of the two, the event shape ``rate.shape[-1:]``.

    ``sample`` returns an exact sample whose gradient is the straight-through
    marginal-expectation estimator through ``E[z] = k p``
    (docs/distributions/gradient_estimators.md): the value is exactly integer and sums exactly to
    ``k``; ``has_rsample`` is true, so ``Trace_ELBO`` treats the site as reparameterised.
    It is biased wherever the downstream function of ``z`` is not linear in ``z``. With
    ``grad_estimator="score_function"``, ``sample`` returns the exact draw under
    ``stop_gradient`` and ``has_rsample`` is ``False`` (unbiased, higher variance).
    NumPyro's ``Trace_ELBO`` (0.22) has no score-function term: it would leave out the
    score term of such a site, so use ``TraceGraph_ELBO``, which adds it, Rao-Blackwellised
    over the costs downstream of the site (NumPyro has no baselines). Which to choose:
    docs/distributions/choosing_gradient_estimator.md.
    ``marginals`` are ``Binomial(k, p_i)``.

    Numerics: ``p`` is normalised in log space, and ``log_prob``, ``entropy``, ``mean``,
    ``variance``, KL and ``log_constraint_prob`` accumulate in float64 where JAX has it
    (``jax_enable_x64``; float32 otherwise, with float32's cancellation at large ``k``)
    before rounding to ``rate``'s dtype. ``k`` and the samples live in ``rate``'s dtype,
    which must hold every count exactly: ``k`` (or ``k_max``) above ``2**24`` (float32) or
    ``2**53`` (float64) is a ``ValueError``.

    ``k``: an int, an integer array, or whole-number floats (``3.0``, as
    ``Binomial.total_count``); ``3.5``, a bool, a complex number or NaN is a ``ValueError``
    whatever ``validate_args`` says (`constrained_ppl.arguments.check_count`). A
    negative ``k`` is a ``ValueError`` with validation on; with it off (or with a traced
    ``k``, which cannot be checked) a negative or fractional ``k`` gives ``-inf``
    log-probabilities and NaN ``mean``, ``variance``, ``entropy`` and samples, never a
    finite number.

    ``k_max``, a static bound on ``k``, is kept exactly as given (None or an int): it is pytree
    aux data, so that a distribution built with a concrete ``k`` and one built with a traced
    ``k`` have the same tree structure (a ``lax.scan`` carry, a ``jit`` argument). The size of
    the tables a call needs is decided when it is called: from ``k``'s values when ``k`` is
    concrete, else from ``k_max`` (the attribute ``k_max`` is what was passed, as in
    ``ExactlyKBernoulli`` and in Pyro). A traced ``k`` without ``k_max`` has none: ``sample``
    then draws sequential binomials, ``entropy`` raises. A concrete ``k`` above ``k_max`` is a
    ``ValueError``; a traced ``k`` above it gives ``-inf`` log-probabilities and NaN moments
    and samples rather than anything silently wrong. A traced ``k`` beyond the exact integers
    of ``rate``'s dtype without ``k_max`` cannot be detected.

    Parameter constraints: ``rate`` has event_dim 1 (its last axis is the event), ``k``
    event_dim 0, which is what ``promote_batch_shape`` (``numpyro.contrib.control_flow.scan``)
    reads.

    :param rate: positive, finite Poisson rates, shape ``batch + (n,)``.
    :param k: the known total, a non-negative integer (per batch element or shared), as
        above.
    :param k_max: a static upper bound on ``k`` (a Python int), needed only where ``k`` is
        traced (an argument of ``jit``, ``vmap``, ``scan``): with it, sampling keeps the
        categorical sampler, and ``entropy`` and the expected L1 loss are possible.
    :param grad_estimator: ``"marginal_expectation"`` (default) or ``"score_function"``
        (above); anything else is a ``ValueError`` naming the two.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> import numpyro.distributions as dist
    >>> from numpyro_constrained import ConditionedPoisson
    >>> rate = jnp.array([1.0, 2.0, 5.0])
    >>> d = ConditionedPoisson(rate, k=8)
    >>> d
    ConditionedPoisson(rate: (3,), k: 8)
    >>> np.round(d.mean, 4).tolist()  # k p, with p = rate / sum(rate)
    [1.0, 2.0, 5.0]
    >>> z = d.sample(jax.random.PRNGKey(0), (4,))  # exact integer draws summing to 8
    >>> z.shape, bool((z.sum(-1) == 8).all()), bool((z == jnp.round(z)).all())
    ((4, 3), True, True)
    >>> value = jnp.array([1.0, 2.0, 5.0])
    >>> multinomial = dist.Multinomial(8, probs=rate / rate.sum())
    >>> bool(jnp.isclose(d.log_prob(value), multinomial.log_prob(value)))
    True
    """

    arg_constraints = {
        "rate": constraints.independent(positive_finite, 1),
        "k": constraints.nonnegative_integer,
    }
    reparametrized_params = ["rate"]
    pytree_data_fields = ("rate", "k")
    has_enumerate_support = True
    #: The largest support that `enumerate_support` builds (a ``ValueError`` beyond it).
    max_support = 2**16
    # Exactly what the user passed, never derived from k: see the class docstring.
    pytree_aux_fields = ("k_max", "grad_estimator")
    #: Set per instance by __init__ (pytree aux data); see the class docstring.
    grad_estimator = "marginal_expectation"

    @keyword_only("k", usage="ConditionedPoisson(rate, k=k)")
    def __init__(
        self,
        rate,
        *,
        k,
        k_max: int | None = None,
        grad_estimator: str = "marginal_expectation",
        validate_args: bool | None = None,
    ) -> None:
        self.grad_estimator = check_grad_estimator(grad_estimator, DISCRETE_GRAD_ESTIMATORS)
        k_max = check_static_bound(k_max)
        check_count(k, concrete=not_jax_tracer(k), name="k")
        # Constants closed over inside jit stay concrete here (NumPyro's own validation
        # evaluates them so too), so that they are still checked and size the tables;
        # tracers stay tracers.
        with jax.ensure_compile_time_eval():
            rate = jnp.asarray(rate)
            if not jnp.issubdtype(rate.dtype, jnp.floating):
                rate = rate.astype(jnp.result_type(float))
            if rate.ndim < 1:
                raise ValueError(
                    "rate must have at least one dimension (the categories), got shape "
                    f"{rate.shape}"
                )
            if rate.shape[-1] < 1:
                raise ValueError("rate must have at least one category (rate.shape[-1] >= 1)")
            k = jnp.asarray(k)
            if not_jax_tracer(k):
                largest_k = _largest_finite(np.asarray(k))
                if largest_k is not None:
                    if k_max is not None:
                        check_k_max_bounds_k(k_max, largest_k)
                    if jnp.issubdtype(k.dtype, jnp.floating):
                        check_total_in_exact_range(largest_k, str(k.dtype), argument="k")
                    check_total_in_exact_range(largest_k, str(rate.dtype), argument="k")
            if k_max is not None:
                check_total_in_exact_range(k_max, str(rate.dtype), argument="k_max")
            try:
                batch_shape, event_shape = self.infer_shapes(rate.shape, k.shape)
            except ValueError as error:
                raise ValueError(
                    f"k of shape {k.shape} does not broadcast with the batch shape "
                    f"{rate.shape[:-1]} of rate (shape {rate.shape})"
                ) from error
            self.rate = jnp.broadcast_to(rate, batch_shape + event_shape)
            self.k = jnp.broadcast_to(k, batch_shape)
        self.k_max = k_max
        super().__init__(batch_shape, event_shape, validate_args=validate_args)

    @classmethod
    def infer_shapes(cls, rate: tuple[int, ...], k: tuple[int, ...] = ()):
        batch_shape = jnp.broadcast_shapes(tuple(rate[:-1]), tuple(k))
        return batch_shape, tuple(rate[-1:])

    @property
    def has_rsample(self) -> bool:
        """False for the score-function estimator (NumPyro's ELBOs read
        ``site["fn"].has_rsample``)."""
        return self.grad_estimator != "score_function"

    def expand(self, batch_shape) -> ConditionedPoisson:
        batch_shape = tuple(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        check_expand(self.batch_shape, batch_shape)
        new = ConditionedPoisson.__new__(ConditionedPoisson)
        new.rate = jnp.broadcast_to(self.rate, batch_shape + self.event_shape)
        new.k = jnp.broadcast_to(self.k, batch_shape)
        new.k_max = self.k_max
        new.grad_estimator = self.grad_estimator
        Distribution.__init__(new, batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    def _table_bound(self) -> int | None:
        """The static bound on ``k`` that sizes the tables of a call: the largest ``k`` (at
        least 0) when ``k`` is concrete, else the ``k_max`` passed, else None. Worked out
        when called, never stored, so that the pytree does not depend on whether ``k`` is
        concrete."""
        if not_jax_tracer(self.k):
            largest = _largest_finite(np.asarray(self.k))
            return 0 if largest is None else max(largest, 0)
        return self.k_max

    def _k_out_of_range(self):
        """Where ``k`` is no count within the bound (negative, fractional, NaN, or above the
        ``k_max`` passed), shape ``batch_shape``; None where ``k`` is concrete and in range
        everywhere, so that eager calls on valid ``k`` pay nothing. What is flagged gets
        ``-inf`` log-probabilities and NaN moments and samples."""
        k = self.k
        if not_jax_tracer(k):
            k_np = np.asarray(k)
            # NaN != NaN flags NaN too.
            bad = (k_np < 0) | (k_np != np.floor(k_np))
            if self.k_max is not None:
                bad |= k_np > self.k_max
            return jnp.asarray(bad) if bad.any() else None
        bad = k < 0
        if jnp.issubdtype(k.dtype, jnp.floating):
            bad = bad | (k != jnp.floor(k))
        if self.k_max is not None:
            bad = bad | (k > self.k_max)
        return bad

    def _mask_out_of_range_k(self, x, fill, *, event: bool):
        """``x`` with ``fill`` where ``k`` is out of range (`_k_out_of_range`); ``event``:
        ``x`` has the event dimension last."""
        bad = self._k_out_of_range()
        if bad is None:
            return x
        return jnp.where(bad[..., None] if event else bad, fill, x)

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self) -> constraints.Constraint:
        return _IntegerComposition(self.k)

    def _log_probs(self):
        """``log p`` and ``log(1 - p)`` in the accumulation dtype (`_normalized_log_probs`)."""
        return _normalized_log_probs(self.rate)

    def _log_p(self):
        """``log p`` in the accumulation dtype (`_log_probs_only`)."""
        return _log_probs_only(self.rate)

    def enumerate_support(self, expand: bool = True) -> jax.Array:
        """Every composition of ``k`` into ``n`` non-negative parts once (all have positive
        probability), shape ``(count,) + batch_shape + (n,)`` (``expand=True``) or
        ``(count,) + (1,) * len(batch_shape) + (n,)`` (``expand=False``), as NumPyro's
        ``OneHotCategorical``; in reverse lexicographic order (the first is
        ``(k, 0, ..., 0)``). Needs one concrete ``k`` over the batch (else a
        ``ValueError``). ``count = C(k + n - 1, n - 1)`` is computed before anything is
        built; above ``max_support`` it is a ``ValueError``."""
        name = type(self).__name__
        refuse_scalar_coordinate_consumers(name)
        with jax.ensure_compile_time_eval():
            if not not_jax_tracer(self.k):
                raise ValueError(
                    f"{name}.enumerate_support needs a concrete k (the support's size is "
                    "static), got a traced one"
                )
            k = single_count(self.k, name)
        if k < 0:
            raise ValueError(f"{name}.enumerate_support: k = {k} has an empty support")
        n = self.event_shape[0]
        count = math.comb(k + n - 1, n - 1)
        check_support_size(count, self.max_support, name)
        values = jnp.asarray(compositions(n, k), dtype=self.rate.dtype)
        values = values.reshape((count,) + (1,) * len(self.batch_shape) + self.event_shape)
        if expand:
            values = jnp.broadcast_to(values, (count,) + self.batch_shape + self.event_shape)
        return values

    @property
    def mode(self):
        """The most likely composition (a multinomial mode), exact: every mode is at least
        ``floor(k p)`` entrywise (the log-pmf is separable and concave in the counts), so
        starting there and handing the remaining units one at a time
        to the count with the largest gain ``log p_i - log(z_i + 1)`` is exact. Ties go to
        the lower index, so among equally likely compositions the result is deterministic.
        Works under ``jit``; NaN where ``k`` is out of range."""
        log_p = self._log_p()
        n = self.event_shape[0]
        k = jnp.maximum(jnp.asarray(self.k, log_p.dtype), 0)
        p = jnp.exp(log_p)
        # A hair below k p, so that rounding never starts above a mode.
        shrink = 1 - 8 * jnp.finfo(p.dtype).eps
        start = jnp.clip(jnp.floor(k[..., None] * p * shrink), 0, k[..., None])
        remaining = k - start.sum(-1)
        index = jnp.arange(n)

        def step(carry):
            counts, remaining = carry
            best = jnp.argmax(log_p - jnp.log1p(counts), axis=-1)  # ties: the lower index
            add = (remaining > 0).astype(counts.dtype)
            counts = counts + add[..., None] * (index == best[..., None]).astype(counts.dtype)
            return counts, remaining - add

        counts, _ = lax.while_loop(lambda c: jnp.any(c[1] > 0), step, (start, remaining))
        return self._mask_out_of_range_k(counts.astype(self.rate.dtype), jnp.nan, event=True)

    @property
    def probs(self):
        """``p = rate / sum(rate)``, the multinomial probabilities."""
        return _probs_only(self.rate).astype(self.rate.dtype)

    @property
    def mean(self):
        """``k p``; NaN where ``k`` is out of range."""
        p = _probs_only(self.rate)
        mean = (self.k.astype(p.dtype)[..., None] * p).astype(self.rate.dtype)
        return self._mask_out_of_range_k(mean, jnp.nan, event=True)

    @property
    def variance(self):
        """``k p (1 - p)``; NaN where ``k`` is out of range."""
        # k p (1 - p) with 1 - p exact also where p rounds to 1.
        log_p, log1m_p = self._log_probs()
        k = self.k.astype(log_p.dtype)[..., None]
        variance = (k * jnp.exp(log_p + log1m_p)).astype(self.rate.dtype)
        return self._mask_out_of_range_k(variance, jnp.nan, event=True)

    @property
    def marginals(self) -> Binomial:
        """The conditional marginal of each coordinate: ``z_i ~ Binomial(k, p_i)``."""
        p = self.probs
        total_count = jnp.broadcast_to(self.k[..., None], p.shape)
        return Binomial(total_count=total_count, probs=p, validate_args=False)

    def log_constraint_prob(self):
        """``log P(sum_i z_i = k)`` under the unconstrained Poissons, ``log Poisson(k; sum(rate))``
        (the count likelihood of a bag of known total); ``-inf`` where ``k`` is out of
        range."""
        log_prob = _log_poisson_of_total(self.rate, jnp.maximum(self.k, 0))
        return self._mask_out_of_range_k(log_prob.astype(self.rate.dtype), -jnp.inf, event=False)

    def log_prob(self, value):
        """``log k! - sum_i log z_i! + sum_i z_i log p_i``; ``-inf`` off the support (and
        where a traced ``k`` is out of range), where, with validation on and a concrete
        value and ``k``, NumPyro's "Out-of-support values" ``UserWarning`` is emitted too
        (as by NumPyro's own distributions; under ``jit`` too for closed-over constants).
        Differentiable in ``value`` too. A value whose shape does not end in the event
        shape, or whose leading dimensions do not broadcast with the batch shape, is a
        ``ValueError`` naming the expected shape.

        The support check is exact whatever ``value``'s dtype (an integer count above
        ``2**24`` is not rounded into the support of a float32 distribution); the sum is
        accumulated in float64 where JAX has it and returned in the promotion of ``rate``'s
        and a floating ``value``'s dtypes.
        """
        # A constant closed over inside jit stays concrete, so that it is still checked.
        value = as_concrete_where_possible(value)
        check_value_shape(value.shape, self.batch_shape, self.event_shape, "ConditionedPoisson")
        if jnp.issubdtype(value.dtype, jnp.floating):
            dtype = jnp.result_type(self.rate.dtype, value.dtype)
        else:
            dtype = self.rate.dtype
        k_bound = self._table_bound()
        total_below_2_to_the_m = (
            k_bound is not None
            and jnp.issubdtype(value.dtype, jnp.floating)
            and k_bound < largest_exact_integer(str(value.dtype))
        )
        log_prob, _ = _log_prob_and_support(
            self.rate, self.k, value, dtype=dtype, total_below_2_to_the_m=total_below_2_to_the_m
        )
        if self._validate_args:
            warn_if_out_of_support(lambda: _is_integer_composition(value, self.k)[0])
        return self._mask_out_of_range_k(log_prob, -jnp.inf, event=False)

    def __repr__(self) -> str:
        return parameters_repr(
            type(self).__name__, {"rate": self.rate, "k": self.k}, integers=("k",)
        )

    def sample(self, key, sample_shape: tuple[int, ...] = ()):
        """An exact sample ``z`` returned as ``z + (m - stop_gradient(m))`` with ``m = k p``:
        the value is exactly ``z``, the gradient that of the conditional mean (zero, not
        absent, where ``k = 0``). NaN where ``k`` is out of range (a traced ``k`` above
        ``k_max``, a negative or fractional ``k``). With ``grad_estimator="score_function"``,
        ``z`` under ``stop_gradient``.

        Categorical draws (O(k log n) per event) where a static bound on ``k`` is known
        (`k_max`) and small beside n, else sequential binomials (O(n) per event, no bound
        needed)."""
        sample_shape = tuple(sample_shape)
        dtype = self.rate.dtype
        rate = lax.stop_gradient(self.rate)
        k = lax.stop_gradient(self.k)
        n = rate.shape[-1]
        k_bound = self._table_bound()
        if k_bound == 0:
            # Every k is 0 (a larger traced k is out of range, NaN below).
            z = jnp.zeros(sample_shape + rate.shape, dtype)
        elif (
            k_bound is not None
            and k_bound < SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY * n
            and math.prod(sample_shape + self.batch_shape) > 0
        ):
            z = _sample_counts_categorical(
                key, rate, k, k_max=k_bound, sample_shape=sample_shape, dtype=dtype
            )
        else:
            log_p = _log_probs_only(rate)
            z = _sample_counts_sequentially(key, log_p, k, sample_shape=sample_shape, dtype=dtype)
        z = self._mask_out_of_range_k(z, jnp.nan, event=True)
        if not self.has_rsample:
            return lax.stop_gradient(z)
        m = jnp.broadcast_to(self.mean, z.shape)
        return z + (m - lax.stop_gradient(m))

    def rsample(self, key, sample_shape=()) -> jax.Array:
        """``sample``; ``NotImplementedError`` with ``grad_estimator="score_function"``."""
        if not self.has_rsample:
            raise NotImplementedError(
                "ConditionedPoisson(grad_estimator='score_function') has no reparameterised "
                "sampler (has_rsample is False): use sample(); TraceGraph_ELBO then differentiates "
                "the site by the score function"
            )
        return self.sample(key, sample_shape)

    def entropy(self):
        """Exact entropy ``-log k! - k sum_i p_i log p_i + sum_i E[log z_i!]``,
        ``z_i ~ Binomial(k, p_i)``.

        The expectations sum only over binomial outcomes within a Bennett-inequality window
        around each mean; the dropped terms total at most ``0.01`` times the machine epsilon
        of ``rate``'s dtype (absolute), see `entropy_log_inverse_tail`. The window sums run
        in ``rate``'s dtype on quantities centred in the accumulation dtype (`_entropy`).
        Needs a static bound on ``k`` (`k_max`): with a traced ``k``, pass ``k_max``. NaN
        where ``k`` is out of range.
        """
        k_bound = self._table_bound()
        if k_bound is None:
            raise ValueError(
                "ConditionedPoisson.entropy needs a static bound on k: pass k_max= when k is "
                "traced (inside jit or vmap)"
            )
        dtype = self.rate.dtype
        log_p, log1m_p = self._log_probs()
        if self.event_shape[0] == 1:
            # A single category: z = k surely. 0 with a zero gradient.
            entropy = jnp.sum(log_p, -1) * self.k
        else:
            eps = float(jnp.finfo(dtype).eps)
            half_width, width = _entropy_window(log_p, log1m_p, self.k, k_bound, eps)
            entropy = _entropy(
                log_p,
                log1m_p,
                self.k,
                k_max=k_bound,
                half_width=half_width,
                width=width,
                dtype=np.dtype(dtype),
            )
        return self._mask_out_of_range_k(entropy.astype(dtype), jnp.nan, event=False)


def _largest_finite(k: np.ndarray) -> int | None:
    """The largest entry of a concrete ``k`` as an int; None when empty or not finite (NaN
    and negative ``k`` are left to the validation of ``k``)."""
    if k.size == 0:
        return None
    largest = np.max(k)
    if not np.isfinite(largest):
        return None
    return int(largest)


@vmap_over.register
def _vmap_over_conditioned_poisson(dist: ConditionedPoisson, rate=None, k=None):
    # rate and k are both stored broadcast to the batch shape: a mapped batch axis maps both.
    return vmap_over_broadcast_leaves(dist, rate=rate, k=k)


# sum_{m >= 2} (m - 1) / m! d^(m - 2), the series of ((d - 1) e^d + 1) / d^2, to the term whose
# contribution at |d| = 1/2 is below 1e-18 of the sum.
_KL_SERIES = tuple((m - 1) / math.factorial(m) for m in range(2, 20))
# Below this |log(p_i / q_i)| the series; above it (d - 1) p/q + 1 cancels by at most 8x.
_KL_SERIES_MAX_D = 0.5


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
    resolvable = jnp.finfo(accumulation).tiny * 2.0**30
    # Only where the two are close: far apart, D_i B - b_i D cancels (rates 1 beside 1e10),
    # and the difference of the logarithms, at least 1/2, is accurate.
    log_difference = log_p - log_q
    close = jnp.abs(lax.stop_gradient(log_difference)) < _KL_SERIES_MAX_D
    precise = close & (a > resolvable) & (b > resolvable)
    denominator = jnp.where(precise, b * total_a, 1.0)
    ratio_minus_one = jnp.where(precise, numerator / denominator, 0.0)
    d = jnp.where(precise, jnp.log1p(ratio_minus_one), log_difference)
    small = jnp.abs(d) < _KL_SERIES_MAX_D
    d_small = jnp.where(small, d, 0.0)
    series = _KL_SERIES[-1]
    for coefficient in reversed(_KL_SERIES[:-1]):
        series = coefficient + d_small * series
    q_prob = jnp.exp(log_q)
    near = q_prob * (d_small * d_small * series)
    far = jnp.exp(log_p) * (jnp.where(small, 1.0, d) - 1.0) + q_prob
    return jnp.sum(jnp.maximum(jnp.where(small, near, far), 0.0), -1)


@kl_divergence.register(ConditionedPoisson, ConditionedPoisson)
def _kl_conditioned_poisson(p: ConditionedPoisson, q: ConditionedPoisson):
    """``KL(p || q) = k sum_i p_i log(p_i / q_i)`` for two with the same ``k`` and ``n``, in
    the promotion of their dtypes, never negative and accurate also where the two are close
    (`_relative_entropy`); NaN where ``k`` is out of range."""
    if p.event_shape != q.event_shape:
        raise ValueError(
            f"KL between ConditionedPoisson needs the same number of categories, got "
            f"{p.event_shape[0]} and {q.event_shape[0]}"
        )
    if not_jax_tracer(p.k) and not_jax_tracer(q.k):
        if not np.array_equal(*np.broadcast_arrays(np.asarray(p.k), np.asarray(q.k))):
            raise ValueError("KL between ConditionedPoisson needs the same k")
    relative_entropy = _relative_entropy(p.rate, q.rate)
    kl = p.k.astype(relative_entropy.dtype) * relative_entropy
    kl = kl.astype(jnp.result_type(p.rate.dtype, q.rate.dtype))
    return p._mask_out_of_range_k(kl, jnp.nan, event=False)
