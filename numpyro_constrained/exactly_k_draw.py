"""The sampler of the JAX exactly-k kernels (SIMPLE Algorithm 5): the root holds k ones; a
node holding c ones gives its left child m of them with probability proportional to
``left[m] right[c - m]``, by the inverse CDF as in the torch kernels, except on levels with
few table entries, which an exponential race splits (one argmax to compile instead of the
prefix sums: compile time, which JAX's static shapes make the limit, see ``_draw``)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from numpyro_constrained._products import matmul
from numpyro_constrained.exactly_k_convolution import _pad_last
from numpyro_constrained.exactly_k_tree import _Loop

# The sampler draws the splits of a level by the inverse CDF (see _prefix_sums: unrolled
# sums up to _UNROLLED_PREFIX_WIDTH wide, else products with triangular matrices of ones in
# blocks of _PREFIX_BLOCK; wider unrolled chains compile into a kernel per partial sum) where
# the level holds many table entries: at least _PREFIX_MIN_ENTRIES where its left tables are
# at most _PREFIX_BLOCK wide (one product), at least _BLOCKED_PREFIX_MIN_ENTRIES where they
# are wider, up to _PREFIX_BLOCK ** 2 (blocked products, slower to compile). There the race's
# random numbers cost more run time than the products' compilation (benchmarks/README.md,
# "Small k at large n"). Other levels are split by an exponential race (see _draw).
_PREFIX_BLOCK = 32
_UNROLLED_PREFIX_WIDTH = 5
_PREFIX_MIN_ENTRIES = 2**14
_BLOCKED_PREFIX_MIN_ENTRIES = 2**18


def _prefix_sums(weight: jax.Array) -> jax.Array:
    """Inclusive prefix sums along the last axis (at most ``_PREFIX_BLOCK ** 2`` wide),
    without ``cumsum``, which compiles on XLA's CPU backend into a tree of about a dozen
    kernels (its reduce-window rewrite). Up to ``_UNROLLED_PREFIX_WIDTH`` wide, as a chain of
    additions that XLA fuses into the kernel that uses them; wider, as products with
    triangular matrices of ones: within blocks of ``_PREFIX_BLOCK``, then the sums of the
    blocks before (two or three kernels; their extra multiply-adds, ``_PREFIX_BLOCK`` per
    entry, cost less at run time than the tree's passes). The products are ``_products``'s,
    at full precision on a GPU too."""
    width = weight.shape[-1]
    if width <= _UNROLLED_PREFIX_WIDTH:
        sums = [weight[..., 0]]
        for entry in range(1, width):
            sums.append(sums[-1] + weight[..., entry])
        return jnp.stack(sums, axis=-1)
    block = min(width, _PREFIX_BLOCK)
    blocks = -(-width // block)
    tiled = _pad_last(weight, 0, blocks * block - width)
    tiled = tiled.reshape(weight.shape[:-1] + (blocks, block))
    # NumPy constants, embedded in the program (jnp.triu compiles into a kernel per shape).
    upper = jnp.asarray(np.triu(np.ones((block, block))), weight.dtype)
    sums = matmul(tiled, upper)
    if blocks > 1:
        strictly_upper = jnp.asarray(np.triu(np.ones((blocks, blocks)), 1), weight.dtype)
        before = matmul(sums[..., -1], strictly_upper)
        sums = sums + before[..., None]
    return sums.reshape(weight.shape[:-1] + (blocks * block,))[..., :width]


def _races(left_shape: tuple, num_samples: int) -> bool:
    """Whether ``_draw`` splits a level whose left tables have shape ``left_shape`` (batch,
    nodes, width) by the exponential race (see ``_PREFIX_BLOCK``)."""
    batch, nodes, width = left_shape
    if width > _PREFIX_BLOCK**2:
        return True
    fewest = _PREFIX_MIN_ENTRIES if width <= _PREFIX_BLOCK else _BLOCKED_PREFIX_MIN_ENTRIES
    return num_samples * batch * nodes * width < fewest


def _draw(key: jax.Array, root_k: jax.Array, levels, num_samples: int) -> jax.Array:
    """Counts of ones per leaf, (num_samples, batch, n), top-down from root counts (batch,).

    A node holding c ones gives its left child m of them with probability proportional to
    ``w_m = left[m] right[c - m]``: by the inverse CDF (one uniform per split, prefix sums by
    ``_prefix_sums``), or where ``_races`` says so by an exponential race: m maximises
    ``w_m / E_m`` with independent standard exponential ``E_m`` (an exact draw from the same
    categorical distribution; splits of weight zero never win). The race needs one random
    number per entry instead of one per split, but its argmax is one kernel to compile (compile
    time is what limits the JAX kernels: benchmarks/README.md). Neither ever picks a split of
    weight zero."""
    counts = jnp.broadcast_to(root_k, (num_samples,) + root_k.shape)[..., None]
    # All random numbers drawn at once: a random call per level multiplies compile time.
    shapes = [level.left.shape for level in levels]  # (steps,) batch, nodes, width
    races = [_races(shape[-3:], num_samples) for shape in shapes]
    sizes = [
        math.prod(shape[:-3]) * shape[-2] * (shape[-1] if race else 1)
        for shape, race in zip(shapes, races, strict=True)
    ]
    dtype = levels[0].left.dtype if levels else jnp.float32
    uniforms = jax.random.uniform(key, counts.shape[:-1] + (sum(sizes),), dtype=dtype)
    used = 0
    for level, size, race in zip(*(reversed(t) for t in (levels, sizes, races)), strict=True):
        uniform = uniforms[..., used : used + size]
        used += size
        if isinstance(level, _Loop):
            counts = _draw_loop(counts, level, uniform, race)
            continue
        counts = _split(counts, level.left, level.right, level.bounds, uniform, race)
        if level.padded:
            counts = counts[..., :-1]
    return counts


def _draw_loop(root_counts: jax.Array, loop: _Loop, uniform: jax.Array, race: bool):
    """``_draw`` through a ``_Loop``: the counts of the nodes that entered it."""
    steps, _, half, _ = loop.left.shape
    start = jnp.zeros(root_counts.shape[:-1] + (2 * half,), root_counts.dtype)
    start = start.at[..., :1].set(root_counts)
    uniform = uniform.reshape(uniform.shape[:-1] + (steps, uniform.shape[-1] // steps))
    uniform = jnp.moveaxis(uniform, -2, 0)

    def step(counts, level):
        return _split(counts[..., :half], *level, race), None

    levels = (loop.left, loop.right, loop.bounds, uniform)
    return lax.scan(step, start, levels, reverse=True)[0][..., : loop.nodes]


def _split(counts, left, right, bounds, uniform, race: bool) -> jax.Array:
    """One level of ``_draw``: the children's counts (num_samples, batch, 2 nodes) from their
    parents' (num_samples, batch, nodes); ``bounds``: the children's (batch, 2 nodes, 2) or
    None; ``uniform``: the level's random numbers, (num_samples, batch, nodes * (width if
    race else 1))."""
    num_samples = counts.shape[0]
    w_left, w_right = left.shape[-1], right.shape[-1]
    rest = counts[..., None] - jnp.arange(w_left, dtype=counts.dtype)  # right's share
    possible = (rest >= 0) & (rest < w_right)
    right_at_rest = jnp.take_along_axis(
        jnp.broadcast_to(right, (num_samples,) + right.shape),
        jnp.clip(rest, 0, w_right - 1),
        axis=-1,
    )
    weight = jnp.where(possible, left * right_at_rest, 0.0)
    if race:
        exponential = -jnp.log1p(-uniform.reshape(weight.shape))  # in [0, inf)
        score = jnp.where(weight > 0, weight / exponential, -1.0)
        ones_left = jnp.argmax(score, axis=-1).astype(counts.dtype)
    else:
        cumulative = _prefix_sums(weight)
        threshold = uniform[..., None] * cumulative[..., -1:]
        # The first split of positive weight whose prefix sum exceeds u * total. Rounding
        # can give a split of weight zero a larger prefix sum than its predecessor's (the
        # sums are computed independently), or put u * total at the total: then the last
        # split of positive weight. Both in one min reduction (an argmax or a second
        # reduction compiles into more kernels): splits above the threshold rank first by
        # index, then the others of positive weight by descending index.
        index = jnp.arange(w_left, dtype=counts.dtype)
        positive = weight > 0
        rank = jnp.where(positive, 2 * w_left - index, 3 * w_left)
        rank = jnp.where((cumulative > threshold) & positive, index, rank).min(-1)
        ones_left = jnp.where(rank < w_left, rank, jnp.maximum(2 * w_left - rank, 0))
    if bounds is not None:
        # FFT levels: keep the draw among the splits both children can hold (noise could
        # otherwise, with a probability of the order of the noise, lead to a parent count
        # whose splits all have weight zero).
        bounds = bounds.astype(counts.dtype)
        pairs = (bounds.shape[0], bounds.shape[1] // 2, 2)
        low, high = bounds[..., 0].reshape(pairs), bounds[..., 1].reshape(pairs)
        first = jnp.maximum(low[..., 0], counts - high[..., 1])
        last = jnp.minimum(high[..., 0], counts - low[..., 1])
        ones_left = jnp.clip(ones_left, first, last)
    counts = jnp.stack([ones_left, counts - ones_left], axis=-1)
    return counts.reshape(counts.shape[:-2] + (2 * counts.shape[-2],))
