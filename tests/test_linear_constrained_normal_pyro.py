"""LinearConstrainedNormal (Pyro) against SciPy's singular normal and Monte Carlo."""

import math

import numpy as np
import pyro
import pytest
import torch
from pyro import poutine
from torch.distributions import biject_to, kl_divergence, transform_to

from pyro_constrained import LinearConstrainedNormal
from pyro_constrained.losses import expected_l1_loss, expected_l2_loss
from tests.oracles import linear_gaussian as oracle

CASES = oracle.CASES


def build(case, n=5, a=2, seed=0, dtype=torch.float64, **kwargs):
    params, cov, A, k = oracle.random_parameters(case, n, a, seed)
    tensors = {name: torch.tensor(value, dtype=dtype) for name, value in params.items()}
    return LinearConstrainedNormal(**tensors, **kwargs), params, cov, A, k


@pytest.mark.parametrize("case", CASES)
def test_log_prob_and_entropy_match_scipy_singular_normal(case):
    dist, params, cov, A, k = build(case)
    reference = oracle.singular_normal(params["loc"], cov, A, k)
    values = reference.rvs(size=7, random_state=1)
    np.testing.assert_allclose(
        dist.log_prob(torch.tensor(values)).numpy(), reference.logpdf(values), rtol=1e-8
    )
    np.testing.assert_allclose(dist.entropy().item(), reference.entropy(), rtol=1e-10)


@pytest.mark.parametrize("case", CASES)
def test_moments_and_marginals_match_the_conditional_gaussian(case):
    dist, params, cov, A, k = build(case)
    mean, covariance = oracle.conditional_moments(params["loc"], cov, A, k)
    np.testing.assert_allclose(dist.mean.numpy(), mean, atol=1e-12)
    np.testing.assert_allclose(dist.variance.numpy(), np.diag(covariance), atol=1e-12)
    np.testing.assert_allclose(dist.covariance_matrix.numpy(), covariance, atol=1e-12)
    marginals = dist.marginals
    np.testing.assert_allclose(marginals.loc.numpy(), mean, atol=1e-12)
    np.testing.assert_allclose(marginals.scale.numpy(), np.sqrt(np.diag(covariance)), atol=1e-12)


@pytest.mark.parametrize("case", ["diag", "full_cov"])
def test_monte_carlo_moments_of_1e5_samples(case):
    dist, params, cov, A, k = build(case)
    mean, covariance = oracle.conditional_moments(params["loc"], cov, A, k)
    samples = dist.sample((100_000,)).numpy()
    # Standard errors: sqrt(var / N) for the mean, sqrt((S_ii S_jj + S_ij^2) / N) for the
    # covariance; 5 standard errors.
    std = np.sqrt(np.diag(covariance))
    assert np.all(np.abs(samples.mean(0) - mean) < 5 * std / math.sqrt(1e5) + 1e-12)
    cov_se = np.sqrt((np.outer(std**2, std**2) + covariance**2) / 1e5)
    assert np.all(np.abs(np.cov(samples.T) - covariance) < 5 * cov_se + 1e-12)
    assert np.abs(samples @ A.T - k).max() < 1e-10


@pytest.mark.parametrize("case", ["diag", "scale_tril"])
def test_samples_pass_goodness_of_fit_on_the_subspace(case):
    dist, params, cov, A, k = build(case, n=6, a=2)
    samples = dist.sample((4000,)).numpy()
    radius_p, coordinate_p = oracle.goodness_of_fit_pvalues(samples, params["loc"], cov, A, k)
    assert radius_p > 1e-3 and coordinate_p > 1e-3


def test_batch_dimensions_broadcast_against_scipy():
    rng = np.random.default_rng(3)
    n, a = 4, 2
    loc = rng.normal(size=(2, 1, n))
    scale = rng.uniform(0.5, 2, size=(3, n))
    A = rng.normal(size=(a, n))
    k = rng.normal(size=(2, 1, a))
    dist = LinearConstrainedNormal(
        torch.tensor(loc), torch.tensor(scale), A=torch.tensor(A), k=torch.tensor(k)
    )
    assert dist.batch_shape == (2, 3) and dist.event_shape == (n,)
    samples = dist.sample((5,))
    assert samples.shape == (5, 2, 3, n)
    log_prob = dist.log_prob(samples).numpy()
    for i in range(2):
        for j in range(3):
            reference = oracle.singular_normal(loc[i, 0], np.diag(scale[j] ** 2), A, k[i, 0])
            np.testing.assert_allclose(log_prob[:, i, j], reference.logpdf(samples[:, i, j]))
            assert np.abs(A @ samples[:, i, j].numpy().T - k[i, 0][:, None]).max() < 1e-10


