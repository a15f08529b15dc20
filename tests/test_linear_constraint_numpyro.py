"""LinearConstraint (NumPyro): projection, residual, distributions sharing one factorisation of
A, per-example right-hand sides, the support tolerance, float32 accuracy, validation, and the
pytree (jit / vmap / scan without refactorising)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from jax import lax
from numpyro.distributions.transforms import biject_to

import numpyro_constrained.linear_constraint as lc_module
from numpyro_constrained import LinearConstrainedNormal, LinearConstraint
from tests.oracles import linear_constraint as oracle
from tests.oracles import linear_gaussian

N, A_ROWS, BATCH = 7, 3, 5
DTYPES = {"float32": jnp.float32, "float64": jnp.float64}
KEY = jax.random.PRNGKey(0)


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "A": rng.normal(size=(A_ROWS, N)),
        "y": 3 * rng.normal(size=(BATCH, N)),
        "k": rng.normal(size=(BATCH, A_ROWS)),
        "loc": rng.normal(size=(BATCH, N)),
        "scale": rng.uniform(0.5, 2.0, size=N),
    }


def _a(array, dtype=jnp.float64):
    return jnp.asarray(np.asarray(array), dtype=dtype)


def _np(array):
    return np.asarray(array, dtype=np.float64)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_project_matches_kkt_and_lstsq_and_residual_matches_numpy(dtype_name):
    dtype = DTYPES[dtype_name]
    p = _problem()
    A, y, k = (_np(_a(p[name], dtype)) for name in ("A", "y", "k"))
    c = LinearConstraint(_a(A, dtype))
    assert (c.n, c.a) == (N, A_ROWS) and c.A.dtype == dtype
    z = _np(c.project(_a(y, dtype), _a(k, dtype)))
    expected = oracle.kkt_project(y, A, k)
    np.testing.assert_allclose(expected, oracle.lstsq_project(y, A, k), atol=1e-12)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(z, expected, atol=50 * eps * np.abs(y).max())
    assert np.all(oracle.relative_residual(z, A, k) <= c.rtol)
    np.testing.assert_allclose(
        _np(c.residual(_a(y, dtype), _a(k, dtype))),
        y @ A.T - k,
        atol=20 * eps * (np.abs(y) @ np.abs(A).T + np.abs(k)).max(),
    )
    np.testing.assert_allclose(
        _np(c.project(_a(y, dtype))), oracle.kkt_project(y, A, np.zeros(A_ROWS)), atol=1e-4
    )
    np.testing.assert_allclose(
        _np(c.project(_a(y, dtype), _a(k[0], dtype))), oracle.kkt_project(y, A, k[0]), atol=1e-4
    )


def test_project_jacobian_is_the_orthogonal_projector():
    p = _problem()
    c = LinearConstraint(_a(p["A"]))
    jacobian = jax.jacobian(lambda y: c.project(y, _a(p["k"][0])))(_a(p["y"][0]))
    A = p["A"]
    np.testing.assert_allclose(
        _np(jacobian), np.eye(N) - A.T @ np.linalg.solve(A @ A.T, A), atol=1e-12
    )


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_constraint_and_A_give_identical_distributions(dtype_name):
    dtype = DTYPES[dtype_name]
    p = _problem()
    args = (_a(p["loc"], dtype), _a(p["scale"], dtype))
    c = LinearConstraint(_a(p["A"], dtype))
    by_constraint = c.normal(*args, k=_a(p["k"], dtype))
    by_keyword = LinearConstrainedNormal(*args, constraint=c, k=_a(p["k"], dtype))
    by_matrix = LinearConstrainedNormal(*args, A=_a(p["A"], dtype), k=_a(p["k"], dtype))
    value = by_matrix.mean
    for d in (by_constraint, by_keyword):
        for name in ("mean", "variance"):
            np.testing.assert_array_equal(getattr(d, name), getattr(by_matrix, name))
        np.testing.assert_array_equal(d.log_prob(value), by_matrix.log_prob(value))
        np.testing.assert_array_equal(d.entropy(), by_matrix.entropy())
        np.testing.assert_array_equal(d.sample(KEY, (4,)), by_matrix.sample(KEY, (4,)))
        assert d.rtol == by_matrix.rtol == lc_module.default_rtol(dtype)


def test_a_float32_constraint_with_float64_parameters_is_refactorised_in_float64():
    p = _problem()
    A32 = _a(p["A"], jnp.float32)
    d = LinearConstraint(A32).normal(_a(p["loc"]), _a(p["scale"]), k=_a(p["k"]))
    reference = LinearConstrainedNormal(
        _a(p["loc"]), _a(p["scale"]), A=A32.astype(jnp.float64), k=_a(p["k"])
    )
    assert d.mean.dtype == d.constraint.A.dtype == jnp.float64
    np.testing.assert_array_equal(d.entropy(), reference.entropy())
    np.testing.assert_array_equal(d.mean, reference.mean)


def test_per_example_k_matches_scipy_for_each_example():
    p = _problem()
    c = LinearConstraint(_a(p["A"]))
    d = c.normal(_a(p["loc"]), _a(p["scale"]), k=_a(p["k"]))
    assert d.batch_shape == (BATCH,) and d.event_shape == (N,)
    cov = np.diag(p["scale"] ** 2)
    samples = _np(d.sample(KEY, (3,)))
    log_prob = _np(d.log_prob(samples))
    for b in range(BATCH):
        args = (p["loc"][b], cov, p["A"], p["k"][b])
        mean, covariance = linear_gaussian.conditional_moments(*args)
        np.testing.assert_allclose(_np(d.mean[b]), mean, atol=1e-12)
        np.testing.assert_allclose(_np(d.variance[b]), np.diag(covariance), atol=1e-12)
        np.testing.assert_allclose(
            log_prob[:, b], oracle.logpdf_with_tolerance(samples[:, b], *args, c.rtol), rtol=1e-9
        )
        np.testing.assert_allclose(
            float(d.entropy()[b]), linear_gaussian.entropy(*args), rtol=1e-10
        )
        assert np.all(oracle.relative_residual(samples[:, b], p["A"], p["k"][b]) <= c.rtol)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_support_tolerance_accepts_data_to_its_precision_and_matches_scipy(dtype_name):
    dtype = DTYPES[dtype_name]
    p = _problem()
    A, k = p["A"], p["k"]
    cov = np.diag(p["scale"] ** 2)
    on = oracle.kkt_project(p["y"], A, k)
    # Balances closing to 1e-7 relative: within the default tolerance of both dtypes (1e-6
    # in float64, 7.6e-6 in float32).
    data = oracle.perturbed(on, 1e-7, seed=1)
    assert np.all(oracle.relative_residual(data, A, k).max(-1) > 1e-10)
    loose = LinearConstraint(_a(A, dtype), rtol=1e-6)
    assert loose.rtol == 1e-6
    strict = LinearConstraint(_a(A, dtype))
    assert strict.rtol == max(1e-6, 64 * float(jnp.finfo(dtype).eps))
    expected = np.array(
        [
            oracle.logpdf_with_tolerance(data[b], p["loc"][b], cov, A, k[b], 1e-6)[0]
            for b in range(BATCH)
        ]
    )
    tolerance = 1e-5 if dtype == jnp.float64 else 2e-3
    for c in (loose, strict):
        d = c.normal(_a(p["loc"], dtype), _a(p["scale"], dtype), k=_a(k, dtype))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no out-of-support warning
            log_prob = _np(d.log_prob(_a(data, dtype)))
        np.testing.assert_allclose(log_prob, expected, rtol=tolerance, atol=tolerance)
    # Balances closing to 1e-4 only: outside the default support; rtol, on the constraint or
    # on the distribution (overriding the constraint's), lets them in.
    coarse = oracle.perturbed(on, 1e-4, seed=1)
    assert np.all(oracle.relative_residual(coarse, A, k).max(-1) > 1e-5)
    d = LinearConstrainedNormal(
        _a(p["loc"], dtype), _a(p["scale"], dtype), constraint=strict, k=_a(k, dtype), rtol=1e-3
    )
    assert d.rtol == 1e-3
    assert np.all(np.isfinite(_np(d.log_prob(_a(coarse, dtype)))))
    # NumPyro's rule for a value outside the support: -inf and, with validation on, its
    # "Out-of-support values" warning, here naming the residual, bound and rtol.
    d = strict.normal(
        _a(p["loc"], dtype), _a(p["scale"], dtype), k=_a(k, dtype), validate_args=True
    )
    with pytest.warns(UserWarning, match="Out-of-support values") as record:
        log_prob = _np(d.log_prob(_a(coarse, dtype)))
    np.testing.assert_array_equal(log_prob, np.full(BATCH, -np.inf))
    message = str(record[0].message)
    assert f"rtol = {strict.rtol:.3g}" in message and "pass rtol=" in message
    if dtype == jnp.float64:
        worst = oracle.relative_residual(coarse, A, k).max()
        assert f"relative residual of {worst:.3g}" in message
        mixed = np.where(np.arange(BATCH)[:, None] % 2 == 0, on, coarse)
        np.testing.assert_array_equal(
            np.asarray(d.support(_a(mixed))), oracle.in_support(mixed, A, k, strict.rtol)
        )


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_scipy_singular_normal_samples_are_in_the_default_support(dtype_name):
    """SciPy's sampler of the same conditional Gaussian (an eigendecomposition of the
    singular covariance) leaves residuals of about sqrt(eps) = 1.5e-8 in float64, which the
    former default (64 eps = 1.4e-14) rejected; the default accepts them, and log_prob
    equals SciPy's log density there."""
    dtype = DTYPES[dtype_name]
    p = _problem()
    A, k, loc, scale = (_np(_a(p[name], dtype)) for name in ("A", "k", "loc", "scale"))
    cov = np.diag(scale**2)
    for b in range(2):  # two right-hand sides: each new shape compiles
        d = LinearConstrainedNormal(
            _a(loc[b], dtype),
            _a(scale, dtype),
            A=_a(A, dtype),
            k=_a(k[b], dtype),
            validate_args=True,
        )
        mean, covariance = linear_gaussian.conditional_moments(loc[b], cov, A, k[b])
        scipy_normal = scipy.stats.multivariate_normal(mean, covariance, allow_singular=True)
        z = scipy_normal.rvs(size=200, random_state=b)
        if dtype == jnp.float64:
            assert oracle.relative_residual(z, A, k[b]).max() > 1e3 * 64 * np.finfo(float).eps
        value = _a(z, dtype)
        assert bool(np.all(np.asarray(d.support(value))))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no out-of-support warning
            log_prob = _np(d.log_prob(value))
        tolerance = 1e-6 if dtype == jnp.float64 else 1e-3
        expected = scipy_normal.logpdf(_np(value))
        np.testing.assert_allclose(log_prob, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("grad_estimator", ["marginal_expectation", "pathwise"])
def test_float32_mean_samples_bijection_and_projection_satisfy_the_constraint_at_cond_1e6(
    grad_estimator,
):
    A, loc, k = oracle.ill_conditioned(N, A_ROWS, 1e6, seed=0)
    assert 0.5e6 < np.linalg.cond(A @ A.T) < 2e6
    A32, loc32, k32 = (_a(x, jnp.float32) for x in (A, loc, k))
    A, k = _np(A32), _np(k32)
    c = LinearConstraint(A32)
    d = c.normal(loc32, jnp.ones(N, jnp.float32), k=k32, grad_estimator=grad_estimator)
    transform = biject_to(d.support)
    keys = jax.random.split(KEY, 3)
    points = {
        "mean": d.mean,
        "sample": d.sample(keys[0], (50,)),
        "bijection": transform(jax.random.normal(keys[1], (50, N - A_ROWS), jnp.float32)),
        "project": c.project(10 * jax.random.normal(keys[2], (50, N), jnp.float32), k32),
    }
    for name, z in points.items():
        assert z.dtype == jnp.float32
        worst = oracle.relative_residual(_np(z), A, k).max()
        assert worst <= 1e-5, f"{name}: relative residual {worst:.3g}"
        assert bool(jnp.all(c._check(z, k32))), name
    assert bool(jnp.all(jnp.isfinite(d.log_prob(points["bijection"]))))


@pytest.fixture
def factorisations(monkeypatch):
    """The arguments of every call of the factorisation of A (traced calls included)."""
    calls = []
    factorise = lc_module._factorise
    monkeypatch.setattr(lc_module, "_factorise", lambda A: calls.append(A) or factorise(A))
    return calls


def test_jit_vmap_and_scan_with_a_constraint_argument_do_not_refactorise(factorisations):
    p = _problem()
    c = LinearConstraint(_a(p["A"]))
    assert len(factorisations) == 1
    factorisations.clear()
    loc, scale, k, y = (_a(p[name]) for name in ("loc", "scale", "k", "y"))

    def step(constraint, loc, k, y):
        d = constraint.normal(loc, scale, k=k)
        return d.log_prob(d.mean) + jnp.sum(constraint.project(y, k), -1)

    eager = step(c, loc, k, y)
    jitted = jax.jit(step)(c, loc, k, y)
    np.testing.assert_allclose(jitted, eager, rtol=1e-12)
    mapped = jax.vmap(step, in_axes=(None, 0, 0, 0))(c, loc, k, y)
    np.testing.assert_allclose(mapped, eager, rtol=1e-12)

    def body(constraint, inputs):
        return constraint, step(constraint, *inputs)

    carried, scanned = lax.scan(body, c, (loc, k, y))
    np.testing.assert_allclose(scanned, eager, rtol=1e-12)
    assert factorisations == []  # the cached factors crossed jit, vmap and scan as data
    assert isinstance(carried, LinearConstraint) and carried.rtol == c.rtol
    # A stack of constraints maps too (one A per example), still without refactorising.
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), c, c)
    projected = jax.vmap(lambda constraint, y: constraint.project(y, k[0]))(stacked, y[:2])
    np.testing.assert_allclose(
        projected, oracle.kkt_project(p["y"][:2], p["A"], p["k"][0]), atol=1e-12
    )
    assert factorisations == []
    # The distribution's own pytree carries the factors: rebuilt inside jit, its support and
    # constraint need no factorisation either.
    d = c.normal(loc, scale, k=k)
    support_check = jax.jit(lambda d: d.support(d.mean))(d)
    assert bool(jnp.all(support_check))
    assert factorisations == []


