"""Scaling of the exactly-k kernels in n and k: ``python -m benchmarks.exactly_k --scaling``.

For n from 1e3 up (``--max-n``, default 1e7) and k in {10, n/20, n/2}, batch 1, torch and
JAX, float32 and float64, one table per package and dtype:

* the library's ``marginals`` (upward + downward pass: the forward and backward pass of the
  log normaliser) and ``sample`` (one draw), best of ``--repeats`` runs after a warm-up;
* the previous kernels, read from git at ``--previous`` (default: the commit before the FFT
  path, ``PREVIOUS_REVISION``) into temporary modules (``load_previous_kernels``), on the
  same inputs in the same run, and the ratio previous / new (above 1: new is faster), where
  the previous kernels take at most ``--previous-limit`` (n k) multiply-adds;
* peak memory of ``marginals``: torch, the growth of the peak resident set (VmHWM, reset
  first) of a forked child that runs it once; JAX, XLA's own accounting of the compiled
  function (arguments, outputs and temporaries, ``memory_analysis``);
* the log-log slope of time against n at k = n/2 (least squares over n = 1e4..1e6).

Then JAX compile times: the first call (trace + compile + run) and the compile alone of
``jit(log_prob)`` and ``jit(sample)`` of ``ExactlyKBernoulli`` at k = n/2, new kernels and
previous ones (the distribution's ``kernels`` module swapped), and the number of
compilations of eager ``marginals`` calls over 10 sizes n = 1000..1900.

``--device cuda`` runs both packages on the accelerator (torch's CUDA device, JAX's GPU
backend; ``benchmarks/devices.py``), memory then being CUDA's peak allocation for torch.

A k series stops growing n once one of its cases took more than ``--stop-after`` seconds,
and k > 10 stops above ``--max-n-large-k`` (default 1e6; the output says where). Other
processes share the machine: compare ratios within one run.
"""

import argparse
import ctypes
import os
import subprocess
import sys
import time
from types import ModuleType

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import devices  # noqa: E402
from numpyro_constrained import exactly_k_bernoulli as numpyro_module  # noqa: E402
from numpyro_constrained import exactly_k_kernels as jax_kernels  # noqa: E402
from pyro_constrained import exactly_k_kernels as torch_kernels  # noqa: E402

jax.config.update("jax_enable_x64", True)
torch.set_num_threads(1)

# main just before the FFT path (the branch point of issue 18's kernels): the kernels the
# scaling tables compare against.
PREVIOUS_REVISION = "1c60b785c1e7f3550c20976e1bc64f97aebe894d"
_KERNEL_PATHS = {
    "torch": "pyro_constrained/exactly_k_kernels.py",
    "jax": "numpyro_constrained/exactly_k_kernels.py",
}


