"""``ConditionedPoisson``'s exact entropy in JAX: ``E[log z_i!]`` for the binomial
marginals, summed over a window of outcomes around each mean that Bennett's inequality
bounds (`constrained_ppl.binomial_tails`)."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.special import gammaln
from numpyro.util import not_jax_tracer

from constrained_ppl.binomial_tails import bennett_deviation, entropy_log_inverse_tail
from constrained_ppl.conditioned_poisson import LOG_FACTORIAL_TABLE_MAX_SIZE
from constrained_ppl.stirling import LOG_SQRT_2PI
from numpyro_constrained._conditioned_poisson_numerics import (
    _bd0,
    _log_sqrt_2pi_z_plus_stirling_error,
    _stirling_error,
)


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


def _window_terms(center, j, k_event, *, k_max: int, stable: bool, log_shift, odds_shift):
    """``D[t]``, ``G[t]`` over the windows (`_entropy`) and ``log c!`` (None where
    ``stable``), in the accumulation dtype of ``log_shift``.

    Without float64 (x64 off, ``stable``), ``log j! - log c!`` keeps no digit at large k: D
    and G come from Loader's small pieces (`_log_factorial_step`); with float64, from the
    tabulated log-factorials, whose exact cancellation the grouping in `_entropy` relies on."""
    accumulation = log_shift.dtype
    c_float = center.astype(accumulation)[..., None]
    t = (j - center[..., None]).astype(accumulation)
    if stable:
        k_column = k_event.astype(accumulation)[..., None]
        j_float = j.astype(accumulation)
        d = _log_factorial_step(c_float, j_float)
        g = (
            d
            + _log_factorial_step(k_column - c_float, k_column - j_float)
            + t * (jnp.log1p(0.5 / (c_float + 0.5)) - jnp.log1p(0.5 / (k_column - c_float + 0.5)))
        )
        return d, g, None

    def log_factorial(m):
        return _log_factorial(m, k_max, accumulation)

    log_c_factorial = log_factorial(center)
    d = log_factorial(j) - log_c_factorial[..., None] - t * log_shift
    # G written from D (the same numbers), so that XLA fuses it into the two sums of _entropy
    # and reads the log j! table once, not twice.
    g = (
        d
        + (log_factorial(k_event[..., None] - j) - log_factorial(k_event - center)[..., None])
        - t * (odds_shift - log_shift)
    )
    return d, g, log_c_factorial


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
    log_shift = jnp.log1p(c_float)
    odds_shift = jnp.log(c_float + 0.5) - jnp.log(k_float[..., None] - c_float + 0.5)
    stable = accumulation == np.dtype(np.float32)
    d, g, log_c_factorial = _window_terms(
        center, j, k_event, k_max=k_max, stable=stable, log_shift=log_shift, odds_shift=odds_shift
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
