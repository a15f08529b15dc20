"""The derivative of the JAX exactly-k marginals: a tangent pass linear in the tangent, over
tables saved by the forward pass (docs/numerics.md, "The exactly-k kernels").

The marginals' Jacobian is the conditional covariance of z, and JAX's reverse mode
transposes whatever linear map the derivative rule computes. The primal kernels' own
linearisation transposes poorly (a ``dynamic_slice`` per shift of each convolution loop
becomes a ``dynamic_update_slice`` into a zero array, every loop step saves its slices,
and the top levels' ``lax.scan`` saves its steps), so this rule states the tangent of each
level itself: for a product of tables ``d(L * R) = dL * R + L * dR``, each term a product
with a table of the forward pass laid out as a Toeplitz (or Hankel) matrix, so that the
term is a batched matrix-vector product, which JAX transposes into another. The rule is
plain JAX, so it is differentiable again in either mode (forward-over-reverse Hessians
included), and exact: the same sums as JAX's derivative of the kernels, in another order.

Served: tables at most ``_TOEPLITZ_WIDTH`` wide (``k_max`` up to 32), where those matrices
(width^2 entries per node and term) cost little; wider tables, and the FFT levels, keep JAX's
own derivative of the kernels (see ``_jvp``).
"""

from functools import partial

import jax
import jax.numpy as jnp

from numpyro_constrained._products import matmul
from numpyro_constrained.exactly_k_convolution import _convolve, _correlate
from numpyro_constrained.exactly_k_tilt import tilt
from numpyro_constrained.exactly_k_tree import (
    _flush,
    _leaves,
    _marginals_from,
    _prepare,
    _scale_of,
    _with_empty_nodes,
)

# The widest tables served (k_max up to 32): the forward pass builds a (width x width)
# matrix per node and term. At k_max = 64 they made the forward derivative 1.6x to 1.8x
# slower (reverse mode 1.5x to 2x faster), and the kernels' loops in their place
# transposed no faster than JAX's own derivative (benchmarks/README.md, "Small sites").
_TOEPLITZ_WIDTH = 33


@partial(jax.custom_jvp, nondiff_argnums=(2,))
def marginals(logits: jax.Array, k: jax.Array, k_max: int) -> jax.Array:
    """The marginals of flattened ``(batch, n)`` logits at int32 ``k`` (batch,), ``k_max``
    at least 1 (a power of two, as ``exactly_k_kernels`` rounds it); derivative: the
    tangent pass."""
    return _kernel_marginals(logits, k, k_max)


def _kernel_marginals(logits, k, k_max: int):
    """The general kernels' marginals, differentiated by JAX itself."""
    flat_k, _, weights, root, levels, _, fft = _prepare(logits, k, k_max, True)
    return _marginals_from(flat_k, weights, root, levels, fft)


def serves(k_max: int) -> bool:
    """Whether the marginals' derivative at ``k_max`` is the tangent pass (else JAX's own
    derivative of the kernels). No level this narrow takes the FFT path."""
    return k_max + 1 <= _TOEPLITZ_WIDTH


@marginals.defjvp
def _jvp(k_max, primals, tangents):
    logits, k = primals
    if not serves(k_max):
        return jax.jvp(lambda x: _kernel_marginals(x, k, k_max), (logits,), (tangents[0],))
    mu, saved = _forward(logits, k, k_max)
    return mu, _tangent(tangents[0], saved)


def _level_products(pairs: jax.Array, out_width: int):
    """(rescaled products of the pairs, their scale, where they were kept): one level of the
    upward pass without FFT (``exactly_k_tree._merge``), with what its tangent needs."""
    raw = _convolve(pairs[:, :, 0], pairs[:, :, 1], out_width)
    scale, _ = _scale_of(raw)
    tables = _flush(raw * scale)
    return tables, scale, tables > 0


def _matrix(table: jax.Array, index: jax.Array) -> jax.Array:
    """M[..., r, c] = table[..., index[r, c]], 0 where the index is outside the table."""
    inside = (index >= 0) & (index < table.shape[-1])
    entries = jnp.take(table, jnp.clip(index, 0, table.shape[-1] - 1), axis=-1)
    return jnp.where(inside, entries, 0.0)


def _apply(tangent: jax.Array, factor: jax.Array) -> jax.Array:
    """``sum_r tangent[..., r] factor[..., r, c]``: a product with a constant matrix, which JAX
    transposes into another."""
    return matmul(tangent[..., None, :], factor)[..., 0, :]


def _up_factors(left, right, out_width):
    """The constant factors of an upward level's tangent ``dL * R + L * dR`` (truncated
    products): (R, L) as matrices M[a, j] = C[j - a]."""
    index = jnp.arange(out_width)[None, :] - jnp.arange(left.shape[-1])[:, None]
    return _matrix(right, index), _matrix(left, index)


def _down_factors(outside, siblings, width):
    """The constant factors of a downward level's tangent ``corr(dO, S) + corr(O, dS)``,
    ``corr(O, S)[a] = sum_b O[a + b] S[b]``: M[m, a] = S[m - a] and the
    Hankel matrix H[b, a] = O[a + b]."""
    columns = jnp.arange(width)[None, :]
    by_outside = _matrix(siblings, jnp.arange(outside.shape[-1])[:, None] - columns)
    by_siblings = _matrix(outside, jnp.arange(siblings.shape[-1])[:, None] + columns)
    return by_outside, by_siblings


