"""The showcase's results: one row per distribution, and the table printed from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ShowcaseResult:
    """One row of the results table."""

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
