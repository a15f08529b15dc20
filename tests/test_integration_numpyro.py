"""End-to-end checks of the three classes in the NumPyro routines users call (issue 15):
``numpyro.contrib.control_flow.scan`` against the unrolled model, distributions as
``lax.scan`` carries and under ``jax.vmap``, NUTS on an ``LinearConstrainedNormal`` prior
built from constants inside the model (against the closed-form conditional Gaussian), and
traced out-of-range counts under ``jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax import lax
from numpyro.contrib.control_flow import scan
from numpyro.distributions import distribution as _distribution_module
from numpyro.infer import MCMC, NUTS
from numpyro.infer.util import log_density

from numpyro_constrained import ConditionedPoisson, ExactlyKBernoulli, LinearConstrainedNormal

T = 3  # scan length
N = 4  # event size


def key(seed: int = 0):
    return jax.random.PRNGKey(seed)


@pytest.fixture(autouse=True)
def _validation_off():
    # Pinned, so that no test depends on what another module did to the global flag.
    with numpyro.validation_enabled(False):
        yield


@pytest.fixture
def validation_on():
    """``numpyro.enable_validation()`` for one test, restoring the previous setting."""
    previous = _distribution_module._VALIDATION_ENABLED
    numpyro.enable_validation(True)
    try:
        yield
    finally:
        numpyro.enable_validation(previous)


_rng = np.random.default_rng(15)
LOGITS = _rng.normal(size=(T, N)).astype(np.float32)
RATES = _rng.uniform(0.5, 2.0, size=(T, N)).astype(np.float32)
LOCS = _rng.normal(size=(T, N)).astype(np.float32)
SCALE = np.array([0.5, 1.0, 1.5, 0.8], np.float32)
COUNTS = np.array([1, 2, 3])


def _ekb(params, count):
    return ExactlyKBernoulli(logits=params, k=count)


def _cp(params, count):
    return ConditionedPoisson(rate=params, k=count)


def _lcn(params, count):
    # count: the right-hand side of the default zero-sum-like row, shape (1,)
    return LinearConstrainedNormal(params, SCALE, k=count)


SCAN_CASES = {
    "ExactlyKBernoulli": (_ekb, LOGITS, COUNTS),
    "ConditionedPoisson": (_cp, RATES, COUNTS),
    "LinearConstrainedNormal": (
        _lcn,
        LOCS,
        np.array([[0.5], [-1.0], [2.0]], np.float32),
    ),
}


def _params(test_name, names):
    return [pytest.param(name, id=name) for name in names]


def _observations(make, params, counts):
    return jnp.stack(
        [make(p, c).sample(key(t)) for t, (p, c) in enumerate(zip(params, counts, strict=True))]
    )


# --- scan versus unrolled ---------------------------------------------------------------------


@pytest.mark.parametrize("name", _params("test_scan_matches_unrolled", list(SCAN_CASES)))
def test_scan_matches_unrolled(name):
    """An observed site inside ``numpyro.contrib.control_flow.scan``, its parameters and
    count coming in through ``xs`` (so traced inside the body), scores the same log density
    as the unrolled model."""
    make, params, counts = SCAN_CASES[name]
    data = _observations(make, params, counts)

    def scanned(data):
        def body(carry, step):
            p, c, x = step
            numpyro.sample("z", make(p, c), obs=x)
            return carry, None

        scan(body, None, (params, counts, data))

    def unrolled(data):
        for t in range(T):
            numpyro.sample(f"z_{t}", make(params[t], counts[t]), obs=data[t])

    expected = sum(float(make(params[t], counts[t]).log_prob(data[t])) for t in range(T))
    actual_unrolled, _ = log_density(unrolled, (data,), {}, {})
    actual_scanned, _ = log_density(scanned, (data,), {}, {})
    np.testing.assert_allclose(actual_unrolled, expected, rtol=1e-5)
    np.testing.assert_allclose(actual_scanned, expected, rtol=1e-5)


@pytest.mark.parametrize("name", _params("test_scan_shared_parameters", list(SCAN_CASES)))
def test_scan_shared_parameters(name):
    """The same with parameters closed over (constants shared by every step) and only the
    observations scanned: the promoted batch shape must not swallow the event axis."""
    make, params, counts = SCAN_CASES[name]
    p0, c0 = params[0], counts[0]
    data = jnp.stack([make(p0, c0).sample(key(t)) for t in range(T)])

    def scanned(data):
        def body(carry, x):
            numpyro.sample("z", make(p0, c0), obs=x)
            return carry, None

        scan(body, None, data)

    expected = float(jnp.sum(make(p0, c0).log_prob(data)))
    actual, _ = log_density(scanned, (data,), {}, {})
    np.testing.assert_allclose(actual, expected, rtol=1e-5)


# --- lax.scan carry and vmap ----------------------------------------------------------------

CARRY_CASES = {"ExactlyKBernoulli": (_ekb, "logits"), "ConditionedPoisson": (_cp, "rate")}


@pytest.mark.parametrize("name", _params("test_lax_scan_carry", list(CARRY_CASES)))
def test_lax_scan_carry(name):
    """A distribution built outside with a concrete k is a ``lax.scan`` carry; the body
    rebuilds it from the carried (traced) values. Log-densities equal the eager loop's."""
    make, field = CARRY_CASES[name]
    params = LOGITS[0] if name == "ExactlyKBernoulli" else RATES[0]
    # k = 1, not 2: a concrete k's table bound (a power of two) then differs from n = 4.
    count = 1
    value = make(params, count).sample(key(0))
    steps = jnp.asarray(np.random.default_rng(4).uniform(0.1, 0.3, size=(T, N)), jnp.float32)

    def body(d, step):
        new = make(getattr(d, field) + step, d.k)
        return new, new.log_prob(value)

    init = make(params, count)
    final, log_probs = lax.scan(body, init, steps)
    expected = []
    current = jnp.asarray(params)
    for t in range(T):
        current = current + steps[t]
        expected.append(make(current, count).log_prob(value))
    np.testing.assert_allclose(log_probs, jnp.stack(expected), rtol=1e-5)
    np.testing.assert_allclose(getattr(final, field), current, rtol=1e-6)
    assert int(final.k) == count


