"""LinearConstrainedNormal (Pyro) against SciPy's singular normal and Monte Carlo; torch's
and Pyro's conventions (parameter constraints, value shapes, JIT ELBOs)."""

import math

import numpy as np
import pyro
import pyro.distributions as pdist
import pytest
import torch
from pyro import poutine
from pyro.infer import (
    JitTrace_ELBO,
    JitTraceGraph_ELBO,
    JitTraceMeanField_ELBO,
    Trace_ELBO,
    TraceGraph_ELBO,
    TraceMeanField_ELBO,
)
from torch.distributions import biject_to, constraints, kl_divergence, transform_to

from pyro_constrained import LinearConstrainedNormal, LinearConstraint
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
    # SciPy's singular-normal draws satisfy A z = k only to ~1e-8 relative (its eigen-
    # decomposition): in the support, but scored at the projections so that both densities
    # are compared at the same point to 1e-8.
    values = oracle.project(reference.rvs(size=7, random_state=1), A, k)
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
    # An n x n float64 matrix at n = 2 10^5 would need 320 GB: construction, log_prob,
    # sample, variance, entropy and the losses must all run in O(n a).
    n, a = 200_000, 3
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
    # A NaN entry is named as such (its residual and bound are NaN: no tolerance to suggest).
    value[1] = math.nan
    with pytest.raises(ValueError, match="1 value.s. have NaN or infinite entries"):
        dist.log_prob(value)
    unchecked, *_ = build("diag", validate_args=False)
    assert unchecked.log_prob(value).item() == -math.inf
    assert math.isfinite(unchecked.log_prob(unchecked.sample()).item())


BAD_INPUTS = [
    ({"A": [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]]}, "rank"),
    # Every singular value 0: the ratio is 0, not a NaN from 0 / 0 (with a RuntimeWarning).
    ({"A": [[0.0, 0.0, 0.0]]}, "rank-deficient.*is 0 times its largest"),
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


@pytest.mark.filterwarnings("error::RuntimeWarning")
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


# --- torch's and Pyro's conventions (issue 15) --------------------------------------------

EVENT_DIMS = {"loc": 1, "scale": 1, "covariance_matrix": 2, "scale_tril": 2, "A": 2, "k": 1}


@pytest.mark.parametrize("case", CASES)
def test_params_constraints_in_the_pattern_of_torch(case):
    # torch's test_params_constraints: every argument given has a constraint whose event dim
    # is that of the argument, its batch shape broadcasts with the distribution's, and it
    # satisfies the constraint. A covariance_matrix argument is stored, and constrained, as
    # its Cholesky factor scale_tril: the attribute covariance_matrix is the conditional
    # covariance, which no argument constraint describes.
    params, *_ = oracle.random_parameters(case)
    params = {name: torch.tensor(np.broadcast_to(v, (3,) + v.shape)) for name, v in params.items()}
    dist = LinearConstrainedNormal(**params)
    assert set(dist.arg_constraints) == set(EVENT_DIMS) - {"covariance_matrix"}
    if "covariance_matrix" in params:
        params["scale_tril"] = torch.linalg.cholesky(params.pop("covariance_matrix"))
    for name, value in params.items():
        constraint = dist.arg_constraints[name]
        assert constraint.event_dim == EVENT_DIMS[name], name
        assert value.dim() >= constraint.event_dim
        torch.broadcast_shapes(dist.batch_shape, value.shape[: value.dim() - constraint.event_dim])
        assert constraint.check(value).shape == (3,), name
        assert constraint.check(value).all(), name
    assert "covariance_matrix" not in dist.arg_constraints
    # torch's test_support_constraints: samples lie in the support.
    assert dist.support.check(dist.sample((4,))).all()


