"""Benchmark of the exactly-k kernels: ``python -m benchmarks.exactly_k [--quick]``.

For n in {100, 1000, 10000}, k in {10, 100}, batch 256, float32 and float64, torch and JAX
(under jit), prints one table per package and dtype (times are the best of several repeats,
in milliseconds, all measured in this one run; ratios are taken within it):

* marginals: the library's ``marginals`` (upward + downward pass) against the reference
  sequential log-space DP forward + autograd backward (SIMPLE's code);
* sampling: the library's exact ``sample`` against the reference sequential sampler (its DP
  table, then one variable at a time), one draw per batch row;
* rsample: the library's ``sample_and_marginals`` (what a straight-through ``rsample`` needs)
  against Gumbel-top-k (inexact, but the cheapest k-hot sampler);
* accuracy: max |float32 - float64| of the library's marginals, and max |float64 -
  enumeration| at n = 12.

The reference DP costs O(n) sequential steps and keeps a (batch, k) table per step for its
backward pass (O(batch n k) memory: 51 GB in float32 at batch 256, n = 10000, k = 5000); at
n = 10000 it runs once (no repeats), and above ``--max-reference-n`` or
``--max-reference-nk`` (n k) not at all. ``--ks`` chooses the k of each n (``n/2`` for half
of n), ``--batch`` the batch. ``--device cuda`` runs both packages on the accelerator
(``benchmarks/devices.py``).

``--scaling [options]`` runs ``benchmarks.exactly_k_scaling`` instead: n up to 1e7, k up to
n/2, peak memory, log-log slopes and JAX compile times, against the previous kernels
(read from git at the commit before the FFT path, ``--previous``) in the same run.
"""

import argparse
import os
import sys

# One thread per framework: the machine is shared, and the comparison is per core.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import devices  # noqa: E402
from benchmarks import exactly_k_reference as reference  # noqa: E402
from numpyro_constrained import exactly_k_kernels as jax_kernels  # noqa: E402
from pyro_constrained import exactly_k_kernels as torch_kernels  # noqa: E402

jax.config.update("jax_enable_x64", True)
torch.set_num_threads(1)


def best_time(function, repeats: int) -> float:
    """Best wall time of ``repeats`` calls, in ms (after one warm-up call: JIT compilation)."""
    return 1e3 * devices.best_time(function, repeats)


def torch_cases(logits: np.ndarray, k: int, dtype):
    x = torch.tensor(logits, dtype=dtype)
    ks = torch.full(x.shape[:-1], k)
    return {
        "marginals": lambda: torch_kernels.marginals(x, ks, k),
        "marginals_ref": lambda: reference.torch_marginals(x, k),
        "sample": lambda: torch_kernels.sample(x, ks, k),
        "sample_ref": lambda: reference.torch_sample(x, k),
        "rsample": lambda: torch_kernels.sample_and_marginals(x, ks, k),
        "gumbel": lambda: reference.torch_gumbel_top_k(x, k),
    }


def jax_cases(logits: np.ndarray, k: int, dtype):
    x = jnp.asarray(logits, dtype=dtype)
    ks = jnp.full(x.shape[:-1], k)
    key = jax.random.PRNGKey(0)

    def ready(function):
        return lambda: jax.block_until_ready(function())

    return {
        "marginals": ready(lambda: jax_kernels.marginals(x, ks, k)),
        "marginals_ref": ready(lambda: reference.jax_marginals(x, k)),
        "sample": ready(lambda: jax_kernels.sample(key, x, ks, k)),
        "sample_ref": ready(lambda: reference.jax_sample(key, x, k)),
        "rsample": ready(lambda: jax_kernels.sample_and_marginals(key, x, ks, k)),
        "gumbel": ready(lambda: reference.jax_gumbel_top_k(key, x, k)),
    }


def marginals_of(package: str, logits: np.ndarray, ks: np.ndarray, dtype) -> np.ndarray:
    n = logits.shape[-1]
    if package == "torch":
        mu = torch_kernels.marginals(torch.tensor(logits, dtype=dtype), torch.tensor(ks), n)
        return mu.cpu().numpy()
    return np.asarray(jax_kernels.marginals(jnp.asarray(logits, dtype), jnp.asarray(ks), n))


