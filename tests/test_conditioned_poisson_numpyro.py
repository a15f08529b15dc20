"""ConditionedPoisson in numpyro_constrained, against SciPy, enumeration and finite differences;
jit, vmap and grad."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions.batch_util import vmap_over
from numpyro.distributions.kl import kl_divergence
from scipy import special, stats

from numpyro_constrained import ConditionedPoisson
from numpyro_constrained.losses import expected_l1_loss, expected_l2_loss
from tests.oracles import poisson as oracle

DTYPES = [jnp.float32, jnp.float64]


def _rtol(dtype, float64_rtol=1e-11):
    return 2e-5 if dtype == jnp.float32 else float64_rtol


# log_prob ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_prob_matches_scipy_multinomial_with_per_batch_k(dtype):
    rng = np.random.default_rng(1)
    rate = rng.gamma(1.0, size=(3, 4)) + 0.05
    k = np.array([0, 3, 7])
    value = np.stack([rng.multinomial(k_b, r / r.sum()) for k_b, r in zip(k, rate, strict=True)])
    d = ConditionedPoisson(jnp.asarray(rate, dtype), k=k)
    log_prob = d.log_prob(jnp.asarray(value, dtype))
    assert log_prob.dtype == dtype and log_prob.shape == (3,)
    expected = oracle.multinomial_logpmf(rate, k, value)
    np.testing.assert_allclose(log_prob, expected, rtol=_rtol(dtype), atol=1e-5)


def test_log_prob_gradient_in_value_is_minus_digamma_plus_log_p_also_at_zero():
    # Regression: jnp.maximum(z, 0) inside log_prob halved this gradient at z = 0.
    rate = np.array([[0.5, 1.0, 2.5, 1.0], [3.0, 0.2, 0.2, 0.6]])
    value = np.array([[0.0, 2.0, 3.0, 1.0], [4.0, 0.0, 1.0, 1.0]])
    d = ConditionedPoisson(jnp.asarray(rate), k=value.sum(-1).astype(int))
    grad = jax.jit(jax.grad(lambda z: d.log_prob(z).sum()))(jnp.asarray(value))
    expected = -special.digamma(value + 1.0) + np.log(rate / rate.sum(-1, keepdims=True))
    np.testing.assert_allclose(grad, expected, rtol=1e-12)


def test_log_prob_gradient_in_rate_matches_finite_differences_of_scipy():
    rate = np.array([0.7, 1.3, 2.1, 0.4])
    value = np.array([1.0, 2.0, 2.0, 0.0])
    grad = jax.jit(jax.grad(lambda r: ConditionedPoisson(r, k=5).log_prob(jnp.asarray(value))))(
        jnp.asarray(rate)
    )
    step = 1e-6
    expected = [
        (
            oracle.multinomial_logpmf(rate + step * e, 5, value)
            - oracle.multinomial_logpmf(rate - step * e, 5, value)
        )
        / (2 * step)
        for e in np.eye(4)
    ]
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "value",
    [[-1.0, 3.0, 2.0], [0.5, 2.5, 1.0], [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [math.nan, 2.0, 2.0]],
    ids=["negative", "non-integer", "sum-below-k", "sum-above-k", "nan"],
)
def test_log_prob_outside_the_support(value):
    # As NumPyro's own distributions: a UserWarning and -inf with validation on.
    rate = jnp.array([1.0, 2.0, 3.0])
    with pytest.warns(UserWarning, match="Out-of-support values"):
        log_prob = ConditionedPoisson(rate, k=4).log_prob(jnp.array(value))
    assert float(log_prob) == -math.inf
    log_prob = ConditionedPoisson(rate, k=4, validate_args=False).log_prob(jnp.array(value))
    assert float(log_prob) == -math.inf
    # Under jit the value cannot be checked: -inf even with validation on.
    jitted = jax.jit(lambda v: ConditionedPoisson(rate, k=4).log_prob(v))
    assert float(jitted(jnp.array(value))) == -math.inf


def test_log_prob_outside_the_support_leaves_the_gradient_of_the_rest_finite():
    value = jnp.array([[-1.0, 3.0, 2.0], [0.0, 2.0, 2.0]])

    def second_log_prob(rate, value):
        return ConditionedPoisson(rate, k=4, validate_args=False).log_prob(value)[1]

    grads = jax.jit(jax.grad(second_log_prob, argnums=(0, 1)))(jnp.ones((2, 3)), value)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)


# Bad parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rate", [[1.0, 0.0, 2.0], [1.0, -1.0, 2.0], [1.0, math.nan, 2.0], [1.0, math.inf, 2.0]]
)
def test_bad_rate_raises_value_error_naming_rate(rate):
    with pytest.raises(ValueError, match="rate"):
        ConditionedPoisson(jnp.array(rate), k=2)


@pytest.mark.parametrize("k", [-1, 2.5, np.array([1, -2]), True])
def test_bad_k_raises_value_error_naming_k(k):
    with pytest.raises(ValueError, match="k"):
        ConditionedPoisson(jnp.ones((2, 3)), k=k)


def test_shape_mismatch_and_scalar_rate_raise_value_error():
    with pytest.raises(ValueError, match="k of shape .* does not broadcast"):
        ConditionedPoisson(jnp.ones((2, 3)), k=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="rate must have at least one dimension"):
        ConditionedPoisson(jnp.array(1.0), k=2)


# Sampling ---------------------------------------------------------------------------------


def test_samples_pass_chi_square_against_enumeration_with_per_batch_k():
    rate = np.array([[0.5, 1.0, 2.5], [0.2, 0.3, 3.0]])
    k = np.array([4, 2])
    samples = ConditionedPoisson(jnp.asarray(rate), k=k).sample(jax.random.PRNGKey(0), (4000,))
    assert samples.shape == (4000, 2, 3)
    np.testing.assert_array_equal(samples.sum(-1), np.broadcast_to(k, (4000, 2)))
    for b in range(2):
        pvalue = oracle.composition_chi_square_pvalue(np.asarray(samples[:, b]), rate[b], k[b])
        assert pvalue > 1e-3


def test_sampling_with_k_traced_under_jit_is_exact():
    # A traced k has no static bound: the sequential-binomial sampler (also the one used
    # when k >> n) runs instead of the categorical one.
    rate = np.array([[0.5, 1.0, 2.5], [0.2, 0.3, 3.0]])

    @jax.jit
    def draw(key, k):
        return ConditionedPoisson(jnp.asarray(rate), k=k).sample(key, (4000,))

    k = np.array([4, 2])
    samples = draw(jax.random.PRNGKey(1), k)
    np.testing.assert_array_equal(samples.sum(-1), np.broadcast_to(k, (4000, 2)))
    for b in range(2):
        pvalue = oracle.composition_chi_square_pvalue(np.asarray(samples[:, b]), rate[b], k[b])
        assert pvalue > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_is_exactly_integer_sums_to_k_and_keeps_dtype(dtype):
    rate = jax.random.uniform(jax.random.PRNGKey(3), (5, 7), dtype) + 0.1
    k = np.array([0, 1, 9, 30, 200])
    z = ConditionedPoisson(rate, k=k).sample(jax.random.PRNGKey(4), (3,))
    assert z.dtype == dtype and z.shape == (3, 5, 7)
    np.testing.assert_array_equal(z, jnp.round(z))
    assert bool((z >= 0).all())
    np.testing.assert_array_equal(z.sum(-1), np.broadcast_to(k, (3, 5)).astype(dtype))


def test_sample_gradient_is_the_jacobian_vector_product_of_the_mean():
    rng = np.random.default_rng(3)
    rate = rng.gamma(1.0, size=(2, 4)) + 0.1
    k = np.array([3, 8])
    weights = rng.normal(size=(6, 2, 4))

    def weighted_sample(r):
        z = ConditionedPoisson(r, k=k).sample(jax.random.PRNGKey(5), (6,))
        return jnp.sum(weights * z)

    grad = jax.jit(jax.grad(weighted_sample))(jnp.asarray(rate))
    expected = np.einsum("sbi,bij->bj", weights, oracle.mean_jacobian(rate, k))
    np.testing.assert_allclose(grad, expected, rtol=1e-12)
    assert ConditionedPoisson(jnp.ones(3), k=2).has_rsample


# Moments, marginals, constraint probability -----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_and_variance_match_enumeration(dtype):
    rate = np.array([[0.5, 1.0, 2.5], [2.0, 2.0, 0.1]])
    d = ConditionedPoisson(jnp.asarray(rate, dtype), k=np.array([4, 6]))
    assert d.mean.dtype == dtype and d.variance.dtype == dtype
    for b, k in enumerate([4, 6]):
        mean, variance = oracle.enumerated_mean_and_variance(rate[b], k)
        np.testing.assert_allclose(d.mean[b], mean, rtol=_rtol(dtype, 1e-10))
        np.testing.assert_allclose(d.variance[b], variance, rtol=_rtol(dtype, 1e-10))


def test_marginals_and_log_constraint_prob():
    rate = np.array([0.5, 1.0, 2.5])
    d = ConditionedPoisson(jnp.asarray(rate), k=6)
    values = jnp.array([0.0, 3.0, 6.0])
    expected = stats.binom.logpmf(np.asarray(values), 6, rate / rate.sum())
    np.testing.assert_allclose(d.marginals.log_prob(values), expected, rtol=1e-12)
    enumerated = np.log(np.exp(stats.poisson.logpmf(oracle.compositions(3, 6), rate).sum(-1)).sum())
    np.testing.assert_allclose(d.log_constraint_prob(), enumerated, rtol=1e-12)


# Entropy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n, k", [(1, 7), (2, 0), (4, 5), (50, 100), (5, 10_000), (40, 10_000)])
def test_entropy_float64_within_1e9_of_scipy(n, k):
    rng = np.random.default_rng(n * 7919 + k)
    rate = np.exp(rng.uniform(-5, 4, size=(2, n)))
    entropy = ConditionedPoisson(jnp.asarray(rate), k=k).entropy()
    np.testing.assert_allclose(entropy, oracle.multinomial_entropy(rate, k), rtol=1e-9, atol=1e-12)


def test_entropy_under_jit_and_grad_matches_scipy_and_finite_differences():
    rate = np.array([0.4, 1.0, 2.2, 0.9])

    def entropy(r):
        return ConditionedPoisson(r, k=12).entropy()

    np.testing.assert_allclose(
        jax.jit(entropy)(jnp.asarray(rate)), oracle.multinomial_entropy(rate, 12), rtol=1e-12
    )
    grad = jax.jit(jax.grad(entropy))(jnp.asarray(rate))
    step = 1e-5
    expected = [
        (
            oracle.multinomial_entropy(rate + step * e, 12)
            - oracle.multinomial_entropy(rate - step * e, 12)
        )
        / (2 * step)
        for e in np.eye(4)
    ]
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-9)


def test_entropy_float32_with_per_batch_k():
    rng = np.random.default_rng(5)
    rate = rng.gamma(1.0, size=(3, 30)) + 0.01
    k = np.array([0, 20, 200])
    entropy = ConditionedPoisson(jnp.asarray(rate, jnp.float32), k=k).entropy()
    assert entropy.dtype == jnp.float32
    # JAX's float32 gammaln is less accurate than torch's lgamma.
    np.testing.assert_allclose(entropy, oracle.multinomial_entropy(rate, k), rtol=5e-5, atol=1e-5)


def test_entropy_with_traced_k_needs_k_max():
    rate = jnp.array([0.5, 1.0, 2.5])
    with pytest.raises(ValueError, match="k_max"):
        jax.jit(lambda k: ConditionedPoisson(rate, k=k).entropy())(3)
    entropy = jax.jit(lambda k: ConditionedPoisson(rate, k=k, k_max=5).entropy())(3)
    np.testing.assert_allclose(entropy, oracle.multinomial_entropy(np.asarray(rate), 3), rtol=1e-12)


# KL and losses ----------------------------------------------------------------------------


def test_kl_matches_enumeration_and_rejects_different_k():
    rate_p = np.array([[0.5, 1.0, 2.5], [1.0, 1.0, 1.0]])
    rate_q = np.array([[2.0, 1.0, 0.3], [0.2, 5.0, 1.0]])
    k = np.array([4, 2])
    kl = kl_divergence(
        ConditionedPoisson(jnp.asarray(rate_p), k=k), ConditionedPoisson(jnp.asarray(rate_q), k=k)
    )
    expected = [oracle.enumerated_kl(p, q, kb) for p, q, kb in zip(rate_p, rate_q, k, strict=True)]
    np.testing.assert_allclose(kl, expected, rtol=1e-10)
    with pytest.raises(ValueError, match="same k"):
        kl_divergence(ConditionedPoisson(jnp.ones(3), k=2), ConditionedPoisson(jnp.ones(3), k=3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_expected_losses_match_enumeration_and_differentiate(dtype):
    rate = np.array([[0.5, 1.0, 2.5, 0.2], [1.0, 1.0, 3.0, 0.5]])
    k = np.array([5, 3])
    target = np.array([[2.0, 0.0, 3.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    d = ConditionedPoisson(jnp.asarray(rate, dtype), k=k)
    l1 = expected_l1_loss(d, jnp.asarray(target, dtype))
    l2 = expected_l2_loss(d, jnp.asarray(target, dtype))
    assert l1.dtype == dtype and l1.shape == (2,)
    zipped = list(zip(rate, k, target, strict=True))
    np.testing.assert_allclose(
        l1, [oracle.enumerated_expected_l1(*args) for args in zipped], rtol=_rtol(dtype)
    )
    np.testing.assert_allclose(
        l2, [oracle.enumerated_expected_l2(*args) for args in zipped], rtol=_rtol(dtype)
    )
    if dtype == jnp.float64:
        grad = jax.jit(jax.grad(lambda r: expected_l1_loss(ConditionedPoisson(r, k=5), target[0])))(
            jnp.asarray(rate[0])
        )
        step = 1e-6
        expected = [
            (
                oracle.enumerated_expected_l1(rate[0] + step * e, 5, target[0])
                - oracle.enumerated_expected_l1(rate[0] - step * e, 5, target[0])
            )
            / (2 * step)
            for e in np.eye(4)
        ]
        np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-9)


# Support, shapes, jit, vmap ---------------------------------------------------------------


def test_support_demands_the_exact_total_and_integers():
    support = ConditionedPoisson(jnp.ones((3, 3)), k=np.array([2, 3, 2])).support
    assert support.is_discrete and support.event_dim == 1
    value = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.5, 1.5, 0.0]])
    assert support(value).tolist() == [True, False, False]


def test_expand_and_infer_shapes():
    d = ConditionedPoisson(jnp.array([[1.0, 2.0, 3.0]]), k=np.array([2, 4]))
    assert d.batch_shape == (2,) and d.event_shape == (3,)
    expanded = d.expand((5, 2))
    assert expanded.batch_shape == (5, 2) and isinstance(expanded, ConditionedPoisson)
    z = expanded.sample(jax.random.PRNGKey(0))
    np.testing.assert_array_equal(z.sum(-1), np.broadcast_to([2.0, 4.0], (5, 2)))
    np.testing.assert_allclose(expanded.log_prob(z), d.log_prob(z))
    assert ConditionedPoisson.infer_shapes(rate=(2, 3), k=(4, 1)) == ((4, 2), (3,))


def test_jit_and_vmap_over_rate_and_k():
    rate = jnp.array([[0.5, 1.0, 2.5], [1.0, 1.0, 1.0]])
    k = jnp.array([3, 5])
    d = ConditionedPoisson(rate, k=k)
    value = jnp.array([[1.0, 1.0, 1.0], [0.0, 5.0, 0.0]])

    jitted = jax.jit(lambda d, v: d.log_prob(v))(d, value)
    np.testing.assert_allclose(jitted, oracle.multinomial_logpmf(rate, k, value), rtol=1e-12)

    in_axes = vmap_over(d, rate=0, k=0)
    mapped = jax.vmap(lambda d, v: d.log_prob(v), in_axes=(in_axes, 0))(d, value)
    np.testing.assert_allclose(mapped, jitted, rtol=1e-12)
    means = jax.vmap(lambda d: d.mean, in_axes=(in_axes,))(d)
    np.testing.assert_allclose(means, d.mean, rtol=1e-12)
    samples = jax.vmap(lambda d, key: d.sample(key), in_axes=(in_axes, 0))(
        d, jax.random.split(jax.random.PRNGKey(0), 2)
    )
    np.testing.assert_array_equal(samples.sum(-1), k.astype(samples.dtype))


def test_plate():
    def model():
        with numpyro.plate("bags", 4):
            return numpyro.sample("z", ConditionedPoisson(jnp.ones(3), k=5))

    z = numpyro.handlers.seed(model, 0)()
    assert z.shape == (4, 3)
    np.testing.assert_array_equal(z.sum(-1), 5.0)


# Inference --------------------------------------------------------------------------------


# NumPyro warns about any discrete latent site under Trace_ELBO; this one is reparameterised
# (has_rsample), which is what the test checks works.
@pytest.mark.filterwarnings("ignore:Currently, SVI with Trace_ELBO loss does not support")
def test_svi_recovers_mixture_proportions_from_bags_of_known_totals():
    # As in the Pyro test: latent class counts z_b per bag of known total, a noisy sum of
    # per-class signatures observed, a ConditionedPoisson guide per bag.
    rng = np.random.default_rng(0)
    true_proportions = np.array([0.5, 0.3, 0.2])
    totals = rng.integers(5, 25, size=60)
    counts = np.stack([rng.multinomial(k, true_proportions) for k in totals])
    signatures = np.array([[2.0, 0.0, 0.5], [0.0, 2.0, 0.5], [0.5, 0.0, 2.0]])
    observed = counts @ signatures + rng.normal(scale=0.5, size=(60, 3))

    def model():
        proportions = numpyro.param(
            "proportions", jnp.ones(3) / 3, constraint=dist.constraints.simplex
        )
        with numpyro.plate("bags", 60):
            z = numpyro.sample("z", ConditionedPoisson(proportions, k=totals))
            numpyro.sample("y", dist.Normal(z @ signatures, 0.5).to_event(1), obs=observed)

    def guide():
        log_rate = numpyro.param("log_rate", jnp.zeros((60, 3)))
        with numpyro.plate("bags", 60):
            numpyro.sample("z", ConditionedPoisson(jnp.exp(log_rate), k=totals))

    optimizer = numpyro.optim.ClippedAdam(step_size=lambda step: 0.1 * 0.995**step, clip_norm=10.0)
    svi = numpyro.infer.SVI(model, guide, optimizer, numpyro.infer.Trace_ELBO())
    result = svi.run(jax.random.PRNGKey(0), 400, progress_bar=False)
    learned = np.asarray(result.params["proportions"])
    maximum_likelihood_from_true_counts = counts.sum(0) / totals.sum()
    np.testing.assert_allclose(learned, maximum_likelihood_from_true_counts, atol=0.03)
    np.testing.assert_allclose(learned, true_proportions, atol=0.06)


def test_a_single_category_is_deterministic_with_finite_gradients():
    # p == 1 makes log(1 - p) = -inf; the kernels must give exact values and no NaN.
    def total(rate):
        d = ConditionedPoisson(rate, k=np.array([0, 6]))
        return d.entropy(), d.log_prob(jnp.array([[0.0], [6.0]]))

    rate = jnp.array([[2.0], [0.5]])
    entropy, log_prob = total(rate)
    np.testing.assert_array_equal(entropy, 0.0)
    np.testing.assert_array_equal(log_prob, 0.0)
    grad = jax.jit(jax.grad(lambda r: sum(jnp.sum(x) for x in total(r))))(rate)
    assert bool(jnp.isfinite(grad).all())
