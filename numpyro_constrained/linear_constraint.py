"""The linear equality constraint ``A z = k``, validated and factorised once.

The math: ``docs/distributions/linear_constrained_normal.md``.


Holds :class:`LinearConstraint` (a pytree: its cached factorisation is data, so it passes
through ``jit``, ``vmap`` and ``lax.scan`` without being recomputed) and the linear algebra
that it and :class:`~numpyro_constrained.linear_constrained_normal.LinearConstrainedNormal`
share: products over the last dimensions, the row-sorted QR, and the support tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.util import not_jax_tracer

from constrained_ppl.conditioning import DEFAULT_RTOL_ULPS, check_full_row_rank
from constrained_ppl.conditioning import check_rtol as _check_rtol
from constrained_ppl.conditioning import default_rtol as _default_rtol
from numpyro_constrained._products import matmul

__all__ = ["DEFAULT_RTOL_ULPS", "LinearConstraint"]


def default_rtol(dtype) -> float:
    """The default support tolerance for values of ``dtype``: 1e-6 in float64, 64 eps =
    7.6e-6 in float32 (see :func:`constrained_ppl.conditioning.default_rtol`)."""
    return _default_rtol(jnp.finfo(dtype).eps)


def _rows_times(matrix: jax.Array, vector: jax.Array) -> jax.Array:
    """``matrix @ vector`` over the last dimensions: (..., a, n) x (..., n) -> (..., a).

    Written as a row vector times the transposed matrix so that an unbatched ``matrix`` and
    a batched ``vector`` become one matrix-matrix product.
    """
    return matmul(vector[..., None, :], jnp.swapaxes(matrix, -1, -2))[..., 0, :]


def _combine_rows(coefficients: jax.Array, rows: jax.Array) -> jax.Array:
    """``coefficients^T @ rows``: (..., a) x (..., a, n) -> (..., n)."""
    return matmul(coefficients[..., None, :], rows)[..., 0, :]


def _after(value: jax.Array, *earlier: jax.Array) -> jax.Array:
    """``value``, a batch of matrices (..., p, q), made to depend on ``earlier``, batches of
    matrices (..., r, s) whose batch shapes broadcast to that of ``value``: NaN in each
    batch element where the first entry of that element of some ``earlier`` is NaN.

    XLA's CPU runtime runs independent LAPACK calls (QR, triangular solves) at the same
    time, and a batched LAPACK call blocks its thread while it spreads its batch over the
    same thread pool: two of them at once on a small pool deadlock (measured: a (256, 1000)
    scale with a = 10 hung every time on two cores). A data dependency orders them; an
    optimization barrier does not (its outputs alias its inputs). The dependency is taken
    per batch element, not on the first entry of the whole array: a batch sharded over
    devices then depends only on its own shard (the first entry lives on one device, and
    every other device would wait for it through an all-reduce)."""
    marker = sum(array[..., :1, :1] for array in earlier)
    return jnp.where(jnp.isnan(marker), jnp.nan, value)


def _row_sorted_qr(tall: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Reduced QR ``tall = Q R`` of an (..., n, a) matrix, n >= a, with Householder
    reflections applied to the rows sorted by decreasing norm.

    ``Q`` (..., n, a) is returned in the original row order; ``R`` (..., a, a) is upper
    triangular and, as ``R^T R = tall^T tall``, does not depend on the order. Why sort: the
    rows here are ``s_i A_{:, i}^T``, whose norms may differ by many orders of magnitude, and
    Householder QR is row-wise backward stable only when the rows come in decreasing order
    of norm (Powell and Reid 1969; Cox and Higham 1998). Unsorted, the rows of ``Q`` of the
    small-variance coordinates carry errors of the size of the largest row, which in float32
    with scales spanning 12 decades moves the conditional mean off ``A z = k`` by 100%.
    """
    order = jnp.argsort(-jnp.linalg.norm(tall, axis=-1), axis=-1)
    q, r = jnp.linalg.qr(jnp.take_along_axis(tall, order[..., None], axis=-2))
    inverse_order = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(q, inverse_order[..., None], axis=-2), r


