"""LinearConstrainedNormalReparam (NumPyro): law of the reparameterised site, and NUTS against
the closed-form posterior when loc or k depends on a latent."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.diagnostics import effective_sample_size
from numpyro.handlers import reparam, seed, trace
from numpyro.infer import MCMC, NUTS, Predictive

from numpyro_constrained import LinearConstrainedNormal, LinearConstrainedNormalReparam
from tests._reparam_oracle import K_CASE, LOC_CASE, MU0, SIGMA, A, S, Y, exact_posterior


def test_reparam_sample_has_lcn_law():
    rng = np.random.default_rng(1)
    loc = rng.normal(size=5)
    tril = np.tril(rng.normal(size=(5, 5))) + 3 * np.eye(5)
    A_ = rng.normal(size=(2, 5))
    k = rng.normal(size=2)
    d = LinearConstrainedNormal(jnp.array(loc), scale_tril=jnp.array(tril), A=A_, k=k)

    def model():
        with numpyro.plate("draws", 40000):
            numpyro.sample("z", d)

    rep = reparam(model, config={"z": LinearConstrainedNormalReparam()})
    tr = trace(seed(rep, 0)).get_trace()
    assert tr["z_decentered"]["value"].shape == (40000, 3)
    z = np.asarray(tr["z"]["value"])
    np.testing.assert_allclose(z @ A_.T, np.broadcast_to(k, (40000, 2)), atol=1e-9)
    # Monte Carlo error of 40000 draws: ~0.5% of the variances; 5 times that
    cov_exact = np.asarray(d.covariance_matrix)
    scale = cov_exact.diagonal().max()
    np.testing.assert_allclose(z.mean(0), np.asarray(d.mean), atol=0.03 * np.sqrt(scale))
    np.testing.assert_allclose(np.cov(z.T), cov_exact, atol=0.03 * scale)


def test_observed_site_untouched():
    d = LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), A=jnp.ones((1, 3)), k=jnp.ones(1))
    value = jnp.array([1.0, 0.0, 0.0])

    def model():
        numpyro.sample("z", d, obs=value)

    tr = trace(seed(reparam(model, config={"z": LinearConstrainedNormalReparam()}), 0)).get_trace()
    assert "z_decentered" not in tr
    assert tr["z"]["is_observed"]
    np.testing.assert_array_equal(tr["z"]["value"], value)


def make_model(v, k0, w):
    def model():
        t = numpyro.sample("t", dist.Normal(0.0, 1.0))
        loc = jnp.asarray(MU0) + t * jnp.asarray(v)
        k = jnp.asarray(k0) + t * jnp.asarray(w)
        z = numpyro.sample("z", LinearConstrainedNormal(loc, jnp.asarray(S), A=jnp.asarray(A), k=k))
        numpyro.sample("y", dist.Normal(z, SIGMA).to_event(1), obs=jnp.asarray(Y))

    return model


def run_nuts(model, seed=0):
    mcmc = MCMC(NUTS(model), num_warmup=300, num_samples=600, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed))
    return mcmc


def draws_of(samples):
    return np.concatenate(
        [np.reshape(samples["t"], (-1, 1)), np.reshape(samples["z"], (-1, 3))], -1
    )


def check_against_exact(draws, case):
    mean, cov = exact_posterior(MU0, case[0], S, A, case[1], case[2], SIGMA, Y)
    ess = effective_sample_size(draws[None])
    se = np.sqrt(np.diag(cov)) / np.sqrt(np.maximum(ess, 1.0))
    err = np.abs(draws.mean(0) - mean)
    assert (err < 5 * se + 1e-8).all(), (err, se, ess)


@pytest.mark.parametrize("case", [LOC_CASE, K_CASE], ids=["loc", "k"])
def test_nuts_with_reparam_matches_exact_posterior(case):
    model = reparam(make_model(*case), config={"z": LinearConstrainedNormalReparam()})
    mcmc = run_nuts(model)
    # MCMC returns the latent sites only: z is recomputed from z_decentered
    samples = Predictive(model, mcmc.get_samples(), return_sites=["t", "z"])(jax.random.PRNGKey(1))
    check_against_exact(draws_of(samples), case)


def test_nuts_without_reparam_loc_case_matches():
    check_against_exact(draws_of(run_nuts(make_model(*LOC_CASE)).get_samples()), LOC_CASE)


def test_nuts_without_reparam_latent_k_matches():
    """NumPyro recomputes biject_to(fn.support) in every potential-energy call, so the chain is
    right; MCMC.get_samples() maps the draws back with the transforms of the initial trace
    unless the support is flagged dynamic, which the subspace support is (through
    numpyro_constrained._compat.DynamicSupport). Before that, z landed on the initial
    subspace."""
    d = draws_of(run_nuts(make_model(*K_CASE)).get_samples())
    residual = d[:, 1:].sum(-1) - K_CASE[2][0] * d[:, 0]  # A z - k(t): on the current subspace
    assert np.abs(residual).max() < 1e-9
    check_against_exact(d, K_CASE)


def test_the_subspace_support_makes_numpyro_replay_the_model():
    from numpyro.infer.util import _get_model_transforms

    _, replay_model, _, _ = _get_model_transforms(seed(make_model(*K_CASE), 0))
    assert replay_model


def test_autodelta_with_reparam_finds_the_exact_posterior_mean_when_k_moves():
    """NumPyro's AutoGuides fix each site's bijection at the first trace (they do not replay
    the model), so a site whose k depends on a latent needs the reparam under SVI: its
    latent coordinates (t, z_decentered) are then jointly Gaussian a posteriori, and
    AutoDelta's optimum, the posterior mode, is the exact posterior mean."""
    from numpyro.infer import SVI, Trace_ELBO
    from numpyro.infer.autoguide import AutoDelta

    model = reparam(make_model(*K_CASE), config={"z": LinearConstrainedNormalReparam()})
    guide = AutoDelta(model)
    svi = SVI(model, guide, numpyro.optim.Adam(lambda step: 0.05 * 0.995**step), Trace_ELBO())
    result = svi.run(jax.random.PRNGKey(0), 1000, progress_bar=False)
    assert np.isfinite(result.losses[-1])
    latent = guide.median(result.params)
    posterior = {name: value[None] for name, value in latent.items()}
    samples = Predictive(model, posterior, return_sites=["t", "z"])(jax.random.PRNGKey(1))
    draw = draws_of(samples)[0]
    mean, _ = exact_posterior(MU0, K_CASE[0], S, A, K_CASE[1], K_CASE[2], SIGMA, Y)
    np.testing.assert_allclose(draw, mean, atol=1e-3)
    assert abs(draw[1:].sum() - K_CASE[2][0] * draw[0]) < 1e-9  # on t's subspace