def test_batched_A_and_full_covariance():
    rng = np.random.default_rng(4)
    n = 4
    A = rng.normal(size=(3, 1, n))
    params, cov, _, _ = oracle.random_parameters("scale_tril", n=n, seed=4)
    dist = LinearConstrainedNormal(
        torch.tensor(params["loc"]),
        scale_tril=torch.tensor(params["scale_tril"]),
        A=torch.tensor(A),
    )
    assert dist.batch_shape == (3,)
    values = dist.sample((2,))
    for b in range(3):
        reference = oracle.singular_normal(params["loc"], cov, A[b], np.zeros(1))
        np.testing.assert_allclose(dist.log_prob(values)[:, b], reference.logpdf(values[:, b]))


def test_expand_and_infer_shapes():
    dist, *_ = build("diag")
    expanded = dist.expand((3, 2))
    assert isinstance(expanded, LinearConstrainedNormal)
    assert expanded.batch_shape == (3, 2) and expanded.sample((4,)).shape == (4, 3, 2, 5)
    value = dist.sample()
    torch.testing.assert_close(expanded.log_prob(value), dist.log_prob(value).expand(3, 2))
    torch.testing.assert_close(expanded.mean, dist.mean.expand(3, 2, 5))
    torch.testing.assert_close(expanded.variance, dist.variance.expand(3, 2, 5))
    torch.testing.assert_close(expanded.entropy(), dist.entropy().expand(3, 2))
    shapes = LinearConstrainedNormal.infer_shapes((2, 1, 5), scale=(3, 5), A=(2, 5), k=(2,))
    assert shapes == ((2, 3), (5,))


def test_float32_keeps_its_dtype():
    dist, params, cov, A, k = build("diag", dtype=torch.float32)
    samples = dist.sample((50,))
    for tensor in (samples, dist.mean, dist.variance, dist.log_prob(samples), dist.entropy()):
        assert tensor.dtype == torch.float32
    reference = oracle.logpdf(oracle.project(samples.numpy(), A, k), params["loc"], cov, A, k)
    np.testing.assert_allclose(dist.log_prob(samples).numpy(), reference, rtol=1e-4, atol=1e-4)


def test_large_n_with_diagonal_covariance_never_forms_n_by_n():
    # An n x n float64 matrix at n = 10^6 would need 8 TB: construction, log_prob, sample,
    # variance, entropy and the losses must all run in O(n a).
    n, a = 1_000_000, 3
    generator = torch.Generator().manual_seed(0)
    A = torch.randn(a, n, generator=generator, dtype=torch.float64)
    dist = LinearConstrainedNormal(
        torch.zeros(n, dtype=torch.float64),
        torch.ones(n, dtype=torch.float64),
        A=A,
        k=torch.ones(a, dtype=torch.float64),
    )
    z = dist.sample()
    assert torch.isfinite(dist.log_prob(z))
    assert (A @ z - 1).abs().max() < 1e-6
    assert torch.isfinite(expected_l1_loss(dist, dist.mean)) and dist.variance.shape == (n,)


def test_a_site_inside_a_plate_is_expanded():
    dist, params, cov, A, k = build("diag")

    def model():
        with pyro.plate("bags", 3):
            return pyro.sample("z", dist)

    trace = poutine.trace(model).get_trace()
    trace.compute_log_prob()
    site = trace.nodes["z"]
    assert site["value"].shape == (3, 5) and site["log_prob"].shape == (3,)
    np.testing.assert_allclose(
        site["log_prob"].numpy(), oracle.logpdf(site["value"].numpy(), params["loc"], cov, A, k)
    )


# --- gradients ---------------------------------------------------------------------------


def _param_tensors(case="diag", seed=0):
    params, cov, A, k = oracle.random_parameters(case, seed=seed)
    loc = torch.tensor(params["loc"], requires_grad=True)
    scale = torch.tensor(params["scale"], requires_grad=True)
    return loc, scale, params, A, k


