"""LinearConstrainedNormalReparam (Pyro): law of the reparameterised site, and NUTS against
the closed-form posterior when loc or k depends on a latent."""

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, NUTS, Predictive
from pyro.ops.stats import effective_sample_size

from pyro_constrained import LinearConstrainedNormal, LinearConstrainedNormalReparam
from tests._reparam_oracle import K_CASE, LOC_CASE, MU0, SIGMA, A, S, Y, exact_posterior

F64 = torch.float64


def test_reparam_sample_has_lcn_law():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    loc = torch.randn(5, generator=g, dtype=F64)
    tril = torch.tril(torch.randn(5, 5, generator=g, dtype=F64)) + 3 * torch.eye(5, dtype=F64)
    A_ = torch.randn(2, 5, generator=g, dtype=F64)
    k = torch.randn(2, generator=g, dtype=F64)
    d = LinearConstrainedNormal(loc, scale_tril=tril, A=A_, k=k)

    def model():
        with pyro.plate("draws", 40000):
            pyro.sample("z", d.expand([40000]))

    rep = pyro.poutine.reparam(model, config={"z": LinearConstrainedNormalReparam()})
    tr = pyro.poutine.trace(rep).get_trace()
    assert tr.nodes["z_decentered"]["value"].shape == (40000, 3)
    z = tr.nodes["z"]["value"]
    assert torch.allclose(z @ A_.T, k.expand(40000, 2), atol=1e-9)
    cov = torch.cov(z.T)
    # Monte Carlo error of 40000 draws: ~0.5% of the variances; 5 times that
    scale = d.covariance_matrix.diagonal().max()
    assert torch.allclose(z.mean(0), d.mean, atol=0.03 * scale.sqrt())
    assert torch.allclose(cov, d.covariance_matrix, atol=0.03 * scale)


def test_observed_site_untouched():
    d = LinearConstrainedNormal(torch.zeros(3), torch.ones(3), A=torch.ones(1, 3), k=torch.ones(1))
    value = torch.tensor([1.0, 0.0, 0.0])

    def model():
        pyro.sample("z", d, obs=value)

    tr = pyro.poutine.trace(
        pyro.poutine.reparam(model, config={"z": LinearConstrainedNormalReparam()})
    ).get_trace()
    assert "z_decentered" not in tr.nodes
    assert torch.equal(tr.nodes["z"]["value"], value)


def make_model(v, k0, w):
    def model():
        t = pyro.sample("t", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        loc = torch.tensor(MU0) + t * torch.tensor(v)
        k = torch.tensor(k0) + t * torch.tensor(w)
        z = pyro.sample("z", LinearConstrainedNormal(loc, torch.tensor(S), A=torch.tensor(A), k=k))
        pyro.sample("y", dist.Normal(z, SIGMA).to_event(1), obs=torch.tensor(Y))

    return model


def run_nuts(model, seed=0):
    pyro.set_rng_seed(seed)
    mcmc = MCMC(NUTS(model), warmup_steps=300, num_samples=600, disable_progbar=True)
    mcmc.run()
    s = mcmc.get_samples()
    return torch.cat([s["t"].reshape(-1, 1), s["z"]], -1)


def check_against_exact(draws, case):
    mean, cov = exact_posterior(MU0, case[0], S, A, case[1], case[2], SIGMA, Y)
    ess = effective_sample_size(draws.unsqueeze(0)).numpy()
    se = np.sqrt(np.diag(cov)) / np.sqrt(np.maximum(ess, 1.0))
    err = np.abs(draws.mean(0).numpy() - mean)
    # the coordinate sum(z) = t is exact; its direction has nonzero sd in every coordinate
    assert (err < 5 * se + 1e-8).all(), (err, se, ess)


@pytest.mark.parametrize("case", [LOC_CASE, K_CASE], ids=["loc", "k"])
def test_nuts_with_reparam_matches_exact_posterior(case):
    model = pyro.poutine.reparam(make_model(*case), config={"z": LinearConstrainedNormalReparam()})
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model), warmup_steps=300, num_samples=600, disable_progbar=True)
    mcmc.run()
    # MCMC returns the latent sites only: z is recomputed from z_decentered
    s = Predictive(model, posterior_samples=mcmc.get_samples(), return_sites=["t", "z"])()
    draws = torch.cat([s["t"].reshape(-1, 1), s["z"].reshape(-1, 3)], -1)
    check_against_exact(draws, case)


def test_nuts_without_reparam_loc_case_matches():
    check_against_exact(run_nuts(make_model(*LOC_CASE)), LOC_CASE)