@pytest.mark.parametrize("name", _params("test_vmap", list(CARRY_CASES)))
def test_vmap(name):
    """``jax.vmap`` over parameters and per-element counts: log_prob, mean, entropy and a
    returned distribution equal the eager loop's."""
    make, field = CARRY_CASES[name]
    params = LOGITS if name == "ExactlyKBernoulli" else RATES
    counts = COUNTS
    values = _observations(make, params, counts)
    if name == "ConditionedPoisson":
        # A traced k needs the static bound for CP's entropy (decision 3; API.md).
        def make(p, c):
            return ConditionedPoisson(rate=p, k=c, k_max=int(COUNTS.max()))

    def stats(p, c, v):
        d = make(p, c)
        return d.log_prob(v), d.mean, d.entropy()

    actual = jax.vmap(stats)(jnp.asarray(params), jnp.asarray(counts), values)
    for t in range(T):
        d = make(params[t], counts[t])
        expected = (d.log_prob(values[t]), d.mean, d.entropy())
        for a, e in zip(actual, expected, strict=True):
            np.testing.assert_allclose(a[t], e, rtol=1e-5, atol=1e-6)
    batched = jax.vmap(make)(jnp.asarray(params), jnp.asarray(counts))
    np.testing.assert_allclose(getattr(batched, field), params, rtol=1e-6)
    np.testing.assert_array_equal(batched.k, counts)


# --- NUTS on an LCN prior built from constants --------------------------------------------------


def _conditional_gaussian(loc, cov, A, k, y, noise):
    """Posterior of z for z ~ N(loc, cov) conditioned on A z = k, y ~ N(z, noise^2 I):
    condition on y (a linear Gaussian observation), then on A z = k (a noise-free one);
    the two commute. Plain NumPy, float64."""
    precision = np.linalg.inv(cov) + np.eye(len(loc)) / noise**2
    post_cov = np.linalg.inv(precision)
    post_mean = post_cov @ (np.linalg.solve(cov, loc) + y / noise**2)
    gain = post_cov @ A.T @ np.linalg.inv(A @ post_cov @ A.T)
    mean = post_mean + gain @ (k - A @ post_mean)
    covariance = post_cov - gain @ A @ post_cov
    return mean, 0.5 * (covariance + covariance.T)


