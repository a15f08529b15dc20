"""Numerical kernels of ExactlyKBernoulli (MATH.md section 1), JAX.

Pure functions of ``logits`` (shape ``batch + (n,)``, entries finite or ``-inf``), ``k``
(integer array of shape ``batch``, ``0 <= k <= number of finite logits``) and ``k_max`` (a
Python int, ``max(k) <= k_max <= n``; tables are truncated at it). The distribution calls
only these functions; ``+inf`` logits and feasibility are handled by the caller. All of them
work under ``jax.jit``, ``jax.vmap`` and ``jax.grad``, and are jitted themselves (``k_max`` and
``sample_shape`` static) so that eager calls compile once per shape.

This version is sequential (``lax.scan`` over the n variables, O(n k_max) work). The table
it builds is the Poisson-binomial pmf of the *tilted* Bernoullis, in log space,

    T[i, j] = log P(z_1 + ... + z_i = j),   z_l ~ Bernoulli(sigmoid(logits_l + c)),

with the tilt ``c`` chosen so that the expected count is about k. Entries near j = k then
stay near 0 whatever n is, so float32 keeps its relative precision (a table of
``log e_j`` would reach magnitudes of sum(logits) and lose it). The normaliser follows from

    log e_k(exp logits) = T[n, k] + sum_l softplus(logits_l + c) - k c.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

_BISECTION_STEPS = 40  # the bracket shrinks 1e12-fold; the tilt need not be exact


def _softplus(x: jax.Array) -> jax.Array:
    # Exact (no linear threshold), with a custom JVP that is right at 0; relu(x) +
    # log1p(exp(-|x|)) has a wrong autograd derivative at x = 0. Inputs here are finite.
    return jax.nn.softplus(x)


def _logaddexp(a: jax.Array, b: jax.Array) -> jax.Array:
    """log(exp a + exp b), with first and second derivatives finite where a or b is -inf
    (no intermediate is ever NaN, so no NaN leaks into derivatives through ``where``)."""
    a_larger = a >= b
    high = jnp.where(a_larger, a, b)
    low = jnp.where(a_larger, b, a)
    finite = high > -jnp.inf
    high_safe = jnp.where(finite, high, 0.0)
    gap = jnp.where(finite, low - high_safe, -jnp.inf)
    return jnp.where(finite, high_safe + jnp.log1p(jnp.exp(gap)), high)


def tilt(logits: jax.Array, k: jax.Array) -> jax.Array:
    """A constant c per batch element (shape ``batch + (1,)``, under ``stop_gradient``) with
    sum_i sigmoid(logits_i + c) ~= k, found by bisection on a bracket that provably holds it.

    The target count is clamped to [1/2, m - 1/2] (m = number of finite logits), since the
    exact solution is infinite for k = 0 and k = m; any finite c leaves the distribution
    unchanged, so the clamp costs nothing.
    """
    logits = lax.stop_gradient(logits)
    dtype = logits.dtype
    finite = jnp.isfinite(logits)
    num_finite = finite.sum(-1).astype(dtype)
    target = jnp.minimum(jnp.maximum(k.astype(dtype), 0.5), num_finite - 0.5)
    target = jnp.where(num_finite > 0, target, 0.0)
    safe = jnp.where(finite, logits, 0.0)
    largest = jnp.where(finite, logits, -jnp.inf).max(-1)
    smallest = jnp.where(finite, logits, jnp.inf).min(-1)
    m = jnp.maximum(num_finite, 1.0)
    t = jnp.maximum(target, 0.25)  # only guards log(0) when m = 0
    # sum sigmoid(x_i + c) <= m exp(max x + c) and >= m (1 - exp(-(min x + c))).
    low = jnp.where(num_finite > 0, jnp.log(t / m) - largest, 0.0).astype(dtype)
    high = jnp.where(
        num_finite > 0, jnp.log(m / (m - jnp.minimum(t, m - 0.25))) - smallest, 0.0
    ).astype(dtype)

    def step(_, bracket):
        low, high = bracket
        middle = 0.5 * (low + high)
        count = jnp.where(finite, jax.nn.sigmoid(safe + middle[..., None]), 0.0).sum(-1)
        too_many = count > target
        return jnp.where(too_many, low, middle), jnp.where(too_many, middle, high)

    low, high = lax.fori_loop(0, _BISECTION_STEPS, step, (low, high))
    return lax.stop_gradient(0.5 * (low + high))[..., None]


def _tilted_log_probs(logits: jax.Array, k: jax.Array):
    """(c, log p, log(1 - p), sum softplus) of the tilted Bernoullis; -inf logits give
    log p = -inf and log(1 - p) = 0 with zero gradient."""
    c = tilt(logits, k)
    finite = jnp.isfinite(logits)
    shifted = jnp.where(finite, logits, 0.0) + c
    log_on = jnp.where(finite, -_softplus(-shifted), -jnp.inf)
    log_off = jnp.where(finite, -_softplus(shifted), 0.0)
    softplus_sum = jnp.where(finite, _softplus(shifted), 0.0).sum(-1)
    return c[..., 0], log_on, log_off, softplus_sum


def _tables(log_on: jax.Array, log_off: jax.Array, k_max: int) -> tuple[jax.Array, jax.Array]:
    """(T[n], stacked [T[0], ..., T[n - 1]] of shape ``(n,) + batch + (k_max + 1,)``)."""
    batch = log_on.shape[:-1]
    first = jnp.full(batch + (k_max + 1,), -jnp.inf, dtype=log_on.dtype).at[..., 0].set(0.0)
    minus_inf = jnp.full(batch + (1,), -jnp.inf, dtype=log_on.dtype)

    def step(table, probs):
        on, off = probs
        one_more = jnp.concatenate([minus_inf, table[..., :-1]], axis=-1) + on[..., None]
        return _logaddexp(table + off[..., None], one_more), table

    probs = (jnp.moveaxis(log_on, -1, 0), jnp.moveaxis(log_off, -1, 0))
    return lax.scan(step, first, probs)


@partial(jax.jit, static_argnames="k_max")
def log_normalizer(logits: jax.Array, k: jax.Array, k_max: int) -> jax.Array:
    """log e_k(exp logits), shape ``batch``; twice differentiable without NaN."""
    k = jnp.asarray(k)
    c, log_on, log_off, softplus_sum = _tilted_log_probs(logits, k)
    table, _ = _tables(log_on, log_off, k_max)
    log_pk = jnp.take_along_axis(table, k[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return log_pk + softplus_sum - k.astype(logits.dtype) * c


@partial(jax.jit, static_argnames="k_max")
def marginals(logits: jax.Array, k: jax.Array, k_max: int) -> jax.Array:
    """mu_i = P(z_i = 1 | sum z = k) = d log e_k / d logits_i, shape ``batch + (n,)``."""
    return jax.grad(lambda x: log_normalizer(x, k, k_max).sum())(logits)


@partial(jax.jit, static_argnames=("k_max", "sample_shape"))
def sample(
    key: jax.Array, logits: jax.Array, k: jax.Array, k_max: int, sample_shape: tuple = ()
) -> jax.Array:
    """Exact draws, shape ``sample_shape + batch + (n,)``, entries 0.0 / 1.0 summing to k.

    SIMPLE Algorithm 2: from i = n down to 1 with j ones left to place,
    P(z_i = 1) = exp(log p_i + T[i-1, j-1] - T[i, j]). No gradient.
    """
    logits = lax.stop_gradient(logits)
    k = jnp.asarray(k)
    _, log_on, log_off, _ = _tilted_log_probs(logits, k)
    last, before = _tables(log_on, log_off, k_max)
    after = jnp.concatenate([before[1:], last[None]], axis=0)
    n = logits.shape[-1]
    shape = tuple(sample_shape) + logits.shape[:-1]
    uniforms = jax.random.uniform(key, (n,) + shape, dtype=logits.dtype)
    left = jnp.broadcast_to(k.astype(jnp.int32), shape)

    def step(left, inputs):
        table_before, table_after, on, u = inputs
        table_before = jnp.broadcast_to(table_before, shape + table_before.shape[-1:])
        table_after = jnp.broadcast_to(table_after, shape + table_after.shape[-1:])
        log_before = jnp.take_along_axis(
            table_before, jnp.maximum(left - 1, 0)[..., None], axis=-1
        )[..., 0]
        log_before = jnp.where(left > 0, log_before, -jnp.inf)
        log_after = jnp.take_along_axis(table_after, left[..., None], axis=-1)[..., 0]
        # A state is reached only with positive probability, so log_after is finite; when
        # z_i is forced the ratio is exactly 0 or exactly exp(0) = 1 (see _logaddexp).
        is_on = u < jnp.exp(on + log_before - log_after)
        return left - is_on.astype(jnp.int32), is_on.astype(logits.dtype)

    _, z = lax.scan(
        step, left, (before, after, jnp.moveaxis(log_on, -1, 0), uniforms), reverse=True
    )
    return jnp.moveaxis(z, 0, -1)


def sample_and_marginals(
    key: jax.Array, logits: jax.Array, k: jax.Array, k_max: int, sample_shape: tuple = ()
) -> tuple[jax.Array, jax.Array]:
    """(sample(...), marginals(...)) for the straight-through sample. Not jitted itself, so
    that it reuses the compilations of the two functions it calls."""
    # stop_gradient outside the jitted sampler: a differentiated caller would otherwise make
    # JAX linearise (and compile again) the whole sampler only to find no gradient in it.
    z = sample(key, lax.stop_gradient(logits), k, k_max, sample_shape)
    return z, marginals(logits, k, k_max)
