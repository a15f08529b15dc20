"""Small ExactlyKBernoulli sites against the cheapest comparable calls (issue 30, item 3).

For batch 1, 16 and 128, n = 10, 50 and 200, k = 1, 5 and n / 2, float32, torch (Pyro) and
JAX (NumPyro), two comparisons, each with the distribution built inside the timed call (as
in a model or guide, where the parameters change at every step):

* rsample: ``ExactlyKBernoulli(logits=..., k=k).rsample()`` and the backward pass of a
  weighted sum of the sample, against a straight-through Gumbel-top-k (written below: the k
  largest of ``logits + Gumbel noise`` as the value, ``k softmax(logits + noise)`` as the
  surrogate; an inexact sampler, but the cheapest k-hot one with a gradient);
* log_prob: ``ExactlyKBernoulli(...).log_prob(value).sum()`` and its backward pass, against
  ``Bernoulli(logits=...).log_prob(value).sum(-1).sum()`` and its backward pass.

Torch runs eagerly on one thread; JAX runs jitted functions (``jax.jit`` of the value and
gradient) on one thread, with x64 off (NumPyro's default), and each function's compile time
(its first call less a later one) is reported separately. Each timing is the best of
several repeats of the mean over many calls, the two sides alternating so that both see the
same load; times are the process's CPU time, which on a shared machine with one thread is
what the wall-clock time would be on an idle one. Target: ratio <= 5.

Run from the repository root: ``python -m benchmarks.small_sites`` (``--quick``: fewer
repeats; ``--packages torch`` or ``jax``; ``--count-ops``: instead of timing, the number of
torch operator calls of each side (``aten::`` calls not nested in another, views included),
which is what the torch times follow at these sizes).
"""

import argparse
import os

# One thread for XLA as for torch: the benchmark compares per-call costs, not thread pools.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro.distributions as ndist  # noqa: E402
import pyro.distributions as pdist  # noqa: E402
import torch  # noqa: E402

import numpyro_constrained  # noqa: E402
import pyro_constrained  # noqa: E402

BATCHES, SIZES = (1, 16, 128), (10, 50, 200)
TARGET_RATIO = 5.0