def _forward(logits, k, k_max: int):
    """(marginals, what the tangent pass needs): the kernels' tilt, leaves, upward and
    downward passes without FFT levels and without the top levels' ``_Loop`` (the tangent
    pass needs every level's tables), each level's factors and flush masks kept."""
    c = tilt(logits, k)
    weights, tables = _leaves(logits + c, k_max)
    up, children = [], []
    while tables.shape[1] > 1:
        batch, nodes, width = tables.shape
        out_width = min(2 * (width - 1), k_max) + 1
        if nodes % 2 == 1:
            tables, _ = _with_empty_nodes(tables, None, 1)
        pairs = tables.reshape(batch, tables.shape[1] // 2, 2, width)
        tables, scale, kept = _level_products(pairs, out_width)
        up.append((nodes % 2 == 1, scale, kept, _up_factors(*_unstack(pairs), out_width)))
        children.append(pairs)
    outside = jax.nn.one_hot(k, tables.shape[-1], dtype=tables.dtype)[:, None, :]
    down = []
    for (padded, _, _, _), pairs in zip(reversed(up), reversed(children), strict=True):
        batch, nodes, _, width = pairs.shape
        siblings = pairs[:, :, ::-1]  # the left child's sibling is the right one
        both = jnp.broadcast_to(outside[:, :, None], (batch, nodes, 2, outside.shape[-1]))
        raw = _correlate(both, siblings, width)
        scale, _ = _scale_of(raw)
        outside = _flush(raw * scale)
        down.append((scale, outside > 0, _down_factors(both, siblings, width)))
        outside = outside.reshape(batch, 2 * nodes, width)
        if padded:
            outside = outside[:, :-1]
    on = weights[..., 1] * outside[..., 1]
    off = weights[..., 0] * outside[..., 0]
    total = jnp.maximum(off + on, jnp.finfo(on.dtype).tiny)
    mu = on / total
    mu = jnp.where(weights[..., 0] == 0, jax.lax.stop_gradient(mu), mu)
    return mu, (weights, outside, total, mu, up, down)


def _unstack(pairs):
    return pairs[:, :, 0], pairs[:, :, 1]


def _product_tangent(d_pairs, factors, out_width):
    """``dL * R + L * dR`` truncated at ``out_width`` (see ``_up_factors``)."""
    d_left, d_right = _unstack(d_pairs)
    by_right, by_left = factors
    return _apply(d_left[..., :out_width], by_right) + _apply(d_right[..., :out_width], by_left)


def _outside_tangent(d_both, d_siblings, factors, width):
    """``corr(dO, S) + corr(O, dS)`` (see ``_down_factors``)."""
    by_outside, by_siblings = factors
    return _apply(d_both, by_outside) + _apply(d_siblings, by_siblings)


def _tangent(d_logits, saved):
    """The marginals' derivative along ``d_logits``: the tangents of the leaves, of every
    table up the tree and every outside table down it, each level a linear map of the
    tangents below (above) it with the forward pass's tables as coefficients."""
    weights, outside, total, mu, up, down = saved
    d_on_weight = weights[..., 1] * d_logits  # the off-weight exp(-max(x, 0)) is constant
    floor = float(jnp.finfo(d_logits.dtype).tiny) ** 0.5
    d_on_leaf = jnp.where(weights[..., 1] >= floor, d_on_weight, 0.0)
    d_tables = jnp.stack([jnp.zeros_like(d_logits), d_on_leaf], -1)
    d_children = []
    for padded, scale, kept, factors in up:
        batch, nodes, width = d_tables.shape
        if padded:
            d_tables = jnp.concatenate([d_tables, jnp.zeros((batch, 1, width), d_tables.dtype)], 1)
        d_pairs = d_tables.reshape(batch, d_tables.shape[1] // 2, 2, width)
        d_children.append(d_pairs)
        d_raw = _product_tangent(d_pairs, factors, kept.shape[-1])
        d_tables = jnp.where(kept, scale * d_raw, 0.0)
    d_outside = jnp.zeros_like(d_tables)  # the root's outside table is one-hot in k
    for (padded, _, _, _), (scale, kept, factors), d_pairs in zip(
        reversed(up), down, reversed(d_children), strict=True
    ):
        batch, nodes, _, width = d_pairs.shape
        d_both = jnp.broadcast_to(d_outside[:, :, None], (batch, nodes, 2, d_outside.shape[-1]))
        d_raw = _outside_tangent(d_both, d_pairs[:, :, ::-1], factors, width)
        d_outside = jnp.where(kept, scale * d_raw, 0.0).reshape(batch, 2 * nodes, width)
        if padded:
            d_outside = d_outside[:, :-1]
    d_on = d_on_weight * outside[..., 1] + weights[..., 1] * d_outside[..., 1]
    d_off = weights[..., 0] * d_outside[..., 0]
    # mu = on / total, total = max(on + off, tiny): as JAX differentiates the quotient.
    d_total = jnp.where(total > jnp.finfo(total.dtype).tiny, d_on + d_off, 0.0)
    d_mu = (d_on - mu * d_total) / total
    return jnp.where(weights[..., 0] == 0, 0.0, d_mu)
