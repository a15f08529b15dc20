"""The one ``__repr__`` format of the distributions (``constrained_ppl/reprs.py``), with
shapes as ``torch.Size``, as ``torch.distributions`` prints them."""

from __future__ import annotations

from functools import partial

import torch

from constrained_ppl.reprs import parameters_repr as _parameters_repr


def _describe(value: torch.Tensor) -> tuple[str, float | None]:
    return str(value.shape), (value.item() if value.numel() == 1 else None)


parameters_repr = partial(_parameters_repr, describe=_describe)
