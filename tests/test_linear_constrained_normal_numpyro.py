"""LinearConstrainedNormal (NumPyro) against SciPy's singular normal, NumPyro's
ZeroSumNormal and Monte Carlo; jit / vmap / grad; NumPyro's conventions (parameter
constraints, pytrees, vmap_over, promote_batch_shape / scan, validation under jit, NUTS)."""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
from jax import lax
from numpyro import handlers
from numpyro.contrib.control_flow import scan
from numpyro.diagnostics import effective_sample_size
from numpyro.distributions import ZeroSumNormal, constraints, kl_divergence
from numpyro.distributions.batch_util import promote_batch_shape, vmap_over
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.transforms import biject_to
from numpyro.infer import MCMC, NUTS
from numpyro.infer.util import log_density

from numpyro_constrained import LinearConstrainedNormal
from numpyro_constrained.losses import expected_l1_loss, expected_l2_loss
from tests.oracles import linear_gaussian as oracle

CASES = oracle.CASES
KEY = jax.random.PRNGKey(0)


@pytest.fixture
def validation_on():
    """NumPyro's validation switched on for the test, and restored afterwards."""
    previous = Distribution._validate_args
    numpyro.enable_validation(True)
    yield
    numpyro.enable_validation(previous)


def build(case, n=5, a=2, seed=0, dtype=jnp.float64, **kwargs):
    params, cov, A, k = oracle.random_parameters(case, n, a, seed)
    arrays = {name: jnp.asarray(value, dtype=dtype) for name, value in params.items()}
    return LinearConstrainedNormal(**arrays, **kwargs), params, cov, A, k


@pytest.mark.parametrize("case", CASES)
def test_log_prob_and_entropy_match_scipy_singular_normal(case):
    dist, params, cov, A, k = build(case)
    reference = oracle.singular_normal(params["loc"], cov, A, k)
    # Projected, so that log_prob is compared on the subspace itself (SciPy's draws satisfy
    # A z = k only to about 1e-8 relative, within the default tolerance but not exactly).
    values = oracle.project(reference.rvs(size=7, random_state=1), A, k)
    np.testing.assert_allclose(dist.log_prob(values), reference.logpdf(values), rtol=1e-8)
    np.testing.assert_allclose(dist.entropy(), reference.entropy(), rtol=1e-10)


