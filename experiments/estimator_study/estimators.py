"""The synthetic gradient-estimator study (docs/distributions/gradient_estimators.md; issue 7).

``python -m experiments.estimator_study.estimators --out DIR [--quick]`` writes

- ``DIR/estimators.csv``: ``distribution, loss, n, estimator, bias, variance, error``, each
  metric the mean over the repeats (independent random problems);
- ``DIR/estimators_repeats.csv``: one row per repeat, with ``bias_floor``, the bias an
  unbiased estimator shows from Monte-Carlo noise alone (``metrics.unbiased_bias_floor``),
  and for the Gaussian the three metrics of the ``loc`` part of the gradient alone
  (``bias_loc``, ``variance_loc``, ``error_loc``; empty for the other families);
- ``DIR/estimators.md``: the same as tables, with the noise floor and loc-only metrics;
- ``DIR/estimators.png``: one panel per distribution and loss (at the largest n), and
  ``DIR/estimators_vs_n.png``: bias and error against n.

The full run uses 10,000 samples per metric and 20 repeats (the papers' settings);
``--quick`` uses 5,000 samples, 5 repeats, Gaussian n in (4, 16, 64) and Poisson n in
(4, 16): under a minute on an idle 2-core machine, about two on a busy one.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyro
import torch

from experiments.estimator_study import gradient_estimators, metrics, synthetic

COLUMNS = ("distribution", "loss", "n", "estimator", "bias", "variance", "error")


@dataclass(frozen=True)
class StudyConfig:
    """What to run: sizes per family, samples per metric, repeats, seed."""

    num_samples: int = 10_000
    repeats: int = 20
    bernoulli_sizes: Sequence[tuple[int, int]] = ((10, 5),)
    bernoulli_losses: Sequence[str] = ("l2",)
    gaussian_sizes: Sequence[int] = (4, 8, 16, 32, 64)
    gaussian_constraints: Sequence[str] = ("sum", "general")
    poisson_sizes: Sequence[int] = (4, 8, 16, 32)
    losses: Sequence[str] = ("l1", "l2")
    estimators: Sequence[str] | None = None  # None: every estimator that applies
    seed: int = 0


FULL = StudyConfig()
QUICK = StudyConfig(num_samples=5_000, repeats=5, gaussian_sizes=(4, 16, 64), poisson_sizes=(4, 16))


def problem_makers(
    config: StudyConfig,
) -> Iterable[tuple[str, str, int, Callable[[torch.Generator], synthetic.SyntheticProblem]]]:
    """(distribution, loss, n, make_problem(generator)) for every cell of the study."""
    for n, k in config.bernoulli_sizes:
        for loss in config.bernoulli_losses:
            yield (
                "bernoulli",
                loss,
                n,
                lambda g, n=n, k=k, loss=loss: synthetic.bernoulli_problem(n, k, loss, g),
            )
    for constraint in config.gaussian_constraints:
        label = "gaussian_sum_to_k" if constraint == "sum" else "gaussian_general_A"
        for loss in config.losses:
            for n in config.gaussian_sizes:
                yield (
                    label,
                    loss,
                    n,
                    lambda g, n=n, loss=loss, c=constraint: synthetic.gaussian_problem(
                        n, loss, c, g
                    ),
                )
    for loss in config.losses:
        for n in config.poisson_sizes:
            yield (
                "poisson",
                loss,
                n,
                lambda g, n=n, loss=loss: synthetic.poisson_problem(n, n, loss, g),
            )


LOC_COLUMNS = ("bias_loc", "variance_loc", "error_loc")


def _loc_metrics(problem, estimates, true_gradient) -> dict:
    """Metrics of the Gaussian's ``loc`` gradient alone (the first n coordinates)."""
    if problem.family != "gaussian":
        return dict.fromkeys(LOC_COLUMNS, "")
    loc_metrics = metrics.gradient_metrics(estimates[:, : problem.n], true_gradient[: problem.n])
    return {f"{name}_loc": value for name, value in loc_metrics.items()}


