"""DistributedDataParallel over 2 processes (gloo, localhost): averaged gradients equal the
single-process gradient of the full batch.

Run by ``tests/test_multi_device.py`` in its own process group (so that a hung or failed run
is killed whole). Standalone::

    PYTHONPATH=$PWD python tests/multi_device_torch_ddp.py

A small module maps a batch of features to the parameters of ExactlyKBernoulli (logits),
LinearConstrainedNormal (loc and scale, under a fixed 2-row A, with the marginal-expectation
and the pathwise gradient estimator) and ConditionedPoisson (rates), one linear head each.
The loss of a batch is the mean over its examples of ``-log_prob(value)`` plus a weighted
squared distance between an ``rsample`` and ``value``, summed over the distributions.

Each of the 2 ranks (``torch.multiprocessing.spawn``, one thread each, float64) takes half of
the batch, wraps the module in ``DistributedDataParallel`` and runs one backward pass; DDP
all-reduces the gradients and divides by the world size, which for equal halves and a mean
loss is the gradient of the full batch's mean loss. The launcher computes that full-batch
gradient in one process with the same sample values (the samples of the full batch are
drawn in the same two halves, after the same seeds as the ranks) and prints a JSON report;
exit status 1 if any gradient differs by more than float64 rounding (or a rank failed).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from pyro_constrained import ConditionedPoisson, ExactlyKBernoulli, LinearConstrainedNormal

WORLD_SIZE = 2
BATCH, FEATURES, N, ROWS = 8, 3, 6, 2
SAMPLE_SEEDS = (11, 12)  # the seed of each half's rsample, rank r using SAMPLE_SEEDS[r]
DTYPE = torch.float64


class Heads(torch.nn.Module):
    """Features -> the parameters of a batch of each distribution."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.logits = torch.nn.Linear(FEATURES, N)
        self.loc = torch.nn.Linear(FEATURES, N)
        self.scale = torch.nn.Linear(FEATURES, N)
        self.loc_pathwise = torch.nn.Linear(FEATURES, N)
        self.log_rate = torch.nn.Linear(FEATURES, N)
        self.register_buffer("A", torch.stack([torch.ones(N), torch.arange(N) - 2.0]))

    def forward(self, x: torch.Tensor, data: dict[str, torch.Tensor]) -> dict[str, object]:
        scale = torch.nn.functional.softplus(self.scale(x)) + 0.1
        return {
            "ExactlyKBernoulli": ExactlyKBernoulli(logits=self.logits(x), k=data["k_bits"]),
            "LinearConstrainedNormal": LinearConstrainedNormal(
                self.loc(x), scale, A=self.A, k=data["k_real"]
            ),
            "LinearConstrainedNormal(pathwise)": LinearConstrainedNormal(
                self.loc_pathwise(x),
                scale,
                A=self.A,
                k=data["k_real"],
                grad_estimator="pathwise",
            ),
            "ConditionedPoisson": ConditionedPoisson(self.log_rate(x).exp(), k=data["k_counts"]),
        }


VALUE_OF = {
    "ExactlyKBernoulli": "bits",
    "LinearConstrainedNormal": "real",
    "LinearConstrainedNormal(pathwise)": "real",
    "ConditionedPoisson": "counts",
}