# A LinearConstrainedNormal site whose subspace moves under an AutoGuide, without the reparam
# (tests/test_compat_numpyro.py runs each AutoGuide kind on it): NumPyro's AutoGuides keep
# the bijection of the initial trace, so before the check every loss was silently inf.


def _svi(model, guide):
    from numpyro.infer import SVI, Trace_ELBO

    return SVI(model, guide, numpyro.optim.Adam(0.01), Trace_ELBO())


def _first_loss(model, guide):
    """The ELBO loss at the guide's initial parameters (eager: no step is compiled)."""
    svi = _svi(model, guide)
    return float(svi.evaluate(svi.init(jax.random.PRNGKey(0))))


def test_autoguide_without_reparam_when_k_moves_raises_naming_the_reparam():
    """The model of the exact AutoDelta test above (k = 3 t), without the reparam: refused
    at SVI.init with the remedy; with it, the same guide kind has a finite loss."""
    from numpyro.infer.autoguide import AutoNormal

    model = make_model(*K_CASE)
    svi = _svi(model, AutoNormal(model))
    with pytest.raises(ValueError, match=r"LinearConstrainedNormalReparam\(\)") as error:
        svi.init(jax.random.PRNGKey(0))
    assert "config={'z': LinearConstrainedNormalReparam()}" in str(error.value)
    fixed = reparam(model, config={"z": LinearConstrainedNormalReparam()})
    assert np.isfinite(_first_loss(fixed, AutoNormal(fixed)))


def test_autoguide_when_k_depends_on_a_parameter_raises_naming_it():
    from numpyro.infer.autoguide import AutoDelta

    def model():
        total = numpyro.param("total", 2.0)
        numpyro.sample("z", LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), k=total))

    with pytest.raises(ValueError, match=r"'z' \(with 'total'\).*LinearConstrainedNormalReparam"):
        _svi(model, AutoDelta(model)).init(jax.random.PRNGKey(0))


