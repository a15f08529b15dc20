"""Truncated convolutions and correlations of many short tables at once (JAX exactly-k
kernels), direct or by FFT.

Direct sums are sums of positive products (every entry keeps its relative precision):
unrolled up to ``_UNROLL_WIDTH``, wider in a ``fori_loop`` over groups of shifts, so that
compile time does not grow with the width (JAX's static shapes: the torch kernels loop in
Python instead). By FFT, in float64 whenever x64 is on (float32 otherwise): the error is then
about eps times the largest entry of each output table, which the caller makes sufficient
(docs/numerics.md, "FFT path").
"""

import jax
import jax.numpy as jnp
from jax import lax

from constrained_ppl import exactly_k_design as design

# Widths up to this are convolved by an unrolled shift-and-add (fused by XLA); wider ones by
# a fori_loop over groups of _SHIFTS_PER_STEP shifts, so compile time does not grow with
# k_max while each loop step still makes one fused pass over the output.
_UNROLL_WIDTH = 2
_SHIFTS_PER_STEP = 8


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
