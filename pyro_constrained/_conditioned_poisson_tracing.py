"""What ``ConditionedPoisson`` may read in Python under ``torch.jit.trace``.

Pyro's ``JitTrace*_ELBO`` trace the model and guide once and replay the recorded tensor
program: a Python branch on a tensor's value is frozen at the value of the first call.
``ConditionedPoisson`` branches in Python only on static information: shapes, dtypes, and
the counts ``k``, which are a constant of the trace (a Python number or a tensor closed over,
not an input of the traced function) or, where ``k_max`` is given, bounded by it. Everything
that depends on the rates takes branch-free forms (``torch.where``, masks) or a size that
holds for every rate (the entropy's window under trace).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

__all__ = ["static_under_trace"]


@contextmanager
def static_under_trace():
    """Silences torch's TracerWarnings around code that reads only static information (a
    size, or ``k``, a constant of the trace). Code that reads the rates must not be inside."""
    if not torch.jit.is_tracing():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        yield