def test_log_prob_of_a_value_of_the_wrong_shape_is_a_value_error():
    params, *_ = oracle.random_parameters("diag")
    for validate in (True, False):
        dist = LinearConstrainedNormal(
            torch.tensor(np.stack([params["loc"]] * 2)),
            torch.tensor(params["scale"]),
            validate_args=validate,
        )
        for shape in [(4,), (2, 4), (3, 5), (4, 3, 5)]:
            with pytest.raises(
                ValueError, match=r"expected a shape broadcasting with \(\.\.\., 2, 5\)"
            ):
                dist.log_prob(torch.zeros(shape, dtype=torch.float64))
        assert dist.log_prob(dist.sample((7,))[:, :1]).shape == (7, 2)


def test_k_is_a_real_right_hand_side_broadcast_to_the_rows_of_A():
    params, cov, A, _ = oracle.random_parameters("diag")
    loc, scale, A_t = torch.tensor(params["loc"]), torch.tensor(params["scale"]), torch.tensor(A)
    explicit = LinearConstrainedNormal(loc, scale, A=A_t, k=torch.tensor([0.7, 0.7]))
    for k in (0.7, torch.tensor(0.7), torch.tensor([0.7]), np.float64(0.7)):
        dist = LinearConstrainedNormal(loc, scale, A=A_t, k=k)
        assert dist.k.shape == (2,)
        torch.testing.assert_close(dist.mean, explicit.mean)
    expected_mean, _ = oracle.conditional_moments(params["loc"], cov, A, [0.7, 0.7])
    np.testing.assert_allclose(explicit.mean.numpy(), expected_mean, atol=1e-12)
    with pytest.raises(ValueError, match=r"k must have shape \(\.\.\., a\) with a = 2"):
        LinearConstrainedNormal(loc, scale, A=A_t, k=torch.zeros(3))
    with pytest.raises(
        ValueError, match=r"do not broadcast: loc \(2,\), scale \(\), A \(\), k \(3,\)"
    ):
        LinearConstrainedNormal(torch.stack([loc, loc]), scale, A=A_t, k=torch.zeros(3, 2))


# An ELBO with a hand-written LinearConstrainedNormal guide. Model: z ~ LCN(PRIOR_LOC,
# diag(PRIOR_SCALE^2), A, k), y ~ N(z, NOISE^2 I); guide: z ~ LCN(loc, scale or scale_tril).
ELBO_A = np.array([[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 0.0, 2.0]])
ELBO_K = np.array([1.0, 0.5])
PRIOR_LOC, PRIOR_SCALE = np.array([0.2, -0.1, 0.4, 0.0]), np.array([1.0, 0.8, 1.3, 0.6])
GUIDE_LOC, GUIDE_SCALE = np.array([0.3, -0.4, 0.1, 0.5]), np.array([0.7, 0.5, 0.9, 0.6])
OBSERVED, NOISE = np.array([0.3, -0.2, 0.5, 0.1]), 0.5
ELBO_PAIRS = [
    (Trace_ELBO, JitTrace_ELBO),
    (TraceMeanField_ELBO, JitTraceMeanField_ELBO),
    (TraceGraph_ELBO, JitTraceGraph_ELBO),
]


def _elbo_model_and_guide(factor):
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    A, k = t(ELBO_A), t(ELBO_K)

    def model():
        z = pyro.sample("z", LinearConstrainedNormal(t(PRIOR_LOC), t(PRIOR_SCALE), A=A, k=k))
        pyro.sample("y", pdist.Normal(z, NOISE).to_event(1), obs=t(OBSERVED))

    def guide():
        loc = pyro.param("loc", t(GUIDE_LOC))
        if factor == "scale":
            scale = pyro.param("scale", t(GUIDE_SCALE), constraint=constraints.positive)
            pyro.sample("z", LinearConstrainedNormal(loc, scale, A=A, k=k))
        else:
            tril = pyro.param(
                "scale_tril", t(np.diag(GUIDE_SCALE)), constraint=constraints.lower_cholesky
            )
            pyro.sample("z", LinearConstrainedNormal(loc, scale_tril=tril, A=A, k=k))

    return model, guide


