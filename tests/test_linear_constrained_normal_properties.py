"""Property-based tests of LinearConstrainedNormal under adversarial numerics (issue 14).

Hypothesis draws the size n (2..8), the number of constraints a (1..n-1), a constraint
matrix that may be ill-conditioned (singular values spread over up to 4 decades, or rows
nearly parallel), diagonal scales log-uniform over up to 12 decades (1e-6..1e6, with the
extremes pinned in some examples), and loc and k from 1e-3 to 1e3 in magnitude. Both
packages are checked in float32 and float64 against references computed here by another
route (the torch package on every drawn shape; the JAX package, whose every new shape costs
seconds of XLA compilation, on a fixed set of shapes in the agreement test, which checks it
against the references and against torch): exact rational arithmetic (``fractions``) for
the constraint residual, and for the conditional moments, entropy and density a 40-digit
``mpmath`` computation in an orthonormal basis N of null(A), which never forms
``A Sigma A^T``: ``z = z0 + N u`` with ``u ~ N(P^{-1} N^T Sigma^{-1} (loc - z0), P^{-1})``,
``P = N^T Sigma^{-1} N``.

The float32 parameters are the float32 roundings of the drawn values, and the references are
computed from those rounded values, so that every test compares the same problem.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction
from types import SimpleNamespace

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import assume, example, given, settings

import numpyro_constrained
import pyro_constrained
from constrained_ppl.conditioning import PrecisionWarning, whitened_condition

DTYPES = {"float32": (torch.float32, jnp.float32), "float64": (torch.float64, jnp.float64)}
NUM_SAMPLES = 8
# The best any floating-point z can do is the rounding of an exact solution: 1/2 ulp of each
# z_i, which moves A_j z by at most 1/2 ulp of |A_j| |z|. The refinement step leaves a
# remainder of the same order; 4 ulps is "a few" with room for both. The code this replaced
# (explicit A Sigma A^T) missed by up to 10^7 ulps on the same strategies.
RESIDUAL_ULPS = 4.0


def _eps(dtype_name: str) -> float:
    return float(np.finfo(dtype_name).eps)


# (n, a) of the JAX checks: the extremes of a, small and large n.
JAX_SHAPES = ((2, 1), (5, 2), (8, 1), (8, 7))


@st.composite
def problems(draw, max_scale_decades: float = 12.0, max_log10_loc: float = 3.0, shapes=None):
    """(loc, scale, A, k) as float64 NumPy arrays, and the condition number of A with its
    rows scaled to unit length (the drawn rows are then rescaled)."""
    if shapes is None:
        n = draw(st.integers(2, 8), label="n")
        a = draw(st.integers(1, n - 1), label="a")
    else:
        n, a = draw(st.sampled_from(shapes), label="(n, a)")
    shape = draw(st.sampled_from(["gaussian", "spread_singular_values", "nearly_parallel"]))
    log10_condition = draw(st.floats(0.0, 4.0), label="log10_condition")
    scale_decades = draw(st.floats(0.0, max_scale_decades), label="scale_decades")
    pin_extremes = draw(st.booleans(), label="pin_extremes")
    log10_loc = draw(st.floats(-max_log10_loc, max_log10_loc), label="log10_loc")
    log10_k = draw(st.floats(-3.0, 3.0), label="log10_k")
    # Row norms of A spread over up to 12 decades: an equation multiplied by a constant is
    # the same constraint, so nothing may depend on it (issue 29).
    row_decades = draw(st.floats(0.0, 12.0), label="row_decades")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))

    if shape == "gaussian":
        A = rng.normal(size=(a, n))
    elif shape == "spread_singular_values":
        left = np.linalg.qr(rng.normal(size=(a, a)))[0]
        right = np.linalg.qr(rng.normal(size=(n, a)))[0]
        A = left @ np.diag(np.logspace(0.0, -log10_condition, a)) @ right.T
    else:
        row = rng.normal(size=n)
        A = row + 10.0**-log10_condition * rng.normal(size=(a, n))
    condition = np.linalg.cond(A)
    # The rank check rejects cond(A) >~ 1 / (n eps) in float32; that is a different test.
    assume(condition < 1e5)
    A = A * 10.0 ** rng.uniform(-row_decades / 2, row_decades / 2, size=(a, 1))

    half = scale_decades / 2
    scale = 10.0 ** rng.uniform(-half, half, size=n)
    if pin_extremes and n >= 2:
        low, high = rng.permutation(n)[:2]
        scale[low], scale[high] = 10.0**-half, 10.0**half
    loc = rng.normal(size=n) * 10.0**log10_loc
    k = rng.normal(size=a) * 10.0**log10_k
    return (loc, scale, A, k), condition


def _rounded(arrays, dtype_name: str):
    """The drawn arrays rounded to the dtype, back in float64 (exactly representable)."""
    return tuple(np.asarray(x, dtype=dtype_name).astype(np.float64) for x in arrays)


def _torch(arrays, dtype_name: str) -> pyro_constrained.LinearConstrainedNormal:
    loc, scale, A, k = (torch.tensor(x, dtype=DTYPES[dtype_name][0]) for x in arrays)
    return pyro_constrained.LinearConstrainedNormal(loc, scale, A=A, k=k)


def _jax(arrays, dtype_name: str) -> numpyro_constrained.LinearConstrainedNormal:
    loc, scale, A, k = (jnp.asarray(x, dtype=DTYPES[dtype_name][1]) for x in arrays)
    return numpyro_constrained.LinearConstrainedNormal(loc, scale, A=A, k=k)


def _exact_relative_residual(z, A, k) -> float:
    """max_j |A_j z - k_j| / (|A_j| |z| + |k_j|), in exact rational arithmetic."""
    z = np.atleast_2d(np.asarray(z, dtype=np.float64))
    A_exact = [[Fraction(float(x)) for x in row] for row in A]
    k_exact = [Fraction(float(x)) for x in k]
    worst = 0.0
    for event in z:
        z_exact = [Fraction(float(x)) for x in event]
        for row, k_j in zip(A_exact, k_exact, strict=True):
            residual = sum(a_ji * z_i for a_ji, z_i in zip(row, z_exact, strict=True)) - k_j
            bound = sum(abs(a_ji * z_i) for a_ji, z_i in zip(row, z_exact, strict=True))
            bound += abs(k_j)
            if bound:
                worst = max(worst, float(abs(residual) / bound))
    return worst


class NullSpaceReference:
    """The conditional distribution in 40-digit arithmetic, in an orthonormal basis of
    null(A) (no ``A Sigma A^T``, no Matheron's rule): see the module docstring."""

    def __init__(self, loc, scale, A, k):
        with mpmath.workdps(40):
            n, a = len(loc), len(k)
            A_mp = mpmath.matrix(A.tolist())
            q, _ = mpmath.qr(A_mp.T, mode="full")
            basis = q[:, a:]
            z0 = A_mp.T * mpmath.lu_solve(A_mp * A_mp.T, mpmath.matrix(k.tolist()))
            precision = mpmath.diag([1 / mpmath.mpf(s) ** 2 for s in scale.tolist()])
            reduced = basis.T * precision * basis  # P = N^T Sigma^{-1} N
            reduced_inverse = mpmath.inverse(reduced)
            coordinates = reduced_inverse * (basis.T * (precision * (mpmath.matrix(loc) - z0)))
            mean = z0 + basis * coordinates
            covariance = basis * reduced_inverse * basis.T
            dim = n - a
            self.log_det_reduced = mpmath.log(mpmath.det(reduced))
            self.entropy = float(
                dim / 2 * (1 + mpmath.log(2 * mpmath.pi)) - self.log_det_reduced / 2
            )
            self.mean = np.array([float(x) for x in mean])
            self.covariance = np.array(
                [[float(covariance[i, j]) for j in range(n)] for i in range(n)]
            )
            self._basis, self._reduced, self._mean_mp, self._dim = basis, reduced, mean, dim
            self._A, self._k = A_mp, mpmath.matrix(k.tolist())
            self._covariance_rows = A_mp * mpmath.diag([mpmath.mpf(s) ** 2 for s in scale.tolist()])

    def logpdf(self, z) -> float:
        """The density at the Sigma^{-1}-orthogonal projection of ``z`` onto the subspace.

        A value in the working dtype is off the subspace by its rounding, and log_prob extends
        the density off the subspace by the Gaussian formula -1/2 ||L^{-1}(z - mu_bar)||^2 + c,
        which agrees with the density at this projection up to 1/2 ||L^{-1}(z - projection)||^2
        (the cross term vanishes in this metric; after a Euclidean projection it would not,
        and the rounding of a large-variance coordinate would move a small-variance one).
        """
        with mpmath.workdps(80):  # A Sigma A^T may have a condition number of 1e32
            z = mpmath.matrix(np.asarray(z, np.float64).tolist())
            rows = self._covariance_rows
            z = z + rows.T * mpmath.lu_solve(rows * self._A.T, self._k - self._A * z)
            u = self._basis.T * (z - self._mean_mp)
            quadratic = (u.T * self._reduced * u)[0]
            return float(
                -quadratic / 2
                + self.log_det_reduced / 2
                - self._dim / 2 * mpmath.log(2 * mpmath.pi)
            )


@pytest.mark.parametrize("dtype_name", DTYPES)
@given(drawn=problems(), seed=st.integers(0, 2**16))
def test_mean_and_samples_satisfy_the_constraint_to_a_few_ulps(drawn, seed, dtype_name):
    arrays, _ = drawn
    loc, scale, A, k = arrays = _rounded(arrays, dtype_name)
    dist = _torch(arrays, dtype_name)
    torch.manual_seed(seed)
    _assert_on_subspace_to_a_few_ulps(dist.mean.numpy(), A, k, dtype_name, "mean")
    _assert_on_subspace_to_a_few_ulps(
        dist.sample((NUM_SAMPLES,)).numpy(), A, k, dtype_name, "samples"
    )


def _assert_on_subspace_to_a_few_ulps(z, A, k, dtype_name: str, name: str) -> None:
    assert np.all(np.isfinite(z)), name
    residual = _exact_relative_residual(z, A, k)
    tolerance = RESIDUAL_ULPS * _eps(dtype_name)
    assert residual <= tolerance, f"{name}: relative residual {residual:.3g} > {tolerance:.3g}"


def _moment_tolerance(dtype_name: str, condition: float) -> float:
    # The conditional mean and covariance are the solution of a weighted minimum-norm
    # problem; a backward-stable solver leaves a forward error of order cond * eps, where
    # cond is that of A (not of A Sigma A^T: the row-sorted QR is stable for any diagonal
    # scaling, so the 12 decades of scales do not enter). 64 absorbs the dimension factors
    # of the bound (n <= 8) and those of the reference's own inputs, which are rounded to
    # the dtype. Measured: at most about 40 eps cond on these strategies.
    return 64 * _eps(dtype_name) * condition


@pytest.mark.parametrize("dtype_name", DTYPES)
@given(drawn=problems())
def test_mean_and_covariance_match_the_null_space_reference(drawn, dtype_name):
    arrays, condition = drawn
    loc, scale, A, k = arrays = _rounded(arrays, dtype_name)
    reference = NullSpaceReference(loc, scale, A, k)
    _assert_moments_match(_torch(arrays, dtype_name), reference, arrays, condition, dtype_name)


def _assert_moments_match(dist, reference, arrays, condition: float, dtype_name: str) -> None:
    loc, scale, A, k = arrays
    tolerance = _moment_tolerance(dtype_name, condition)
    # Per coordinate, the natural size of the mean's error: the rounding of loc and of the
    # result, and the size of the correction in coordinate i (s_i times the length of the
    # whitened correction).
    whitened_correction = np.linalg.norm((reference.mean - loc) / scale)
    mean_size = np.abs(reference.mean) + np.abs(loc) + scale * (1 + whitened_correction)
    # Sigma_bar = L (I - Q Q^T) L^T: entry (i, j) is s_i s_j times an entry of a projector.
    covariance_size = np.outer(scale, scale)
    mean = np.asarray(dist.mean, dtype=np.float64)
    variance = np.asarray(dist.variance, dtype=np.float64)
    covariance = np.asarray(dist.covariance_matrix, dtype=np.float64)
    mean_error = np.max(np.abs(mean - reference.mean) / mean_size)
    assert mean_error <= tolerance, f"mean: {mean_error:.3g} > {tolerance:.3g}"
    variance_error = np.max(np.abs(variance - np.diag(reference.covariance)) / scale**2)
    assert variance_error <= tolerance, f"variance: {variance_error:.3g} > {tolerance:.3g}"
    # And relative to each variance itself (issue 29: diag Sigma - ||(L Q)_i||^2 was off by
    # 11% in float32 for a coordinate that the constraint nearly fixes).
    expected = np.diag(reference.covariance)
    relative, floor = _variance_tolerance(reference, arrays, condition, dtype_name)
    excess = np.abs(variance - expected) - (relative * expected + floor)
    assert np.all(excess <= 0), (variance, expected, relative, floor)
    covariance_error = np.max(np.abs(covariance - reference.covariance) / covariance_size)
    assert covariance_error <= tolerance, f"covariance: {covariance_error:.3g} > {tolerance:.3g}"


def _variance_tolerance(reference, arrays, condition: float, dtype_name: str):
    """(relative, floor): the tolerance ``relative_i * v_i + floor_i`` of each conditional
    variance ``v_i = s_i^2 p_i``, ``p_i = (I - Q Q^T)_ii``.

    ``relative_i`` is 32 eps times the condition number of A (the backward error of the
    factorisations) plus the componentwise condition number of ``p_i`` itself, from
    ``d p_i = -2 (P dM M^+)_ii`` with ``M = diag(s) A^T``: relative perturbations of eps in
    the entries of M move ``p_i`` by up to ``2 eps sum_jk |P_ij| |M_jk| |M^+_ki|``, which is
    large where a coordinate is nearly fixed by a combination of large-scale ones; no
    algorithm working in the dtype does better than that. ``floor_i = (32 eps cond s_i)^2``
    covers a coordinate that the constraint fixes (v_i = 0) by a combination of rows.
    """
    loc, scale, A, k = arrays
    eps = _eps(dtype_name)
    projector = reference.covariance / np.outer(scale, scale)
    componentwise = _componentwise_condition(projector, scale, A)
    relative = 32 * eps * (condition + componentwise)
    floor = (32 * eps * condition * scale) ** 2
    return relative, floor


def _componentwise_condition(projector, scale, A):
    """The componentwise condition number ``kappa_i`` of each ``p_i = (I - Q Q^T)_ii``
    (see :func:`_variance_tolerance`), 0 where ``p_i`` is 0."""
    whitened = scale[:, None] * A.T
    weights = np.abs(whitened) @ np.abs(np.linalg.pinv(whitened))
    spread = np.sum(np.abs(projector) * weights.T, -1)
    diagonal = np.diag(projector)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(diagonal > 0, 2 + 2 * spread / diagonal, 0.0)


@pytest.mark.parametrize("dtype_name", DTYPES)
@given(drawn=problems(max_scale_decades=4.0, max_log10_loc=1.0), seed=st.integers(0, 2**16))
def test_log_prob_matches_scipy_and_the_null_space_density(drawn, seed, dtype_name):
    # SciPy's singular normal drops eigenvalues below 1e6 eps of the largest, so its density
    # is only right while Sigma_bar's spectrum spans less than ~9 decades: scales over 4
    # decades (8 in variance) here. The 40-digit null-space density has no such limit; the
    # agreement test uses it on the 12-decade problems.
    arrays, condition = drawn
    loc, scale, A, k = arrays = _rounded(arrays, dtype_name)
    reference = NullSpaceReference(loc, scale, A, k)
    dist = _torch(arrays, dtype_name)
    torch.manual_seed(seed)
    samples = dist.sample((NUM_SAMPLES,))
    log_prob = dist.log_prob(samples).numpy().astype(np.float64)
    expected = np.array([reference.logpdf(z) for z in samples.numpy()])
    tolerance = _log_prob_tolerance(expected, samples.numpy(), reference, arrays, condition)
    assert np.all(np.abs(log_prob - expected) <= tolerance), (log_prob - expected, tolerance)
    # SciPy inverts Sigma_bar on its support in float64 (and decides what the support is
    # from its float64 eigenvalues): its own error is eps_64 times the spread of that
    # spectrum, and its support test fails where A's conditioning makes the float64 subspace
    # uncertain; compared where that error is below 1e-6.
    spectrum = np.linalg.eigvalsh(reference.covariance)[len(k) :]
    scipy_error = 16 * np.finfo(np.float64).eps * condition**2 * spectrum[-1] / spectrum[0]
    if scipy_error < 1e-6:
        whitened = np.linalg.norm((samples.numpy() - reference.mean) / scale, axis=-1)
        scipy_tolerance = tolerance + scipy_error * (len(loc) + np.abs(expected) + whitened**2)
        scipy_log_prob = scipy.stats.multivariate_normal(
            reference.mean, reference.covariance, allow_singular=True
        ).logpdf(_project(samples.numpy(), scale, A, k))
        # SciPy also decides, from its float64 eigenvalues, whether a point is on the
        # support: with an ill-conditioned A (cond ~ 1e3) it can put a projected point
        # outside (-inf) that the 40-digit reference above accepted. Compare where it did not.
        on_support = np.isfinite(scipy_log_prob)
        if condition < 100:
            assert np.all(on_support)
        difference = np.abs(log_prob - scipy_log_prob)[on_support]
        assert np.all(difference <= scipy_tolerance[on_support])


def _project(z, scale, A, k):
    """The Sigma^{-1}-orthogonal projection of float64 copies of ``z`` onto ``A z = k``, for
    SciPy, which wants points on the support (see :meth:`NullSpaceReference.logpdf`)."""
    z = np.asarray(z, dtype=np.float64)
    covariance_rows = A * scale**2  # A Sigma
    correction = np.linalg.solve(covariance_rows @ A.T, (k - z @ A.T).T).T
    return z + correction @ covariance_rows


def _log_prob_tolerance(expected, samples, reference, arrays, condition: float):
    """log_prob = -1/2 ||w||^2 + c with w = L^{-1}(z - mu_bar). An error d in mu_bar (in
    whitened units: the moments test's tolerance, plus eps |mu_bar_i| / s_i for its
    representation in the dtype) moves it by at most ||w|| d + d^2 / 2; c carries the
    conditioning error of the moments test relative to the terms it sums."""
    loc, scale, A, k = arrays
    dtype_name = str(np.asarray(samples).dtype)
    moment_tolerance = _moment_tolerance(dtype_name, condition)
    whitened_correction = np.linalg.norm((reference.mean - loc) / scale)
    mean_size = np.abs(reference.mean) + np.abs(loc) + scale * (1 + whitened_correction)
    mean_error = moment_tolerance * np.linalg.norm(mean_size / scale) + _eps(
        dtype_name
    ) * np.linalg.norm(reference.mean / scale)
    whitened = np.linalg.norm((samples - reference.mean) / scale, axis=-1)
    return mean_error * (whitened + mean_error / 2) + moment_tolerance * (
        len(loc) + np.abs(expected)
    )


@pytest.mark.parametrize("dtype_name", DTYPES)
@given(drawn=problems())
def test_entropy_matches_the_null_space_formula(drawn, dtype_name):
    arrays, condition = drawn
    loc, scale, A, k = arrays = _rounded(arrays, dtype_name)
    reference = NullSpaceReference(loc, scale, A, k)
    _assert_entropy_matches(_torch(arrays, dtype_name), reference, arrays, condition, dtype_name)


def _assert_entropy_matches(dist, reference, arrays, condition: float, dtype_name: str) -> None:
    # H = sum log s_i + log det terms: each of the n + 2a logarithms is accurate to its
    # argument's relative error (eps for log s_i, the conditioning error for the
    # determinants), which is an absolute error in H.
    tolerance = _moment_tolerance(dtype_name, condition) * (len(arrays[0]) + abs(reference.entropy))
    error = abs(float(dist.entropy()) - reference.entropy)
    assert error <= tolerance, f"entropy: {error:.3g} > {tolerance:.3g}"


@jax.jit
def _jax_quantities(loc, scale, A, k, noise) -> dict[str, jax.Array]:
    # Everything in one compiled program: a new shape costs one XLA compilation instead of
    # one per kernel and eager operation. (Under jit the parameters are not validated; the
    # numerics are the same kernels.)
    dist = numpyro_constrained.LinearConstrainedNormal(loc, scale, A=A, k=k)
    samples = dist._matheron_from_noise(noise)
    return {
        "mean": dist.mean,
        "variance": dist.variance,
        "covariance_matrix": dist.covariance_matrix,
        "entropy": dist.entropy(),
        "samples": samples,
        "log_prob": dist.log_prob(samples),
    }


@pytest.mark.parametrize("dtype_name", DTYPES)
@given(drawn=problems(shapes=JAX_SHAPES), seed=st.integers(0, 2**16))
def test_jax_matches_the_references_and_agrees_with_torch(drawn, seed, dtype_name):
    arrays, condition = drawn
    loc, scale, A, k = arrays = _rounded(arrays, dtype_name)
    reference = NullSpaceReference(loc, scale, A, k)
    noise = np.random.default_rng(seed).normal(size=(NUM_SAMPLES, len(loc)))
    torch_dtype, jax_dtype = DTYPES[dtype_name]
    jax_values = _jax_quantities(*(jnp.asarray(x, dtype=jax_dtype) for x in (*arrays, noise)))
    jax_values = {name: np.asarray(value) for name, value in jax_values.items()}
    jax_dist = SimpleNamespace(
        mean=jax_values["mean"],
        variance=jax_values["variance"],
        covariance_matrix=jax_values["covariance_matrix"],
        entropy=lambda: jax_values["entropy"],
    )
    jax_z = jax_values["samples"]

    _assert_on_subspace_to_a_few_ulps(jax_values["mean"], A, k, dtype_name, "mean")
    _assert_on_subspace_to_a_few_ulps(jax_z, A, k, dtype_name, "samples")
    _assert_moments_match(jax_dist, reference, arrays, condition, dtype_name)
    _assert_entropy_matches(jax_dist, reference, arrays, condition, dtype_name)
    expected = np.array([reference.logpdf(z) for z in jax_z])
    tolerance = _log_prob_tolerance(expected, jax_z, reference, arrays, condition)
    assert np.all(np.abs(jax_values["log_prob"] - expected) <= tolerance)

    # Identical noise and values: the same algorithm with LAPACK and XLA kernels. Each is
    # within the references' tolerance of the exact answer, so within twice of each other.
    torch_dist = _torch(arrays, dtype_name)
    torch_z = torch_dist._matheron_from_noise(torch.tensor(noise, dtype=torch_dtype)).numpy()
    moment_tolerance = _moment_tolerance(dtype_name, condition)
    size = np.abs(jax_z) + np.abs(loc) + scale * (1 + np.linalg.norm(noise, axis=-1))[:, None]
    assert np.max(np.abs(torch_z - jax_z) / size) <= 2 * moment_tolerance
    torch_log_prob = torch_dist.log_prob(torch.tensor(jax_z)).numpy()
    assert np.all(np.abs(torch_log_prob - jax_values["log_prob"]) <= 2 * tolerance)


# --- bad input and mixed dtypes (plain tests) ---------------------------------------------

FRAMEWORKS = {
    "torch": (pyro_constrained.LinearConstrainedNormal, lambda x: torch.tensor(x)),
    "jax": (numpyro_constrained.LinearConstrainedNormal, lambda x: jnp.asarray(x)),
}
VALID = {"loc": [0.0, 1.0, 2.0], "scale": [1.0, 2.0, 0.5], "A": [[1.0, 1.0, 0.0]], "k": [1.0]}
FULL = [[1.0, 0.2, 0.0], [0.2, 1.0, 0.1], [0.0, 0.1, 1.0]]
TRIL = np.linalg.cholesky(FULL).tolist()


def _with(name: str, value) -> dict:
    """``VALID`` with one argument replaced (a covariance argument replaces ``scale``)."""
    kwargs = dict(VALID)
    if name in ("covariance_matrix", "scale_tril"):
        del kwargs["scale"]
    kwargs[name] = value
    return kwargs


def _poison(matrix, value) -> list:
    """``matrix`` with one off-diagonal pair (or one entry) replaced by ``value``."""
    poisoned = np.array(matrix, dtype=np.float64)
    if poisoned.ndim == 2 and poisoned.shape[0] == poisoned.shape[1]:
        poisoned[1, 0] = value
        if not np.allclose(np.tril(matrix), matrix):  # symmetric: keep it symmetric
            poisoned[0, 1] = value
    else:
        poisoned.flat[1 if poisoned.size > 1 else 0] = value
    return poisoned.tolist()


NON_FINITE = [
    (name, _with(name, _poison(base, value)))
    for name, base in (
        ("loc", VALID["loc"]),
        ("scale", VALID["scale"]),
        ("covariance_matrix", FULL),
        ("scale_tril", TRIL),
        ("A", VALID["A"]),
        ("k", VALID["k"]),
    )
    for value in (math.inf, -math.inf, math.nan)
]
INVALID = [
    ("scale", _with("scale", [1.0, 0.0, 1.0])),
    ("scale", _with("scale", [1.0, -2.0, 1.0])),
    ("covariance_matrix", _with("covariance_matrix", [[1.0, 2.0, 0], [2.0, 1.0, 0], [0, 0, 1.0]])),
    ("covariance_matrix", _with("covariance_matrix", [[1.0, 1.0, 0], [1.0, 1.0, 0], [0, 0, 1.0]])),
    ("scale_tril", _with("scale_tril", [[1.0, 0, 0], [0.5, -1.0, 0], [0, 0, 1.0]])),
    ("scale_tril", _with("scale_tril", [[1.0, 1.0, 0], [0, 1.0, 0], [0, 0, 1.0]])),
    ("rank", {**VALID, "A": [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]], "k": [0.0, 0.0]}),
    ("rows", _with("A", np.eye(3).tolist())),
    ("columns", _with("A", [[1.0, 1.0, 1.0, 1.0]])),
    ("A must have shape", _with("A", [1.0, 1.0, 1.0])),
    ("k must have shape", _with("k", [0.0, 1.0])),
    ("scale", _with("scale", [1.0, 1.0])),
    ("covariance_matrix", _with("covariance_matrix", np.eye(4).tolist())),
    ("broadcast", {**VALID, "loc": np.zeros((2, 3)).tolist(), "k": np.zeros((3, 1)).tolist()}),
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize(("name", "kwargs"), NON_FINITE + INVALID)
def test_bad_input_raises_a_value_error_naming_the_argument(framework, name, kwargs):
    cls, array = FRAMEWORKS[framework]
    arguments = {key: array(np.asarray(value, dtype=np.float64)) for key, value in kwargs.items()}
    with pytest.raises(ValueError, match=name):
        cls(**arguments)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("covariance", ["scale", "covariance_matrix", "scale_tril"])
def test_validation_off_works_on_valid_input(framework, covariance):
    cls, array = FRAMEWORKS[framework]
    kwargs = {"scale": VALID, "covariance_matrix": _with("covariance_matrix", FULL)}.get(
        covariance, _with("scale_tril", TRIL)
    )
    arguments = {key: array(np.asarray(value)) for key, value in kwargs.items()}
    dist = cls(**arguments, validate_args=False)
    z = dist.sample((3,)) if framework == "torch" else dist.sample(jax.random.PRNGKey(0), (3,))
    for value in (dist.log_prob(z), dist.mean, dist.variance, dist.entropy()):
        assert np.all(np.isfinite(np.asarray(value)))


def _dtype_name(value) -> str:
    return str(value.dtype).removeprefix("torch.")


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("covariance", ["scale", "scale_tril"])
@pytest.mark.parametrize("validate_args", [True, False])
def test_mixed_float_dtypes_are_promoted(framework, covariance, validate_args):
    cls, _ = FRAMEWORKS[framework]

    def array(value, dtype_name):
        value = np.asarray(value, dtype=dtype_name)
        return torch.tensor(value) if framework == "torch" else jnp.asarray(value)

    factor = {covariance: array(VALID["scale"] if covariance == "scale" else TRIL, "float32")}
    loc32, A32, k32 = (array(VALID[name], "float32") for name in ("loc", "A", "k"))
    # Parameters: float32 with one float64 argument promote to float64, as the frameworks'
    # own arithmetic would; a Python number takes no part.
    for mixed in (
        {"loc": array(VALID["loc"], "float64")},
        {"A": array(VALID["A"], "float64")},
        {"k": array(VALID["k"], "float64")},
    ):
        kwargs = {"loc": loc32, **factor, "A": A32, "k": k32, **mixed}
        dist = cls(**kwargs, validate_args=validate_args)
        assert _dtype_name(dist.mean) == "float64"
    dist = cls(loc32, **factor, A=A32, k=1.0, validate_args=validate_args)
    assert _dtype_name(dist.mean) == "float32"
    # A float64 value of a float32 distribution: the result is float64 and equals the
    # float32 computation to float32 precision.
    value64 = np.asarray(dist.mean, dtype=np.float64) + np.array([1.0, -1.0, 0.0]) * 0.25
    value32 = value64.astype(np.float32)
    if framework == "torch":
        log_prob64, log_prob32 = (
            dist.log_prob(torch.tensor(value64)),
            dist.log_prob(torch.tensor(value32)),
        )
    else:
        log_prob64, log_prob32 = (
            dist.log_prob(jnp.asarray(value64)),
            dist.log_prob(jnp.asarray(value32)),
        )
    assert _dtype_name(log_prob64) == "float64" and _dtype_name(log_prob32) == "float32"
    np.testing.assert_allclose(np.asarray(log_prob64), np.asarray(log_prob32), rtol=1e-5)


# --- second moments, rank and conditioning (issue 29; plain tests) -----------------------

TRIDIAGONAL = np.array([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
TRIDIAGONAL_SCALE = np.array([0.1, 1.0, 10.0, 100.0])


def _mpmath_covariance(A, scale) -> np.ndarray:
    """Sigma - Sigma A^T (A Sigma A^T)^{-1} A Sigma in 60 digits."""
    with mpmath.workdps(60):
        A_mp = mpmath.matrix(A.tolist())
        sigma = mpmath.diag([mpmath.mpf(s) ** 2 for s in scale.tolist()])
        gain = sigma * A_mp.T * mpmath.inverse(A_mp * sigma * A_mp.T)
        bar = sigma - gain * A_mp * sigma
        return np.array([[float(bar[i, j]) for j in range(len(scale))] for i in range(len(scale))])


def _second_moments(framework: str, dtype_name: str, A, scale, x64: bool = True):
    """(variance, covariance_matrix) as float64 NumPy arrays; NumPyro with x64 off when not
    ``x64`` (the configuration NumPyro users run)."""
    if framework == "torch":
        dtype = DTYPES[dtype_name][0]
        dist = pyro_constrained.LinearConstrainedNormal(
            torch.zeros(len(scale), dtype=dtype),
            torch.tensor(scale, dtype=dtype),
            A=torch.tensor(A, dtype=dtype),
        )
        return dist.variance.double().numpy(), dist.covariance_matrix.double().numpy()
    with jax.enable_x64(x64):
        dtype = DTYPES[dtype_name][1]
        dist = numpyro_constrained.LinearConstrainedNormal(
            jnp.zeros(len(scale), dtype=dtype),
            jnp.asarray(scale, dtype=dtype),
            A=jnp.asarray(A, dtype=dtype),
        )
        assert dist.variance.dtype == dtype
        return (
            np.asarray(dist.variance, np.float64),
            np.asarray(dist.covariance_matrix, np.float64),
        )


CONFIGURATIONS = [
    ("torch", "float32", True),
    ("torch", "float64", True),
    ("jax", "float32", True),
    ("jax", "float64", True),
    ("jax", "float32", False),
]


@pytest.mark.parametrize(("framework", "dtype_name", "x64"), CONFIGURATIONS)
def test_a_nearly_fixed_coordinate_has_its_variance_to_a_few_ulps(framework, dtype_name, x64):
    # cond(A L) = 100: Sigma_ii - ||(L Q)_i||^2 gave 0.00879 for 0.00990 in float32 (11%)
    # and was 5e-10 off in float64, the cancellation of a prior variance 1e4 against the
    # removed part; the subspace formulation has no difference.
    expected = _mpmath_covariance(TRIDIAGONAL, TRIDIAGONAL_SCALE)
    variance, covariance = _second_moments(
        framework, dtype_name, TRIDIAGONAL, TRIDIAGONAL_SCALE, x64
    )
    eps = _eps(dtype_name)
    # Measured: at most 27 eps (float32, the coordinate of scale 100); the conditioning is
    # 100 (cond(A L)), so a few ulps times it.
    np.testing.assert_allclose(variance, np.diag(expected), rtol=64 * eps, atol=0)
    size = np.sqrt(np.outer(np.diag(expected), TRIDIAGONAL_SCALE**2))
    assert np.all(np.abs(covariance - expected) <= 64 * eps * (size + size.T))


@pytest.mark.parametrize(("framework", "dtype_name", "x64"), CONFIGURATIONS)
@pytest.mark.parametrize(
    "A",
    [
        [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]],  # z_0 = k_0: its own row
        [[1.0, 1.0, 0.0, 0.0], [1.0, -1.0, 0.0, 0.0]],  # z_0, z_1 fixed by a combination
    ],
)
def test_a_fixed_coordinate_has_exactly_zero_variance(framework, dtype_name, x64, A):
    # Before: standard deviation 2e-8 (sqrt(eps)) in float64, from 1 - ||Q_i||^2.
    A = np.array(A)
    scale = np.array([3.0, 0.5, 2.0, 7.0])
    variance, covariance = _second_moments(framework, dtype_name, A, scale, x64)
    fixed = np.diag(_mpmath_covariance(A, scale)) == 0
    assert np.all(variance[fixed] == 0)
    assert np.all(variance[~fixed] > 0)
    # The covariance matrix (from the complete basis) is zero there up to its rounding.
    assert np.all(np.abs(covariance[fixed]) <= 8 * _eps(dtype_name) * scale.max() ** 2)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_gradient_of_a_fixed_coordinates_stddev_is_zero_not_nan(framework):
    A = np.array([[1.0, 1.0, 0.0, 0.0], [1.0, -1.0, 0.0, 0.0]])
    scale = np.array([3.0, 0.5, 2.0, 7.0])
    if framework == "torch":
        scale_t = torch.tensor(scale, requires_grad=True)
        A_t = torch.tensor(A, requires_grad=True)
        dist = pyro_constrained.LinearConstrainedNormal(torch.zeros(4), scale_t, A=A_t)
        grads = torch.autograd.grad(dist.marginals.scale.sum(), (scale_t, A_t))
        grads = [g.numpy() for g in grads]
    else:

        def total(scale, A):
            dist = numpyro_constrained.LinearConstrainedNormal(jnp.zeros(4), scale, A=A)
            return dist.marginals.scale.sum()

        grads = jax.grad(total, (0, 1))(jnp.asarray(scale), jnp.asarray(A))
    # Only the free coordinates' scales matter, each with d sigma_i / d s_i = 1.
    np.testing.assert_allclose(np.asarray(grads[0]), [0.0, 0.0, 1.0, 1.0], atol=1e-12)
    np.testing.assert_allclose(np.asarray(grads[1]), np.zeros((2, 4)), atol=1e-12)


ROW_SCALED = {
    "float32": np.array([[1e6, 1e6, 0.0, 0.0], [0.0, 0.0, 1e-6, 2e-6]]),
    "float64": np.array([[1e9, 1e9, 0.0, 0.0], [0.0, 0.0, 1e-9, 2e-9]]),
}


@pytest.mark.parametrize(("framework", "dtype_name", "x64"), CONFIGURATIONS)
def test_the_rank_check_does_not_depend_on_the_rows_scaling(framework, dtype_name, x64):
    # Full row rank, but the smallest singular value is 1e-12 (1e-18) of the largest: it
    # was rejected as rank-deficient. Scaling an equation changes nothing, so neither may
    # the check; the mean is that of the unscaled rows.
    A = ROW_SCALED[dtype_name]
    loc, scale = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 2.0, 0.5, 1.5])
    if framework == "torch":
        dtype = DTYPES[dtype_name][0]
        pyro_constrained.LinearConstraint(torch.tensor(A, dtype=dtype))
        dist = pyro_constrained.LinearConstrainedNormal(
            *(torch.tensor(x, dtype=dtype) for x in (loc, scale)),
            A=torch.tensor(A, dtype=dtype),
            k=torch.tensor(A @ loc, dtype=dtype),
        )
        mean = dist.mean.double().numpy()
    else:
        with jax.enable_x64(x64):
            dtype = DTYPES[dtype_name][1]
            numpyro_constrained.LinearConstraint(jnp.asarray(A, dtype=dtype))
            dist = numpyro_constrained.LinearConstrainedNormal(
                *(jnp.asarray(x, dtype=dtype) for x in (loc, scale)),
                A=jnp.asarray(A, dtype=dtype),
                k=jnp.asarray(A @ loc, dtype=dtype),
            )
            mean = np.asarray(dist.mean, np.float64)
    np.testing.assert_allclose(mean, loc, rtol=16 * _eps(dtype_name))
    # A rank-deficient A is still rejected, whatever its rows' scaling.
    deficient = np.array([[1e6, 2e6, 0.0], [1e-6, 2e-6, 0.0]])
    with pytest.raises(ValueError, match="rank"):
        if framework == "torch":
            pyro_constrained.LinearConstraint(torch.tensor(deficient, dtype=DTYPES[dtype_name][0]))
        else:
            with jax.enable_x64(x64):
                numpyro_constrained.LinearConstraint(
                    jnp.asarray(deficient, dtype=DTYPES[dtype_name][1])
                )


