"""ConditionedPoisson in pyro_constrained, against SciPy, enumeration and finite differences."""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from scipy import special, stats

import pyro_constrained._conditioned_poisson_sampler as sampler_module
from pyro_constrained import ConditionedPoisson
from pyro_constrained.losses import expected_l1_loss, expected_l2_loss
from tests.oracles import poisson as oracle

DTYPES = [torch.float32, torch.float64]
# Relative tolerance of float32 results against float64 references.
F32_RTOL = 2e-5


def _tol(dtype):
    return dict(rtol=F32_RTOL, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-11, atol=0)


# log_prob ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_prob_matches_scipy_multinomial_with_per_batch_k(dtype):
    rng = np.random.default_rng(1)
    rate = rng.gamma(1.0, size=(3, 4)) + 0.05
    k = np.array([0, 3, 7])
    value = np.stack([rng.multinomial(k_b, r / r.sum()) for k_b, r in zip(k, rate, strict=True)])
    d = ConditionedPoisson(torch.tensor(rate, dtype=dtype), k=torch.tensor(k))
    log_prob = d.log_prob(torch.tensor(value, dtype=dtype))
    assert log_prob.dtype == dtype and log_prob.shape == (3,)
    expected = oracle.multinomial_logpmf(rate, k, value)
    np.testing.assert_allclose(log_prob.double().numpy(), expected, **_tol(dtype))


def test_log_prob_matches_the_definition_by_enumeration():
    rate = np.array([0.3, 1.7, 2.0])
    support, pmf = oracle.conditioned_poisson_pmf(rate, 5)
    d = ConditionedPoisson(torch.tensor(rate), k=5)
    np.testing.assert_allclose(d.log_prob(torch.tensor(support, dtype=torch.float64)), np.log(pmf))


def test_log_prob_gradient_in_value_is_minus_digamma_plus_log_p():
    # Regression: a log-factorial table lookup through value.long() cut this gradient.
    rate = np.array([[0.5, 1.0, 2.5, 1.0], [3.0, 0.2, 0.2, 0.6]])
    value = torch.tensor([[0.0, 2.0, 3.0, 1.0], [4.0, 0.0, 1.0, 1.0]], requires_grad=True)
    k = value.detach().sum(-1).long()
    d = ConditionedPoisson(torch.tensor(rate, dtype=torch.float32), k=k)
    (grad,) = torch.autograd.grad(d.log_prob(value).sum(), value)
    p = rate / rate.sum(-1, keepdims=True)
    expected = -special.digamma(value.detach().numpy() + 1.0) + np.log(p)
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-5)


def test_log_prob_gradient_in_value_through_the_large_batch_path():
    # Batches larger than k use the table lookup; its backward must still be digamma.
    rng = np.random.default_rng(2)
    rate = rng.gamma(1.0, size=(50, 6)) + 0.1
    value_np = np.stack([rng.multinomial(3, r / r.sum()) for r in rate]).astype(np.float64)
    value = torch.tensor(value_np, requires_grad=True)
    d = ConditionedPoisson(torch.tensor(rate), k=3)
    (grad,) = torch.autograd.grad(d.log_prob(value).sum(), value)
    expected = -special.digamma(value_np + 1.0) + np.log(rate / rate.sum(-1, keepdims=True))
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-12)


def test_log_prob_gradient_in_rate_matches_finite_differences_of_scipy():
    rate = np.array([0.7, 1.3, 2.1, 0.4])
    value = np.array([1.0, 2.0, 2.0, 0.0])
    rate_t = torch.tensor(rate, requires_grad=True)
    ConditionedPoisson(rate_t, k=5).log_prob(torch.tensor(value)).backward()
    step = 1e-6
    expected = [
        (
            oracle.multinomial_logpmf(rate + step * e, 5, value)
            - oracle.multinomial_logpmf(rate - step * e, 5, value)
        )
        / (2 * step)
        for e in np.eye(4)
    ]
    np.testing.assert_allclose(rate_t.grad.numpy(), expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "value",
    [[-1.0, 3.0, 2.0], [0.5, 2.5, 1.0], [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [math.nan, 2.0, 2.0]],
    ids=["negative", "non-integer", "sum-below-k", "sum-above-k", "nan"],
)
def test_log_prob_outside_the_support(value):
    rate = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="support|sum to exactly k"):
        ConditionedPoisson(rate, k=4).log_prob(torch.tensor(value))
    log_prob = ConditionedPoisson(rate, k=4, validate_args=False).log_prob(torch.tensor(value))
    assert log_prob.item() == -math.inf


def test_log_prob_outside_the_support_leaves_the_rest_of_the_batch_and_its_gradient_alone():
    rate = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]], requires_grad=True)
    value = torch.tensor([[-1.0, 3.0, 2.0], [0.0, 2.0, 2.0]], requires_grad=True)
    log_prob = ConditionedPoisson(rate, k=4, validate_args=False).log_prob(value)
    assert log_prob[0] == -math.inf
    expected = stats.multinomial(4, [1 / 3] * 3).logpmf([0, 2, 2])
    assert log_prob[1].item() == pytest.approx(expected, rel=1e-6)
    log_prob[1].backward()
    assert torch.isfinite(rate.grad).all() and torch.isfinite(value.grad).all()


