"""ConditionedPoisson in numpyro_constrained, against SciPy, enumeration and finite differences;
jit, vmap and grad."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.contrib.control_flow import scan
from numpyro.distributions.batch_util import promote_batch_shape, vmap_over
from numpyro.distributions.kl import kl_divergence
from numpyro.infer.util import log_density
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


@pytest.mark.user_config
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
    with pytest.raises(
        ValueError, match=r"Cannot broadcast distribution of shape \(2,\) to shape \(4,\)"
    ):
        d.expand((4,))


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


# Framework conformance (issue 15) ----------------------------------------------------------

RATES = np.array([[0.5, 1.0, 2.5], [1.0, 2.0, 3.0], [3.0, 1.0, 1.0], [2.0, 2.0, 1.0]])
KS = np.array([3, 4, 2, 5])
VALUES = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 3.0], [2.0, 0.0, 0.0], [1.0, 2.0, 2.0]])


def _scipy_log_prob(rate, k, value):
    return stats.multinomial(int(k), rate / rate.sum()).logpmf(value)


def test_parameter_constraints_carry_the_event_dim():
    # rate's last axis is the event; k is one count per batch element.
    d = ConditionedPoisson(jnp.asarray(RATES), k=KS)
    assert d.arg_constraints["rate"].event_dim == 1
    assert d.arg_constraints["k"].event_dim == 0
    assert d.arg_constraints["rate"](d.rate).shape == d.batch_shape
    invalid = jnp.asarray(RATES).at[1, 2].set(-1.0)
    np.testing.assert_array_equal(d.arg_constraints["rate"](invalid), [True, False, True, True])
    # The base constraint is a greater_than(0), as NumPyro's generic tests generate values
    # for (inside: lower_bound + exp(normal); outside: lower_bound - exp(normal)), and finite.
    base = d.arg_constraints["rate"].base_constraint
    assert isinstance(base, dist.constraints.greater_than) and base.lower_bound == 0.0
    noise = jnp.exp(jax.random.normal(jax.random.PRNGKey(0), (4, 3)))
    assert bool(d.arg_constraints["rate"](base.lower_bound + noise).all())
    assert not bool(d.arg_constraints["rate"](base.lower_bound - noise).any())
    assert not bool(base(jnp.array([jnp.inf, jnp.nan])).any())


def test_promote_batch_shape_reads_the_batch_of_rate_and_k():
    # promote_batch_shape takes each parameter's batch shape as its shape without the
    # constraint's event dims; with an event_dim-0 rate it took the 3 categories as batch.
    d = jax.vmap(lambda r, k: ConditionedPoisson(r, k=k))(jnp.asarray(RATES), jnp.asarray(KS))
    assert d.batch_shape == ()
    assert promote_batch_shape(d).batch_shape == (4,)
    d = jax.vmap(lambda k: ConditionedPoisson(jnp.asarray(RATES[0]), k=k))(jnp.asarray(KS))
    assert promote_batch_shape(d).batch_shape == (4,)


def test_observed_site_in_scan_scores_as_the_unrolled_model():
    def step(carry, x):
        rate, k, value = x
        numpyro.sample("z", ConditionedPoisson(rate, k=k), obs=value)
        return carry, None

    def scanned():
        scan(step, None, (jnp.asarray(RATES), jnp.asarray(KS), jnp.asarray(VALUES)))

    def unrolled():
        for t in range(len(KS)):
            numpyro.sample(f"z{t}", ConditionedPoisson(RATES[t], k=KS[t]), obs=VALUES[t])

    expected = sum(_scipy_log_prob(*args) for args in zip(RATES, KS, VALUES, strict=True))
    log_joint_scanned, _ = log_density(scanned, (), {}, {})
    log_joint_unrolled, _ = log_density(unrolled, (), {}, {})
    np.testing.assert_allclose(log_joint_scanned, expected, rtol=1e-12)
    np.testing.assert_allclose(log_joint_unrolled, expected, rtol=1e-12)


@pytest.mark.parametrize("k", [3.0, np.float64(3.0), np.array([3.0, 4.0]), jnp.array([3.0, 4.0])])
def test_whole_number_float_k_is_the_count(k):
    rate = RATES[:2]
    d = ConditionedPoisson(jnp.asarray(rate), k=k)
    k_int = np.broadcast_to(np.asarray(k), (2,)).astype(int)
    value = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    value[1, 0] = k_int[1]
    expected = [_scipy_log_prob(rate[b], k_int[b], value[b]) for b in (0, 1)]
    np.testing.assert_allclose(d.log_prob(jnp.asarray(value)), expected, rtol=1e-12)
    assert d.k_max is None and d._table_bound() == int(k_int.max())
    np.testing.assert_allclose(d.entropy(), oracle.multinomial_entropy(rate, k_int), rtol=1e-10)


@pytest.mark.parametrize("validate_args", [True, False])
@pytest.mark.parametrize(
    "k", [3.5, np.array([1.0, 2.5]), True, np.array([True, False]), 2 + 0j, math.nan, math.inf]
)
def test_k_that_is_no_count_is_a_value_error_whatever_validate_args(k, validate_args):
    with pytest.raises(ValueError, match=r"\bk\b"):
        ConditionedPoisson(jnp.ones((2, 3)), k=k, validate_args=validate_args)


def test_k_max_is_kept_as_given_and_the_bound_is_decided_at_call_time():
    rate = jnp.asarray(RATES[:2])
    k = np.array([3, 4])
    assert ConditionedPoisson(rate, k=k).k_max is None
    assert ConditionedPoisson(rate, k=k)._table_bound() == 4  # from the concrete k
    assert ConditionedPoisson(rate, k=k, k_max=10).k_max == 10
    assert ConditionedPoisson(rate, k=k, k_max=10)._table_bound() == 4
    assert ConditionedPoisson(rate, k=k, k_max=10.0).k_max == 10  # a whole-number float
    for bad in (3.5, -1, True, jnp.array(5)):
        with pytest.raises(ValueError, match="k_max"):
            ConditionedPoisson(rate, k=k, k_max=bad)
    with pytest.raises(ValueError, match="k_max = 3 is below the largest k = 4"):
        ConditionedPoisson(rate, k=k, k_max=3)

    # Inside jit: a traced k has the bound passed (or none); a closed-over constant k is
    # concrete and gives its own.
    bounds = {}

    def record(k):
        bounds["traced"] = ConditionedPoisson(rate, k=k)._table_bound()
        bounds["traced, k_max=7"] = ConditionedPoisson(rate, k=k, k_max=7)._table_bound()
        bounds["constant"] = ConditionedPoisson(rate, k=np.array([1, 2]))._table_bound()
        bounds["aux"] = ConditionedPoisson(rate, k=k, k_max=7).k_max
        return k

    jax.jit(record)(k)
    assert bounds == {"traced": None, "traced, k_max=7": 7, "constant": 2, "aux": 7}


OUT_OF_RANGE_K = {
    "negative": (np.array([-1, -1]), 5),
    "negative-in-batch": (np.array([2, -1]), 5),
    "above-k_max": (np.array([7, 2]), 5),
    "fractional": (np.array([2.5, 2.0]), 5),
    "negative-without-k_max": (np.array([-1, 2]), None),
}


@pytest.mark.parametrize("k, k_max", OUT_OF_RANGE_K.values(), ids=OUT_OF_RANGE_K.keys())
def test_traced_k_out_of_range_gives_minus_inf_and_nan_never_a_finite_number(k, k_max):
    rate = jnp.asarray(RATES[:2])
    value = jnp.zeros((2, 3))
    bad = (k < 0) | (k != np.floor(k)) | (k > (k_max if k_max is not None else np.inf))

    @jax.jit
    def run(k):
        d = ConditionedPoisson(rate, k=k, k_max=k_max)
        out = {
            "log_prob": d.log_prob(value),
            "log_constraint_prob": d.log_constraint_prob(),
            "mean": d.mean,
            "variance": d.variance,
            "sample": d.sample(jax.random.PRNGKey(0), (3,)),
            "kl": kl_divergence(d, d),
        }
        if k_max is not None:
            out["entropy"] = d.entropy()
            out["expected_l1"] = expected_l1_loss(d, jnp.ones(3))
        return out

    out = run(k)
    for name in ("log_prob", "log_constraint_prob"):
        assert np.all(np.asarray(out[name])[bad] == -math.inf), name
    for name in ("mean", "variance", "kl", "entropy", "expected_l1"):
        if name in out:
            x = np.asarray(out[name])
            assert np.all(np.isnan(x[bad])) and np.all(np.isfinite(x[~bad])), name
    sample = np.asarray(out["sample"])
    assert np.all(np.isnan(sample[:, bad])) and np.all(np.isfinite(sample[:, ~bad]))
    np.testing.assert_array_equal(
        sample[:, ~bad].sum(-1), np.broadcast_to(k[~bad], (3, (~bad).sum()))
    )


def test_concrete_negative_k_with_validation_off_gives_minus_inf_and_nan():
    d = ConditionedPoisson(jnp.asarray(RATES[:2]), k=np.array([3, -1]), validate_args=False)
    log_prob = d.log_prob(jnp.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    np.testing.assert_allclose(log_prob[0], _scipy_log_prob(RATES[0], 3, [1, 1, 1]), rtol=1e-12)
    assert log_prob[1] == -math.inf
    for x in (d.mean, d.variance, d.entropy(), d.sample(jax.random.PRNGKey(0))):
        assert np.all(np.isfinite(x[0])) and np.all(np.isnan(x[1]))


# Pytrees: structure independent of k's concreteness and of the methods called -------------


def _methods_called(d):
    """Calls every method and property (their results are discarded)."""
    d.log_prob(d.sample(jax.random.PRNGKey(0), (2,)))
    d.mean, d.variance, d.probs, d.support, d.marginals  # noqa: B018
    d.log_constraint_prob()
    if d._table_bound() is not None:
        d.entropy()
    kl_divergence(d, d)
    d.expand((3,) + d.batch_shape)


@pytest.mark.parametrize("k_max", [None, 9])
def test_tree_structure_is_the_same_for_concrete_and_traced_k_and_after_every_method(k_max):
    rate, k = jnp.asarray(RATES), jnp.asarray(KS)
    d = ConditionedPoisson(rate, k=k, k_max=k_max)
    treedef = jax.tree.structure(d)
    _methods_called(d)
    assert jax.tree.structure(d) == treedef
    leaves = jax.tree.leaves(d)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert jax.tree.structure(rebuilt) == treedef
    for a, b in zip(jax.tree.leaves(rebuilt), leaves, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(
        rebuilt.log_prob(jnp.asarray(VALUES)), d.log_prob(jnp.asarray(VALUES))
    )
    # Built from a traced k (an argument of jit): the same structure.
    traced_treedef = {}

    def build(rate, k):
        built = ConditionedPoisson(rate, k=k, k_max=k_max)
        traced_treedef["before"] = jax.tree.structure(built)
        _methods_called(built)
        traced_treedef["after"] = jax.tree.structure(built)
        return built

    returned = jax.jit(build)(rate, k)
    assert traced_treedef == {"before": treedef, "after": treedef}
    assert jax.tree.structure(returned) == treedef


def test_a_distribution_is_a_jit_argument_and_a_scan_carry():
    rate, k = jnp.asarray(RATES), jnp.asarray(KS)
    d = ConditionedPoisson(rate, k=k)
    value = jnp.asarray(VALUES)
    expected = np.array([_scipy_log_prob(*args) for args in zip(RATES, KS, VALUES, strict=True)])
    np.testing.assert_allclose(jax.jit(lambda d: d.log_prob(value))(d), expected, rtol=1e-12)

    # Built outside with a concrete k, rebuilt in the body from the carried (traced) k.
    def body(carry, scale):
        new = ConditionedPoisson(carry.rate * scale, k=carry.k)
        return new, new.log_prob(value)

    scales = jnp.array([1.0, 2.0, 0.5])
    final, log_probs = jax.lax.scan(body, d, scales)
    cumulative = np.cumprod(np.asarray(scales))
    # Only the proportions of the rates matter: a common scale leaves log_prob alone.
    np.testing.assert_allclose(log_probs, np.broadcast_to(expected, (3, 4)), rtol=1e-12)
    np.testing.assert_allclose(final.rate, RATES * cumulative[-1], rtol=1e-12)
    np.testing.assert_array_equal(final.k, KS)
    assert jax.tree.structure(final) == jax.tree.structure(d)


@pytest.mark.parametrize("name", ["rate", "k"])
def test_vmap_over_as_numpyro_test_vmap_dist_uses_it(name):
    # numpyro test/test_distributions.py::test_vmap_dist, with k passed by keyword.
    params = {"rate": jnp.asarray(RATES), "k": jnp.asarray(KS)}

    def make(rate, k):
        return ConditionedPoisson(rate, k=k)

    d = make(**params)
    cases = [(0, 0), (0, vmap_over(d, **{name: 0}))]
    if name == "rate":
        cases.append((1, vmap_over(d, rate=1)))
    for axis, out_axes in cases:
        in_axes = {key: (axis if key == name else None) for key in params}
        batched = {key: jnp.expand_dims(v, axis) if key == name else v for key, v in params.items()}
        batched_d = jax.vmap(make, in_axes=(in_axes["rate"], in_axes["k"]), out_axes=out_axes)(
            batched["rate"], batched["k"]
        )
        for field in ("rate", "k"):
            # rate and k are stored broadcast to the batch shape, so a batch axis of d
            # mapped on one is mapped on both (else each element would keep the whole batch).
            mapped = out_axes == 0 or field == name or axis < len(d.batch_shape)
            field_axis = axis if mapped else None
            got = getattr(batched_d, field)
            got = got if field_axis is None else jnp.take(got, 0, axis=field_axis)
            np.testing.assert_array_equal(got, getattr(d, field))
        samples = jax.vmap(lambda d: d.sample(jax.random.PRNGKey(0)), in_axes=(out_axes,))(
            batched_d
        )
        assert samples.shape == (1,) + d.batch_shape + d.event_shape
        np.testing.assert_array_equal(samples.sum(-1), np.broadcast_to(KS, (1, 4)))


# Validation -------------------------------------------------------------------------------


def test_validation_inside_jit_checks_closed_over_constants_and_never_converts_a_tracer():
    rate, k, value = jnp.asarray(RATES), np.array(KS), jnp.asarray(VALUES)

    @jax.jit
    def everything(scale):
        d = ConditionedPoisson(rate, k=k, validate_args=True)
        traced = ConditionedPoisson(rate * scale, k=jnp.asarray(k) * 1, validate_args=True)
        out = []
        for dist_ in (d, traced):
            out += [dist_.log_prob(value), dist_.mean, dist_.variance, dist_.log_constraint_prob()]
            out.append(dist_.sample(jax.random.PRNGKey(0)))
        out.append(d.entropy())
        out.append(kl_divergence(d, traced))
        return out

    out = everything(1.0)
    expected = np.array([_scipy_log_prob(*args) for args in zip(RATES, KS, VALUES, strict=True)])
    np.testing.assert_allclose(out[0], expected, rtol=1e-12)
    np.testing.assert_allclose(out[5], expected, rtol=1e-12)
    # Concrete constants are still checked inside jit.
    negative_rate, negative_k = -rate, -k
    with pytest.raises(ValueError, match="rate"):
        jax.jit(lambda s: ConditionedPoisson(negative_rate, k=k, validate_args=True).mean * s)(1.0)
    with pytest.raises(ValueError, match=r"\bk\b"):
        jax.jit(lambda s: ConditionedPoisson(rate, k=negative_k, validate_args=True).mean * s)(1.0)


OUT_OF_SUPPORT = np.array([[1.0, 1.0, 0.0], [0.0, 1.0, 3.0], [2.0, 0.0, 0.0], [1.0, 2.0, 2.0]])


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32, jnp.int32, jnp.int64])
@pytest.mark.parametrize("path", ["eager", "jit-closed-over", "sample-shape", "k_max"])
def test_out_of_support_values_warn_and_give_minus_inf(dtype, path):
    rate, k = jnp.asarray(RATES), np.array(KS)
    value = jnp.asarray(OUT_OF_SUPPORT, dtype)
    k_max = 9 if path == "k_max" else None
    d = ConditionedPoisson(rate, k=k, k_max=k_max, validate_args=True)
    if path == "sample-shape":
        value = jnp.stack([value, jnp.asarray(VALUES, dtype)])
    with pytest.warns(UserWarning, match="Out-of-support values provided to log prob method"):
        if path == "jit-closed-over":
            log_prob = jax.jit(lambda s: ConditionedPoisson(rate, k=k).log_prob(value) * s)(1.0)
        else:
            log_prob = d.log_prob(value)
    log_prob = np.asarray(log_prob).reshape(-1, 4)
    assert log_prob[0, 0] == -math.inf and np.all(np.isfinite(log_prob[0, 1:]))
    quiet = ConditionedPoisson(rate, k=k, k_max=k_max, validate_args=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert quiet.log_prob(value).reshape(-1, 4)[0, 0] == -math.inf


@pytest.mark.parametrize("shape", [(2,), (4, 2), (4, 4), (3, 3), (2, 3, 3), (5, 4, 3, 1)], ids=str)
@pytest.mark.parametrize("jit", [False, True])
def test_a_value_of_the_wrong_shape_is_a_value_error_naming_the_expected_shape(shape, jit):
    d = ConditionedPoisson(jnp.asarray(RATES), k=KS)
    log_prob = jax.jit(d.log_prob) if jit else d.log_prob
    with pytest.raises(ValueError, match=r"expected a shape broadcasting with \(\.\.\., 4, 3\)"):
        log_prob(jnp.zeros(shape))


def test_repr_names_each_parameter_by_value_or_shape():
    # The Pyro package's format, with shapes as tuples.
    rate = jnp.ones((3, 4))
    assert repr(ConditionedPoisson(rate, k=jnp.array([1, 2, 3]))) == (
        "ConditionedPoisson(rate: (3, 4), k: (3,))"
    )
    assert repr(ConditionedPoisson(rate[0], k=7.0)) == "ConditionedPoisson(rate: (4,), k: 7)"


def test_mode_is_a_brute_force_mode_with_ties_to_the_lower_index():
    # Every case in one batch (one set of dispatched ops), padded with zero rates, which
    # take no unit.
    cases = oracle.MODE_CASES
    rate = np.concatenate([np.tile(np.pad(r, (0, 5 - len(r))), (len(k), 1)) for r, k in cases])
    k = np.concatenate([k for _, k in cases])
    d = ConditionedPoisson(jnp.asarray(rate), k=jnp.asarray(k), validate_args=False)
    mode = np.asarray(d.mode)
    np.testing.assert_array_equal(mode.sum(-1), k)
    oracle.check_mode_against_brute_force(np.asarray(d.rate, np.float64), k, mode)


def test_mode_under_jit_with_a_traced_k_and_no_bound_and_at_large_n():
    """A traced ``k`` without ``k_max`` bounds the candidates by the dtype's exact integers;
    at n = 2e4 and k = 2e5 the mode takes one sort (the loop it replaces handed out up to n
    units one at a time, each a pass over n)."""
    rate = jnp.asarray([[0.05, 0.9, 0.05, 2.2], [1.0, 1.0, 1.0, 1.0]])
    k = jnp.asarray([9, 6])
    mode = jax.jit(lambda r, k: ConditionedPoisson(r, k=k).mode)(rate, k)
    eager = ConditionedPoisson(rate, k=k).mode
    np.testing.assert_array_equal(np.asarray(mode), np.asarray(eager))
    oracle.check_mode_against_brute_force(np.asarray(rate, np.float64), np.asarray(k), eager)
    big = np.random.default_rng(3).gamma(1.0, size=(1, 20_000)) + 1e-3
    d = ConditionedPoisson(jnp.asarray(big), k=200_000)
    mode = np.asarray(d.mode, np.float64)
    assert mode.sum() == 200_000
    log_p = oracle.reference_log_p(np.asarray(d.rate, np.float64))
    assert oracle.is_locally_optimal(log_p, mode)
