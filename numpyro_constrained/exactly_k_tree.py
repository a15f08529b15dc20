"""The tree of the JAX exactly-k kernels: leaves, the upward pass (products of polynomials
truncated at ``k_max``, each table rescaled by a power of two), the downward pass (outside
tables) and the marginals (docs/numerics.md, "The exactly-k kernels").

What JAX forces here, against the torch kernels: shapes are static, so the tree is unrolled
in Python level by level, and compile time (XLA's CPU code generation, a kernel per fusion,
loop body or conditional branch) is what limits small and medium problems. Hence: the FFT
rule is evaluated on the device, so each wide level is a ``lax.cond`` between FFT and direct
sums (under ``vmap`` both run); the normaliser and the draws build no ``lax.cond`` (every wide
level takes the FFT, from ``design.JAX_FFT_WIDTH_UNCONDITIONAL``); the top levels whose
tables are all ``k_max + 1`` wide run in one ``lax.scan`` of fixed shape (``_Loop``); the
node bounds of the FFT path are computed from the leaves at the first FFT level in one
array; the rescaling exponents are summed up the tree by elementwise additions and the
parents' bounds are sums of strided slices (reductions compile into several kernels each).
benchmarks/README.md ("JAX compile times") has the measurements.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from constrained_ppl import exactly_k_design as design
from numpyro_constrained.exactly_k_convolution import (
    _convolve,
    _convolve_by_fft,
    _correlate,
    _correlate_by_fft,
    _mask_outside,
    _pad_last,
)
from numpyro_constrained.exactly_k_tilt import tilt
from numpyro_constrained.exactly_k_values import wide_dtype

_FFT_WIDTH = design.JAX_FFT_WIDTH
_FFT_WIDTH_UNCONDITIONAL = design.JAX_FFT_WIDTH_UNCONDITIONAL
_FFT_MIN_VARIANCE = design.FFT_MIN_VARIANCE
# The top levels whose tables are all k_max + 1 wide (k_max small against n) run in one
# lax.scan of fixed shape (_Loop) once at most _LOOP_NODES nodes holding at most
# _LOOP_ENTRIES table entries are left, if that saves at least _LOOP_MIN_STEPS levels: each
# step then merges as many pairs as the first, mostly of empty tables, instead of halving,
# and the scan compiles once instead of once per level (JAX's static shapes: a level of its
# own compiles per shape). The entries bound keeps that wasted work small next to a level's
# (benchmarks/README.md, "JAX compile times", has the measurements of both).
_LOOP_NODES = 64
_LOOP_ENTRIES = 2**13
_LOOP_MIN_STEPS = 3


def _rescale(table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(table / 2^e, e) per node, 2^e the power of two with the largest entry in
    [2^e, 2^(e + 1)) (e in the wide dtype, a whole number), and entries below sqrt(tiny) of
    the largest set to zero (so products of two entries are never denormal).

    A power of two: the division is exact, and cheap enough for XLA to fuse into each of the
    table's consumers (a division by the largest entry itself becomes a reciprocal per node,
    a kernel of its own per level; compile time is what limits the JAX kernels). The factor
    is under stop_gradient: every quantity computed from the tables is either invariant to
    it (marginals, sampling) or adds it back explicitly (the normaliser).
    """
    scale, exponent = _scale_of(table)
    return _flush(table * scale), exponent


def _flush(table: jax.Array) -> jax.Array:
    """Entries below sqrt(tiny) set to zero (the torch kernels' rule; see ``_rescale``)."""
    return jnp.where(table > float(jnp.finfo(table.dtype).tiny) ** 0.5, table, 0.0)


