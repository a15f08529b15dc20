"""LinearConstraint (Pyro): projection, residual, distributions sharing one factorisation of A,
per-example right-hand sides, the support tolerance, float32 accuracy, validation."""

import numpy as np
import pytest
import scipy.stats
import torch
from torch.distributions import biject_to

import pyro_constrained.linear_constraint as lc_module
from pyro_constrained import LinearConstrainedNormal, LinearConstraint
from tests.oracles import linear_constraint as oracle
from tests.oracles import linear_gaussian

N, A_ROWS, BATCH = 7, 3, 5
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "A": rng.normal(size=(A_ROWS, N)),
        "y": 3 * rng.normal(size=(BATCH, N)),
        "k": rng.normal(size=(BATCH, A_ROWS)),
        "loc": rng.normal(size=(BATCH, N)),
        "scale": rng.uniform(0.5, 2.0, size=N),
    }


def _t(array, dtype=torch.float64):
    return torch.tensor(np.asarray(array), dtype=dtype)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_project_matches_kkt_and_lstsq_and_residual_matches_numpy(dtype_name):
    dtype = DTYPES[dtype_name]
    p = _problem()
    A = np.asarray(_t(p["A"], dtype), dtype=np.float64)  # the matrix as the library sees it
    y, k = (np.asarray(_t(p[name], dtype), dtype=np.float64) for name in ("y", "k"))
    c = LinearConstraint(_t(A, dtype))
    assert (c.n, c.a) == (N, A_ROWS) and c.A.dtype == dtype
    z = c.project(_t(y, dtype), _t(k, dtype)).numpy().astype(np.float64)
    expected = oracle.kkt_project(y, A, k)
    np.testing.assert_allclose(expected, oracle.lstsq_project(y, A, k), atol=1e-12)
    eps = torch.finfo(dtype).eps
    # The projection moves y by O(|y|); its rounding error is a few eps of that.
    np.testing.assert_allclose(z, expected, atol=50 * eps * np.abs(y).max())
    # And the projected point satisfies the support test with the default rtol.
    assert np.all(oracle.relative_residual(z, A, k) <= c.rtol)
    np.testing.assert_allclose(
        c.residual(_t(y, dtype), _t(k, dtype)).numpy(),
        y @ A.T - k,
        atol=20 * eps * (np.abs(y) @ np.abs(A).T + np.abs(k)).max(),
    )
    # k defaults to zeros; one k broadcasts over a batch of y.
    np.testing.assert_allclose(
        c.project(_t(y, dtype)).numpy(), oracle.kkt_project(y, A, np.zeros(A_ROWS)), atol=1e-4
    )
    np.testing.assert_allclose(
        c.project(_t(y, dtype), _t(k[0], dtype)).numpy(),
        oracle.kkt_project(y, A, k[0]),
        atol=1e-4,
    )


def test_project_is_differentiable_and_its_jacobian_is_the_orthogonal_projector():
    p = _problem()
    c = LinearConstraint(_t(p["A"]))
    jacobian = torch.autograd.functional.jacobian(
        lambda y: c.project(y, _t(p["k"][0])), _t(p["y"][0])
    )
    A = p["A"]
    projector = np.eye(N) - A.T @ np.linalg.solve(A @ A.T, A)
    np.testing.assert_allclose(jacobian.numpy(), projector, atol=1e-12)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_constraint_and_A_give_identical_distributions(dtype_name):
    dtype = DTYPES[dtype_name]
    p = _problem()
    args = (_t(p["loc"], dtype), _t(p["scale"], dtype))
    c = LinearConstraint(_t(p["A"], dtype))
    by_constraint = c.normal(*args, k=_t(p["k"], dtype))
    by_keyword = LinearConstrainedNormal(*args, constraint=c, k=_t(p["k"], dtype))
    by_matrix = LinearConstrainedNormal(*args, A=_t(p["A"], dtype), k=_t(p["k"], dtype))
    value = by_matrix.mean
    for d in (by_constraint, by_keyword):
        assert torch.equal(d.mean, by_matrix.mean)
        assert torch.equal(d.variance, by_matrix.variance)
        assert torch.equal(d.log_prob(value), by_matrix.log_prob(value))
        assert torch.equal(d.entropy(), by_matrix.entropy())
        torch.manual_seed(3)
        first = d.sample((4,))
        torch.manual_seed(3)
        assert torch.equal(first, by_matrix.sample((4,)))
        assert d.constraint.rtol == by_matrix.constraint.rtol == lc_module.default_rtol(dtype)