@pytest.mark.parametrize("scale", [0.3, 1.7])
def test_zero_sum_case_equals_numpyro_zero_sum_normal(scale):
    n = 5
    reference = ZeroSumNormal(scale, event_shape=(n,))
    values = reference.sample(KEY, (20,))
    dist = LinearConstrainedNormal(jnp.zeros(n), jnp.full(n, scale))
    np.testing.assert_allclose(dist.log_prob(values), reference.log_prob(values), rtol=1e-10)
    np.testing.assert_allclose(dist.variance, reference.variance, rtol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_moments_and_marginals_match_the_conditional_gaussian(case):
    dist, params, cov, A, k = build(case)
    mean, covariance = oracle.conditional_moments(params["loc"], cov, A, k)
    np.testing.assert_allclose(dist.mean, mean, atol=1e-12)
    np.testing.assert_allclose(dist.variance, np.diag(covariance), atol=1e-12)
    np.testing.assert_allclose(dist.covariance_matrix, covariance, atol=1e-12)
    np.testing.assert_allclose(dist.marginals.loc, mean, atol=1e-12)
    np.testing.assert_allclose(dist.marginals.scale, np.sqrt(np.diag(covariance)), atol=1e-12)


@pytest.mark.parametrize("case", ["diag", "full_cov"])
def test_monte_carlo_moments_of_1e5_samples(case):
    dist, params, cov, A, k = build(case)
    mean, covariance = oracle.conditional_moments(params["loc"], cov, A, k)
    samples = np.asarray(dist.sample(KEY, (100_000,)))
    # 5 standard errors: sqrt(var / N) (mean), sqrt((S_ii S_jj + S_ij^2) / N) (covariance).
    std = np.sqrt(np.diag(covariance))
    assert np.all(np.abs(samples.mean(0) - mean) < 5 * std / math.sqrt(1e5) + 1e-12)
    cov_se = np.sqrt((np.outer(std**2, std**2) + covariance**2) / 1e5)
    assert np.all(np.abs(np.cov(samples.T) - covariance) < 5 * cov_se + 1e-12)
    assert np.abs(samples @ A.T - k).max() < 1e-10


@pytest.mark.parametrize("case", ["diag", "scale_tril"])
def test_samples_pass_goodness_of_fit_on_the_subspace(case):
    dist, params, cov, A, k = build(case)
    samples = dist.sample(jax.random.PRNGKey(1), (4000,))
    radius_p, coordinate_p = oracle.goodness_of_fit_pvalues(samples, params["loc"], cov, A, k)
    assert radius_p > 1e-3 and coordinate_p > 1e-3


def test_batch_dimensions_broadcast_against_scipy():
    rng = np.random.default_rng(3)
    n, a = 4, 2
    loc = rng.normal(size=(2, 1, n))
    scale = rng.uniform(0.5, 2, size=(3, n))
    A = rng.normal(size=(a, n))
    k = rng.normal(size=(2, 1, a))
    dist = LinearConstrainedNormal(loc, scale, A=A, k=k)
    assert dist.batch_shape == (2, 3) and dist.event_shape == (n,)
    samples = np.asarray(dist.sample(KEY, (5,)))
    assert samples.shape == (5, 2, 3, n)
    log_prob = dist.log_prob(samples)
    for i in range(2):
        for j in range(3):
            reference = oracle.singular_normal(loc[i, 0], np.diag(scale[j] ** 2), A, k[i, 0])
            np.testing.assert_allclose(log_prob[:, i, j], reference.logpdf(samples[:, i, j]))
            assert np.abs(A @ samples[:, i, j].T - k[i, 0][:, None]).max() < 1e-10


def test_batched_A_and_full_covariance():
    A = np.random.default_rng(4).normal(size=(3, 1, 4))
    params, cov, _, _ = oracle.random_parameters("scale_tril", n=4, seed=4)
    dist = LinearConstrainedNormal(params["loc"], scale_tril=params["scale_tril"], A=A)
    assert dist.batch_shape == (3,)
    values = dist.sample(KEY, (2,))
    for b in range(3):
        reference = oracle.singular_normal(params["loc"], cov, A[b], np.zeros(1))
        np.testing.assert_allclose(dist.log_prob(values)[:, b], reference.logpdf(values[:, b]))


def test_expand_and_infer_shapes():
    dist, *_ = build("diag")
    expanded = dist.expand((3, 2))
    assert isinstance(expanded, LinearConstrainedNormal)
    assert expanded.batch_shape == (3, 2) and expanded.sample(KEY, (4,)).shape == (4, 3, 2, 5)
    value = dist.sample(KEY)
    np.testing.assert_allclose(
        expanded.log_prob(value), jnp.broadcast_to(dist.log_prob(value), (3, 2))
    )
    np.testing.assert_allclose(expanded.mean, jnp.broadcast_to(dist.mean, (3, 2, 5)))
    np.testing.assert_allclose(expanded.variance, jnp.broadcast_to(dist.variance, (3, 2, 5)))
    np.testing.assert_allclose(expanded.entropy(), jnp.broadcast_to(dist.entropy(), (3, 2)))
    shapes = LinearConstrainedNormal.infer_shapes((2, 1, 5), scale=(3, 5), A=(2, 5), k=(2,))
    assert shapes == ((2, 3), (5,))


def test_float32_keeps_its_dtype_with_x64_enabled():
    dist, params, cov, A, k = build("diag", dtype=jnp.float32)
    samples = dist.sample(KEY, (50,))
    for array in (samples, dist.mean, dist.variance, dist.log_prob(samples), dist.entropy()):
        assert array.dtype == jnp.float32
    reference = oracle.logpdf(oracle.project(samples, A, k), params["loc"], cov, A, k)
    np.testing.assert_allclose(dist.log_prob(samples), reference, rtol=1e-4, atol=1e-4)


def test_large_n_with_diagonal_covariance_never_forms_n_by_n():
    # An n x n float64 matrix at n = 2 10^5 would need 320 GB.
    n, a = 200_000, 3
    A = jax.random.normal(jax.random.PRNGKey(2), (a, n))
    dist = LinearConstrainedNormal(jnp.zeros(n), jnp.ones(n), A=A, k=jnp.ones(a))
    z = dist.sample(KEY)
    assert jnp.isfinite(dist.log_prob(z))
    assert jnp.abs(A @ z - 1).max() < 1e-6
    assert jnp.isfinite(expected_l1_loss(dist, dist.mean)) and dist.variance.shape == (n,)


def test_jit_vmap_and_vmap_over():
    dist, params, cov, A, k = build("diag")
    value = dist.sample(KEY, (3,))
    np.testing.assert_allclose(
        jax.jit(lambda d, z: d.log_prob(z))(dist, value), dist.log_prob(value)
    )
    jitted = jax.jit(lambda loc, scale: LinearConstrainedNormal(loc, scale, A=A, k=k).sample(KEY))
    np.testing.assert_allclose(jitted(params["loc"], params["scale"]), dist.sample(KEY))

    locs = jnp.stack([jnp.asarray(params["loc"]) + shift for shift in (0.0, 1.0, -2.0)])
    scales = jnp.stack([jnp.asarray(params["scale"]) * factor for factor in (1.0, 2.0, 0.5)])

    def make(loc, scale):
        return LinearConstrainedNormal(loc, scale, A=A, k=k)

    for axes, args in (
        ({"loc": 0}, (locs, jnp.asarray(params["scale"]))),
        ({"scale": 0}, (jnp.asarray(params["loc"]), scales)),
    ):
        in_axes = tuple(0 if name in axes else None for name in ("loc", "scale"))
        batched = jax.vmap(make, in_axes=in_axes, out_axes=vmap_over(dist, **axes))(*args)
        for b in range(3):
            one = make(
                *(arg[b] if axis == 0 else arg for arg, axis in zip(args, in_axes, strict=True))
            )
            np.testing.assert_allclose(batched.mean[b], one.mean)
            np.testing.assert_allclose(batched.log_prob(value[0])[b], one.log_prob(value[0]))


def test_a_site_inside_a_plate_is_expanded():
    dist, params, cov, A, k = build("diag")

    def model():
        with numpyro.plate("bags", 3):
            return numpyro.sample("z", dist)

    trace = handlers.trace(handlers.seed(model, 0)).get_trace()
    site = trace["z"]
    assert site["value"].shape == (3, 5)
    log_prob = site["fn"].log_prob(site["value"])
    np.testing.assert_allclose(log_prob, oracle.logpdf(site["value"], params["loc"], cov, A, k))
    promoted = promote_batch_shape(site["fn"])
    assert promoted.batch_shape == (3,) and "scale_tril" not in promoted.__dict__


# --- gradients ---------------------------------------------------------------------------


def test_default_estimator_gradient_is_the_gradient_of_the_conditional_mean():
    params, cov, A, k = oracle.random_parameters("diag")
    weights = np.random.default_rng(5).normal(size=5)

    def through_sample(loc, scale):
        return weights @ LinearConstrainedNormal(loc, scale, A=A, k=k).sample(KEY)

    grad_loc, grad_scale = jax.grad(through_sample, argnums=(0, 1))(params["loc"], params["scale"])

    def objective(loc_np, scale_np):
        mean, _ = oracle.conditional_moments(loc_np, np.diag(scale_np**2), A, k)
        return weights @ mean

    step, eye = 1e-6, np.eye(5)
    loc0, scale0 = params["loc"], params["scale"]
    fd_loc = [
        (objective(loc0 + step * e, scale0) - objective(loc0 - step * e, scale0)) / (2 * step)
        for e in eye
    ]
    fd_scale = [
        (objective(loc0, scale0 + step * e) - objective(loc0, scale0 - step * e)) / (2 * step)
        for e in eye
    ]
    np.testing.assert_allclose(grad_loc, fd_loc, atol=1e-7)
    np.testing.assert_allclose(grad_scale, fd_scale, atol=1e-7)


def test_sample_value_is_the_same_exact_sample_for_both_estimators():
    params, cov, A, k = oracle.random_parameters("diag")
    samples = [
        LinearConstrainedNormal(params["loc"], params["scale"], A=A, k=k, grad_estimator=g).sample(
            KEY, (3,)
        )
        for g in ("marginal_expectation", "pathwise")
    ]
    np.testing.assert_array_equal(samples[0], samples[1])
    assert LinearConstrainedNormal(params["loc"], params["scale"], A=A, k=k).has_rsample


def test_pathwise_estimator_is_unbiased_for_the_expected_l2_loss():
    params, cov, A, k = oracle.random_parameters("diag")
    mean, _ = oracle.conditional_moments(params["loc"], cov, A, k)
    target = oracle.project(mean + np.random.default_rng(6).normal(size=5) * 0.5, A, k)
    theta = (jnp.asarray(params["loc"]), jnp.asarray(params["scale"]))

    def closed_form(loc, scale):
        return expected_l2_loss(LinearConstrainedNormal(loc, scale, A=A, k=k), target)

    def monte_carlo(loc, scale, key, estimator):
        dist = LinearConstrainedNormal(loc, scale, A=A, k=k, grad_estimator=estimator)
        return jnp.mean(jnp.sum(jnp.square(dist.sample(key, (2000,)) - target), -1))

    truth = jnp.concatenate(jax.grad(closed_form, argnums=(0, 1))(*theta))
    keys = jax.random.split(KEY, 20)

    @partial(jax.jit, static_argnums=1)
    def estimate(key, estimator):
        return jnp.concatenate(jax.grad(monte_carlo, argnums=(0, 1))(*theta, key, estimator))

    replicates = jnp.stack([estimate(key, "pathwise") for key in keys])
    standard_error = replicates.std(0, ddof=1) / math.sqrt(20)
    assert jnp.all(jnp.abs(replicates.mean(0) - truth) < 5 * standard_error + 1e-9)
    biased = jnp.stack([estimate(key, "marginal_expectation") for key in keys[:5]]).mean(0)
    assert jnp.abs(biased[5:] - truth[5:]).max() > 0.5


# --- KL and losses ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case_p", "case_q"),
    [("diag", "diag"), ("diag", "full_cov"), ("scale_tril", "diag"), ("full_cov", "scale_tril")],
)
def test_kl_matches_the_pseudo_inverse_formula(case_p, case_q):
    p, params_p, cov_p, A, k = build(case_p, seed=0)
    params_q, cov_q, _, _ = oracle.random_parameters(case_q, seed=1)
    q = LinearConstrainedNormal(**{**params_q, "A": A, "k": k})
    expected = oracle.kl_same_support(
        oracle.conditional_moments(params_p["loc"], cov_p, A, k),
        oracle.conditional_moments(params_q["loc"], cov_q, A, k),
    )
    np.testing.assert_allclose(kl_divergence(p, q), expected, rtol=1e-9)
    assert abs(kl_divergence(p, p)) < 1e-10
    np.testing.assert_allclose(jax.jit(lambda p, q: kl_divergence(p, q))(p, q), expected, rtol=1e-9)


