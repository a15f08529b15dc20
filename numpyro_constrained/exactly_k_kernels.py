"""Numerical kernels of ExactlyKBernoulli (docs/distributions/exactly_k_bernoulli.md), JAX.

Pure functions of ``logits`` (shape ``batch + (n,)``, entries finite or ``-inf``), ``k``
(integer array of shape ``batch``, ``0 <= k <= number of finite logits``) and ``k_max`` (a
Python int, ``max(k) <= k_max <= n``; tables are truncated at it). The distribution calls
only these functions; ``+inf`` logits and feasibility are handled by the caller. All of them
work under ``jax.jit``, ``jax.vmap`` and ``jax.grad``, and are jitted themselves (``k_max`` and
``sample_shape`` static) so that eager calls compile once per shape.

Method (SIMPLE Algorithms 4 and 5, in scaled linear space; the same as
``pyro_constrained.exactly_k_kernels``):

* Tilt: add a constant c (no gradient) so that the tilted Bernoullis
  ``z_i ~ Bernoulli(sigmoid(x_i))``, ``x = logits + c``, have expected count about k.
  This leaves the conditional distribution unchanged and puts the bulk of every table
  near the entries that matter.
* Upward pass: each leaf holds the table ``[1, exp(x_i)]`` (the polynomial
  ``1 + exp(x_i) t``), each internal node the product of its children's polynomials
  truncated at degree ``k_max`` (a truncated convolution): a binary tree of depth
  ``ceil(log2 n)`` and O(n k_max) work. Every table is stored divided by the power of two
  at or below its largest entry (an exact division), with the log of that factor kept
  aside, so nothing overflows; entries below ``sqrt(tiny)`` times the largest one are set
  to zero, so every product of two stored
  entries is a normal float (denormal arithmetic is up to 100x slower on CPUs, and such
  entries are invisible at working precision next to the largest one). The root's entry k
  is ``e_k(exp x)`` up to the kept factors:

      log e_k(exp logits) = log root[k] + sum of kept log factors - k c.

* Downward pass (inside-outside): the outside table of the root is the indicator of k; a
  child's outside table is the correlation of its parent's outside table with its
  sibling's table. At a leaf with outside table ``[o_0, o_1]``,

      mu_i = exp(x_i) o_1 / (o_0 + exp(x_i) o_1),

  a ratio of positive terms (no cancellation, so small marginals keep their relative
  precision). Every outside table is again rescaled (by a power of two): the ratio does
  not depend on it. The marginals are built from differentiable operations, so they can be
  differentiated again (the straight-through gradient), and ``log_normalizer``'s
  derivative is defined (``custom_jvp``) to be these marginals.
* Sampling (SIMPLE Algorithm 5): the root holds k ones; a node holding c ones gives its
  left child m of them with probability proportional to ``left[m] right[c - m]``, down to
  the leaves.

FFT path (cost independent of k). A level of the tree whose product tables are at least
``_FFT_WIDTH`` wide (``_FFT_WIDTH_UNCONDITIONAL`` for the normaliser and the draws, see
below) is computed by FFT instead of the direct sums: the upward convolutions
and the downward correlations, in float64 arithmetic whatever the tables' dtype (float32
when JAX's x64 mode is off: errors then about 1e-7 times a table's largest entry, which
meets float32 accuracy only for well spread count distributions). A level of w-wide tables
then costs O(n log w) instead of O(n w), so the whole tree costs O(n log^2 n) for any k,
and the tables stored for the backward pass and the sampler are O(n log n) entries.
Accuracy, and why it suffices:

* FFT rounding is about 1e-16 times the largest entry of each output table, not relative to
  each entry. Structural zeros stay exact: every node carries the bounds of its possible
  counts (a leaf can be off unless its off-weight is flushed to zero, on unless its
  on-weight is zero; a parent sums its children's), and FFT outputs outside them are set to
  exactly zero, outside tables likewise (the rest of the tree must be able to hold
  ``k - a``). So ``-inf`` logits are never selected, forced variables always are, and the
  sampler additionally keeps every draw within the bounds.
* Which entries need relative accuracy: the tilt puts the expected count at k, so for every
  node the entries that carry ``root[k]`` and the marginals lie near the peak of its table
  and near the peak of its outside table, where an error relative to the largest entry is a
  relative error. A leaf's marginal ``w_1 o_1 / (w_0 o_0 + w_1 o_1)`` takes its own
  weights exactly (they never pass through an FFT) and ``o_0, o_1 = P(rest = k), P(rest =
  k - 1)`` (up to a common factor): both are near the peak of the rest's count distribution
  when that distribution is spread out, so marginals and complements as small as 1e-300
  keep full relative precision. It fails only when the count distribution is nearly
  deterministic (its variance ``V = sum_i sigmoid(x_i) sigmoid(-x_i)`` small: then
  ``o_0 / o_1`` can be far below 1e-16 and the smaller one is noise). Hence the rule: the
  FFT path is taken only when every row has ``V >= _FFT_MIN_VARIANCE`` (4); other batches
  take the exact direct sums at every level (O(n k) again: a batch with one nearly
  deterministic row is as slow as before). Measured (tests/test_exactly_k_kernels.py):
  marginals down to 1e-60 and the log normaliser agree with the direct path and with a
  log-space reference to about 1e-15 relative in float64 and to float32 rounding in float32.

Narrower levels, and every level of a batch the rule keeps off the FFT path, are computed
directly (sums of positive products: every entry keeps its relative precision). The rule is
evaluated on the device, so each wide level is a ``lax.cond`` between the two (under
``vmap`` a ``cond`` becomes a select and both run).

The rule is needed only for the marginals. Where only the root's entry k (the normaliser:
``log_prob``, entropy and KL parts) or a draw is needed, the wide levels always go by FFT,
and no ``lax.cond`` (whose two branches both compile) is built:

* the tilt puts the tilted count's mean at k (to about 1e-4), and the mode of a
  Poisson-binomial count lies within 1 of its mean (Darroch, 1964), at the integer mean
  itself, so ``root[k]`` is the root's largest entry or within a small factor of it, at any
  variance: errors relative to each table's largest entry are relative errors of it;
* a draw picks each split with probability ``left[m] right[c - m]`` over their sum: an
  absolute error of about eps in these probabilities (structurally impossible splits stay
  exactly impossible: the bounds), which is the resolution of the uniform that picks the
  split anyway (an inverse CDF cannot tell a probability below eps from zero). A draw is
  exact in that sense, as on the direct path.

Compile time is XLA's CPU code generation, about 10-20 ms of CPU per kernel (a fusion, a
loop body, a conditional branch), and the tree is unrolled in Python because its levels
have different shapes (nodes halve, widths grow): 17 levels at n = 1e5, each a handful of
kernels per pass, with both branches of every wide level's ``lax.cond`` compiled where
marginals are computed. Hence: the normaliser and the draws build no ``lax.cond`` (above);
a sample that is not differentiated computes no marginals (``sample_straight_through``);
the top levels whose tables are all ``k_max + 1`` wide, once few nodes and table entries
are left (``_LOOP_NODES``, ``_LOOP_ENTRIES``), run in one ``lax.scan`` of fixed shape
(``_Loop``); the node bounds of the FFT
path are one array, computed from the leaves at the first FFT level; an FFT level
transforms both children in one call; tables are rescaled by powers of two, which XLA
fuses into their consumers (a division by the largest entry compiles into a reciprocal
kernel per level); reductions are few and floating (XLA's CPU backend compiles an integer
or boolean reduction of a long axis into a tree of about five kernels: ``count``), so the
rescaling exponents are summed up the tree by elementwise additions, the parents' bounds are
sums of strided slices, and the tilt's Newton step makes one reduction of its three sums;
and the sampler's inverse CDF takes its prefix sums unrolled (up to
``_UNROLLED_PREFIX_WIDTH``) or as products with triangular matrices (a ``cumsum`` compiles
into a tree of about a dozen kernels per level), picks its split in one reduction, and
splits the levels with few table entries by an exponential race (one argmax per level,
``_races``). Where no ``lax.cond`` is built, FFT levels compile into fewer kernels than
direct ones, hence FFT from width 129 there; the marginals take it from 513, below which
XLA's direct sums run faster. benchmarks/README.md ("JAX compile times") has the numbers.

Compilation: the public functions are thin wrappers around jitted ones (``k_max`` and
``sample_shape`` static). They pad n with ``-inf`` logits to a size bucket (``_bucket``:
powers of two, also 1.5 times a power of two above 1024, and eight buckets per octave above
65536) and round ``k_max`` up to a power of
two, then cut the outputs back to n, so an eager loop whose n or k varies compiles once per
bucket. They do the same inside a caller's ``jit``/``grad``/``vmap``: the padded tables fix
the random numbers a sample consumes, so a key draws the same sample eagerly and under jit.
"""

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from constrained_ppl import exactly_k_design as design