def test_a_float32_constraint_with_float64_parameters_is_refactorised_in_float64():
    p = _problem()
    A32 = _t(p["A"], torch.float32)
    d = LinearConstraint(A32).normal(_t(p["loc"]), _t(p["scale"]), k=_t(p["k"]))
    reference = LinearConstrainedNormal(_t(p["loc"]), _t(p["scale"]), A=A32.double(), k=_t(p["k"]))
    assert d.mean.dtype == d.constraint.A.dtype == torch.float64
    assert torch.equal(d.entropy(), reference.entropy())
    assert torch.equal(d.mean, reference.mean)


def test_per_example_k_matches_scipy_for_each_example():
    p = _problem()
    c = LinearConstraint(_t(p["A"]))
    d = c.normal(_t(p["loc"]), _t(p["scale"]), k=_t(p["k"]))
    assert d.batch_shape == (BATCH,) and d.event_shape == (N,)
    cov = np.diag(p["scale"] ** 2)
    samples = d.sample((3,))
    for b in range(BATCH):
        args = (p["loc"][b], cov, p["A"], p["k"][b])
        mean, covariance = linear_gaussian.conditional_moments(*args)
        np.testing.assert_allclose(d.mean[b].numpy(), mean, atol=1e-12)
        np.testing.assert_allclose(d.variance[b].numpy(), np.diag(covariance), atol=1e-12)
        np.testing.assert_allclose(
            d.log_prob(samples)[:, b].numpy(),
            oracle.logpdf_with_tolerance(samples[:, b].numpy(), *args, c.rtol),
            rtol=1e-9,
        )
        np.testing.assert_allclose(
            d.entropy()[b].item(), linear_gaussian.entropy(*args), rtol=1e-10
        )
        assert np.all(oracle.relative_residual(samples[:, b].numpy(), p["A"], p["k"][b]) <= c.rtol)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_support_tolerance_accepts_data_to_its_precision_and_matches_scipy(dtype_name):
    dtype = DTYPES[dtype_name]
    p = _problem()
    A, k = p["A"], p["k"]
    cov = np.diag(p["scale"] ** 2)
    on = oracle.kkt_project(p["y"], A, k)
    # Measured data: balances close to 1e-7 relative (rounding to 7 significant digits),
    # within the default tolerance of both dtypes (1e-6 in float64, 7.6e-6 in float32).
    data = oracle.perturbed(on, 1e-7, seed=1)
    assert np.all(oracle.relative_residual(data, A, k).max(-1) > 1e-10)  # truly off in float64
    loose = LinearConstraint(_t(A, dtype), rtol=1e-6)
    assert loose.rtol == 1e-6
    strict = LinearConstraint(_t(A, dtype))
    assert strict.rtol == max(1e-6, 64 * torch.finfo(dtype).eps)
    # SciPy at the projected point; the library scores the point itself, which is within
    # 1e-7 relative of it (float32: its own rounding of loc, scale, A and k).
    expected = np.array(
        [
            oracle.logpdf_with_tolerance(data[b], p["loc"][b], cov, A, k[b], 1e-6)[0]
            for b in range(BATCH)
        ]
    )
    tolerance = 1e-5 if dtype == torch.float64 else 2e-3
    for c in (loose, strict):
        d = c.normal(_t(p["loc"], dtype), _t(p["scale"], dtype), k=_t(k, dtype))
        log_prob = d.log_prob(_t(data, dtype)).numpy()
        np.testing.assert_allclose(log_prob, expected, rtol=tolerance, atol=tolerance)
    # Data closing its balances to 1e-4 only is outside the default support; rtol, set on
    # the constraint or on the distribution (overriding the constraint's), lets it in.
    coarse = oracle.perturbed(on, 1e-4, seed=1)
    assert np.all(oracle.relative_residual(coarse, A, k).max(-1) > 1e-5)
    d = LinearConstrainedNormal(
        _t(p["loc"], dtype), _t(p["scale"], dtype), constraint=strict, k=_t(k, dtype), rtol=1e-3
    )
    assert d.rtol == 1e-3
    assert np.all(np.isfinite(d.log_prob(_t(coarse, dtype)).numpy()))
    # With the default the same data is outside the support: an error that names the
    # residual, the bound and the rtol in force, and how to loosen it.
    d = strict.normal(_t(p["loc"], dtype), _t(p["scale"], dtype), k=_t(k, dtype))
    with pytest.raises(ValueError, match=r"outside the support") as info:
        d.log_prob(_t(coarse, dtype))
    message = str(info.value)
    assert f"rtol = {strict.rtol:.3g}" in message and "pass rtol=" in message
    if dtype == torch.float64:
        worst = oracle.relative_residual(coarse, A, k).max()
        assert f"relative residual of {worst:.3g}" in message
    d = strict.normal(
        _t(p["loc"], dtype), _t(p["scale"], dtype), k=_t(k, dtype), validate_args=False
    )
    np.testing.assert_array_equal(d.log_prob(_t(coarse, dtype)).numpy(), np.full(BATCH, -np.inf))
    if dtype == torch.float64:
        # The support test itself agrees with the float64 reference, point by point.
        mixed = np.where(np.arange(BATCH)[:, None] % 2 == 0, on, coarse)
        np.testing.assert_array_equal(
            d.support.check(_t(mixed)).numpy(), oracle.in_support(mixed, A, k, strict.rtol)
        )


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_scipy_singular_normal_samples_are_in_the_default_support(dtype_name):
    """SciPy's sampler of the same conditional Gaussian (an eigendecomposition of the
    singular covariance) leaves residuals of about sqrt(eps) = 1.5e-8 in float64, which the
    former default (64 eps = 1.4e-14) rejected; the default accepts them, and log_prob
    equals SciPy's log density there."""
    dtype = DTYPES[dtype_name]
    p = _problem()
    A, k, loc = (np.asarray(_t(p[name], dtype), np.float64) for name in ("A", "k", "loc"))
    scale = np.asarray(_t(p["scale"], dtype), np.float64)
    cov = np.diag(scale**2)
    for b in range(BATCH):
        d = LinearConstrainedNormal(
            _t(loc[b], dtype), _t(scale, dtype), A=_t(A, dtype), k=_t(k[b], dtype)
        )
        mean, covariance = linear_gaussian.conditional_moments(loc[b], cov, A, k[b])
        scipy_normal = scipy.stats.multivariate_normal(mean, covariance, allow_singular=True)
        z = scipy_normal.rvs(size=200, random_state=b)
        if dtype == torch.float64:
            assert oracle.relative_residual(z, A, k[b]).max() > 1e3 * 64 * np.finfo(float).eps
        value = _t(z, dtype)
        assert bool(d.support.check(value).all())
        log_prob = d.log_prob(value).numpy()  # validation on: no error
        tolerance = 1e-6 if dtype == torch.float64 else 1e-3
        expected = scipy_normal.logpdf(np.asarray(value, np.float64))
        np.testing.assert_allclose(log_prob, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("grad_estimator", ["marginal_expectation", "pathwise"])
def test_float32_mean_samples_bijection_and_projection_satisfy_the_constraint_at_cond_1e6(
    grad_estimator,
):
    A, loc, k = oracle.ill_conditioned(N, A_ROWS, 1e6, seed=0)
    assert 0.5e6 < np.linalg.cond(A @ A.T) < 2e6  # Sigma = I: cond(A Sigma A^T) = 1e6
    A32, loc32, k32 = (_t(x, torch.float32) for x in (A, loc, k))
    A, k = A32.double().numpy(), k32.double().numpy()  # what the library sees, exactly
    c = LinearConstraint(A32)
    d = c.normal(loc32, torch.ones(N), k=k32, grad_estimator=grad_estimator)
    transform = biject_to(d.support)
    points = {
        "mean": d.mean,
        "sample": d.sample((50,)),
        "rsample": d.rsample((50,)),
        "bijection": transform(torch.randn(50, N - A_ROWS)),
        "project": c.project(10 * torch.randn(50, N), k32),
    }
    for name, z in points.items():
        assert z.dtype == torch.float32
        worst = oracle.relative_residual(z.detach().numpy(), A, k).max()
        assert worst <= 1e-5, f"{name}: relative residual {worst:.3g}"
        # ... and they are in the default support, so scoring them raises nothing.
        assert bool(c._check(z.detach(), k32).all()), name
    assert torch.isfinite(d.log_prob(points["bijection"])).all()


def test_bijection_reuses_the_cached_null_basis_and_normal_does_not_refactorise(monkeypatch):
    p = _problem()
    c = LinearConstraint(_t(p["A"]))
    calls = []
    factorise = lc_module._factorise
    monkeypatch.setattr(lc_module, "_factorise", lambda A: calls.append(A) or factorise(A))
    d = c.normal(_t(p["loc"]), _t(p["scale"]), k=_t(p["k"]))
    d.log_prob(d.sample((2,)))
    d.rsample()
    c.project(_t(p["y"]), _t(p["k"]))
    assert calls == []  # no factorisation of A per distribution or per call
    first, second = biject_to(d.support), biject_to(d.support)
    assert first.basis is second.basis  # the complete QR ran once
    u = torch.randn(BATCH, N - A_ROWS, dtype=torch.float64)
    z = first(u)
    np.testing.assert_allclose(first.inv(z).numpy(), u.numpy(), atol=1e-12)
    basis = first.basis.numpy()
    np.testing.assert_allclose(basis.T @ basis, np.eye(N - A_ROWS), atol=1e-12)
    np.testing.assert_allclose(p["A"] @ basis, 0, atol=1e-12)
    # An A= distribution builds one LinearConstraint (one factorisation) and no more.
    LinearConstrainedNormal(_t(p["loc"]), _t(p["scale"]), A=_t(p["A"]), k=_t(p["k"]))
    assert len(calls) == 1


def test_validation_errors():
    p = _problem()
    A = _t(p["A"])
    rank_deficient = torch.cat([A[:2], A[:1] + A[1:2]])
    with pytest.raises(ValueError, match="full row rank 3; it is rank-deficient"):
        LinearConstraint(rank_deficient)
    with pytest.raises(ValueError, match="between 1 and n = 7 rows"):
        LinearConstraint(torch.randn(8, N, dtype=torch.float64))
    with pytest.raises(ValueError, match="A must have shape"):
        LinearConstraint(torch.ones(N))
    with pytest.raises(ValueError, match="A must be finite"):
        LinearConstraint(torch.where(A > 1, torch.nan, A))
    for rtol in (0.0, -1e-6, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rtol must be a positive finite number"):
            LinearConstraint(A, rtol=rtol)
        with pytest.raises(ValueError, match="rtol must be a positive finite number"):
            LinearConstrainedNormal(_t(p["loc"]), _t(p["scale"]), A=A, rtol=rtol)
    c = LinearConstraint(A)
    with pytest.raises(ValueError, match="not both"):
        LinearConstrainedNormal(_t(p["loc"]), _t(p["scale"]), A=A, constraint=c)
    with pytest.raises(ValueError, match="must be a LinearConstraint"):
        LinearConstrainedNormal(_t(p["loc"]), _t(p["scale"]), constraint=A)
    with pytest.raises(ValueError, match=r"k must have shape \(\.\.\., a\) with a = 3"):
        c.normal(_t(p["loc"]), _t(p["scale"]), k=torch.zeros(BATCH, 2))
    with pytest.raises(ValueError, match=r"k must have shape \(\.\.\., a\) with a = 3"):
        c.project(_t(p["y"]), torch.zeros(2))
    with pytest.raises(ValueError, match="do not broadcast"):
        c.normal(_t(p["loc"]), _t(p["scale"]), k=torch.zeros(BATCH + 1, A_ROWS))
    with pytest.raises(ValueError, match="the constraint has n = 7 columns, but loc has size 6"):
        c.normal(torch.zeros(6), torch.ones(6))
    with pytest.raises(ValueError, match=r"y must have shape \(\.\.\., 7\)"):
        c.project(torch.zeros(6))
    with pytest.raises(ValueError, match="n - 1 = 6 rows"):
        LinearConstraint(torch.eye(N, dtype=torch.float64)).normal(torch.zeros(N), torch.ones(N))
    # A square, invertible A is a valid constraint (one point), only not a distribution.
    square = LinearConstraint(torch.eye(N, dtype=torch.float64) + 0.1)
    np.testing.assert_allclose(
        square.project(torch.zeros(N, dtype=torch.float64), torch.ones(N, dtype=torch.float64)),
        np.linalg.solve(np.eye(N) + 0.1, np.ones(N)),
        atol=1e-12,
    )