def _closed_form_loss():
    """-ELBO = KL(q || p) + E_q[-log N(y; z, NOISE^2 I)], from the conditional moments."""
    cov_q, cov_p = np.diag(GUIDE_SCALE**2), np.diag(PRIOR_SCALE**2)
    moments_q = oracle.conditional_moments(GUIDE_LOC, cov_q, ELBO_A, ELBO_K)
    moments_p = oracle.conditional_moments(PRIOR_LOC, cov_p, ELBO_A, ELBO_K)
    mean, covariance = moments_q
    expected_nll = np.sum(
        0.5 * np.log(2 * np.pi * NOISE**2)
        + ((OBSERVED - mean) ** 2 + np.diag(covariance)) / (2 * NOISE**2)
    )
    return oracle.kl_same_support(moments_q, moments_p) + expected_nll, moments_q


# Converting A == A' to a bool in the KL check is a constant of the trace: expected.
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("factor", ["scale", "scale_tril"])
@pytest.mark.parametrize(("elbo_class", "jit_class"), ELBO_PAIRS, ids=lambda c: c.__name__)
def test_jit_elbos_with_a_hand_written_guide_agree_with_the_closed_form(
    elbo_class, jit_class, factor
):
    # The sampler wrote into its noise buffer (addcmul out=, sub_) under no_grad; JIT traces
    # do not record no_grad, and the TorchScript interpreter refused the replayed out= op.
    model, guide = _elbo_model_and_guide(factor)
    expected, (mean, covariance) = _closed_form_loss()
    # Monte Carlo standard error of a 4000-particle estimate: the spread of the
    # per-particle loss, from exact conditional samples drawn by NumPy.
    rng = np.random.default_rng(0)
    z = rng.multivariate_normal(mean, covariance, size=100_000, method="eigh")
    quadratic = np.sum((OBSERVED - z) ** 2, -1) / (2 * NOISE**2)
    particles = 4000
    standard_error = quadratic.std() / math.sqrt(particles)
    if elbo_class is not TraceMeanField_ELBO:  # log q - log p of each sample adds spread
        standard_error *= 3
    for cls in (elbo_class, jit_class):
        pyro.clear_param_store()
        pyro.set_rng_seed(1)
        elbo = cls(num_particles=particles, vectorize_particles=True, max_plate_nesting=0)
        for _ in range(2):  # the second JIT call runs the compiled trace
            loss = elbo.loss_and_grads(model, guide)
            assert abs(loss - expected) < 5 * standard_error, (cls.__name__, loss, expected)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize("factor", ["scale", "scale_tril"])
@pytest.mark.parametrize(
    ("elbo_class", "jit_class"),
    [(Trace_ELBO, JitTrace_ELBO), (TraceGraph_ELBO, JitTraceGraph_ELBO)],
    ids=lambda c: c.__name__,
)
def test_jit_elbos_give_the_losses_and_gradients_of_the_plain_elbos(elbo_class, jit_class, factor):
    # Same seed, same draws: the compiled trace gives the same single-particle loss and
    # gradients as the plain ELBO (the gradients differed while the draw was kept out of
    # the graph by no_grad alone, which a trace does not record). The first JIT call draws
    # twice, once while tracing; Pyro's JitTraceMeanField_ELBO draws in another order than
    # TraceMeanField_ELBO even for Normal guides, so it is compared with the closed form
    # above instead.
    model, guide = _elbo_model_and_guide(factor)
    results = {}
    for cls in (elbo_class, jit_class):
        pyro.clear_param_store()
        elbo = cls()
        pyro.set_rng_seed(0)
        elbo.loss_and_grads(model, guide)  # warm-up (traces the JIT version)
        results[cls] = []
        for seed in range(3):
            for param in pyro.get_param_store().values():
                param.unconstrained().grad = None
            pyro.set_rng_seed(seed + 1)
            loss = elbo.loss_and_grads(model, guide)
            grads = [p.unconstrained().grad.clone() for p in pyro.get_param_store().values()]
            results[cls].append((loss, grads))
    for (loss, grads), (jit_loss, jit_grads) in zip(
        results[elbo_class], results[jit_class], strict=True
    ):
        assert math.isfinite(loss)
        np.testing.assert_allclose(jit_loss, loss, rtol=1e-10)
        for grad, jit_grad in zip(grads, jit_grads, strict=True):
            torch.testing.assert_close(jit_grad, grad, rtol=1e-8, atol=1e-10)


