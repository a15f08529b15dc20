"""End-to-end checks of the three Pyro classes inside Pyro's inference machinery.

* ``JitTrace_ELBO``, ``JitTraceMeanField_ELBO`` and ``JitTraceGraph_ELBO`` with hand-written
  guides (a model with the class as prior and a Normal likelihood, a guide of the same class
  with ``pyro.param`` parameters; every guide site reparameterised through ``rsample``) give
  the loss and the gradients of their non-JIT versions (``Trace_ELBO``,
  ``TraceMeanField_ELBO``, ``TraceGraph_ELBO``) for the same random seed. The compiled
  function draws its random numbers with the same torch operations in the same order as
  the eager one, so after the warm-up call (which compiles) the two agree to rounding.
* The same losses, averaged over many vectorised particles, against the closed form
  ``-ELBO = KL(q || p) - E_q[log N(y; z, 1)]`` with
  ``E_q[log N(y; z, 1)] = sum_i (-log(2 pi) / 2 - ((y_i - m_i)^2 + v_i) / 2)`` (``m``, ``v``
  the guide's mean and variance), within ``SIGMAS`` Monte Carlo standard errors.
* A few SVI steps with each JIT ELBO run and reduce ``KL(q || p)`` of a prior-only model.
* ``poutine.trace(...).log_prob_sum()`` under ``pyro.plate`` equals the sum of the
  distribution's own log_prob over the plate.
"""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import (
    SVI,
    JitTrace_ELBO,
    JitTraceGraph_ELBO,
    JitTraceMeanField_ELBO,
    Trace_ELBO,
    TraceGraph_ELBO,
    TraceMeanField_ELBO,
)
from pyro.optim import Adam
from torch.distributions import constraints, kl_divergence

from pyro_constrained import ConditionedPoisson, ExactlyKBernoulli, LinearConstrainedNormal

SIGMAS = 6.0

ELBO_PAIRS = {
    "trace": (Trace_ELBO, JitTrace_ELBO),
    "meanfield": (TraceMeanField_ELBO, JitTraceMeanField_ELBO),
    "graph": (TraceGraph_ELBO, JitTraceGraph_ELBO),
}

# Two bags (a plate of size 2), n = 4; EKB and CP with a different k per bag.
Y = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 2.0, 1.0, 0.0]])
K_COUNTS = torch.tensor([2, 3])
LCN_A = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, -1.0, 0.5]])
LCN_K = torch.tensor([[1.0, 0.0], [2.0, 0.5]])


def _prior(name: str):
    if name == "ekb":
        return ExactlyKBernoulli(torch.tensor([[0.0, 1.0, -1.0, 0.5]]).expand(2, 4), k=K_COUNTS)
    if name == "cp":
        return ConditionedPoisson(torch.tensor([[1.0, 2.0, 0.5, 1.0]]).expand(2, 4), k=K_COUNTS)
    return LinearConstrainedNormal(torch.zeros(2, 4), torch.ones(2, 4), A=LCN_A, k=LCN_K)


def _guide_dist(name: str):
    """The guide's distribution from the param store (creating the params)."""
    if name == "ekb":
        logits = pyro.param(
            "q_logits", torch.tensor([[0.5, -0.5, 1.0, 0.0], [1.0, 0.0, 0.0, -1.0]])
        )
        return ExactlyKBernoulli(logits, k=K_COUNTS)
    if name == "cp":
        rate = pyro.param(
            "q_rate",
            torch.tensor([[1.0, 0.5, 2.0, 1.0], [0.5, 1.0, 1.0, 2.0]]),
            constraint=constraints.positive,
        )
        return ConditionedPoisson(rate, k=K_COUNTS)
    loc = pyro.param("q_loc", torch.tensor([[0.5, -0.5, 1.0, 0.0], [1.0, 0.0, 0.0, -1.0]]))
    scale = pyro.param("q_scale", torch.full((2, 4), 0.7), constraint=constraints.positive)
    estimator = "pathwise" if name == "lcn-pathwise" else "marginal_expectation"
    return LinearConstrainedNormal(loc, scale, A=LCN_A, k=LCN_K, grad_estimator=estimator)


def _model_and_guide(name: str, observed: bool = True):
    def model():
        with pyro.plate("bags", 2, dim=-1):
            z = pyro.sample("z", _prior(name))
            if observed:
                pyro.sample("y", dist.Normal(z, 1.0).to_event(1), obs=Y)

    def guide():
        with pyro.plate("bags", 2, dim=-1):
            pyro.sample("z", _guide_dist(name))

    return model, guide