def _unresolvable_in_float32():
    """Nearly parallel rows (cond of the row-equilibrated A 2.3e5) and scales 1e-4..1e4:
    the row-equilibrated whitened A L has condition number 3.8e9, beyond 1 / eps of
    float32 (measured on main: log_prob -1887 where the truth is 6.02)."""
    rng = np.random.default_rng(145)
    row = rng.normal(size=4)
    A = row + 10.0 ** -rng.uniform(3, 5) * rng.normal(size=(2, 4))
    scale = np.logspace(-4, 4, 4)
    rng.shuffle(scale)
    loc, k = rng.normal(size=4), rng.normal(size=2)
    return _rounded((loc, scale, A, k), "float32")


def _build(framework: str, dtype_name: str, arrays, validate_args=None):
    loc, scale, A, k = arrays
    if framework == "torch":
        dtype = DTYPES[dtype_name][0]
        return pyro_constrained.LinearConstrainedNormal(
            *(torch.tensor(x, dtype=dtype) for x in (loc, scale)),
            A=torch.tensor(A, dtype=dtype),
            k=torch.tensor(k, dtype=dtype),
            validate_args=validate_args,
        )
    dtype = DTYPES[dtype_name][1]
    return numpyro_constrained.LinearConstrainedNormal(
        *(jnp.asarray(x, dtype=dtype) for x in (loc, scale)),
        A=jnp.asarray(A, dtype=dtype),
        k=jnp.asarray(k, dtype=dtype),
        validate_args=validate_args,
    )


