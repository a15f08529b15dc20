"""The showcase run by ``python -m pyro_constrained``: one small model per distribution.

Each experiment builds synthetic data with NumPy from a fixed seed (the generators live in
``constrained_ppl.showcase``, which imports neither torch nor JAX, so that the NumPyro
mirror, ``numpyro_constrained.showcase``, builds the very same data), fits a model with
Pyro's SVI, draws samples from the fitted distribution, and measures

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

import time

import numpy as np

# The framework-free half (data, results table, command line) is shared with the NumPyro
# showcase, so that both fit the very same data.
from constrained_ppl.showcase import (
    ELECTRONEGATIVITY,
    ShowcaseResult,
    make_bags,
    make_molecules,
    make_sparse_regression,
    run_experiments,
)
from constrained_ppl.showcase import main as _shared_main
from constrained_ppl.showcase.progress import StageProgress, final_loss

# ---------------------------------------------------------------------------------------
# Experiments (Pyro)


def _svi_loop(svi, steps: int, desc: str, progress: bool, *args) -> float:
    """Run ``steps`` SVI steps, reporting progress; return the final loss (the mean of the
    last tenth of the steps' losses, as the ELBO estimate of one step is noisy)."""
    losses = []
    stage = StageProgress(steps, desc, enabled=progress)
    for step in stage:
        losses.append(svi.step(*args))
        stage.show_loss(step, losses[-1])
    loss = final_loss(losses)
    stage.finish(loss)
    return loss


def run_exactly_k_bernoulli(seed: int = 0, steps: int = 500, progress: bool = True):
    import pyro
    import pyro.distributions as dist
    import torch
    from pyro.infer import SVI, Trace_ELBO
    from pyro.optim import Adam

    from pyro_constrained import ExactlyKBernoulli

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    n_features, k = 24, 4
    data = make_sparse_regression(rng, n_data=200, n_features=n_features, k=k, noise=0.5)
    X = torch.as_tensor(data["X"], dtype=torch.float32)
    y = torch.as_tensor(data["y"], dtype=torch.float32)
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()

    def model(X, y):
        # Uniform prior over the k-subsets of inputs; coefficients are point estimates.
        z = pyro.sample("z", ExactlyKBernoulli(logits=torch.zeros(n_features), k=k))
        coef = pyro.param("coef", torch.zeros(n_features))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(X @ (z * coef), data["noise"]), obs=y)

    def guide(X, y):
        logits = pyro.param("logits", torch.zeros(n_features))
        pyro.sample("z", ExactlyKBernoulli(logits=logits, k=k))

    svi = SVI(model, guide, Adam({"lr": 0.05}), Trace_ELBO())
    final_loss = _svi_loop(svi, steps, "ExactlyKBernoulli", progress, X, y)

    with torch.no_grad():
        posterior = ExactlyKBernoulli(logits=pyro.param("logits"), k=k)
        samples = posterior.sample((1000,))
        violation = max(
            (samples.sum(-1) - k).abs().max().item(),
            (samples * (1 - samples)).abs().max().item(),
        )
        selected = posterior.mode
        coef = (selected * pyro.param("coef")).numpy()
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
    import pyro
    import torch
    from pyro.infer import SVI, Trace_ELBO
    from pyro.optim import Adam

    from pyro_constrained import LinearConstrainedNormal

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    n_atoms = 10
    train = make_molecules(rng, n_molecules=300, n_atoms=n_atoms)
    test = make_molecules(rng, n_molecules=200, n_atoms=n_atoms)
    n_features = train["features"].shape[-1]
    n_elements = len(ELECTRONEGATIVITY)
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()

    def tensors(data):
        return (
            torch.as_tensor(data["features"], dtype=torch.float32),
            torch.as_tensor(data["elements"]),
            torch.as_tensor(data["total"], dtype=torch.float32),
        )

    def charge_distribution(features, elements, total):
        weights = pyro.param("weights", torch.zeros(n_features))
        log_scale = pyro.param("log_scale", torch.full((n_elements,), -2.0))
        return LinearConstrainedNormal(
            features @ weights, log_scale[elements].exp(), k=total.unsqueeze(-1)
        )

    def model(features, elements, total, charges=None):
        with pyro.plate("molecules", len(total)):
            pyro.sample("charges", charge_distribution(features, elements, total), obs=charges)

    def guide(features, elements, total, charges=None):
        pass  # no latent variables: SVI is maximum likelihood here

    svi = SVI(model, guide, Adam({"lr": 0.02}), Trace_ELBO())
    charges = torch.as_tensor(train["charges"], dtype=torch.float32)
    final_loss = _svi_loop(
        svi, steps, "LinearConstrainedNormal", progress, *tensors(train), charges
    )

    with torch.no_grad():
        features, elements, total = tensors(test)
        predictive = charge_distribution(features, elements, total)
        samples = predictive.sample((100,))
        violation = (samples.sum(-1) - total).abs().max().item()
        error = np.abs(predictive.mean.numpy() - test["mean_charges"]).mean()
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
    import pyro
    import pyro.distributions as dist
    import torch
    from pyro.infer import SVI, Trace_ELBO
    from pyro.optim import Adam

    from pyro_constrained import ConditionedPoisson

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    true_rate = np.array([1.0, 3.0, 6.0, 12.0])
    data = make_bags(rng, n_bags=500, rate=true_rate)
    exposure = torch.as_tensor(data["exposure"], dtype=torch.float32)
    total = torch.as_tensor(data["total"], dtype=torch.float32)
    n_types = len(true_rate)
    pyro.set_rng_seed(seed)
    pyro.clear_param_store()

    def model(exposure, total):
        rate = pyro.param("rate", torch.ones(n_types), constraint=dist.constraints.positive)
        with pyro.plate("bags", len(total)):
            counts = pyro.sample("counts", dist.Poisson(exposure * rate).to_event(1))
            # The total is observed exactly; the guide only proposes counts that match it.
            pyro.sample("total", dist.Delta(counts.sum(-1)), obs=total)

    def guide(exposure, total):
        log_rate = pyro.param("guide_log_rate", torch.zeros(n_types))
        with pyro.plate("bags", len(total)):
            pyro.sample("counts", ConditionedPoisson(exposure * log_rate.exp(), k=total))

    svi = SVI(model, guide, Adam({"lr": 0.1}), Trace_ELBO())
    final_loss = _svi_loop(svi, steps, "ConditionedPoisson", progress, exposure, total)

    with torch.no_grad():
        posterior = ConditionedPoisson(exposure * pyro.param("guide_log_rate").exp(), k=total)
        samples = posterior.sample((100,))
        violation = max(
            (samples.sum(-1) - total).abs().max().item(),
            (samples - samples.round()).abs().max().item(),
            (-samples).clamp(min=0).max().item(),
        )
        rate = pyro.param("rate").numpy()
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
    return run_experiments(EXPERIMENTS, QUICK_STEPS, seed=seed, quick=quick, progress=progress)


def main(argv: list[str] | None = None) -> int:
    """``python -m pyro_constrained``: print the showcase table; 0 if every check passes."""
    return _shared_main(
        argv,
        prog="python -m pyro_constrained",
        description="Fit one model per constrained distribution with Pyro SVI and report.",
        run_showcase=run_showcase,
        setup=_one_torch_thread,
    )


def _one_torch_thread() -> None:
    import torch

    # Small models: one thread avoids oversubscribing small CPUs.
    torch.set_num_threads(1)
