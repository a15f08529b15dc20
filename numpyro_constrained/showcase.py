"""The showcase run by ``python -m numpyro_constrained``: one small model per distribution.

The NumPyro mirror of ``pyro_constrained.showcase``: the same NumPy data generators (shared
from ``constrained_ppl.showcase``, which imports neither torch nor JAX), the same models
written for NumPyro, fitted with NumPyro's SVI. Each experiment draws samples from the fitted
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

import time
import warnings

import numpy as np

# The framework-free half (data, results table, command line) is shared with the Pyro
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
# Experiments (NumPyro)


def _svi_loop(svi, steps: int, desc: str, progress: bool, seed: int, *args):
    """Run ``steps`` jitted SVI updates under a progress bar; return (params, final loss).

    ``svi.init`` is jitted too: run eagerly, every operation of the model and the guide
    would compile on its own, which costs more than compiling them all at once."""
    import jax

    with warnings.catch_warnings():
        # NumPyro warns about any discrete latent site; these distributions' samples carry
        # the straight-through gradient (``has_rsample``), so Trace_ELBO handles them.
        warnings.filterwarnings("ignore", "Currently, SVI with", UserWarning)
        state = jax.jit(svi.init)(jax.random.PRNGKey(seed), *args)
    update = jax.jit(svi.update)
    losses = []
    stage = StageProgress(steps, desc, enabled=progress)
    for step in stage:
        state, loss = update(state, *args)
        losses.append(loss)
        stage.show_loss(step, loss)
    # The ELBO estimate of one step is noisy: the mean of the last tenth of the steps.
    loss = final_loss(losses)
    stage.finish(loss)
    return svi.get_params(state), loss


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

    @jax.jit  # evaluated as one program (compiled once, not operation by operation)
    def evaluate(params, key):
        posterior = ExactlyKBernoulli(logits=params["logits"], k=k)
        samples = posterior.sample(key, (1000,))
        violation = jnp.maximum(
            jnp.abs(samples.sum(-1) - k).max(), jnp.abs(samples * (1 - samples)).max()
        )
        return violation, posterior.mode * params["coef"]

    violation, coef = evaluate(params, jax.random.PRNGKey(seed + 1))
    violation, coef = float(violation), np.asarray(coef)
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

    @jax.jit  # evaluated as one program (compiled once, not operation by operation)
    def evaluate(params, key, features, elements, total):
        predictive = charge_distribution(
            params["weights"], params["log_scale"], features, elements, total
        )
        samples = predictive.sample(key, (100,))
        return jnp.abs(samples.sum(-1) - total).max(), predictive.mean

    violation, mean = evaluate(params, jax.random.PRNGKey(seed + 1), *arrays(test))
    violation = float(violation)
    error = np.abs(np.asarray(mean) - test["mean_charges"]).mean()
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

    @jax.jit  # evaluated as one program (compiled once, not operation by operation)
    def evaluate(log_rate, key):
        posterior = ConditionedPoisson(exposure * jnp.exp(log_rate), k=total)
        samples = posterior.sample(key, (100,))
        return jnp.max(
            jnp.stack(
                [
                    jnp.abs(samples.sum(-1) - total).max(),
                    jnp.abs(samples - jnp.round(samples)).max(),
                    jnp.clip(-samples, 0).max(),
                ]
            )
        )

    violation = float(evaluate(params["guide_log_rate"], jax.random.PRNGKey(seed + 1)))
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
    return run_experiments(EXPERIMENTS, QUICK_STEPS, seed=seed, quick=quick, progress=progress)


def main(argv: list[str] | None = None) -> int:
    """``python -m numpyro_constrained``: print the showcase table; 0 if every check passes."""
    return _shared_main(
        argv,
        prog="python -m numpyro_constrained",
        description="Fit one model per constrained distribution with NumPyro SVI and report.",
        run_showcase=run_showcase,
    )
