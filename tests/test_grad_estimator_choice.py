"""The choice of gradient estimator of the discrete distributions (issue 30):
``grad_estimator="marginal_expectation"`` (default, straight-through) and
``"score_function"`` (no reparameterised sampler, so the frameworks' ELBOs apply the score
function), in both packages.

References, written here: the ELBO of a small problem as an exact sum over its support,
listed with itertools (k-subsets, compositions), normalised here (not by the classes'
kernels), differentiated by autograd; the exact posterior of the issue's model by the same
enumeration.

Statistical tolerance of the gradient tests: the estimate is the mean of ``REPEATS``
independent ELBO gradients, each itself an average over ``PARTICLES`` particles, so by the
central limit theorem each coordinate of the mean is within 5 standard errors (the standard
deviation over the repeats / sqrt(REPEATS)) of its expectation except with probability
about 6e-7 (and the test is seeded). The same tolerance rejects the straight-through
estimator's expectation, which is biased on these problems: the test can fail.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as ndist
import pyro
import pyro.distributions as pdist
import pytest
import torch
from numpyro.infer import TraceGraph_ELBO as NumPyroTraceGraph_ELBO
from numpyro.infer import TraceMeanField_ELBO as NumPyroTraceMeanField_ELBO
from pyro.infer import SVI, Trace_ELBO, TraceGraph_ELBO, TraceMeanField_ELBO
from pyro.optim import Adam

import numpyro_constrained as nc
import pyro_constrained as pc
from constrained_ppl.arguments import DISCRETE_GRAD_ESTIMATORS

REPEATS = 20
PARTICLES = 500
SIGMAS = 5.0

# A small selection problem: guide ExactlyKBernoulli(theta, k), prior ExactlyKBernoulli(0, k),
# likelihood Normal(y_i; MU0 + D z_i, 1) per item (not linear in z off {0, 1}).
N, K = 5, 2
THETA = np.array([0.8, -0.3, 0.1, 1.2, -1.0])
Y = np.array([1.9, -0.4, 0.3, 2.2, 0.1])
MU0, D = 0.0, 1.5

# A small count problem: guide ConditionedPoisson(exp(theta), k), prior ConditionedPoisson of
# RATE0, likelihood Normal(y_i; D z_i, 1).
CP_THETA = np.array([0.3, -0.2, 0.5])
CP_RATE0 = np.array([1.0, 2.0, 1.5])
CP_Y = np.array([1.0, 4.0, 0.5])
CP_K = 4


def k_subsets(n, k):
    rows = []
    for ones in itertools.combinations(range(n), k):
        row = np.zeros(n)
        row[list(ones)] = 1.0
        rows.append(row)
    return np.array(rows)


def compositions(n, k):
    return np.array([c for c in itertools.product(range(k + 1), repeat=n) if sum(c) == k], float)


def exact_ekb_elbo_grad():
    """d/dtheta of sum_z q(z) [log p(z) + log p(y | z) - log q(z)] over the 10 two-subsets."""
    support = torch.tensor(k_subsets(N, K))
    theta = torch.tensor(THETA, requires_grad=True)
    log_q = support @ theta - torch.logsumexp(support @ theta, 0)
    log_prior = -torch.log(torch.tensor(float(len(support))))
    y = torch.tensor(Y)
    log_lik = (-0.5 * (y - MU0 - D * support) ** 2 - 0.5 * np.log(2 * np.pi)).sum(-1)
    elbo = (log_q.exp() * (log_prior + log_lik - log_q)).sum()
    (grad,) = torch.autograd.grad(elbo, theta)
    return grad.numpy()


def exact_cp_elbo_grad():
    """The same for the count problem: Multinomial(k, p) pmfs written out here."""
    support = torch.tensor(compositions(len(CP_THETA), CP_K))
    theta = torch.tensor(CP_THETA, requires_grad=True)

    def log_multinomial(log_p):
        log_coef = torch.lgamma(torch.tensor(CP_K + 1.0)) - torch.lgamma(support + 1).sum(-1)
        return log_coef + (support * log_p).sum(-1)

    log_q = log_multinomial(torch.log_softmax(theta, 0))
    log_prior = log_multinomial(torch.log(torch.tensor(CP_RATE0 / CP_RATE0.sum())))
    y = torch.tensor(CP_Y)
    log_lik = (-0.5 * (y - D * support) ** 2 - 0.5 * np.log(2 * np.pi)).sum(-1)
    elbo = (log_q.exp() * (log_prior + log_lik - log_q)).sum()
    (grad,) = torch.autograd.grad(elbo, theta)
    return grad.numpy()


def assert_unbiased(draws, exact):
    draws = np.asarray(draws)
    mean = draws.mean(0)
    stderr = draws.std(0, ddof=1) / np.sqrt(len(draws))
    assert np.all(np.abs(mean - exact) <= SIGMAS * stderr), (mean, exact, stderr)
    return mean, stderr


def assert_biased(draws, exact):
    draws = np.asarray(draws)
    mean = draws.mean(0)
    stderr = draws.std(0, ddof=1) / np.sqrt(len(draws))
    assert np.any(np.abs(mean - exact) > SIGMAS * stderr), (mean, exact, stderr)


# --- Pyro ---------------------------------------------------------------------------------


def _pyro_problem(kind, grad_estimator):
    if kind == "ekb":
        y = torch.tensor(Y)

        def model():
            z = pyro.sample("z", pc.ExactlyKBernoulli(torch.zeros(N, dtype=torch.float64), k=K))
            pyro.sample("y", pdist.Normal(MU0 + D * z, 1.0).to_event(1), obs=y)

        def guide():
            theta = pyro.param("theta", lambda: torch.tensor(THETA))
            pyro.sample("z", pc.ExactlyKBernoulli(theta, k=K, grad_estimator=grad_estimator))

        return model, guide
    y = torch.tensor(CP_Y)

    def model():
        z = pyro.sample("z", pc.ConditionedPoisson(torch.tensor(CP_RATE0), k=CP_K))
        pyro.sample("y", pdist.Normal(D * z, 1.0).to_event(1), obs=y)

    def guide():
        rate = pyro.param("theta", lambda: torch.tensor(CP_THETA)).exp()
        pyro.sample("z", pc.ConditionedPoisson(rate, k=CP_K, grad_estimator=grad_estimator))

    return model, guide


def _pyro_gradients(kind, grad_estimator, elbo_class):
    model, guide = _pyro_problem(kind, grad_estimator)
    elbo = elbo_class(num_particles=PARTICLES, vectorize_particles=True, max_plate_nesting=0)
    pyro.set_rng_seed(0)
    draws = []
    for _ in range(REPEATS):
        pyro.clear_param_store()
        # loss_and_grads differentiates the surrogate loss (score-function terms included)
        # into the parameter's .grad: the gradient of the loss, -ELBO.
        elbo.loss_and_grads(model, guide)
        draws.append(-pyro.param("theta").unconstrained().grad.numpy())
    return draws


@pytest.mark.parametrize("elbo_class", [Trace_ELBO, TraceGraph_ELBO])
@pytest.mark.parametrize("kind", ["ekb", "cp"])
def test_pyro_score_function_gradient_is_unbiased(kind, elbo_class):
    exact = exact_ekb_elbo_grad() if kind == "ekb" else exact_cp_elbo_grad()
    assert_unbiased(_pyro_gradients(kind, "score_function", elbo_class), exact)


@pytest.mark.parametrize("kind", ["ekb", "cp"])
def test_pyro_default_stays_straight_through_and_is_biased_here(kind):
    # The default's expectation differs from the exact gradient by more than the tolerance
    # above: the unbiasedness test can fail.
    exact = exact_ekb_elbo_grad() if kind == "ekb" else exact_cp_elbo_grad()
    assert_biased(_pyro_gradients(kind, "marginal_expectation", Trace_ELBO), exact)


def test_pyro_rsample_gradient_of_the_default_is_the_marginals():
    # Straight-through: d(w . rsample) / dtheta = d(w . mu) / dtheta with mu the marginals
    # (by enumeration here), unchanged by the new argument.
    support = torch.tensor(k_subsets(N, K))
    w = torch.tensor([0.3, -1.0, 2.0, 0.5, 1.1], dtype=torch.float64)
    theta = torch.tensor(THETA, requires_grad=True)
    mu = (torch.softmax(support @ theta, 0)[:, None] * support).sum(0)
    (expected,) = torch.autograd.grad((w * mu).sum(), theta)
    for estimator in ({}, {"grad_estimator": "marginal_expectation"}):
        theta = torch.tensor(THETA, requires_grad=True)
        z = pc.ExactlyKBernoulli(theta, k=K, **estimator).rsample()
        (got,) = torch.autograd.grad((w * z).sum(), theta)
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls", ["ExactlyKBernoulli", "ConditionedPoisson"])
def test_pyro_attributes_per_option(cls):
    def build(**kwargs):
        if cls == "ExactlyKBernoulli":
            return pc.ExactlyKBernoulli(torch.tensor(THETA), k=K, **kwargs)
        return pc.ConditionedPoisson(torch.tensor(CP_RATE0), k=CP_K, **kwargs)

    default = build()
    assert default.grad_estimator == "marginal_expectation" and default.has_rsample
    assert build(grad_estimator="marginal_expectation").has_rsample
    d = build(grad_estimator="score_function")
    assert not d.has_rsample and d.grad_estimator == "score_function"
    assert not d.expand((3,)).has_rsample and d.expand((3,)).grad_estimator == "score_function"
    assert default.expand((3,)).has_rsample
    assert type(d).has_rsample  # the class default is untouched
    with pytest.raises(NotImplementedError, match="score_function"):
        d.rsample()
    z = d.sample((4,))
    assert not z.requires_grad
    assert bool(d.support.check(z).all())
    for bad in ("pathwise", "score-function", None, 1):
        with pytest.raises(ValueError, match="marginal_expectation.*score_function"):
            build(grad_estimator=bad)


# --- NumPyro ------------------------------------------------------------------------------


def _numpyro_problem(kind, grad_estimator):
    if kind == "ekb":
        y = jnp.asarray(Y)

        def model():
            z = numpyro.sample("z", nc.ExactlyKBernoulli(jnp.zeros(N), k=K))
            numpyro.sample("y", ndist.Normal(MU0 + D * z, 1.0).to_event(1), obs=y)

        def guide():
            theta = numpyro.param("theta", jnp.asarray(THETA))
            numpyro.sample("z", nc.ExactlyKBernoulli(theta, k=K, grad_estimator=grad_estimator))

        return model, guide, jnp.asarray(THETA)
    y = jnp.asarray(CP_Y)

    def model():
        z = numpyro.sample("z", nc.ConditionedPoisson(jnp.asarray(CP_RATE0), k=CP_K))
        numpyro.sample("y", ndist.Normal(D * z, 1.0).to_event(1), obs=y)

    def guide():
        rate = jnp.exp(numpyro.param("theta", jnp.asarray(CP_THETA)))
        numpyro.sample("z", nc.ConditionedPoisson(rate, k=CP_K, grad_estimator=grad_estimator))

    return model, guide, jnp.asarray(CP_THETA)


def _numpyro_gradients(kind, grad_estimator):
    model, guide, theta0 = _numpyro_problem(kind, grad_estimator)
    elbo = NumPyroTraceGraph_ELBO(num_particles=PARTICLES)

    @jax.jit
    def gradient(key):
        return jax.grad(lambda theta: -elbo.loss(key, {"theta": theta}, model, guide))(theta0)

    keys = jax.random.split(jax.random.PRNGKey(0), REPEATS)
    return [np.asarray(gradient(key)) for key in keys]


@pytest.mark.parametrize("kind", ["ekb", "cp"])
def test_numpyro_score_function_gradient_is_unbiased(kind):
    exact = exact_ekb_elbo_grad() if kind == "ekb" else exact_cp_elbo_grad()
    assert_unbiased(_numpyro_gradients(kind, "score_function"), exact)
    assert_biased(_numpyro_gradients(kind, "marginal_expectation"), exact)


@pytest.mark.parametrize("cls", ["ExactlyKBernoulli", "ConditionedPoisson"])
def test_numpyro_attributes_per_option(cls):
    def build(**kwargs):
        if cls == "ExactlyKBernoulli":
            return nc.ExactlyKBernoulli(jnp.asarray(THETA), k=K, **kwargs)
        return nc.ConditionedPoisson(jnp.asarray(CP_RATE0), k=CP_K, **kwargs)

    default = build()
    assert default.grad_estimator == "marginal_expectation" and default.has_rsample
    d = build(grad_estimator="score_function")
    assert not d.has_rsample
    assert not d.expand((3,)).has_rsample
    leaves, tree = jax.tree_util.tree_flatten(d)
    assert not jax.tree_util.tree_unflatten(tree, leaves).has_rsample
    assert jax.tree_util.tree_structure(default) != tree  # the option is static (aux data)
    key = jax.random.PRNGKey(1)
    with pytest.raises(NotImplementedError, match="score_function"):
        d.rsample(key)

    def draw(param, grad_estimator):
        if cls == "ExactlyKBernoulli":
            d = nc.ExactlyKBernoulli(param, k=K, grad_estimator=grad_estimator)
        else:
            d = nc.ConditionedPoisson(jnp.exp(param), k=CP_K, grad_estimator=grad_estimator)
        return (d.sample(key) * jnp.arange(1.0, param.shape[-1] + 1)).sum()

    param = jnp.asarray(THETA if cls == "ExactlyKBernoulli" else CP_THETA)
    assert not np.any(jax.grad(draw)(param, "score_function"))
    assert np.any(jax.grad(draw)(param, "marginal_expectation"))
    assert draw(param, "score_function") == draw(param, "marginal_expectation")  # same draw
    for bad in ("pathwise", None):
        with pytest.raises(ValueError, match="marginal_expectation.*score_function"):
            build(grad_estimator=bad)


def test_options_are_shared():
    assert DISCRETE_GRAD_ESTIMATORS == ("marginal_expectation", "score_function")


# --- The remedy: a likelihood linear in z, with the analytic KL ---------------------------


def _linear_log_likelihood_terms(normal, y):
    # log N(y; MU0 + D z, 1) = z lp1 + (1 - z) lp0 on the support (z_i^2 = z_i).
    return normal(MU0 + D, 1.0).log_prob(y), normal(MU0, 1.0).log_prob(y)


def test_pyro_linear_likelihood_with_mean_field_gives_the_exact_gradient_every_sample():
    # The straight-through gradient of a term linear in z is exact for every sample, and
    # TraceMeanField_ELBO takes the KL in closed form: one particle gives the exact ELBO
    # gradient of the Normal-likelihood model (the same model on the support).
    lp1, lp0 = _linear_log_likelihood_terms(pdist.Normal, torch.tensor(Y))

    def model():
        z = pyro.sample("z", pc.ExactlyKBernoulli(torch.zeros(N, dtype=torch.float64), k=K))
        pyro.factor("y", (z * lp1 + (1 - z) * lp0).sum(-1))

    def guide():
        pyro.sample("z", pc.ExactlyKBernoulli(pyro.param("theta", torch.tensor(THETA)), k=K))

    exact = exact_ekb_elbo_grad()
    pyro.set_rng_seed(0)
    for _ in range(5):
        pyro.clear_param_store()
        TraceMeanField_ELBO().loss_and_grads(model, guide)
        got = -pyro.param("theta").unconstrained().grad.numpy()
        np.testing.assert_allclose(got, exact, rtol=1e-9, atol=1e-12)


def test_numpyro_linear_likelihood_with_mean_field_gives_the_exact_gradient_every_sample():
    lp1, lp0 = _linear_log_likelihood_terms(ndist.Normal, jnp.asarray(Y))

    def model():
        z = numpyro.sample("z", nc.ExactlyKBernoulli(jnp.zeros(N), k=K))
        numpyro.factor("y", (z * lp1 + (1 - z) * lp0).sum(-1))

    def guide():
        numpyro.sample("z", nc.ExactlyKBernoulli(numpyro.param("theta", jnp.zeros(N)), k=K))

    elbo = NumPyroTraceMeanField_ELBO()

    @jax.jit
    def gradient(key):
        return jax.grad(lambda t: -elbo.loss(key, {"theta": t}, model, guide))(jnp.asarray(THETA))

    exact = exact_ekb_elbo_grad()
    for key in jax.random.split(jax.random.PRNGKey(0), 5):
        np.testing.assert_allclose(gradient(key), exact, rtol=1e-9, atol=1e-12)


# --- SVI on the model -------------------------------------------------------------

BAGS_K = [1, 2, 3, 2]
BAG_N = 6


def _bags():
    rng = np.random.default_rng(3)
    z = np.zeros((len(BAGS_K), BAG_N))
    for b, k in enumerate(BAGS_K):
        z[b, rng.choice(BAG_N, size=k, replace=False)] = 1.0
    return MU0 + D * z + rng.normal(size=z.shape)


def _posterior_kl(theta, y):
    """Mean over bags of KL(q || exact posterior), both by enumeration over the k-subsets
    (prior uniform on them, likelihood Normal(y; MU0 + D z, 1))."""
    total = 0.0
    for b, k in enumerate(BAGS_K):
        support = k_subsets(BAG_N, k)
        log_q = support @ theta[b]
        log_q = log_q - np.logaddexp.reduce(log_q)
        log_post = (-0.5 * (y[b] - MU0 - D * support) ** 2).sum(-1)
        log_post = log_post - np.logaddexp.reduce(log_post)
        total += (np.exp(log_q) * (log_q - log_post)).sum()
    return total / len(BAGS_K)


def _pyro_svi(grad_estimator, steps):
    y = torch.tensor(_bags())
    ks = torch.tensor(BAGS_K)

    def model():
        with pyro.plate("bags", len(BAGS_K)):
            z = pyro.sample("z", pc.ExactlyKBernoulli(torch.zeros(len(BAGS_K), BAG_N), k=ks))
            pyro.sample("y", pdist.Normal(MU0 + D * z, 1.0).to_event(1), obs=y)

    def guide():
        theta = pyro.param("theta", torch.zeros(len(BAGS_K), BAG_N, dtype=torch.float64))
        with pyro.plate("bags", len(BAGS_K)):
            dist = pc.ExactlyKBernoulli(theta, k=ks, grad_estimator=grad_estimator)
            pyro.sample("z", dist, infer={"baseline": {"use_decaying_avg_baseline": True}})

    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    elbo = TraceGraph_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(model, guide, Adam({"lr": 0.1}), elbo)
    for _ in range(steps):
        svi.step()
    return _posterior_kl(pyro.param("theta").detach().numpy(), y.numpy())


def test_pyro_svi_score_function_reaches_the_exact_posterior():
    # The guide family contains the exact posterior (logits = the log-likelihood ratios).
    # Straight-through SVI stops at a biased fixed point: measured over seeds 0-2, its KL
    # stays between 0.09 and 0.22 nats per bag from step 50 to 400. The score-function run
    # (TraceGraph_ELBO, Pyro's decaying-average baseline) is at 0.004-0.009 after 100 steps
    # and 0.0005 after 400. Here: 0.103 after 100 straight-through steps and 0.005 after 150
    # score-function steps. The threshold, 0.03 and a third of the straight-through run's
    # final KL, leaves a factor of 3 or more for Monte-Carlo noise on either side.
    straight_through = _pyro_svi("marginal_expectation", steps=100)
    score_function = _pyro_svi("score_function", steps=150)
    assert score_function < min(0.03, straight_through / 3), (score_function, straight_through)
