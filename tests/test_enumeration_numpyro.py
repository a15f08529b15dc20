"""Enumeration of ExactlyKBernoulli and ConditionedPoisson in NumPyro (issue 16, item 2):
enumerate_support against itertools, ConditionedPoisson.mode against brute force, the
clear error that NumPyro's scalar-coordinate machines (numpyro.contrib.funsor's enum,
DiscreteHMCGibbs, MixedHMC) get, and exact enumeration through a Categorical index:
TraceEnum_ELBO and log_density against the evidence by brute force, infer_discrete
against the exact posterior."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import HMC, MCMC, NUTS, DiscreteHMCGibbs, MixedHMC
from scipy import stats

from numpyro_constrained import ConditionedPoisson, CountConstrainedBernoulli, ExactlyKBernoulli

pytest.importorskip("funsor")
from numpyro.contrib.funsor import config_enumerate, enum, infer_discrete, log_density  # noqa: E402
from numpyro.infer import TraceEnum_ELBO  # noqa: E402

jax.config.update("jax_enable_x64", True)


def k_hot(n, k):
    out = []
    for ones in itertools.combinations(range(n), k):
        z = [0.0] * n
        for i in ones:
            z[i] = 1.0
        out.append(tuple(z))
    return out


def compositions(n, k):
    return [
        tuple(float(x) for x in c) for c in itertools.product(range(k + 1), repeat=n) if sum(c) == k
    ]


def normal(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def uniform(shape, seed=0):
    return jax.random.uniform(jax.random.PRNGKey(seed), shape) + 0.1


CASES = [
    ("ekb", lambda s: ExactlyKBernoulli(normal(s + (5,)), k=2), lambda: k_hot(5, 2)),
    ("ekb0", lambda s: ExactlyKBernoulli(normal(s + (4,)), k=0), lambda: k_hot(4, 0)),
    ("ekbn", lambda s: ExactlyKBernoulli(normal(s + (4,)), k=4), lambda: k_hot(4, 4)),
    ("cp", lambda s: ConditionedPoisson(uniform(s + (3,)), k=4), lambda: compositions(3, 4)),
    ("cp1", lambda s: ConditionedPoisson(uniform(s + (1,)), k=3), lambda: compositions(1, 3)),
]


@pytest.mark.parametrize("batch_shape", [(), (2, 3)])
@pytest.mark.parametrize("name,make,reference", CASES, ids=[c[0] for c in CASES])
def test_enumerate_support(name, make, reference, batch_shape):
    d = make(batch_shape)
    assert d.has_enumerate_support
    ref = reference()
    n = d.event_shape[0]
    values = d.enumerate_support()
    assert values.shape == (len(ref),) + batch_shape + (n,)
    unexpanded = d.enumerate_support(expand=False)
    assert unexpanded.shape == (len(ref),) + (1,) * len(batch_shape) + (n,)
    np.testing.assert_array_equal(jnp.broadcast_to(unexpanded, values.shape), values)
    # NumPyro's convention (Categorical): (count,) + (1,) * len(batch_shape) unexpanded.
    categorical = dist.Categorical(logits=jnp.zeros(batch_shape + (3,)))
    assert categorical.enumerate_support(expand=False).ndim == unexpanded.ndim - 1
    rows = [tuple(r) for r in np.asarray(unexpanded).reshape(len(ref), n).tolist()]
    assert len(set(rows)) == len(rows) and set(rows) == set(ref)
    assert bool(jnp.all(d.support(values)))
    total = jnp.exp(d.log_prob(values)).sum(0)
    np.testing.assert_allclose(total, np.ones(batch_shape), atol=1e-10)
    np.testing.assert_array_equal(make(batch_shape).enumerate_support(), values)


def test_counts_are_binomial_coefficients():
    assert ExactlyKBernoulli(jnp.zeros(12), k=5).enumerate_support().shape[0] == math.comb(12, 5)
    assert ConditionedPoisson(jnp.ones(4), k=6).enumerate_support().shape[0] == math.comb(9, 3)


def test_max_support():
    with pytest.raises(ValueError, match="max_support"):
        ExactlyKBernoulli(jnp.zeros(40), k=20).enumerate_support()
    with pytest.raises(ValueError, match="max_support"):
        ConditionedPoisson(jnp.ones(30), k=30).enumerate_support()

    class Small(ConditionedPoisson):
        max_support = 14

    with pytest.raises(ValueError, match="15 members"):
        Small(jnp.ones(3), k=4).enumerate_support()


def test_k_must_be_one_concrete_value():
    with pytest.raises(ValueError, match="one k"):
        ExactlyKBernoulli(jnp.zeros((2, 4)), k=jnp.array([1, 2])).enumerate_support()
    with pytest.raises(ValueError, match="one k"):
        ConditionedPoisson(jnp.ones((2, 4)), k=jnp.array([1, 2])).enumerate_support()
    assert ConditionedPoisson(jnp.ones((2, 4)), k=jnp.array([2, 2])).enumerate_support().shape == (
        10,
        2,
        4,
    )
    with pytest.raises(ValueError, match="concrete k"):
        jax.jit(lambda k: ExactlyKBernoulli(jnp.zeros(4), k=k, k_max=4).enumerate_support())(2)
    with pytest.raises(ValueError, match="concrete k"):
        jax.jit(lambda k: ConditionedPoisson(jnp.ones(4), k=k, k_max=4).enumerate_support())(2)
    # Traced logits with a concrete k are fine (SVI traces its parameters).
    out = jax.jit(lambda logits: ExactlyKBernoulli(logits, k=2).enumerate_support())(jnp.zeros(4))
    assert out.shape == (6, 4)


def test_infinite_logits_fix_their_variables():
    logits = jnp.array([0.3, -jnp.inf, 1.0, jnp.inf, -0.2])
    d = ExactlyKBernoulli(logits, k=2)
    values = d.enumerate_support()
    assert values.shape == (3, 5)
    assert bool(jnp.all(values[:, 1] == 0)) and bool(jnp.all(values[:, 3] == 1))
    np.testing.assert_allclose(jnp.exp(d.log_prob(values)).sum(), 1.0, atol=1e-12)
    assert ExactlyKBernoulli(
        probs=jnp.array([0.5, 0.0, 1.0, 0.5]), k=2
    ).enumerate_support().shape == (2, 4)
    with pytest.raises(ValueError, match="same over the batch"):
        ExactlyKBernoulli(
            jnp.array([[0.0, jnp.inf, 0.0], [0.0, 0.0, 0.0]]), k=1
        ).enumerate_support()


@pytest.mark.parametrize(
    "rate,k",
    [
        ([1.0, 1.0, 1.0], 4),
        ([1.0, 2.0, 3.0], 7),
        ([0.2, 0.5, 0.3], 4),
        ([5.0, 1.0], 3),
        ([1.0, 1.0], 3),
        ([1.0, 3.0], 0),
        ([1e-3, 1.0, 1.0, 2.0], 9),
        ([0.25, 0.25, 0.5], 4),
        ([2.0], 5),
    ],
)
def test_mode_is_a_brute_force_argmax(rate, k):
    d = ConditionedPoisson(jnp.array(rate), k=k)
    best = d.log_prob(d.enumerate_support()).max()
    mode = d.mode
    assert bool(d.support(mode))
    np.testing.assert_allclose(d.log_prob(mode), best, atol=1e-12, rtol=0)


def test_mode_with_a_traced_k_is_the_concrete_k_mode():
    rate = uniform((50, 4), seed=1)
    traced_mode = jax.jit(lambda k: ConditionedPoisson(rate, k=k, k_max=20).mode)
    for k in [0, 1, 5, 11]:
        np.testing.assert_array_equal(traced_mode(k), ConditionedPoisson(rate, k=k).mode)


# Each k's support is a new shape, which eager log_prob compiles anew (about 3 s each).
@pytest.mark.slow
def test_mode_random_batched_is_a_brute_force_argmax():
    rate = uniform((50, 4), seed=1)
    for k in [0, 1, 5, 11]:
        d = ConditionedPoisson(rate, k=k)
        best = d.log_prob(d.enumerate_support()).max(0)
        np.testing.assert_allclose(d.log_prob(d.mode), best, atol=1e-12, rtol=0)
    d = ConditionedPoisson(jnp.array([1.0, 2.0, 4.0]), k=10**6)
    mode = np.asarray(d.mode)
    assert mode.sum() == 10**6
    for i, j in itertools.permutations(range(3), 2):
        moved = mode.copy()
        moved[i] += 1
        moved[j] -= 1
        assert d.log_prob(moved) <= d.log_prob(mode)


# --- inference ------------------------------------------------------------------------

SENSOR_LOGITS = jnp.array([-1.0, 0.5, 0.0, -0.5, 1.0])
SENSOR_Y = jnp.array([0.3, 2.4, -0.4, 1.9, 0.8])
SOURCE_RATE = jnp.array([1.0, 2.0, 1.5])
SOURCE_Y = jnp.array([3.0, 6.0, 2.0])


def problem(name):
    if name == "sensors":
        return ExactlyKBernoulli(SENSOR_LOGITS, k=2), lambda z: dist.Normal(2.0 * z, 1.0), SENSOR_Y
    return ConditionedPoisson(SOURCE_RATE, k=4), lambda z: dist.Poisson(0.5 + 1.5 * z), SOURCE_Y


def direct_model(name):
    prior, likelihood, y = problem(name)

    def model():
        z = numpyro.sample("z", prior)
        numpyro.sample("y", likelihood(z).to_event(1), obs=y)

    return model


def index_model(name, copies=None):
    """The site written as a Categorical index into its enumerate_support (the pattern the
    error message and the README give); ``copies``: that many independent copies in a plate
    (one infer_discrete call then draws them all)."""
    prior, likelihood, y = problem(name)
    support = prior.enumerate_support()

    def model():
        with numpyro.plate("copies", copies or 1):
            index = numpyro.sample("index", dist.Categorical(logits=prior.log_prob(support)))
            z = support[index]
            numpyro.sample("y", likelihood(z).to_event(1), obs=y)

    return model, support


def exact(name):
    prior, likelihood, y = problem(name)
    support = prior.enumerate_support()
    joint = prior.log_prob(support) + likelihood(support).log_prob(y).sum(-1)
    return support, jax.nn.logsumexp(joint), np.asarray(jax.nn.softmax(joint))


@pytest.mark.parametrize("name", ["sensors", "sources"])
def test_direct_enumeration_is_a_clear_error(name):
    model = direct_model(name)
    with pytest.raises(ValueError, match="Categorical"):
        TraceEnum_ELBO().loss(jax.random.PRNGKey(0), {}, config_enumerate(model), lambda: None)
    with pytest.raises(ValueError, match="Categorical"):
        with numpyro.handlers.seed(rng_seed=0):
            infer_discrete(
                config_enumerate(model), first_available_dim=-1, rng_key=jax.random.PRNGKey(0)
            )()


@pytest.mark.parametrize("name", ["sensors", "sources"])
def test_trace_enum_elbo_and_log_density_through_an_index(name):
    _, log_evidence, _ = exact(name)
    model, _ = index_model(name)
    loss = TraceEnum_ELBO().loss(jax.random.PRNGKey(0), {}, config_enumerate(model), lambda: None)
    assert abs(loss + log_evidence) < 1e-5
    log_joint, _ = log_density(enum(config_enumerate(model), -2), (), {}, {})
    assert abs(log_joint - log_evidence) < 1e-5


def chi_square_p(draws, posterior):
    counts = np.bincount(draws, minlength=len(posterior)).astype(float)
    expected = posterior * len(draws)
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("name", ["sensors", "sources"])
def test_infer_discrete_through_an_index(name):
    _, _, posterior = exact(name)
    model, support = index_model(name, copies=2000)
    sampler = infer_discrete(
        config_enumerate(model),
        first_available_dim=-2,
        temperature=1,
        rng_key=jax.random.PRNGKey(0),
    )
    trace = numpyro.handlers.trace(sampler).get_trace()
    draws = np.asarray(trace["index"]["value"])
    assert draws.shape == (2000,)
    assert chi_square_p(draws, posterior) > 1e-3
    map_model = infer_discrete(
        config_enumerate(model),
        first_available_dim=-2,
        temperature=0,
        rng_key=jax.random.PRNGKey(1),
    )
    index = np.asarray(numpyro.handlers.trace(map_model).get_trace()["index"]["value"])
    assert (index == np.argmax(posterior)).all()


def mixed_model():
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    z = numpyro.sample("z", ExactlyKBernoulli(SENSOR_LOGITS, k=2))
    numpyro.sample("y", dist.Normal(mu + 2.0 * z, 1.0).to_event(1), obs=SENSOR_Y)


def mixed_model_cp():
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    z = numpyro.sample("z", ConditionedPoisson(SOURCE_RATE, k=4))
    numpyro.sample("y", dist.Normal(mu + z, 1.0).to_event(1), obs=SOURCE_Y)


KERNELS = {
    "DiscreteHMCGibbs": lambda m: DiscreteHMCGibbs(NUTS(m)),
    "DiscreteHMCGibbs-modified": lambda m: DiscreteHMCGibbs(NUTS(m), modified=True),
    "MixedHMC": lambda m: MixedHMC(HMC(m, trajectory_length=1.0)),
    "NUTS": NUTS,
}


@pytest.mark.filterwarnings("ignore:Some algorithms will automatically enumerate")
@pytest.mark.parametrize("model", [mixed_model, mixed_model_cp], ids=["ekb", "cp"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_scalar_coordinate_samplers_get_a_clear_error(kernel, model):
    mcmc = MCMC(KERNELS[kernel](model), num_warmup=5, num_samples=5, progress_bar=False)
    with pytest.raises(ValueError, match="enumerate_support"):
        mcmc.run(jax.random.PRNGKey(0))


def test_without_the_guard_discrete_hmc_gibbs_never_moves(monkeypatch):
    """What the guard prevents: every one-coordinate proposal leaves the k-hot support
    (log_prob -inf) and is rejected, so the chain silently stays at its initial value."""
    import numpyro_constrained.exactly_k_bernoulli as ekb_module

    monkeypatch.setattr(ekb_module, "refuse_scalar_coordinate_consumers", lambda name: None)
    mcmc = MCMC(
        DiscreteHMCGibbs(NUTS(mixed_model)), num_warmup=50, num_samples=100, progress_bar=False
    )
    mcmc.run(jax.random.PRNGKey(0))
    z = np.asarray(mcmc.get_samples()["z"])
    assert (z == z[0]).all()
    # The exact posterior is far from a point mass at that value.
    assert exact("sensors")[2].max() < 0.9


def _ccb_model(low, high):
    def model():
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        z = numpyro.sample("z", CountConstrainedBernoulli(SENSOR_LOGITS, low=low, high=high))
        numpyro.sample("y", dist.Normal(mu + 2.0 * z, 1.0).to_event(1), obs=SENSOR_Y)

    return model


@pytest.mark.filterwarnings("ignore:Some algorithms will automatically enumerate")
def test_count_constrained_bernoulli_refuses_funsor_and_gibbs_within_one_count():
    """CountConstrainedBernoulli gets the same guard: funsor's enumeration (which failed
    with "a value of shape (15,) does not end in the event shape") always, the Gibbs
    samplers where a range is one count (no one-coordinate move stays in it); across a
    wider range a one-coordinate move changes the count within it, and they run."""
    with pytest.raises(ValueError, match="Categorical"):
        TraceEnum_ELBO().loss(
            jax.random.PRNGKey(0), {}, config_enumerate(_ccb_model(1, 3)), lambda: None
        )
    for kernel in ["DiscreteHMCGibbs", "NUTS"]:
        mcmc = MCMC(
            KERNELS[kernel](_ccb_model(2, 2)), num_warmup=5, num_samples=5, progress_bar=False
        )
        with pytest.raises(ValueError, match="enumerate_support"):
            mcmc.run(jax.random.PRNGKey(0))
    mcmc = MCMC(
        KERNELS["DiscreteHMCGibbs"](_ccb_model(1, 3)),
        num_warmup=20,
        num_samples=50,
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(0))
    draws = np.asarray(mcmc.get_samples()["z"])
    assert ((draws.sum(-1) >= 1) & (draws.sum(-1) <= 3)).all()
    assert len({tuple(row) for row in draws}) > 1  # the chain moves