def test_default_estimator_gradient_is_the_gradient_of_the_conditional_mean():
    loc, scale, params, A, k = _param_tensors()
    weights = torch.tensor(np.random.default_rng(5).normal(size=5))
    dist = LinearConstrainedNormal(loc, scale, A=torch.tensor(A), k=torch.tensor(k))
    z = dist.rsample()
    grad_loc, grad_scale = torch.autograd.grad((weights * z).sum(), (loc, scale))

    # Central finite differences of w . mu_bar through the NumPy oracle.
    def objective(loc_np, scale_np):
        mean, _ = oracle.conditional_moments(loc_np, np.diag(scale_np**2), A, k)
        return weights.numpy() @ mean

    step = 1e-6
    eye = np.eye(5)
    fd_loc = [
        (
            objective(params["loc"] + step * e, params["scale"])
            - objective(params["loc"] - step * e, params["scale"])
        )
        / (2 * step)
        for e in eye
    ]
    fd_scale = [
        (
            objective(params["loc"], params["scale"] + step * e)
            - objective(params["loc"], params["scale"] - step * e)
        )
        / (2 * step)
        for e in eye
    ]
    np.testing.assert_allclose(grad_loc.numpy(), fd_loc, atol=1e-7)
    np.testing.assert_allclose(grad_scale.numpy(), fd_scale, atol=1e-7)


def test_rsample_value_is_an_exact_sample_for_both_estimators():
    loc, scale, params, A, k = _param_tensors()
    for estimator in ("marginal_expectation", "pathwise"):
        dist = LinearConstrainedNormal(
            loc, scale, A=torch.tensor(A), k=torch.tensor(k), grad_estimator=estimator
        )
        torch.manual_seed(7)
        z = dist.rsample((3,))
        torch.manual_seed(7)
        assert torch.equal(z.detach(), dist.sample((3,)))
        assert z.requires_grad


def test_pathwise_estimator_is_unbiased_for_the_expected_l2_loss():
    loc, scale, params, A, k = _param_tensors()
    A_t, k_t = torch.tensor(A), torch.tensor(k)
    mean, _ = oracle.conditional_moments(params["loc"], np.diag(params["scale"] ** 2), A, k)
    target = torch.tensor(mean + np.random.default_rng(6).normal(size=5) * 0.5)
    target = target - A_t.T @ torch.linalg.solve(A_t @ A_t.T, A_t @ target - k_t)  # on subspace

    def closed_form_grad():
        dist = LinearConstrainedNormal(loc, scale, A=A_t, k=k_t)
        return torch.cat(torch.autograd.grad(expected_l2_loss(dist, target), (loc, scale)))

    def estimate(estimator, num_samples):
        dist = LinearConstrainedNormal(loc, scale, A=A_t, k=k_t, grad_estimator=estimator)
        z = dist.rsample((num_samples,))
        loss = (z - target).square().sum(-1).mean()
        return torch.cat(torch.autograd.grad(loss, (loc, scale)))

    truth = closed_form_grad()
    replicates = torch.stack([estimate("pathwise", 2000) for _ in range(20)])
    standard_error = replicates.std(0) / math.sqrt(20)
    assert ((replicates.mean(0) - truth).abs() < 5 * standard_error + 1e-9).all()
    # The straight-through estimator ignores how the spread depends on the scale: biased.
    biased = torch.stack([estimate("marginal_expectation", 2000) for _ in range(5)]).mean(0)
    assert (biased[5:] - truth[5:]).abs().max() > 0.5


# --- KL and losses ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case_p", "case_q"),
    [("diag", "diag"), ("diag", "full_cov"), ("scale_tril", "diag"), ("full_cov", "scale_tril")],
)
def test_kl_matches_the_pseudo_inverse_formula(case_p, case_q):
    p, params_p, cov_p, A, k = build(case_p, seed=0)
    params_q, cov_q, _, _ = oracle.random_parameters(case_q, seed=1)
    tensors = {name: torch.tensor(value) for name, value in params_q.items()}
    tensors.update(A=torch.tensor(A), k=torch.tensor(k))
    q = LinearConstrainedNormal(**tensors)
    expected = oracle.kl_same_support(
        oracle.conditional_moments(params_p["loc"], cov_p, A, k),
        oracle.conditional_moments(params_q["loc"], cov_q, A, k),
    )
    np.testing.assert_allclose(kl_divergence(p, q).item(), expected, rtol=1e-9)
    assert abs(kl_divergence(p, p).item()) < 1e-10


def test_kl_rejects_different_constraints():
    p, *_ = build("diag", seed=0)
    q, *_ = build("diag", seed=1)
    with pytest.raises(ValueError, match="same A and k"):
        kl_divergence(p, q)


@pytest.mark.parametrize("case", CASES)
def test_expected_losses_match_quadrature_and_monte_carlo(case):
    dist, params, cov, A, k = build(case)
    target = torch.tensor(oracle.singular_normal(params["loc"], cov, A, k).rvs(random_state=2))
    l1_ref, l2_ref = oracle.expected_losses(params["loc"], cov, A, k, target.numpy())
    l1, l2 = expected_l1_loss(dist, target), expected_l2_loss(dist, target)
    np.testing.assert_allclose([l1.item(), l2.item()], [l1_ref, l2_ref], rtol=1e-6)
    samples = dist.sample((100_000,))
    mc_l1 = (samples - target).abs().sum(-1)
    mc_l2 = (samples - target).square().sum(-1)
    for estimate, closed in ((mc_l1, l1), (mc_l2, l2)):
        assert abs(estimate.mean() - closed) < 5 * estimate.std() / math.sqrt(1e5)