# The framework-free constants, with the reason for each value, live in one place for both
# packages.
_TILT_STEPS = design.TILT_STEPS
_TILT_TOLERANCE = design.TILT_TOLERANCE
_TILT_FLAT = design.TILT_FLAT
_TILT_MAX_STEPS = design.TILT_MAX_STEPS
_FFT_WIDTH = design.JAX_FFT_WIDTH
_FFT_WIDTH_UNCONDITIONAL = design.JAX_FFT_WIDTH_UNCONDITIONAL
_FFT_MIN_VARIANCE = design.FFT_MIN_VARIANCE
# Widths up to this are convolved by an unrolled shift-and-add (fused by XLA); wider ones by
# a fori_loop over groups of _SHIFTS_PER_STEP shifts, so compile time does not grow with
# k_max while each loop step still makes one fused pass over the output.
_UNROLL_WIDTH = 2
_SHIFTS_PER_STEP = 8
# The sampler draws the splits of a level by the inverse CDF (see _prefix_sums: unrolled
# sums up to _UNROLLED_PREFIX_WIDTH wide, else products with triangular matrices of ones in
# blocks of _PREFIX_BLOCK; wider unrolled chains compile into a kernel per partial sum) where
# the level holds many table entries: at least _PREFIX_MIN_ENTRIES where its left tables are
# at most _PREFIX_BLOCK wide (one product), at least _BLOCKED_PREFIX_MIN_ENTRIES where they
# are wider, up to _PREFIX_BLOCK ** 2 (blocked products, slower to compile). There the race's
# random numbers cost more run time than the products' compilation (n = 1e5: 2x at k = 10;
# n = 1e7: 15% at k = 100). Other levels are split by an exponential race (see _draw).
_PREFIX_BLOCK = 32
_UNROLLED_PREFIX_WIDTH = 5
_PREFIX_MIN_ENTRIES = 2**14
_BLOCKED_PREFIX_MIN_ENTRIES = 2**18
# The top levels whose tables are all k_max + 1 wide (k_max small against n) run in one
# lax.scan of fixed shape (_Loop) once at most _LOOP_NODES nodes holding at most
# _LOOP_ENTRIES table entries are left, if that saves at least _LOOP_MIN_STEPS levels: each
# step then merges as many pairs as the first, mostly of empty tables, instead of halving,
# and the scan compiles once instead of once per level (jit(sample) at n = 1e5: 2.2-2.4 s of
# compilation before, 1.6-1.8 s after, on the idle machine). The entries bound keeps that
# wasted work small next to a level's: with 64 nodes of 1025-wide tables, the marginals at
# n = 1e4 to 1e6, k = 1000 ran 10% to 30% slower.
_LOOP_NODES = 64
_LOOP_ENTRIES = 2**13
_LOOP_MIN_STEPS = 3
# Eager calls pad n with -inf logits (never selected, so nothing changes) to a size bucket
# and round k_max up to a power of two, so that a loop whose n or k varies compiles once per
# bucket: sizes up to _SMALLEST_BUCKET share one bucket, powers of two up to
# _FINE_BUCKETS_FROM, then also 1.5 times a power of two (at most a third of padding), and
# above _FINEST_BUCKETS_FROM eight buckets per octave (at most an eighth of padding: there
# the padded leaves' run time outweighs a compilation).
_SMALLEST_BUCKET = 16
_FINE_BUCKETS_FROM = 1024
_FINEST_BUCKETS_FROM = 65536


