"""Training-step time of the LinearConstrainedNormal regression head against the same MLP
with a plain Normal head and with an orthogonal projection layer.

One training step = forward + loss + backward + Adam step, batch 256, n = 20 outputs,
a = 6 balances shared by all examples with a right-hand side k per example, 10 inputs,
backbone MLP 10 -> 64 -> 64 (SiLU), float32, torch on one thread. The heads:

- ``normal``: ``Normal(loc, s).to_event(1)`` with a per-output learned scale (softplus +
  floor, as the LCN head's default), NLL loss: the plain MLP step the target refers to;
- ``projection``: ``LinearConstraint.project(loc, k)`` (the orthogonal projection layer,
  KKThPINN), squared-error loss;
- ``lcn nll``: :class:`LinearConstrainedNormalHead`, default scale (``"per_output"``),
  ``loss="nll"``: the step the target is about (<= 1.3x ``normal``);
- ``lcn mse+nll``: the same head with the recommended loss (two terms);
- ``lcn nll per_example``: the heteroscedastic scale (a scale MLP, one whitened QR per
  example), for comparison.

Validation is off for every distribution in the step (``validate_args=False``; the
``LinearConstraint`` was validated once when built), as in a training loop.

Each timing is the best of ``REPEATS`` repeats of the mean over ``STEPS`` steps, all
variants alternating within a repeat so that they see the same background load; times are
the process's CPU time (``time.process_time``), which with one thread is what the wall-clock
time would be on an idle machine.

Run from the repository root: ``python -m benchmarks.regression_head``
(``--profile`` adds torch.profiler tables of the LCN steps; ``--device cuda`` runs the steps
on the accelerator, timed in wall-clock seconds there: ``benchmarks/devices.py``).
"""

from __future__ import annotations

import argparse
import os

import pyro.distributions as pdist
import torch
from torch import nn
from torch.nn import functional as F

from benchmarks import devices
from pyro_constrained import LinearConstraint
from pyro_constrained.nn import LinearConstrainedNormalHead

BATCH, N, A_ROWS, IN, HIDDEN = 256, 20, 6, 10, 64
REPEATS, STEPS = 15, 20
TARGET_RATIO = 1.3
MIN_SCALE = 1e-2


def backbone() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, HIDDEN), nn.SiLU())


def make_data(generator: torch.Generator):
    A, x, raw, k = (
        devices.from_cpu(torch.randn(*shape, generator=generator, device="cpu"))
        for shape in ((A_ROWS, N), (BATCH, IN), (BATCH, N), (BATCH, A_ROWS))
    )
    constraint = LinearConstraint(A)
    return constraint, x, k, constraint.project(raw, k)


def make_steps(constraint, x, k, y) -> dict:
    """One closure per variant, each doing a full training step."""
    steps = {}

    def with_optimiser(modules, loss_fn):
        parameters = [p for module in modules for p in module.parameters()]
        optimiser = torch.optim.Adam(parameters, lr=1e-3)

        def step():
            optimiser.zero_grad(set_to_none=True)
            loss_fn().backward()
            optimiser.step()

        return step

    torch.manual_seed(0)
    body, linear = backbone(), nn.Linear(HIDDEN, N)
    raw_scale = nn.Module()
    raw_scale.value = nn.Parameter(torch.zeros(N))

    def normal_loss():
        scale = MIN_SCALE + F.softplus(raw_scale.value)
        dist = pdist.Normal(linear(body(x)), scale, validate_args=False).to_event(1)
        return -dist.log_prob(y).mean()

    steps["normal"] = with_optimiser([body, linear, raw_scale], normal_loss)

    body_p, linear_p = backbone(), nn.Linear(HIDDEN, N)

    def projection_loss():
        return (constraint.project(linear_p(body_p(x)), k) - y).square().sum(-1).mean()

    steps["projection"] = with_optimiser([body_p, linear_p], projection_loss)

    for name, loss, scale in (
        ("lcn nll", "nll", "per_output"),
        ("lcn mse+nll", "mse+nll", "per_output"),
        ("lcn nll per_example", "nll", "per_example"),
    ):
        body_h = backbone()
        head = LinearConstrainedNormalHead(
            HIDDEN, constraint, loss=loss, scale=scale, validate_args=False
        )

        def head_loss(body_h=body_h, head=head):
            return head.loss(body_h(x), k, y)

        steps[name] = with_optimiser([body_h, head], head_loss)
    return steps


def best_times(steps: dict) -> dict[str, float]:
    for step in steps.values():
        for _ in range(3):
            step()  # warm-up
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(REPEATS):
        for name, step in steps.items():
            start = devices.clock()
            for _ in range(STEPS):
                step()
            best[name] = min(best[name], (devices.clock() - start) / STEPS)
    return best


def profile(steps: dict, names) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name in names:
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                steps[name]()
        print(f"\n## profile: {name} (50 steps)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="print torch.profiler tables")
    devices.add_device_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not devices.use_device(args.device, ["torch"]):
        return
    constraint, x, k, y = make_data(torch.Generator().manual_seed(0))
    steps = make_steps(constraint, x, k, y)
    best = best_times(steps)
    reference = best["normal"]
    print(
        f"training step, batch {BATCH}, n = {N}, a = {A_ROWS}, MLP {IN}-{HIDDEN}-{HIDDEN}, "
        f"float32, one thread; best of {REPEATS} x {STEPS} steps "
        f"({'CPU' if args.device == 'cpu' else 'wall-clock'} time, "
        f"{devices.describe(args.device)}); load average "
        f"{os.getloadavg()[0]:.1f} at the end of the run\n"
    )
    print("| head | step | vs plain Normal MLP |")
    print("| --- | --- | --- |")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e6:.0f} us | {seconds / reference:.2f}x |")
    ratio = best["lcn nll"] / reference
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(f"\nLCN head (NLL) / plain MLP = {ratio:.2f}x: target <= {TARGET_RATIO}x {verdict}")
    print(f"LCN head (NLL) / projection layer = {best['lcn nll'] / best['projection']:.2f}x")
    if args.profile:
        profile(steps, ["normal", "lcn nll", "lcn nll per_example"])


if __name__ == "__main__":
    main()
