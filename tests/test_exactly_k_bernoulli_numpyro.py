"""numpyro_constrained.ExactlyKBernoulli against enumeration, SciPy, finite differences and
goodness-of-fit tests, and through jit / vmap / grad and SVI."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as ndist
import pytest
from numpyro.distributions.batch_util import vmap_over
from numpyro.distributions.kl import kl_divergence
from numpyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO

from numpyro_constrained import ExactlyKBernoulli
from numpyro_constrained.losses import expected_l1_loss, expected_l2_loss
from tests.oracles import exactly_k as oracle
from tests.test_exactly_k_bernoulli_pyro import BAD_INPUTS, CASES, OUTSIDE

INF = math.inf


def _key(seed: int = 0) -> jax.Array:
    return jax.random.PRNGKey(seed)


def _jnp_kwargs(kwargs: dict) -> dict:
    """The torch tensors of the shared bad-input table as NumPy arrays."""
    converted = {}
    for name, value in kwargs.items():
        if hasattr(value, "numpy"):
            value = value.numpy()
            value = jnp.asarray(value) if value.dtype != np.int64 else np.asarray(value)
        converted[name] = value
    return converted


@pytest.mark.parametrize("logits, ks", CASES)
def test_log_prob_marginals_entropy_match_enumeration(logits, ks):
    d = ExactlyKBernoulli(logits=jnp.asarray(logits), k=jnp.asarray(ks))
    assert d.batch_shape == (len(ks),) and d.event_shape == (logits.shape[1],)
    mean, variance, entropy = np.asarray(d.mean), np.asarray(d.variance), np.asarray(d.entropy())
    unvalidated = ExactlyKBernoulli(
        logits=jnp.asarray(logits), k=jnp.asarray(ks), validate_args=False
    )
    for row, (theta, k) in enumerate(zip(logits, ks, strict=True)):
        subsets, probs = oracle.exactly_k_pmf(theta, k)
        # Score every subset under the whole batch and keep this row's column.
        log_probs = np.asarray(unvalidated.log_prob(jnp.asarray(subsets)[:, None, :])[:, row])
        np.testing.assert_allclose(log_probs, np.log(probs), atol=1e-10, rtol=0)
        expected_mu = oracle.exactly_k_marginals(theta, k)
        np.testing.assert_allclose(mean[row], expected_mu, atol=1e-10, rtol=0)
        np.testing.assert_allclose(variance[row], expected_mu * (1 - expected_mu), atol=1e-10)
        np.testing.assert_allclose(entropy[row], oracle.exactly_k_entropy(theta, k), atol=1e-10)
        np.testing.assert_allclose(d.marginals.probs[row], expected_mu, atol=1e-10)


def test_simple_reference_vector():
    # SIMPLE (Ahmed et al. 2023), worked example: probs [.3, .6, .5, .2], k = 2.
    d = ExactlyKBernoulli(probs=jnp.array([0.3, 0.6, 0.5, 0.2]), k=2)
    np.testing.assert_allclose(d.mean, [0.35676, 0.76216, 0.65946, 0.22162], atol=5e-6)
    assert abs(float(jnp.exp(d.log_constraint_prob())) - 0.37) < 1e-12
    assert abs(float(d.entropy()) - 1.49549) < 5e-6


@pytest.mark.parametrize("logits, ks", CASES)
def test_log_constraint_prob_matches_poisson_binomial(logits, ks):
    got = np.asarray(
        ExactlyKBernoulli(logits=jnp.asarray(logits), k=jnp.asarray(ks)).log_constraint_prob()
    )
    for row, (theta, k) in enumerate(zip(logits, ks, strict=True)):
        np.testing.assert_allclose(got[row], oracle.log_constraint_prob(theta, k), rtol=1e-9)


def test_kl_matches_enumeration():
    # One batch (one compilation): three random pairs, and a pair with infinite logits whose
    # KL is finite one way and infinite the other.
    rng = np.random.default_rng(2)
    p_logits = rng.normal(size=(4, 5)) * 2
    q_logits = rng.normal(size=(4, 5)) * 2
    p_logits[3] = [INF, 0.3, -INF, 1.0, -0.5]
    q_logits[3] = [INF, 0.1, 0.0, -1.0, 2.0]
    ks = np.array([2, 3, 5, 2])
    p = ExactlyKBernoulli(logits=jnp.asarray(p_logits), k=jnp.asarray(ks))
    q = ExactlyKBernoulli(logits=jnp.asarray(q_logits), k=jnp.asarray(ks))
    forward, backward = np.asarray(kl_divergence(p, q)), np.asarray(kl_divergence(q, p))
    for row in range(4):
        want = oracle.exactly_k_kl(p_logits[row], q_logits[row], ks[row])
        assert abs(forward[row] - want) < 1e-10
    for row in range(3):
        want = oracle.exactly_k_kl(q_logits[row], p_logits[row], ks[row])
        assert abs(backward[row] - want) < 1e-10
    assert backward[3] == INF == oracle.exactly_k_kl(q_logits[3], p_logits[3], 2)


def test_kl_rejects_different_k_or_n():
    p = ExactlyKBernoulli(logits=jnp.zeros(5), k=2)
    with pytest.raises(ValueError, match="same k"):
        kl_divergence(p, ExactlyKBernoulli(logits=jnp.zeros(5), k=3))
    with pytest.raises(ValueError, match="same n"):
        kl_divergence(p, ExactlyKBernoulli(logits=jnp.zeros(6), k=2))


@pytest.mark.parametrize("logits, ks", CASES[2:])
def test_expected_losses_match_enumeration_and_their_gradients(logits, ks):
    rng = np.random.default_rng(3)
    targets = np.stack([oracle.k_subsets(logits.shape[1], k)[0] for k in ks])
    rng.shuffle(targets, axis=1)

    def losses(theta):
        d = ExactlyKBernoulli(logits=theta, k=jnp.asarray(ks))
        return expected_l1_loss(d, jnp.asarray(targets)), expected_l2_loss(d, jnp.asarray(targets))

    l1, l2 = losses(jnp.asarray(logits))
    for row, (t, k) in enumerate(zip(logits, ks, strict=True)):
        want_l1, want_l2 = oracle.exactly_k_expected_losses(t, k, targets[row])
        assert abs(float(l1[row]) - want_l1) < 1e-10
        assert abs(float(l2[row]) - want_l2) < 1e-10
    grad = np.asarray(jax.grad(lambda theta: losses(theta)[1][0])(jnp.asarray(logits)))
    t0, k0, h = logits[0], ks[0], 1e-6
    for i in np.flatnonzero(np.isfinite(t0)):
        up, down = t0.copy(), t0.copy()
        up[i] += h
        down[i] -= h
        fd = (
            oracle.exactly_k_expected_losses(up, k0, targets[0])[1]
            - oracle.exactly_k_expected_losses(down, k0, targets[0])[1]
        ) / (2 * h)
        assert abs(grad[0, i] - fd) < 1e-7


def test_samples_follow_the_enumerated_pmf():
    logits = np.array(
        [[0.5, -1.0, 2.0, 0.0, -0.3], [INF, -INF, 1.0, -1.5, 0.7], [3.0, -2.0, 0.0, 1.0, -4.0]]
    )
    ks = np.array([2, 2, 3])
    samples = ExactlyKBernoulli(logits=jnp.asarray(logits), k=jnp.asarray(ks)).sample(
        _key(2), (4000,)
    )
    assert samples.shape == (4000, 3, 5) and samples.dtype == jnp.float64
    for row in range(3):
        # p > 1e-3 fails by chance once in a thousand seeds; the seed is fixed.
        pvalue = oracle.chi_square_pvalue(np.asarray(samples[:, row]), logits[row], ks[row])
        assert pvalue > 1e-3


def test_float32_samples_follow_the_enumerated_pmf():
    theta = np.array([0.5, -1.0, 2.0, 0.0, -0.3, 1.2])
    d = ExactlyKBernoulli(logits=jnp.asarray(theta, dtype=jnp.float32), k=3)
    samples = d.sample(_key(2), (3000,))
    assert samples.dtype == jnp.float32
    assert oracle.chi_square_pvalue(np.asarray(samples, dtype=np.float64), theta, 3) > 1e-3


def test_sample_is_exact_and_its_gradient_is_the_marginals_jvp():
    theta = np.array([0.5, -1.0, 2.0, -INF, 0.0, INF, -0.3])
    weights = np.array([1.0, -2.0, 0.5, 3.0, 1.5, -1.0, 0.25])
    z = ExactlyKBernoulli(logits=jnp.asarray(theta), k=3).sample(_key(3), (6,))
    assert bool(jnp.all((z == 0) | (z == 1))) and bool(jnp.all(z.sum(-1) == 3))

    def weighted(x):
        return (ExactlyKBernoulli(logits=x, k=3).sample(_key(3), (6,)) * weights).sum()

    grad = np.asarray(jax.grad(weighted)(jnp.asarray(theta)))
    h = 1e-6
    finite = np.isfinite(theta)
    step = np.where(finite, weights, 0.0) * h
    fd = (
        oracle.exactly_k_marginals(theta + step, 3) - oracle.exactly_k_marginals(theta - step, 3)
    ) / (2 * h)
    np.testing.assert_allclose(grad, 6 * np.where(finite, fd, 0.0), atol=1e-6)


def _central_differences(f, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """d f / d x_i (f vector-valued) by central differences, rows indexed by i."""
    rows = []
    for i in range(len(x)):
        step = np.zeros_like(x)
        step[i] = h
        rows.append(
            (np.asarray(f(jnp.asarray(x + step))) - np.asarray(f(jnp.asarray(x - step)))) / (2 * h)
        )
    return np.stack(rows)


def test_gradients_match_finite_differences_and_stay_finite_at_infinite_logits():
    theta = np.array([0.5, -1.0, 2.0, 0.0, -0.3])
    value = jnp.array([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    weights = jnp.arange(7.0)

    def with_forced(x):
        # Infinite logits at fixed places, so finite differences only move the finite ones.
        return jnp.concatenate([x[:2], jnp.array([-INF]), x[2:], jnp.array([INF])])

    def scalars(x):
        d = ExactlyKBernoulli(logits=with_forced(x), k=3)
        return jnp.stack([d.log_prob(value), d.entropy(), d.log_constraint_prob()])

    def weighted_mean(x):
        # Differentiating the marginals is differentiating log e_k twice (as SVI does
        # through a straight-through sample).
        return (ExactlyKBernoulli(logits=with_forced(x), k=3).mean * weights).sum()

    jacobian = np.asarray(jax.jacrev(scalars)(jnp.asarray(theta)))
    np.testing.assert_allclose(jacobian, _central_differences(scalars, theta).T, atol=1e-7)
    grad = jax.grad(weighted_mean)(jnp.asarray(theta))
    fd = _central_differences(weighted_mean, theta)
    np.testing.assert_allclose(grad, fd, atol=1e-7)
    # The gradient with respect to the infinite logits themselves: finite (zero), no NaN.
    full = jax.grad(lambda y: (ExactlyKBernoulli(logits=y, k=3).mean * weights).sum())(
        with_forced(jnp.asarray(theta))
    )
    assert bool(jnp.all(jnp.isfinite(full))) and full[2] == 0 and full[6] == 0


def test_mode_is_the_most_likely_subset_with_deterministic_ties():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(5, 6))
    ks = np.array([0, 1, 2, 3, 6])
    mode = ExactlyKBernoulli(logits=jnp.asarray(logits), k=jnp.asarray(ks)).mode
    for row in range(5):
        subsets, probs = oracle.exactly_k_pmf(logits[row], ks[row])
        np.testing.assert_array_equal(mode[row], subsets[np.argmax(probs)])
    tied = ExactlyKBernoulli(logits=jnp.zeros(5), k=2).mode
    assert tied.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_probs_zero_and_one_work_like_infinite_logits():
    probs = jnp.array([1.0, 0.0, 0.4, 0.7, 0.2])
    logits = jnp.array([INF, -INF, math.log(0.4 / 0.6), math.log(0.7 / 0.3), math.log(0.25)])
    # Without validation: vectors that the infinite logits rule out get -inf.
    from_probs = ExactlyKBernoulli(probs=probs, k=2, validate_args=False)
    from_logits = ExactlyKBernoulli(logits=logits, k=2, validate_args=False)
    subsets = jnp.asarray(oracle.k_subsets(5, 2))
    log_probs = np.asarray(from_probs.log_prob(subsets))
    np.testing.assert_allclose(log_probs, from_logits.log_prob(subsets), atol=1e-12)
    allowed = np.asarray((subsets[:, 0] == 1) & (subsets[:, 1] == 0))
    assert np.all(log_probs[~allowed] == -INF) and np.all(np.isfinite(log_probs[allowed]))
    # With validation: such a vector is outside the support, a ValueError.
    for bad in ([0.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0, 0.0]):
        with pytest.raises(ValueError, match="infinite logits allow"):
            ExactlyKBernoulli(probs=probs, k=2).log_prob(jnp.asarray(bad))
    np.testing.assert_allclose(from_probs.mean, from_logits.mean, atol=1e-12)
    z = from_probs.sample(_key(), (200,))
    assert bool(jnp.all(z[:, 0] == 1) & jnp.all(z[:, 1] == 0) & jnp.all(z.sum(-1) == 2))
    assert from_probs.probs is probs or bool(jnp.all(from_probs.probs == probs))


def test_shapes_batch_expand_sample_shape_and_infer_shapes():
    logits = jax.random.normal(_key(), (3, 1, 6))
    k = jnp.array([1, 2, 3, 4])
    d = ExactlyKBernoulli(logits=logits, k=k)
    assert d.batch_shape == (3, 4) and d.event_shape == (6,)
    z = d.sample(_key(), (2, 5))
    assert z.shape == (2, 5, 3, 4, 6) and bool(jnp.all(z.sum(-1) == k))
    assert d.log_prob(z).shape == (2, 5, 3, 4)
    assert d.mean.shape == (3, 4, 6) and d.entropy().shape == (3, 4)
    assert d.log_constraint_prob().shape == (3, 4) and d.mode.shape == (3, 4, 6)
    e = ExactlyKBernoulli(logits=jax.random.normal(_key(1), (6,)), k=2).expand((3, 4))
    assert type(e) is ExactlyKBernoulli and e.batch_shape == (3, 4)
    assert e.sample(_key(), (2, 5)).shape == (2, 5, 3, 4, 6) and e.entropy().shape == (3, 4)
    np.testing.assert_allclose(e.entropy(), jnp.broadcast_to(e.entropy()[0, 0], (3, 4)))
    assert ExactlyKBernoulli.infer_shapes(logits=(3, 1, 6), k=(4,)) == ((3, 4), (6,))
    assert ExactlyKBernoulli.infer_shapes(probs=(6,)) == ((), (6,))


def test_plates_give_the_right_shapes():
    def model():
        with numpyro.plate("rows", 4, dim=-1):
            return numpyro.sample("z", ExactlyKBernoulli(logits=jnp.zeros(6), k=2))

    trace = numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace()
    site = trace["z"]
    assert site["value"].shape == (4, 6)
    log_prob = site["fn"].log_prob(site["value"])
    np.testing.assert_allclose(log_prob, np.full(4, -math.log(math.comb(6, 2))), atol=1e-12)


def test_jit_vmap_and_grad():
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.normal(size=(3, 5)))
    ks = jnp.array([1, 2, 4])
    value = jnp.array([[0.0, 1, 0, 0, 0], [1.0, 0, 0, 1, 0], [1.0, 1, 1, 1, 0]])

    def summary(x, k):
        d = ExactlyKBernoulli(logits=x, k=k)
        return d.log_prob(value), d.entropy(), d.mean, d.sample(_key(), (2,))

    eager = summary(logits, ks)
    # k traced too: the kernels then work with tables of size n (k_max = n).
    jitted = jax.jit(summary)(logits, ks)
    vmapped = jax.vmap(lambda x, k, v: ExactlyKBernoulli(logits=x, k=k).log_prob(v))(
        logits, ks, value
    )
    for got, want in zip(jitted[:3], eager[:3], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-12)
    np.testing.assert_allclose(vmapped, eager[0], atol=1e-12)
    assert bool(jnp.all(jitted[3].sum(-1) == ks))
    for row in range(3):
        np.testing.assert_allclose(
            eager[1][row],
            oracle.exactly_k_entropy(np.asarray(logits[row]), int(ks[row])),
            atol=1e-10,
        )
    # A distribution passes through jit and vmap as a pytree (vmap_over gives its axes).
    d = ExactlyKBernoulli(logits=logits, k=ks)
    np.testing.assert_allclose(jax.jit(lambda d: d.entropy())(d), eager[1], atol=1e-12)
    batched = jax.vmap(
        lambda x: ExactlyKBernoulli(logits=x, k=2),
        out_axes=vmap_over(ExactlyKBernoulli(logits=logits[0], k=2), logits=0),
    )(logits)
    assert batched.logits.shape == (3, 5)
    np.testing.assert_allclose(batched.entropy(), ExactlyKBernoulli(logits=logits, k=2).entropy())


@pytest.mark.parametrize("kwargs, message", BAD_INPUTS)
def test_bad_input_raises_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExactlyKBernoulli(**_jnp_kwargs(kwargs), validate_args=True)


@pytest.mark.parametrize("value", OUTSIDE)
def test_log_prob_outside_the_support(value):
    logits = jnp.array([INF, -INF, 0.3, -0.2])
    value = jnp.array(value)
    unvalidated = ExactlyKBernoulli(logits=logits, k=2, validate_args=False)
    assert float(unvalidated.log_prob(value)) == -INF
    if value.sum() != 2 or not bool(jnp.all((value == 0) | (value == 1))):
        with pytest.raises(ValueError, match="k-hot"):
            ExactlyKBernoulli(logits=logits, k=2, validate_args=True).log_prob(value)


def test_float32_large_n_is_finite_and_close_to_float64():
    rng = np.random.default_rng(5)
    n = 300
    ks = jnp.array([0, 1, 2, 37, 150, 263, 298, 299, 300])
    logits = jnp.broadcast_to(jnp.asarray(rng.normal(-1.0, 6.0, size=n)), (len(ks), n))
    d64 = ExactlyKBernoulli(logits=logits, k=ks)
    d32 = ExactlyKBernoulli(logits=logits.astype(jnp.float32), k=ks)
    mu32 = d32.mean
    assert mu32.dtype == jnp.float32
    for value in (mu32, d32.entropy(), d32.log_constraint_prob(), d32.log_prob(d32.mode)):
        assert value.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(value)))
    assert float(jnp.abs(mu32.astype(jnp.float64) - d64.mean).max()) < 1e-4
    z = d32.sample(_key())
    assert z.dtype == jnp.float32 and bool(jnp.all(z.sum(-1) == ks))
    # k = 0 and k = n (rows 0 and -1) are deterministic: exact values, zero entropy.
    assert bool(jnp.all(z[0] == 0) & jnp.all(z[-1] == 1))
    assert bool(jnp.all(mu32[0] == 0) & jnp.all(mu32[-1] == 1))
    assert float(jnp.abs(d32.entropy()[np.array([0, -1])]).max()) < 1e-3
    # Gradients through the straight-through sample and the entropy stay finite in float32.
    grad = jax.grad(
        lambda x: (
            ExactlyKBernoulli(logits=x, k=ks).sample(_key()).sum()
            + ExactlyKBernoulli(logits=x, k=ks).entropy().sum()
        )
    )(logits.astype(jnp.float32))
    assert grad.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(grad)))


def _svi_recovers_the_subset(elbo) -> None:
    n, k = 8, 3
    truth = np.zeros(n)
    truth[[1, 4, 6]] = 1.0
    data = jnp.asarray(truth + 0.4 * np.random.default_rng(7).normal(size=(6, n)))
    # The exact posterior is ExactlyKBernoulli with these logits (flat prior, Gaussian noise);
    # check that the problem is well posed, i.e. its mode is the truth.
    posterior_logits = ((2 * data - 1) / (2 * 0.4**2)).sum(0)
    assert np.array_equal(ExactlyKBernoulli(logits=posterior_logits, k=k).mode, truth)

    def model():
        z = numpyro.sample("z", ExactlyKBernoulli(logits=jnp.zeros(n), k=k))
        with numpyro.plate("data", data.shape[0], dim=-1):
            numpyro.sample("x", ndist.Normal(z, 0.4).to_event(1), obs=data)

    def guide():
        logits = numpyro.param("logits", jnp.zeros(n))
        numpyro.sample("z", ExactlyKBernoulli(logits=logits, k=k))

    svi = SVI(model, guide, numpyro.optim.Adam(0.1), elbo)
    result = svi.run(_key(8), 150, progress_bar=False)
    learned = result.params["logits"]
    assert np.array_equal(ExactlyKBernoulli(logits=learned, k=k).mode, truth)
    # The straight-through estimator is biased, so the guide need not reach the (nearly
    # deterministic) exact posterior: assert that the true features stand clearly apart.
    mu = np.asarray(ExactlyKBernoulli(logits=learned, k=k).mean)
    assert mu[truth == 1].min() > 0.5
    assert mu[truth == 1].min() - mu[truth == 0].max() > 0.25


# SVI warns that it "does not support models with discrete latent variables": it means
# enumeration, which a reparameterised (straight-through) site does not need.
@pytest.mark.filterwarnings("ignore:Currently, SVI")
def test_svi_trace_elbo_recovers_the_subset():
    _svi_recovers_the_subset(Trace_ELBO())


@pytest.mark.filterwarnings("ignore:Currently, SVI")
def test_svi_trace_mean_field_elbo_recovers_the_subset():
    _svi_recovers_the_subset(TraceMeanField_ELBO())