def tilt(logits: jax.Array, k: jax.Array) -> jax.Array:
    """A constant c per batch element (shape ``batch + (1,)``, under ``stop_gradient``) with
    ``sum_i sigmoid(logits_i + c) ~= k``, for any finite logits however large.

    Newton's method on ``g(c) = log f(c) - log(m - f(c))``, f the expected count and m the
    number of finite logits: g is increasing and close to linear with slope 1 in both tails
    (where Newton on f itself crawls), and exactly linear when m = 1. Steps that leave a
    bracket that provably holds the root are replaced by bisection, and the iteration stops
    once every step is below ``_TILT_TOLERANCE`` (usually after 2 or 3 steps from the
    bracket ``[logit(t/m) - max x, logit(t/m) - min x]``). That bracket is as wide as the
    spread of the logits: with masked logits (-1e4, -1e9) bisection cannot narrow it in a
    few steps, and inside a wide gap between the logits f is constant to working precision,
    so Newton may stop anywhere in the gap. Rows where either can have happened restart
    from order statistics (``_restart_tilt``; under ``vmap`` the restart is computed for
    every row, because ``lax.cond`` becomes a select). The target count t is clamped to
    [1/2, m - 1/2] because the exact solution is infinite for k = 0 and k = m; any finite c
    leaves the distribution unchanged, and the tables only need c roughly right.
    """
    logits = lax.stop_gradient(logits)
    dtype = logits.dtype
    finite = jnp.isfinite(logits)
    num_finite = count(finite)[..., None].astype(dtype)
    m = jnp.maximum(num_finite, 1.0)
    target = jnp.minimum(jnp.maximum(jnp.asarray(k).astype(dtype)[..., None], 0.5), m - 0.5)
    target = jnp.maximum(target, 0.25)  # m = 1: any c in a wide range will do
    largest = logits.max(-1, keepdims=True)
    smallest = jnp.where(finite, logits, jnp.inf).min(-1, keepdims=True)
    goal = jnp.log(target) - jnp.log(m - target)
    low = jnp.where(num_finite > 0, goal - largest, 0.0).astype(dtype)
    high = jnp.where(num_finite > 0, goal - smallest, 0.0).astype(dtype)
    c, settled = _newton(logits, finite, goal, low, high, 0.5 * (low + high), _TILT_STEPS)
    unsettled = ~settled & (num_finite > 1)

    def restart():
        return jnp.where(unsettled, _restart_tilt(logits, finite, target, goal, m), c)

    c = lax.cond(jnp.any(unsettled), restart, lambda: c)
    return lax.stop_gradient(c)


