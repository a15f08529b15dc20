"""The sampler of the torch exactly-k kernels (SIMPLE Algorithm 5): the root holds k ones;
a node holding c ones gives its left child m of them with probability proportional to
``left[m] right[c - m]``, drawn by the inverse CDF, down to the leaves."""

import torch
import torch.nn.functional as F

from constrained_ppl import exactly_k_design as design
from pyro_constrained.exactly_k_convolution import _in_batch_blocks
from pyro_constrained.exactly_k_tracing import _in_place_allowed

_DRAW_BLOCK_BYTES = design.TORCH_DRAW_BLOCK_BYTES


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
