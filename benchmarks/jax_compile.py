"""JAX compile time of ``ExactlyKBernoulli``, this tree against a git revision:
``python -m benchmarks.jax_compile [--previous REVISION] [--rounds R]``.

For n in {1e3, 1e4, 1e5} and k in {n/2, 10} (``--sizes``), float64, batch 1: the compile
time of ``jit(log_prob)`` and ``jit(sample)`` of ``numpyro_constrained.ExactlyKBernoulli``
(wall seconds and, in brackets, process CPU seconds: XLA compiles on every core) and the
number of compiled kernels (fusions, custom calls, FFTs and sorts in the optimised HLO:
XLA's CPU backend spends about 10-20 ms of CPU on each).

Both versions of the whole package are measured, this tree and ``numpyro_constrained`` and
``constrained_ppl`` as they were at ``--previous`` (default ``HEAD``, the last commit),
extracted with ``git archive`` into a temporary directory, each in a fresh interpreter
(nothing cached), the two alternating, ``--rounds`` times. The table gives the minimum and
median over the rounds and the ratio of the minima (new / previous: below 1, new compiles
faster). Compile times vary from run to run and with the load on the other cores: compare
within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = ("numpyro_constrained", "constrained_ppl")


def _kernels(hlo_text: str) -> int:
    return len(re.findall(r"= \S+ (?:fusion|custom-call|fft|sort)\(", hlo_text))


def worker(sizes: list[tuple[int, int]]) -> None:
    """Run in a fresh interpreter: one JSON line per (n, k, function)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    from numpyro_constrained import ExactlyKBernoulli

    for n, k in sizes:
        logits = jnp.asarray(np.random.default_rng(1).normal(0.0, 2.0, size=(n,)))
        value = jnp.zeros(n).at[:k].set(1.0)

        def log_prob(logits, k=k, value=value):
            return ExactlyKBernoulli(logits=logits, k=k).log_prob(value)

        def sample(logits, key, k=k):
            return ExactlyKBernoulli(logits=logits, k=k).sample(key)

        for name, function, arguments in (
            ("log_prob", log_prob, (logits,)),
            ("sample", sample, (logits, jax.random.PRNGKey(0))),
        ):
            jax.clear_caches()
            lowered = jax.jit(function).lower(*arguments)
            start, cpu = time.perf_counter(), time.process_time()
            compiled = lowered.compile()
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            kernels = _kernels(compiled.as_text())
            row = {"n": n, "k": k, "function": name, "seconds": seconds, "cpu": cpu}
            print(json.dumps(row | {"kernels": kernels}), flush=True)


def _extract(revision: str, directory: str) -> None:
    archive = os.path.join(directory, "previous.tar")
    try:
        with open(archive, "wb") as out:
            subprocess.run(
                ["git", "-C", str(ROOT), "archive", revision, *_PACKAGES],
                stdout=out,
                check=True,
            )
    except (OSError, subprocess.CalledProcessError) as error:
        message = f"benchmarks: cannot extract {revision!r} with git archive: {error}"
        raise SystemExit(message) from error
    with tarfile.open(archive) as tar:
        tar.extractall(directory, filter="data")


def _measure(root: str, sizes: list[tuple[int, int]]) -> list[dict]:
    """One fresh interpreter whose ``numpyro_constrained`` is the one under ``root``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, str(ROOT)]))
    argument = ",".join(f"{n}:{k}" for n, k in sizes)
    command = [sys.executable, "-m", "benchmarks.jax_compile", "--worker", argument]
    # The worker's module is this file (benchmarks/ is not extracted), its package the
    # version's: PYTHONPATH puts the version first.
    output = subprocess.run(
        command, env=env, cwd=root, check=True, capture_output=True, text=True
    ).stdout
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def _cell(rows: list[dict]) -> str:
    seconds = sorted(row["seconds"] for row in rows)
    cpu = min(row["cpu"] for row in rows)
    kernels = rows[0]["kernels"]
    return f"{seconds[0]:.2f} / {statistics.median(seconds):.2f} s ({cpu:.2f}), {kernels}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--previous", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker([tuple(int(x) for x in pair.split(":")) for pair in args.worker.split(",")])
        return
    sizes = [(n, k) for n in map(int, args.sizes.split(",")) for k in (n // 2, 10)]
    results: dict[str, list[dict]] = {"previous": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="constrained-ppl-previous-") as directory:
        _extract(args.previous, directory)
        for _ in range(args.rounds):
            results["previous"] += _measure(directory, sizes)
            results["new"] += _measure(str(ROOT), sizes)
    print(
        f"### JAX compile of ExactlyKBernoulli: this tree against {args.previous} "
        f"(float64, batch 1, {args.rounds} rounds)\n"
    )
    print("Minimum / median wall seconds (minimum CPU seconds), kernels.\n")
    print("| n | k | function | previous | new | new / previous (minima) |")
    print("|---|---|---|---|---|---|")
    for n, k in sizes:
        for function in ("log_prob", "sample"):
            cells = {
                version: [
                    row for row in rows if (row["n"], row["k"], row["function"]) == (n, k, function)
                ]
                for version, rows in results.items()
            }
            ratio = min(r["seconds"] for r in cells["new"]) / min(
                r["seconds"] for r in cells["previous"]
            )
            print(
                f"| {n:.0e} | {k} | {function} | {_cell(cells['previous'])} "
                f"| {_cell(cells['new'])} | {ratio:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