def test_log_prob_rejects_a_value_of_the_wrong_event_size():
    with pytest.raises(ValueError, match="event shape"):
        ConditionedPoisson(torch.ones(3), k=2).log_prob(torch.tensor([1.0, 1.0]))


# Bad parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rate", [[1.0, 0.0, 2.0], [1.0, -1.0, 2.0], [1.0, math.nan, 2.0], [1.0, math.inf, 2.0]]
)
def test_bad_rate_raises_value_error_naming_rate(rate):
    with pytest.raises(ValueError, match="rate"):
        ConditionedPoisson(torch.tensor(rate), k=2)


@pytest.mark.parametrize("k", [-1, 2.5, torch.tensor([1.0, -2.0]), True])
def test_bad_k_raises_value_error_naming_k(k):
    with pytest.raises(ValueError, match="k"):
        ConditionedPoisson(torch.ones(2, 3), k=k)


def test_shape_mismatch_between_rate_and_k_raises_value_error():
    with pytest.raises(ValueError, match="k of shape .* does not broadcast"):
        ConditionedPoisson(torch.ones(2, 3), k=torch.tensor([1, 2, 3]))


def test_scalar_rate_raises_value_error():
    with pytest.raises(ValueError, match="rate must have at least one dimension"):
        ConditionedPoisson(torch.tensor(1.0), k=2)


# Sampling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sequential", [False, True], ids=["categorical", "sequential-binomial"])
def test_samples_pass_chi_square_against_enumeration(monkeypatch, sequential):
    if sequential:
        monkeypatch.setattr(sampler_module, "SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY", 0)
    rate = np.array([0.5, 1.0, 2.5])
    samples = ConditionedPoisson(torch.tensor(rate), k=4).sample((4000,))
    assert oracle.composition_chi_square_pvalue(samples.numpy(), rate, 4) > 1e-3


@pytest.mark.parametrize("sequential", [False, True], ids=["categorical", "sequential-binomial"])
def test_per_batch_k_samples_are_exact(monkeypatch, sequential):
    if sequential:
        monkeypatch.setattr(sampler_module, "SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY", 0)
    rate = np.array([[1.0, 2.0, 1.0], [0.2, 0.3, 3.0]])
    k = torch.tensor([2, 5])
    samples = ConditionedPoisson(torch.tensor(rate), k=k).sample((3000,))
    assert samples.shape == (3000, 2, 3)
    assert torch.equal(samples.sum(-1), k.double().expand(3000, 2))
    for b in range(2):
        pvalue = oracle.composition_chi_square_pvalue(samples[:, b].numpy(), rate[b], int(k[b]))
        assert pvalue > 1e-3


def test_large_k_sample_marginal_passes_chi_square_against_binomial():
    # k far above 32 n takes the sequential-binomial path.
    rate = np.array([1.0, 3.0])
    samples = ConditionedPoisson(torch.tensor(rate), k=300).sample((4000,))
    assert torch.equal(samples.sum(-1), torch.full((4000,), 300.0, dtype=torch.float64))
    observed = np.bincount(samples[:, 0].long().numpy(), minlength=301)
    probs = stats.binom.pmf(np.arange(301), 300, 0.25)
    assert oracle.binned_chi_square_pvalue(observed, probs) > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_rsample_is_exactly_integer_and_sums_exactly_to_k(dtype):
    rate = torch.rand(5, 7, dtype=dtype) + 0.1
    k = torch.tensor([0, 1, 9, 30, 500])
    z = ConditionedPoisson(rate.requires_grad_(), k=k).rsample((3,))
    assert z.dtype == dtype and z.shape == (3, 5, 7) and z.requires_grad
    assert torch.equal(z, z.round()) and (z >= 0).all()
    assert torch.equal(z.sum(-1), k.to(dtype).expand(3, 5))


def test_rsample_gradient_is_the_jacobian_vector_product_of_the_mean():
    rng = np.random.default_rng(3)
    rate = rng.gamma(1.0, size=(2, 4)) + 0.1
    k = np.array([3, 8])
    weights = rng.normal(size=(6, 2, 4))
    rate_t = torch.tensor(rate, requires_grad=True)
    z = ConditionedPoisson(rate_t, k=torch.tensor(k)).rsample((6,))
    (grad,) = torch.autograd.grad((torch.tensor(weights) * z).sum(), rate_t)
    jacobian = oracle.mean_jacobian(rate, k)
    expected = np.einsum("sbi,bij->bj", weights, jacobian)
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-12)


def test_sample_has_no_gradient():
    rate = torch.ones(3, requires_grad=True)
    assert not ConditionedPoisson(rate, k=2).sample().requires_grad