def _scale_of(table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(2^-e per node, shape (..., 1), under stop_gradient; e in the wide dtype): the factor
    of ``_rescale``."""
    info = jnp.finfo(table.dtype)
    tiny = float(info.tiny)
    largest = jnp.maximum(lax.stop_gradient(table).max(-1, keepdims=True), tiny)
    # 2^-e from the bits of the largest entry (jnp.frexp and jnp.ldexp compile into a kernel
    # per node of their own): its biased exponent field is e + bias, 2^-e's is bias - e.
    bits = {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[info.bits]
    field = lax.bitcast_convert_type(largest, bits) >> info.nmant  # e + bias (largest > 0)
    bias = 2 ** (info.nexp - 1) - 1
    scale = lax.bitcast_convert_type((2 * bias - field) << info.nmant, table.dtype)
    return scale, (field[..., 0] - bias).astype(wide_dtype(table.dtype))


def _leaves(x: jax.Array, k_max: int):
    """Leaf tables ``[1, exp(x_i)]`` divided by their largest entry exp(max(x_i, 0)):
    returns (``[exp(-max(x, 0)), exp(x - max(x, 0))]`` (unflushed), flushed tables truncated
    at k_max). The log factors, ``max(x_i, 0)``, are added back in the wide dtype by
    ``log_normalizer_value``."""
    shift = jnp.maximum(lax.stop_gradient(x), 0.0)
    weights = jnp.stack([jnp.exp(-shift), jnp.exp(x - shift)], axis=-1)
    floor = float(jnp.finfo(x.dtype).tiny) ** 0.5
    tables = jnp.where(weights >= floor, weights, 0.0)[..., : k_max + 1]
    return weights, tables


class _Level(NamedTuple):
    """One level of the tree: node j of the level above is the parent of ``left`` node j
    and ``right`` node j, (batch, nodes, width) each; ``padded``: the last right node is the
    table of an empty set, added to make the count even. ``bounds``: on levels wide enough
    for the FFT path, the children's lowest and highest possible counts (batch, 2 nodes, 2),
    left and right child of each parent in turn (else None)."""

    left: jax.Array
    right: jax.Array
    padded: bool
    bounds: jax.Array | None = None


def _by_rule(fft: jax.Array | bool, by_fft, direct, *operands) -> jax.Array:
    """A wide level: ``by_fft`` where ``fft`` is True, else a ``lax.cond`` on the device's
    decision (both branches compiled)."""
    return by_fft(*operands) if fft is True else lax.cond(fft, by_fft, direct, *operands)


def _merge(pairs: jax.Array, bounds: jax.Array | None, out_width: int, fft):
    """One level of the upward pass: the rescaled products of node pairs ``pairs`` (batch,
    nodes, 2, width) truncated at ``out_width``, and their exponents (see ``_rescale``);
    ``bounds``: the parents' bounds (batch, nodes, 2), or None below the FFT levels."""
    if bounds is not None and out_width >= _fft_width(fft):

        def by_fft(pairs):
            return _mask_outside(_convolve_by_fft(pairs, out_width), bounds)

        def direct(pairs):
            return _convolve(pairs[:, :, 0], pairs[:, :, 1], out_width)

        merged = _by_rule(fft, by_fft, direct, pairs)
    else:
        merged = _convolve(pairs[:, :, 0], pairs[:, :, 1], out_width)
    return _rescale(merged)


def _parent_bounds(bounds: jax.Array) -> jax.Array:
    """The bounds of the parents of nodes (batch, 2 parents, 2): their children's sums, as an
    addition of strided slices, which XLA fuses into the bounds' consumers (a reduction over
    the pairs compiled into a kernel per level)."""
    return bounds[:, 0::2] + bounds[:, 1::2]


def _with_empty_nodes(tables: jax.Array, bounds: jax.Array | None, number: int):
    """``number`` tables of an empty set (``[1, 0, ...]``, bounds 0) appended to the nodes."""
    batch, _, width = tables.shape
    empty = jnp.zeros((batch, number, width), tables.dtype).at[..., 0].set(1.0)
    tables = jnp.concatenate([tables, empty], axis=1)
    if bounds is not None:
        bounds = jnp.pad(bounds, ((0, 0), (0, number), (0, 0)))
    return tables, bounds


def _upward(tables: jax.Array, k_max: int, fft: jax.Array | bool | None):
    """Merge pairs of nodes until one is left. ``tables``: (batch, nodes, width).
    ``fft``: None if no level is wide enough for the FFT path; True if the levels at least
    ``_fft_width(fft)`` wide take it; else a boolean scalar on the device: whether they take
    it (``lax.cond``, the direct sums otherwise). The top levels whose tables are all
    ``k_max + 1`` wide run in one ``lax.scan`` (``_Loop``)."""
    levels = []
    # The exponents of the rescaling summed over each node's subtree, from the leaves (none)
    # up: elementwise additions, which XLA fuses, where a sum over each level's nodes compiled
    # into two to four kernels per level (a concatenation of the levels' exponents is split
    # back into one reduction per level by XLA's algebraic simplifier).
    subtree = jnp.zeros(tables.shape[:2], wide_dtype(tables.dtype))
    if fft is not None:
        # Lowest and highest possible count of every leaf: it can be off unless its flushed
        # off-weight is zero, and on unless its on-weight is zero. A node's bounds are the
        # sums over its leaves (not truncated at k_max: the downward pass takes the rest's
        # bounds as the root's minus a node's), needed from the first FFT level up.
        off = tables[..., 0] == 0
        on = tables[..., 1] > 0 if tables.shape[-1] > 1 else jnp.zeros_like(off)
        leaf_bounds = jnp.stack([off, on], axis=-1).astype(jnp.int32)
    bounds = None
    span = 1  # leaves per node
    while tables.shape[1] > 1:
        batch, nodes, width = tables.shape
        out_width = min(2 * (width - 1), k_max) + 1
        if fft is not None and bounds is None and out_width >= _fft_width(fft):
            # The children's bounds from their leaves in one kernel (a kernel per level
            # below would cost compile time; see "Compile time" in the module docstring).
            leaf_bounds = jnp.pad(
                leaf_bounds, ((0, 0), (0, nodes * span - leaf_bounds.shape[1]), (0, 0))
            )
            # Summed in float32 (exact: span is at most a few hundred leaves), which
            # compiles into one kernel, an integer sum into two.
            bounds = leaf_bounds.reshape(batch, nodes, span, 2).astype(jnp.float32).sum(2)
            bounds = bounds.astype(jnp.int32)
        if (
            width == k_max + 1
            and 2 ** (_LOOP_MIN_STEPS - 1) < nodes <= _LOOP_NODES
            and nodes * width <= _LOOP_ENTRIES
        ):
            tables, loop, subtree = _upward_loop(tables, bounds, subtree, fft)
            levels.append(loop)
            break
        padded = nodes % 2 == 1
        if padded:
            tables, bounds = _with_empty_nodes(tables, bounds, 1)
            subtree = _pad_last(subtree, 0, 1)
        pairs = tables.reshape(batch, tables.shape[1] // 2, 2, width)
        children = bounds
        if bounds is not None:
            bounds = _parent_bounds(bounds)
        tables, exponent = _merge(pairs, bounds, out_width, fft)
        subtree = exponent + subtree[:, 0::2] + subtree[:, 1::2]
        levels.append(_Level(pairs[:, :, 0], pairs[:, :, 1], padded, children))
        span *= 2
    # The exponent sum itself (a whole number, exact in either dtype), not its multiple of
    # log 2: in float32 that product, thousands at n = 1e4, would round to 2e-4.
    return tables[:, 0], levels, subtree[:, 0]


class _Loop(NamedTuple):
    """The top levels of the tree, all ``k_max + 1`` wide, as one ``lax.scan`` of fixed
    shape, so that they compile once instead of once per level (compile time is what limits
    the JAX kernels; benchmarks/README.md). ``nodes`` nodes enter, followed by tables of an
    empty set up to ``2 ** steps``; step s merges nodes 2j and 2j + 1 of its buffer into node j
    and fills the upper half with empty tables again, so the root is node 0 after the last
    step. ``left``, ``right``: each step's children, (steps, batch, 2 ** (steps - 1), width);
    ``bounds``: each step's children's bounds, (steps, batch, 2 ** steps, 2), or None. Every
    step merges ``2 ** (steps - 1)`` pairs, most of them empty: at most ``_LOOP_NODES`` nodes
    holding at most ``_LOOP_ENTRIES`` table entries enter, so the extra work is a few times
    one level's entries whatever n."""

    left: jax.Array
    right: jax.Array
    nodes: int
    bounds: jax.Array | None


def _upward_loop(tables: jax.Array, bounds: jax.Array | None, subtree: jax.Array, fft):
    """``_upward`` through a ``_Loop``: (the root's table, the loop, the root's subtree
    exponent), from the nodes' tables, bounds and subtree exponents."""
    batch, nodes, width = tables.shape
    steps = (nodes - 1).bit_length()
    half = 2 ** (steps - 1)
    tables, bounds = _with_empty_nodes(tables, bounds, 2 * half - nodes)
    subtree = _pad_last(subtree, 0, 2 * half - nodes)

    def step(carry, _):
        tables, bounds, subtree = carry
        pairs = tables.reshape(batch, half, 2, width)
        children = bounds
        if bounds is not None:
            bounds = _parent_bounds(bounds)
        merged, exponent = _merge(pairs, bounds, width, fft)
        merged, bounds = _with_empty_nodes(merged, bounds, half)
        subtree = _pad_last(exponent + subtree[:, 0::2] + subtree[:, 1::2], 0, half)
        return (merged, bounds, subtree), (pairs[:, :, 0], pairs[:, :, 1], children)

    (tables, _, subtree), (left, right, children) = lax.scan(
        step, (tables, bounds, subtree), length=steps
    )
    return tables[:, :1], _Loop(left, right, nodes, children), subtree[:, :1]


def _outside_of_children(outside, left, right, bounds, k, total, fft) -> jax.Array:
    """One level of the downward pass: the rescaled outside tables of the children (batch,
    2 nodes, width) from their parents' (batch, nodes, width of a parent). ``bounds``: the
    children's (batch, 2 nodes, 2), ``total``: the root's (batch, 1, 2), or both None."""
    batch, nodes, width = left.shape
    # Both children at once: the left one's sibling is `right` and vice versa.
    siblings = jnp.stack([right, left], axis=2)
    both = jnp.broadcast_to(outside[:, :, None], (batch, nodes, 2, outside.shape[-1]))
    if bounds is not None:
        # outside[a] is proportional to P(rest = k - a): possible only for
        # low_rest <= k - a <= high_rest, and a child's own entry a only for
        # low <= a <= high.
        k_column = k[:, None].astype(bounds.dtype)
        rest = total - bounds  # the rest's (low, high)
        bounds = jnp.stack(
            [
                jnp.maximum(bounds[..., 0], k_column - rest[..., 1]),
                jnp.minimum(bounds[..., 1], k_column - rest[..., 0]),
            ],
            axis=-1,
        ).reshape(batch, nodes, 2, 2)

        def by_fft(both, siblings):
            return _mask_outside(_correlate_by_fft(both, siblings, width), bounds)

        def direct(both, siblings):
            return _correlate(both, siblings, width)

        tables = _by_rule(fft, by_fft, direct, both, siblings)
    else:
        tables = _correlate(both, siblings, width)
    outside, _ = _rescale(tables)
    return outside.reshape(batch, 2 * nodes, width)


def _downward(root_width: int, levels, k: jax.Array, dtype, fft) -> jax.Array:
    """Outside tables of the leaves, (batch, n, width of a leaf), up to a factor per leaf.
    ``fft``: as for ``_upward``."""
    outside = jax.nn.one_hot(k, root_width, dtype=dtype)[:, None, :]
    total = None
    if levels and levels[-1].bounds is not None:  # the root's: the sums over its children
        top = levels[-1].bounds
        total = (top[-1] if isinstance(levels[-1], _Loop) else top).sum(1, keepdims=True)
    for level in reversed(levels):
        if isinstance(level, _Loop):
            outside = _downward_loop(outside, level, k, total, fft)
            continue
        outside = _outside_of_children(
            outside, level.left, level.right, level.bounds, k, total, fft
        )
        if level.padded:
            outside = outside[:, :-1]
    return outside


def _downward_loop(root_outside, loop: _Loop, k, total, fft) -> jax.Array:
    """``_downward`` through a ``_Loop``: the outside tables of the nodes that entered it."""
    _, batch, half, width = loop.left.shape
    start = jnp.zeros((batch, 2 * half, width), root_outside.dtype)
    start = start.at[:, :1].set(root_outside)

    def step(outside, level):
        left, right, bounds = level
        return _outside_of_children(outside[:, :half], left, right, bounds, k, total, fft), None

    levels = (loop.left, loop.right, loop.bounds)
    return lax.scan(step, start, levels, reverse=True)[0][:, : loop.nodes]


def flatten(logits: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits as ``(batch, n)``, ``k`` broadcast to the batch as int32 ``(batch,)``): the
    layout every kernel works in."""
    k = jnp.broadcast_to(jnp.asarray(k), logits.shape[:-1]).reshape(-1).astype(jnp.int32)
    return logits.reshape(-1, logits.shape[-1]), k


def _prepare(logits: jax.Array, k: jax.Array, k_max: int, for_marginals: bool):
    """Flattened tilted inputs, leaf weights, and the upward pass (``exponent``: the sum of
    the internal nodes' factors' base-2 logarithms, a whole number in the wide dtype).
    ``for_marginals``: whether the tables will feed a downward pass (see ``_use_fft``)."""
    flat_logits, flat_k = flatten(logits, k)
    c = tilt(flat_logits, flat_k)
    x = flat_logits + c
    weights, leaf_tables = _leaves(x, k_max)
    fft = _use_fft(x, k_max, for_marginals)
    root, levels, exponent = _upward(leaf_tables, k_max, fft)
    return flat_k, c[:, 0], weights, root, levels, exponent, fft


def _use_fft(x: jax.Array, k_max: int, for_marginals: bool) -> jax.Array | bool | None:
    """None if no level can be ``_FFT_WIDTH`` wide; True where only the root entry or a draw
    is needed (``for_marginals`` false: see "FFT path" in the module docstring); else whether
    the wide levels go by FFT, on the device: every row's tilted count variance
    ``sum_i sigmoid(x_i) sigmoid(-x_i)`` is at least ``_FFT_MIN_VARIANCE``."""
    if min(k_max, 2 ** (x.shape[-1] - 1).bit_length()) + 1 < _fft_width(not for_marginals):
        return None
    if not for_marginals:
        return True
    x = lax.stop_gradient(x)
    variance = (jax.nn.sigmoid(x) * jax.nn.sigmoid(-x)).astype(wide_dtype(x.dtype)).sum(-1)
    return jnp.all(variance >= _FFT_MIN_VARIANCE)


def _fft_width(fft: jax.Array | bool) -> int:
    """The narrowest level on the FFT path: ``_FFT_WIDTH_UNCONDITIONAL`` where every wide level
    takes it (``fft is True``), else ``_FFT_WIDTH``."""
    return _FFT_WIDTH_UNCONDITIONAL if fft is True else _FFT_WIDTH


def _marginals_from(flat_k, weights, root, levels, fft, with_complements: bool = False):
    outside = _downward(root.shape[-1], levels, flat_k, weights.dtype, fft)
    on = weights[..., 1] * outside[..., 1]
    off = weights[..., 0] * outside[..., 0]
    total = jnp.maximum(off + on, jnp.finfo(on.dtype).tiny)
    # A leaf whose off-weight is exactly zero is always on: marginal 1, derivative exactly 0
    # (the ratio's is rounding noise, which a saturated logit of a caller magnifies).
    mu = jnp.where(weights[..., 0] == 0, lax.stop_gradient(on / total), on / total)
    if with_complements:
        return mu, lax.stop_gradient(off / total)
    return mu
