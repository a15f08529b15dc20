"""What the torch exactly-k kernels may do where they are traced or compiled.

Under ``torch.jit.trace`` (Pyro's ``JitTrace*_ELBO``) a Python branch on a tensor's value is
replayed as taken on the first call, and under ``torch.compile`` it breaks the graph; in-place
operations on constants folded by TorchScript change them at every call. The kernels ask
these functions and take branch-free, out-of-place forms of the same arithmetic there
(docs/numerics.md, "Traced and compiled programs").
"""

import warnings
from contextlib import contextmanager
from functools import wraps

import torch


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


@contextmanager
def static_under_trace():
    """Silences torch's TracerWarnings around code that reads only static information (a
    size, which a trace fixes, or a count given as a constant of the trace). Python branches
    on values that can change between calls (logits, rates) must not be inside: under
    ``torch.jit.trace`` such code takes ``_static_control_flow``'s branch-free forms."""
    if not torch.jit.is_tracing():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        yield


def _sizes_only(function):
    """``function`` under :func:`static_under_trace`. Under ``torch.jit.trace`` a tensor's
    sizes are traced values, and reading one as a Python int or bool warns; the kernels'
    remaining Python conditions read sizes only (the tree's shape follows n, k_max and the
    batch size, which a trace fixes anyway), never values (those are
    ``_static_control_flow``'s forms), so the warnings would only be noise."""

    @wraps(function)
    def wrapper(*args, **kwargs):
        with static_under_trace():
            return function(*args, **kwargs)

    return wrapper