def _closed_form_loss(name: str, observed: bool = True) -> torch.Tensor:
    """``KL(q || p) - E_q[log N(Y; z, 1)]`` summed over the bags, from the param store."""
    with torch.no_grad():
        q, p = _guide_dist(name), _prior(name)
        loss = kl_divergence(q, p).sum()
        if observed:
            expected_log_lik = -0.5 * math.log(2 * math.pi) - 0.5 * (
                (Y - q.mean).square() + q.variance
            )
            loss = loss - expected_log_lik.sum()
    return loss.double()


def _per_particle_std(name: str, num: int = 4000) -> float:
    """Standard deviation of one particle's Trace_ELBO loss, ``log q(z) - log p(z) -
    log N(Y; z, 1)`` with ``z ~ q`` (an upper bound for the mean-field one, whose KL part
    is exact)."""
    with torch.no_grad():
        q, p = _guide_dist(name), _prior(name)
        z = q.sample((num,))
        log_lik = dist.Normal(z, 1.0).to_event(1).log_prob(Y)
        per_particle = (q.log_prob(z) - p.log_prob(z) - log_lik).sum(-1).double()
    return float(per_particle.std())


# "lcn" is the default straight-through guide (grad_estimator="marginal_expectation"),
# "lcn-pathwise" the exact reparameterisation.
NAMES = ("ekb", "lcn", "lcn-pathwise", "cp")


def _params(names=NAMES, elbos=tuple(ELBO_PAIRS)):
    return [pytest.param(name, elbo, id=f"{name}-{elbo}") for name in names for elbo in elbos]


def _loss_and_grads(elbo, model, guide, seed: int):
    pyro.set_rng_seed(seed)
    store = pyro.get_param_store()
    for _, unconstrained in store.named_parameters():
        unconstrained.grad = None
    loss = elbo.loss_and_grads(model, guide)
    grads = {name: unconstrained.grad.clone() for name, unconstrained in store.named_parameters()}
    return loss, grads


@pytest.mark.parametrize("name,elbo_name", _params(elbos=("trace", "graph")))
def test_jit_elbo_matches_eager(name, elbo_name):
    """Same seed, same loss and gradients, also after the parameters moved. Not for the
    mean-field pair: there Pyro's compiled function draws other random numbers than the
    eager one for the same seed even with a plain ``Normal`` guide
    (``test_jit_meanfield_rng_differs_upstream``), so ``JitTraceMeanField_ELBO`` is
    checked against the closed form instead."""
    eager_cls, jit_cls = ELBO_PAIRS[elbo_name]
    model, guide = _model_and_guide(name)
    eager = eager_cls(num_particles=2, max_plate_nesting=1)
    jit = jit_cls(num_particles=2, max_plate_nesting=1, ignore_jit_warnings=True)
    _loss_and_grads(jit, model, guide, seed=0)  # compiles
    # The second round moves the parameters far from those the graph was traced with, so
    # Python control flow that the trace froze (iteration counts, branches on values)
    # would show as a mismatch.
    for seed, move in ((1, 0.0), (2, 0.0), (3, 1.5)):
        with torch.no_grad():
            for _, unconstrained in pyro.get_param_store().named_parameters():
                noise = torch.randn(
                    unconstrained.shape, generator=torch.Generator().manual_seed(seed)
                )
                unconstrained.add_(move * noise)
        jit_loss, jit_grads = _loss_and_grads(jit, model, guide, seed)
        eager_loss, eager_grads = _loss_and_grads(eager, model, guide, seed)
        assert math.isfinite(jit_loss)
        assert jit_loss == pytest.approx(eager_loss, rel=1e-5, abs=1e-5)
        assert jit_grads.keys() == eager_grads.keys() and jit_grads
        for param_name, grad in jit_grads.items():
            torch.testing.assert_close(grad, eager_grads[param_name], rtol=1e-4, atol=1e-5)