def accuracy(package: str, n: int, rng) -> tuple[float, float]:
    """(max |mu32 - mu64| over k in 0..n with logits ~ N(-1, 6^2); max |mu64 - enumeration|
    at n = 12, logits ~ N(0, 3^2), every k)."""
    from tests.oracles.exactly_k import exactly_k_marginals

    ks = np.unique(np.linspace(0, n, 11).astype(int))
    logits = rng.normal(-1.0, 6.0, size=(len(ks), n))
    mu64 = np.asarray(
        marginals_of(package, logits, ks, torch.float64 if package == "torch" else np.float64)
    )
    mu32 = np.asarray(
        marginals_of(package, logits, ks, torch.float32 if package == "torch" else np.float32)
    )
    small = rng.normal(0.0, 3.0, size=(13, 12))
    small_ks = np.arange(13)
    mu_small = np.asarray(
        marginals_of(package, small, small_ks, torch.float64 if package == "torch" else np.float64)
    )
    enumerated = np.stack(
        [exactly_k_marginals(row, k) for row, k in zip(small, small_ks, strict=True)]
    )
    return float(np.abs(mu32 - mu64).max()), float(np.abs(mu_small - enumerated).max())


def main() -> None:
    if "--scaling" in sys.argv[1:]:
        from benchmarks import exactly_k_scaling

        return exactly_k_scaling.main([arg for arg in sys.argv[1:] if arg != "--scaling"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n <= 1000, batch 64, 2 repeats")
    parser.add_argument("--packages", default="torch,jax")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--sizes", default=None, help="comma-separated n (default 100,1000,10000)")
    parser.add_argument("--ks", default="10,100", help="comma-separated k, or n/2")
    parser.add_argument("--batch", type=int, default=None, help="default 256 (--quick: 64)")
    parser.add_argument("--max-reference-n", type=int, default=10000)
    parser.add_argument("--max-reference-nk", type=float, default=1e6)
    parser.add_argument("--no-accuracy", action="store_true")
    devices.add_device_argument(parser)
    args = parser.parse_args()
    packages = devices.use_device(args.device, args.packages.split(","))
    sizes = [100, 1000] if args.quick else [100, 1000, 10000]
    if args.sizes:
        sizes = [int(size) for size in args.sizes.split(",")]
    batch = args.batch or (64 if args.quick else 256)
    repeats = 2 if args.quick else 5
    rng = np.random.default_rng(0)
    print(
        f"batch {batch}, best of {repeats} repeats (reference at n = 10000: 1 run), ms, "
        f"{devices.describe(args.device)}\n"
    )
    for package in packages:
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch if package == "torch" else np, dtype_name)
            print(f"### {package}, {dtype_name}\n")
            print(
                "| n | k | marginals | reference | speed-up | sample | sequential sampler "
                "| speed-up | rsample | Gumbel-top-k | rsample / Gumbel |"
            )
            print("|" + "---|" * 11)
            for n in sizes:
                for k in sorted({n // 2 if k == "n/2" else int(k) for k in args.ks.split(",")}):
                    if k > n:
                        continue
                    logits = rng.normal(0.0, 2.0, size=(batch, n))
                    cases = (torch_cases if package == "torch" else jax_cases)(logits, k, dtype)
                    if n > args.max_reference_n or n * k > args.max_reference_nk:
                        cases = {name: f for name, f in cases.items() if not name.endswith("_ref")}
                    ref_repeats = 1 if n >= 10000 else repeats
                    t = {
                        name: best_time(function, ref_repeats if name.endswith("_ref") else repeats)
                        for name, function in cases.items()
                    }
                    t.setdefault("marginals_ref", float("nan"))
                    t.setdefault("sample_ref", float("nan"))
                    row = (
                        n,
                        k,
                        t["marginals"],
                        t["marginals_ref"],
                        t["marginals_ref"] / t["marginals"],
                        t["sample"],
                        t["sample_ref"],
                        t["sample_ref"] / t["sample"],
                        t["rsample"],
                        t["gumbel"],
                        t["rsample"] / t["gumbel"],
                    )
                    print(
                        "| {} | {} | {:.1f} | {:.1f} | {:.1f}x | {:.1f} | {:.1f} | {:.1f}x "
                        "| {:.1f} | {:.2f} | {:.0f}x |".format(*row)
                        .replace("nanx", "-")
                        .replace("nan", "-"),
                        flush=True,
                    )
            print()
    if args.no_accuracy:
        return
    print("### accuracy of the library's marginals\n")
    print(
        "| package | n | max abs float32 - float64 (k = 0..n, logits ~ N(-1, 36)) "
        "| max abs float64 - enumeration (n = 12) |"
    )
    print("|---|---|---|---|")
    for package in packages:
        for n in [300, 1000]:
            diff32, diff_enum = accuracy(package, n, rng)
            print(f"| {package} | {n} | {diff32:.1e} | {diff_enum:.1e} |", flush=True)


if __name__ == "__main__":
    main()
