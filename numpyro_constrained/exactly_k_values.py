"""The JAX exactly-k kernels' log normaliser in parts, and the quantities computed from them
without cancellation (log_prob, cross-entropy, KL, log constraint probability), including
the float32 forms used with x64 off."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from numpyro_constrained.exactly_k_convolution import _pad_last


def wide_dtype(dtype):
    """The dtype of the normaliser's parts and of the values computed from them: float64
    when x64 is on (in float32 they are sums of many terms that can be large and nearly
    cancel), else ``dtype``: then ``log_constraint_prob_value`` and ``kl_value`` keep their
    large parts apart and subtract them before rounding."""
    return jnp.promote_types(dtype, jnp.float64) if jax.config.jax_enable_x64 else dtype


class NormalizerParts(NamedTuple):
    """The log normaliser in two parts that keep their precision for logits of any size
    (float64 when x64 is on, shape ``batch``, under ``stop_gradient``): with
    ``x = logits + tilt``,

        log e_k(exp logits) = log_reduced + sum_i max(x_i, 0) - k tilt,

    where ``log_reduced = log e_k(exp x) - sum_i max(x_i, 0)`` is the log of the root's
    entry k times the internal nodes' factors. Every quantity that is a small difference of
    large terms when written with the logits (log_prob, entropy, KL, the constraint
    probability) is a sum of terms of one sign when written with ``x`` and ``log_reduced``
    (the ``*_value`` functions below); a saturated variable (``|x_i|`` beyond the dtype's
    precision) then contributes exactly nothing, as conditioning on its value would."""

    tilt: jax.Array
    log_reduced: jax.Array
    # log_reduced = log_root + exponent log 2, the two kept apart for the float32 formulas
    # (x64 off), where log_reduced (about n / 3) has lost the digits of a small difference.
    log_root: jax.Array
    exponent: jax.Array
    # Where the parts come from an upward pass that the marginals' own pass would repeat
    # exactly (no FFT level): a pytree that returns the marginals (no gradient, flattened to
    # (batch, n)) by one downward pass over its tables when called, so that log_normalizer's
    # derivative need not repeat the upward pass (as the torch parts' ``marginals``); None
    # otherwise.
    marginals: object = None


def _parts_from(logits, flat_k, c, root, exponent) -> NormalizerParts:
    wide = wide_dtype(logits.dtype)
    root_k = jnp.take_along_axis(root, flat_k[:, None], axis=-1)[:, 0]
    log_root = jnp.log(root_k.astype(wide))
    exponent = exponent.astype(wide)
    log_reduced = log_root + exponent * math.log(2.0)
    batch_shape = logits.shape[:-1]
    parts = NormalizerParts(
        *(t.reshape(batch_shape) for t in (c.astype(wide), log_reduced, log_root, exponent))
    )
    return jax.tree_util.tree_map(lax.stop_gradient, parts)


def _zero_parts(logits: jax.Array) -> NormalizerParts:
    """The parts for k = 0 everywhere: e_0 = 1, no tilt."""
    zero_tilt = jnp.zeros(logits.shape[:-1], wide_dtype(logits.dtype))
    x = _tilted(logits, zero_tilt)
    log_reduced = -jnp.maximum(x, 0.0).sum(-1)
    return NormalizerParts(zero_tilt, log_reduced, log_reduced, jnp.zeros_like(zero_tilt))


def _tilted(logits: jax.Array, tilt: jax.Array) -> jax.Array:
    """``x = logits + tilt`` in the wide dtype (``-inf`` stays ``-inf``)."""
    return lax.stop_gradient(logits).astype(tilt.dtype) + tilt[..., None]


def log_normalizer_value(logits: jax.Array, k: jax.Array, parts: NormalizerParts) -> jax.Array:
    """``log e_k(exp logits)`` in the wide dtype from its parts."""
    x = _tilted(logits, parts.tilt)
    positive = jnp.maximum(x, 0.0).sum(-1)
    return parts.log_reduced + positive - jnp.asarray(k).astype(x.dtype) * parts.tilt


@jax.jit
def log_prob_value(logits: jax.Array, parts: NormalizerParts, value: jax.Array) -> jax.Array:
    """``logits . z - log e_k(exp logits)`` for k-hot ``z`` (wide dtype, no gradient), as
    ``sum_i (x_i z_i - max(x_i, 0)) - log_reduced``: every term is 0 or has the sign of the
    penalty it stands for, so nothing cancels."""
    x = _tilted(logits, parts.tilt)
    z = lax.stop_gradient(value).astype(x.dtype)
    terms = jnp.where(x > -jnp.inf, x * z - jnp.maximum(x, 0.0), 0.0)
    return terms.sum(-1) - parts.log_reduced


@jax.jit
def cross_entropy_value(
    logits: jax.Array, parts: NormalizerParts, mu: jax.Array, mu_complement: jax.Array
) -> jax.Array:
    """``-E[log q(z)]`` for q the distribution of ``logits`` (with ``parts``) and z with
    marginals ``mu`` (``mu_complement = 1 - mu``, computed without rounding): with x the
    tilted logits of q, ``log_reduced + sum_i max(x_i, 0) (1 - mu_i) + max(-x_i, 0) mu_i``,
    a sum of non-negative terms after ``log_reduced``. With q the distribution of ``mu``
    itself this is its entropy. Wide dtype, no gradient."""
    x = _tilted(logits, parts.tilt)
    mu, mu_complement = (lax.stop_gradient(t).astype(x.dtype) for t in (mu, mu_complement))
    terms = jnp.maximum(x, 0.0) * mu_complement + jnp.maximum(-x, 0.0) * mu
    return jnp.where(x > -jnp.inf, terms, 0.0).sum(-1) + parts.log_reduced


@jax.jit
def kl_value(
    p_logits: jax.Array,
    p_parts: NormalizerParts,
    q_logits: jax.Array,
    q_parts: NormalizerParts,
    mu: jax.Array,
    mu_complement: jax.Array,
) -> jax.Array:
    """``KL(p || q)`` for p with marginals ``mu`` (``cross_entropy_value`` of q minus that of
    p), with every difference taken before it is summed: per variable,
    ``(1 - mu_i) (max(y_i, 0) - max(x_i, 0)) + mu_i (max(-y_i, 0) - max(-x_i, 0))`` (x, y
    the tilted logits of p and q), and the normalisers' parts as ``log_root`` and the
    whole-number ``exponent`` apart. Each cross-entropy is about n / 3; in float32 (x64 off)
    their difference would carry the rounding of that size (5e-4 at n = 1e4). Exactly 0
    for p = q. Wide dtype, no gradient."""
    x, y = _tilted(p_logits, p_parts.tilt), _tilted(q_logits, q_parts.tilt)
    mu, mu_complement = (lax.stop_gradient(t).astype(x.dtype) for t in (mu, mu_complement))
    x_free, y_free = x > -jnp.inf, y > -jnp.inf
    safe_x, safe_y = jnp.where(x_free, x, 0.0), jnp.where(y_free, y, 0.0)
    # A variable that p forces (removed from p's problem; mu 0 or 1) and q leaves free
    # still has q's term: q's cross-entropy counts it, p's own does not.
    q_terms = mu_complement * jnp.maximum(safe_y, 0.0) + mu * jnp.maximum(-safe_y, 0.0)
    on = jnp.maximum(safe_y, 0.0) - jnp.maximum(safe_x, 0.0)
    off = jnp.maximum(-safe_y, 0.0) - jnp.maximum(-safe_x, 0.0)
    terms = jnp.where(x_free, mu_complement * on + mu * off, jnp.where(y_free, q_terms, 0.0))
    exponents = (q_parts.exponent - p_parts.exponent) * math.log(2.0)
    return terms.sum(-1) + (q_parts.log_root - p_parts.log_root) + exponents


@jax.jit
def log_constraint_prob_value(logits: jax.Array, k: jax.Array, parts: NormalizerParts):
    """``log P(sum z = k)`` for independent ``z_i ~ Bernoulli(sigmoid(logits_i))`` (wide
    dtype, no gradient), without the cancellation of ``log e_k - sum softplus(logits)``. With
    ``softplus(w) = max(w, 0) + log1p(exp(-|w|))`` and ``x = logits + c``,

        log P = log_reduced + sum_i [max(x_i, 0) - max(logits_i, 0)] - k c
                - sum_i log1p(exp(-|logits_i|)),

    and the middle sum is ``c (P - k) + sum logits_i [x_i >= 0 > logits_i]
    - sum logits_i [logits_i >= 0 > x_i]``, P the number of non-negative ``x_i``: an
    integer multiple of c plus logits that change sides under the tilt. No term is formed
    as ``logits + c``, whose rounding would be relative to c, and the large terms are as
    large as the answer (each side-changing variable costs about its own logit)."""
    theta = lax.stop_gradient(logits).astype(parts.tilt.dtype)
    x = theta + parts.tilt[..., None]
    finite = theta > -jnp.inf
    x_on, theta_on = (x >= 0) & finite, (theta >= 0) & finite
    shift = parts.tilt * (x_on.sum(-1) - jnp.asarray(k))
    shift = shift + jnp.where(x_on & ~theta_on, theta, 0.0).sum(-1)
    shift = shift - jnp.where(theta_on & ~x_on, theta, 0.0).sum(-1)
    tails = jnp.where(finite, jnp.log1p(jnp.exp(-jnp.abs(theta))), 0.0)
    if tails.dtype == jnp.float64:
        return parts.log_reduced + shift - tails.sum(-1)
    # float32 (x64 off): exponent log 2 and the tails' sum are each about n / 3 while their
    # difference is a few units, so both are formed as unevaluated sums hi + lo of two
    # float32 numbers (error-free transformations) and subtracted before rounding.
    scale_hi, scale_lo = _two_product(parts.exponent, np.float32(_LN2_HIGH))
    scale_lo = scale_lo + parts.exponent * np.float32(_LN2_LOW)
    tails_hi, tails_lo = _compensated_sum(tails)
    return parts.log_root + ((scale_hi - tails_hi) + (scale_lo - tails_lo)) + shift


# log 2 as the sum of two float32 numbers.
_LN2_HIGH = float(np.float32(math.log(2.0)))
_LN2_LOW = math.log(2.0) - _LN2_HIGH


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(s, e) with s = fl(a + b) and a + b = s + e exactly (Knuth's TwoSum)."""
    s = a + b
    b_virtual = s - a
    return s, (a - (s - b_virtual)) + (b - b_virtual)


def _two_product(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(p, e) with p = fl(a b) and a b = p + e exactly (Dekker's product, float32)."""
    p = a * b

    def split(v):
        t = v * np.float32(4097.0)  # 2^12 + 1: halves of 12 significant bits
        high = t - (t - v)
        return high, v - high

    (a_hi, a_lo), (b_hi, b_lo) = split(a), split(b)
    return p, ((a_hi * b_hi - p) + a_hi * b_lo + a_lo * b_hi) + a_lo * b_lo


def _compensated_sum(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The sum of ``x`` along its last axis as hi + lo: pairwise, each addition's rounding
    error recovered by TwoSum and summed separately (the result is as accurate as a sum in
    twice the precision, up to the errors' own small sum)."""
    lo = jnp.zeros(x.shape[:-1], x.dtype)
    if x.shape[-1] == 0:
        return lo, lo
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = _pad_last(x, 0, 1)
        x, error = _two_sum(x[..., 0::2], x[..., 1::2])
        lo = lo + error.sum(-1)
    return x[..., 0], lo