def run_study(config: StudyConfig, log: Callable[[str], None] = print) -> list[dict]:
    """Per-repeat metrics: a list of dicts with the CSV columns plus ``repeat`` and
    ``bias_floor`` (and the ``*_loc`` metrics for the Gaussian). Deterministic given
    ``config.seed``."""
    rows = []
    for cell, (distribution, loss, n, make_problem) in enumerate(problem_makers(config)):
        started = time.perf_counter()
        for repeat in range(config.repeats):
            generator = torch.Generator().manual_seed(
                config.seed * 1_000_003 + cell * 1_009 + repeat
            )
            problem = make_problem(generator)
            true_gradient = problem.true_gradient()
            names = gradient_estimators.estimators_for(problem.family)
            if config.estimators is not None:
                names = [name for name in names if name in config.estimators]
            for index, name in enumerate(names):
                pyro.set_rng_seed(config.seed + 7919 * (cell * config.repeats + repeat) + index)
                estimates = gradient_estimators.ESTIMATORS[name](problem, config.num_samples)
                rows.append(
                    {
                        "distribution": distribution,
                        "loss": loss,
                        "n": n,
                        "estimator": name,
                        "repeat": repeat,
                        **metrics.gradient_metrics(estimates, true_gradient),
                        "bias_floor": metrics.unbiased_bias_floor(estimates, true_gradient),
                        **_loc_metrics(problem, estimates, true_gradient),
                    }
                )
        log(f"{distribution:>20} {loss} n={n:<3} {time.perf_counter() - started:6.1f} s")
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Means over repeats of bias, variance and error, one row per (cell, estimator)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[c] for c in COLUMNS[:4]), []).append(row)
    return [
        {
            **dict(zip(COLUMNS[:4], key, strict=True)),
            **{m: sum(r[m] for r in group) / len(group) for m in ("bias", "variance", "error")},
        }
        for key, group in groups.items()
    ]


def write_csv(path: Path, rows: list[dict], columns: Sequence[str]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {c: (f"{row[c]:.6g}" if isinstance(row[c], float) else row[c]) for c in columns}
            )


