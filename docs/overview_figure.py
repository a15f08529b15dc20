"""Draw the overview page's picture: one panel per distribution, computed with the library.

Run by ``docs/conf.py`` at every build (``python docs/overview_figure.py OUTDIR``); writes
``OUTDIR/overview.svg``. Left: the inclusion probabilities of ``ExactlyKBernoulli`` against
the independent Bernoullis' probabilities. Middle: draws of ``LinearConstrainedNormal`` on
the line ``z_1 + z_2 = 1`` among draws of the unconstrained Normal. Right: the probabilities
of ``ConditionedPoisson`` on the compositions of ``k`` into three parts (a triangle).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pyro_constrained import (  # noqa: E402
    ConditionedPoisson,
    ExactlyKBernoulli,
    LinearConstrainedNormal,
)


def make_figure() -> plt.Figure:
    """The three panels, laid out (``tests/test_project.py`` checks that no label is cut)."""
    torch.manual_seed(0)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))

    # ExactlyKBernoulli: conditioning on sum z = k moves every inclusion probability.
    logits = torch.tensor([2.0, 1.2, 0.5, 0.0, -0.6, -1.5, -2.5], dtype=torch.float64)
    k = 2
    d = ExactlyKBernoulli(logits, k=k)
    index = np.arange(len(logits))
    ax = axes[0]
    ax.bar(index - 0.2, torch.sigmoid(logits).numpy(), 0.4, label="Bernoulli(sigmoid(logits))")
    ax.bar(index + 0.2, d.mean.numpy(), 0.4, label=f"ExactlyKBernoulli, k = {k}")
    ax.set_xticks(index, [f"z{i + 1}" for i in index])
    ax.set_ylabel("P(z_i = 1)")
    ax.set_title(f"k-subsets: inclusion probabilities sum to {k}")
    ax.legend(fontsize=7, loc="upper right")

    # LinearConstrainedNormal: every draw lies on the subspace A z = k.
    loc = torch.tensor([0.3, -0.2], dtype=torch.float64)
    scale = torch.tensor([1.0, 0.6], dtype=torch.float64)
    free = torch.distributions.Normal(loc, scale).sample((300,))
    lcn = LinearConstrainedNormal(loc, scale, k=1.0)  # default A = [1, 1]: z1 + z2 = 1
    on_line = lcn.sample((300,))
    ax = axes[1]
    ax.scatter(free[:, 0], free[:, 1], s=4, alpha=0.35, label="Normal(loc, scale)")
    ax.scatter(on_line[:, 0], on_line[:, 1], s=4, label="LinearConstrainedNormal, k = 1")
    ax.plot(*lcn.mean.numpy(), "k+", markersize=12, label="conditional mean")
    ax.set_xlabel("z1")
    ax.set_ylabel("z2")
    ax.set_aspect("equal")
    ax.set_title("linear equalities: z1 + z2 = 1 exactly")
    ax.legend(fontsize=7, loc="lower left")

    # ConditionedPoisson: a multinomial on the compositions of k.
    rate = torch.tensor([1.0, 2.5, 4.0], dtype=torch.float64)
    total = 12
    cp = ConditionedPoisson(rate, k=total)
    support = cp.enumerate_support()
    probs = cp.log_prob(support).exp().numpy()
    counts = support.numpy()
    # Barycentric coordinates of the compositions in an equilateral triangle.
    corners = np.array([[0.0, 0.0], [1.0, 0.0], [0.5, np.sqrt(3) / 2]])
    xy = counts / total @ corners
    ax = axes[2]
    ax.plot(*np.vstack([corners, corners[:1]]).T, color="0.6", linewidth=0.8)
    sc = ax.scatter(xy[:, 0], xy[:, 1], c=probs, s=18, cmap="viridis")
    # Each corner's label just outside the triangle, below the two lower corners and above
    # the top one; the axes' limits leave room for them, so that neither the figure's edge
    # nor the colorbar cuts a label (tight_layout sizes the axes, not annotations).
    for i, name in enumerate(["z1", "z2", "z3"]):
        ax.annotate(
            f"{name} = {total}",
            corners[i],
            xytext=(0, -6 if i < 2 else 6),
            textcoords="offset points",
            ha="center",
            va="top" if i < 2 else "bottom",
            fontsize=8,
        )
    ax.set_xlim(-0.15, 1.15)
    ax.set_ylim(-0.15, corners[2, 1] + 0.12)
    fig.colorbar(sc, ax=ax, label="probability", pad=0.04, shrink=0.8)
    ax.set_aspect("equal")
    ax.set_axis_off()
    ax.set_title(f"fixed totals: counts summing to {total}", pad=10)

    fig.tight_layout()
    return fig


def draw(out_dir: Path) -> Path:
    fig = make_figure()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "overview.svg"
    # svg.hashsalt and no date: the same figure gives the same file at every build.
    with plt.rc_context({"svg.hashsalt": "constrained-ppl"}):
        fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    return path


if __name__ == "__main__":
    draw(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "_generated")