def test_repr_names_each_parameter_by_value_or_shape():
    # torch.distributions' convention: a one-element parameter by its value, else its shape;
    # the covariance argument as stored (scale, or scale_tril for a full covariance), each
    # parameter with its own shape, as torch's MultivariateNormal prints them.
    loc = torch.zeros(2, 4)
    d = LinearConstrainedNormal(loc, torch.ones(4), k=1.5)
    assert repr(d) == (
        "LinearConstrainedNormal(loc: torch.Size([2, 4]), scale: torch.Size([4]), "
        "A: torch.Size([1, 4]), k: 1.5)"
    )
    A = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 0.0, 0.0]])
    d = LinearConstrainedNormal(loc[0], covariance_matrix=2 * torch.eye(4), A=A)
    assert repr(d) == (
        "LinearConstrainedNormal(loc: torch.Size([4]), scale_tril: torch.Size([4, 4]), "
        "A: torch.Size([2, 4]), k: torch.Size([2]))"
    )


# --- the diagonal-scale log_prob and its hand-written gradient ---------------------------


def _diag_inputs(scale_batch, value_batch=(3,), seed=4, n=5, a=2):
    """float64 (loc, scale, A, k, value) with loc of batch (3,), a scale of ``scale_batch``
    and values on the subspace of batch ``value_batch``."""
    rng = np.random.default_rng(seed)
    A, k = rng.normal(size=(a, n)), rng.normal(size=a)
    loc = torch.tensor(rng.normal(size=(3, n)), requires_grad=True)
    scale = torch.tensor(rng.uniform(0.5, 2.0, size=scale_batch + (n,)), requires_grad=True)
    value = torch.tensor(oracle.project(rng.normal(size=value_batch + (n,)), A, k))
    return loc, scale, torch.tensor(A), torch.tensor(k), value.requires_grad_()


def _recorded_log_prob(dist, value):
    """The same density differentiated by autograd through the recorded QR."""
    off = ~dist.constraint._check(value.detach(), dist.k)
    return dist._log_prob_recorded(value, None if dist._validate_args else off)