@pytest.mark.parametrize(("framework", "x64"), [("torch", True), ("jax", True), ("jax", False)])
def test_float32_beyond_its_precision_warns_and_float64_is_right(framework, x64):
    arrays = _unresolvable_in_float32()
    reference = NullSpaceReference(*arrays)
    with jax.enable_x64(x64), pytest.warns(PrecisionWarning, match="float64"):
        dist = _build(framework, "float32", arrays)
        dist.log_prob(dist.mean)  # Pyro factorises on first use
    # The same problem in float64 is resolved, without a warning.
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        dist = _build(framework, "float64", arrays)
        mean = dist.mean
        log_prob = float(dist.log_prob(mean))
        expected = reference.logpdf(np.asarray(mean))
        assert abs(log_prob - expected) <= 1e-6 * max(1.0, abs(expected))
    # Validation off: no check (it needs the factor on the host), as for every check.
    with jax.enable_x64(x64), warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        dist = _build(framework, "float32", arrays, validate_args=False)
        dist.log_prob(dist.mean)


def test_a_traced_float32_problem_is_not_checked_under_jit():
    # NumPyro's rule for values: a tracer cannot be inspected, so no warning (and no error)
    # under jit; the eager construction of the same problem warns (previous test).
    loc, scale, A, k = _unresolvable_in_float32()
    with jax.enable_x64(False), warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)

        @jax.jit
        def entropy(scale):
            return numpyro_constrained.LinearConstrainedNormal(
                jnp.asarray(loc, jnp.float32), scale, A=jnp.asarray(A, jnp.float32)
            ).entropy()

        assert np.isfinite(entropy(jnp.asarray(scale, jnp.float32)))