def test_bijection_reuses_the_cached_null_basis_inside_jit(factorisations):
    p = _problem()
    c = LinearConstraint(_a(p["A"]))
    d = c.normal(_a(p["loc"]), _a(p["scale"]), k=_a(p["k"]))
    u = jax.random.normal(KEY, (BATCH, N - A_ROWS))
    first, second = biject_to(d.support), biject_to(d.support)
    assert first.basis is second.basis  # the complete QR ran once for the constraint
    # Inside jit (an AutoGuide step) the basis of a concrete constraint is a constant.
    z = jax.jit(lambda u: biject_to(d.support)(u))(u)
    np.testing.assert_allclose(first.inv(z), u, atol=1e-12)
    basis = _np(first.basis)
    np.testing.assert_allclose(basis.T @ basis, np.eye(N - A_ROWS), atol=1e-12)
    np.testing.assert_allclose(p["A"] @ basis, 0, atol=1e-12)
    assert factorisations[1:] == []  # only c's own factorisation
    LinearConstrainedNormal(_a(p["loc"]), _a(p["scale"]), A=_a(p["A"]), k=_a(p["k"]))
    assert len(factorisations) == 2


def test_validation_errors():
    p = _problem()
    A = _a(p["A"])
    rank_deficient = jnp.concatenate([A[:2], A[:1] + A[1:2]])
    with pytest.raises(ValueError, match="full row rank 3; it is rank-deficient"):
        LinearConstraint(rank_deficient)
    with pytest.raises(ValueError, match="between 1 and n = 7 rows"):
        LinearConstraint(jnp.ones((8, N)))
    with pytest.raises(ValueError, match="A must have shape"):
        LinearConstraint(jnp.ones(N))
    with pytest.raises(ValueError, match="A must be finite"):
        LinearConstraint(jnp.where(A > 1, jnp.nan, A))
    for rtol in (0.0, -1e-6, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rtol must be a positive finite number"):
            LinearConstraint(A, rtol=rtol)
        with pytest.raises(ValueError, match="rtol must be a positive finite number"):
            LinearConstrainedNormal(_a(p["loc"]), _a(p["scale"]), A=A, rtol=rtol)
    c = LinearConstraint(A)
    with pytest.raises(ValueError, match="not both"):
        LinearConstrainedNormal(_a(p["loc"]), _a(p["scale"]), A=A, constraint=c)
    with pytest.raises(ValueError, match="must be a LinearConstraint"):
        LinearConstrainedNormal(_a(p["loc"]), _a(p["scale"]), constraint=A)
    with pytest.raises(ValueError, match=r"k must have shape \(\.\.\., a\) with a = 3"):
        c.normal(_a(p["loc"]), _a(p["scale"]), k=jnp.zeros((BATCH, 2)))
    with pytest.raises(ValueError, match=r"k must have shape \(\.\.\., a\) with a = 3"):
        c.project(_a(p["y"]), jnp.zeros(2))
    with pytest.raises(ValueError, match="do not broadcast"):
        c.normal(_a(p["loc"]), _a(p["scale"]), k=jnp.zeros((BATCH + 1, A_ROWS)))
    with pytest.raises(ValueError, match="the constraint has n = 7 columns, but loc has size 6"):
        c.normal(jnp.zeros(6), jnp.ones(6))
    with pytest.raises(ValueError, match=r"y must have shape \(\.\.\., 7\)"):
        c.project(jnp.zeros(6))
    with pytest.raises(ValueError, match="n - 1 = 6 rows"):
        LinearConstraint(jnp.eye(N)).normal(jnp.zeros(N), jnp.ones(N))
    square = LinearConstraint(jnp.eye(N) + 0.1)
    np.testing.assert_allclose(
        square.project(jnp.zeros(N), jnp.ones(N)),
        np.linalg.solve(np.eye(N) + 0.1, np.ones(N)),
        atol=1e-12,
    )