def load_previous_kernels(revision: str) -> dict[str, ModuleType]:
    """The kernel modules of both packages as they were at git ``revision``, loaded from
    ``git show`` into fresh in-memory modules (they import only torch and JAX).
    Raises SystemExit with a clear message when git, the repository or the revision is not
    available (e.g. a source archive without history: pass ``--previous`` a revision that
    exists, or ``--previous-limit 0`` to skip the comparison)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    modules = {}
    for package, path in _KERNEL_PATHS.items():
        try:
            source = subprocess.run(
                ["git", "-C", root, "show", f"{revision}:{path}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        except FileNotFoundError:
            message = "benchmarks: the previous kernels need git, which is not installed"
            raise SystemExit(message) from None
        except subprocess.CalledProcessError as error:
            raise SystemExit(
                f"benchmarks: cannot read {path} at revision {revision!r} with git "
                f"({error.stderr.strip()}); pass --previous REV with a revision of this "
                "repository, or --previous-limit 0 to skip the previous kernels"
            ) from None
        name = f"exactly_k_previous_{package}"
        module = ModuleType(name)
        module.__file__ = f"{revision}:{path}"
        sys.modules[name] = module  # NamedTuple and pickling look their module up
        exec(compile(source, module.__file__, "exec"), module.__dict__)
        if package == "jax" and not hasattr(module, "sample_straight_through"):
            module.sample_straight_through = _eager_straight_through(module)
        modules[package] = module
    return modules


def _eager_straight_through(kernels: ModuleType):
    """For JAX kernels from before ``sample_straight_through``: what the distribution did
    then, ``z + mu - stop_gradient(mu)`` from ``sample_and_marginals`` (the marginals
    computed whether or not the sample is differentiated), so that the distribution of
    this revision can run on them."""

    def sample_straight_through(key, logits, k, k_max, sample_shape=()):
        z, mu = kernels.sample_and_marginals(key, logits, k, k_max, sample_shape)
        return z + (mu - jax.lax.stop_gradient(mu))

    return sample_straight_through


best_time = devices.best_time


def table_size(n: int, k: int) -> int:
    """The table size the distributions pass: k rounded up to a power of two, at most n."""
    return min(n, 1 << k.bit_length())


def calls(package: str, kernels, logits: np.ndarray, k: int, dtype):
    n = logits.shape[-1]
    k_max = table_size(n, k)
    if package == "torch":
        x = torch.tensor(logits, dtype=dtype)
        ks = torch.full(x.shape[:-1], k)
        return (
            lambda: kernels.marginals(x, ks, k_max),
            lambda: kernels.sample(x, ks, k_max),
        )
    x = jnp.asarray(logits, dtype=dtype)
    ks = jnp.full(x.shape[:-1], k)
    key = jax.random.PRNGKey(0)
    return (
        lambda: jax.block_until_ready(kernels.marginals(x, ks, k_max)),
        lambda: jax.block_until_ready(kernels.sample(key, x, ks, k_max)),
    )


def torch_peak_bytes(function) -> float:
    """Growth of the peak resident set while a forked child runs ``function`` once; on CUDA,
    the peak of CUDA memory allocated while it runs (a CUDA context cannot be forked)."""
    if torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        function()
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - before)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure and report, then leave without cleanup
        os.close(read)
        # Free heap memory kept by malloc (the parent's earlier runs) goes back to the
        # system first: reused, it would not show as growth.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets the peak resident set (VmHWM) to the current one
        before = _status_bytes("VmRSS")
        function()
        os.write(write, str(max(0, _status_bytes("VmHWM") - before)).encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 64):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return float(data or b"nan")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def jax_peak_bytes(logits: np.ndarray, k: int, dtype) -> float:
    n = logits.shape[-1]
    x = jnp.asarray(logits, dtype=dtype)
    ks = jnp.full(x.shape[:-1], k)
    function = jax.jit(lambda x, ks: jax_kernels.marginals(x, ks, table_size(n, k)))
    analysis = function.lower(x, ks).compile().memory_analysis()
    if analysis is None:
        return float("nan")
    return float(
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def slope(points: list[tuple[int, float]]) -> float:
    chosen = [(n, t) for n, t in points if 1e4 <= n <= 1e6]
    if len(chosen) < 2:
        return float("nan")
    log_n, log_t = np.log([n for n, _ in chosen]), np.log([t for _, t in chosen])
    return float(np.polyfit(log_n, log_t, 1)[0])


def scaling_tables(args, previous_kernels) -> None:
    rng = np.random.default_rng(0)
    sizes = [n for n in (1000, 10000, 100000, 1000000, 10000000) if n <= args.max_n]
    for package in args.packages:
        previous = previous_kernels.get(package)
        new = torch_kernels if package == "torch" else jax_kernels
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch if package == "torch" else jnp, dtype_name)
            print(f"### {package}, {dtype_name} (batch 1, seconds, {args.device_name})\n")
            print(
                "| n | k | marginals | previous | previous / new | sample | previous "
                "| previous / new | peak memory (marginals) | sample / marginals |"
            )
            print("|" + "---|" * 10)
            half_points = []
            stopped = {}
            for n in sizes:
                logits = rng.normal(0.0, 2.0, size=(1, n))
                for fraction, k in (("10", 10), ("n/20", n // 20), ("n/2", n // 2)):
                    if fraction in stopped or (fraction != "10" and k <= 10):
                        continue
                    if fraction != "10" and n > args.max_n_large_k:
                        stopped.setdefault(fraction, sizes[sizes.index(n) - 1])
                        continue
                    marginals, sample = calls(package, new, logits, k, dtype)
                    t_mu = best_time(marginals, args.repeats)
                    t_z = best_time(sample, args.repeats)
                    old = ["-", "-", "-", "-"]
                    if previous is not None and n * k <= args.previous_limit:
                        old_mu, old_z = calls(package, previous, logits, k, dtype)
                        p_mu = best_time(old_mu, args.repeats)
                        p_z = best_time(old_z, args.repeats)
                        old = [f"{p_mu:.3g}", f"{p_mu / t_mu:.1f}x"]
                        old += [f"{p_z:.3g}", f"{p_z / t_z:.1f}x"]
                    if package == "torch":
                        memory = torch_peak_bytes(marginals)
                    else:
                        memory = jax_peak_bytes(logits, k, dtype)
                    print(
                        f"| {n:.0e} | {k} | {t_mu:.3g} | {old[0]} | {old[1]} | {t_z:.3g} "
                        f"| {old[2]} | {old[3]} | {memory / 2**20:.0f} MiB | {t_z / t_mu:.2f} |",
                        flush=True,
                    )
                    if fraction == "n/2":
                        half_points.append((n, t_mu))
                    if max(t_mu, t_z) > args.stop_after:
                        stopped[fraction] = n
            print()
            print(f"log-log slope of marginals time against n at k = n/2: {slope(half_points):.2f}")
            if stopped:
                where = ", ".join(f"k = {f} after n = {n:.0e}" for f, n in stopped.items())
                print(f"stopped (time or --max-n-large-k): {where}")
            print()


def _compile_row(logits, k: int) -> list[str]:
    """First call and compile (wall, and process CPU in brackets) of jit(log_prob) and
    jit(sample) of ExactlyKBernoulli with the distribution's current kernels module."""
    value = jnp.zeros(logits.shape[-1]).at[:k].set(1.0)

    def log_prob(logits):
        return numpyro_module.ExactlyKBernoulli(logits=logits, k=k).log_prob(value)

    def sample(logits, key):
        return numpyro_module.ExactlyKBernoulli(logits=logits, k=k).sample(key)

    row = []
    for function, arguments in ((log_prob, (logits,)), (sample, (logits, jax.random.PRNGKey(0)))):
        jax.clear_caches()
        start = time.perf_counter()
        jax.block_until_ready(jax.jit(function)(*arguments))
        first = time.perf_counter() - start
        jax.clear_caches()
        lowered = jax.jit(function).lower(*arguments)
        start, cpu = time.perf_counter(), time.process_time()
        lowered.compile()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        row += [f"{first:.2f}", f"{seconds:.2f} ({cpu:.2f})"]
    return row


