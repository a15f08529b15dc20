"""LinearConstrainedNormal as a latent site: AutoGuides (Pyro and NumPyro) and NUTS recover
the analytic posterior of a conjugate model, through the registered bijection.

Model: z ~ LinearConstrainedNormal(loc, diag(scale^2), A, k), y_j ~ N(z, noise^2 I) for three
observations. The posterior is the Gaussian posterior of the unconstrained prior conditioned
on A z = k (``oracle.conjugate_posterior_mean``). Gaussian guides (AutoNormal,
AutoMultivariateNormal) have the exact posterior mean at their optimum, AutoDelta the
posterior mode, which for a Gaussian is the mean; so every method must land within 0.05.
"""

import jax
import numpy as np
import numpyro
import numpyro.distributions as ndist
import pyro
import pyro.distributions as pdist
import pytest
import torch
from numpyro.infer import MCMC as NumPyroMCMC
from numpyro.infer import NUTS as NumPyroNUTS
from numpyro.infer import SVI as NumPyroSVI
from numpyro.infer import Trace_ELBO as NumPyroTraceELBO
from numpyro.infer import autoguide as numpyro_autoguide
from pyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from pyro.infer import autoguide as pyro_autoguide

import numpyro_constrained
import pyro_constrained
from tests.oracles import linear_gaussian as oracle

A = np.array([[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 0.0, 2.0]])
K = np.array([1.0, 0.5])
LOC = np.array([0.5, -0.2, 0.1, 0.3])
SCALE = np.array([1.0, 0.7, 1.3, 0.9])
NOISE = 0.5
Y = np.random.default_rng(0).normal(size=(3, 4))
POSTERIOR_MEAN = oracle.conjugate_posterior_mean(LOC, np.diag(SCALE**2), A, K, NOISE, Y)
GUIDES = ["AutoNormal", "AutoDelta", "AutoMultivariateNormal"]


def _assert_on_subspace(samples):
    assert np.abs(np.asarray(samples) @ A.T - K).max() < 1e-6


def pyro_model(y):
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    prior = pyro_constrained.LinearConstrainedNormal(t(LOC), t(SCALE), A=t(A), k=t(K))
    z = pyro.sample("z", prior)
    with pyro.plate("observations", y.shape[0]):
        pyro.sample("y", pdist.Normal(z, NOISE).to_event(1), obs=y)


def numpyro_model(y):
    prior = numpyro_constrained.LinearConstrainedNormal(LOC, SCALE, A=A, k=K)
    z = numpyro.sample("z", prior)
    with numpyro.plate("observations", y.shape[0]):
        numpyro.sample("y", ndist.Normal(z, NOISE).to_event(1), obs=y)


@pytest.mark.parametrize("guide_name", GUIDES)
def test_pyro_autoguides_recover_the_posterior_mean(guide_name):
    y = torch.tensor(Y)
    guide = getattr(pyro_autoguide, guide_name)(pyro_model)
    particles = 1 if guide_name == "AutoDelta" else 8
    # The decaying learning rate lets Adam settle instead of jittering by about lr around
    # the optimum.
    svi = SVI(
        pyro_model,
        guide,
        pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.993}),
        Trace_ELBO(num_particles=particles, vectorize_particles=True),
    )
    for _ in range(700):
        svi.step(y)
    estimate = guide.median(y)["z"].detach().numpy()
    assert np.abs(estimate - POSTERIOR_MEAN).max() < 0.05
    _assert_on_subspace(estimate)
    with torch.no_grad():
        _assert_on_subspace(torch.stack([guide(y)["z"] for _ in range(20)]))


@pytest.mark.parametrize("guide_name", GUIDES)
def test_numpyro_autoguides_recover_the_posterior_mean(guide_name):
    guide = getattr(numpyro_autoguide, guide_name)(numpyro_model)
    particles = 1 if guide_name == "AutoDelta" else 8
    svi = NumPyroSVI(
        numpyro_model,
        guide,
        numpyro.optim.Adam(lambda step: 0.05 * 0.993**step),
        NumPyroTraceELBO(num_particles=particles),
    )
    result = svi.run(jax.random.PRNGKey(0), 700, Y, progress_bar=False)
    estimate = guide.median(result.params)["z"]
    assert np.abs(estimate - POSTERIOR_MEAN).max() < 0.05
    _assert_on_subspace(estimate)
    draws = guide.sample_posterior(jax.random.PRNGKey(1), result.params, sample_shape=(20,))
    _assert_on_subspace(draws["z"])


def test_numpyro_nuts_recovers_the_posterior_mean():
    mcmc = NumPyroMCMC(
        NumPyroNUTS(numpyro_model), num_warmup=300, num_samples=500, progress_bar=False
    )
    mcmc.run(jax.random.PRNGKey(1), Y)
    samples = mcmc.get_samples()["z"]
    assert np.abs(samples.mean(0) - POSTERIOR_MEAN).max() < 0.05
    _assert_on_subspace(samples)


def test_pyro_nuts_recovers_the_posterior_mean():
    mcmc = MCMC(NUTS(pyro_model), num_samples=300, warmup_steps=200, disable_progbar=True)
    mcmc.run(torch.tensor(Y))
    samples = mcmc.get_samples()["z"]
    assert np.abs(samples.mean(0).numpy() - POSTERIOR_MEAN).max() < 0.05
    _assert_on_subspace(samples)