def test_jit_meanfield_rng_differs_upstream():
    """Why the mean-field pair is not compared seed for seed: with Pyro's own ``Normal``
    prior and guide, ``JitTraceMeanField_ELBO`` and ``TraceMeanField_ELBO`` give other
    losses for the same seed (Pyro 1.9). When this starts failing, Pyro draws the same
    numbers, and ``test_jit_elbo_matches_eager`` can take the mean-field pair too."""

    def model():
        with pyro.plate("bags", 2, dim=-1):
            z = pyro.sample("z", dist.Normal(torch.zeros(2, 4), 1.0).to_event(1))
            pyro.sample("y", dist.Normal(z, 1.0).to_event(1), obs=Y)

    def guide():
        loc = pyro.param("loc", torch.ones(2, 4))
        with pyro.plate("bags", 2, dim=-1):
            pyro.sample("z", dist.Normal(loc, 0.5).to_event(1))

    eager = TraceMeanField_ELBO(max_plate_nesting=1)
    jit = JitTraceMeanField_ELBO(max_plate_nesting=1, ignore_jit_warnings=True)
    _loss_and_grads(jit, model, guide, seed=0)
    differ = []
    for seed in (1, 2, 3):
        jit_loss, _ = _loss_and_grads(jit, model, guide, seed)
        eager_loss, _ = _loss_and_grads(eager, model, guide, seed)
        differ.append(abs(jit_loss - eager_loss) > 1e-4)
    assert any(differ)


@pytest.mark.parametrize("name,elbo_name", _params())
def test_jit_elbo_matches_closed_form(name, elbo_name):
    """The JIT loss over many vectorised particles against ``KL - E_q[log lik]``."""
    _, jit_cls = ELBO_PAIRS[elbo_name]
    model, guide = _model_and_guide(name)
    assert _guide_dist(name).has_rsample  # a reparameterised site: no score-function terms
    num_particles = 2000
    jit = jit_cls(
        num_particles=num_particles,
        vectorize_particles=True,
        max_plate_nesting=1,
        ignore_jit_warnings=True,
    )
    pyro.set_rng_seed(0)
    jit.loss_and_grads(model, guide)  # compiles
    pyro.set_rng_seed(1)
    loss = jit.loss_and_grads(model, guide)
    exact = float(_closed_form_loss(name))
    tolerance = SIGMAS * _per_particle_std(name) / math.sqrt(num_particles) + 1e-4
    assert abs(loss - exact) <= tolerance, (loss, exact, tolerance)


@pytest.mark.parametrize("name,elbo_name", _params())
def test_jit_svi_reduces_kl(name, elbo_name):
    """SVI with the JIT ELBO on a prior-only model (the optimum is q = p) runs and brings
    ``KL(q || p)`` down."""
    _, jit_cls = ELBO_PAIRS[elbo_name]
    model, guide = _model_and_guide(name, observed=False)
    svi = SVI(
        model,
        guide,
        Adam({"lr": 0.1}),
        jit_cls(
            num_particles=16,
            vectorize_particles=True,
            max_plate_nesting=1,
            ignore_jit_warnings=True,
        ),
    )
    before = float(_closed_form_loss(name, observed=False))
    losses = [svi.step() for _ in range(10)]
    after = float(_closed_form_loss(name, observed=False))
    assert all(math.isfinite(loss) for loss in losses)
    # Measured with the eager ELBOs over 5 seeds: after / before is 0.09-0.18 for every
    # guide but LCN's straight-through one with a Monte Carlo KL (0.39-0.76: its sample
    # passes a gradient to the mean only, so the scales learn from the entropy term alone).
    biased = name == "lcn" and elbo_name != "meanfield"
    assert after < (0.9 if biased else 0.5) * before, (before, after)


@pytest.mark.parametrize("name", ["ekb", "lcn", "cp"])
def test_trace_log_prob_sum_under_plate(name):
    """``poutine.trace`` of a model with a plate over an expanded prior: the trace's
    log_prob_sum is the sum of the prior's log_prob of the sampled value (and of the
    observed one), and the site carries the plate's batch shape."""
    prior = _prior(name)

    def model(obs=None):
        with pyro.plate("repeats", 3, dim=-2):
            with pyro.plate("bags", 2, dim=-1):
                return pyro.sample("z", prior, obs=obs)

    trace = poutine.trace(model).get_trace()
    z = trace.nodes["z"]["value"]
    assert z.shape == (3, 2, 4)
    manual = prior.log_prob(z).sum()
    torch.testing.assert_close(trace.log_prob_sum(), manual)
    assert torch.isfinite(manual)
    observed = z[0]  # one value per bag, broadcast over the repeats
    trace = poutine.trace(model).get_trace(observed)
    assert trace.nodes["z"]["is_observed"]
    torch.testing.assert_close(trace.log_prob_sum(), 3 * prior.log_prob(observed).sum())
