"""Whether a tensor is being differentiated, in either of torch's modes; and its values for
a check in NumPy, in any mode.

A path that skips work a derivative would need (detached factors, a gradient-free
algorithm, terms that only a derivative sees) must ask this rather than
``tensor.requires_grad``: under forward mode (``torch.autograd.forward_ad``,
``torch.func.jvp`` / ``jacfwd``, the outer level of ``torch.func.hessian``) a differentiated
tensor does not require grad, and the skipped work would make its derivative a silent 0.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.autograd import forward_ad


def is_differentiated(tensor: torch.Tensor) -> bool:
    """Whether derivatives with respect to ``tensor`` are being taken: in reverse mode
    (autograd with grad enabled, ``torch.func.grad`` / ``vjp`` / ``jacrev``) or forward mode
    (a dual tensor of ``torch.autograd.forward_ad``, ``torch.func.jvp`` / ``jacfwd``)."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return True
    return forward_ad.unpack_dual(tensor).tangent is not None


def float64_values(tensor: torch.Tensor) -> np.ndarray:
    """The values of ``tensor`` as a float64 NumPy array, for checks written in NumPy.
    ``.tolist()``, not ``.numpy()``: inside a ``torch.func`` transform every tensor is a
    wrapper without storage, which ``.numpy()`` refuses (``.tolist()`` reads it)."""
    return np.asarray(tensor.detach().to(torch.float64).cpu().tolist(), dtype=np.float64)