def test_kl_rejects_different_constraints():
    p, *_ = build("diag", seed=0)
    q, *_ = build("diag", seed=1)
    with pytest.raises(ValueError, match="same A and k"):
        kl_divergence(p, q)


@pytest.mark.parametrize("case", CASES)
def test_expected_losses_match_quadrature_and_monte_carlo(case):
    dist, params, cov, A, k = build(case)
    target = oracle.singular_normal(params["loc"], cov, A, k).rvs(random_state=2)
    l1_ref, l2_ref = oracle.expected_losses(params["loc"], cov, A, k, target)
    l1, l2 = expected_l1_loss(dist, target), expected_l2_loss(dist, target)
    np.testing.assert_allclose([l1, l2], [l1_ref, l2_ref], rtol=1e-6)
    samples = dist.sample(KEY, (100_000,))
    for estimate, closed in (
        (jnp.abs(samples - target).sum(-1), l1),
        (jnp.square(samples - target).sum(-1), l2),
    ):
        assert abs(estimate.mean() - closed) < 5 * estimate.std() / math.sqrt(1e5)


def test_l1_loss_with_a_coordinate_fixed_by_the_constraint_has_finite_gradients():
    A, k = np.array([[1.0, 0.0, 0.0, 0.0, 0.0]]), np.array([0.7])  # fixes z_0 = 0.7
    target = np.array([0.2, 0.0, 1.0, -0.5, 0.3])

    def loss(loc, scale):
        return expected_l1_loss(LinearConstrainedNormal(loc, scale, A=A, k=k), target)

    loc, scale = jnp.array([0.3, -1.0, 2.0, 0.0, 0.5]), jnp.array([1.0, 0.5, 2.0, 1.5, 0.7])
    l1_ref, _ = oracle.expected_losses(loc, np.diag(scale**2), A, k, target)
    np.testing.assert_allclose(loss(loc, scale), l1_ref, rtol=1e-8)
    assert all(jnp.isfinite(g).all() for g in jax.grad(loss, argnums=(0, 1))(loc, scale))