# Moments, marginals, constraint probability -----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_and_variance_match_enumeration(dtype):
    rate = np.array([[0.5, 1.0, 2.5], [2.0, 2.0, 0.1]])
    d = ConditionedPoisson(torch.tensor(rate, dtype=dtype), k=torch.tensor([4, 6]))
    for b, k in enumerate([4, 6]):
        mean, variance = oracle.enumerated_mean_and_variance(rate[b], k)
        rtol = 1e-6 if dtype == torch.float32 else 1e-10
        np.testing.assert_allclose(d.mean[b].double().numpy(), mean, rtol=rtol)
        np.testing.assert_allclose(d.variance[b].double().numpy(), variance, rtol=rtol)
    assert d.mean.dtype == dtype


def test_marginals_are_binomials_matching_scipy():
    rate = np.array([0.5, 1.0, 2.5])
    marginals = ConditionedPoisson(torch.tensor(rate), k=6).marginals
    assert isinstance(marginals, dist.Binomial)
    values = torch.tensor([[0.0, 3.0, 6.0]], dtype=torch.float64)
    expected = stats.binom.logpmf(values.numpy(), 6, rate / rate.sum())
    np.testing.assert_allclose(marginals.log_prob(values).numpy(), expected, rtol=1e-12)


def test_log_constraint_prob_is_the_poisson_pmf_of_the_total():
    rate = np.array([[0.5, 1.0, 2.5], [0.1, 0.2, 0.3]])
    d = ConditionedPoisson(torch.tensor(rate), k=torch.tensor([4, 2]))
    # By enumeration: sum over compositions of the product of the Poisson pmfs.
    expected = [
        np.log(np.exp(stats.poisson.logpmf(oracle.compositions(3, k), r).sum(-1)).sum())
        for r, k in zip(rate, [4, 2], strict=True)
    ]
    np.testing.assert_allclose(d.log_constraint_prob().numpy(), expected, rtol=1e-12)


# Entropy ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, k",
    [(1, 7), (2, 0), (3, 1), (4, 5), (50, 100), (5, 1000), (5, 10_000), (40, 10_000)],
)
def test_entropy_float64_within_1e9_of_scipy(n, k):
    rng = np.random.default_rng(n * 7919 + k)
    # Rates over four orders of magnitude, so some coordinates are near-certain zeros and
    # one may dominate.
    rate = np.exp(rng.uniform(-5, 4, size=(2, n)))
    entropy = ConditionedPoisson(torch.tensor(rate), k=k).entropy()
    expected = oracle.multinomial_entropy(rate, k)
    np.testing.assert_allclose(entropy.numpy(), expected, rtol=1e-9, atol=1e-12)


def test_entropy_matches_enumeration_with_per_batch_k():
    rate = np.array([[0.5, 1.0, 2.5], [3.0, 0.1, 0.1], [1.0, 1.0, 1.0]])
    k = [0, 3, 6]
    entropy = ConditionedPoisson(torch.tensor(rate), k=torch.tensor(k)).entropy()
    expected = [oracle.enumerated_entropy(r, k_b) for r, k_b in zip(rate, k, strict=True)]
    np.testing.assert_allclose(entropy.numpy(), expected, rtol=1e-12, atol=1e-14)


def test_entropy_float32_stays_float32_and_is_accurate():
    rng = np.random.default_rng(5)
    rate = rng.gamma(1.0, size=(3, 30)) + 0.01
    entropy = ConditionedPoisson(torch.tensor(rate, dtype=torch.float32), k=200).entropy()
    assert entropy.dtype == torch.float32
    np.testing.assert_allclose(entropy.numpy(), oracle.multinomial_entropy(rate, 200), rtol=1e-5)


def test_entropy_gradient_matches_finite_differences_of_scipy():
    rate = np.array([0.4, 1.0, 2.2, 0.9])
    rate_t = torch.tensor(rate, requires_grad=True)
    ConditionedPoisson(rate_t, k=12).entropy().backward()
    step = 1e-5
    expected = [
        (
            oracle.multinomial_entropy(rate + step * e, 12)
            - oracle.multinomial_entropy(rate - step * e, 12)
        )
        / (2 * step)
        for e in np.eye(4)
    ]
    np.testing.assert_allclose(rate_t.grad.numpy(), expected, rtol=1e-6, atol=1e-9)


def test_entropy_of_a_large_batch_is_close_to_torch_multinomial():
    # A second, independent implementation (which computes lgamma(k + 1) in float32).
    rate = torch.rand(8, 300, dtype=torch.float64) + 0.01
    entropy = ConditionedPoisson(rate, k=100).entropy()
    reference = torch.distributions.Multinomial(100, probs=rate / rate.sum(-1, keepdim=True))
    torch.testing.assert_close(entropy, reference.entropy(), rtol=1e-7, atol=1e-4)


# KL and losses ----------------------------------------------------------------------------


