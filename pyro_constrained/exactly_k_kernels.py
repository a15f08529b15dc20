"""Numerical kernels of ExactlyKBernoulli (docs/distributions/exactly_k_bernoulli.md), PyTorch.

Pure functions of ``logits`` (shape ``batch + (n,)``, entries finite or ``-inf``), ``k``
(integer tensor of shape ``batch``, ``0 <= k <= number of finite logits``) and ``k_max`` (a
Python int, ``max(k) <= k_max <= n``; tables are truncated at it). The distribution calls
only these functions; ``+inf`` logits and feasibility are handled by the caller.

Method (SIMPLE Algorithms 4 and 5, in scaled linear space):

* Tilt: add a constant c (no gradient) so that the tilted Bernoullis
  ``z_i ~ Bernoulli(sigmoid(x_i))``, ``x = logits + c``, have expected count about k.
  This leaves the conditional distribution unchanged and puts the bulk of every table
  near the entries that matter.
* Upward pass: each leaf holds the table ``[1, exp(x_i)]`` (the polynomial
  ``1 + exp(x_i) t``), each internal node the product of its children's polynomials
  truncated at degree ``k_max`` (a truncated convolution): a binary tree of depth
  ``ceil(log2 n)`` and O(n k_max) work. Every table is stored divided by its largest entry,
  with the log of that factor kept aside, so nothing overflows; entries below
  ``sqrt(tiny)`` times the largest one are set to zero, so every product of two stored
  entries is a normal float (denormal arithmetic is up to 100x slower on CPUs, and such
  entries are invisible at working precision next to the largest one). The root's entry k
  is ``e_k(exp x)`` up to the kept factors:

      log e_k(exp logits) = log root[k] + sum of kept log factors - k c.

* Downward pass (inside-outside): the outside table of the root is the indicator of k; a
  child's outside table is the correlation of its parent's outside table with its
  sibling's table. At a leaf with outside table ``[o_0, o_1]``,

      mu_i = exp(x_i) o_1 / (o_0 + exp(x_i) o_1),

  a ratio of positive terms (no cancellation, so small marginals keep their relative
  precision). Every outside table is again rescaled by its largest entry: the ratio does
  not depend on it. The marginals are built from differentiable operations, so they can be
  differentiated again (the straight-through gradient of ``rsample``), and
  ``log_normalizer``'s gradient is defined to be these marginals.
* Sampling (SIMPLE Algorithm 5): the root holds k ones; a node holding c ones gives its
  left child m of them with probability proportional to ``left[m] right[c - m]``, down to
  the leaves.

FFT path (cost independent of k). A level of the tree whose product tables are at least
``_FFT_WIDTH`` wide is computed by FFT instead of the direct sums: the upward convolutions
and the downward correlations, in float64 arithmetic whatever the tables' dtype. A level of
w-wide tables then costs O(n log w) instead of O(n w), so the whole tree costs O(n log^2 n)
for any k, and the tables stored for the backward pass and the sampler are O(n log n)
entries. Accuracy, and why it suffices:

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

Storage and arithmetic, chosen by measurement (benchmarks/README.md):

* A level of the tree pairs node j with node j + half (the nodes split in halves, so both
  children of a level are contiguous). Tables at most ``_NARROW`` wide are stored
  width-major, (batch, width, nodes): the lower levels hold many narrow nodes, and each
  shift of a convolution is then one multiply-add over a contiguous slab. Wider tables are
  stored node-major, (batch, nodes, width).
* Upward convolutions off the FFT path are direct (sums of positive products: every entry
  keeps its relative precision, and an entry is zero exactly when it is impossible):
  float32 node-major levels by one grouped oneDNN ``conv1d``, the rest by shifting and
  adding in place. The FFT path starts at ``_FFT_WIDTH`` (float64) and
  ``_FFT_WIDTH_FLOAT32`` (float32 levels are one oneDNN convolution, faster up to there).
* Downward correlations of float64 tables at least ``_FFT_WIDTH_FLOAT64`` wide are computed
  by FFT (``_correlate_by_fft``: its error is relative to a table's largest entry, which
  the marginals tolerate, see there); the rest directly.
* float64 node-major levels and the sampler's draws run in blocks of batch rows that fit in
  cache (``_in_batch_blocks``), and the large arrays are rescaled in place: at n = 10000 a
  fresh array is tens of megabytes, and every pass over one is memory-bound.
"""

import warnings
from functools import partial, wraps
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pyro_constrained import exactly_k_small as _small

