"""The tree of the torch exactly-k kernels: leaves, the upward pass (products of polynomials
truncated at ``k_max``, each table rescaled by a power of two), the downward pass (outside
tables) and the marginals (docs/numerics.md, "The exactly-k kernels").

A level of the tree pairs node j with node j + half (the nodes split in halves, so both
children of a level are contiguous). Tables at most ``_NARROW`` wide are stored width-major,
(batch, width, nodes): the lower levels hold many narrow nodes, and each shift of a
convolution is then one multiply-add over a contiguous slab. Wider tables are stored
node-major, (batch, nodes, width). float64 node-major levels run in blocks of batch rows that
fit in cache (``_in_batch_blocks``), and the large arrays are rescaled in place (a fresh
array at n = 10000 is tens of megabytes, and every pass over one is memory-bound).
"""

import math
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from constrained_ppl import exactly_k_design as design
from pyro_constrained.exactly_k_convolution import (
    _convolve,
    _convolve_by_fft,
    _correlate,
    _in_batch_blocks,
    _mask_outside,
    _shift_and_add,
    _shift_and_add_correlate,
)
from pyro_constrained.exactly_k_tilt import tilt
from pyro_constrained.exactly_k_tracing import _in_place_allowed, _static_control_flow

_NARROW = design.TORCH_NARROW
_FFT_WIDTH = design.TORCH_FFT_WIDTH_FLOAT64
_FFT_WIDTH_FLOAT32 = design.TORCH_FFT_WIDTH_FLOAT32
_FFT_MIN_VARIANCE = design.FFT_MIN_VARIANCE
# Per float dtype: the integer type of its bits, the mask of its exponent field, the number
# of mantissa bits below that field, and the exponent bias.
_EXPONENT_FIELD = {
    torch.float16: (torch.int16, 0x7C00, 10, 15),
    torch.bfloat16: (torch.int16, 0x7F80, 7, 127),
    torch.float32: (torch.int32, 0x7F800000, 23, 127),
    torch.float64: (torch.int64, 0x7FF0000000000000, 52, 1023),
}


def _rescale(table: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(table / 2^e, 2^e) per node, the entries running along ``dim``: 2^e the power of two
    with the largest entry in [2^e, 2^(e + 1)), and entries below sqrt(tiny) after the
    division set to zero (so products of two entries are never denormal). ``table`` is
    overwritten. A power of two, as in the JAX kernels: the division is exact, and the
    normaliser adds back the sum of the exponents (``_exponent``, exact integers) times
    log 2 once.

    The factor is detached: every quantity computed from the tables is either invariant to
    it (marginals, sampling) or adds it back explicitly (the normaliser).
    """
    info = torch.finfo(table.dtype)
    largest = table.detach().amax(dim, keepdim=True).clamp(min=info.tiny)
    power = _power_of_two_at_or_below(largest)
    # In place (autograd allows it: neither operation's input is saved for its backward):
    # fresh multi-megabyte tensors cost page faults. Not under torch.jit.trace.
    if _in_place_allowed():
        table = F.threshold(table.div_(power), info.tiny**0.5, 0.0, inplace=True)
    else:
        table = F.threshold(table / power, info.tiny**0.5, 0.0)
    return table, power.squeeze(dim)


def _power_of_two_at_or_below(largest: torch.Tensor) -> torch.Tensor:
    """2^e with ``largest`` in [2^e, 2^(e + 1)), for normal positive floats: the exponent
    field of ``largest`` with the mantissa cleared (``torch.frexp`` and ``torch.ldexp`` are
    20x slower). ``torch.jit.trace`` cannot trace a view as another dtype, so traced code
    takes the slower form."""
    if torch.jit.is_tracing():
        return torch.ldexp(torch.ones_like(largest), torch.frexp(largest).exponent - 1)
    integer, field_mask = _EXPONENT_FIELD[largest.dtype][:2]
    return (largest.view(integer) & field_mask).view(largest.dtype)


def _exponent(power: torch.Tensor) -> torch.Tensor:
    """e (float64, a whole number) of the powers of two 2^e from ``_rescale``."""
    if torch.jit.is_tracing():
        return (torch.frexp(power).exponent - 1).to(torch.float64)
    integer, _, mantissa_bits, bias = _EXPONENT_FIELD[power.dtype]
    return ((power.view(integer) >> mantissa_bits) - bias).to(torch.float64)


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
    log factors (batch,): the exponents' exact sum times log 2, or None unless
    ``with_log_scale``: only the normaliser needs it).
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
            # Whole numbers, summed exactly in float64; times log 2 once, at the root.
            log_scale = log_scale + _exponent(factor).sum(-1)
        if bounds is not None:
            levels.append(_Level(left, right, padded, node_major, *children))
        else:
            levels.append(_Level(left, right, padded, node_major))
    root = tables[:, 0] if node_major else tables[:, :, 0]
    return root, levels, log_scale * math.log(2.0) if with_log_scale else None


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
    the internal nodes' log factors, float64, when ``with_log_scale``: the sum of their
    base-2 exponents, exact, times log 2)."""
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


def _leaf_marginals(weights: torch.Tensor, outside: torch.Tensor, with_complements: bool):
    on = weights[:, 1] * outside[:, 1]
    off = weights[:, 0] * outside[:, 0]
    total = (off + on).clamp(min=torch.finfo(on.dtype).tiny)
    # A leaf whose off-weight is exactly zero is on in every configuration: its marginal is
    # 1 and its derivative exactly 0, where the ratio's is rounding noise that a caller
    # multiplying by a saturated logit (1e9) turns into a visible gradient.
    mu = torch.where(weights[:, 0] == 0, (on / total).detach(), on / total)
    if with_complements:
        return mu, (off / total).detach()
    return mu


def _marginals_from(k, weights, root, levels, with_complements: bool = False):
    outside = _downward(root.shape[-1], levels, k, weights.dtype)
    return _leaf_marginals(weights, outside, with_complements)