def count(mask: jax.Array) -> jax.Array:
    """The number of True entries of ``mask`` along its last axis (int32), summed in
    floating point where every partial sum is an exact integer (up to 2^24 entries in float32,
    2^53 in float64): XLA's CPU backend compiles an integer reduction of a long axis into a
    tree of about five kernels and a floating one into one, and compile time is what limits
    these kernels (see "Compile time" above)."""
    exact = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    if mask.shape[-1] > 2 ** (jnp.finfo(exact).nmant + 1):
        return mask.sum(-1, dtype=jnp.int32)
    return mask.astype(exact).sum(-1).astype(jnp.int32)


def _newton(logits, finite, goal, low, high, c, max_steps: int):
    """Safeguarded Newton steps on g (see ``tilt``) from ``c`` inside ``[low, high]``.
    Returns (c, settled): settled rows took a last step below ``_TILT_TOLERANCE`` at a
    count variance of at least ``_TILT_FLAT``."""
    dtype = logits.dtype

    def step(state):
        # One sigmoid per step: 1 - on is exact to an absolute eps, which only matters where
        # the off-count is tiny, far from the root (the bracket catches it).
        steps, c, low, high, _, _ = state
        on = jax.nn.sigmoid(logits + c)
        off = jnp.where(finite, 1.0 - on, 0.0)
        # The three sums in one reduction, and both logs in one operation: each reduction of
        # its own, and each operation on the (batch, 1) results, compiled into a kernel.
        sums = jnp.stack([on, off, on * off], axis=-2).sum(-1)
        count_on, count_off, slope = (sums[..., i : i + 1] for i in range(3))
        logs = jnp.log(sums[..., :2])
        g = logs[..., :1] - logs[..., 1:]
        too_many = g > goal
        high = jnp.where(too_many, c, high)
        low = jnp.where(too_many, low, c)
        newton = c - (g - goal) / (slope * (1.0 / count_on + 1.0 / count_off))
        inside = (newton >= low) & (newton <= high)  # False for NaN steps too
        new_c = jnp.where(inside, newton, 0.5 * (low + high)).astype(dtype)
        small = jnp.abs(new_c - c) <= _TILT_TOLERANCE
        done = jnp.all(small | (high - low <= _TILT_TOLERANCE))
        return steps + 1, new_c, low, high, done, small & (slope >= _TILT_FLAT)

    def more(state):
        steps, _, _, _, done, _ = state
        return (steps < max_steps) & ~done

    settled = jnp.zeros(c.shape, bool)
    start = (jnp.int32(0), c.astype(dtype), low, high, jnp.bool_(False), settled)
    _, c, _, _, _, settled = lax.while_loop(more, step, start)
    return c, settled


def _restart_tilt(logits, finite, target, goal, m):
    """The tilt from the order statistics ``a = x_(ceil t)`` and ``b = x_(floor t + 1)``
    (descending): at ``c = -b + log(t / (floor t + 1 - t))`` the largest ``floor t + 1``
    terms alone reach the count t, and at ``c = -a - log((m - t) / (t - ceil t + 1))`` the
    terms from rank ``ceil t`` down cannot lift it above t, so the root lies between, a
    bracket only ``a - b + O(log m)`` wide. When a - b is large (a gap), the root is within
    ``log(m) / 2`` of ``-(a + b) / 2 + log(t / (m - t)) / 2`` (the two saturated tails
    balance there), where Newton starts; f may be flat there to working precision, but the
    start is already as close as the tables need."""
    descending = -jnp.sort(-logits, axis=-1)
    above = jnp.ceil(target) - 1
    below = jnp.minimum(jnp.floor(target), logits.shape[-1] - 1)
    a = jnp.take_along_axis(descending, above.astype(jnp.int32), axis=-1)
    b = jnp.take_along_axis(descending, below.astype(jnp.int32), axis=-1)
    # Rows without finite logits (not restarted) must not turn the loop's test into NaN.
    a, b = (jnp.where(jnp.isfinite(t), t, 0.0) for t in (a, b))
    low = -a - jnp.log((m - target) / (target - above))
    high = -b + jnp.log(target / (below + 1.0 - target))
    start = -(0.5 * a + 0.5 * b) + 0.5 * (jnp.log(target) - jnp.log(m - target))
    start = jnp.clip(start, low, high)
    return _newton(logits, finite, goal, low, high, start, _TILT_MAX_STEPS)[0]


# ----------------------------------------------------------------------------------------
# Truncated convolutions and correlations of many short tables at once.


def _pad_last(x: jax.Array, before: int, after: int) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(before, after)])