def plot(summary: list[dict], path: Path) -> None:
    """One panel per (distribution, loss): bias, variance and error of every estimator at
    the largest n in the study, log scale (unbiased estimators sit near 1e-4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, str], list[dict]] = {}
    for row in summary:
        panels.setdefault((row["distribution"], row["loss"]), []).append(row)
    columns = min(3, len(panels))
    rows_of_panels = -(-len(panels) // columns)
    figure, axes = plt.subplots(
        rows_of_panels, columns, figsize=(5.5 * columns, 3.8 * rows_of_panels), squeeze=False
    )
    metric_names = ("bias", "variance", "error")
    for axis, ((distribution, loss), cell_rows) in zip(axes.flat, panels.items(), strict=False):
        largest = max(row["n"] for row in cell_rows)
        shown = [row for row in cell_rows if row["n"] == largest]
        width = 0.8 / len(metric_names)
        for offset, metric in enumerate(metric_names):
            axis.bar(
                [i + (offset - 1) * width for i in range(len(shown))],
                [max(row[metric], 1e-6) for row in shown],
                width,
                label=metric,
            )
        axis.set_yscale("log")
        axis.set_ylim(1e-6, 3)
        axis.set_xticks(range(len(shown)))
        axis.set_xticklabels([row["estimator"] for row in shown], rotation=40, ha="right")
        axis.set_title(f"{distribution}, {loss.upper()} loss, n = {largest}")
        axis.grid(axis="y", alpha=0.3)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, title="cosine distance", loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def plot_against_n(summary: list[dict], path: Path) -> None:
    """Bias (solid) and error (dashed) against n, one panel per (distribution, loss)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, str], list[dict]] = {}
    for row in summary:
        panels.setdefault((row["distribution"], row["loss"]), []).append(row)
    panels = {key: rows for key, rows in panels.items() if len({r["n"] for r in rows}) > 1}
    if not panels:
        return
    columns = min(3, len(panels))
    rows_of_panels = -(-len(panels) // columns)
    figure, axes = plt.subplots(
        rows_of_panels, columns, figsize=(5.5 * columns, 3.8 * rows_of_panels), squeeze=False
    )
    present = {row["estimator"] for row in summary}
    estimator_names = [name for name in gradient_estimators.ESTIMATORS if name in present]
    colours = {name: f"C{i}" for i, name in enumerate(estimator_names)}
    for axis, ((distribution, loss), cell_rows) in zip(axes.flat, panels.items(), strict=False):
        for name in estimator_names:
            points = sorted(
                (r["n"], r["bias"], r["error"]) for r in cell_rows if r["estimator"] == name
            )
            if not points:
                continue
            sizes, biases, errors = zip(*points, strict=True)
            axis.plot(sizes, [max(b, 1e-6) for b in biases], "-o", color=colours[name], label=name)
            axis.plot(sizes, errors, "--", color=colours[name])
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("n")
        axis.set_title(f"{distribution}, {loss.upper()}: bias (solid), error (dashed)")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


HEADLINE_N = 16


def headline_table(summary: list[dict]) -> list[str]:
    """Markdown lines: estimator x (distribution, loss), cells ``bias / variance / error``
    at n = 16 (or the largest n below it that was run; Bernoulli at its only n)."""
    cells: dict[tuple[str, str], int] = {}
    for row in summary:
        key = (row["distribution"], row["loss"])
        best = cells.get(key)
        if best is None or abs(row["n"] - HEADLINE_N) < abs(best - HEADLINE_N):
            cells[key] = row["n"]
    values = {
        (row["estimator"], row["distribution"], row["loss"]): row
        for row in summary
        if cells[(row["distribution"], row["loss"])] == row["n"]
    }
    present = {row["estimator"] for row in summary}
    header = [f"{d} {loss.upper()} (n={n})" for (d, loss), n in cells.items()]
    lines = [
        "### Headline: bias / variance / error (cosine distance, mean over repeats)",
        "",
        "| estimator | " + " | ".join(header) + " |",
        "| --- |" + " :---: |" * len(header),
    ]
    for estimator in (name for name in gradient_estimators.ESTIMATORS if name in present):
        entries = []
        for distribution, loss in cells:
            row = values.get((estimator, distribution, loss))
            entries.append(
                ""
                if row is None
                else f"{row['bias']:.2g} / {row['variance']:.2g} / {row['error']:.2g}"
            )
        lines.append(f"| {estimator} | " + " | ".join(entries) + " |")
    return [*lines, ""]


def markdown_tables(rows: list[dict]) -> str:
    """One table per (distribution, loss, n): means over repeats, with the noise floor of
    the bias and, for the Gaussian, the metrics of the loc gradient alone."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for row in rows:
        cell = groups.setdefault((row["distribution"], row["loss"], row["n"]), {})
        cell.setdefault(row["estimator"], []).append(row)
    lines = headline_table(summarise(rows))
    for (distribution, loss, n), by_estimator in groups.items():
        gaussian = distribution.startswith("gaussian")
        names = ["bias", "bias_floor", "variance", "error"] + (
            list(LOC_COLUMNS) if gaussian else []
        )
        repeats = len(next(iter(by_estimator.values())))
        lines += [
            f"### {distribution}, {loss.upper()} loss, n = {n} ({repeats} repeats)",
            "",
            "| estimator | " + " | ".join(names) + " |",
            "| --- |" + " ---: |" * len(names),
        ]
        for estimator, group in by_estimator.items():
            means = [sum(r[name] for r in group) / len(group) for name in names]
            lines.append(f"| {estimator} | " + " | ".join(f"{m:.3g}" for m in means) + " |")
        lines.append("")
    return "\n".join(lines)


def write_outputs(rows: list[dict], out: Path) -> None:
    """``estimators.csv`` (means over repeats), ``estimators_repeats.csv``, the figures."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(rows)
    write_csv(out / "estimators.csv", summary, COLUMNS)
    write_csv(
        out / "estimators_repeats.csv",
        rows,
        (*COLUMNS[:4], "repeat", *COLUMNS[4:], "bias_floor", *LOC_COLUMNS),
    )
    (out / "estimators.md").write_text(markdown_tables(rows))
    plot(summary, out / "estimators.png")
    plot_against_n(summary, out / "estimators_vs_n.png")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for CSV and PNG")
    parser.add_argument("--quick", action="store_true", help="small run (about a minute)")
    parser.add_argument("--samples", type=int, help="samples per metric (overrides the preset)")
    parser.add_argument("--repeats", type=int, help="random problems per cell (overrides)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny kernels: threads only contend
    config = QUICK if args.quick else FULL
    overrides = {"seed": args.seed}
    if args.samples:
        overrides["num_samples"] = args.samples
    if args.repeats:
        overrides["repeats"] = args.repeats
    config = dataclasses.replace(config, **overrides)
    started = time.perf_counter()
    rows = run_study(config)
    write_outputs(rows, args.out)
    print(f"wrote {args.out}/estimators.csv and .png in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