@pytest.mark.parametrize(
    ("scale_batch", "value_batch"), [((), (3,)), ((3,), (3,)), ((), (2, 3)), ((3,), ())]
)
def test_diagonal_log_prob_gradient_equals_autograd_through_the_factorisation(
    scale_batch, value_batch
):
    # The hand-written backward of _ProjectedLogDensity against autograd through the
    # row-sorted QR (the generic path), for a shared and a per-example scale, values with
    # sample dimensions and values broadcast against the batch.
    loc, scale, A, k, value = _diag_inputs(scale_batch, value_batch)
    dist = LinearConstrainedNormal(loc, scale, A=A, k=k, validate_args=False)
    fast = dist.log_prob(value)
    weights = torch.tensor(np.random.default_rng(5).normal(size=fast.shape))
    assert fast.grad_fn is not None and "ProjectedLogDensity" in type(fast.grad_fn).__name__
    slow = _recorded_log_prob(dist, value)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    inputs = (loc, scale, value)
    fast_grads = torch.autograd.grad((weights * fast).sum(), inputs)
    slow_grads = torch.autograd.grad((weights * slow).sum(), inputs)
    for fast_grad, slow_grad in zip(fast_grads, slow_grads, strict=True):
        assert fast_grad.shape == slow_grad.shape
        torch.testing.assert_close(fast_grad, slow_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale_batch", [(), (3,)])
def test_diagonal_log_prob_passes_gradcheck_and_gradgradcheck(scale_batch):
    # Finite differences in float64. The values move off the subspace under the
    # perturbation, so the support tolerance is widened to keep them scored.
    loc, scale, A, k, value = _diag_inputs(scale_batch)

    def log_prob(loc, scale, value):
        dist = LinearConstrainedNormal(loc, scale, A=A, k=k, rtol=1e-3, validate_args=False)
        return dist.log_prob(value)

    inputs = (loc, scale, value)
    assert torch.autograd.gradcheck(log_prob, inputs)
    # Second derivatives (Hessians, Laplace approximations) go through the recorded path.
    assert torch.autograd.gradgradcheck(log_prob, inputs)


def test_diagonal_log_prob_off_the_subspace_is_minus_inf_with_zero_gradient():
    loc, scale, A, k, value = _diag_inputs((), (3,))
    value = value.detach().clone()
    value[1] += 1e-3  # off the subspace, by far more than the tolerance
    dist = LinearConstrainedNormal(loc, scale, A=A, k=k, validate_args=False)
    log_prob = dist.log_prob(value)
    assert torch.isneginf(log_prob[1]) and torch.isfinite(log_prob[[0, 2]]).all()
    slow = _recorded_log_prob(dist, value)
    weights = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    grads = torch.autograd.grad((weights * log_prob).sum(), (loc, scale))
    slow_grads = torch.autograd.grad((weights * slow).sum(), (loc, scale))
    assert (grads[0][1] == 0).all()
    for grad, slow_grad in zip(grads, slow_grads, strict=True):
        torch.testing.assert_close(grad, slow_grad, rtol=1e-10, atol=1e-12)


def test_diagonal_log_prob_gradient_without_constraint_is_the_normal_one():
    # With a -> 0 the formulas reduce to those of log N(z; loc, s^2); a one-row constraint
    # on a coordinate the values do not involve checks the leverage term too: fixing
    # z_0 = c makes the density that of the other coordinates, N(z_i; loc_i, s_i).
    n = 4
    A = torch.zeros(1, n, dtype=torch.float64)
    A[0, 0] = 1.0
    loc = torch.tensor([[0.3, -0.2, 1.1, 0.4]], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([0.7, 1.3, 0.9, 2.0], dtype=torch.float64, requires_grad=True)
    value = torch.tensor([[0.5, 0.1, 0.7, -0.6]], dtype=torch.float64)
    dist = LinearConstrainedNormal(loc, scale, A=A, k=value[:, :1], validate_args=False)
    reference = pdist.Normal(loc[:, 1:], scale[1:]).log_prob(value[:, 1:]).sum(-1)
    torch.testing.assert_close(dist.log_prob(value), reference, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(dist.log_prob(value).sum(), (loc, scale))
    expected = torch.autograd.grad(reference.sum(), (loc, scale))
    for grad, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


def test_diagonal_log_prob_under_torch_func_transforms():
    # The hand-written autograd.Function runs under torch.func (setup_context, a generated
    # vmap rule, a jvp), with the values and gradients of the recorded path.
    loc, scale, A, k, value = _diag_inputs((), (3,))
    value = value.detach()

    def total(loc, scale):
        return (
            LinearConstrainedNormal(loc, scale, A=A, k=k, validate_args=False).log_prob(value).sum()
        )

    grads = torch.func.grad(total, argnums=(0, 1))(loc.detach(), scale.detach())
    expected = torch.autograd.grad(total(loc, scale), (loc, scale))
    for grad, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-12)
    mapped = torch.func.vmap(lambda loc: total(loc, scale.detach()))(loc.detach()[:, None])
    singles = [total(row[None], scale) for row in loc.detach()]
    torch.testing.assert_close(mapped, torch.stack(singles).detach(), rtol=1e-12, atol=1e-12)


def test_diagonal_log_prob_jacobians_and_hessians_under_torch_func_are_the_recorded_ones():
    # jacrev and jacfwd (the Function's jvp), and hessian (forward over reverse: the backward
    # differentiated, with Q from the recorded factorisation of the scale) against autograd
    # through the recorded QR.
    loc, scale, A, k, value = _diag_inputs((), (3,))
    value = value.detach()

    def fast(loc, scale):
        dist = LinearConstrainedNormal(loc, scale, A=A, k=k, validate_args=False)
        return dist.log_prob(value)

    def recorded(loc, scale):
        dist = LinearConstrainedNormal(loc, scale, A=A, k=k, validate_args=False)
        return dist._log_prob_recorded(value, None)

    args = (loc.detach(), scale.detach())
    assert "ProjectedLogDensity" in type(fast(loc, scale).grad_fn).__name__
    for transform in (torch.func.jacrev, torch.func.jacfwd):
        for got, want in zip(
            transform(fast, argnums=(0, 1))(*args),
            torch.autograd.functional.jacobian(recorded, args),
            strict=True,
        ):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    total = lambda loc, scale: fast(loc, scale).sum()  # noqa: E731
    want = torch.autograd.functional.hessian(lambda l, s: recorded(l, s).sum(), args)
    got = torch.func.hessian(total, argnums=(0, 1))(*args)
    for i in range(2):
        for j in range(2):
            torch.testing.assert_close(got[i][j], want[i][j], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("prebuilt", [False, True], ids=["arguments", "LinearConstraint"])
def test_torch_func_with_validation_on(prebuilt):
    """The default (validation on) under torch.func.grad and hessian: the checks of A's rank
    and of the factor's precision read values in NumPy, which ``.numpy()`` refused inside a
    transform (every tensor there is a wrapper without storage)."""
    loc, scale, A, k, value = _diag_inputs((), (3,))
    constraint = LinearConstraint(A) if prebuilt else None

    def log_prob(loc, scale):
        if prebuilt:
            return constraint.normal(loc, scale, k=k, validate_args=True).log_prob(value).sum()
        return (
            LinearConstrainedNormal(loc, scale, A=A, k=k, validate_args=True).log_prob(value).sum()
        )

    args = (loc.detach(), scale.detach())
    expected = torch.autograd.grad(log_prob(loc, scale), (loc, scale))
    for got, want in zip(torch.func.grad(log_prob, argnums=(0, 1))(*args), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    want = torch.autograd.functional.hessian(lambda l: log_prob(l, scale.detach()), args[0])
    got = torch.func.hessian(lambda l: log_prob(l, args[1]))(args[0])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_a_covariance_that_is_not_positive_definite_without_validation_gives_nan():
    """Validation off: the factorisation's failure was ignored and a partial factor used
    (finite, wrong variances of 0.75); NaN now, as NumPyro gives (validation on raises)."""
    import jax.numpy as jnp

    import numpyro_constrained

    covariance = np.diag([1.0, -1.0, 1.0, 1.0])
    d = LinearConstrainedNormal(
        torch.zeros(4, dtype=torch.float64),
        covariance_matrix=torch.tensor(covariance),
        validate_args=False,
    )
    j = numpyro_constrained.LinearConstrainedNormal(
        jnp.zeros(4), covariance_matrix=jnp.asarray(covariance), validate_args=False
    )
    for value in (d.variance, d.entropy(), j.variance, j.entropy()):
        assert np.all(np.isnan(np.asarray(value))), value
    with pytest.raises(ValueError, match="positive definite"):
        LinearConstrainedNormal(torch.zeros(4), covariance_matrix=torch.tensor(covariance).float())