_LEVERAGE_ORDER_NOTE = """
    The rows are processed in decreasing order of leverage ``h_i = ||Q_i||^2`` (from the
    reduced factorisation), not of norm: Householder QR gives rows of the orthogonal
    factor that are accurate relative to their own length when each reflection's pivot
    row dominates its column among the remaining rows (Powell and Reid's row pivoting;
    Cox and Higham 1998). Pre-sorting by norm does not ensure that for the later columns:
    a row that is small overall but carries a later column (a coordinate that a
    constraint on small-scale coordinates nearly fixes) then sits behind larger rows, and
    its row of the complement lost up to 4000 ulps (float64) on a problem of condition 1.
    The rows of largest leverage are those that carry the column space."""


def _leverage_order(tall: jax.Array, leverage: jax.Array):
    order = jnp.argsort(-jax.lax.stop_gradient(leverage), axis=-1, stable=True)
    order = jnp.broadcast_to(order, tall.shape[:-1])
    return order, jnp.argsort(order, axis=-1)


def _complete_complement(tall: jax.Array, leverage: jax.Array) -> jax.Array:
    """An orthonormal basis (..., n, n - a) of the orthogonal complement of the range of
    ``tall`` (..., n, a), full column rank: the last n - a columns of the complete QR
    factor, not differentiated (``stop_gradient``; the callers differentiate it by hand);
    ``leverage`` (..., n) are the leverages ``||Q_i||^2`` of ``tall``'s reduced QR. Its
    rows are accurate to a few ulps relative to their own length, also when that length
    is tiny (a coordinate almost fixed by the constraint), which ``1 - ||Q_i||^2`` is
    not; a row that the constraint fixes exactly comes out as exact zeros when the
    reflections do not mix it.
    """
    tall = jax.lax.stop_gradient(tall)
    order, inverse_order = _leverage_order(tall, leverage)
    sorted_rows = jnp.take_along_axis(tall, order[..., None], axis=-2)
    q = jnp.linalg.qr(sorted_rows, mode="complete")[0]
    return jnp.take_along_axis(q, inverse_order[..., None], axis=-2)[..., tall.shape[-1] :]


_complete_complement.__doc__ += _LEVERAGE_ORDER_NOTE


def _complement_diagonal(tall: jax.Array, basis: jax.Array) -> jax.Array:
    """``diag(I - Q Q^T)`` (..., n) for ``tall = Q R`` (..., n, a), accurate to a few
    ulps times its componentwise condition number, and differentiable (to any order) with
    the same accuracy. O(n a^3) time, O(n a^2) memory.

    ``1 - h_i`` (``h_i = ||Q_i||^2``) loses digits only where ``h_i`` is near 1, and at
    most m - 1 rows have ``h_i > 1/2`` for m = min(2a, n) (the ``h_i`` sum to a); every
    other ``1 - h_i`` is at least 1/2, hence accurate. For the m rows of largest leverage
    the leave-one-out identity ``1 - h_i = 1 / (1 + ||R_(i)^{-T} m_i||^2)`` is used
    instead, with ``m_i`` the row and ``R_(i)`` the R factor of ``tall`` without it (a
    row-sorted QR each): no difference is taken, and where the row is nearly fixed the
    norm is large and as accurate as that factorisation. (The rows of the complete
    orthogonal factor are not: where a pivot row dominates its column, Householder QR
    leaves them an absolute, not relative, error of eps, measured as 3000 ulps of a
    variance in float32.) A row that the others cannot reach at all (a coordinate the
    constraint fixes exactly: ``R_(i)`` singular) gets exactly 0, with zero derivative.
    """
    n, a = tall.shape[-2:]
    m = min(2 * a, n)
    leverage = jnp.sum(jnp.square(basis), -1)
    # A sort, not lax.top_k: XLA's SPMD partitioner splits a sort along its other (batch)
    # axes, while top_k all-gathers a batch-sharded operand (tests/multi_device_jax_check.py).
    special = jnp.argsort(-jax.lax.stop_gradient(leverage), axis=-1, stable=True)[..., :m]
    others = jnp.arange(n) != special[..., None]  # (..., m, n)
    left_out = tall[..., None, :, :] * others[..., None]  # row i zeroed, (..., m, n, a)
    r_fixed = _row_sorted_qr(jax.lax.stop_gradient(left_out))[1]
    singular = jnp.any(jnp.diagonal(r_fixed, axis1=-2, axis2=-1) == 0, -1)
    # A singular factor has no derivative (it divides by the zero): factorise the whole
    # matrix there instead, and discard the result.
    left_out = jnp.where(singular[..., None, None], tall[..., None, :, :], left_out)
    r_factor = _row_sorted_qr(_after(left_out, r_fixed))[1]  # (..., m, a, a)
    rows = jnp.take_along_axis(tall, special[..., None], axis=-2)  # (..., m, a)
    solved = jax.scipy.linalg.solve_triangular(
        jnp.swapaxes(r_factor, -1, -2), rows[..., None], lower=True
    )[..., 0]
    values = jnp.where(singular, 0.0, 1 / (1 + jnp.sum(jnp.square(solved), -1)))
    positions = jnp.arange(n)[:, None] == special[..., None, :]  # (..., n, m)
    return jnp.where(
        jnp.any(positions, -1),
        jnp.sum(jnp.where(positions, values[..., None, :], 0), -1),
        1 - leverage,
    )


