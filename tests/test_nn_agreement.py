"""The torch head and the JAX functions agree for identical weights and inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import numpyro_constrained
import pyro_constrained
from numpyro_constrained.nn import calibrate_head, head_distribution, head_loss, init_head
from pyro_constrained.nn import LinearConstrainedNormalHead

IN_FEATURES, N, A_ROWS, BATCH = 4, 5, 2, 3
LOSSES = ("mse+nll", "loc_mse+nll", "nll", "mse", "expected_l2", "expected_l1")


def _jax_params_from(head: LinearConstrainedNormalHead) -> dict:
    def linear(layer):
        return {
            "weight": jnp.asarray(layer.weight.detach().numpy()),
            "bias": jnp.asarray(layer.bias.detach().numpy()),
        }

    params = {"mean": linear(head.mean_layer)}
    if head.scale_kind == "per_example":
        params["scale_hidden"] = linear(head.scale_net[0])
        params["scale_out"] = linear(head.scale_net[2])
    else:
        params["raw_scale"] = jnp.asarray(head.raw_scale.detach().numpy())
    return params


@pytest.mark.parametrize(
    "scale, prediction",
    [("per_example", "projection"), ("per_output", "projection"), ("per_output", "conditional")],
)
def test_torch_and_jax_heads_agree(scale, prediction):
    rng = np.random.default_rng(0)
    A = rng.normal(size=(A_ROWS, N))
    features = rng.normal(size=(BATCH, IN_FEATURES))
    k = rng.normal(size=(BATCH, A_ROWS))
    raw = rng.normal(size=(BATCH, N))
    target = raw + np.linalg.lstsq(A, (k - raw @ A.T).T, rcond=None)[0].T
    output_loc = rng.normal(size=N)
    output_scale = rng.uniform(0.5, 2.0, size=N)
    metric = rng.uniform(0.2, 5.0, size=N)

    torch.manual_seed(0)
    head = LinearConstrainedNormalHead(
        IN_FEATURES,
        pyro_constrained.LinearConstraint(torch.tensor(A)),
        scale=scale,
        output_loc=torch.tensor(output_loc),
        output_scale=torch.tensor(output_scale),
        metric=torch.tensor(metric),
        prediction=prediction,
    ).double()
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    _, state = init_head(
        jax.random.PRNGKey(0),
        IN_FEATURES,
        numpyro_constrained.LinearConstraint(jnp.asarray(A)),
        scale=scale,
        output_loc=output_loc,
        output_scale=output_scale,
        metric=metric,
        dtype=jnp.float64,
    )
    params = _jax_params_from(head)

    t = {name: torch.tensor(x) for name, x in (("f", features), ("k", k), ("y", target))}
    j = {name: jnp.asarray(x) for name, x in (("f", features), ("k", k), ("y", target))}
    for name in LOSSES:
        np.testing.assert_allclose(
            float(
                head_loss(params, state, j["f"], j["k"], j["y"], loss=name, prediction=prediction)
            ),
            head.loss(t["f"], t["k"], t["y"], loss=name).item(),
            rtol=1e-10,
            err_msg=name,
        )
    # Three examples: the maximum-likelihood factor (the conformal one needs nine).
    factor = head.calibrate(t["f"], t["k"], t["y"], method="likelihood")
    state = calibrate_head(
        params, state, j["f"], j["k"], j["y"], prediction=prediction, method="likelihood"
    )
    np.testing.assert_allclose(float(state["scale_factor"]), factor, rtol=1e-10)
    torch_dist = head(t["f"], t["k"])
    jax_dist = head_distribution(params, state, j["f"], j["k"], prediction=prediction)
    np.testing.assert_allclose(jax_dist.mean, torch_dist.mean.detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(
        jax_dist.variance, torch_dist.variance.detach().numpy(), rtol=1e-9, atol=1e-14
    )
    np.testing.assert_allclose(
        jax_dist.log_prob(j["y"]), torch_dist.log_prob(t["y"]).detach().numpy(), rtol=1e-10
    )


@pytest.mark.parametrize("coverage", [0.5, 0.75])
def test_torch_and_jax_conformal_factors_agree(coverage):
    """The split-conformal calibration factor of identical heads on identical held-out
    data (a per-example scale, a metric and standardisation), and the resulting variances.
    Three examples, the shapes of the test above (JAX compiles nothing new): the second
    (coverage 0.5) and the largest (0.75) distance."""
    rng = np.random.default_rng(4)
    rows = BATCH
    A = rng.normal(size=(A_ROWS, N))
    features = rng.normal(size=(rows, IN_FEATURES))
    k = rng.normal(size=(rows, A_ROWS))
    raw = rng.normal(size=(rows, N))
    target = raw + np.linalg.lstsq(A, (k - raw @ A.T).T, rcond=None)[0].T
    options = {
        "output_loc": rng.normal(size=N),
        "output_scale": rng.uniform(0.5, 2.0, size=N),
        "metric": rng.uniform(0.2, 5.0, size=N),
    }
    torch.manual_seed(1)
    head = LinearConstrainedNormalHead(
        IN_FEATURES,
        pyro_constrained.LinearConstraint(torch.tensor(A)),
        scale="per_example",
        **{name: torch.tensor(value) for name, value in options.items()},
    ).double()
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    _, state = init_head(
        jax.random.PRNGKey(0),
        IN_FEATURES,
        numpyro_constrained.LinearConstraint(jnp.asarray(A)),
        scale="per_example",
        dtype=jnp.float64,
        **{name: jnp.asarray(value) for name, value in options.items()},
    )
    params = _jax_params_from(head)
    t = [torch.tensor(v) for v in (features, k, target)]
    j = [jnp.asarray(v) for v in (features, k, target)]
    factor = head.calibrate(*t, coverage=coverage)
    state = calibrate_head(params, state, *j, coverage=coverage)
    np.testing.assert_allclose(float(state["scale_factor"]), factor, rtol=1e-10)
    assert factor != pytest.approx(1.0)
    np.testing.assert_allclose(
        head_distribution(params, state, j[0], j[1]).variance,
        head(t[0], t[1]).variance.detach().numpy(),
        rtol=1e-9,
        atol=1e-14,
    )


def test_chi2_quantile_against_scipy():
    """constrained_ppl.conformal.chi2_quantile (the library has no SciPy dependency)."""
    import scipy.stats

    from constrained_ppl.conformal import chi2_quantile

    for probability in (1e-6, 0.05, 0.5, 0.9, 0.999999):
        for dof in (1, 2, 4, 9, 37, 500):
            np.testing.assert_allclose(
                chi2_quantile(probability, dof),
                scipy.stats.chi2.ppf(probability, dof),
                rtol=1e-12,
                err_msg=f"p={probability}, dof={dof}",
            )