# --- support, bijection, validation -------------------------------------------------------


def test_registered_bijection_is_an_isometry_onto_the_subspace():
    dist, params, cov, A, k = build("diag")
    transform = biject_to(dist.support)
    u = jax.random.normal(KEY, (10, 3))
    z = transform(u)
    assert z.shape == (10, 5)
    assert np.abs(z @ A.T - k).max() < 1e-12
    assert dist.support(z).all()
    np.testing.assert_allclose(transform.inv(z), u, atol=1e-12)
    distances = lambda x: jnp.linalg.norm(x[:, None] - x[None], axis=-1)  # noqa: E731
    np.testing.assert_allclose(distances(z), distances(u), atol=1e-12)
    assert (transform.log_abs_det_jacobian(u, z) == 0).all()
    assert transform.inverse_shape((3, 5)) == (3, 3) and transform.forward_shape((3, 3)) == (3, 5)
    assert dist.support(dist.support.feasible_like(z)).all()


def test_log_prob_off_the_subspace(validation_on):
    # NumPyro's rule for every distribution: with validation on, a concrete value outside
    # the support gets NumPyro's own UserWarning and -inf (not an error).
    dist, *_ = build("diag")
    value = dist.sample(KEY) + 1e-3
    with pytest.warns(UserWarning, match="Out-of-support values provided to log prob method"):
        assert dist.log_prob(value) == -jnp.inf
    # A NaN entry is named as such (its residual and bound are NaN: no tolerance to suggest).
    with pytest.warns(UserWarning, match="1 value.s. have NaN or infinite entries"):
        assert dist.log_prob(value.at[1].set(jnp.nan)) == -jnp.inf
    assert jax.jit(lambda d, z: d.log_prob(z))(dist, value) == -jnp.inf
    unchecked, *_ = build("diag", validate_args=False)
    assert unchecked.log_prob(value) == -jnp.inf
    assert jnp.isfinite(unchecked.log_prob(unchecked.sample(KEY)))


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
    kwargs = {"loc": [0.0, 1.0, 2.0], "scale": [1.0, 1.0, 1.0], **overrides}
    kwargs = {
        name: jnp.asarray(value) if not isinstance(value, str) and value is not None else value
        for name, value in kwargs.items()
    }
    with pytest.raises(ValueError, match=message):
        LinearConstrainedNormal(**kwargs)