def test_kl_matches_enumeration_and_is_registered():
    rate_p = np.array([[0.5, 1.0, 2.5], [1.0, 1.0, 1.0]])
    rate_q = np.array([[2.0, 1.0, 0.3], [0.2, 5.0, 1.0]])
    p = ConditionedPoisson(torch.tensor(rate_p), k=torch.tensor([4, 2]))
    q = ConditionedPoisson(torch.tensor(rate_q), k=torch.tensor([4, 2]))
    kl = torch.distributions.kl_divergence(p, q)
    expected = [
        oracle.enumerated_kl(rp, rq, k) for rp, rq, k in zip(rate_p, rate_q, [4, 2], strict=True)
    ]
    np.testing.assert_allclose(kl.numpy(), expected, rtol=1e-10)


def test_kl_with_different_k_or_n_raises():
    p = ConditionedPoisson(torch.ones(3), k=2)
    with pytest.raises(ValueError, match="same k"):
        torch.distributions.kl_divergence(p, ConditionedPoisson(torch.ones(3), k=3))
    with pytest.raises(ValueError, match="categories"):
        torch.distributions.kl_divergence(p, ConditionedPoisson(torch.ones(4), k=2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_expected_losses_match_enumeration(dtype):
    rate = np.array([[0.5, 1.0, 2.5, 0.2], [1.0, 1.0, 3.0, 0.5]])
    k = [5, 3]
    target = np.array([[2.0, 0.0, 3.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    d = ConditionedPoisson(torch.tensor(rate, dtype=dtype), k=torch.tensor(k))
    l1 = expected_l1_loss(d, torch.tensor(target, dtype=dtype))
    l2 = expected_l2_loss(d, torch.tensor(target, dtype=dtype))
    assert l1.dtype == dtype and l1.shape == (2,)
    rtol = 1e-5 if dtype == torch.float32 else 1e-11
    expected_l1 = [
        oracle.enumerated_expected_l1(r, kb, y) for r, kb, y in zip(rate, k, target, strict=True)
    ]
    expected_l2 = [
        oracle.enumerated_expected_l2(r, kb, y) for r, kb, y in zip(rate, k, target, strict=True)
    ]
    np.testing.assert_allclose(l1.double().numpy(), expected_l1, rtol=rtol)
    np.testing.assert_allclose(l2.double().numpy(), expected_l2, rtol=rtol)


def test_expected_l1_loss_gradient_matches_finite_differences_of_enumeration():
    rate = np.array([0.5, 1.0, 2.5])
    target = np.array([1.0, 1.0, 2.0])
    rate_t = torch.tensor(rate, requires_grad=True)
    expected_l1_loss(ConditionedPoisson(rate_t, k=4), torch.tensor(target)).backward()
    step = 1e-6
    expected = [
        (
            oracle.enumerated_expected_l1(rate + step * e, 4, target)
            - oracle.enumerated_expected_l1(rate - step * e, 4, target)
        )
        / (2 * step)
        for e in np.eye(3)
    ]
    np.testing.assert_allclose(rate_t.grad.numpy(), expected, rtol=1e-6, atol=1e-9)


# Support, shapes ---------------------------------------------------------------------------


def test_support_demands_the_exact_total():
    support = ConditionedPoisson(torch.ones(2, 3), k=torch.tensor([2, 3])).support
    assert support.is_discrete and support.event_dim == 1
    value = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # torch's own multinomial constraint accepts the second row (sum 2 <= 3); this must not.
    assert support.check(value).tolist() == [True, False]


def test_expand_and_infer_shapes():
    d = ConditionedPoisson(torch.tensor([[1.0, 2.0, 3.0]]), k=torch.tensor([2, 4]))
    assert d.batch_shape == (2,) and d.event_shape == (3,)
    expanded = d.expand((5, 2))
    assert expanded.batch_shape == (5, 2) and isinstance(expanded, ConditionedPoisson)
    z = expanded.sample()
    assert z.shape == (5, 2, 3)
    assert torch.equal(z.sum(-1), torch.tensor([2.0, 4.0]).expand(5, 2))
    torch.testing.assert_close(expanded.log_prob(z), d.log_prob(z))
    assert ConditionedPoisson.infer_shapes(rate=(2, 3), k=(4, 1)) == ((4, 2), (3,))
    assert ConditionedPoisson.infer_shapes(rate=(2, 3), k=(4, 1)) == (
        ConditionedPoisson(torch.ones(2, 3), k=torch.ones(4, 1, dtype=torch.long)).batch_shape,
        (3,),
    )
    # As NumPyro's expand: a ValueError naming both shapes, not torch's RuntimeError.
    with pytest.raises(
        ValueError, match=r"Cannot broadcast distribution of shape \(2,\) to shape \(4,\)"
    ):
        d.expand((4,))


def test_plate_and_sample_shape():
    def model():
        with pyro.plate("bags", 4):
            return pyro.sample("z", ConditionedPoisson(torch.ones(3), k=5))

    z = model()
    assert z.shape == (4, 3) and torch.equal(z.sum(-1), torch.full((4,), 5.0))


# Inference --------------------------------------------------------------------------------


def test_svi_recovers_mixture_proportions_from_bags_of_known_totals():
    # Each bag holds k_b items of three classes in unknown numbers z_b (latent); a noisy
    # sum of per-class signatures is observed. SVI with a ConditionedPoisson guide per bag
    # (rsample, straight-through gradients) learns the class proportions.
    rng = np.random.default_rng(0)
    true_proportions = np.array([0.5, 0.3, 0.2])
    totals = rng.integers(5, 25, size=60)
    counts = np.stack([rng.multinomial(k, true_proportions) for k in totals])
    signatures = np.array([[2.0, 0.0, 0.5], [0.0, 2.0, 0.5], [0.5, 0.0, 2.0]])
    observed = counts @ signatures + rng.normal(scale=0.5, size=(60, 3))
    totals_t = torch.tensor(totals)
    observed_t = torch.tensor(observed, dtype=torch.float32)
    signatures_t = torch.tensor(signatures, dtype=torch.float32)

    def model():
        proportions = pyro.param(
            "proportions", torch.ones(3) / 3, constraint=torch.distributions.constraints.simplex
        )
        with pyro.plate("bags", 60):
            z = pyro.sample("z", ConditionedPoisson(proportions, k=totals_t))
            pyro.sample("y", dist.Normal(z @ signatures_t, 0.5).to_event(1), obs=observed_t)

    def guide():
        log_rate = pyro.param("log_rate", torch.zeros(60, 3))
        with pyro.plate("bags", 60):
            pyro.sample("z", ConditionedPoisson(log_rate.exp(), k=totals_t))

    svi = pyro.infer.SVI(
        model, guide, pyro.optim.ClippedAdam({"lr": 0.1, "lrd": 0.995}), pyro.infer.Trace_ELBO()
    )
    for _ in range(400):
        svi.step()
    learned = pyro.param("proportions").detach().numpy()
    maximum_likelihood_from_true_counts = counts.sum(0) / totals.sum()
    np.testing.assert_allclose(learned, maximum_likelihood_from_true_counts, atol=0.03)
    np.testing.assert_allclose(learned, true_proportions, atol=0.06)


def test_a_single_category_is_deterministic_with_finite_gradients():
    # p == 1 makes log(1 - p) = -inf; the kernels must give exact values and no NaN.
    rate = torch.tensor([[2.0], [0.5]], requires_grad=True)
    d = ConditionedPoisson(rate, k=torch.tensor([0, 6]))
    entropy = d.entropy()
    log_prob = d.log_prob(torch.tensor([[0.0], [6.0]]))
    assert entropy.tolist() == [0.0, 0.0] and log_prob.tolist() == [0.0, 0.0]
    (entropy.sum() + log_prob.sum()).backward()
    assert torch.isfinite(rate.grad).all()


# Framework conformance (issue 15) ----------------------------------------------------------


def test_parameter_constraints_carry_the_event_dim():
    # As torch's test_params_constraints reads them: check(param) respects event_dim, so a
    # rate vector is one parameter, valid or not as a whole.
    rate = torch.tensor([[0.5, 1.0, 2.5], [1.0, -2.0, 3.0]])
    d = ConditionedPoisson(rate.abs(), k=torch.tensor([3, 4]))
    assert d.arg_constraints["rate"].event_dim == 1
    assert d.arg_constraints["k"].event_dim == 0
    for name, constraint in d.arg_constraints.items():
        valid = constraint.check(getattr(d, name))
        assert valid.shape == d.batch_shape and bool(valid.all()), name
    assert d.arg_constraints["rate"].check(rate).tolist() == [True, False]


@pytest.mark.parametrize(
    "k",
    [3.0, np.float64(3.0), torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0], dtype=torch.float16)],
)
def test_whole_number_float_k_is_the_count(k):
    rate = np.array([[0.5, 1.0, 2.5], [1.0, 2.0, 3.0]])
    d = ConditionedPoisson(torch.tensor(rate), k=k)
    k_int = np.broadcast_to(np.asarray(k), (2,)).astype(int)
    value = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    value[1, 0] = k_int[1]
    expected = [
        stats.multinomial(k_int[b], rate[b] / rate[b].sum()).logpmf(value[b]) for b in (0, 1)
    ]
    np.testing.assert_allclose(d.log_prob(torch.tensor(value)), expected, rtol=1e-12)
    assert torch.equal(
        d.rsample((4,)).sum(-1), torch.tensor(k_int, dtype=torch.float64).expand(4, 2)
    )


@pytest.mark.parametrize("validate_args", [True, False])
@pytest.mark.parametrize(
    "k",
    [3.5, torch.tensor([1.0, 2.5]), True, torch.tensor([True, False]), 2 + 0j, math.nan, math.inf],
)
def test_k_that_is_no_count_is_a_value_error_whatever_validate_args(k, validate_args):
    with pytest.raises(ValueError, match=r"\bk\b"):
        ConditionedPoisson(torch.ones(2, 3), k=k, validate_args=validate_args)


def test_k_max_is_accepted_and_checked_as_in_numpyro():
    rate = torch.ones(2, 3)
    k = torch.tensor([3, 4])
    assert ConditionedPoisson(rate, k=k).k_max is None
    d = ConditionedPoisson(rate, k=k, k_max=10)
    assert d.k_max == 10 and d.expand((5, 2)).k_max == 10
    assert ConditionedPoisson(rate, k=k, k_max=4.0).k_max == 4
    for bad in (3.5, -1, True, torch.tensor(5)):
        with pytest.raises(ValueError, match="k_max"):
            ConditionedPoisson(rate, k=k, k_max=bad)
    with pytest.raises(ValueError, match="k_max = 3 is below the largest k = 4"):
        ConditionedPoisson(rate, k=k, k_max=3)
    with pytest.raises(ValueError, match="k_max = 16777217 exceeds"):
        ConditionedPoisson(rate, k=k, k_max=2**24 + 1)


def test_negative_k_with_validation_off_gives_minus_inf_and_nan_never_a_finite_number():
    rate = torch.tensor([[0.5, 1.0, 2.5], [1.0, 2.0, 3.0]], dtype=torch.float64)
    d = ConditionedPoisson(rate, k=torch.tensor([3, -1]), validate_args=False)
    log_prob = d.log_prob(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    expected = stats.multinomial(3, rate[0].numpy() / rate[0].sum().item()).logpmf([1, 1, 1])
    assert log_prob[0].item() == pytest.approx(expected, rel=1e-12)
    assert log_prob[1].item() == -math.inf
    assert d.log_constraint_prob()[1].item() == -math.inf
    samples = d.rsample((3,))
    assert torch.isfinite(samples[:, 0]).all() and torch.isnan(samples[:, 1]).all()
    kl = torch.distributions.kl_divergence(d, d)
    for x in (d.mean, d.variance, d.entropy(), kl):
        assert torch.isfinite(x[0]).all() and torch.isnan(x[1]).all()
    with pytest.raises(ValueError, match=r"\bk\b"):
        ConditionedPoisson(rate, k=torch.tensor([3, -1]), validate_args=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_out_of_support_values_are_a_value_error_with_validation_and_minus_inf_without(dtype):
    rate = torch.tensor([[0.5, 1.0, 2.5], [1.0, 2.0, 3.0]])
    k = torch.tensor([3, 4])
    inside = torch.tensor([[1, 1, 1], [0, 1, 3]], dtype=dtype)
    outside = torch.tensor([[1, 1, 0], [0, 1, 3]], dtype=dtype)
    value = torch.stack([inside, outside])  # sample shape (2,)
    with pytest.raises(ValueError, match="sum to exactly k"):
        ConditionedPoisson(rate, k=k).log_prob(value)
    log_prob = ConditionedPoisson(rate, k=k, validate_args=False).log_prob(value)
    assert torch.isfinite(log_prob[0]).all() and torch.isfinite(log_prob[1, 1])
    assert log_prob[1, 0].item() == -math.inf


@pytest.mark.parametrize("shape", [(2,), (4, 2), (3, 3), (4, 3), (2, 4, 3), (5, 2, 3, 1)], ids=str)
def test_a_value_of_the_wrong_shape_is_a_value_error_naming_the_expected_shape(shape):
    d = ConditionedPoisson(torch.ones(2, 3), k=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"expected a shape broadcasting with \(\.\.\., 2, 3\)"):
        d.log_prob(torch.zeros(shape))


# Pyro's JIT ELBOs trace the model and the guide with torch.jit.trace: sample, rsample and
# log_prob must record faithfully (no in-place writes, no reliance on no_grad, which a trace
# does not record). A model of two bags, a latent ConditionedPoisson per bag observed
# through another one; k = 5 over 3 categories draws categorically, k = 200 by sequential
# binomials.
PRIOR = np.array([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
GUIDE_RATE = np.array([[2.0, 1.0, 1.0], [1.0, 3.0, 0.5]])
Y_TOTAL = np.array([4, 2])
Y = np.array([[1.0, 0.0, 3.0], [0.0, 2.0, 0.0]])


def _bags_model_and_guide(k_first_bag):
    k = torch.tensor([k_first_bag, 3])
    prior, y_total, y = torch.tensor(PRIOR), torch.tensor(Y_TOTAL), torch.tensor(Y)

    def model():
        with pyro.plate("bags", 2):
            z = pyro.sample("z", ConditionedPoisson(prior, k=k))
            pyro.sample("y", ConditionedPoisson(z + 0.5, k=y_total), obs=y)

    def guide():
        rate = pyro.param(
            "guide_rate", torch.tensor(GUIDE_RATE), constraint=dist.constraints.positive
        )
        with pyro.plate("bags", 2):
            pyro.sample("z", ConditionedPoisson(rate, k=k))

    return model, guide


def _log_likelihood_of_y(z, b):
    """``log Multinomial(y_b; k_y, (z + 1/2) / sum(z + 1/2))`` from its definition."""
    p = (z + 0.5) / (z + 0.5).sum(-1, keepdims=True)
    y = Y[b]
    return special.gammaln(Y_TOTAL[b] + 1) - special.gammaln(y + 1).sum() + (y * np.log(p)).sum(-1)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("k_first_bag", [5, 200], ids=["categorical", "sequential"])
@pytest.mark.parametrize(
    "eager_elbo, jit_elbo",
    [
        (pyro.infer.Trace_ELBO, pyro.infer.JitTrace_ELBO),
        (pyro.infer.TraceGraph_ELBO, pyro.infer.JitTraceGraph_ELBO),
    ],
    ids=lambda e: e.__name__,
)
def test_jit_elbo_with_a_guide_gives_the_eager_losses_and_gradients(
    eager_elbo, jit_elbo, k_first_bag
):
    # With the same seed per step, the compiled loss and gradients are the eager ones (the
    # compiled graph draws what the eager code draws, in the same order). Not so for
    # JitTraceMeanField_ELBO, whose draws differ from TraceMeanField_ELBO's for a Normal
    # guide too: it is checked against the exact expectation below.
    model, guide = _bags_model_and_guide(k_first_bag)

    def loss_and_grad(elbo, seed):
        pyro.set_rng_seed(seed)
        loss = elbo.loss_and_grads(model, guide)
        unconstrained = pyro.get_param_store().get_param("guide_rate").unconstrained()
        grad = unconstrained.grad.clone()
        unconstrained.grad = None
        return loss, grad

    eager, jitted = eager_elbo(max_plate_nesting=1), jit_elbo(max_plate_nesting=1)
    loss_and_grad(jitted, 0)  # compiles (tracing draws its own samples)
    for seed in range(1, 4):
        loss, grad = loss_and_grad(eager, seed)
        jit_loss, jit_grad = loss_and_grad(jitted, seed)
        assert math.isfinite(loss) and jit_loss == pytest.approx(loss, rel=1e-10, abs=1e-10)
        torch.testing.assert_close(jit_grad, grad, rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("k_first_bag", [5, 200], ids=["categorical", "sequential"])
@pytest.mark.parametrize(
    "jit_elbo",
    [pyro.infer.JitTrace_ELBO, pyro.infer.JitTraceMeanField_ELBO, pyro.infer.JitTraceGraph_ELBO],
    ids=lambda e: e.__name__,
)
def test_jit_elbos_estimate_the_exact_expected_loss(jit_elbo, k_first_bag):
    # The loss is E_q[log q(z) - log p(z) - log p(y | z)], here summed exactly over every
    # composition z of each bag (the pmfs from Poisson pmfs, the likelihood from its
    # definition); the Monte Carlo estimates of the compiled ELBO over 2000 vectorised
    # particles must lie within 5 standard errors of it, and change from call to call.
    model, guide = _bags_model_and_guide(k_first_bag)
    ks = [k_first_bag, 3]
    particles = 2000
    expected = 0.0
    for b, k in enumerate(ks):
        support, q = oracle.conditioned_poisson_pmf(GUIDE_RATE[b], k)
        _, p = oracle.conditioned_poisson_pmf(PRIOR[b], k)
        expected += float(q @ (np.log(q) - np.log(p) - _log_likelihood_of_y(support, b)))
    # Standard error: per-particle losses with and without the KL term (the mean-field ELBO
    # takes KL(q || p) in closed form), the larger of the two.
    z = ConditionedPoisson(torch.tensor(GUIDE_RATE), k=torch.tensor(ks)).sample((particles,))
    z = z.numpy()
    log_ratio = sum(
        oracle.multinomial_logpmf(GUIDE_RATE[b], ks[b], z[:, b])
        - oracle.multinomial_logpmf(PRIOR[b], ks[b], z[:, b])
        for b in (0, 1)
    )
    negative_log_likelihood = -sum(_log_likelihood_of_y(z[:, b], b) for b in (0, 1))
    spread = max(np.std(log_ratio + negative_log_likelihood), np.std(negative_log_likelihood))
    standard_error = spread / math.sqrt(particles)

    elbo = jit_elbo(num_particles=particles, vectorize_particles=True, max_plate_nesting=1)
    losses = [elbo.loss_and_grads(model, guide) for _ in range(3)]
    for loss in losses:
        assert abs(loss - expected) < 5 * standard_error, (loss, expected, standard_error)
    assert len(set(losses)) == 3  # fresh draws on every call, not samples frozen in the trace
    grad = pyro.get_param_store().get_param("guide_rate").unconstrained().grad
    assert grad is not None and torch.isfinite(grad).all()


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_log_prob_traced_with_values_in_the_support_still_gives_minus_inf_off_it():
    # torch.jit.trace freezes Python branches on values: masking off-support rows only when
    # the traced example had some would drop the mask from the compiled graph.
    rate = torch.tensor([[0.5, 1.0, 2.5], [1.0, 2.0, 3.0]], dtype=torch.float64)
    d = ConditionedPoisson(rate, k=torch.tensor([3, 4]), validate_args=False)
    inside = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 3.0]], dtype=torch.float64)
    traced = torch.jit.trace(d.log_prob, (inside,), check_trace=False)
    outside = torch.tensor([[-1.0, 2.0, 2.0], [1.0, 1.0, 2.0]], dtype=torch.float64)
    log_prob = traced(outside)
    assert log_prob[0].item() == -math.inf
    expected = stats.multinomial(4, (rate[1] / rate[1].sum()).numpy()).logpmf([1, 1, 2])
    assert log_prob[1].item() == pytest.approx(expected, rel=1e-12)


def test_repr_names_each_parameter_by_value_or_shape():
    # torch.distributions' convention: a one-element parameter by its value, else its shape;
    # k, stored in the rate's float dtype, prints as the count it is.
    rate = torch.ones(3, 4)
    assert repr(ConditionedPoisson(rate, k=torch.tensor([1, 2, 3]))) == (
        "ConditionedPoisson(rate: torch.Size([3, 4]), k: torch.Size([3]))"
    )
    assert repr(ConditionedPoisson(rate[0], k=7)) == (
        "ConditionedPoisson(rate: torch.Size([4]), k: 7)"
    )


# mode (vectorised: a lower bound plus the remaining units of largest gain, by one sort) ----


@pytest.mark.parametrize("rate,k", oracle.MODE_CASES)
def test_mode_is_a_brute_force_mode_with_ties_to_the_lower_index(rate, k):
    rate_t = torch.tensor(rate, dtype=torch.float64).expand(len(k), len(rate))
    d = ConditionedPoisson(rate_t, k=torch.tensor(k), validate_args=False)
    mode = d.mode
    assert mode.dtype == torch.float64 and mode.shape == (len(k), len(rate))
    assert torch.equal(mode.sum(-1), torch.tensor(k, dtype=torch.float64))
    oracle.check_mode_against_brute_force(rate_t.numpy(), np.array(k), mode.numpy())


@pytest.mark.parametrize("dtype", DTYPES)
def test_mode_of_a_batch_with_per_batch_k_matches_brute_force(dtype):
    rng = np.random.default_rng(5)
    rate = rng.gamma(0.7, size=(3, 2, 4)) + 1e-3
    rate[0, 1] = [0.4, 0.4, 0.4, 1.3]  # a tied block inside the batch
    k = np.array([[0], [6], [11]]) + np.array([0, 3])  # (3, 2), every element its own k
    d = ConditionedPoisson(torch.tensor(rate, dtype=dtype), k=torch.tensor(k))
    mode = d.mode
    assert mode.dtype == dtype and mode.shape == (3, 2, 4)
    # The reference takes the rates as the distribution holds them (float32 rounded).
    oracle.check_mode_against_brute_force(d.rate.double().numpy(), k, mode.double().numpy())


def test_mode_agrees_with_numpyro_and_is_optimal_where_enumeration_cannot_go():
    import jax.numpy as jnp

    from numpyro_constrained import ConditionedPoisson as NumPyroConditionedPoisson

    rng = np.random.default_rng(7)
    # One batch (one NumPyro compilation): ordinary, 60-decade, tied and integer rates.
    rate = np.concatenate(
        [
            rng.gamma(1.0, size=(4, 16)) + 1e-3,
            np.exp(rng.normal(0.0, 40.0, size=(3, 16))),
            np.ones((2, 16)),
            rng.integers(1, 4, size=(3, 16)).astype(float),
        ]
    )
    k = np.array([0, 17, 10_000, 123_457, 5, 1_000, 10**9, 13, 4_000_001, 7, 30, 2**40])
    mode = ConditionedPoisson(torch.tensor(rate), k=torch.tensor(k)).mode.numpy()
    expected = NumPyroConditionedPoisson(jnp.asarray(rate), k=jnp.asarray(k)).mode
    np.testing.assert_array_equal(mode, np.asarray(expected))
    np.testing.assert_array_equal(mode.sum(-1), k)
    assert oracle.is_locally_optimal(oracle.reference_log_p(rate), mode)
    # The largest k float64 holds, over many categories: a composition, locally optimal to
    # the rounding of log p (there the two frameworks' log p, rounded differently, may
    # move a unit between near-tied categories).
    rate = rng.gamma(1.0, size=(1, 200))
    mode = ConditionedPoisson(torch.tensor(rate), k=2**53).mode.numpy()
    assert mode.sum() == 2**53
    assert oracle.is_locally_optimal(oracle.reference_log_p(rate), mode)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_mode_traced_replays_with_other_rates():
    # No Python decision on the rates: a trace made with one set replays for any other.
    import warnings

    first = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    k = torch.tensor([9, 6])
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(
            lambda rate: ConditionedPoisson(rate, k=k, validate_args=False).mode, (first,)
        )
    for rate in (
        torch.tensor([[1e-30, 1.0, 1e30, 1.0], [5.0, 1.0, 1.0, 5.0]], dtype=torch.float64),
        torch.tensor([[0.1, 0.1, 0.1, 9.0], [2.0, 1.0, 2.0, 1.0]], dtype=torch.float64),
    ):
        assert torch.equal(traced(rate), ConditionedPoisson(rate, k=k).mode)
