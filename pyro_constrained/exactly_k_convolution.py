"""Truncated convolutions and correlations of many short tables at once (torch exactly-k
kernels), direct or by FFT.

Direct sums are sums of positive products (every entry keeps its relative precision, and an
entry is zero exactly when it is impossible): float32 node-major tables by one grouped
oneDNN ``conv1d``, the rest by shifting and adding in place. By FFT, in float64 whatever the
tables' dtype: the error is then about 1e-16 times the largest entry of each output table,
not relative to each entry, which the caller makes sufficient (docs/numerics.md, "FFT
path"). Which form runs where is a measured crossover (``constrained_ppl.exactly_k_design``).
"""

import torch
import torch.nn.functional as F
from pyro.ops.tensor_utils import next_fast_len

from constrained_ppl import exactly_k_design as design
from pyro_constrained.exactly_k_tracing import _in_place_allowed

_SHIFT_WIDTH = design.TORCH_SHIFT_WIDTH
_SHIFT_WIDTH_FLOAT32 = design.TORCH_SHIFT_WIDTH_FLOAT32
_FFT_WIDTH_FLOAT64 = design.TORCH_CORRELATE_FFT_WIDTH_FLOAT64
_BLOCK_BYTES = design.TORCH_BLOCK_BYTES


def _convolve(left: torch.Tensor, right: torch.Tensor, width: int) -> torch.Tensor:
    """out[..., j] = sum_a left[..., a] right[..., j - a] for j < width."""
    nodes = left.shape[:-1]
    left = left[..., :width]
    w_left, w_right = left.shape[-1], right.shape[-1]
    if left.dtype == torch.float32 and w_left > _SHIFT_WIDTH_FLOAT32:
        # One grouped conv1d (oneDNN) is the fastest exact form in float32.
        groups = left.numel() // w_left
        signal = F.pad(left.reshape(1, groups, w_left), (w_right - 1, width - w_left))
        kernel = right.flip(-1).reshape(groups, 1, w_right)
        return F.conv1d(signal, kernel, groups=groups).reshape(nodes + (width,))
    # Shift and add in place (float64 grouped convolutions and matrix-vector products are
    # slower on CPU).
    return _shift_and_add(left, right, width, -1)