def test_nuts_without_reparam_latent_k_raises_naming_the_reparam():
    # HMC freezes biject_to(support) at the first trace; before the fix the frozen transform
    # kept z on the initial subspace, every move of t scored -inf and the chain stuck
    # (t's standard deviation ~1e-8): a silent wrong posterior.
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(make_model(*K_CASE)), warmup_steps=20, num_samples=20, disable_progbar=True)
    with pytest.raises(ValueError, match="LinearConstrainedNormalReparam"):
        mcmc.run()


@pytest.mark.parametrize("validate", [True, False])
def test_stale_transform_value_raises_naming_the_reparam(validate):
    A_ = torch.ones(1, 3, dtype=F64)
    scale = torch.ones(3, dtype=F64)
    old = LinearConstrainedNormal(
        torch.zeros(3, dtype=F64), scale, A=A_, k=torch.ones(1, dtype=F64)
    )
    transform = torch.distributions.biject_to(old.support)
    # As under inference: the unconstrained coordinates and the k that moved (a function of
    # another latent) are differentiated.
    z = transform(torch.tensor([0.3, -0.2], dtype=F64, requires_grad=True))
    with pyro.validation_enabled(validate):
        moved = LinearConstrainedNormal(
            torch.zeros(3, dtype=F64),
            scale,
            A=A_,
            k=torch.full((1,), 2.0, dtype=F64, requires_grad=True),
        )
        with pytest.raises(ValueError, match="LinearConstrainedNormalReparam"):
            moved.log_prob(z)
        # same subspace from new tensors: scored as usual
        same = LinearConstrainedNormal(
            torch.zeros(3, dtype=F64), scale, A=A_.clone(), k=torch.ones(1, dtype=F64)
        )
        assert torch.allclose(same.log_prob(z), old.log_prob(z))
        # a value off the subspace that is not differentiated keeps the usual behaviour
        # (-inf when not validating)
        if not validate:
            assert moved.log_prob(z.detach().clone()) == -float("inf")


# A LinearConstrainedNormal site whose subspace moves under an AutoGuide, without the reparam.
# Pyro's AutoGuides keep the bijection of the prototype trace; log_prob refuses the values
# that then leave the subspace, but under JitTrace_ELBO an AutoDelta's first step (traced
# while the guide and the model still agree) froze that check, and every later loss was
# silently inf. The guide's setup now refuses such a site.

GUIDES = ["AutoNormal", "AutoDelta", "AutoDiagonalNormal", "AutoMultivariateNormal"]


def _step(model, guide, elbo):
    pyro.clear_param_store()
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), elbo)
    return svi.step()


@pytest.mark.parametrize("guide_name", GUIDES)
def test_autoguide_without_reparam_when_k_moves_is_refused_at_setup(guide_name):
    """The refusal comes from the guide's setup (its message names the site and what moves
    it), not from log_prob: if Pyro stops building the bijections in
    ``AutoGuide._setup_prototype``, pyro_constrained._compat.autoguide_being_set_up
    no longer finds the guide and this fails."""
    from pyro.infer import JitTrace_ELBO
    from pyro.infer import autoguide as autoguides

    from pyro_constrained._compat import AUTOGUIDE_SETUP

    model = make_model(*K_CASE)
    guide = getattr(autoguides, guide_name)(model)
    with pytest.raises(ValueError, match="LinearConstrainedNormalReparam") as error:
        _step(model, guide, JitTrace_ELBO())
    assert f"{guide_name}: the support of the LinearConstrainedNormal site(s) 'z' (with 't')" in (
        str(error.value)
    ), (
        f"Pyro {pyro.__version__}'s {guide_name} was not refused at its setup: its AutoGuides "
        f"no longer build their bijections inside a method named {AUTOGUIDE_SETUP!r} (see "
        "pyro_constrained._compat.autoguide_being_set_up): update that name to "
        f"where they now call biject_to. The error was: {error.value}"
    )


def test_autoguide_when_k_depends_on_a_parameter_raises_naming_it():
    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoDelta

    def model():
        total = pyro.param("total", torch.tensor(2.0, dtype=F64))
        pyro.sample("z", LinearConstrainedNormal(torch.zeros(3, dtype=F64), 1.0, k=total))

    with pytest.raises(ValueError, match=r"'z' \(with 'total'\).*LinearConstrainedNormalReparam"):
        _step(model, AutoDelta(model), Trace_ELBO())


