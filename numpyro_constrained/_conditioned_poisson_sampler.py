"""``ConditionedPoisson``'s exact samplers in JAX: categorical draws (O(k log n) per event)
or sequential binomials (O(n) per event, for k large beside n or without a static bound)."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from constrained_ppl.conditioned_poisson import SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY
from numpyro_constrained._conditioned_poisson_numerics import _accumulation_dtype, _log_probs_only


def _sample_counts(key, rate, k, k_bound: int | None, sample_shape: tuple[int, ...], dtype):
    """Exact ``Multinomial(k, rate / sum(rate))`` counts of shape ``sample_shape + rate.shape``
    in ``dtype`` (``k`` of shape ``rate.shape[:-1]``, ``k_bound`` a static bound on it or
    None where ``k`` is traced without one): categorical draws where the bound is known and
    small beside n, else sequential binomials. Which runs depends on sizes and the bound
    only, never on the rates."""
    n = rate.shape[-1]
    if k_bound == 0:
        # Every k is 0 (a larger traced k is out of range, NaN in the caller).
        return jnp.zeros(sample_shape + rate.shape, dtype)
    if (
        k_bound is not None
        and k_bound < SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY * n
        and math.prod(sample_shape + rate.shape[:-1]) > 0
    ):
        return _sample_counts_categorical(
            key, rate, k, k_max=k_bound, sample_shape=sample_shape, dtype=dtype
        )
    log_p = _log_probs_only(rate)
    return _sample_counts_sequentially(key, log_p, k, sample_shape=sample_shape, dtype=dtype)


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