_TILT_STEPS = 6
# A step below this leaves the expected count within about 1e-4 of k (measured; Newton
# converges quadratically), far closer than the tables need.
_TILT_TOLERANCE = 0.1
# Rows that have not converged after _TILT_STEPS, or whose count distribution is nearly
# deterministic at the result (variance below _TILT_FLAT, where the expected count can be
# flat to working precision far from the root), start again from order statistics
# (_restart_tilt) and may take up to _TILT_MAX_STEPS steps.
_TILT_FLAT = 0.1
_TILT_MAX_STEPS = 60
# The restart's step bound where every step is taken (traced or compiled code): bisection
# alone narrows a bracket of width up to 0.1 * 2^24 (1.7e6) below _TILT_TOLERANCE, and for a
# wider one, a gap between the order statistics, the start is already within log(m) / 2 of
# the root (see _restart_tilt). Each step is unrolled in a trace, and TorchScript's
# optimising pass grows faster than linearly with the graph (measured with a Pyro JIT ELBO
# step: 2 s of optimisation at 15 steps, 5 s at 24, 41 s at 60).
_TILT_TRACED_STEPS = 24
# Node-major convolutions are computed by shifting and adding in place for float64 always,
# and float64 correlations up to _SHIFT_WIDTH (wider ones: Toeplitz matrix-vector products,
# and FFT from _FFT_WIDTH_FLOAT64); in float32 both up to _SHIFT_WIDTH_FLOAT32 (wider ones:
# oneDNN's grouped conv1d). Measured per level at batch 256, n = 1000 on one CPU thread.
_SHIFT_WIDTH = 8
_SHIFT_WIDTH_FLOAT32 = 2
# float64 outside tables of nodes at least this wide are computed by FFT (3-5x faster than
# the direct sums from width 33 up; slower below).
_FFT_WIDTH_FLOAT64 = 32
# Tables at most this wide are stored width-major (see _Level), wider ones node-major.
_NARROW = 16
# The FFT path (see "FFT path" in the module docstring): levels whose product tables are at
# least _FFT_WIDTH wide are computed by FFT when every row's tilted count variance is at
# least _FFT_MIN_VARIANCE (measured crossover of the direct sums and the FFT, per level, on
# one CPU thread: benchmarks/README.md).
_FFT_WIDTH = 129
# float32 direct sums are one oneDNN convolution, faster below this (1.3x to 2.5x at
# n = 2^19, k_max = 256 to 1024, with FFT levels from 257: benchmarks/README.md).
_FFT_WIDTH_FLOAT32 = 1025
_FFT_MIN_VARIANCE = 4.0
# Bytes of output per block of batch rows (see _in_batch_blocks), measured best for the
# direct sums, and for the sampler's draws (whose temporaries are several times the output).
_BLOCK_BYTES = 786432
_DRAW_BLOCK_BYTES = 3145728


def _in_place_allowed() -> bool:
    """In-place operations on fresh buffers save allocations (page faults on multi-megabyte
    tables), but not under ``torch.jit.trace`` (Pyro's ``JitTrace*_ELBO``): TorchScript
    may fold a subgraph computed from constants (a prior's logits) into a constant, which an
    in-place operation then changes at every call, and ``out=`` operations under no_grad
    are not replayed faithfully. Traced code takes out-of-place forms of the same
    arithmetic (equal results)."""
    return not torch.jit.is_tracing()


def _static_control_flow() -> bool:
    """Whether Python may not branch on tensor values here: under ``torch.jit.trace`` (Pyro's
    ``JitTrace*_ELBO``) the branch taken on the first call would be replayed for every later
    input, and under ``torch.compile`` it breaks the graph. Such code takes branch-free forms
    with the same values: both sides computed and selected by ``torch.where``, iterations
    run to their fixed bound instead of stopping when converged."""
    return torch.jit.is_tracing() or _is_compiling()


def _is_compiling() -> bool:
    is_compiling = getattr(torch.compiler, "is_compiling", None)  # torch >= 2.3
    return bool(is_compiling()) if is_compiling is not None else False


