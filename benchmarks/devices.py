"""The ``--device`` option shared by the benchmarks: where torch and JAX run.

``--device cpu`` (the default) changes nothing. ``--device cuda`` (or ``gpu``) makes the
accelerator the default device of both frameworks before any array is made: torch through
``torch.set_default_device`` (every factory call without a ``device``, ``torch.tensor`` of a
NumPy array included, then allocates there), JAX through the ``jax_default_device`` option
(its first GPU). A package whose framework has no such device is skipped with a message
rather than silently timed on the CPU. Timers call ``synchronize`` so that they measure
finished work: CUDA kernels run asynchronously, and JAX's are awaited by
``block_until_ready`` in the benchmarks themselves.

The benchmarks that time one thread's CPU time on the CPU (``clock``) time wall-clock seconds
on an accelerator instead, where the work is the device's and not the process's.
"""

from __future__ import annotations

import argparse
import time

import jax
import torch

ACCELERATOR_NAMES = ("cuda", "gpu")
_on_accelerator = False


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu",) + ACCELERATOR_NAMES,
        help="cpu (default), or cuda / gpu: torch's CUDA device and JAX's GPU backend",
    )


def jax_accelerator():
    """JAX's first GPU device, or None (a CPU-only jaxlib has no GPU backend at all)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    return devices[0] if devices else None


def use_device(device: str, packages) -> list[str]:
    """Make ``device`` the default of torch and JAX; return the packages that can run there
    (those that cannot are reported and left out)."""
    global _on_accelerator
    if device == "cpu":
        return list(packages)
    _on_accelerator = True
    usable = []
    for package in packages:
        if package == "torch":
            if torch.cuda.is_available():
                torch.set_default_device("cuda")
                usable.append(package)
            else:
                print("torch: no CUDA device; its tables are skipped\n")
        else:
            accelerator = jax_accelerator()
            if accelerator is not None:
                jax.config.update("jax_default_device", accelerator)
                usable.append(package)
            else:
                print("jax: no GPU backend; its tables are skipped\n")
    return usable


def from_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (made on the CPU, as a seeded ``torch.Generator`` requires) on torch's
    default device."""
    return tensor.to(torch.get_default_device())


def synchronize() -> None:
    """Wait for queued CUDA work (no-op on the CPU)."""
    if torch.cuda.is_available() and torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()


def clock() -> float:
    """Seconds for paired timings: the process's CPU time on the CPU (with one thread, what
    the wall-clock time would be on an idle machine, where a shared machine's wall-clock
    time mostly measures the wait for a core); on an accelerator, wall-clock time once the
    queued CUDA work has finished (the work is the device's, not this process's)."""
    if not _on_accelerator:
        return time.process_time()
    synchronize()
    return time.perf_counter()


def describe(device: str) -> str:
    """The device as the tables' headers state it."""
    if device == "cpu":
        return "CPU"
    names = []
    if torch.cuda.is_available():
        names.append(f"torch: {torch.cuda.get_device_name()}")
    accelerator = jax_accelerator()
    if accelerator is not None:
        names.append(f"jax: {accelerator.device_kind}")
    return ", ".join(names) or "no accelerator"


def best_time(function, repeats: int) -> float:
    """Best wall time of ``repeats`` calls, in seconds, after one warm-up call (which also
    compiles), each timing ending when queued CUDA work has finished."""
    function()
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best