def test_l1_loss_with_a_coordinate_fixed_by_the_constraint_has_finite_gradients():
    loc = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    A = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)  # fixes z_0 = k
    dist = LinearConstrainedNormal(loc, scale, A=A, k=torch.tensor([0.7], dtype=torch.float64))
    target = torch.tensor([0.2, 0.0, 1.0], dtype=torch.float64)
    loss = expected_l1_loss(dist, target)
    l1_ref, _ = oracle.expected_losses(
        [0.3, -1.0, 2.0], np.diag([1, 0.25, 4]), A.numpy(), [0.7], target.numpy()
    )
    np.testing.assert_allclose(loss.item(), l1_ref, rtol=1e-8)
    grads = torch.autograd.grad(loss, (loc, scale))
    assert all(torch.isfinite(g).all() for g in grads)


# --- support, bijection, validation -------------------------------------------------------


@pytest.mark.parametrize("registry", [biject_to, transform_to])
def test_registered_bijection_is_an_isometry_onto_the_subspace(registry):
    dist, params, cov, A, k = build("diag", n=6, a=2)
    transform = registry(dist.support)
    u = torch.randn(10, 4, dtype=torch.float64)
    z = transform(u)
    assert z.shape == (10, 6)
    assert (z @ torch.tensor(A).T - torch.tensor(k)).abs().max() < 1e-12
    assert dist.support.check(z).all()
    torch.testing.assert_close(transform.inv(z), u)
    torch.testing.assert_close(torch.cdist(z, z), torch.cdist(u, u))
    assert (transform.log_abs_det_jacobian(u, z) == 0).all()
    assert transform.inverse_shape((3, 6)) == (3, 4) and transform.forward_shape((3, 4)) == (3, 6)


def test_log_prob_off_the_subspace():
    dist, *_ = build("diag")
    value = dist.sample() + 1e-3
    with pytest.raises(ValueError, match="support"):
        dist.log_prob(value)
    unchecked, *_ = build("diag", validate_args=False)
    assert unchecked.log_prob(value).item() == -math.inf
    assert math.isfinite(unchecked.log_prob(unchecked.sample()).item())


BAD_INPUTS = [
    ({"A": [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]]}, "rank"),
    ({"A": np.eye(3)}, "rows"),
    ({"A": np.ones((1, 4))}, "columns"),
    ({"A": np.ones(3)}, "A must have shape"),
    ({"k": [0.0, 1.0]}, "k must have shape"),
    ({"scale": [1.0, 0.0, 1.0]}, "scale"),
    ({"scale": [1.0, -1.0, 1.0]}, "scale"),
    ({"scale": [1.0, 1.0]}, "scale"),
    (
        {"scale": None, "covariance_matrix": [[1.0, 2.0, 0], [2.0, 1.0, 0], [0, 0, 1.0]]},
        "covariance_matrix",
    ),
    ({"scale": None, "covariance_matrix": np.eye(4)}, "covariance_matrix"),
    ({"scale": None, "scale_tril": [[1.0, 1.0, 0], [0, 1.0, 0], [0, 0, 1.0]]}, "scale_tril"),
    ({"loc": [0.0, math.nan, 1.0]}, "loc"),
    ({"scale": [1.0, math.nan, 1.0]}, "scale"),
    ({"A": [[1.0, math.nan, 1.0]]}, "A"),
    ({"k": [math.nan]}, "k"),
    ({"loc": np.zeros((2, 3)), "k": np.zeros((3, 1))}, "broadcast"),
    ({"covariance_matrix": np.eye(3)}, "exactly one"),
    ({"grad_estimator": "reinforce"}, "grad_estimator"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_INPUTS)
def test_bad_input_raises_a_value_error_naming_the_problem(overrides, message):
    kwargs = {"loc": [0.0, 1.0, 2.0], "scale": [1.0, 1.0, 1.0]}
    kwargs.update(overrides)
    kwargs = {
        name: torch.tensor(value, dtype=torch.float64)
        if not isinstance(value, str) and value is not None
        else value
        for name, value in kwargs.items()
    }
    with pytest.raises(ValueError, match=message):
        LinearConstrainedNormal(**kwargs)
