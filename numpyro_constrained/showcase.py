"""The showcase run by ``python -m numpyro_constrained``: one small model per distribution.

The NumPyro mirror of ``pyro_constrained.showcase``: the same NumPy data generators (kept
identical; a test checks that both build the same data), the same models written for
NumPyro, fitted with NumPyro's SVI. Each experiment draws samples from the fitted
distribution and measures

- the constraint violation of those samples: exactly 0 for the discrete distributions,
  a few float roundings for the Gaussian on its affine subspace;
- the error of the recovered quantities against the truth that generated the data.

1. ``ExactlyKBernoulli``: which k of n regression inputs matter (a straight-through guide
   over k-subsets); error: relative L2 error of the recovered coefficients.
2. ``LinearConstrainedNormal``: per-atom partial charges of synthetic molecules that sum to
   the molecule's total charge (charge equilibration makes them exactly such a conditioned
   Gaussian); error: mean absolute deviation of the predicted charges on new molecules.
3. ``ConditionedPoisson``: bags of objects of n types whose total count is known but whose
   per-type counts are not; the guide is the exact posterior family, so SVI maximises the
   marginal likelihood; error: mean relative error of the recovered per-type rates.
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import dataclass

import numpy as np

# Pauling electronegativities (eV-like units) and chemical hardnesses of H, C, N, O: only
# their ordering matters for a plausible synthetic charge model.
ELECTRONEGATIVITY = np.array([2.20, 2.55, 3.04, 3.44])
HARDNESS = np.array([6.4, 5.0, 7.2, 6.1])
ELEMENT_FREQUENCY = np.array([0.45, 0.35, 0.1, 0.1])


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


# ---------------------------------------------------------------------------------------
# Data (plain NumPy; pyro_constrained.showcase holds an identical copy)


def make_sparse_regression(
    rng: np.random.Generator, n_data: int, n_features: int, k: int, noise: float
) -> dict:
    """Linear regression data in which only ``k`` of ``n_features`` inputs matter."""
    X = rng.normal(size=(n_data, n_features))
    support = np.sort(rng.choice(n_features, size=k, replace=False))
    coef = np.zeros(n_features)
    coef[support] = rng.choice([-1.0, 1.0], size=k) * rng.uniform(1.0, 2.0, size=k)
    y = X @ coef + noise * rng.normal(size=n_data)
    return {"X": X, "y": y, "coef": coef, "support": support, "noise": noise}


def make_molecules(
    rng: np.random.Generator, n_molecules: int, n_atoms: int, noise: float = 0.05
) -> dict:
    """Synthetic molecules with per-atom partial charges summing to the total charge.

    Each molecule is a random tree of ``n_atoms`` atoms (H, C, N, O). An atom's
    electronegativity is its element's value shifted by its neighbours' (an inductive
    effect) plus noise; charge equilibration then minimises
    ``sum_i chi_i q_i + eta_i q_i^2 / 2`` subject to ``sum_i q_i = Q``, whose solution is
    ``q_i = (lambda - chi_i) / eta_i``. With noise of variance ``noise^2 eta_i`` on
    ``chi_i`` the charges are exactly ``N(-chi_bar / eta, noise^2 / eta)`` conditioned on
    ``sum q = Q``: a LinearConstrainedNormal whose location is linear in the features
    returned here (element one-hot, and element one-hot times neighbour counts).
    """
    n_elements = len(ELECTRONEGATIVITY)
    elements = rng.choice(n_elements, size=(n_molecules, n_atoms), p=ELEMENT_FREQUENCY)
    neighbour_counts = np.zeros((n_molecules, n_atoms, n_elements))
    rows = np.arange(n_molecules)
    for atom in range(1, n_atoms):
        parent = rng.integers(0, atom, size=n_molecules)
        neighbour_counts[rows, atom, elements[rows, parent]] += 1
        neighbour_counts[rows, parent, elements[rows, atom]] += 1
    one_hot = np.eye(n_elements)[elements]
    features = np.concatenate(
        [
            one_hot,
            (one_hot[..., :, None] * neighbour_counts[..., None, :]).reshape(
                n_molecules, n_atoms, -1
            ),
        ],
        axis=-1,
    )
    chi = ELECTRONEGATIVITY[elements]
    chi_bar = chi + 0.15 * (neighbour_counts @ ELECTRONEGATIVITY - neighbour_counts.sum(-1) * chi)
    eta = HARDNESS[elements]
    total = rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0], size=n_molecules)
    loc = -chi_bar / eta
    scale = noise / np.sqrt(eta)
    weights = scale**2
    # Conditioning N(loc, diag(scale^2)) on the sum: shift along the weights.
    mean = loc + weights * ((total - loc.sum(-1)) / weights.sum(-1))[:, None]
    x = loc + scale * rng.normal(size=loc.shape)
    charges = x + weights * ((total - x.sum(-1)) / weights.sum(-1))[:, None]
    return {
        "features": features,
        "elements": elements,
        "total": total,
        "charges": charges,
        "mean_charges": mean,
    }


def make_bags(rng: np.random.Generator, n_bags: int, rate: np.ndarray) -> dict:
    """Bags holding ``exposure[b, j]`` units of type ``j`` and a known total count.

    The per-type counts ``counts[b, j] ~ Poisson(exposure[b, j] rate[j])`` are hidden;
    only ``total[b] = sum_j counts[b, j]`` and the exposures are observed.
    """
    # Shape 1/2: most bags are dominated by one or two types, which is what lets the
    # per-type rates be told apart from totals alone.
    exposure = rng.gamma(0.5, 2.0, size=(n_bags, len(rate)))
    counts = rng.poisson(exposure * rate)
    return {"exposure": exposure, "counts": counts, "total": counts.sum(-1), "rate": rate}


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


# ---------------------------------------------------------------------------------------
# Experiments (NumPyro)


def _svi_loop(svi, steps: int, desc: str, progress: bool, seed: int, *args):
    """Run ``steps`` jitted SVI updates under a progress bar; return (params, final loss)."""
    import jax
    from tqdm.auto import trange

    with warnings.catch_warnings():
        # NumPyro warns about any discrete latent site; these distributions' samples carry
        # the straight-through gradient (``has_rsample``), so Trace_ELBO handles them.
        warnings.filterwarnings("ignore", "Currently, SVI with", UserWarning)
        state = svi.init(jax.random.PRNGKey(seed), *args)
    update = jax.jit(svi.update)
    losses = []
    bar = trange(steps, desc=desc, disable=not progress, leave=True)
    for step in bar:
        state, loss = update(state, *args)
        losses.append(loss)
        if step % 25 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{float(loss):.4g}")
    # The ELBO estimate is noisy: report the mean over the last tenth of the run.
    final_loss = float(np.mean(np.asarray(losses[-max(1, steps // 10) :])))
    return svi.get_params(state), final_loss


def run_exactly_k_bernoulli(seed: int = 0, steps: int = 500, progress: bool = True):
    import jax
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.optim import Adam

    from numpyro_constrained import ExactlyKBernoulli

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    n_features, k = 24, 4
    data = make_sparse_regression(rng, n_data=200, n_features=n_features, k=k, noise=0.5)
    X = jnp.asarray(data["X"], dtype=jnp.float32)
    y = jnp.asarray(data["y"], dtype=jnp.float32)

    def model(X, y):
        # Uniform prior over the k-subsets of inputs; coefficients are point estimates.
        z = numpyro.sample("z", ExactlyKBernoulli(logits=jnp.zeros(n_features), k=k))
        coef = numpyro.param("coef", jnp.zeros(n_features))
        with numpyro.plate("data", len(y)):
            numpyro.sample("y", dist.Normal(X @ (z * coef), data["noise"]), obs=y)

    def guide(X, y):
        logits = numpyro.param("logits", jnp.zeros(n_features))
        numpyro.sample("z", ExactlyKBernoulli(logits=logits, k=k))

    svi = SVI(model, guide, Adam(0.05), Trace_ELBO())
    params, final_loss = _svi_loop(svi, steps, "ExactlyKBernoulli", progress, seed, X, y)

    posterior = ExactlyKBernoulli(logits=params["logits"], k=k)
    samples = posterior.sample(jax.random.PRNGKey(seed + 1), (1000,))
    violation = max(
        float(jnp.abs(samples.sum(-1) - k).max()), float(jnp.abs(samples * (1 - samples)).max())
    )
    coef = np.asarray(posterior.mode * params["coef"])
    error = np.linalg.norm(coef - data["coef"]) / np.linalg.norm(data["coef"])
    return ShowcaseResult(
        "ExactlyKBernoulli",
        f"select {k} of {n_features} regression inputs",
        steps,
        final_loss,
        violation,
        0.0,
        "rel. L2 error of coefficients",
        float(error),
        0.1,
        time.perf_counter() - start,
    )


def run_linear_constrained_normal(seed: int = 0, steps: int = 400, progress: bool = True):
    import jax
    import jax.numpy as jnp
    import numpyro
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.optim import Adam

    from numpyro_constrained import LinearConstrainedNormal

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    n_atoms = 10
    train = make_molecules(rng, n_molecules=300, n_atoms=n_atoms)
    test = make_molecules(rng, n_molecules=200, n_atoms=n_atoms)
    n_features = train["features"].shape[-1]
    n_elements = len(ELECTRONEGATIVITY)

    def arrays(data):
        return (
            jnp.asarray(data["features"], dtype=jnp.float32),
            jnp.asarray(data["elements"]),
            jnp.asarray(data["total"], dtype=jnp.float32),
        )

    def charge_distribution(weights, log_scale, features, elements, total):
        return LinearConstrainedNormal(
            features @ weights, jnp.exp(log_scale[elements]), k=total[..., None]
        )

    def model(features, elements, total, charges=None):
        weights = numpyro.param("weights", jnp.zeros(n_features))
        log_scale = numpyro.param("log_scale", jnp.full((n_elements,), -2.0))
        with numpyro.plate("molecules", len(total)):
            numpyro.sample(
                "charges",
                charge_distribution(weights, log_scale, features, elements, total),
                obs=charges,
            )

    def guide(features, elements, total, charges=None):
        pass  # no latent variables: SVI is maximum likelihood here

    svi = SVI(model, guide, Adam(0.02), Trace_ELBO())
    charges = jnp.asarray(train["charges"], dtype=jnp.float32)
    params, final_loss = _svi_loop(
        svi, steps, "LinearConstrainedNormal", progress, seed, *arrays(train), charges
    )

    features, elements, total = arrays(test)
    predictive = charge_distribution(
        params["weights"], params["log_scale"], features, elements, total
    )
    samples = predictive.sample(jax.random.PRNGKey(seed + 1), (100,))
    violation = float(jnp.abs(samples.sum(-1) - total).max())
    error = np.abs(np.asarray(predictive.mean) - test["mean_charges"]).mean()
    # float32 rounding of a sum of n charges of size ~1
    tol = 8 * n_atoms * float(np.finfo(np.float32).eps)
    return ShowcaseResult(
        "LinearConstrainedNormal",
        f"charges of {n_atoms}-atom molecules, sum = Q",
        steps,
        final_loss,
        violation,
        tol,
        "MAD of charges on new molecules",
        float(error),
        0.01,
        time.perf_counter() - start,
    )


def run_conditioned_poisson(seed: int = 0, steps: int = 500, progress: bool = True):
    import jax
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.optim import Adam

    from numpyro_constrained import ConditionedPoisson

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    true_rate = np.array([1.0, 3.0, 6.0, 12.0])
    data = make_bags(rng, n_bags=500, rate=true_rate)
    exposure = jnp.asarray(data["exposure"], dtype=jnp.float32)
    total = jnp.asarray(data["total"], dtype=jnp.int32)
    n_types = len(true_rate)

    # The model closes over the data rather than taking it as arguments, so that the
    # known totals are concrete constants under ``jit`` (sampling a count needs its bound).
    def model():
        rate = numpyro.param("rate", jnp.ones(n_types), constraint=dist.constraints.positive)
        with numpyro.plate("bags", len(total)):
            counts = numpyro.sample("counts", dist.Poisson(exposure * rate).to_event(1))
            # The total is observed exactly; the guide only proposes counts that match it.
            numpyro.sample("total", dist.Delta(counts.sum(-1)), obs=total.astype(counts.dtype))

    def guide():
        log_rate = numpyro.param("guide_log_rate", jnp.zeros(n_types))
        with numpyro.plate("bags", len(total)):
            numpyro.sample("counts", ConditionedPoisson(exposure * jnp.exp(log_rate), k=total))

    svi = SVI(model, guide, Adam(0.1), Trace_ELBO())
    params, final_loss = _svi_loop(svi, steps, "ConditionedPoisson", progress, seed)

    posterior = ConditionedPoisson(exposure * jnp.exp(params["guide_log_rate"]), k=total)
    samples = posterior.sample(jax.random.PRNGKey(seed + 1), (100,))
    violation = max(
        float(jnp.abs(samples.sum(-1) - total).max()),
        float(jnp.abs(samples - jnp.round(samples)).max()),
        float(jnp.clip(-samples, 0).max()),
    )
    rate = np.asarray(params["rate"])
    error = np.mean(np.abs(rate - true_rate) / true_rate)
    return ShowcaseResult(
        "ConditionedPoisson",
        f"per-type rates from {len(total)} bag totals",
        steps,
        final_loss,
        violation,
        0.0,
        "mean rel. error of rates",
        float(error),
        0.15,
        time.perf_counter() - start,
    )


EXPERIMENTS = (run_exactly_k_bernoulli, run_linear_constrained_normal, run_conditioned_poisson)
# Fewer optimisation steps for the test suite; every check in the table still passes.
QUICK_STEPS = (300, 250, 250)


def run_showcase(seed: int = 0, quick: bool = False, progress: bool = True) -> list[ShowcaseResult]:
    """Run the three experiments and return one result per distribution."""
    results = []
    for experiment, quick_steps in zip(EXPERIMENTS, QUICK_STEPS, strict=True):
        kwargs = {"steps": quick_steps} if quick else {}
        results.append(experiment(seed=seed, progress=progress, **kwargs))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m numpyro_constrained",
        description="Fit one model per constrained distribution with NumPyro SVI and report.",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for data and SVI")
    parser.add_argument("--quick", action="store_true", help="fewer SVI steps (for tests)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    results = run_showcase(seed=args.seed, quick=args.quick, progress=not args.no_progress)
    print()
    print(format_table(results))
    passed = all(r.passed for r in results)
    print(
        f"\ntotal {time.perf_counter() - start:.1f} s; "
        + ("all checks passed" if passed else "SOME CHECKS FAILED")
    )
    return 0 if passed else 1