def compile_tables(args, previous_kernels) -> None:
    rng = np.random.default_rng(1)
    previous_jax = previous_kernels.get("jax")
    versions = [("new", jax_kernels)] + ([("previous", previous_jax)] if previous_jax else [])
    print(
        "### JAX compile times (ExactlyKBernoulli, seconds; process CPU seconds in brackets; "
        f"{args.device_name})\n"
    )
    print(
        "| n | k | kernels | jit(log_prob): first call | compile (CPU) "
        "| jit(sample): first call | compile (CPU) |"
    )
    print("|---|---|---|---|---|---|---|")
    saved = numpyro_module.kernels
    try:
        for n in (1000, 10000, 100000):
            logits = jnp.asarray(rng.normal(0.0, 2.0, size=(n,)))
            for k in (n // 2, 10):
                for name, kernels in versions:
                    numpyro_module.kernels = kernels
                    row = [f"{n:.0e}", str(k), name] + _compile_row(logits, k)
                    print("| " + " | ".join(row) + " |", flush=True)
    finally:
        numpyro_module.kernels = saved
    print()
    print("### Compilations of eager JAX marginals over n = 1000, 1100, ..., 1900 (k = n/2)\n")
    print("| kernels | compilations | total seconds |")
    print("|---|---|---|")
    for name, kernels in versions:
        # The jitted function behind `marginals`: itself in the kernels before size buckets.
        jitted = next(
            f
            for f in (getattr(kernels, "_marginals", None), kernels.marginals)
            if hasattr(f, "_cache_size")
        )
        jax.clear_caches()
        start = time.perf_counter()
        for n in range(1000, 2000, 100):
            x = jnp.asarray(rng.normal(0.0, 2.0, size=(1, n)))
            k = jnp.asarray([n // 2])
            jax.block_until_ready(kernels.marginals(x, k, table_size(n, n // 2)))
        seconds = time.perf_counter() - start
        print(f"| {name} | {jitted._cache_size()} | {seconds:.1f} |", flush=True)
    print()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-n", type=float, default=1e7)
    parser.add_argument("--max-n-large-k", type=float, default=1e6, help="n limit for k > 10")
    parser.add_argument("--packages", default="torch,jax")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--previous",
        default=PREVIOUS_REVISION,
        help="git revision of the previous kernels (default: main before the FFT path)",
    )
    parser.add_argument(
        "--previous-limit",
        type=float,
        default=1e9,
        help="largest n k for the previous kernels; 0 skips them (and git)",
    )
    parser.add_argument("--stop-after", type=float, default=20.0)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--only-compile", action="store_true")
    devices.add_device_argument(parser)
    args = parser.parse_args(argv)
    args.packages = devices.use_device(args.device, args.packages.split(","))
    args.device_name = devices.describe(args.device)
    previous_kernels = load_previous_kernels(args.previous) if args.previous_limit > 0 else {}
    if not args.only_compile:
        scaling_tables(args, previous_kernels)
    if not args.no_compile and "jax" in args.packages:
        compile_tables(args, previous_kernels)


if __name__ == "__main__":
    main()