def _convolve(left: jax.Array, right: jax.Array, width: int) -> jax.Array:
    """out[..., j] = sum_a left[..., a] right[..., j - a] for j < width."""
    left = left[..., :width]
    w_left, w_right = left.shape[-1], right.shape[-1]
    if w_left <= _UNROLL_WIDTH:
        out = jnp.zeros(left.shape[:-1] + (width,), left.dtype)
        for a in range(w_left):
            span = min(w_right, width - a)
            out = out + _pad_last(left[..., a : a + 1] * right[..., :span], a, width - a - span)
        return out
    # shifted[a][j] = right[j - a]: a window of right padded by zeros on both sides. The
    # shifts are taken _SHIFTS_PER_STEP at a time (left padded with zero weights), so that
    # XLA fuses them into one pass over the output per loop step.
    steps = -(-w_left // _SHIFTS_PER_STEP)
    left = _pad_last(left, 0, steps * _SHIFTS_PER_STEP - w_left)
    before = max(width, steps * _SHIFTS_PER_STEP)
    padded = _pad_last(right[..., :width], before, width + max(0, width - w_right))

    def add_shifts(step, out):
        for shift in range(_SHIFTS_PER_STEP):
            a = step * _SHIFTS_PER_STEP + shift
            shifted = lax.dynamic_slice_in_dim(padded, before - a, width, axis=-1)
            out = out + lax.dynamic_slice_in_dim(left, a, 1, axis=-1) * shifted
        return out

    zeros = jnp.zeros(left.shape[:-1] + (width,), left.dtype)
    if steps == 1:  # no loop: a one-step while loop compiles (and differentiates) slowly
        return add_shifts(0, zeros)
    return lax.fori_loop(0, steps, add_shifts, zeros)


def _correlate(outside: jax.Array, right: jax.Array, width: int) -> jax.Array:
    """out[..., a] = sum_b outside[..., a + b] right[..., b] for a < width."""
    w_right = right.shape[-1]
    outside = outside[..., : width + w_right - 1]
    padded = _pad_last(outside, 0, width + w_right - outside.shape[-1])
    if w_right <= _UNROLL_WIDTH:
        out = jnp.zeros(outside.shape[:-1] + (width,), outside.dtype)
        for b in range(w_right):
            out = out + padded[..., b : b + width] * right[..., b : b + 1]
        return out

    steps = -(-w_right // _SHIFTS_PER_STEP)
    right = _pad_last(right, 0, steps * _SHIFTS_PER_STEP - w_right)
    padded = _pad_last(padded, 0, steps * _SHIFTS_PER_STEP - w_right)

    def add_shifts(step, out):
        for shift in range(_SHIFTS_PER_STEP):
            b = step * _SHIFTS_PER_STEP + shift
            window = lax.dynamic_slice_in_dim(padded, b, width, axis=-1)
            out = out + window * lax.dynamic_slice_in_dim(right, b, 1, axis=-1)
        return out

    zeros = jnp.zeros(outside.shape[:-1] + (width,), outside.dtype)
    if steps == 1:
        return add_shifts(0, zeros)
    return lax.fori_loop(0, steps, add_shifts, zeros)


def _fft_dtype(dtype):
    """FFT arithmetic in float64 whenever x64 is on (float32 tables would get an error of
    1e-7 times their largest entry), else in float32 (see "FFT path")."""
    return jnp.promote_types(dtype, jnp.float64) if jax.config.jax_enable_x64 else dtype


def _convolve_by_fft(pairs: jax.Array, width: int) -> jax.Array:
    """``_convolve`` of ``pairs[..., 0, :]`` and ``pairs[..., 1, :]`` as a circular
    convolution long enough that nothing wraps around, both transforms in one FFT (one
    padding kernel to compile instead of two). Its error is about eps times the largest
    entry of the output, not relative to each entry; negative noise is clamped to zero, and
    the caller zeroes the structurally impossible entries (``_mask_outside``)."""
    length = design.fft_length(2 * pairs.shape[-1] - 1)
    wide = _fft_dtype(pairs.dtype)
    spectra = jnp.fft.rfft(pairs.astype(wide), length)
    out = jnp.fft.irfft(spectra[..., 0, :] * spectra[..., 1, :], length)[..., :width]
    return jnp.maximum(out, 0.0).astype(pairs.dtype)


def _correlate_by_fft(outside: jax.Array, right: jax.Array, width: int) -> jax.Array:
    """``_correlate`` by FFT (see ``_convolve_by_fft``)."""
    w_right = right.shape[-1]
    outside = outside[..., : width + w_right - 1]
    length = design.fft_length(max(outside.shape[-1], width) + w_right - 1)
    wide = _fft_dtype(outside.dtype)
    spectrum = jnp.fft.rfft(outside.astype(wide), length) * jnp.conj(
        jnp.fft.rfft(right.astype(wide), length)
    )
    out = jnp.fft.irfft(spectrum, length)[..., :width]
    return jnp.maximum(out, 0.0).astype(outside.dtype)


def _mask_outside(table: jax.Array, bounds: jax.Array) -> jax.Array:
    """``table`` (..., width) with the entries outside ``bounds[..., 0]..bounds[..., 1]``
    zero."""
    index = jnp.arange(table.shape[-1])
    inside = (index >= bounds[..., :1]) & (index <= bounds[..., 1:])
    return jnp.where(inside, table, 0.0)


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
    info = jnp.finfo(table.dtype)
    tiny = float(info.tiny)
    largest = jnp.maximum(lax.stop_gradient(table).max(-1, keepdims=True), tiny)
    # 2^-e from the bits of the largest entry (jnp.frexp and jnp.ldexp compile into a kernel
    # per node of their own): its biased exponent field is e + bias, 2^-e's is bias - e.
    bits = {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[info.bits]
    field = lax.bitcast_convert_type(largest, bits) >> info.nmant  # e + bias (largest > 0)
    bias = 2 ** (info.nexp - 1) - 1
    scale = lax.bitcast_convert_type((2 * bias - field) << info.nmant, table.dtype)
    # Entries below sqrt(tiny) after the division are zero (the torch kernels' rule).
    table = table * scale
    table = jnp.where(table > tiny**0.5, table, 0.0)
    return table, (field[..., 0] - bias).astype(wide_dtype(table.dtype))


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


def wide_dtype(dtype):
    """The dtype of the normaliser's parts and of the values computed from them: float64
    when x64 is on (in float32 they are sums of many terms that can be large and nearly
    cancel), else ``dtype``: then ``log_constraint_prob_value`` and ``kl_value`` keep their
    large parts apart and subtract them before rounding."""
    return jnp.promote_types(dtype, jnp.float64) if jax.config.jax_enable_x64 else dtype


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
        pairs = tables.reshape(batch, -1, 2, width)
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


def _prepare(logits: jax.Array, k: jax.Array, k_max: int, for_marginals: bool):
    """Flattened tilted inputs, leaf weights, and the upward pass (``exponent``: the sum of
    the internal nodes' factors' base-2 logarithms, a whole number in the wide dtype).
    ``for_marginals``: whether the tables will feed a downward pass (see ``_use_fft``)."""
    n = logits.shape[-1]
    flat_logits = logits.reshape(-1, n)
    flat_k = jnp.broadcast_to(jnp.asarray(k), logits.shape[:-1]).reshape(-1).astype(jnp.int32)
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


def _bucket(size: int) -> int:
    """The padded size of a bucket of sizes (see ``_SMALLEST_BUCKET``)."""
    if size <= _SMALLEST_BUCKET:
        return _SMALLEST_BUCKET
    power = 1 << (size - 1).bit_length()
    per_octave = 1 if size <= _FINE_BUCKETS_FROM else 2 if size <= _FINEST_BUCKETS_FROM else 8
    step = power // (2 * per_octave)  # sizes in (power / 2, power] round up to a multiple
    return -(-size // step) * step


def _to_bucket(logits, k_max: int):
    """(logits, k_max, n): the logits padded with -inf to the bucket of n (variables that
    are never selected: every quantity of the others is unchanged, and the padded ones get
    marginal 0 and are cut off again), k_max rounded up to a power of two (a wider
    truncation changes nothing), and n to cut the outputs back to. Traced logits (inside a
    caller's jit, grad or vmap) are padded too: the tables, and so the random numbers a
    sample consumes, must not depend on whether the caller jitted, or a key would draw
    different samples eagerly and under jit."""
    logits = jnp.asarray(logits)
    n = logits.shape[-1]
    size = _bucket(n)
    if k_max > 0:
        k_max = min(1 << (k_max - 1).bit_length(), size)
    if size > n:
        logits = _pad_to(logits, size)
    return logits, k_max, n


# Jitted (one dispatch each, compiled once per pair of sizes): an eager jnp.pad is several
# dispatched operations, which cost more than the kernels themselves at n = 1000.
@partial(jax.jit, static_argnums=1)
def _pad_to(logits: jax.Array, size: int) -> jax.Array:
    padding = [(0, 0)] * (logits.ndim - 1) + [(0, size - logits.shape[-1])]
    return jnp.pad(logits, padding, constant_values=-jnp.inf)


@partial(jax.jit, static_argnums=1)
def _cut_to(out: jax.Array, n: int) -> jax.Array:
    return out[..., :n]


def _cut(out: jax.Array, n: int | None) -> jax.Array:
    return out if n is None or out.shape[-1] == n else _cut_to(out, n)


def normalizer_parts(logits: jax.Array, k: jax.Array, k_max: int) -> NormalizerParts:
    """The parts of ``log e_k(exp logits)`` (see ``NormalizerParts``), from one upward pass."""
    logits, k_max, _ = _to_bucket(logits, k_max)
    return _normalizer_parts(logits, k, k_max)


@partial(jax.jit, static_argnames="k_max")
def _normalizer_parts(logits: jax.Array, k: jax.Array, k_max: int) -> NormalizerParts:
    logits = lax.stop_gradient(logits)
    if k_max == 0:
        return _zero_parts(logits)
    flat_k, c, _, root, _, exponent, _ = _prepare(logits, jnp.asarray(k), k_max, False)
    return _parts_from(logits, flat_k, c, root, exponent)


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
    on = jnp.maximum(y, 0.0) - jnp.maximum(x, 0.0)
    off = jnp.maximum(-y, 0.0) - jnp.maximum(-x, 0.0)
    terms = jnp.where(x > -jnp.inf, mu_complement * on + mu * off, 0.0)
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


def _marginals_from(flat_k, weights, root, levels, fft, with_complements: bool = False):
    outside = _downward(root.shape[-1], levels, flat_k, weights.dtype, fft)
    on = weights[..., 1] * outside[..., 1]
    off = weights[..., 0] * outside[..., 0]
    total = jnp.maximum(off + on, jnp.finfo(on.dtype).tiny)
    if with_complements:
        return on / total, lax.stop_gradient(off / total)
    return on / total


@partial(jax.custom_jvp, nondiff_argnums=(2,))
def _log_normalizer(logits: jax.Array, k: jax.Array, k_max: int, parts) -> jax.Array:
    return log_normalizer_value(logits, k, parts).astype(logits.dtype)


@_log_normalizer.defjvp
def _log_normalizer_jvp(k_max, primals, tangents):
    logits, k, parts = primals
    d_logits = tangents[0]
    value = _log_normalizer(logits, k, k_max, parts)
    mu = _marginals(logits, k, k_max)
    return value, (mu * d_logits).sum(-1)


def log_normalizer(
    logits: jax.Array, k: jax.Array, k_max: int, parts: NormalizerParts | None = None
) -> jax.Array:
    """log e_k(exp logits), shape ``batch``; its derivative is ``marginals`` (differentiable
    again, without NaN at ``-inf`` logits). ``parts``: from ``normalizer_parts``, if the
    caller has them already."""
    logits, k_max, _ = _to_bucket(logits, k_max)
    return _log_normalizer_jit(logits, k, k_max, parts)


@partial(jax.jit, static_argnames="k_max")
def _log_normalizer_jit(logits, k, k_max: int, parts):
    k = jnp.broadcast_to(jnp.asarray(k), logits.shape[:-1])
    if parts is None:
        parts = _normalizer_parts(logits, k, k_max)
    return _log_normalizer(logits, k, k_max, parts)


def marginals(logits: jax.Array, k: jax.Array, k_max: int) -> jax.Array:
    """mu_i = P(z_i = 1 | sum z = k) = d log e_k(exp logits) / d logits_i, shape
    ``batch + (n,)``; differentiable again."""
    logits, k_max, n = _to_bucket(logits, k_max)
    return _cut(_marginals(logits, k, k_max), n)


@partial(jax.jit, static_argnames="k_max")
def _marginals(logits: jax.Array, k: jax.Array, k_max: int) -> jax.Array:
    if k_max == 0:
        return jnp.zeros_like(logits)
    flat_k, _, weights, root, levels, _, fft = _prepare(logits, jnp.asarray(k), k_max, True)
    return _marginals_from(flat_k, weights, root, levels, fft).reshape(logits.shape)


def marginals_and_complements(
    logits: jax.Array, k: jax.Array, k_max: int
) -> tuple[jax.Array, jax.Array]:
    """(``marginals``, ``1 - marginals`` without rounding: from the leaves' off-weights, no
    gradient), so that a marginal near 1 keeps the relative precision of its complement."""
    logits, k_max, n = _to_bucket(logits, k_max)
    mu, complement = _marginals_and_complements(logits, k, k_max)
    return _cut(mu, n), _cut(complement, n)


@partial(jax.jit, static_argnames="k_max")
def _marginals_and_complements(logits, k, k_max: int):
    if k_max == 0:
        return jnp.zeros_like(logits), jnp.ones_like(logits)
    flat_k, _, weights, root, levels, _, fft = _prepare(logits, jnp.asarray(k), k_max, True)
    mu, complement = _marginals_from(flat_k, weights, root, levels, fft, with_complements=True)
    return mu.reshape(logits.shape), complement.reshape(logits.shape)


def _prefix_sums(weight: jax.Array) -> jax.Array:
    """Inclusive prefix sums along the last axis (at most ``_PREFIX_BLOCK ** 2`` wide),
    without ``cumsum``, which compiles on XLA's CPU backend into a tree of about a dozen
    kernels (its reduce-window rewrite). Up to ``_UNROLLED_PREFIX_WIDTH`` wide, as a chain of
    additions that XLA fuses into the kernel that uses them; wider, as products with
    triangular matrices of ones: within blocks of ``_PREFIX_BLOCK``, then the sums of the
    blocks before (two or three kernels; their extra multiply-adds, ``_PREFIX_BLOCK`` per
    entry, cost less at run time than the tree's passes). ``HIGHEST`` precision: a GPU's
    default float32 product rounds to 10 bits."""
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
    sums = jnp.matmul(tiled, upper, precision=lax.Precision.HIGHEST)
    if blocks > 1:
        strictly_upper = jnp.asarray(np.triu(np.ones((blocks, blocks)), 1), weight.dtype)
        before = jnp.matmul(sums[..., -1], strictly_upper, precision=lax.Precision.HIGHEST)
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
    uniform = jnp.moveaxis(uniform.reshape(uniform.shape[:-1] + (steps, -1)), -2, 0)

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
        low = bounds[..., 0].reshape(bounds.shape[0], -1, 2)
        high = bounds[..., 1].reshape(bounds.shape[0], -1, 2)
        first = jnp.maximum(low[..., 0], counts - high[..., 1])
        last = jnp.minimum(high[..., 0], counts - low[..., 1])
        ones_left = jnp.clip(ones_left, first, last)
    counts = jnp.stack([ones_left, counts - ones_left], axis=-1)
    return counts.reshape(counts.shape[:-2] + (-1,))


def _sample_and_maybe_marginals(key, logits, k, k_max, sample_shape, with_marginals):
    sample_shape = tuple(sample_shape)
    out_shape = sample_shape + logits.shape
    if k_max == 0:
        return jnp.zeros(out_shape, logits.dtype), jnp.zeros_like(logits)
    num_samples = 1
    for size in sample_shape:
        num_samples *= size
    flat_k, _, weights, root, levels, _, fft = _prepare(
        logits, jnp.asarray(k), k_max, with_marginals
    )
    detached = [
        level._replace(left=lax.stop_gradient(level.left), right=lax.stop_gradient(level.right))
        for level in levels
    ]
    counts = _draw(key, flat_k, detached, num_samples)
    z = counts.astype(logits.dtype).reshape(out_shape)
    mu = None
    if with_marginals:
        mu = _marginals_from(flat_k, weights, root, levels, fft).reshape(logits.shape)
    return z, mu


def sample(
    key: jax.Array, logits: jax.Array, k: jax.Array, k_max: int, sample_shape: tuple = ()
) -> jax.Array:
    """Exact draws, shape ``sample_shape + batch + (n,)``, entries 0.0 / 1.0 summing to k.
    No gradient."""
    logits, k_max, n = _to_bucket(logits, k_max)
    return _cut(_sample(key, logits, k, k_max, tuple(sample_shape)), n)


@partial(jax.jit, static_argnames=("k_max", "sample_shape"))
def _sample(key, logits, k, k_max: int, sample_shape: tuple):
    logits = lax.stop_gradient(logits)
    return _sample_and_maybe_marginals(key, logits, k, k_max, sample_shape, False)[0]


def sample_straight_through(
    key: jax.Array, logits: jax.Array, k: jax.Array, k_max: int, sample_shape: tuple = ()
) -> jax.Array:
    """Exact draws (the values of ``sample``) whose derivative is that of ``marginals``,
    broadcast over ``sample_shape``: the straight-through estimator ``z + mu -
    stop_gradient(mu)`` as a ``custom_jvp``, so that a caller who does not differentiate
    never computes the marginals (``jit`` of a sample compiles and runs the upward pass and
    the draw only), and one who does gets both from one upward pass
    (``sample_and_marginals``)."""
    logits, k_max, n = _to_bucket(logits, k_max)
    return _cut(_straight_through_sample(key, logits, k, k_max, tuple(sample_shape)), n)


@partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _straight_through_sample(key, logits, k, k_max: int, sample_shape: tuple):
    return _sample(key, logits, k, k_max, sample_shape)


@_straight_through_sample.defjvp
def _straight_through_sample_jvp(k_max, sample_shape, primals, tangents):
    key, logits, k = primals

    def draw_and_marginals(logits):
        return _sample_and_marginals(key, logits, k, k_max, sample_shape)

    (z, _), (_, d_mu) = jax.jvp(draw_and_marginals, (logits,), (tangents[1],))
    return z, jnp.broadcast_to(d_mu, z.shape)


def sample_and_marginals(
    key: jax.Array, logits: jax.Array, k: jax.Array, k_max: int, sample_shape: tuple = ()
) -> tuple[jax.Array, jax.Array]:
    """(sample(...), marginals(...)) from one upward pass (for the straight-through sample)."""
    logits, k_max, n = _to_bucket(logits, k_max)
    z, mu = _sample_and_marginals(key, logits, k, k_max, tuple(sample_shape))
    return _cut(z, n), _cut(mu, n)


@partial(jax.jit, static_argnames=("k_max", "sample_shape"))
def _sample_and_marginals(key, logits, k, k_max: int, sample_shape: tuple):
    return _sample_and_maybe_marginals(key, logits, k, k_max, sample_shape, True)