@pytest.mark.parametrize("guide_name", ["AutoNormal", "AutoDelta"])
def test_autoguide_on_a_subspace_that_does_not_move_is_not_refused(guide_name):
    """A latent loc alone (LOC_CASE), a k = 0 * t that does not move, and an A that is a
    constant: the loss is finite, as before the check."""
    from numpyro.infer import autoguide

    def model():
        t = numpyro.sample("t", dist.Normal(0.0, 1.0))
        loc = jnp.asarray(MU0) + t * jnp.asarray(LOC_CASE[0])
        k = jnp.asarray(LOC_CASE[1]) + 0.0 * t
        z = numpyro.sample("z", LinearConstrainedNormal(loc, jnp.asarray(S), A=jnp.asarray(A), k=k))
        numpyro.sample("y", dist.Normal(z, SIGMA).to_event(1), obs=jnp.asarray(Y))

    assert np.isfinite(_first_loss(model, getattr(autoguide, guide_name)(model)))


def test_moving_subspaces_names_what_moves_each_site():
    """``A`` depending on one latent, ``k`` on another, a third site fixed: each moving site
    with the inputs that move it, found by differentiation (independently of how the
    distribution stores A and k)."""
    from numpyro_constrained.linear_constrained_normal import moving_subspaces

    def model():
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        row = jnp.array([[1.0, 1.0, 2.0]]) + a * jnp.array([[0.0, 0.0, 0.1]])
        numpyro.sample("by_a", LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), A=row, k=1.0))
        with numpyro.plate("rows", 2):
            numpyro.sample("by_b", LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), k=b + 1.0))
        numpyro.sample("fixed", LinearConstrainedNormal(jnp.full(3, a), jnp.ones(3), k=1.0))

    assert moving_subspaces(model) == {"by_a": ["a"], "by_b": ["b"]}


def test_autoguide_setup_inside_jit_and_scan():
    """The moving-subspace check of an AutoGuide's setup ran the model where every value
    was a tracer (inside jax.jit(svi.init), and in a scan body) and raised
    TracerBoolConversionError for a subspace that does not move; it is evaluated where it
    can be, so a fixed subspace runs and a moving one is still refused under jit."""
    from numpyro.contrib.control_flow import scan
    from numpyro.infer.autoguide import AutoNormal

    def fixed(y):
        z = numpyro.sample("z", LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), k=1.0))
        numpyro.sample("y", dist.Normal(z, 1.0).to_event(1), obs=y)

    def moving(y):
        total = numpyro.sample("total", dist.Normal(3.0, 0.1))
        z = numpyro.sample("z", LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), k=total))
        numpyro.sample("y", dist.Normal(z, 1.0).to_event(1), obs=y)

    def scanned(y):
        def body(carry, k):
            numpyro.sample("z", LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), k=k))
            return carry, None

        scan(body, None, jnp.array([1.0, 2.0]))

    y = jnp.array([0.5, 0.2, 0.1])
    state = jax.jit(_svi(fixed, AutoNormal(fixed)).init)(jax.random.PRNGKey(0), y)
    assert state is not None
    _svi(scanned, AutoNormal(scanned)).init(jax.random.PRNGKey(0), y)
    with pytest.raises(ValueError, match=r"'z' \(with 'total'\).*LinearConstrainedNormalReparam"):
        jax.jit(_svi(moving, AutoNormal(moving)).init)(jax.random.PRNGKey(0), y)


def test_a_masked_site_keeps_its_mask():
    """A .mask() on the site was dropped by the reparameterised site (mask False: the
    rewritten model's log density was the full prior of z_decentered, not 0). A batch of
    two, one masked: the rewritten density is the kept element's N(0, I) prior, as the
    original's is its own; handlers.mask (which wraps the site the same way) too."""
    from numpyro.infer.util import log_density

    mask = jnp.array([True, False])
    base = LinearConstrainedNormal(jnp.zeros((2, 3)), jnp.ones(3), k=1.0)

    def masked_method():
        numpyro.sample("z", base.mask(mask))

    def masked_by_handler():
        with numpyro.handlers.mask(mask=mask):
            numpyro.sample("z", base)

    u = jnp.array([[0.3, -1.2], [2.0, 0.5]])
    expected = float(dist.Normal(0.0, 1.0).log_prob(u[0]).sum())
    config = {"z": LinearConstrainedNormalReparam()}
    for model in (masked_method, masked_by_handler):
        value, _ = log_density(reparam(model, config=config), (), {}, {"z_decentered": u})
        assert float(value) == pytest.approx(expected, rel=1e-12)