def make_data() -> dict[str, torch.Tensor]:
    """Features, k and values in each distribution's support, for the full batch."""
    g = torch.Generator().manual_seed(1)
    k_bits = torch.tensor([0, 1, 2, 3, 6, 5, 2, 4])
    bits = torch.zeros(BATCH, N, dtype=DTYPE)
    for i, k in enumerate(k_bits.tolist()):
        bits[i, torch.randperm(N, generator=g)[:k]] = 1.0
    k_counts = torch.tensor([0.0, 1.0, 3.0, 5.0, 2.0, 4.0, 1.0, 5.0], dtype=DTYPE)
    counts = torch.stack(
        [
            torch.bincount(torch.randint(N, (int(k),), generator=g), minlength=N).to(DTYPE)
            for k in k_counts
        ]
    )
    A = torch.stack([torch.ones(N), torch.arange(N) - 2.0]).to(DTYPE)
    k_real = torch.randn(BATCH, ROWS, generator=g, dtype=DTYPE)
    # Points of {z : A z = k}: the minimum-norm solution plus a null-space component.
    null_space = torch.linalg.svd(A)[2][ROWS:]
    real = torch.linalg.lstsq(A, k_real.T).solution.T + (
        torch.randn(BATCH, N - ROWS, generator=g, dtype=DTYPE) @ null_space
    )
    return {
        "x": torch.randn(BATCH, FEATURES, generator=g, dtype=DTYPE),
        "k_bits": k_bits,
        "bits": bits,
        "k_counts": k_counts,
        "counts": counts,
        "k_real": k_real,
        "real": real,
    }


def half(data: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    rows = slice(rank * BATCH // WORLD_SIZE, (rank + 1) * BATCH // WORLD_SIZE)
    return {name: tensor[rows] for name, tensor in data.items()}


def losses(model, data, samples: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's mean loss: -log_prob(value) plus a weighted squared distance of the
    given ``samples`` (rsample outputs) from ``value``."""
    dists = model(data["x"], data)
    weights = torch.arange(1, N + 1, dtype=DTYPE)
    total = torch.zeros((), dtype=DTYPE)
    for name, d in dists.items():
        value = data[VALUE_OF[name]]
        total = total - d.log_prob(value).mean()
        total = total + ((samples[name] - value) ** 2 * weights).sum(-1).mean()
    return total


def rsamples(model, data, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {name: d.rsample() for name, d in model(data["x"], data).items()}


def rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        model = DistributedDataParallel(Heads().to(DTYPE))
        data = half(make_data(), rank)
        # The samples come from the wrapped module's forward, as in training; their values
        # depend only on the seed and this half's parameters.
        loss = losses(model, data, rsamples(model, data, SAMPLE_SEEDS[rank]))
        loss.backward()  # DDP all-reduces and averages the gradients here
        grads = {name: p.grad for name, p in model.module.named_parameters()}
        torch.save(grads, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def full_batch_gradients() -> dict[str, torch.Tensor]:
    """The gradient of the full batch's mean loss in one process, with the ranks' samples."""
    model = Heads().to(DTYPE)
    data = make_data()
    samples = [rsamples(model, half(data, r), SAMPLE_SEEDS[r]) for r in range(WORLD_SIZE)]
    joined = {name: torch.cat([s[name] for s in samples]) for name in samples[0]}
    losses(model, data, joined).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    torch.set_num_threads(1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        # spawn (not fork): a fresh interpreter per rank, as torch.distributed.run gives.
        mp.spawn(rank_main, args=(free_port(), out_dir), nprocs=WORLD_SIZE, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD_SIZE)]
    seconds = time.perf_counter() - start
    expected = full_batch_gradients()
    report = []
    for name, want in expected.items():
        failures = []
        for r, grads in enumerate(ranks):
            have = grads[name]
            error = (have - want).abs().max().item()
            # One backward pass in float64 either way; the sums run in another order.
            if not torch.isfinite(want).all() or error > 1e-12 * max(1.0, want.abs().max()):
                failures.append(f"rank {r}: max |DDP - full batch| = {error:.3g}")
        if not want.abs().max() > 0:
            failures.append("the full-batch gradient is zero: nothing was compared")
        report.append({"case": name, "ok": not failures, "failures": failures})
    report.append({"case": "ranks", "ok": True, "failures": [], "seconds": round(seconds, 2)})
    print(json.dumps(report, indent=1))
    return 0 if all(entry["ok"] for entry in report) else 1


if __name__ == "__main__":
    sys.exit(main())
