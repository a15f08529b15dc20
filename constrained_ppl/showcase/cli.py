"""The showcase's command line, shared by ``python -m pyro_constrained`` and
``python -m numpyro_constrained``: each passes its own experiments, which are the only
framework code involved."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from collections.abc import Callable, Sequence

from constrained_ppl.showcase.progress import averaged_steps, is_interactive
from constrained_ppl.showcase.report import ShowcaseResult, format_code, format_table

# An experiment fits one model and returns its row: ``experiment(seed=, progress=, steps=)``.
Experiment = Callable[..., ShowcaseResult]


def run_experiments(
    experiments: Sequence[Experiment],
    quick_steps: Sequence[int],
    seed: int = 0,
    quick: bool = False,
    progress: bool = True,
) -> list[ShowcaseResult]:
    """Run each experiment (with its ``quick_steps`` entry as ``steps`` when ``quick``)."""
    results = []
    for experiment, steps in zip(experiments, quick_steps, strict=True):
        kwargs = {"steps": steps} if quick else {}
        result = experiment(seed=seed, progress=progress, **kwargs)
        result.code = experiment
        results.append(result)
    return results


def parse_args(argv: list[str] | None, prog: str, description: str) -> argparse.Namespace:
    """The showcase's options: ``--seed``, ``--quick``, ``--no-progress``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="Progress goes to stderr: a bar per model on a terminal, otherwise (a log "
        "file, a pipe, CI) one line per model. The table goes to stdout and ends with the "
        "file and function of each row's code.",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for data and SVI")
    parser.add_argument("--quick", action="store_true", help="fewer SVI steps (for tests)")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bars or progress lines"
    )
    return parser.parse_args(argv)


def main(
    argv: list[str] | None,
    prog: str,
    description: str,
    run_showcase: Callable[..., list[ShowcaseResult]],
    setup: Callable[[], None] | None = None,
) -> int:
    """Parse ``argv``, run ``run_showcase(seed=, quick=, progress=)``, print the table.

    ``setup`` runs after parsing, so that ``--help`` answers without importing a framework.
    Returns the exit status: 0 when every row passes its checks, 1 otherwise.
    """
    args = parse_args(argv, prog, description)
    if setup is not None:
        setup()
    if not args.no_progress and not is_interactive(sys.stderr):
        print(
            f"{prog}: stderr is not a terminal, so one progress line per model instead of "
            "progress bars (--no-progress hides them)",
            file=sys.stderr,
            flush=True,
        )
    start = time.perf_counter()
    results = run_showcase(seed=args.seed, quick=args.quick, progress=not args.no_progress)
    print()
    print(format_table(results))
    counts = [str(averaged_steps(r.steps)) for r in results]
    averaged = " and ".join([", ".join(counts[:-1]), counts[-1]] if len(counts) > 1 else counts)
    notes = [
        "final loss: SVI's loss, the negative ELBO in nats summed over the data (for "
        "LinearConstrainedNormal, whose guide is empty, the negative log-likelihood), "
        f"averaged over the last tenth of the steps ({averaged} here). One step's loss, the "
        "last value a progress bar shows, is a noisy estimate and differs from it.",
        "violation: the largest distance of the fitted distribution's samples from the "
        "constraint (tol: the most allowed). error vs truth: the fitted model against the "
        "truth that generated the data (max: the most allowed).",
    ]
    print()
    for note in notes:
        print(textwrap.fill(note, width=100, subsequent_indent="  "))
    code = format_code(results)
    if code:
        print("\n" + code)
    passed = all(r.passed for r in results)
    print(
        f"\ntotal {time.perf_counter() - start:.1f} s; "
        + ("all checks passed" if passed else "SOME CHECKS FAILED")
    )
    return 0 if passed else 1