def test_nuts_lcn_prior_from_constants(validation_on):
    """NUTS (validation on) on a model whose LCN prior is built inside the model from
    constant arrays (explicit A, covariance_matrix): the posterior mean and covariance match
    the closed-form conditional Gaussian (tolerances: about 5 Monte Carlo standard errors for
    500 draws), and every draw satisfies A z = k."""
    loc = np.array([0.5, -0.3, 1.0, 0.2])
    m = np.random.default_rng(3).normal(size=(N, N))
    cov = m @ m.T / N + 0.5 * np.eye(N)
    A = np.array([[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 0.5, 0.0]])
    k = np.array([1.0, 0.5])
    y = np.array([0.8, -0.5, 0.6, 0.4])
    noise = 0.7

    def model():
        z = numpyro.sample("z", LinearConstrainedNormal(loc, covariance_matrix=cov, A=A, k=k))
        numpyro.sample("y", dist.Normal(z, noise).to_event(1), obs=y)

    mcmc = MCMC(NUTS(model), num_warmup=300, num_samples=500, num_chains=1, progress_bar=False)
    mcmc.run(key(0))
    z = np.asarray(mcmc.get_samples()["z"])
    assert z.shape == (500, N)
    np.testing.assert_allclose(z @ A.T, np.broadcast_to(k, (500, 2)), atol=1e-6)
    mean, covariance = _conditional_gaussian(loc, cov, A, k, y, noise)
    std = np.sqrt(np.diag(covariance))
    np.testing.assert_allclose(z.mean(0), mean, atol=float(5 * std.max() / np.sqrt(500)))
    sample_cov = np.cov(z.T)
    np.testing.assert_allclose(sample_cov, covariance, atol=float(0.3 * std.max() ** 2))


# --- traced out-of-range counts ---------------------------------------------------------------

OUT_OF_RANGE = [
    ("ExactlyKBernoulli", -1),
    ("ExactlyKBernoulli", N + 1),
    ("ConditionedPoisson", -1),
    ("ConditionedPoisson", N + 1),
]


def _out_of_range_params(test_name):
    return [pytest.param(name, count, id=f"{name}-k{count}") for name, count in OUT_OF_RANGE]


def _make_bounded(name, count):
    """EKB: range 0..n (its own bound); CP: ``k_max = n`` gives the range 0..n (a CP without
    ``k_max`` has no upper bound on a traced k)."""
    if name == "ExactlyKBernoulli":
        return ExactlyKBernoulli(logits=LOGITS[0], k=count)
    return ConditionedPoisson(rate=RATES[0], k=count, k_max=N)


def _value_for(name, count):
    # A value in the support of the nearest in-range count (never in range for the traced k).
    if name == "ExactlyKBernoulli":
        return jnp.array([1.0, 1.0, 0.0, 0.0])
    return jnp.array([float(max(count, 0)), 0.0, 0.0, 0.0])


@pytest.mark.parametrize("name, count", _out_of_range_params("test_traced_k_out_of_range"))
def test_traced_k_out_of_range(name, count):
    """Decision 3: under ``jit`` a traced k outside 0..n gives a -inf log_prob and a NaN
    entropy, never a finite number."""
    value = _value_for(name, count)

    @jax.jit
    def f(k):
        d = _make_bounded(name, k)
        return d.log_prob(value), d.entropy()

    log_prob, entropy = f(count)
    assert bool(jnp.all(log_prob == -jnp.inf)), log_prob
    assert bool(jnp.all(jnp.isnan(entropy))), entropy


@pytest.mark.parametrize("name, count", _out_of_range_params("test_traced_k_out_of_range_moments"))
def test_traced_k_out_of_range_moments(name, count):
    """Decision 3 (the rest of it): mean, variance and samples are NaN too."""

    @jax.jit
    def f(k):
        d = _make_bounded(name, k)
        return d.mean, d.variance, d.sample(key(0))

    for out in f(count):
        assert bool(jnp.all(jnp.isnan(out))), out