def ks_for(n: int) -> list[int]:
    return sorted({1, 5, n // 2})


def paired_best_times(ours, reference, repeats: int, seconds: float) -> tuple[float, float]:
    """Best over ``repeats`` of the mean seconds per call, both functions alternating; the
    number of calls per repeat is set so that a repeat of ``ours`` takes about ``seconds``."""
    ours()
    reference()
    start = time.process_time()
    ours()
    once = max(time.process_time() - start, 1e-6)
    calls = int(min(max(seconds / once, 3), 200))
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for index, function in enumerate((ours, reference)):
            start = time.process_time()
            for _ in range(calls):
                function()
            best[index] = min(best[index], (time.process_time() - start) / calls)
    return best[0], best[1]


def operator_calls(function) -> int:
    """The number of torch operator calls of one call of ``function`` (after a first one):
    the profiler's ``aten::`` events not nested in another (autograd's backward included)."""
    function()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        function()
    calls = 0
    for event in profile.events():
        parent = event.cpu_parent
        if event.name.startswith("aten::") and not (parent and parent.name.startswith("aten::")):
            calls += 1
    return calls


def torch_gumbel_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Straight-through Gumbel-top-k: the k largest perturbed logits as the value, the
    gradient of ``k softmax(perturbed logits)``."""
    uniform = torch.rand_like(logits).clamp(min=torch.finfo(logits.dtype).tiny)
    perturbed = logits - torch.log(-torch.log(uniform))
    top = perturbed.topk(k, dim=-1).indices
    hard = torch.zeros_like(logits).scatter_(-1, top, 1.0)
    soft = k * torch.softmax(perturbed, dim=-1)
    return hard + (soft - soft.detach())


def jax_gumbel_top_k(key, logits: jax.Array, k: int) -> jax.Array:
    perturbed = logits + jax.random.gumbel(key, logits.shape, logits.dtype)
    _, top = jax.lax.top_k(perturbed, k)
    hard = jnp.zeros_like(logits).at[jnp.arange(logits.shape[0])[:, None], top].set(1.0)
    soft = k * jax.nn.softmax(perturbed, axis=-1)
    return hard + (soft - jax.lax.stop_gradient(soft))


def _k_hot(batch: int, n: int, k: int, rng) -> np.ndarray:
    value = np.zeros((batch, n), np.float32)
    for row in value:
        row[rng.choice(n, k, replace=False)] = 1.0
    return value


def torch_cases(batch: int, n: int, k: int):
    rng = np.random.default_rng(batch * 1000 + n * 10 + k)
    logits = torch.tensor(2.0 * rng.standard_normal((batch, n)), dtype=torch.float32)
    logits.requires_grad_(True)
    weights = torch.tensor(rng.standard_normal((batch, n)), dtype=torch.float32)
    value = torch.tensor(_k_hot(batch, n, k, rng))

    def rsample():
        z = pyro_constrained.ExactlyKBernoulli(logits=logits, k=k).rsample()
        (z * weights).sum().backward()
        logits.grad = None

    def gumbel():
        (torch_gumbel_top_k(logits, k) * weights).sum().backward()
        logits.grad = None

    def log_prob():
        pyro_constrained.ExactlyKBernoulli(logits=logits, k=k).log_prob(value).sum().backward()
        logits.grad = None

    def bernoulli():
        pdist.Bernoulli(logits=logits).log_prob(value).sum(-1).sum().backward()
        logits.grad = None

    return {"rsample": (rsample, gumbel), "log_prob": (log_prob, bernoulli)}


def jax_cases(batch: int, n: int, k: int):
    rng = np.random.default_rng(batch * 1000 + n * 10 + k)
    logits = jnp.asarray(2.0 * rng.standard_normal((batch, n)), dtype=jnp.float32)
    weights = jnp.asarray(rng.standard_normal((batch, n)), dtype=jnp.float32)
    value = jnp.asarray(_k_hot(batch, n, k, rng))
    keys = iter(jax.random.split(jax.random.PRNGKey(n + k), 100000))

    def rsample_loss(logits, key):
        z = numpyro_constrained.ExactlyKBernoulli(logits=logits, k=k).rsample(key)
        return (z * weights).sum()

    def gumbel_loss(logits, key):
        return (jax_gumbel_top_k(key, logits, k) * weights).sum()

    def log_prob_loss(logits):
        return numpyro_constrained.ExactlyKBernoulli(logits=logits, k=k).log_prob(value).sum()

    def bernoulli_loss(logits):
        return ndist.Bernoulli(logits=logits).log_prob(value).sum(-1).sum()

    jitted = {
        name: jax.jit(jax.value_and_grad(loss))
        for name, loss in [
            ("rsample", rsample_loss),
            ("gumbel", gumbel_loss),
            ("log_prob", log_prob_loss),
            ("bernoulli", bernoulli_loss),
        ]
    }
    compile_times = {}

    def call(name):
        if name in ("rsample", "gumbel"):
            return lambda: jax.block_until_ready(jitted[name](logits, next(keys)))
        return lambda: jax.block_until_ready(jitted[name](logits))

    for name in jitted:
        start = time.process_time()
        call(name)()
        first = time.process_time() - start
        start = time.process_time()
        call(name)()
        compile_times[name] = first - (time.process_time() - start)
    cases = {
        "rsample": (call("rsample"), call("gumbel")),
        "log_prob": (call("log_prob"), call("bernoulli")),
    }
    return cases, compile_times


def count_operator_calls(batches, sizes) -> None:
    print("torch operator calls per call (forward and backward, construction included)\n")
    print("| batch | n | k | rsample + backward | Gumbel-top-k | log_prob + backward | Bernoulli |")
    print("|---" * 7 + "|")
    for batch in batches:
        for n in sizes:
            for k in ks_for(n):
                cases = torch_cases(batch, n, k)
                counts = [
                    operator_calls(f) for name in ("rsample", "log_prob") for f in cases[name]
                ]
                print(f"| {batch} | {n} | {k} | " + " | ".join(map(str, counts)) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter repeats")
    parser.add_argument("--packages", nargs="+", default=["torch", "jax"])
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    parser.add_argument(
        "--count-ops", action="store_true", help="torch operator calls instead of times"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.count_ops:
        count_operator_calls(args.batches, args.sizes)
        return
    repeats, seconds = (3, 0.02) if args.quick else (7, 0.05)
    print(f"one thread; CPU time per call, best of {repeats}; target ratio <= {TARGET_RATIO:g}")
    misses = 0
    for package in args.packages:
        print(f"\n### {package}, float32\n")
        header = "| batch | n | k | rsample + backward | Gumbel-top-k | ratio "
        header += "| log_prob + backward | Bernoulli | ratio |"
        if package == "jax":
            header += " compile (rsample, log_prob) |"
        print(header)
        print("|---" * (header.count("|") - 1) + "|")
        for batch in args.batches:
            for n in args.sizes:
                for k in ks_for(n):
                    if package == "torch":
                        cases, compiled = torch_cases(batch, n, k), None
                    else:
                        cases, compiled = jax_cases(batch, n, k)
                    row = f"| {batch} | {n} | {k} "
                    for name in ("rsample", "log_prob"):
                        ours, reference = paired_best_times(*cases[name], repeats, seconds)
                        ratio = ours / reference
                        misses += ratio > TARGET_RATIO
                        mark = "" if ratio <= TARGET_RATIO else " (over)"
                        row += f"| {1e6 * ours:.0f} us | {1e6 * reference:.0f} us "
                        row += f"| {ratio:.1f}x{mark} "
                    if compiled is not None:
                        row += f"| {compiled['rsample']:.2f} s, {compiled['log_prob']:.2f} s "
                    print(row + "|", flush=True)
    print(f"\ncells over the target: {misses}")


if __name__ == "__main__":
    main()