def _check_finite(name: str, array: jax.Array) -> None:
    # A traced value cannot be inspected; NumPyro's own distributions skip it likewise.
    if not_jax_tracer(array) and not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite, but it contains NaN or +-inf")


@jax.jit
def _factorise(A: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(Q1^T, R1^{-T}, R1)`` of the reduced QR ``A^T = Q1 R1`` (rows sorted by norm, see
    :func:`_row_sorted_qr`): O(n a^2), the one factorisation of ``A``."""
    q, r = _row_sorted_qr(jnp.swapaxes(A, -1, -2))
    r = _after(r, q)  # the solve below runs after the QR's last LAPACK call (see _after)
    # An explicit triangular inverse (a x a) is as accurate here as a substitution, and a
    # small matrix product broadcasts where a batched solve would not.
    identity = jnp.broadcast_to(jnp.eye(r.shape[-1], dtype=r.dtype), r.shape)
    r_inv_t = jnp.swapaxes(jax.scipy.linalg.solve_triangular(r, identity, lower=False), -1, -2)
    return jnp.swapaxes(q, -1, -2), r_inv_t, r


@jax.jit
def _null_basis(A: jax.Array) -> jax.Array:
    """An orthonormal basis of null(A), (..., n, n - a), from the complete QR of ``A^T``."""
    q = jnp.linalg.qr(jnp.swapaxes(A, -1, -2), mode="complete")[0]
    return q[..., :, A.shape[-2] :]


@jax.tree_util.register_pytree_node_class
class LinearConstraint:
    r"""The linear equalities ``A z = k``: ``A`` (..., a, n) of full row rank a <= n,
    validated and factorised once, for any number of right-hand sides ``k``.

    **Factorisation.** The reduced QR ``A^T = Q1 R1`` (Q1: n x a with orthonormal columns,
    R1: a x a upper triangular; Householder reflections on the rows sorted by norm). Then
    ``A A^T = R1^T R1``, ``A^T (A A^T)^{-1} = Q1 R1^{-T}`` and
    ``1/2 log det(A A^T) = sum log|R1_ii|``. Every use costs O(n a) per right-hand side;
    the orthonormal basis of null(A) (n x (n - a), for the bijection of AutoGuides and
    NUTS) is computed from a complete QR the first time it is needed (when ``A`` is
    concrete: also inside ``jit``, as a constant) and then kept.

    **Pytree.** The leaves are ``A`` and its factors (``Q1^T``, ``R1^{-T}``,
    ``1/2 log det(A A^T)``); ``rtol`` is static. A constraint passed to a jitted function,
    mapped by ``vmap`` or carried by ``lax.scan`` keeps its factorisation: nothing is
    recomputed.

    **Support tolerance.** A point ``z`` satisfies the constraint when, for every row j,
    ``|(A z - k)_j| <= rtol * (|A| |z| + |k|)_j`` (``|A| |z|`` is the product of the
    elementwise absolute values: the scale of the terms whose rounding makes up the
    residual). ``rtol`` defaults to ``max(1e-6, 64 eps)`` of the dtype: 1e-6 in float64,
    the tolerance of the frameworks' ``simplex`` constraints, so that values other tools
    compute on the subspace are accepted (a sample of
    ``scipy.stats.multivariate_normal(mean, covariance_matrix, allow_singular=True)``
    carries residuals of about ``sqrt(eps)`` = 1.5e-8); 64 eps = 7.6e-6 in float32, the
    rounding of the residual itself (see ``constrained_ppl.conditioning``). Data measured to
    a known relative precision coarser than that (a mass balance closing to 1e-5) needs
    ``rtol`` at least that precision.

    :param A: the constraint matrix, shape (..., a, n), real, finite, of full row rank.
    :param rtol: the relative tolerance of the support check (a positive number), or None
        for the default of the dtype of the values checked.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> from numpyro_constrained import LinearConstraint
    >>> c = LinearConstraint(jnp.array([[1.0, 1.0, 1.0]]))  # z1 + z2 + z3 = k
    >>> c.a, c.n
    (1, 3)
    >>> y = jnp.array([1.0, 2.0, 3.0])
    >>> np.round(c.residual(y), 4).tolist()  # A y - k, with k = 0 by default
    [6.0]
    >>> bool(jnp.allclose(c.project(y, k=3.0), jnp.array([0.0, 1.0, 2.0]), atol=1e-5))
    True
    >>> d = c.normal(jnp.zeros((2, 3)), jnp.ones(3), k=jnp.array([[1.0], [2.0]]))
    >>> d.batch_shape, bool(jnp.allclose(d.mean.sum(-1), jnp.array([1.0, 2.0]), atol=1e-5))
    ((2,), True)
    """

    def __init__(self, A: jax.Array, *, rtol: float | None = None):
        with jax.ensure_compile_time_eval():
            A = jnp.asarray(A)
            if not jnp.issubdtype(A.dtype, jnp.floating):
                if not (jnp.issubdtype(A.dtype, jnp.integer) or A.dtype == jnp.bool_):
                    raise ValueError(f"A must be a real array, got dtype {A.dtype}")
                A = A.astype(jnp.result_type(float))
        self._setup(A, _check_rtol(rtol), validate=True)

    @classmethod
    def _build(cls, A: jax.Array, rtol: float | None, validate: bool) -> LinearConstraint:
        """A constraint from a float array ``A``, checked only when ``validate``: how
        :class:`LinearConstrainedNormal` builds one for its ``A=`` argument."""
        constraint = cls.__new__(cls)
        constraint._setup(A, rtol, validate)
        return constraint

    @classmethod
    def _from_parts(cls, A, basis_t, r_inv_t, log_det_half, rtol) -> LinearConstraint:
        """A constraint from its leaves (no computation)."""
        constraint = cls.__new__(cls)
        constraint.A = A
        constraint._basis_t = basis_t
        constraint._r_inv_t = r_inv_t
        constraint._log_det_half = log_det_half
        constraint._rtol = rtol
        return constraint

    def _setup(self, A: jax.Array, rtol: float | None, validate: bool) -> None:
        if A.ndim < 2:
            raise ValueError(f"A must have shape (..., a, n), got {A.shape}")
        num_rows, n = A.shape[-2:]
        if not 1 <= num_rows <= n:
            raise ValueError(
                f"A must have between 1 and n = {n} rows (full row rank a <= n), got {num_rows}"
            )
        # A constant (also one closed over inside jit) is factorised eagerly, so that a
        # jitted function sees its factors as constants; a tracer is factorised traced.
        with jax.ensure_compile_time_eval():
            if validate:
                _check_finite("A", A)
            basis_t, r_inv_t, r = _factorise(A)
            self.A = A
            self._rtol = rtol
            self._basis_t = basis_t
            self._r_inv_t = r_inv_t
            self._log_det_half = jnp.sum(jnp.log(jnp.abs(jnp.diagonal(r, axis1=-2, axis2=-1))), -1)
            if validate and not_jax_tracer(r):
                # R1 has the singular values of A (a x a: no n-sized SVD); they are judged
                # with A's rows scaled to unit length (see constrained_ppl.conditioning).
                check_full_row_rank(np.asarray(r), n, float(np.finfo(A.dtype).eps))

    def tree_flatten(self):
        return (self.A, self._basis_t, self._r_inv_t, self._log_det_half), self._rtol

    @classmethod
    def tree_unflatten(cls, rtol, children) -> LinearConstraint:
        return cls._from_parts(*children, rtol)

    def _replace(self, *, rtol: float | None = None, dtype=None) -> LinearConstraint:
        """A copy sharing the factorisation, with another ``rtol`` or dtype (O(n a))."""
        leaves = (self.A, self._basis_t, self._r_inv_t, self._log_det_half)
        if dtype is not None:
            leaves = tuple(jnp.asarray(leaf).astype(dtype) for leaf in leaves)
        new = LinearConstraint._from_parts(*leaves, self._rtol if rtol is None else rtol)
        cached = self.__dict__.get("_null_basis_cache")
        if cached is not None:
            new._null_basis_cache = cached if dtype is None else cached.astype(dtype)
        return new

    @property
    def n(self) -> int:
        """The dimension of ``z``."""
        return self.A.shape[-1]

    @property
    def a(self) -> int:
        """The number of equalities (rows of ``A``)."""
        return self.A.shape[-2]

    @property
    def rtol(self) -> float:
        """The relative tolerance in force for values of ``A``'s dtype."""
        return default_rtol(self.A.dtype) if self._rtol is None else self._rtol

    def _rtol_for(self, dtype) -> float:
        """The tolerance for a value of ``dtype``: the default is that of the less precise
        of the value's and ``A``'s dtypes (a float32 value is on a float64 subspace only to
        float32 precision); a given ``rtol`` is used as given."""
        if self._rtol is not None:
            return self._rtol
        return max(default_rtol(dtype), default_rtol(self.A.dtype))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(a={self.a}, n={self.n}, rtol={self.rtol:.3g})"

    def _k_like(self, k, reference: jax.Array) -> jax.Array:
        dtype = jnp.result_type(self.A.dtype, reference.dtype)
        if k is None:
            return jnp.zeros(self.a, dtype=dtype)
        k = jnp.asarray(k)
        if not (jnp.issubdtype(k.dtype, jnp.floating) or jnp.issubdtype(k.dtype, jnp.integer)):
            raise ValueError(f"k must be a real array, got dtype {k.dtype}")
        k = k.astype(dtype)
        if k.ndim == 0:
            k = k[None]
        if k.shape[-1] not in (1, self.a):
            raise ValueError(
                f"k must have shape (..., a) with a = {self.a} (the rows of A), or a last "
                f"dimension of 1, got {tuple(k.shape)}"
            )
        return jnp.broadcast_to(k, k.shape[:-1] + (self.a,))

    def _as_points(self, z, name: str) -> jax.Array:
        z = jnp.asarray(z)
        if not jnp.issubdtype(z.dtype, jnp.floating):
            z = z.astype(self.A.dtype)
        if z.ndim < 1 or z.shape[-1] != self.n:
            raise ValueError(f"{name} must have shape (..., {self.n}), got {tuple(z.shape)}")
        return z

    def _correct(self, z: jax.Array, k: jax.Array) -> jax.Array:
        """``z - A^T (A A^T)^{-1} (A z - k) = z - Q1 R1^{-T} (A z - k)``: the Euclidean
        projection of ``z`` onto ``{A z = k}``, O(n a) per point."""
        return _correct(z, k, self.A, self._basis_t, self._r_inv_t)

    def residual(self, z: jax.Array, k: jax.Array | float | None = None) -> jax.Array:
        """``A z - k``, shape (..., a): what is left of each equality (for reporting
        violations). ``k`` defaults to zeros and broadcasts with ``z``'s batch."""
        z = self._as_points(z, "z")
        return _rows_times(self.A, z) - self._k_like(k, z)

    def project(self, y: jax.Array, k: jax.Array | float | None = None) -> jax.Array:
        """The Euclidean projection ``argmin_{A z = k} ||z - y||`` of each ``y`` (..., n):
        ``y - A^T (A A^T)^{-1} (A y - k)``, computed as ``y - Q1 R1^{-T} (A y - k)`` and
        repeated once (iterative refinement: the second step removes what rounding left of
        the residual, so the result satisfies the support tolerance). O(n a) per point;
        differentiable in ``y`` and ``k``."""
        y = self._as_points(y, "y")
        k = self._k_like(k, y)
        return self._correct(self._correct(y, k), k)

    def _offset(self, k: jax.Array) -> jax.Array:
        """The point of ``{A z = k}`` nearest the origin, ``Q1 R1^{-T} k`` (refined)."""
        z0 = _combine_rows(_rows_times(self._r_inv_t, k), self._basis_t)
        return self._correct(z0, k)

    @property
    def _null_basis(self) -> jax.Array:
        """An orthonormal basis of null(A), (..., n, n - a). O(n^2 a) the first time, then
        kept when ``A`` is concrete (AutoGuides build the bijection at every step)."""
        cached = self.__dict__.get("_null_basis_cache")
        if cached is not None:
            return cached
        with jax.ensure_compile_time_eval():
            basis = _null_basis(self.A)
        if not_jax_tracer(basis):
            self._null_basis_cache = basis
        return basis

    def _check(self, z: jax.Array, k: jax.Array) -> jax.Array:
        """Whether each point ``z`` satisfies ``A z = k`` to the tolerance (see the class)."""
        z = jnp.asarray(z)
        dtype = z.dtype if jnp.issubdtype(z.dtype, jnp.floating) else self.A.dtype
        return _within_tolerance(z, k, self.A, self._rtol_for(dtype))

    def _out_of_support_message(self, z: jax.Array, k: jax.Array) -> str:
        """What a value off the subspace violates, and how to loosen the check."""
        z = np.asarray(z)
        if not np.issubdtype(z.dtype, np.floating):
            z = z.astype(self.A.dtype)
        not_finite = int(np.sum(np.any(~np.isfinite(z), axis=-1)))
        if not_finite:  # their residuals and bounds are NaN: nothing to compare
            return f"{not_finite} value(s) have NaN or infinite entries."
        A, k = np.asarray(self.A), np.asarray(k)
        residual = np.abs(np.einsum("...ij,...j->...i", A, z) - k)
        bound = np.einsum("...ij,...j->...i", np.abs(A), np.abs(z)) + np.abs(k)
        rtol = self._rtol_for(z.dtype)
        residual, bound = np.broadcast_arrays(residual, bound)
        ratio = residual / np.maximum(bound, np.finfo(bound.dtype).tiny)
        worst = int(np.argmax(ratio))
        failing = int(np.sum(np.any(residual > rtol * bound, axis=-1)))
        return (
            f"{failing} value(s) do not satisfy A z = k to the tolerance "
            f"|A z - k| <= rtol * (|A| |z| + |k|) per row: the largest violation is a "
            f"residual of {residual.flat[worst]:.3g} against a bound (|A| |z| + |k|) of "
            f"{bound.flat[worst]:.3g}, a relative residual of {ratio.flat[worst]:.3g}, with "
            f"rtol = {rtol:.3g} in force. If the values are right to a known relative "
            f"precision (measured data), pass rtol= that precision to LinearConstraint or "
            f"LinearConstrainedNormal (for example rtol={max(ratio.max() * 2, rtol):.1g}); "
            f"otherwise project them first with LinearConstraint.project."
        )

    def normal(
        self,
        loc: jax.Array,
        scale: jax.Array | None = None,
        *,
        covariance_matrix: jax.Array | None = None,
        scale_tril: jax.Array | None = None,
        k: jax.Array | float | None = None,
        grad_estimator: str = "marginal_expectation",
        validate_args: bool | None = None,
    ):
        """``LinearConstrainedNormal(loc, ..., constraint=self, k=k)``: ``N(loc, Sigma)``
        conditioned on ``A z = k``, reusing this factorisation of ``A`` (per call
        O(B n a^2) for a batch of B scales, O(B n a) when the scale is shared)."""
        from numpyro_constrained.linear_constrained_normal import LinearConstrainedNormal

        return LinearConstrainedNormal(
            loc,
            scale,
            covariance_matrix=covariance_matrix,
            scale_tril=scale_tril,
            constraint=self,
            k=k,
            grad_estimator=grad_estimator,
            validate_args=validate_args,
        )


@jax.jit
def _correct(z, k, A, basis_t, r_inv_t):
    coefficients = _rows_times(r_inv_t, _rows_times(A, z) - k)
    return z - _combine_rows(coefficients, basis_t)


def _within_tolerance(z: jax.Array, k: jax.Array, A: jax.Array, rtol) -> jax.Array:
    """``all_j |(A z - k)_j| <= rtol (|A| |z| + |k|)_j`` for each point (traceable)."""
    if not jnp.issubdtype(z.dtype, jnp.floating):
        z = z.astype(A.dtype)
    residual = _rows_times(A, z) - k
    bound = _rows_times(jnp.abs(A), jnp.abs(z)) + jnp.abs(k)
    return jnp.all(jnp.abs(residual) <= rtol * bound, axis=-1)