def _in_batch_blocks(
    function,
    tables: tuple[torch.Tensor, ...],
    bytes_per_row: int,
    block_bytes: int = _BLOCK_BYTES,
):
    """``function(*tables)`` computed on blocks of the batch (first) dimension of about
    ``block_bytes`` of output each (``bytes_per_row`` per row of the batch), and
    concatenated (outputs: a tensor or a tuple of tensors). The direct sums make one pass
    over their output per shift, and a block's output stays in cache between passes (2x
    faster at n = 10000)."""
    batch = tables[0].shape[0]
    rows = max(1, block_bytes // bytes_per_row)
    if rows >= batch:
        return function(*tables)
    blocks = [
        function(*(table[start : start + rows] for table in tables))
        for start in range(0, batch, rows)
    ]
    if isinstance(blocks[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*blocks, strict=True))
    return torch.cat(blocks)


def _correlate(
    outside: torch.Tensor, right: torch.Tensor, width: int, fft: bool = False
) -> torch.Tensor:
    """out[..., a] = sum_b outside[..., a + b] right[..., b] for a < width (``outside``
    broadcasts against ``right`` in the dimensions before the last)."""
    w_right = right.shape[-1]
    outside = outside[..., : width + w_right - 1]
    if fft or (outside.dtype != torch.float32 and w_right >= _FFT_WIDTH_FLOAT64):
        return _correlate_by_fft(outside, right, width)
    nodes = torch.broadcast_shapes(outside.shape[:-1], right.shape[:-1])
    outside = outside.expand(nodes + outside.shape[-1:])
    right = right.expand(nodes + right.shape[-1:])
    w_out = outside.shape[-1]
    if outside.dtype == torch.float32 and w_right > _SHIFT_WIDTH_FLOAT32:
        groups = outside.numel() // w_out
        signal = F.pad(outside.reshape(1, groups, w_out), (0, width + w_right - 1 - w_out))
        kernel = right.reshape(groups, 1, w_right)
        return F.conv1d(signal, kernel, groups=groups).reshape(nodes + (width,))
    if outside.dtype != torch.float32 and w_right > _SHIFT_WIDTH:
        # float64: a batched matrix-vector product with the Toeplitz windows of `outside`
        # (a strided view).
        padded = F.pad(outside, (0, width + w_right - 1 - w_out))
        windows = padded.unfold(-1, w_right, 1)[..., :width, :]
        return (windows @ right.unsqueeze(-1)).squeeze(-1)
    return _shift_and_add_correlate(outside, right, width, -1)


def _correlate_by_fft(outside: torch.Tensor, right: torch.Tensor, width: int) -> torch.Tensor:
    """``_correlate`` as a circular correlation of length >= width + w_right - 1 (so nothing
    wraps around), with one transform of ``outside`` shared by everything it broadcasts to.

    Its rounding error is about eps times the largest entry of the output (measured: 6e-16
    relative in float64), not relative to each entry; it is used only for float64 outside
    tables, whose entries near the largest one are all the marginals depend on: the outside
    table of a leaf is (P(rest = k), P(rest = k - 1)) up to a common factor, tilting puts k
    near the mode of the rest, and a small marginal is small because of its own leaf's
    weight. Marginals down to 1e-60 keep 1e-12 relative precision
    (tests/test_exactly_k_kernels.py). Negative rounding noise is clamped to zero.
    """
    # Python ints: under torch.jit.trace sizes are traced values, and a transform length
    # computed from them is replayed wrongly (the output had the wrong size).
    width, length = int(width), next_fast_len(int(width) + int(right.shape[-1]) - 1)
    dtype = outside.dtype
    outside, right = outside.to(torch.float64), right.to(torch.float64)
    spectrum = torch.fft.rfft(outside, length) * torch.fft.rfft(right, length).conj()
    return torch.fft.irfft(spectrum, length)[..., :width].clamp(min=0.0).to(dtype)


def _convolve_by_fft(left: torch.Tensor, right: torch.Tensor, width: int) -> torch.Tensor:
    """``_convolve`` by FFT in float64 (whatever the tables' dtype: float32 tables would
    otherwise get an error of 1e-7 times their largest entry), as a circular convolution
    long enough that nothing wraps around. The error is about 1e-16 times the largest entry
    of the output, not relative to each entry (see "FFT path" in the module docstring);
    negative rounding noise is clamped to zero, and the caller zeroes the entries that are
    structurally impossible (``_mask_outside``)."""
    left = left[..., :width]
    width, length = int(width), next_fast_len(int(left.shape[-1]) + int(right.shape[-1]) - 1)
    dtype = left.dtype
    left, right = left.to(torch.float64), right.to(torch.float64)
    spectrum = torch.fft.rfft(left, length) * torch.fft.rfft(right, length)
    return torch.fft.irfft(spectrum, length)[..., :width].clamp(min=0.0).to(dtype)


def _mask_outside(table: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """``table`` (nodes-major, (..., nodes, width)) with the entries outside ``low..high``
    (integer tensors of shape (..., nodes)) set to exactly zero."""
    index = torch.arange(table.shape[-1], device=table.device)
    inside = (index >= low[..., None]) & (index <= high[..., None])
    return torch.where(inside, table, 0.0)


def _shift_and_add(left: torch.Tensor, right: torch.Tensor, width: int, dim: int):
    """``_convolve`` along ``dim``, one in-place multiply-add per shift. With tables stored
    width-major, (batch, width, nodes), and dim = 1, each shift is one pass over a contiguous
    slab of all nodes, which is what makes narrow, numerous nodes cheap (in node-major
    storage every operation strides over a last dimension of 2 to 16 entries)."""
    w_left, w_right = min(left.shape[dim], width), right.shape[dim]
    shape = list(left.shape)
    shape[dim] = width
    out = left.new_zeros(shape)
    in_place = _in_place_allowed()
    for a in range(w_left):
        span = min(w_right, width - a)
        if in_place:
            out.narrow(dim, a, span).addcmul_(left.narrow(dim, a, 1), right.narrow(dim, 0, span))
        else:
            term = left.narrow(dim, a, 1) * right.narrow(dim, 0, span)
            out = out.index_add(dim, torch.arange(a, a + span, device=out.device), term)
    return out


def _shift_and_add_correlate(
    outside: torch.Tensor, right: torch.Tensor, width: int, dim: int
) -> torch.Tensor:
    """``_correlate`` along ``dim``, one in-place multiply-add per shift: out[a] =
    sum_b outside[a + b] right[b] (``outside`` broadcasts against ``right`` elsewhere)."""
    w_out, w_right = outside.shape[dim], right.shape[dim]
    shape = list(
        torch.broadcast_shapes(outside.narrow(dim, 0, 1).shape, right.narrow(dim, 0, 1).shape)
    )
    shape[dim] = width
    out = right.new_zeros(shape)
    in_place = _in_place_allowed()
    for b in range(w_right):
        span = min(width, w_out - b)
        if span <= 0:
            continue
        if in_place:
            out.narrow(dim, 0, span).addcmul_(outside.narrow(dim, b, span), right.narrow(dim, b, 1))
        else:
            term = (outside.narrow(dim, b, span) * right.narrow(dim, b, 1)).expand(
                out.narrow(dim, 0, span).shape
            )
            out = out.index_add(dim, torch.arange(span, device=out.device), term)
    return out