def test_batched_construction_does_not_deadlock_xla_cpu_pool():
    """A batched scale makes the whitened QR and the triangular solve batched LAPACK calls;
    run at the same time they deadlocked XLA's CPU thread pool (every time, on two cores).
    In a subprocess with a time limit, so that a regression fails instead of hanging."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        from numpyro_constrained import LinearConstrainedNormal
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        loc = jax.random.normal(keys[0], (256, 1000), dtype=jnp.float32)
        scale = jax.random.uniform(keys[1], (256, 1000), dtype=jnp.float32) + 0.5
        A = jax.random.normal(keys[2], (10, 1000), dtype=jnp.float32)
        d = LinearConstrainedNormal(loc, scale, A=A, k=jnp.zeros(10, jnp.float32))
        d.sample(keys[3]).block_until_ready()
        print("done")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "done" in result.stdout, result.stderr[-2000:]


# --- NumPyro's conventions (issue 15) -----------------------------------------------------

EVENT_DIMS = {"loc": 1, "scale": 1, "covariance_matrix": 2, "scale_tril": 2, "A": 2, "k": 1}


@pytest.mark.parametrize("case", CASES)
def test_every_argument_satisfies_its_constraint_with_the_argument_event_dim(case):
    # As torch's test_params_constraints: the constraint of each argument has the event dim
    # of the argument (what promote_batch_shape and infer_shapes read), and the arguments
    # given satisfy it, one answer per batch element.
    params, *_ = oracle.random_parameters(case)
    params = {name: np.broadcast_to(value, (3,) + value.shape) for name, value in params.items()}
    dist = LinearConstrainedNormal(**params)
    assert set(dist.arg_constraints) == set(EVENT_DIMS)
    assert set(dist.reparametrized_params) == set(dist.arg_constraints)
    for name, value in params.items():
        constraint = dist.arg_constraints[name]
        assert constraint.event_dim == EVENT_DIMS[name], name
        assert constraint(jnp.asarray(value)).shape == (3,), name
        assert bool(jnp.all(constraint(jnp.asarray(value)))), name
    assert dist.arg_constraints["covariance_matrix"] is constraints.positive_definite
    assert dist.arg_constraints["scale_tril"] is constraints.lower_cholesky


def _scan_and_unrolled_models(case, batch, steps):
    params, cov, A, _ = oracle.random_parameters(case, n=5, a=2, seed=7)
    rng = np.random.default_rng(8)
    params["loc"] = rng.normal(size=batch + (5,))  # batched loc, shared A and covariance
    ks = rng.normal(size=(steps, 2))

    def make(k):
        return LinearConstrainedNormal(**{**params, "A": A, "k": k})

    ys = np.stack([np.asarray(make(ks[t]).sample(jax.random.PRNGKey(t))) for t in range(steps)])

    def scanned():
        def step(carry, x):
            k, y = x
            numpyro.sample("y", make(k), obs=y)
            return carry, None

        scan(step, None, (ks, ys))

    def unrolled():
        for t in range(steps):
            numpyro.sample(f"y_{t}", make(ks[t]), obs=ys[t])

    return scanned, unrolled, (params, cov, A, ks, ys)


@pytest.mark.parametrize("case", ["diag", "full_cov"])
@pytest.mark.parametrize(("batch", "steps"), [((), 4), ((3,), 4), ((3,), 3), ((2, 3), 2)])
def test_scan_scores_an_observed_site_like_the_unrolled_model(case, batch, steps):
    # scan stacks every leaf along a time axis and calls promote_batch_shape: a shared A of
    # shape (a, n) becomes (T, a, n) beside a (T, 3, n) loc, which broadcast T against the
    # batch (an error, or with T == 3 a silently wrong score) until the leaves were aligned.
    scanned, unrolled, (params, cov, A, ks, ys) = _scan_and_unrolled_models(case, batch, steps)
    expected = sum(
        oracle.logpdf(ys[t].reshape(-1, 5)[i], params["loc"].reshape(-1, 5)[i], cov, A, ks[t])
        for t in range(steps)
        for i in range(int(np.prod(batch, dtype=int)))
    )
    unrolled_score = log_density(unrolled, (), {}, {})[0]
    scanned_score = log_density(scanned, (), {}, {})[0]
    np.testing.assert_allclose(unrolled_score, expected, rtol=1e-10)
    np.testing.assert_allclose(scanned_score, expected, rtol=1e-10)


def test_promote_batch_shape_after_vmap_lines_up_every_leaf():
    params, cov, A, k = oracle.random_parameters("diag", seed=9)
    locs = np.random.default_rng(9).normal(size=(4, 3, 5))  # vmapped over 4, batch (3,)

    def make(loc):
        return LinearConstrainedNormal(loc, params["scale"], A=A, k=k)

    batched = jax.vmap(make)(locs)
    assert batched.batch_shape == (3,)
    promoted = promote_batch_shape(batched)
    assert promoted.batch_shape == (4, 3) and batched.batch_shape == (3,)
    assert promoted.loc is batched.loc  # leaves of the full rank are shared, not copied
    values = np.stack([np.asarray(make(loc).sample(KEY)) for loc in locs])
    expected = [
        [oracle.logpdf(values[v, b], locs[v, b], cov, A, k) for b in range(3)] for v in range(4)
    ]
    np.testing.assert_allclose(promoted.log_prob(values), expected, rtol=1e-10)
    np.testing.assert_allclose(promoted.sample(KEY).shape, (4, 3, 5))


ARGUMENT_CASES = ["scale", "covariance_matrix", "scale_tril"]


def _constant_arguments(case):
    params, cov, A, k = oracle.random_parameters(
        {"scale": "diag", "covariance_matrix": "full_cov", "scale_tril": "scale_tril"}[case]
    )
    return {name: jnp.asarray(value) for name, value in params.items()}, cov, A, k


@pytest.mark.parametrize("case", ARGUMENT_CASES)
def test_construction_inside_jit_from_closed_over_constants(case, validation_on):
    # Validation used to call bool() on the results of jnp operations, which are tracers
    # inside jit even for constants (TracerBoolConversionError).
    arguments, cov, A, k = _constant_arguments(case)
    value = LinearConstrainedNormal(**arguments).sample(KEY, (3,))

    @jax.jit
    def build_and_use():
        dist = LinearConstrainedNormal(**arguments)
        return dist.mean, dist.log_prob(value), dist.entropy()

    mean, log_prob, entropy = build_and_use()
    expected_mean, _ = oracle.conditional_moments(arguments["loc"], cov, A, k)
    np.testing.assert_allclose(mean, expected_mean, atol=1e-12)
    np.testing.assert_allclose(log_prob, oracle.logpdf(value, arguments["loc"], cov, A, k))
    np.testing.assert_allclose(entropy, oracle.entropy(arguments["loc"], cov, A, k))


BAD_CONSTANTS = [
    ({"A": jnp.array([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]])}, "rank"),
    ({"scale": jnp.array([1.0, -1.0, 1.0])}, "scale"),
    (
        {"scale": None, "covariance_matrix": jnp.array([[1.0, 2, 0], [2, 1, 0], [0, 0, 1]])},
        "covariance_matrix",
    ),
    ({"scale": None, "scale_tril": jnp.array([[1.0, 1, 0], [0, 1, 0], [0, 0, 1]])}, "scale_tril"),
    ({"k": jnp.array([jnp.nan])}, "k"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_CONSTANTS)
def test_bad_constants_closed_over_inside_jit_are_still_rejected(overrides, message, validation_on):
    # NumPyro validates concrete values under jax.ensure_compile_time_eval(): constants
    # closed over inside jit are concrete and get checked; tracers are skipped.
    kwargs = {"loc": jnp.zeros(3), "scale": jnp.ones(3), **overrides}
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda: LinearConstrainedNormal(**kwargs).mean)()
    traced = {name: value for name, value in overrides.items() if value is not None}
    fixed = {name: value for name, value in kwargs.items() if name not in traced}
    # The same values as traced arguments cannot be inspected, and are not (as NumPyro).
    jax.jit(lambda t: LinearConstrainedNormal(**fixed, **t).loc)(traced)


def test_nuts_on_a_prior_built_from_constants_inside_jit(validation_on):
    # NUTS jits the potential energy, which builds the prior from the constants below: this
    # raised TracerBoolConversionError. The posterior is the prior, whose moments are the
    # conditional Gaussian's, computed here by the textbook formulas.
    rng = np.random.default_rng(11)
    n, a = 4, 2
    loc = rng.normal(size=n)
    factor = rng.normal(size=(n, n))
    covariance = factor @ factor.T / n + 0.5 * np.eye(n)
    A = rng.normal(size=(a, n))
    k = rng.normal(size=a)
    # JAX arrays: jnp operations on them inside jit give tracers, which is what broke.
    constants = {
        "loc": jnp.asarray(loc),
        "covariance_matrix": jnp.asarray(covariance),
        "A": jnp.asarray(A),
        "k": jnp.asarray(k),
    }

    def model():
        numpyro.sample("z", LinearConstrainedNormal(**constants))

    gain = covariance @ A.T @ np.linalg.inv(A @ covariance @ A.T)
    expected_mean = loc + gain @ (k - A @ loc)
    expected_cov = covariance - gain @ A @ covariance

    mcmc = MCMC(NUTS(model), num_warmup=200, num_samples=400, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0))
    samples = np.asarray(mcmc.get_samples()["z"])
    assert np.abs(samples @ A.T - k).max() < 1e-8
    # Monte Carlo tolerance: 5 standard errors with the effective sample size of each
    # coordinate (NUTS draws are correlated).
    ess = np.asarray(effective_sample_size(samples[None]))
    std = np.sqrt(np.diag(expected_cov))
    assert np.all(np.abs(samples.mean(0) - expected_mean) < 5 * std / np.sqrt(ess) + 1e-12)
    cov_se = np.sqrt((np.outer(std**2, std**2) + expected_cov**2) / np.minimum.outer(ess, ess))
    assert np.all(np.abs(np.cov(samples.T) - expected_cov) < 5 * cov_se + 1e-12)


METHODS = {
    "mean": lambda d: d.mean,
    "variance": lambda d: d.variance,
    "covariance_matrix": lambda d: d.covariance_matrix,
    "scale_tril": lambda d: d.scale_tril,
    "scale": lambda d: d.scale,
    "entropy": lambda d: d.entropy(),
    "log_prob": lambda d: d.log_prob(d.mean),
    "sample": lambda d: d.sample(KEY, (2,)),
    "marginals": lambda d: d.marginals.scale,
    "support": lambda d: d.support(d.mean),
}


def _assert_tree_stable(dist, treedef):
    for name, method in METHODS.items():
        method(dist)
        assert jax.tree.structure(dist) == treedef, name
    leaves, structure = jax.tree.flatten(dist)
    roundtrip = jax.tree.unflatten(structure, leaves)
    assert jax.tree.structure(roundtrip) == treedef
    for name, method in METHODS.items():
        method(roundtrip)
        assert jax.tree.structure(roundtrip) == treedef, name


@pytest.mark.parametrize("case", CASES)
def test_tree_structure_is_the_same_before_and_after_every_method(case):
    # The lazily computed scale / scale_tril used to be pytree data fields: computing one
    # added a leaf, so the distribution could not be a scan carry.
    arguments = {
        name: jnp.asarray(value) for name, value in oracle.random_parameters(case)[0].items()
    }
    dist = LinearConstrainedNormal(**arguments)
    treedef = jax.tree.structure(LinearConstrainedNormal(**arguments))
    _assert_tree_stable(dist, treedef)

    @jax.jit
    def traced(arguments):
        dist = LinearConstrainedNormal(**arguments)
        assert jax.tree.structure(dist) == treedef  # traced parameters, same structure
        _assert_tree_stable(dist, treedef)
        return dist

    returned = traced(arguments)
    assert jax.tree.structure(returned) == treedef
    np.testing.assert_allclose(returned.log_prob(dist.mean), dist.log_prob(dist.mean))


@pytest.mark.parametrize("case", ["diag", "scale_tril"])
def test_a_distribution_as_a_scan_carry_and_a_jit_argument(case):
    arguments = {
        name: jnp.asarray(value) for name, value in oracle.random_parameters(case)[0].items()
    }
    factor_name = "scale" if case == "diag" else "scale_tril"
    shifts = jnp.asarray(np.random.default_rng(12).normal(size=(3, 5)))

    def step(dist, shift):
        new = LinearConstrainedNormal(
            dist.loc + shift, **{factor_name: getattr(dist, factor_name)}, A=dist.A, k=dist.k
        )
        return new, new.entropy() + new.log_prob(new.mean)

    init = LinearConstrainedNormal(**arguments)
    # Properties computed on a concrete carry must not change its structure (scale and
    # scale_tril were lazy pytree fields, cached when concrete, not when traced).
    for method in METHODS.values():
        method(init)
    final, outputs = lax.scan(step, init, shifts)
    dist, expected = LinearConstrainedNormal(**arguments), []
    for shift in shifts:
        dist, output = step(dist, shift)
        expected.append(output)
    np.testing.assert_allclose(outputs, expected, rtol=1e-12)
    np.testing.assert_allclose(final.mean, dist.mean, rtol=1e-12)
    through_jit = jax.jit(lambda d: d)(dist)
    assert jax.tree.structure(through_jit) == jax.tree.structure(dist)
    np.testing.assert_allclose(through_jit.sample(KEY), dist.sample(KEY))


def _tree_equal(t1, t2):
    # As NumPyro's test_vmap_dist.
    return jnp.all(
        jax.flatten_util.ravel_pytree(jax.tree.map(lambda x, y: jnp.allclose(x, y), t1, t2))[0]
    )


@pytest.mark.parametrize("case", CASES)
def test_vmap_over_in_the_pattern_of_numpyro_test_vmap_dist(case):
    import jax.flatten_util  # noqa: F401 (ravel_pytree)

    params, *_ = oracle.random_parameters(case)
    params = {name: jnp.asarray(value) for name, value in params.items()}
    names = list(params)

    def make(*args):
        return LinearConstrainedNormal(**dict(zip(names, args, strict=True)))

    args = [params[name] for name in names]
    d = make(*args)
    cases = [(tuple(0 for _ in names), 0)]
    for i, name in enumerate(names):
        single = [0 if j == i else None for j in range(len(names))]
        cases.append((single, 0))
        cases.append((single, vmap_over(d, **{name: 0})))
        cases.append(
            ([1 if j == i else None for j in range(len(names))], vmap_over(d, **{name: 1}))
        )
    for in_axes, out_axes in cases:
        batched_args = [
            jnp.expand_dims(arg, axis) if isinstance(axis, int) else arg
            for arg, axis in zip(args, in_axes, strict=True)
        ]
        d = make(*args)
        batched = jax.vmap(make, in_axes=in_axes, out_axes=out_axes)(*batched_args)
        equal = jax.vmap(_tree_equal, in_axes=(out_axes, None))(batched, d)
        assert equal == jnp.array([True]), (in_axes, out_axes)
        samples = jax.vmap(lambda dist: dist.sample(KEY), in_axes=(out_axes,))(batched)
        assert samples.shape == (1,) + d.sample(KEY).shape
        mean = d.mean
        log_probs = jax.vmap(lambda dist, z=mean: dist.log_prob(z), in_axes=(out_axes,))(batched)
        np.testing.assert_allclose(log_probs, d.log_prob(d.mean)[None], rtol=1e-12)


def test_vmap_over_a_batch_of_covariances_and_constraints():
    # Batches of size 3 (not 1) along every array argument, one at a time, against the
    # distributions built one by one.
    params, *_ = oracle.random_parameters("full_cov")
    rng = np.random.default_rng(13)
    factors = rng.normal(size=(3, 5, 5))
    stacked = {
        "loc": rng.normal(size=(3, 5)),
        "covariance_matrix": factors @ np.swapaxes(factors, -1, -2) / 5 + 0.5 * np.eye(5),
        "A": rng.normal(size=(3, 2, 5)),
        "k": rng.normal(size=(3, 2)),
    }
    for name, batch in stacked.items():
        fixed = {key: value for key, value in params.items() if key != name}

        def make(value, fixed=fixed, name=name):
            return LinearConstrainedNormal(**fixed, **{name: value})

        reference = make(batch[0])
        batched = jax.vmap(make, out_axes=vmap_over(reference, **{name: 0}))(batch)
        for b in range(3):
            one = make(batch[b])
            z = one.sample(KEY)
            np.testing.assert_allclose(
                jax.vmap(
                    lambda d, z=z: d.log_prob(z), in_axes=(vmap_over(reference, **{name: 0}),)
                )(batched)[b],
                one.log_prob(z),
                rtol=1e-10,
            )


def test_log_prob_of_a_value_of_the_wrong_shape_is_a_value_error():
    # It used to be JAX's broadcasting TypeError, or a silently broadcast answer.
    params, *_ = oracle.random_parameters("diag")
    dist = LinearConstrainedNormal(np.stack([params["loc"]] * 2), params["scale"])
    for shape in [(4,), (2, 4), (3, 5), (4, 3, 5)]:
        with pytest.raises(
            ValueError, match=r"expected a shape broadcasting with \(\.\.\., 2, 5\)"
        ):
            dist.log_prob(jnp.zeros(shape))
        with pytest.raises(ValueError, match="does not"):
            jax.jit(lambda d, z: d.log_prob(z))(dist, jnp.zeros(shape))
    assert dist.log_prob(jnp.zeros((7, 1, 5))).shape == (7, 2)


def test_k_is_a_real_right_hand_side_broadcast_to_the_rows_of_A():
    params, cov, A, _ = oracle.random_parameters("diag")
    loc, scale = params["loc"], params["scale"]
    explicit = LinearConstrainedNormal(loc, scale, A=A, k=np.array([0.7, 0.7]))
    for k in (0.7, np.float32(0.7), jnp.array(0.7), np.array([0.7])):
        dist = LinearConstrainedNormal(loc, scale, A=A, k=k)
        assert dist.k.shape == (2,)
        np.testing.assert_allclose(dist.mean, explicit.mean, rtol=1e-6)
    expected_mean, _ = oracle.conditional_moments(loc, cov, A, [0.7, 0.7])
    np.testing.assert_allclose(explicit.mean, expected_mean, atol=1e-12)
    with pytest.raises(ValueError, match=r"k must have shape \(\.\.\., a\) with a = 2"):
        LinearConstrainedNormal(loc, scale, A=A, k=np.zeros(3))
    with pytest.raises(
        ValueError, match=r"do not broadcast: loc \(2,\), scale \(\), A \(\), k \(3,\)"
    ):
        LinearConstrainedNormal(np.stack([loc, loc]), scale, A=A, k=np.zeros((3, 2)))


def test_repr_names_each_parameter_by_value_or_shape():
    # The Pyro package's format, with shapes as tuples.
    loc = jnp.zeros((2, 4))
    d = LinearConstrainedNormal(loc, jnp.ones(4), k=1.5)
    assert repr(d) == ("LinearConstrainedNormal(loc: (2, 4), scale: (4,), A: (1, 4), k: 1.5)")
    A = jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 0.0, 0.0]])
    d = LinearConstrainedNormal(loc[0], covariance_matrix=2 * jnp.eye(4), A=A)
    assert repr(d) == ("LinearConstrainedNormal(loc: (4,), scale_tril: (4, 4), A: (2, 4), k: (2,))")


def test_the_lazy_mean_is_no_leaf_and_never_a_leaked_tracer():
    # The conditional mean is computed on first use (log_prob does not need it) and kept
    # only when concrete: a tracer kept on a closed-over distribution would leak out of jit.
    dist, params, cov, A, k = build("diag")
    expected, _ = oracle.conditional_moments(params["loc"], cov, A, k)
    treedef = jax.tree.structure(dist)
    np.testing.assert_allclose(jax.jit(lambda: dist.mean)(), expected, atol=1e-12)
    np.testing.assert_allclose(dist.mean, expected, atol=1e-12)
    assert jax.tree.structure(dist) == treedef

    def mean_of(loc):
        traced = LinearConstrainedNormal(loc, params["scale"], A=A, k=k)
        mean = traced.mean
        assert "_mean_cache" not in traced.__dict__
        return mean

    loc = jnp.asarray(params["loc"])
    np.testing.assert_allclose(jax.jit(mean_of)(loc), expected, atol=1e-12)
    # d mu_bar / d loc = I - K A, K = Sigma A^T (A Sigma A^T)^{-1}.
    gain = cov @ A.T @ np.linalg.inv(A @ cov @ A.T)
    np.testing.assert_allclose(jax.jacobian(mean_of)(loc), np.eye(5) - gain @ A, atol=1e-12)
    # A mean kept before expand / promote_batch_shape follows the new batch shape.
    expanded = dist.expand((3,))
    assert expanded.mean.shape == (3, 5)
    np.testing.assert_allclose(expanded.mean, np.broadcast_to(expected, (3, 5)), atol=1e-12)
    stacked = jax.vmap(lambda loc: LinearConstrainedNormal(loc, params["scale"], A=A, k=k))(
        jnp.stack([loc, loc + 1.0])
    )
    stacked.__dict__["_mean_cache"] = dist.mean  # as if computed before stacking
    promoted = promote_batch_shape(stacked)
    assert promoted.mean.shape == (2, 5)
    np.testing.assert_allclose(promoted.mean[0], expected, atol=1e-12)
