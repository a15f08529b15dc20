"""The jitted kernels of :class:`~numpyro_constrained.LinearConstrainedNormal`: the
whitened QR factorisation, the conditional mean, ``log_prob``, Matheron's sampler and the
second moments (the conditional-Gaussian math of
``docs/distributions/linear_constrained_normal.md``).

Each is jitted as a whole: besides fusing the O(n a) work, this compiles one program per
shape instead of dispatching dozens of small eager operations.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_constrained._products import matmul
from numpyro_constrained.linear_constraint import (
    _after,
    _combine_rows,
    _complement_diagonal,
    _complete_complement,
    _row_sorted_qr,
    _rows_times,
    _within_tolerance,
)


def _refine(
    z: jax.Array,
    A: jax.Array,
    k: jax.Array,
    factor: jax.Array,
    basis_t: jax.Array,
    r_inv_t: jax.Array,
    diagonal: bool,
) -> jax.Array:
    """``z + K (k - A z)`` with ``K = L Q R^{-T}``: the Sigma^{-1}-orthogonal projection
    onto ``{A z = k}``; Q is read once (it is (batch, a, n) when the scale is batched)."""
    direction = _combine_rows(_rows_times(r_inv_t, k - _rows_times(A, z)), basis_t)
    if diagonal:
        return z + factor * direction
    return z + _rows_times(factor, direction)


def _whitened_t(factor: jax.Array, A: jax.Array, diagonal: bool) -> jax.Array:
    """``(A L)^T`` (..., n, a)."""
    if diagonal:
        return factor[..., :, None] * jnp.swapaxes(A, -1, -2)
    return matmul(jnp.swapaxes(factor, -1, -2), jnp.swapaxes(A, -1, -2))


@jax.jit
def _diagonal_variance_kernel(
    scale: jax.Array, A: jax.Array, basis_t: jax.Array, r_inv_t: jax.Array
) -> jax.Array:
    """``diag Sigma_bar = scale^2 diag(I - Q Q^T)`` (see :func:`_complement_diagonal`)."""
    whitened_t = _whitened_t(scale, A, True)
    # Its QRs run after the reduced one's LAPACK calls (see _after).
    whitened_t = _after(whitened_t, basis_t, r_inv_t)
    complement = _complement_diagonal(whitened_t, jnp.swapaxes(basis_t, -1, -2))
    return jnp.square(scale) * complement


@partial(jax.jit, static_argnames=("diagonal",))
def _second_moment_kernel(
    factor: jax.Array,
    A: jax.Array,
    basis_t: jax.Array,
    r_inv_t: jax.Array,
    diagonal: bool,
) -> tuple[jax.Array, jax.Array]:
    r"""``(Y, Z)``, (..., n, n - a) and (..., a, n), with ``Sigma_bar = Y Y^T + Z^T Z``:
    the second moments as sums of squares, without the cancellation of
    ``Sigma - (L Q)(L Q)^T``. O(n^2 a) (a complete QR).

    ``Sigma_bar = L P L^T`` with ``P = I - Q Q^T = N N^T``, ``N`` an orthonormal basis of
    the complement of range(M), ``M = (A L)^T``, from the complete QR
    (:func:`_complete_complement`, rows in leverage order). ``Y = L N`` and ``Z = 0`` in
    value; the derivatives
    come from writing ``P`` as a function of ``M`` around ``M0 = stop_gradient(M)``, whose
    basis ``N0`` was computed: with ``D = (M - M0)^T N0`` (zero in value) and
    ``C = R^{-T} D``, the exact identities ``P(M) N0 = N0 - Q C =: N_d`` and
    ``N_d^T N_d = I - C^T C`` give ``P = N_d (I - C^T C)^{-1} N_d^T
    = N_d N_d^T + (C N_d^T)^T (C N_d^T) + O(|M - M0|^4)``, differentiable through the
    reduced QR (``basis_t`` = Q^T, ``r_inv_t`` = R^{-T}) alone. So ``Y = L N_d`` and
    ``Z = C N_d^T L^T``: values exact to the basis' rounding, first to third derivatives
    exact.
    """
    whitened_t = _whitened_t(factor, A, diagonal)
    fixed = lax.stop_gradient(whitened_t)
    # The complete QR runs after the reduced one's LAPACK calls (see _after).
    leverage = jnp.sum(jnp.square(lax.stop_gradient(basis_t)), -2)
    complement = _complete_complement(_after(fixed, basis_t, r_inv_t), leverage)
    coefficients = matmul(r_inv_t, matmul(jnp.swapaxes(whitened_t - fixed, -1, -2), complement))
    moved = complement - matmul(jnp.swapaxes(basis_t, -1, -2), coefficients)
    crossed = matmul(coefficients, jnp.swapaxes(moved, -1, -2))
    if diagonal:
        return factor[..., :, None] * moved, crossed * factor[..., None, :]
    return matmul(factor, moved), matmul(crossed, jnp.swapaxes(factor, -1, -2))


@partial(jax.jit, static_argnames=("diagonal",))
def _precompute(
    factor: jax.Array,
    A: jax.Array,
    log_det_a_half: jax.Array,
    diagonal: bool,
) -> dict[str, jax.Array]:
    """Everything that depends only on the covariance and ``A``; O(n a^2 + a^3) when
    ``diagonal``. The conditional mean is computed on first use (:func:`_mean_kernel`):
    ``log_prob`` does not need it.

    ``factor`` is the standard deviations (diagonal) or the lower Cholesky factor L of Sigma;
    ``log_det_a_half`` is ``1/2 log det(A A^T)`` from the :class:`LinearConstraint`.
    """
    whitened_t = _whitened_t(factor, A, diagonal)
    if diagonal:
        log_det_sigma_half = jnp.sum(jnp.log(factor), -1)
        prior_variance = jnp.square(factor)
    else:
        log_det_sigma_half = jnp.sum(jnp.log(jnp.diagonal(factor, axis1=-2, axis2=-1)), -1)
        prior_variance = jnp.sum(jnp.square(factor), -1)
    basis, r_factor = _row_sorted_qr(whitened_t)
    r_factor = _after(r_factor, basis)  # one LAPACK call at a time (see _after)
    basis_t = jnp.swapaxes(basis, -1, -2)  # Q^T, (..., a, n): orthonormal rows
    # R^{-T} (..., a, a), so that K r = L Q (R^{-T} r) costs one pass over Q. An explicit
    # triangular inverse is as accurate here as a substitution, and a small matrix product
    # broadcasts where a batched solve would not.
    identity = jnp.broadcast_to(jnp.eye(r_factor.shape[-1], dtype=r_factor.dtype), r_factor.shape)
    r_inv_t = jnp.swapaxes(
        jax.scipy.linalg.solve_triangular(r_factor, identity, lower=False), -1, -2
    )
    num_rows, n = A.shape[-2:]
    return {
        "_basis_t": basis_t,
        "_r_inv_t": r_inv_t,
        "_prior_variance": prior_variance,
        # log p(z) = -1/2 (z - mu_bar)^T Sigma^{-1} (z - mu_bar) + _log_normalizer on the
        # subspace: for A z = k the cross term with mu_bar - loc = K (k - A loc) vanishes,
        # so the squared distance splits into this one plus the one of log N(k; A loc, S).
        # 1/2 log det S = sum log|R_ii|, 1/2 log det(A A^T) = sum log|R'_ii|.
        "_log_normalizer": (
            -log_det_sigma_half
            + jnp.sum(jnp.log(jnp.abs(jnp.diagonal(r_factor, axis1=-2, axis2=-1))), -1)
            - log_det_a_half
            - 0.5 * (n - num_rows) * math.log(2 * math.pi)
        ),
        # Not a leaf: for the conditioning check at construction (popped there).
        "r_factor": r_factor,
    }


@partial(jax.jit, static_argnames=("diagonal",))
def _mean_kernel(
    loc: jax.Array,
    factor: jax.Array,
    A: jax.Array,
    k: jax.Array,
    basis_t: jax.Array,
    r_inv_t: jax.Array,
    diagonal: bool,
) -> jax.Array:
    """``mu_bar``, the Sigma^{-1}-orthogonal projection of loc onto the subspace: one step
    from loc, then one of refinement."""
    refine = partial(
        _refine, A=A, k=k, factor=factor, basis_t=basis_t, r_inv_t=r_inv_t, diagonal=diagonal
    )
    return refine(refine(loc))


@partial(jax.jit, static_argnames=("diagonal", "projected"))
def _log_prob_kernel(
    value: jax.Array,
    center: jax.Array,
    factor: jax.Array,
    basis_t: jax.Array,
    log_normalizer: jax.Array,
    A: jax.Array,
    k: jax.Array,
    rtol: jax.Array,
    diagonal: bool,
    projected: bool,
) -> tuple[jax.Array, jax.Array]:
    """(log density, or -inf off the subspace; whether each value is on the subspace).

    ``center`` is ``loc`` when ``projected`` (diagonal scale, value of the parameters'
    dtype), else the conditional mean ``mu_bar``.
    """
    diff = value - center
    if projected:
        # On the subspace, L^{-1} (z - mu_bar) = (I - Q Q^T) L^{-1} (z - loc): an orthogonal
        # projection in whitened coordinates, which needs neither mu_bar (two refinement
        # passes) nor k, and is as accurate as the difference from mu_bar.
        whitened = diff / factor
        whitened = whitened - _combine_rows(_rows_times(basis_t, whitened), basis_t)
        mahalanobis = jnp.sum(jnp.square(whitened), -1)
    elif diagonal:
        mahalanobis = jnp.sum(jnp.square(diff / factor), -1)
    else:
        batch = jnp.broadcast_shapes(diff.shape[:-1], factor.shape[:-2])
        solved = jax.scipy.linalg.solve_triangular(
            jnp.broadcast_to(factor, batch + factor.shape[-2:]),
            jnp.broadcast_to(diff, batch + diff.shape[-1:])[..., None],
            lower=True,
        )
        mahalanobis = jnp.sum(jnp.square(solved[..., 0]), -1)
    on_subspace = _within_tolerance(value, k, A, rtol)
    log_prob = -0.5 * mahalanobis + log_normalizer
    return jnp.where(on_subspace, log_prob, -jnp.inf), on_subspace


@partial(jax.jit, static_argnames=("diagonal",))
def _matheron_kernel(
    noise: jax.Array,
    mean: jax.Array,
    factor: jax.Array,
    A: jax.Array,
    k: jax.Array,
    basis_t: jax.Array,
    r_inv_t: jax.Array,
    diagonal: bool,
) -> jax.Array:
    """Matheron's rule in whitened form, ``z = mu_bar + L (noise - Q Q^T noise)``, then one
    refinement step.

    The projection is orthogonal, hence accurate however ill-conditioned ``A L`` is; the
    refinement step removes what rounding left of ``A z - k`` (see the class docstring).
    """
    projected = noise - _combine_rows(_rows_times(basis_t, noise), basis_t)
    if diagonal:
        z = mean + factor * projected
    else:
        z = mean + _rows_times(factor, projected)
    return _refine(z, A, k, factor, basis_t, r_inv_t, diagonal)
