"""LinearConstrainedNormal against an unconstrained Normal of the same size.

n = 1000, a in {1, 10}, diagonal covariance, batch 256, float32: the time of ``log_prob`` of
a (256, 1000) value and of one ``sample()`` of shape (256, 1000), in torch (Pyro) and in JAX
(NumPyro, both sides jitted, the distribution passed in as a pytree so that what depends
only on the parameters is computed once, at construction, as in torch). The unconstrained
reference is ``Normal(loc, scale).to_event(1)`` with the same parameters. Both frameworks run
on one thread. Each timing is the best of several repeats of the mean over many calls, the
two sides alternating; ratios are taken within one run. Times are the process's CPU time
(``time.process_time``), not wall-clock time: on a shared machine wall-clock time mostly
measures how long the process waited for a core, and with one thread CPU time is what the
wall-clock time would be on an idle machine. Target: constrained / unconstrained <= 3.

Run from the repository root: ``python -m benchmarks.linear_constrained_normal``
(``--device cuda`` runs both on the accelerator, timed in wall-clock seconds there:
``benchmarks/devices.py``).
"""

import os

# One thread for XLA as for torch: the benchmark compares kernels, not thread pools.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpyro.distributions as ndist  # noqa: E402
import pyro.distributions as pdist  # noqa: E402
import torch  # noqa: E402

import numpyro_constrained  # noqa: E402
import pyro_constrained  # noqa: E402
from benchmarks import devices  # noqa: E402

N, BATCH, ROWS = 1000, 256, (1, 10)
REPEATS, CALLS = 15, 20
TARGET_RATIO = 3.0


def paired_best_times(constrained, unconstrained) -> tuple[float, float]:
    """Best over ``REPEATS`` of the mean seconds per call over ``CALLS`` calls, for both
    functions, alternating between them so that both see the same background load."""
    constrained()  # warm-up (and, for JAX, compilation)
    unconstrained()
    best = [float("inf"), float("inf")]
    for _ in range(REPEATS):
        for index, function in enumerate((constrained, unconstrained)):
            start = devices.clock()
            for _ in range(CALLS):
                function()
            best[index] = min(best[index], (devices.clock() - start) / CALLS)
    return best[0], best[1]


def torch_timings(num_rows: int) -> dict[str, tuple[float, float]]:
    generator = torch.Generator().manual_seed(num_rows)
    loc, scale, A, k = (
        devices.from_cpu(tensor)
        for tensor in (
            torch.randn(BATCH, N, generator=generator, device="cpu"),
            torch.rand(BATCH, N, generator=generator, device="cpu") + 0.5,
            torch.randn(num_rows, N, generator=generator, device="cpu"),
            torch.randn(num_rows, generator=generator, device="cpu"),
        )
    )
    constrained = pyro_constrained.LinearConstrainedNormal(loc, scale, A=A, k=k)
    unconstrained = pdist.Normal(loc, scale).to_event(1)
    value = constrained.sample()
    free_value = unconstrained.sample()
    with torch.no_grad():
        return {
            "log_prob": paired_best_times(
                lambda: constrained.log_prob(value), lambda: unconstrained.log_prob(free_value)
            ),
            "sample": paired_best_times(constrained.sample, unconstrained.sample),
        }


def jax_timings(num_rows: int) -> dict[str, tuple[float, float]]:
    keys = jax.random.split(jax.random.PRNGKey(num_rows), 5)
    loc = jax.random.normal(keys[0], (BATCH, N), dtype=jnp.float32)
    scale = jax.random.uniform(keys[1], (BATCH, N), dtype=jnp.float32) + 0.5
    A = jax.random.normal(keys[2], (num_rows, N), dtype=jnp.float32)
    k = jax.random.normal(keys[3], (num_rows,), dtype=jnp.float32)
    constrained = numpyro_constrained.LinearConstrainedNormal(loc, scale, A=A, k=k)
    unconstrained = ndist.Normal(loc, scale).to_event(1)
    value = constrained.sample(keys[4])
    free_value = unconstrained.sample(keys[4])

    log_prob = jax.jit(lambda dist, x: dist.log_prob(x))
    sample = jax.jit(lambda dist, key: dist.sample(key))
    return {
        "log_prob": paired_best_times(
            lambda: log_prob(constrained, value).block_until_ready(),
            lambda: log_prob(unconstrained, free_value).block_until_ready(),
        ),
        "sample": paired_best_times(
            lambda: sample(constrained, keys[4]).block_until_ready(),
            lambda: sample(unconstrained, keys[4]).block_until_ready(),
        ),
    }


def main(argv=None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    devices.add_device_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    packages = devices.use_device(args.device, ["torch", "jax"])
    clock = "CPU time" if args.device == "cpu" else "wall-clock time"
    print(
        f"n = {N}, batch = {BATCH}, diagonal covariance, float32, one thread, {clock}, "
        f"{devices.describe(args.device)}"
    )
    print(f"{'framework':<10}{'a':>4}  {'call':<9}{'constrained':>13}{'Normal':>11}{'ratio':>8}")
    all_within = True
    for framework, timings in (("torch", torch_timings), ("jax", jax_timings)):
        if framework not in packages:
            continue
        for num_rows in ROWS:
            for call, (constrained, unconstrained) in timings(num_rows).items():
                ratio = constrained / unconstrained
                all_within &= ratio <= TARGET_RATIO
                print(
                    f"{framework:<10}{num_rows:>4}  {call:<9}{constrained * 1e6:>10.0f} us"
                    f"{unconstrained * 1e6:>8.0f} us{ratio:>7.2f}x"
                )
    verdict = "within" if all_within else "NOT within"
    print(f"all ratios {verdict} the {TARGET_RATIO:.0f}x target")
    return all_within


if __name__ == "__main__":
    main()
