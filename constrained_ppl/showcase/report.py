"""The showcase's results: one row per distribution, and the table printed from them."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ShowcaseResult:
    """One row of the results table; ``code`` is the function that produced it (set by
    ``run_experiments``), whose file and name the job prints under the table."""

    distribution: str
    model: str
    steps: int
    final_loss: float
    violation: float
    violation_tol: float
    error_name: str
    error: float
    error_max: float
    wall_s: float
    code: Callable | None = None

    @property
    def passed(self) -> bool:
        return self.violation <= self.violation_tol and self.error <= self.error_max


def format_table(results: list[ShowcaseResult]) -> str:
    """The results as a text table with ``|``-separated columns, one row per distribution."""
    columns = [
        ("distribution", 23, "<"),
        ("model fitted with SVI", 37, "<"),
        ("steps", 5, ">"),
        ("final loss", 10, ">"),
        ("violation", 9, ">"),
        ("tol", 7, ">"),
        ("error vs truth", 31, "<"),
        ("error", 7, ">"),
        ("max", 5, ">"),
        ("time s", 6, ">"),
        ("ok", 3, "<"),
    ]

    def row(cells):
        return (
            "| "
            + " | ".join(
                f"{cell:{align}{width}}"
                for cell, (_, width, align) in zip(cells, columns, strict=True)
            )
            + " |"
        )

    lines = [row([name for name, _, _ in columns])]
    lines.append("|" + "|".join("-" * (width + 2) for _, width, _ in columns) + "|")
    for r in results:
        cells = [
            r.distribution,
            r.model,
            str(r.steps),
            f"{r.final_loss:.4g}",
            f"{r.violation:.3g}",
            f"{r.violation_tol:.1g}",
            r.error_name,
            f"{r.error:.4f}",
            f"{r.error_max:.3g}",
            f"{r.wall_s:.1f}",
            "yes" if r.passed else "NO",
        ]
        lines.append(row(cells))
    return "\n".join(lines)


def _where(function: Callable) -> str:
    """``path:line, name()`` of a function, the path relative to the working directory
    when the file lies under it (a checkout), else absolute (an installed package)."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:  # a callable object: no file to name
        return repr(function)
    path = code.co_filename
    if os.path.isfile(path):
        path = os.path.abspath(path)
        try:
            relative = os.path.relpath(path)
        except ValueError:  # Windows: another drive than the working directory
            relative = os.pardir
        if not relative.startswith(os.pardir):
            path = relative
    return f"{path}:{code.co_firstlineno}, {function.__name__}()"


def format_code(results: list[ShowcaseResult]) -> str:
    """Where each row's code lives (data, model, guide, SVI fit and checks), or ``""`` when
    no row knows its function."""
    rows = [r for r in results if r.code is not None]
    if not rows:
        return ""
    width = max(len(r.distribution) for r in rows)
    lines = ["The code of each row (data, model, guide, SVI fit and checks):"]
    lines += [f"  {r.distribution:<{width}}  {_where(r.code)}" for r in rows]
    return "\n".join(lines)