@pytest.mark.parametrize(("framework", "x64"), [("torch", True), ("jax", False)])
def test_well_conditioned_float32_problems_do_not_warn(framework, x64):
    # Scales over 12 decades on loosely coupled coordinates: cond(A L) is 1e12, but the
    # row-equilibrated whitened constraint is well conditioned and the answer is right.
    A = np.array([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    arrays = (np.zeros(4), np.array([1e-6, 1.0, 1.0, 1e6]), A, np.ones(2))
    with jax.enable_x64(x64), warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        dist = _build(framework, "float32", arrays)
        dist.log_prob(dist.mean)


# --- gradients against float64 finite differences (issue 29, item 2) --------------------

FD_STEP = 1e-4


def _torch_quantities(theta, fixed, dtype):
    """The quantities whose gradients are checked, as one vector, from the parameters
    ``theta = (loc, log scale, k)``: variance, mean, entropy, log_prob of fixed points on
    the subspace (only where k is not moved), KL to a fixed q, the expected L2 and L1
    losses against a fixed target."""
    from pyro_constrained.losses import expected_l1_loss, expected_l2_loss

    loc, log_scale, k = theta
    A = torch.tensor(fixed["A"], dtype=dtype)
    # rtol: the fixed points are rounded to float32 in both dtypes' checks (the same
    # problem), so they are on the float64 subspace only to float32 precision.
    dist = pyro_constrained.LinearConstrainedNormal(
        loc, log_scale.exp(), A=A, k=k, rtol=1e-4, validate_args=False
    )
    q = pyro_constrained.LinearConstrainedNormal(
        torch.tensor(fixed["q_loc"], dtype=dtype),
        torch.tensor(fixed["q_scale"], dtype=dtype),
        A=A,
        k=k,
        validate_args=False,
    )
    target = torch.tensor(fixed["target"], dtype=dtype)
    parts = [
        dist.variance,
        dist.mean,
        dist.entropy().reshape(1),
        torch.distributions.kl_divergence(dist, q).reshape(1),
        expected_l2_loss(dist, target).reshape(1),
        expected_l1_loss(dist, target).reshape(1),
    ]
    if fixed["with_log_prob"]:
        parts.append(dist.log_prob(torch.tensor(fixed["points"], dtype=dtype)))
    return torch.cat(parts)


def _directional_check(quantities, theta0, direction, fixed, condition, dtype_name, to):
    """``J u`` of ``quantities`` in the dtype (autograd, forward-over-reverse) against
    central differences of the float64 quantities, per output."""
    theta64 = [np.asarray(x, np.float64) for x in theta0]

    def at(step):
        return np.asarray(
            quantities(
                [to(t + step * u, "float64") for t, u in zip(theta64, direction, strict=True)],
                fixed,
                "float64",
            ),
            np.float64,
        )

    # Five-point central differences: truncation error of order h^4, so a step large
    # enough for the rounding (eps_64 |F| / h) to stay small.
    plus, minus = at(FD_STEP), at(-FD_STEP)
    finite_difference = (8 * (plus - minus) - (at(2 * FD_STEP) - at(-2 * FD_STEP))) / (12 * FD_STEP)
    value, derivative = quantities.jvp(
        [to(t, dtype_name) for t in theta64], [to(u, dtype_name) for u in direction], fixed
    )
    derivative = np.asarray(derivative, np.float64)
    # The size of the terms that make up each directional derivative: |J| |u| from the
    # float64 Jacobian, and |F| (the directions move every parameter by O(1) of its own
    # size, so a derivative's terms are of the size of the quantity even where they
    # cancel). The float64 differences carry eps_64 |F| / h of rounding.
    magnitude = np.abs(plus) + np.abs(minus)
    size = quantities.abs_jacobian_times(theta64, direction, fixed) + magnitude
    # The losses' derivatives are sums of (mean - target) times the mean's derivative: the
    # representation error of the mean in the dtype (eps |mean|) enters with that factor.
    n = len(fixed["target"])
    mean, d_mean = (plus + minus)[n : 2 * n] / 2, finite_difference[n : 2 * n]
    operands = (np.abs(mean) + np.abs(fixed["target"])) * np.abs(d_mean)
    deviation = np.sqrt(np.maximum((plus + minus)[:n] / 2, 0))
    size[2 * n + 2] += 2 * np.sum(operands)
    size[2 * n + 3] += np.sum(operands / np.maximum(deviation, 1e-3 * np.max(deviation)))
    eps = _eps(dtype_name)
    # Moving the log-scales moves the correction mu_bar - loc. Its derivative has the
    # accuracy docs/numerics.md states for the float32 results below the conditioning
    # guard: eps times the condition number kappa_w of the row-equilibrated whitened
    # constraint A L (which cond(A) does not see: scales 0.003..316 make it 1.4e5 where
    # cond(A) = 3.7), times the correction's size in coordinate i, s_i (1 + its whitened
    # length). Measured at most 0.2 of that (float32, kappa_w = 1.7e3 and 1.4e5).
    loc0, scale0 = np.asarray(theta0[0], np.float64), np.exp(np.asarray(theta0[1], np.float64))
    kappa_w = float(whitened_condition(np.linalg.qr(scale0[:, None] * fixed["A"].T)[1]))
    correction = np.linalg.norm((mean - loc0) / scale0)
    mean_error = 4 * eps * kappa_w * scale0 * (1 + correction)
    mean_tolerance = mean_error * np.abs(direction[1]).max()
    tolerance = 256 * eps * condition * size + 1e-7 * size
    # A variance's derivative is as accurate as the variance itself, whose error relative
    # to itself is eps times its componentwise condition number kappa_i (large where the
    # constraint nearly fixes the coordinate; see _variance_tolerance): the float32
    # variance 2.14e-8 of a nearly fixed coordinate (kappa = 1.5e4) is off by 3.2e-4 of
    # itself in value and by 2.2e-4 in derivative.
    log_scale = np.asarray(theta0[1], np.float64)
    scale, A = np.exp(log_scale), np.asarray(fixed["A"], np.float64)
    whitened = scale[:, None] * A.T
    projector = np.eye(n) - whitened @ np.linalg.pinv(whitened)
    tolerance[:n] += 256 * eps * _componentwise_condition(projector, scale, A) * size[:n]
    tolerance[n : 2 * n] += mean_tolerance
    # The KL's Mahalanobis term sums (mu_p - mu_q)_i d mu_p,i / s_q,i^2: the mean's error, in
    # value and in derivative, enters with those weights (the small scales amplify it).
    q_mean = pyro_constrained.LinearConstrainedNormal(
        torch.tensor(fixed["q_loc"]),
        torch.tensor(fixed["q_scale"]),
        A=torch.tensor(fixed["A"]),
        k=torch.tensor(np.asarray(theta0[2], np.float64)),
        validate_args=False,
    ).mean.numpy()
    weights = 1 / np.asarray(fixed["q_scale"], np.float64) ** 2
    tolerance[2 * n + 1] += np.sum(
        weights * (np.abs(mean - q_mean) * mean_tolerance + mean_error * np.abs(d_mean))
    )
    error = np.abs(derivative - finite_difference)
    assert np.all(error <= tolerance), (error / np.maximum(tolerance, 1e-300), value)


class _TorchQuantities:
    @staticmethod
    def __call__(theta, fixed, dtype_name):
        dtype = DTYPES[dtype_name][0]
        with torch.no_grad():
            return _torch_quantities([torch.as_tensor(t, dtype=dtype) for t in theta], fixed, dtype)

    @staticmethod
    def jvp(theta, direction, fixed):
        dtype = theta[0].dtype
        return torch.autograd.functional.jvp(
            lambda *t: _torch_quantities(list(t), fixed, dtype), tuple(theta), tuple(direction)
        )

    @staticmethod
    def abs_jacobian_times(theta, direction, fixed):
        theta = tuple(torch.tensor(t) for t in theta)
        jacobian = torch.autograd.functional.jacobian(
            lambda *t: _torch_quantities(list(t), fixed, torch.float64), theta
        )
        return sum(
            (j.abs() @ torch.tensor(u).abs()).numpy()
            for j, u in zip(jacobian, direction, strict=True)
        )


def _gradient_problem(arrays, seed, dtype_name):
    loc, scale, A, k = arrays
    rng = np.random.default_rng(seed)
    base = pyro_constrained.LinearConstrainedNormal(
        *(torch.tensor(x) for x in (loc, scale)), A=torch.tensor(A), k=torch.tensor(k)
    )
    torch.manual_seed(seed)
    points = base.sample((2,)).numpy()
    fixed = {
        "A": A,
        "q_loc": loc + scale * rng.normal(size=len(loc)),
        "q_scale": scale * np.exp(rng.normal(size=len(loc)) / 2),
        "target": base.sample().numpy(),
        "points": points,
    }
    # The fixed arrays as the dtype has them, so that both dtypes solve the same problem.
    for name in ("q_loc", "q_scale", "target", "points"):
        fixed[name] = np.asarray(fixed[name], dtype_name).astype(np.float64)
    theta0 = (loc, np.log(scale), k)
    # Moving loc and the scales (log_prob of fixed points included), then moving k.
    along_parameters = (
        scale * rng.normal(size=len(loc)),
        rng.normal(size=len(loc)),
        np.zeros_like(k),
    )
    along_k = (
        np.zeros_like(loc),
        np.zeros_like(loc),
        # A move of the mean of the order of the conditional standard deviations, the
        # scale on which the losses vary (a larger one leaves the finite differences'
        # linear regime where a coordinate is nearly fixed).
        A @ (base.stddev.numpy() * rng.normal(size=len(loc))),
    )
    return fixed, theta0, along_parameters, along_k


# Issue 29 (c): coordinate 3 is nearly fixed (conditional variance 2.1e-8, componentwise
# condition number 1.5e4); its float32 variance gradient failed the tolerance without kappa_i.
NEARLY_FIXED_COORDINATE = (
    (
        np.zeros(4),
        np.ones(4),
        np.array(
            [
                [0.08673671, -0.53260862, -0.75577798, 0.37095073],
                [0.55239914, -0.65067847, 0.52102713, -0.00185848],
                [0.56012199, 0.15993247, -0.3966489, -0.70947489],
            ]
        ),
        np.zeros(3),
    ),
    1.0,
)

# And a mean whose correction is large in whitened units (scales 0.06..245): the derivative
# of the small-scale coordinates' mean failed the tolerance without the correction's size.
LARGE_CORRECTION = (
    (
        np.zeros(4),
        np.array([6.03082111e-02, 1.19533691e-01, 2.45415140e02, 6.15285384e-01]),
        np.array(
            [
                [0.46771358, -0.11119879, -0.12951389, -0.86723987],
                [0.40344601, -0.78465703, 0.39265259, 0.25955463],
                [0.28139617, 0.53211225, 0.79775003, -0.03560392],
            ]
        ),
        np.zeros(3),
    ),
    1.0,
)

# The same with kappa_w = 1.4e5 (scales 0.003..316, cond(A) = 3.7): the float32 mean of the
# two small-scale coordinates is off by 0.5% in value and in derivative.
ILL_CONDITIONED_WHITENED = (
    (
        np.zeros(5),
        np.array([5.65322644, 8.75454648, 3.16227766e-03, 1.49789898e-02, 3.16227766e02]),
        np.array(
            [
                [0.48732528, 1.17189518, 1.58750361, -0.59883512, -1.80109084],
                [-0.49754424, -0.09077888, -1.68460812, -0.11389155, -1.78158032],
                [-0.60653713, -0.67636385, 0.32412249, 0.51653065, 0.506844],
                [-0.00280444, 1.23435861, -0.02477202, 0.45641019, 0.36780081],
            ]
        ),
        np.zeros(4),
    ),
    3.7015441104625713,
)

# A KL whose Mahalanobis term weights the small-scale coordinates' mean error by
# 1 / s_q^2 (kappa_w = 7.3e4, cond(A) = 17.7): it failed without that term.
KL_OF_SMALL_SCALES = (
    (
        np.zeros(8),
        np.array(
            [
                2.52151717e00,
                3.16227766e02,
                3.16227766e-03,
                3.14468551e-02,
                1.62392345e02,
                2.11617140e-01,
                1.06531097e-02,
                4.42120607e00,
            ]
        ),
        np.array(
            [
                [
                    1.12144776e-01,
                    -1.17830623e-01,
                    5.71223479e-01,
                    9.35654132e-02,
                    -4.77789040e-01,
                    3.22523860e-01,
                    1.16309978e00,
                    8.44746641e-01,
                ],
                [
                    -1.39230238e00,
                    -2.50356845e00,
                    -1.23311506e00,
                    8.17612316e-02,
                    -4.59994857e00,
                    -4.32867561e-01,
                    -2.46496792e00,
                    -1.44875165e00,
                ],
                [
                    -2.92716912e-01,
                    -1.70114611e-01,
                    2.21385817e-01,
                    5.60691332e-01,
                    -6.91293498e-02,
                    7.34920286e-01,
                    -3.57759333e-01,
                    1.89051436e-01,
                ],
                [
                    3.22058766e-01,
                    3.35124338e-02,
                    -2.65034149e-01,
                    -3.28566170e-01,
                    -1.63164892e-01,
                    7.84926511e-02,
                    -3.59897197e-01,
                    -7.45645279e-02,
                ],
                [
                    -1.27809497e-01,
                    4.34135328e-01,
                    1.72306313e-01,
                    2.85256739e-01,
                    -5.24826505e-01,
                    -1.04040523e-01,
                    6.29295048e-01,
                    1.19877325e00,
                ],
                [
                    -6.28870727e-01,
                    7.56165839e-01,
                    6.72230027e-01,
                    3.90244873e-01,
                    1.32088760e-01,
                    -1.56796341e-01,
                    7.28243689e-01,
                    9.79098420e-01,
                ],
                [
                    7.02133710e-01,
                    5.12522654e-01,
                    1.39278406e-01,
                    -4.70906319e-01,
                    -1.73586617e-03,
                    2.55841619e-01,
                    -5.02100636e-01,
                    1.53987094e-01,
                ],
            ]
        ),
        np.zeros(7),
    ),
    17.740846241419092,
)


@pytest.mark.x64_only("Pyro only: nothing of JAX runs in it")
@pytest.mark.parametrize("dtype_name", DTYPES)
@given(drawn=problems(max_scale_decades=6.0, max_log10_loc=1.0), seed=st.integers(0, 2**16))
@example(drawn=NEARLY_FIXED_COORDINATE, seed=0)
@example(drawn=LARGE_CORRECTION, seed=0)
@example(drawn=ILL_CONDITIONED_WHITENED, seed=0)
@example(drawn=KL_OF_SMALL_SCALES, seed=1)
def test_gradients_match_float64_finite_differences(drawn, seed, dtype_name):
    # Row norms over 12 decades, scales over 6, conditioning up to 1e3, with loc and the
    # mean within a few scales of each other and of zero: the derivatives' terms are then of
    # the size of the quantities. (A mean of 100 scales carries eps * 100 of representation
    # error in float32, which the loss derivatives multiply by the mean's own derivative:
    # that is the data, not the gradient.)
    (loc, scale, A, k), condition = drawn
    assume(condition < 1e3)
    rng = np.random.default_rng(seed)
    loc = scale * rng.normal(size=len(scale))
    k = A @ (loc + scale * rng.normal(size=len(scale)))
    arrays = _rounded((loc, scale, A, k), dtype_name)
    fixed, theta0, along_parameters, along_k = _gradient_problem(arrays, seed, dtype_name)
    quantities = _TorchQuantities()

    def to(x, name):
        return torch.tensor(np.asarray(x, np.float64), dtype=DTYPES[name][0])

    for direction, with_log_prob in ((along_parameters, True), (along_k, False)):
        fixed["with_log_prob"] = with_log_prob
        _directional_check(quantities, theta0, direction, fixed, condition, dtype_name, to)


# --- NumPyro gradients against an independent 40-digit reference (issue 29) --------------


def _null_space_quantities(loc, log_scale, A, k, points, move=None, dps: int = 40) -> list:
    """``[mean, variance, entropy, log_prob(points)]`` of the conditional Gaussian as
    ``dps``-digit numbers, computed in an orthonormal basis ``N`` of null(A) (no
    ``A Sigma A^T``, no whitened QR): ``P = N^T Sigma^{-1} N`` is the precision of the
    coordinates ``u = N^T (z - mean)``, whose density is the one on the subspace. ``move``:
    ``(step, (d_loc, d_log_scale))``, parameters moved by ``step`` times that direction in
    the same arithmetic (a float64 sum would round the step)."""
    with mpmath.workdps(dps):
        n, a = A.shape[1], A.shape[0]
        step, (d_loc, d_log_scale) = move if move is not None else (0, (loc, log_scale))
        step = mpmath.mpf(step)
        loc = [mpmath.mpf(x) + step * mpmath.mpf(d) for x, d in zip(loc, d_loc, strict=True)]
        log_scale = [
            mpmath.mpf(x) + step * mpmath.mpf(d)
            for x, d in zip(log_scale, d_log_scale, strict=True)
        ]
        A_mp = mpmath.matrix(A.tolist())
        basis = mpmath.qr(A_mp.T, mode="full")[0][:, a:]
        z0 = A_mp.T * mpmath.lu_solve(A_mp * A_mp.T, mpmath.matrix(k.tolist()))
        inverse_variance = mpmath.diag([mpmath.exp(-2 * x) for x in log_scale])
        precision = basis.T * inverse_variance * basis
        covariance = mpmath.inverse(precision)
        shift = mpmath.matrix(loc) - z0
        mean = z0 + basis * (covariance * (basis.T * (inverse_variance * shift)))
        variance = [(basis[i, :] * covariance * basis[i, :].T)[0] for i in range(n)]
        log_det = mpmath.log(mpmath.det(precision))
        half_log_2pi = mpmath.log(2 * mpmath.pi) / 2
        dim = n - a
        values = [mean[i] for i in range(n)] + variance
        values.append(dim * (mpmath.mpf(1) / 2 + half_log_2pi) - log_det / 2)
        for point in points:
            u = basis.T * (mpmath.matrix([mpmath.mpf(x) for x in point]) - mean)
            values.append(-(u.T * precision * u)[0] / 2 + log_det / 2 - dim * half_log_2pi)
        return values


def _as_float(values) -> np.ndarray:
    return np.array([float(v) for v in values])


def _null_space_quantities_float64(loc, log_scale, A, points) -> np.ndarray:
    """What :func:`_null_space_quantities` computes except the mean's offset (``k`` enters
    only through it, and the derivatives below are in ``loc`` and the scales), in float64:
    for the sizes of the derivatives' terms, needed to a digit or two."""
    a = A.shape[0]
    basis = np.linalg.qr(A.T, mode="complete")[0][:, a:]
    inverse_variance = np.exp(-2 * log_scale)
    precision = basis.T @ (inverse_variance[:, None] * basis)
    covariance = np.linalg.inv(precision)
    mean = basis @ (covariance @ (basis.T @ (inverse_variance * loc)))
    variance = np.einsum("ij,jk,ik->i", basis, covariance, basis)
    log_det = np.linalg.slogdet(precision)[1]
    u = (points - mean) @ basis
    log_prob = -np.einsum("pi,ij,pj->p", u, precision, u) / 2 + log_det / 2
    return np.concatenate([mean, variance, [-log_det / 2], log_prob])


def _numpyro_quantities(loc, log_scale, A, k, points):
    # The support check is not under test here: a point rounded to float32 is off the
    # subspace by its rounding, so the tolerance is that of measured data.
    dist = numpyro_constrained.LinearConstrainedNormal(
        loc, jnp.exp(log_scale), A=A, k=k, rtol=1e-4, validate_args=False
    )
    return jnp.concatenate([dist.mean, dist.variance, dist.entropy()[None], dist.log_prob(points)])


@jax.jit
def _numpyro_directional_derivative(theta, direction, A, k, points):
    """The quantities and their derivative along ``direction`` in (loc, log scale), in one
    compiled program per shape and dtype."""
    return jax.jvp(lambda *t: _numpyro_quantities(*t, A, k, points), theta, direction)


@pytest.mark.parametrize("dtype_name", DTYPES)
@given(
    drawn=problems(max_scale_decades=4.0, max_log10_loc=1.0, shapes=((3, 1), (5, 2))),
    seed=st.integers(0, 2**16),
)
# A third of the profile's examples: each costs 4 reference evaluations in 40 digits.
@settings(max_examples=max(1, settings.default.max_examples // 3))
def test_numpyro_gradients_match_a_40_digit_reference(drawn, seed, dtype_name):
    """The derivatives of NumPyro's ``mean``, ``variance``, ``entropy`` and ``log_prob`` (of
    fixed points on the subspace) along a joint move of ``loc`` and the log scales, by JAX's
    forward mode in the dtype, against five-point central differences of the 40-digit
    null-space reference: within the documented ``256 eps cond(A)`` times the size of each
    derivative's terms (``|J| |u|`` from float64 differences of the same formulas, plus
    the quantity itself; docs/numerics.md). The differences' own error is below 1e-14 of
    that size (h^4 truncation, 40-digit rounding)."""
    (_, scale, A, _), condition = drawn
    assume(condition < 1e3)
    rng = np.random.default_rng(seed)
    loc = scale * rng.normal(size=len(scale))
    k = A @ (loc + scale * rng.normal(size=len(scale)))
    loc, scale, A, k = _rounded((loc, scale, A, k), dtype_name)
    (log_scale,) = _rounded((np.log(scale),), dtype_name)
    n = len(loc)
    # Two points of the subspace about a conditional standard deviation from the mean.
    reference0 = _as_float(_null_space_quantities(loc, log_scale, A, k, np.zeros((0, n)), dps=16))
    mean, deviation = reference0[:n], np.sqrt(reference0[n : 2 * n])
    basis = np.linalg.qr(A.T, mode="complete")[0][:, A.shape[0] :]
    points = mean + (rng.normal(size=(2, n)) * deviation) @ basis @ basis.T
    (points,) = _rounded((points,), dtype_name)
    direction = _rounded((scale * rng.normal(size=n), rng.normal(size=n)), dtype_name)

    h = 1e-4
    with mpmath.workdps(40):
        at = {
            step: _null_space_quantities(loc, log_scale, A, k, points, (step * h, direction))
            for step in (-2, -1, 1, 2)
        }
        finite_difference = _as_float(
            (8 * (p1 - m1) - (p2 - m2)) / (12 * mpmath.mpf(h))
            for p1, m1, p2, m2 in zip(at[1], at[-1], at[2], at[-2], strict=True)
        )
    # |J| |u| by central differences of the float64 reference (a size, needed to a digit
    # or two), plus the quantities themselves.
    size = np.abs(_as_float(at[1]))
    for part in range(2):
        for i in range(n):
            theta = [np.array(loc), np.array(log_scale)]
            theta[part][i] += 1e-6
            plus = _null_space_quantities_float64(*theta, A, points)
            theta[part][i] -= 2e-6
            minus = _null_space_quantities_float64(*theta, A, points)
            size += np.abs((plus - minus) / 2e-6 * direction[part][i])

    dtype = DTYPES[dtype_name][1]
    as_jax = lambda x: jnp.asarray(x, dtype=dtype)  # noqa: E731
    _, derivative = _numpyro_directional_derivative(
        (as_jax(loc), as_jax(log_scale)),
        (as_jax(direction[0]), as_jax(direction[1])),
        as_jax(A),
        as_jax(k),
        as_jax(points),
    )
    derivative = np.asarray(derivative, np.float64)
    tolerance = 256 * _eps(dtype_name) * condition * size
    error = np.abs(derivative - finite_difference)
    assert np.all(error <= tolerance), (error / tolerance, derivative, finite_difference)
