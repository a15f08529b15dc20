"""The small-problem path of the ExactlyKBernoulli kernels, JAX (docs/numerics.md, "Small
problems"); the mirror of ``pyro_constrained/exactly_k_small.py``, whose docstring describes
the method.

Chosen by ``exactly_k_kernels`` (``applies``) for small n after its padding to a bucket of
sizes, on flattened ``(batch, n)`` logits (finite or ``-inf``) and integer ``k``, for the
marginals and the samplers; unlike the torch module it has no ``normalizer_parts``: the log
normaliser takes the general kernels at every size (see ``exactly_k_kernels``). Every
function here is jitted; the derivatives are ``custom_jvp`` rules over the tables of the
forward pass (the tangent pass), written so that JAX can differentiate them again.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_constrained.exactly_k_tree import flatten

# The largest n that takes this path, and the most table entries (batch * n * (k_max + 1)):
# under jit the small path was 2.4x to 2.6x faster than the general kernels up to batch 128
# at n = 50, k = 5 (rsample plus gradient, 38400 entries), and 2x to 4x slower at batch 256,
# n = 100, k = 10 (281600 entries), where its exp and log per entry and its (width x width)
# outside terms cost more than the general kernels' linear-space sums.
SMALL_N = 256
SMALL_ENTRIES = 1 << 16
_LN2 = math.log(2.0)


def applies(logits: jax.Array, k_max: int) -> bool:
    """Whether the small path is taken (sizes only; k_max = 0 is the callers' own case)."""
    n = logits.shape[-1]
    batch = math.prod(logits.shape[:-1])
    return k_max > 0 and n <= SMALL_N and batch * n * (k_max + 1) <= SMALL_ENTRIES


def tilt(logits: jax.Array, k: jax.Array, k_max: int) -> jax.Array:
    """``-(x_(k) + x_(k+1)) / 2`` per row, shape ``(batch, 1)`` (see the torch module)."""
    logits = lax.stop_gradient(logits)
    n = logits.shape[-1]
    # A sort, not lax.top_k, which XLA's SPMD partitioner all-gathers across a sharded batch.
    ordered = -jnp.sort(-logits, axis=-1)[..., : min(k_max + 1, n)]
    k = k[:, None]
    upper = jnp.take_along_axis(ordered, jnp.maximum(k - 1, 0), -1)
    lower = jnp.take_along_axis(ordered, jnp.minimum(k, ordered.shape[-1] - 1), -1)
    upper = jnp.where(k >= 1, upper, lower)
    lower = jnp.where((k < n) & (lower > -jnp.inf), lower, upper)
    c = -(0.5 * upper + 0.5 * lower)
    return jnp.where(jnp.isfinite(c), c, 0.0)


def _leaves(x: jax.Array) -> jax.Array:
    """(2, batch, m) log leaf tables, m = n rounded up to a power of two (padding variables
    with logit -inf)."""
    n = x.shape[-1]
    size = 1 << (n - 1).bit_length()
    if size > n:
        x = jnp.pad(x, [(0, 0), (0, size - n)], constant_values=-jnp.inf)
    return jnp.stack([-jnp.maximum(x, 0.0), jnp.minimum(x, 0.0)], 0)


def _pad_width(table, before: int, after: int, value=-jnp.inf):
    return jnp.pad(table, [(before, after), (0, 0), (0, 0)], constant_values=value)


def _convolve_terms(left, right, out_width: int, pad_value=-jnp.inf):
    """Terms ``left[t] + right[j - t]``, shape (out_width, w, batch, nodes)."""
    w = left.shape[0]
    padded = _pad_width(right, w - 1, max(0, out_width - right.shape[0]), pad_value)
    index = jnp.arange(out_width)[:, None] - jnp.arange(w) + (w - 1)
    return padded[index] + left[None]


def _correlate_terms(outside, sibling, pad_value=-jnp.inf):
    """Terms ``outside[a + t] + sibling[t]``, shape (w, w, batch, nodes)."""
    w = sibling.shape[0]
    padded = _pad_width(outside, 0, max(0, 2 * w - 1 - outside.shape[0]), pad_value)
    index = jnp.arange(w)[:, None] + jnp.arange(w)
    return padded[index] + sibling[None]


def _logsumexp(terms):
    """(logsumexp over axis 1, the softmax weights of the terms, 0 where every term is
    -inf), with finite derivatives of every order there too."""
    top = lax.stop_gradient(jnp.maximum(terms.max(1, keepdims=True), jnp.finfo(terms.dtype).min))
    weights = jnp.exp(terms - top)
    total = weights.sum(1, keepdims=True)
    possible = total > 0
    safe = jnp.where(possible, total, 1.0)
    value = jnp.where(possible, jnp.log(safe) + top, -jnp.inf)[:, 0]
    return value, weights / safe


def _shift(table):
    """The table less a whole multiple of log 2 near its largest entry (per node)."""
    top = lax.stop_gradient(jnp.maximum(table.max(0, keepdims=True), jnp.finfo(table.dtype).min))
    return table - jnp.floor(top / _LN2) * _LN2


def _halves(table):
    half = table.shape[-1] // 2
    return table[..., :half], table[..., half:]


def _upward(leaves, k_max: int):
    """Tables leaves first, root last (each less a multiple of log 2 per node, which the
    marginals' ratios and the sampler's splits do not see); softmax weights per level."""
    tables, weights_list = [leaves], []
    table = leaves
    while table.shape[-1] > 1:
        out_width = min(2 * table.shape[0] - 1, k_max + 1)
        table, weights = _logsumexp(_convolve_terms(*_halves(table), out_width))
        table = _shift(table)
        tables.append(table)
        weights_list.append(weights)
    return tables, weights_list


def _siblings(table):
    left, right = _halves(table)
    return jnp.concatenate([right, left], -1)


def _downward(tables, k):
    root = tables[-1]
    counts = jnp.arange(root.shape[0])[:, None, None]
    outside = jnp.where(counts == k[:, None], 0.0, -jnp.inf).astype(root.dtype)
    weights_list = []
    for table in reversed(tables[:-1]):
        parent = jnp.concatenate([outside, outside], -1)
        outside, weights = _logsumexp(_correlate_terms(parent, _siblings(table)))
        outside = _shift(outside)
        weights_list.append(weights)
    return outside, weights_list


def _prepare(logits, k, k_max: int):
    c = tilt(logits, k, k_max)
    x = logits + c
    leaves = _leaves(x)
    return c, x, leaves, _upward(leaves, k_max)


def _forward(logits, k, k_max: int):
    n = logits.shape[-1]
    _, x, leaves, (tables, up_weights) = _prepare(logits, k, k_max)
    outside, down_weights = _downward(tables, k)
    log_odds = (leaves[1] - leaves[0] + outside[1] - outside[0])[:, :n]
    return x, tables, up_weights, down_weights, log_odds


def _tangent(x, tangent, tables, up_weights, down_weights, log_odds):
    """The derivative of the log odds along ``tangent`` (see the torch module)."""
    n = x.shape[-1]
    d_off = jnp.where(x > 0, -tangent, 0.0)
    d_on = jnp.where((x > -jnp.inf) & (x <= 0), tangent, 0.0)
    d_leaves = jnp.stack([d_off, d_on], 0)
    size = tables[0].shape[-1]
    if size > n:
        d_leaves = jnp.pad(d_leaves, [(0, 0), (0, 0), (0, size - n)])
    d_tables, d_table = [d_leaves], d_leaves
    for weights in up_weights:
        d_terms = _convolve_terms(*_halves(d_table), weights.shape[0], 0.0)
        d_table = (weights * d_terms).sum(1)
        d_tables.append(d_table)
    d_outside = jnp.zeros_like(tables[-1])
    for d_table, weights in zip(reversed(d_tables[:-1]), down_weights, strict=True):
        parent = jnp.concatenate([d_outside, d_outside], -1)
        d_outside = (weights * _correlate_terms(parent, _siblings(d_table), 0.0)).sum(1)
    d_log_odds = (d_leaves[1] - d_leaves[0] + d_outside[1] - d_outside[0])[:, :n]
    return jnp.where(jnp.isfinite(log_odds), d_log_odds, 0.0)


@partial(jax.custom_jvp, nondiff_argnums=(2,))
def _marginal_pair(logits, k, k_max: int):
    log_odds = _forward(logits, k, k_max)[-1]
    return jax.nn.sigmoid(log_odds), jax.nn.sigmoid(-log_odds)


@_marginal_pair.defjvp
def _marginal_pair_jvp(k_max, primals, tangents):
    logits, k = primals
    x, tables, up_weights, down_weights, log_odds = _forward(logits, k, k_max)
    mu, complement = jax.nn.sigmoid(log_odds), jax.nn.sigmoid(-log_odds)
    d = _tangent(x, tangents[0], tables, up_weights, down_weights, log_odds)
    return (mu, complement), (mu * complement * d, jnp.zeros_like(complement))


@partial(jax.jit, static_argnames="k_max")
def marginals_and_complements(logits, k, k_max: int):
    """(mu, 1 - mu without rounding, no derivative), shape ``batch + (n,)``."""
    mu, complement = _marginal_pair(*flatten(logits, k), k_max)
    return mu.reshape(logits.shape), lax.stop_gradient(complement).reshape(logits.shape)


@partial(jax.jit, static_argnames="k_max")
def marginals(logits, k, k_max: int):
    return _marginal_pair(*flatten(logits, k), k_max)[0].reshape(logits.shape)


def _draw(key, tables, k, num_samples: int):
    """Counts of ones per leaf, (num_samples, batch, m), top-down from k."""
    counts = jnp.broadcast_to(k[None, :, None], (num_samples, k.shape[0], 1))
    keys = jax.random.split(key, len(tables) - 1)
    for key, table in zip(keys, reversed(tables[:-1]), strict=True):
        left, right = _halves(table)
        w = table.shape[0]
        padded = _pad_width(right, w - 1, w - 1)[:, None]
        index = counts[None] + (w - 1 - jnp.arange(w))[:, None, None, None]
        padded = jnp.broadcast_to(padded, (padded.shape[0],) + counts.shape)
        log_weight = left[:, None] + jnp.take_along_axis(padded, index, 0)
        ones_left = jax.random.categorical(key, log_weight, axis=0)
        counts = jnp.concatenate([ones_left, counts - ones_left], -1)
    return counts


@partial(jax.jit, static_argnames=("k_max", "sample_shape"))
def sample(key, logits, k, k_max: int, sample_shape: tuple = ()):
    """Exact draws, shape ``sample_shape + batch + (n,)`` in the logits' dtype."""
    flat_logits, flat_k = flatten(lax.stop_gradient(logits), k)
    tables = _prepare(flat_logits, flat_k, k_max)[3][0]
    counts = _draw(key, tables, flat_k, math.prod(sample_shape))
    z = counts[..., : logits.shape[-1]].astype(logits.dtype)
    return z.reshape(tuple(sample_shape) + logits.shape)


@partial(jax.jit, static_argnames=("k_max", "sample_shape"))
def sample_and_marginals(key, logits, k, k_max: int, sample_shape: tuple = ()):
    """(sample(...), marginals(...)), sharing the upward pass where XLA sees it."""
    return sample(key, logits, k, k_max, sample_shape), marginals(logits, k, k_max)


@partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def sample_straight_through(key, logits, k, k_max: int, sample_shape: tuple = ()):
    """Exact draws whose derivative is that of ``marginals`` (broadcast over
    ``sample_shape``), as ``exactly_k_kernels.sample_straight_through``."""
    return sample(key, logits, k, k_max, sample_shape)


@sample_straight_through.defjvp
def _sample_straight_through_jvp(k_max, sample_shape, primals, tangents):
    key, logits, k = primals
    z = sample(key, logits, k, k_max, sample_shape)
    _, d_mu = jax.jvp(lambda theta: marginals(theta, k, k_max), (logits,), (tangents[1],))
    return z, jnp.broadcast_to(d_mu, z.shape)