def _sizes_only(function):
    """``function`` with torch's TracerWarnings silenced while it is traced. Under
    ``torch.jit.trace`` a tensor's sizes are traced values, and reading one as a Python int
    or bool warns; the kernels' remaining Python conditions read sizes only (the tree's
    shape follows n, k_max and the batch size, which a trace fixes anyway), never values
    (those are ``_static_control_flow``'s forms), so the warnings would only be noise."""

    @wraps(function)
    def wrapper(*args, **kwargs):
        if not torch.jit.is_tracing():
            return function(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            return function(*args, **kwargs)

    return wrapper


def tilt(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A constant c per batch element (shape ``batch + (1,)``, no gradient) with
    ``sum_i sigmoid(logits_i + c) ~= k``, for any finite logits however large.

    Newton's method on ``g(c) = log f(c) - log(n - f(c))``, f the expected count: g is
    increasing and close to linear with slope 1 in both tails (where Newton on f itself
    crawls). ``n - f`` counts each ``-inf`` logit (never on) as off, so no mask is needed.
    Steps that leave a bracket that provably holds the root are replaced by bisection, and
    the iteration stops once every step is below ``_TILT_TOLERANCE`` (usually after 2 or 3
    steps from the bracket ``[logit(t/m) - max x, logit(t/m) - min x]``, m the number of
    finite logits). That bracket is as wide as the spread of the logits: with masked logits
    (-1e4, -1e9) bisection cannot narrow it in a few steps, and inside a wide gap between
    the logits f is constant to working precision, so Newton may stop anywhere in the gap.
    Rows where either can have happened restart from order statistics (``_restart_tilt``).
    The target count t is clamped to [1/2, m - 1/2] because the exact solution is infinite
    for k = 0 and k = m; any finite c leaves the distribution unchanged, and the tables
    only need c roughly right.
    """
    with torch.no_grad():
        logits = logits.detach()
        finite = logits > -torch.inf  # the caller allows no +inf or NaN
        num_finite = finite.sum(-1, keepdim=True).to(logits.dtype)
        target = _tilt_target(k, num_finite)
        m = num_finite.clamp(min=1.0)
        largest = logits.amax(-1, keepdim=True)
        smallest = torch.where(finite, logits, torch.inf).amin(-1, keepdim=True)
        center = torch.log(target) - torch.log(m - target)
        low = torch.where(num_finite > 0, center - largest, 0.0)
        high = torch.where(num_finite > 0, center - smallest, 0.0)
        c, settled = _newton(logits, target, low, high, 0.5 * (low + high), _TILT_STEPS)
        unsettled = ~settled & (num_finite[:, 0] > 1)
        if _static_control_flow():
            # Every row restarts and keeps the restart where it did not settle: the same
            # values as below, without reading the mask in Python (a trace would replay
            # the first call's choice for every later input).
            restarted = _restart_tilt(logits, target, num_finite, _TILT_TRACED_STEPS)
            return torch.where(unsettled[:, None], restarted, c)
        if bool(unsettled.any()):
            rows = unsettled.nonzero()[:, 0]
            restarted = _restart_tilt(logits[rows], target[rows], num_finite[rows])
            # Out of place: c flows to the outputs (see _in_place_allowed).
            c = c.index_put((rows,), restarted)
        return c


def _tilt_target(k: torch.Tensor, num_finite: torch.Tensor) -> torch.Tensor:
    m = num_finite.clamp(min=1.0)
    target = torch.minimum(k.to(num_finite.dtype)[..., None].clamp(min=0.5), m - 0.5)
    return target.clamp(min=0.25)  # m = 1: any c in a wide range will do


def _newton(logits, target, low, high, c, max_steps: int):
    """Safeguarded Newton steps on g (see ``tilt``) from ``c`` inside ``[low, high]``.
    Returns (c, settled): settled rows took a last step below ``_TILT_TOLERANCE`` at a
    count variance of at least ``_TILT_FLAT``."""
    n = logits.shape[-1]
    goal = torch.log(target) - torch.log(n - target)
    # One buffer for all steps (fresh multi-megabyte tensors cost page faults); sums in
    # float64, so that n - f keeps its precision when f is close to n.
    # Out of place under torch.jit.trace (see _in_place_allowed).
    tracing = _static_control_flow()
    on = None if tracing else torch.empty_like(logits)
    for _ in range(max_steps):
        if tracing:
            on = torch.sigmoid(logits + c)
            squares = on * on
        else:
            torch.add(logits, c, out=on).sigmoid_()
        count_on = on.sum(-1, keepdim=True, dtype=torch.float64)
        count_off = n - count_on
        if not tracing:
            squares = on.square_()
        slope = count_on - squares.sum(-1, keepdim=True, dtype=torch.float64)
        count_on, count_off, slope = (t.to(logits.dtype) for t in (count_on, count_off, slope))
        g = torch.log(count_on) - torch.log(count_off)
        too_many = g > goal
        high = torch.where(too_many, c, high)
        low = torch.where(too_many, low, c)
        newton = c - (g - goal) / (slope * (1.0 / count_on + 1.0 / count_off))
        inside = (newton >= low) & (newton <= high)  # False for NaN steps too
        step = torch.where(inside, newton, 0.5 * (low + high)) - c
        c = c + step
        # The tables only need c to within a small fraction of a unit of log-odds.
        settled = (step.abs() <= _TILT_TOLERANCE) & (slope >= _TILT_FLAT)
        # Traced or compiled code takes every step (max_steps is the bound the eager
        # iteration is allowed as well; a converged row's further steps stay below the
        # tolerance, inside its bracket).
        if not tracing and bool(
            ((step.abs() <= _TILT_TOLERANCE) | (high - low <= _TILT_TOLERANCE)).all()
        ):
            break
    return c, settled[:, 0]


def _restart_tilt(logits, target, num_finite, max_steps: int = _TILT_MAX_STEPS):
    """The tilt of rows whose first attempt did not settle, from the order statistics
    ``a = x_(ceil t)`` and ``b = x_(floor t + 1)`` (descending): at
    ``c = -b + log(t / (floor t + 1 - t))`` the largest ``floor t + 1`` terms alone reach
    the count t, and at ``c = -a - log((m - t) / (t - ceil t + 1))`` the terms from rank
    ``ceil t`` down cannot lift it above t, so the root lies between, a bracket only
    ``a - b + O(log m)`` wide. When a - b is large (a gap), the root is within
    ``log(m) / 2`` of ``-(a + b) / 2 + log(t / (m - t)) / 2`` (the two saturated tails
    balance there), where Newton starts; f may be flat there to working precision, but the
    start is already as close as the tables need."""
    descending = logits.sort(-1, descending=True).values
    above = torch.ceil(target).long() - 1
    below = torch.floor(target).long()
    a = descending.gather(-1, above)
    b = descending.gather(-1, below.clamp(max=logits.shape[-1] - 1))
    low = -a - torch.log((num_finite - target) / (target - above - 0.0))
    high = -b + torch.log(target / (below + 1.0 - target))
    start = -(0.5 * a + 0.5 * b) + 0.5 * (torch.log(target) - torch.log(num_finite - target))
    start = torch.minimum(torch.maximum(start, low), high)
    return _newton(logits, target, low, high, start, max_steps)[0]


# ----------------------------------------------------------------------------------------
# Truncated convolutions and correlations of many short tables at once.


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
    width, length = int(width), _fast_fft_length(int(width) + int(right.shape[-1]) - 1)
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
    width, length = int(width), _fast_fft_length(int(left.shape[-1]) + int(right.shape[-1]) - 1)
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


def _fast_fft_length(size: int) -> int:
    """The smallest integer >= size whose prime factors are 2, 3 and 5."""
    while True:
        rest = size
        for prime in (2, 3, 5):
            while rest % prime == 0:
                rest //= prime
        if rest == 1:
            return size
        size += 1


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


def _rescale(table: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(table / its largest entry, that entry) per node, the entries running along ``dim``,
    with entries below sqrt(tiny) of the largest set to zero (so products of two entries are
    never denormal). ``table`` is overwritten.

    The factor is detached: every quantity computed from the tables is either invariant to
    it (marginals, sampling) or adds its log back explicitly (the normaliser).
    """
    info = torch.finfo(table.dtype)
    largest = table.detach().amax(dim, keepdim=True).clamp(min=info.tiny)
    # In place (autograd allows it: neither operation's input is saved for its backward):
    # fresh multi-megabyte tensors cost page faults. Not under torch.jit.trace.
    if _in_place_allowed():
        table = F.threshold(table.div_(largest), info.tiny**0.5, 0.0, inplace=True)
    else:
        table = F.threshold(table / largest, info.tiny**0.5, 0.0)
    return table, largest.squeeze(dim)


def _leaves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Leaf tables ``[1, exp(x_i)]`` divided by their largest entry exp(max(x_i, 0)):
    returns (``[exp(-max(x, 0)), exp(x - max(x, 0))]`` (unflushed) and the flushed tables,
    both width-major, (batch, 2, n)). The log factors, ``max(x_i, 0)``, are added back in
    float64 by ``log_normalizer_value``."""
    shift = x.detach().clamp(min=0.0)
    # Out of place: under torch.jit.trace, TorchScript folds ``shift`` of a distribution
    # whose logits are constants (a model's prior) into a constant, which an in-place
    # exp_ would then change at every call (measured: the prior's log_prob drifted to NaN
    # over five JitTrace_ELBO steps). Both are n-sized, small next to the tables.
    weights = torch.stack([torch.exp(-shift), torch.exp(x - shift)], dim=1)
    tables = F.threshold(weights, torch.finfo(x.dtype).tiny ** 0.5, 0.0)
    return weights, tables


class _Level(NamedTuple):
    """One level of the tree: node j of the level above is the parent of ``left`` node j and
    ``right`` node j (the nodes of this level, split in halves); ``padded``: the last right
    node is the table of an empty set, added to make the count even. Tables are width-major,
    (batch, width, nodes), while they are at most ``_NARROW`` wide, and node-major,
    (batch, nodes, width), above."""

    left: torch.Tensor
    right: torch.Tensor
    padded: bool
    node_major: bool
    # FFT levels only (else None): the children's degree bounds, (batch, 2 half) int64 each
    # (left children, then right ones), see ``_degree_bounds``.
    low: torch.Tensor | None = None
    high: torch.Tensor | None = None


def _merge(left: torch.Tensor, right: torch.Tensor, width: int, node_major: bool, bounds=None):
    """The rescaled tables of the parents of ``left`` and ``right``, and their factors.
    ``bounds``: the parents' (low, high) degree bounds on FFT levels, else None."""
    if bounds is not None:
        return _rescale(_mask_outside(_convolve_by_fft(left, right, width), *bounds), -1)
    if node_major:
        return _rescale(_convolve(left, right, width), -1)
    return _rescale(_shift_and_add(left, right, width, 1), 1)


def _outside_of_children(
    outside: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    node_major: bool,
    bounds=None,
) -> torch.Tensor:
    """The rescaled outside tables of the children (the left ones, then the right ones)
    from their parents' ``outside`` tables: each is correlated with its sibling's table.
    ``bounds``: on FFT levels, the (low, high) range of each child's possible entries."""
    if node_major:
        batch, half, width = left.shape
        siblings = torch.stack([right, left], dim=1)
        tables = _correlate(outside[:, None], siblings, width, fft=bounds is not None)
        tables = tables.reshape(batch, 2 * half, width)
        if bounds is not None:
            tables = _mask_outside(tables, *bounds)
        return _rescale(tables, -1)[0]
    batch, width, half = left.shape
    siblings = torch.stack([right, left], dim=2)
    tables = _shift_and_add_correlate(outside[:, :, None], siblings, width, 1)
    return _rescale(tables.reshape(batch, width, 2 * half), 1)[0]


def _blocked(table: torch.Tensor, node_major: bool) -> bool:
    # Measured: width-major levels make few passes (their tables are narrow), so blocks only
    # add overhead there; float32 node-major levels are one oneDNN convolution each.
    return node_major and table.dtype != torch.float32


def _upward(tables: torch.Tensor, k_max: int, with_log_scale: bool, fft: bool = False):
    """Merge pairs of nodes until one is left. ``tables``: the leaves, (batch, 2, n).
    ``fft``: compute levels at least ``_FFT_WIDTH`` wide by FFT (the caller checked that
    the tilted count variance allows it).

    Returns (root table (batch, width), the levels from the leaves up, the sum of the kept
    log factors (batch,), or None unless ``with_log_scale``: only the normaliser needs it).
    """
    levels = []
    log_scale = tables.new_zeros(tables.shape[0], dtype=torch.float64)
    node_major = False
    # Degree bounds of every node (only for the FFT path): a leaf can be off unless its
    # flushed off-weight is zero, and on unless its on-weight is zero; a parent's bounds are
    # its children's sums.
    low = (tables[:, 0] == 0).long() if fft else None
    high = (tables[:, 1] > 0).long() if fft else None
    while tables.shape[2 - node_major] > 1:
        width = tables.shape[1 + node_major]
        if not node_major and width > _NARROW:
            tables, node_major = tables.transpose(1, 2).contiguous(), True
        node_dim, width_dim = (1, 2) if node_major else (2, 1)
        padded = tables.shape[node_dim] % 2 == 1
        if padded:  # pair the last node with the table of an empty set, [1, 0, ...]
            empty = torch.zeros_like(tables.narrow(node_dim, 0, 1))
            first = torch.zeros(1, dtype=torch.long, device=empty.device)
            empty = empty.index_fill(width_dim, first, 1.0)
            tables = torch.cat([tables, empty], dim=node_dim)
        left, right = tables.chunk(2, dim=node_dim)
        out_width = min(2 * (width - 1), k_max) + 1
        bounds = None
        if fft:
            if padded:  # the empty set: degree exactly 0
                low, high = F.pad(low, (0, 1)), F.pad(high, (0, 1))
            children = (low, high)
            half = low.shape[-1] // 2
            # Not truncated at k_max: the downward pass takes the rest's bounds as the
            # root's minus a node's.
            low, high = low[:, :half] + low[:, half:], high[:, :half] + high[:, half:]
            if node_major and out_width >= _fft_width(tables.dtype):
                bounds = (low, high)
        merge = partial(_merge, width=out_width, node_major=node_major, bounds=bounds)
        if bounds is not None:
            tables, factor = merge(left, right)
        elif _blocked(tables, node_major):
            per_row = out_width * left.shape[node_dim] * left.element_size()
            tables, factor = _in_batch_blocks(merge, (left, right), per_row)
        else:
            tables, factor = merge(left, right)
        if with_log_scale:
            # The logs in float64: a float32 log is off by eps |log factor|, and n of them add up.
            log_scale = log_scale + torch.log(factor.to(torch.float64)).sum(-1)
        if bounds is not None:
            levels.append(_Level(left, right, padded, node_major, *children))
        else:
            levels.append(_Level(left, right, padded, node_major))
    root = tables[:, 0] if node_major else tables[:, :, 0]
    return root, levels, log_scale if with_log_scale else None


def _downward(root_width: int, levels, k: torch.Tensor, dtype) -> torch.Tensor:
    """Outside tables of the leaves, width-major (batch, 2, n), up to a factor per leaf."""
    outside = F.one_hot(k.long(), root_width).to(dtype)[:, None, :]  # node-major
    node_major = True
    total = None
    for level in reversed(levels):
        left, right, padded, level_node_major = level[:4]
        if node_major and not level_node_major:
            outside, node_major = outside.transpose(1, 2).contiguous(), False
        bounds = None
        if level.low is not None:
            if total is None:  # the root's bounds: the sums over its two children
                total = (level.low.sum(-1, keepdim=True), level.high.sum(-1, keepdim=True))
            # outside[a] is proportional to P(rest = k - a): possible only for
            # low_rest <= k - a <= high_rest, and a child's own entry a only for
            # low <= a <= high.
            k_column = k.long()[:, None]
            low_a = torch.maximum(level.low, k_column - (total[1] - level.high))
            high_a = torch.minimum(level.high, k_column - (total[0] - level.low))
            bounds = (low_a, high_a)
        split = partial(_outside_of_children, node_major=node_major, bounds=bounds)
        if bounds is not None:
            outside = split(outside, left, right)
        elif _blocked(outside, node_major):
            per_row = 2 * left.numel() // left.shape[0] * left.element_size()
            outside = _in_batch_blocks(split, (outside, left, right), per_row)
        else:
            outside = split(outside, left, right)
        if padded:
            outside = outside[..., :-1, :] if node_major else outside[..., :-1]
    if node_major:  # a single leaf
        outside = outside.transpose(1, 2)
    return outside


def _flatten(logits: torch.Tensor, k: torch.Tensor):
    n = logits.shape[-1]
    batch_shape = logits.shape[:-1]
    return logits.reshape(-1, n), k.expand(batch_shape).reshape(-1), batch_shape


def _prepare(logits: torch.Tensor, k: torch.Tensor, k_max: int, with_log_scale: bool = False):
    """Flattened tilted inputs, leaf weights, and the upward pass (``log_scale``: the sum of
    the internal nodes' log factors, float64, when ``with_log_scale``)."""
    flat_logits, flat_k, batch_shape = _flatten(logits, k)
    c = tilt(flat_logits, flat_k)
    x = flat_logits + c
    weights, leaf_tables = _leaves(x)
    root, levels, log_scale = _upward(leaf_tables, k_max, with_log_scale, _use_fft(x, k_max))
    return flat_k, batch_shape, c[:, 0], weights, root, levels, log_scale


def _fft_width(dtype) -> int:
    return _FFT_WIDTH_FLOAT32 if dtype == torch.float32 else _FFT_WIDTH


def _use_fft(x: torch.Tensor, k_max: int) -> bool:
    """Whether the wide levels go by FFT: only when some level is at least ``_FFT_WIDTH``
    wide and every row's tilted count variance ``sum_i sigmoid(x_i) sigmoid(-x_i)`` is at
    least ``_FFT_MIN_VARIANCE`` (see "FFT path" in the module docstring)."""
    if _static_control_flow():
        # A trace would bake this data-dependent choice in for every later input, among
        # them nearly deterministic ones: traced and compiled code stays direct.
        return False
    widest = min(k_max, 2 ** (int(x.shape[-1]) - 1).bit_length()) + 1
    if widest < _fft_width(x.dtype) or x.shape[0] == 0:
        return False
    with torch.no_grad():
        on = torch.sigmoid(x.detach())
        variance = (on * torch.sigmoid(-x.detach())).sum(-1, dtype=torch.float64)
        return bool((variance >= _FFT_MIN_VARIANCE).all())


class NormalizerParts(NamedTuple):
    """The log normaliser in two parts that keep their precision for logits of any size
    (float64, shape ``batch``, no gradient): with ``x = logits + tilt``,

        log e_k(exp logits) = log_reduced + sum_i max(x_i, 0) - k tilt,

    where ``log_reduced = log e_k(exp x) - sum_i max(x_i, 0)`` is the log of the root's
    entry k times the internal nodes' factors. Every quantity that is a small difference of
    large terms when written with the logits (log_prob, entropy, KL, the constraint
    probability) is a sum of terms of one sign when written with ``x`` and ``log_reduced``
    (the ``*_value`` functions below); a saturated variable (``|x_i|`` beyond the dtype's
    precision) then contributes exactly nothing, as conditioning on its value would."""

    tilt: torch.Tensor
    log_reduced: torch.Tensor


@_sizes_only
def normalizer_parts(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> NormalizerParts:
    """The parts of ``log e_k(exp logits)`` (see ``NormalizerParts``), from one upward pass."""
    with torch.no_grad():
        logits = logits.detach()
        if k_max == 0:  # e_0 = 1: no tilt, log_reduced = -sum max(logits, 0)
            zero_tilt = logits.new_zeros(logits.shape[:-1], dtype=torch.float64)
            return NormalizerParts(zero_tilt, -_positive_part_sum(_tilted(logits, zero_tilt)))
        if _small.applies(logits, k_max):  # small n: see exactly_k_small
            return NormalizerParts(*_small.normalizer_parts(logits, k, k_max))
        flat_k, batch_shape, c, _, root, _, log_scale = _prepare(logits, k, k_max, True)
        root_k = root.gather(-1, flat_k.long()[:, None])[:, 0]
        log_reduced = torch.log(root_k.to(torch.float64)) + log_scale
        return NormalizerParts(
            c.to(torch.float64).reshape(batch_shape), log_reduced.reshape(batch_shape)
        )


def _tilted(logits: torch.Tensor, tilt: torch.Tensor) -> torch.Tensor:
    """``x = logits + tilt`` in float64 (``-inf`` stays ``-inf``)."""
    return logits.detach().to(torch.float64) + tilt[..., None]


def _positive_part_sum(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(min=0.0).sum(-1)


def log_normalizer_value(logits: torch.Tensor, k: torch.Tensor, parts: NormalizerParts):
    """``log e_k(exp logits)`` in float64 from its parts."""
    x = _tilted(logits, parts.tilt)
    return parts.log_reduced + _positive_part_sum(x) - k.to(torch.float64) * parts.tilt


def log_prob_value(logits: torch.Tensor, parts: NormalizerParts, value: torch.Tensor):
    """``logits . z - log e_k(exp logits)`` for k-hot ``z`` (float64, no gradient), as
    ``sum_i (x_i z_i - max(x_i, 0)) - log_reduced``: every term is 0 or has the sign of the
    penalty it stands for, so nothing cancels."""
    x = _tilted(logits, parts.tilt)
    z = value.detach().to(torch.float64)
    terms = torch.where(x > -torch.inf, x * z - x.clamp(min=0.0), 0.0)
    return terms.sum(-1) - parts.log_reduced


def cross_entropy_value(
    logits: torch.Tensor, parts: NormalizerParts, mu: torch.Tensor, mu_complement: torch.Tensor
) -> torch.Tensor:
    """``-E[log q(z)]`` for q the distribution of ``logits`` (with ``parts``) and z with
    marginals ``mu`` (``mu_complement = 1 - mu``, computed without rounding): with x the
    tilted logits of q, ``log_reduced + sum_i max(x_i, 0) (1 - mu_i) + max(-x_i, 0) mu_i``,
    a sum of non-negative terms after ``log_reduced``. With q the distribution of ``mu``
    itself this is its entropy. float64, no gradient."""
    x = _tilted(logits, parts.tilt)
    mu, mu_complement = (t.detach().to(torch.float64) for t in (mu, mu_complement))
    terms = x.clamp(min=0.0) * mu_complement + (-x).clamp(min=0.0) * mu
    return torch.where(x > -torch.inf, terms, 0.0).sum(-1) + parts.log_reduced


def log_constraint_prob_value(logits: torch.Tensor, k: torch.Tensor, parts: NormalizerParts):
    """``log P(sum z = k)`` for independent ``z_i ~ Bernoulli(sigmoid(logits_i))`` (float64,
    no gradient), without the cancellation of ``log e_k - sum softplus(logits)``. With
    ``softplus(w) = max(w, 0) + log1p(exp(-|w|))`` and ``x = logits + c``,

        log P = log_reduced + sum_i [max(x_i, 0) - max(logits_i, 0)] - k c
                - sum_i log1p(exp(-|logits_i|)),

    and the middle sum is ``c (P - k) + sum logits_i [x_i >= 0 > logits_i]
    - sum logits_i [logits_i >= 0 > x_i]``, P the number of non-negative ``x_i``: an
    integer multiple of c plus logits that change sides under the tilt. No term is formed
    as ``logits + c``, whose rounding would be relative to c, and the large terms are as
    large as the answer (each side-changing variable costs about its own logit)."""
    theta = logits.detach().to(torch.float64)
    x = theta + parts.tilt[..., None]
    finite = theta > -torch.inf
    x_on, theta_on = (x >= 0) & finite, (theta >= 0) & finite
    shift = parts.tilt * (x_on.sum(-1) - k) + torch.where(x_on & ~theta_on, theta, 0.0).sum(-1)
    shift = shift - torch.where(theta_on & ~x_on, theta, 0.0).sum(-1)
    tails = torch.where(finite, torch.log1p(torch.exp(-theta.abs())), 0.0).sum(-1)
    return parts.log_reduced + shift - tails


def _leaf_marginals(weights: torch.Tensor, outside: torch.Tensor, with_complements: bool):
    on = weights[:, 1] * outside[:, 1]
    off = weights[:, 0] * outside[:, 0]
    total = (off + on).clamp(min=torch.finfo(on.dtype).tiny)
    if with_complements:
        return on / total, (off / total).detach()
    return on / total


def _marginals_from(k, weights, root, levels, with_complements: bool = False):
    outside = _downward(root.shape[-1], levels, k, weights.dtype)
    return _leaf_marginals(weights, outside, with_complements)


def _zeros_with_gradient(logits: torch.Tensor) -> torch.Tensor:
    """Zeros that depend on the logits (with zero derivative), so that a caller's backward
    pass gets zero gradients rather than none."""
    return torch.where(logits > -torch.inf, logits, 0.0) * 0.0


class _LogNormalizer(torch.autograd.Function):
    """log e_k(exp logits) (from precomputed parts) with the marginals as its gradient; the
    backward pass is built from differentiable operations, so second derivatives work
    (create_graph=True)."""

    @staticmethod
    def forward(logits, k, k_max, tilt, log_reduced):
        value = log_normalizer_value(logits, k, NormalizerParts(tilt, log_reduced))
        return value.to(logits.dtype)

    # A separate setup_context is what torch.func transforms (grad, jacrev) require; the
    # forward is plain tensor operations, so vmap can batch it (over a log_prob's values:
    # vmap over the logits stops earlier, at the table size, a Python int).
    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, k, k_max = inputs[:3]
        ctx.save_for_backward(logits, k)
        ctx.k_max = k_max

    @staticmethod
    def backward(ctx, grad):
        logits, k = ctx.saved_tensors
        return grad[..., None] * marginals(logits, k, ctx.k_max), None, None, None, None


def log_normalizer(
    logits: torch.Tensor, k: torch.Tensor, k_max: int, parts: NormalizerParts | None = None
) -> torch.Tensor:
    """log e_k(exp logits), shape ``batch``; its gradient is ``marginals`` (differentiable
    again, without NaN at ``-inf`` logits). ``parts``: from ``normalizer_parts``, if the
    caller has them already."""
    if parts is None:
        parts = normalizer_parts(logits, k, k_max)
    k = k.expand(logits.shape[:-1])
    return _LogNormalizer.apply(logits, k, k_max, parts.tilt, parts.log_reduced)


@_sizes_only
def marginals(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """mu_i = P(z_i = 1 | sum z = k) = d log e_k(exp logits) / d logits_i, shape
    ``batch + (n,)``; differentiable again when ``logits`` requires grad."""
    if k_max == 0:
        return _zeros_with_gradient(logits)
    if _small.applies(logits, k_max):  # small n: see exactly_k_small
        return _small.marginals(logits, k, k_max)
    flat_k, batch_shape, _, weights, root, levels, _ = _prepare(logits, k, k_max)
    return _marginals_from(flat_k, weights, root, levels).reshape(logits.shape)


@_sizes_only
def marginals_and_complements(
    logits: torch.Tensor, k: torch.Tensor, k_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``marginals``, ``1 - marginals`` without rounding: from the leaves' off-weights, no
    gradient), so that a marginal near 1 keeps the relative precision of its complement."""
    if k_max == 0:
        return _zeros_with_gradient(logits), torch.ones_like(logits).detach()
    if _small.applies(logits, k_max):  # small n: see exactly_k_small
        return _small.marginals_and_complements(logits, k, k_max)
    flat_k, batch_shape, _, weights, root, levels, _ = _prepare(logits, k, k_max)
    mu, complement = _marginals_from(flat_k, weights, root, levels, with_complements=True)
    return mu.reshape(logits.shape), complement.reshape(logits.shape)


def _ones_to_left(
    counts: torch.Tensor, left: torch.Tensor, right: torch.Tensor, low=None, high=None
) -> torch.Tensor:
    """For parents holding ``counts`` ones (batch, num_samples, half), a draw of how many go
    to the left child: m with probability proportional to left[m] right[c - m]. Tables are
    (batch, half, width). ``low``, ``high``: on FFT levels, the children's degree bounds
    (batch, 2 half); the draw is then kept among the splits both children can hold (FFT
    noise could otherwise, with a probability of the order of the noise, lead to a parent
    count whose splits all have weight zero)."""
    if low is not None:
        half = low.shape[-1] // 2
        drawn = _ones_to_left(counts, left, right)
        first = torch.maximum(low[:, None, :half], counts - high[:, None, half:])
        last = torch.minimum(high[:, None, :half], counts - low[:, None, half:])
        return torch.minimum(torch.maximum(drawn, first), last)
    w_left = left.shape[-1]
    left = left[:, None]
    if w_left == 2 and right.shape[-1] == 2:  # pairs of leaves: only a count of 1 is random
        on_left, on_right = left[..., 1] * right[:, None, :, 0], left[..., 0] * right[:, None, :, 1]
        # A count of 1 was drawn with positive weight, so on_left + on_right > 0 there.
        left_wins = on_left / (on_left + on_right)
        uniform = torch.rand(counts.shape, dtype=left.dtype, device=left.device)
        return torch.where(counts == 1, uniform < left_wins, counts == 2).long()
    # Zeros on both sides of the right tables make every count of ones the right child could
    # be asked for, c - m for c < w_left + w_right - 1 and m < w_left, an index.
    right = F.pad(right, (w_left - 1, w_left - 1))[:, None]
    offsets = w_left - 1 - torch.arange(w_left, device=left.device)
    rest = counts[..., None] + offsets  # index of c - m in the padded table
    # One fresh array, then in place (the sampler runs without autograd): weights, their
    # running sums, and those divided by the total.
    share = right.expand(counts.shape + right.shape[-1:]).gather(-1, rest)
    # The first split whose share of the total weight reaches 1 - u, u ~ U[0, 1): its own
    # weight is positive, and the last share is exactly 1, so one always exists.
    if _in_place_allowed():
        share.mul_(left).cumsum_(-1)
        share.div_(share[..., -1:].clone())
    else:
        share = (share * left).cumsum(-1)
        share = share / share[..., -1:]
    uniform = torch.rand(counts.shape + (1,), dtype=share.dtype, device=share.device)
    return torch.searchsorted(share, 1.0 - uniform)[..., 0]


def _draw(root_k: torch.Tensor, levels, num_samples: int) -> torch.Tensor:
    """Counts of ones per leaf, (num_samples, batch, n), top-down from root counts (batch,)."""
    counts = root_k.long()[:, None, None].expand(-1, num_samples, 1)  # (batch, samples, nodes)
    for level in reversed(levels):
        left, right, padded, node_major = level[:4]
        if not node_major:
            left, right = left.transpose(1, 2), right.transpose(1, 2)
        per_row = num_samples * left.numel() // left.shape[0] * left.element_size()
        tables = (counts, left, right)
        if level.low is not None:
            tables += (level.low, level.high)
        ones_left = _in_batch_blocks(_ones_to_left, tables, per_row, _DRAW_BLOCK_BYTES)
        counts = torch.cat([ones_left, counts - ones_left], dim=-1)
        if padded:
            counts = counts[..., :-1]
    return counts.transpose(0, 1)


def _sample_and_maybe_marginals(logits, k, k_max, sample_shape, with_marginals):
    sample_shape = torch.Size(sample_shape)
    out_shape = sample_shape + logits.shape
    if k_max == 0:
        return logits.new_zeros(out_shape).detach(), _zeros_with_gradient(logits)
    flat_k, _, _, weights, root, levels, _ = _prepare(logits, k, k_max)
    with torch.no_grad():
        detached = [
            level._replace(left=level.left.detach(), right=level.right.detach()) for level in levels
        ]
        counts = _draw(flat_k, detached, sample_shape.numel())
        z = counts.to(logits.dtype).reshape(out_shape)
    mu = None
    if with_marginals:
        mu = _marginals_from(flat_k, weights, root, levels).reshape(logits.shape)
    return z, mu


@_sizes_only
def sample(
    logits: torch.Tensor, k: torch.Tensor, k_max: int, sample_shape: tuple[int, ...] = ()
) -> torch.Tensor:
    """Exact draws, shape ``sample_shape + batch + (n,)``, entries 0.0 / 1.0 summing to k.
    No gradient."""
    if _small.applies(logits, k_max):  # small n: see exactly_k_small
        return _small.sample(logits, k, k_max, sample_shape)
    with torch.no_grad():
        return _sample_and_maybe_marginals(logits.detach(), k, k_max, sample_shape, False)[0]


@_sizes_only
def sample_and_marginals(
    logits: torch.Tensor, k: torch.Tensor, k_max: int, sample_shape: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample(...), marginals(...)) from one upward pass (for ``rsample``)."""
    if _small.applies(logits, k_max):  # small n: see exactly_k_small
        return _small.sample_and_marginals(logits, k, k_max, sample_shape)
    return _sample_and_maybe_marginals(logits, k, k_max, sample_shape, True)