@pytest.mark.parametrize("guide_name", ["AutoNormal", "AutoDelta"])
def test_autoguide_on_a_subspace_that_does_not_move_is_not_refused(guide_name):
    """A latent loc alone (LOC_CASE) and a k = 0 * t that does not move: finite losses under
    JitTrace_ELBO, as before the check."""
    from pyro.infer import JitTrace_ELBO
    from pyro.infer import autoguide as autoguides

    mu0, v, s, a, k0, y = map(torch.as_tensor, (MU0, LOC_CASE[0], S, A, LOC_CASE[1], Y))

    def model():
        t = pyro.sample("t", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        z = pyro.sample("z", LinearConstrainedNormal(mu0 + t * v, s, A=a, k=k0 + 0.0 * t))
        pyro.sample("y", dist.Normal(z, SIGMA).to_event(1), obs=y)

    pyro.clear_param_store()
    guide = getattr(autoguides, guide_name)(model)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), JitTrace_ELBO())
    assert np.isfinite([svi.step() for _ in range(3)]).all()


def test_moving_subspaces_names_what_moves_each_site():
    """``A`` depending on one latent, ``k`` on another, a third site fixed (its loc moves):
    each moving site with the latents that move it, found by differentiation."""
    from pyro_constrained.affine_subspace import moving_subspaces

    def model():
        a = pyro.sample("a", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        b = pyro.sample("b", dist.Normal(torch.tensor(0.0, dtype=F64), 1.0))
        row = torch.tensor([[1.0, 1.0, 2.0]], dtype=F64) + a * torch.tensor([[0.0, 0.0, 0.1]])
        zeros, ones = torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64)
        pyro.sample("by_a", LinearConstrainedNormal(zeros, ones, A=row, k=1.0))
        with pyro.plate("rows", 2):
            pyro.sample("by_b", LinearConstrainedNormal(zeros, ones, k=(b + 1.0).expand(2, 1)))
        pyro.sample("fixed", LinearConstrainedNormal(zeros + a, ones, k=1.0))

    assert moving_subspaces(model) == {"by_a": ["a"], "by_b": ["b"]}


def test_autodelta_with_reparam_finds_the_exact_posterior_mean_when_k_moves():
    """The remedy the errors above name, on their model: with the reparam the latent
    coordinates (t, z_decentered) are jointly Gaussian a posteriori, so AutoDelta's optimum,
    the posterior mode, is the exact posterior mean (L-BFGS on the deterministic loss)."""
    from pyro import poutine
    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoDelta

    pyro.clear_param_store()
    model = poutine.reparam(make_model(*K_CASE), config={"z": LinearConstrainedNormalReparam()})
    guide = AutoDelta(model)
    loss_fn = Trace_ELBO().differentiable_loss
    loss_fn(model, guide)  # sets the guide up
    params = [p.unconstrained() for p in pyro.get_param_store().values()]
    optimizer = torch.optim.LBFGS(
        params,
        max_iter=500,
        tolerance_grad=1e-12,
        tolerance_change=0.0,
        line_search_fn="strong_wolfe",
    )

    def closure():
        optimizer.zero_grad()
        loss = loss_fn(model, guide)
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        draw = Predictive(model, guide=guide, num_samples=1, return_sites=["t", "z"])()
    t, z = draw["t"].reshape(1), draw["z"].reshape(3)
    mean, _ = exact_posterior(MU0, K_CASE[0], S, A, K_CASE[1], K_CASE[2], SIGMA, Y)
    np.testing.assert_allclose(torch.cat([t, z]).numpy(), mean, atol=1e-6)
    assert abs(float(z.sum() - K_CASE[2][0] * t)) < 1e-9  # on t's subspace


def test_a_masked_site_keeps_its_mask():
    """A .mask() on the site was dropped by the reparameterised site (mask False: the
    rewritten model's log density was the full prior of z_decentered, not 0). A batch of
    two, one masked: the rewritten density is the kept element's N(0, I) prior."""
    mask = torch.tensor([True, False])
    base = LinearConstrainedNormal(torch.zeros(2, 3), torch.ones(3), k=1.0)

    def model():
        pyro.sample("z", base.mask(mask))

    u = torch.tensor([[0.3, -1.2], [2.0, 0.5]])
    rewritten = pyro.poutine.reparam(model, config={"z": LinearConstrainedNormalReparam()})
    conditioned = pyro.poutine.condition(rewritten, data={"z_decentered": u})
    trace = pyro.poutine.trace(conditioned).get_trace()
    expected = dist.Normal(0.0, 1.0).log_prob(u[0]).sum()
    torch.testing.assert_close(trace.log_prob_sum(), expected)
