"""A Gaussian conditioned on linear equalities ``A z = k``.

The math: ``docs/distributions/linear_constrained_normal.md``.


Holds :class:`LinearConstrainedNormal`, its support constraint (the affine subspace
``{z : A z = k}``), the isometric bijection from ``R^(n - a)`` onto that subspace (registered
with ``biject_to`` so that AutoGuides and NUTS can use the distribution as a latent site),
its KL rule (registered with ``kl_divergence``) and its ``vmap_over`` and
``promote_batch_shape`` rules (used by ``jax.vmap`` with ``out_axes`` and by NumPyro's
``scan``).
"""

from __future__ import annotations

import copy
import math
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from jax import lax
from numpyro.distributions import Distribution, Normal, constraints
from numpyro.distributions.batch_util import promote_batch_shape, vmap_over
from numpyro.distributions.kl import kl_divergence
from numpyro.distributions.transforms import Transform, biject_to
from numpyro.util import not_jax_tracer

from constrained_ppl.arguments import check_value_shape, keyword_only
from constrained_ppl.conditioning import warn_if_unresolvable
from numpyro_constrained._batching import check_expand
from numpyro_constrained._compat import default_validate_args
from numpyro_constrained._repr import parameters_repr
from numpyro_constrained.linear_constraint import (
    LinearConstraint,
    _after,
    _check_finite,
    _check_rtol,
    _combine_rows,
    _complement_diagonal,
    _complete_complement,
    _row_sorted_qr,
    _rows_times,
    _within_tolerance,
)
from numpyro_constrained.validation import (
    OUT_OF_SUPPORT_MESSAGE,
    _stack_level_outside,
    as_concrete_where_possible,
    is_concrete,
)

GRAD_ESTIMATORS = ("marginal_expectation", "pathwise")


def _as_constraint(A, k: jax.Array) -> LinearConstraint:
    """``A`` itself when it is a :class:`LinearConstraint`, else one built (unchecked) from
    the matrix ``A`` in the dtype of its promotion with ``k``."""
    if isinstance(A, LinearConstraint):
        return A
    A = jnp.asarray(A)
    return LinearConstraint._build(A.astype(jnp.result_type(A, k)), None, validate=False)


def _min_norm_point_and_basis(A, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(z0, B)``: the point of ``{A z = k}`` nearest the origin, ``A^T (A A^T)^{-1} k``,
    and an orthonormal basis of null(A) (``A`` a matrix or a :class:`LinearConstraint`,
    whose cached factorisation is used)."""
    constraint = _as_constraint(A, k)
    return constraint._offset(k), constraint._null_basis


class AffineSubspace(constraints._Interval):
    """The affine subspace ``{z in R^n : A z = k}`` with ``A`` of shape (..., a, n), rank a.

    ``A`` is a :class:`LinearConstraint` (whose factorisation and ``rtol`` are used) or a
    matrix. A value passes when its residual is within the constraint's tolerance,
    ``|A z - k| <= rtol * (|A| |z| + |k|)`` per row (see :class:`LinearConstraint`).

    Why it derives from NumPyro's interval constraint: this support moves whenever ``A`` or
    ``k`` depends on another latent variable. NumPyro's MCMC maps its unconstrained draws
    back to sample sites with the transforms of the initial trace, unless it sees a support
    that may be dynamic, and it recognises one only as an interval (or lower-bounded)
    constraint whose bounds are not Python numbers
    (``numpyro.infer.util._transforms_from_trace``); it then replays the model for every
    draw. Posing as an interval with array bounds (``-inf``, ``+inf``: the coordinates
    themselves are unbounded) makes ``MCMC.get_samples()`` exact for such a site instead of
    silently returning points of the initial subspace. Every other behaviour of the interval
    class (``__call__``, ``feasible_like``, ``eq``, the pytree, ``biject_to``, whose registry
    is keyed by the exact class) is overridden here.
    """

    is_discrete = False
    event_dim = 1

    def __init__(self, A: LinearConstraint | jax.Array, k: jax.Array):
        self.constraint = _as_constraint(A, k)
        self.k = k

    @property
    def A(self) -> jax.Array:
        return self.constraint.A

    @property
    def lower_bound(self) -> jax.Array:
        return jnp.full(jnp.shape(self.k)[:-1], -jnp.inf)

    @property
    def upper_bound(self) -> jax.Array:
        return jnp.full(jnp.shape(self.k)[:-1], jnp.inf)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.constraint._check(x, self.k)

    def feasible_like(self, prototype: jax.Array) -> jax.Array:
        offset = self.constraint._offset(self.k)
        return jnp.broadcast_to(offset, jnp.shape(prototype)).astype(jnp.result_type(prototype))

    def tree_flatten(self):
        return (self.constraint, self.k), (("constraint", "k"), dict())

    def eq(self, other: object, static: bool = False):
        if not isinstance(other, AffineSubspace):
            return False
        if static:
            return self.A is other.A and self.k is other.k
        return jnp.array_equal(self.A, other.A) & jnp.array_equal(self.k, other.k)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(a={self.A.shape[-2]}, n={self.A.shape[-1]})"


class AffineSubspaceTransform(Transform):
    """The isometry ``u -> z0 + B u`` from ``R^(n - a)`` onto ``{z : A z = k}``.

    ``B`` (n x (n - a)) is an orthonormal basis of the null space of ``A`` (the last n - a
    columns of the complete QR factor of ``A^T``) and ``z0 = A^T (A A^T)^{-1} k`` is the point
    of the subspace nearest the origin. Because ``B`` has orthonormal columns the map
    preserves lengths, so its log-determinant with respect to the (n - a)-dimensional
    Lebesgue (Hausdorff) measure on the subspace, the base measure of
    :class:`LinearConstrainedNormal`, is 0. The inverse ``z -> B^T (z - z0)`` is the
    orthogonal projection, so it also maps a point near the subspace to the nearest one.

    The forward map ends with the Euclidean projection step of
    :meth:`LinearConstraint.project` (``z <- z - A^T (A A^T)^{-1} (A z - k)``, which is the
    identity in exact arithmetic), so its values satisfy the support tolerance in float32.

    Cost: ``B`` and the factorisation are those of the :class:`LinearConstraint` (given, or
    the distribution's): the O(n^2 a) QR for ``B`` runs once per constraint (as a constant
    when ``A`` is concrete, also inside ``jit``), not once per transform, so an AutoGuide
    that builds this transform at every step does not refactorise. Each call is
    O(n (n - a)) per point.
    """

    def __init__(self, A: LinearConstraint | jax.Array, k: jax.Array):
        self.constraint = _as_constraint(A, k)
        self.k = k
        self.offset = self.constraint._offset(k)
        self.basis = self.constraint._null_basis

    @property
    def A(self) -> jax.Array:
        return self.constraint.A

    @property
    def domain(self) -> constraints.Constraint:
        return constraints.real_vector

    @property
    def codomain(self) -> constraints.Constraint:
        return AffineSubspace(self.constraint, self.k)

    def __call__(self, u: jax.Array) -> jax.Array:
        return self.constraint._correct(self.offset + _rows_times(self.basis, u), self.k)

    def _inverse(self, z: jax.Array) -> jax.Array:
        return _combine_rows(z - self.offset, self.basis)

    def log_abs_det_jacobian(self, x: jax.Array, y: jax.Array, intermediates=None) -> jax.Array:
        shape = jnp.broadcast_shapes(jnp.shape(x)[:-1], jnp.shape(y)[:-1])
        return jnp.zeros(shape, dtype=jnp.result_type(y))

    def forward_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return jnp.broadcast_shapes(shape[:-1], self.offset.shape[:-1]) + self.basis.shape[-2:-1]

    def inverse_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return jnp.broadcast_shapes(shape[:-1], self.offset.shape[:-1]) + self.basis.shape[-1:]

    def tree_flatten(self):
        names = ("constraint", "k", "offset", "basis")
        return (self.constraint, self.k, self.offset, self.basis), (names, dict())

    def eq(self, other: object, static: bool = False):
        if not isinstance(other, AffineSubspaceTransform):
            return False
        return self.codomain.eq(other.codomain, static=static)


@biject_to.register(AffineSubspace)
def _transform_to_affine_subspace(constraint: AffineSubspace) -> AffineSubspaceTransform:
    return AffineSubspaceTransform(constraint.constraint, constraint.k)


def _float_array(value, name: str, dtype) -> jax.Array:
    array = jnp.asarray(value)
    if not (
        jnp.issubdtype(array.dtype, jnp.floating)
        or jnp.issubdtype(array.dtype, jnp.integer)
        or array.dtype == jnp.bool_
    ):
        raise ValueError(f"{name} must be a real array, got dtype {array.dtype}")
    return array.astype(dtype)


def _float_dtype(values):
    """The dtype of the parameters: JAX's promotion of the floating dtypes of the arrays
    among ``values`` (Python numbers and lists are weakly typed and do not take part), or
    the default float dtype when there are none."""
    dtypes = [
        value.dtype
        for value in values
        if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating)
    ]
    return jnp.result_type(*dtypes) if dtypes else jnp.result_type(float)


# The kernels below are jitted as a whole: besides fusing the O(n a) work, this compiles one
# program per shape instead of dispatching dozens of small eager operations.


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
    return jnp.swapaxes(factor, -1, -2) @ jnp.swapaxes(A, -1, -2)


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
    coefficients = r_inv_t @ (jnp.swapaxes(whitened_t - fixed, -1, -2) @ complement)
    moved = complement - jnp.swapaxes(basis_t, -1, -2) @ coefficients
    crossed = coefficients @ jnp.swapaxes(moved, -1, -2)
    if diagonal:
        return factor[..., :, None] * moved, crossed * factor[..., None, :]
    return factor @ moved, crossed @ jnp.swapaxes(factor, -1, -2)


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


@jax.jit
def _check_arguments(arguments: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Whether each argument satisfies its ``arg_constraints`` entry (all events)."""
    return {
        name: jnp.all(LinearConstrainedNormal.arg_constraints[name](value))
        for name, value in arguments.items()
    }


def _concrete(value):
    """``value`` where it is concrete, else None: a check on values runs only on concrete
    arrays (NumPyro's rule; a tracer cannot be inspected)."""
    return value if not_jax_tracer(value) else None


# The number of trailing event dimensions of each pytree leaf of LinearConstrainedNormal
# (``_factor`` is a vector of scales or a Cholesky factor, see ``_event_ndims``).
_LEAF_EVENT_NDIMS = {
    "loc": 1,
    "A": 2,
    "k": 1,
    "_basis_t": 2,
    "_r_inv_t": 2,
    "_prior_variance": 1,
    "_log_normalizer": 0,
    "_constraint_basis_t": 2,
    "_constraint_r_inv_t": 2,
    "_constraint_log_det_half": 0,
}


class LinearConstrainedNormal(Distribution):
    r"""A multivariate normal ``N(loc, Sigma)`` conditioned on the linear equalities ``A z = k``.

    With ``S = A Sigma A^T`` and ``K = Sigma A^T S^{-1}`` the conditional distribution is the
    degenerate Gaussian with mean ``mu_bar = loc + K (k - A loc)`` and covariance
    ``Sigma_bar = Sigma - K A Sigma`` (rank n - a), supported on the affine subspace
    ``{z : A z = k}``.

    **Method: whitened QR, S is never formed.** With ``Sigma = L L^T`` (``L = diag(scale)``
    or ``scale_tril``) and the reduced QR factorisation ``(A L)^T = Q R`` (Q: n x a with
    orthonormal columns, R: a x a upper triangular; rows sorted by norm before the Householder
    reflections, see :func:`_row_sorted_qr`), ``S = R^T R`` and
    ``K = L Q R^{-T}``. In whitened coordinates ``w = L^{-1} (z - loc)`` the constraint reads
    ``R^T Q^T w = k - A loc``, so conditioning is an orthogonal projection:
    ``Sigma_bar = L (I - Q Q^T) L^T`` and a sample is ``z = mu_bar + L (I - Q Q^T) eps``
    (Matheron's rule). Because ``S`` is not formed, the conditioning that matters is that of
    ``A L`` (the square root of that of ``S``). Every mean and sample ends with one step of
    iterative refinement, ``z <- z + K (k - A z)``, with ``k - A z`` evaluated in the
    working precision: it changes ``z`` by rounding error only, and brings the residual to a
    few ulps relative to ``|A| |z| + |k|`` even for scales spanning 12 orders of magnitude.
    ``log det S = 2 sum log|R_ii|`` and ``log det(A A^T) = 2 sum log|R'_ii|`` with
    ``A^T = Q' R'``.

    **Base measure.** :meth:`log_prob` is the density with respect to the (n - a)-dimensional
    Lebesgue (Hausdorff) measure on the subspace:
    ``log p(z) = log N(z; loc, Sigma) - log N(k; A loc, S) - 1/2 log det(A A^T)`` for
    ``A z = k``. This equals
    ``scipy.stats.multivariate_normal(mu_bar, Sigma_bar, allow_singular=True).logpdf(z)``, and
    for ``loc = 0``, ``Sigma = s^2 I`` and the default zero-sum constraint it equals
    ``numpyro.distributions.ZeroSumNormal(s, event_shape=(n,))``. It does not depend on a
    choice of coordinates. "On the subspace" means within the support tolerance,
    ``|A z - k| <= rtol * (|A| |z| + |k|)`` per row (``rtol`` default 64 eps; see
    :class:`LinearConstraint`). A value off the subspace gets ``-inf``; with validation on it
    also emits NumPyro's own "Out-of-support values" ``UserWarning``, as NumPyro's
    distributions do (when the value and the parameters are concrete; a tracer cannot be
    inspected), followed by the largest residual, its bound, the ``rtol`` in force and how
    to loosen it. A
    value whose shape does not end in ``(n,)`` or whose leading dimensions do not broadcast
    with the batch shape is a ``ValueError`` naming the expected shape. A value of another
    float dtype than the parameters is promoted (``jnp.result_type``), and so is the result.

    **Sampling** is exact, by Matheron's rule in whitened form (above). :meth:`sample`
    returns this sample carrying the gradient chosen by ``grad_estimator``:
    ``"marginal_expectation"`` (default): straight-through through the conditional mean,
    ``stop_gradient(z) + (mu_bar - stop_gradient(mu_bar))`` (biased, low variance);
    ``"pathwise"``: the gradient of the Matheron sample itself (exact reparameterisation,
    unbiased; the refinement step adds ``K (k - A z)``, which vanishes identically in exact
    arithmetic, so it adds nothing to the gradient either). Either way ``jax.grad`` through
    a sample works.

    **Validation** (``validate_args``, as NumPyro's default): NaN or +-inf in any parameter,
    a non-positive scale, a covariance that is not positive definite, an ``A`` that is
    rank-deficient or has a >= n rows, and shapes that do not fit raise ``ValueError``
    naming the argument. As in NumPyro's own ``validate_args``, the checks on values run
    under ``jax.ensure_compile_time_eval()`` on concrete parameters only: constants closed
    over inside ``jit`` or ``vmap`` are still checked, tracers are skipped (shapes always
    are checked). Parameters of different float dtypes are promoted together.

    **Pytree.** The leaves are the parameters (``loc``, the factor of Sigma, ``A``, ``k``) and
    the quantities precomputed from them, all set by ``__init__``: the tree structure is the
    same before and after any method call, so a distribution can be a ``jit`` argument or a
    ``lax.scan`` carry. ``scale`` and ``scale_tril`` are computed from the stored factor on
    each access; the conditional mean on first use (kept when concrete, not a leaf), since
    ``log_prob`` does not need it. ``arg_constraints`` describe the constructor's
    arguments; the property :attr:`covariance_matrix` is the conditional covariance (rank
    n - a), not the argument.

    **Cost.** With a diagonal covariance (``scale``) construction is O(n a^2 + a^3) and every
    call O(n a); no n x n matrix is formed except by :attr:`covariance_matrix`. With a full
    covariance the Cholesky factor costs O(n^3) once and each sample or log_prob O(n^2).

    :param loc: the unconditional mean, shape (..., n).
    :param scale: unconditional standard deviations (diagonal covariance), shape (..., n).
    :param covariance_matrix: unconditional covariance, shape (..., n, n).
    :param scale_tril: lower Cholesky factor of the unconditional covariance, (..., n, n).
        Exactly one of ``scale`` / ``covariance_matrix`` / ``scale_tril`` is given.
    :param A: constraint matrix of shape (..., a, n) with rank a < n; default one row of ones.
        Validated and factorised once per distribution; to do that once for many
        distributions (a regression head, a model step), pass ``constraint`` instead.
    :param k: right-hand side of shape (..., a), real; a scalar or a last dimension of 1 is
        broadcast to all a rows; its leading dimensions broadcast with the other parameters'
        batch shapes. Default zeros (with the default ``A``: the zero-sum constraint).
    :param constraint: a :class:`LinearConstraint` (``A`` validated and factorised once),
        instead of ``A``; giving both is a ``ValueError``. Construction then costs
        O(n a^2) for the whitened factorisation of the scale (once per distinct scale) plus
        O(B n a) for a batch of B right-hand sides, and no work on ``A`` alone.
    :param rtol: the relative tolerance of the support check,
        ``|A z - k| <= rtol * (|A| |z| + |k|)`` per row; default the constraint's, itself
        by default 64 eps of the dtype (see :class:`LinearConstraint`). Set it to the
        precision of measured data that satisfies its balances only to that precision.
    :param grad_estimator: ``"marginal_expectation"`` or ``"pathwise"``.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> from numpyro_constrained import LinearConstrainedNormal
    >>> d = LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), k=1.0)  # z1 + z2 + z3 = 1
    >>> d
    LinearConstrainedNormal(loc: (3,), scale: (3,), A: (1, 3), k: 1.0)
    >>> np.round(d.mean, 4).tolist()
    [0.3333, 0.3333, 0.3333]
    >>> z = d.sample(jax.random.PRNGKey(0), (2,))  # exact draws on the plane
    >>> z.shape, bool(jnp.allclose(z.sum(-1), 1.0, atol=1e-5))
    ((2, 3), True)
    >>> A = jnp.array([[1.0, 1.0, 0.0], [0.0, 1.0, -1.0]])  # two equalities
    >>> d2 = LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), A=A, k=jnp.array([1.0, 0.0]))
    >>> bool(jnp.allclose(A @ d2.mean, jnp.array([1.0, 0.0]), atol=1e-5))
    True
    >>> int(jnp.linalg.matrix_rank(d2.covariance_matrix))  # n - a = 1
    1
    """

    arg_constraints = {
        "loc": constraints.real_vector,
        "scale": constraints.independent(constraints.positive, 1),
        "covariance_matrix": constraints.positive_definite,
        "scale_tril": constraints.lower_cholesky,
        "A": constraints.independent(constraints.real, 2),
        "k": constraints.real_vector,
    }
    # Samples are differentiable in every parameter (through the conditional mean, or the
    # whole Matheron sample with the pathwise estimator).
    reparametrized_params = list(arg_constraints)
    has_rsample = True
    # Only arrays that __init__ (and expand, tree_unflatten) always sets: no lazy cache whose
    # presence would change the tree structure once computed (Distribution.tree_flatten reads
    # self.__dict__). ``_factor`` is ``scale`` (diagonal) or ``scale_tril``.
    pytree_data_fields = (
        "loc",
        "_factor",
        "A",
        "k",
        "_basis_t",
        "_r_inv_t",
        "_prior_variance",
        "_log_normalizer",
        # The factorisation of A (its LinearConstraint's leaves), so that a distribution
        # rebuilt from its leaves (jit, vmap, scan) can hand its constraint on (support,
        # project) without refactorising A.
        "_constraint_basis_t",
        "_constraint_r_inv_t",
        "_constraint_log_det_half",
    )
    # ``_leaf_batch_ndims``: the number of batch dimensions of each data field as built
    # (static, from shapes only), so that promote_batch_shape can tell the axes that scan or
    # vmap stacked in front of a leaf from the leaf's own batch dimensions.
    pytree_aux_fields = ("grad_estimator", "_diagonal", "_leaf_batch_ndims", "_rtol")

    @keyword_only("A", "k", usage="LinearConstrainedNormal(loc, scale, A=A, k=k)")
    def __init__(
        self,
        loc: jax.Array,
        scale: jax.Array | None = None,
        *,
        covariance_matrix: jax.Array | None = None,
        scale_tril: jax.Array | None = None,
        A: jax.Array | None = None,
        k: jax.Array | float | None = None,
        constraint: LinearConstraint | None = None,
        rtol: float | None = None,
        grad_estimator: str = "marginal_expectation",
        validate_args: bool | None = None,
    ):
        validate = default_validate_args() if validate_args is None else validate_args
        if grad_estimator not in GRAD_ESTIMATORS:
            raise ValueError(
                f"grad_estimator must be one of {GRAD_ESTIMATORS}, got {grad_estimator!r}"
            )
        if sum(p is not None for p in (scale, covariance_matrix, scale_tril)) != 1:
            raise ValueError("exactly one of scale, covariance_matrix or scale_tril must be given")
        # As NumPyro's validate_args: under compile-time evaluation, arrays closed over inside
        # jit stay concrete through the conversions below and their values get checked;
        # tracers are converted (and staged) as usual and only their shapes are checked.
        if constraint is not None:
            if A is not None:
                raise ValueError(
                    "give the constraint either as A or as constraint (a LinearConstraint), "
                    "not both"
                )
            if not isinstance(constraint, LinearConstraint):
                raise ValueError(
                    f"constraint must be a LinearConstraint, got {type(constraint).__name__}"
                )
        rtol = _check_rtol(rtol)
        with jax.ensure_compile_time_eval():
            loc, factor, A, k, batch_shape = self._arguments(
                loc, scale, covariance_matrix, scale_tril, A, k, validate, constraint
            )
        n = loc.shape[-1]
        # Kept at its own shape, as A, k and the factor are: a leaf broadcast to the batch
        # shape would keep, inside a vmap over another parameter, the axis mapped away
        # (``vmap_over(d, scale=0)`` then gave one row of log-densities per element).
        self.loc = loc
        self._factor = factor
        self._diagonal = scale is not None
        if constraint is None:
            # Validated (rank included, where A is concrete) and factorised here, once per
            # distribution; a LinearConstraint given instead was validated and factorised
            # once for all.
            constraint = LinearConstraint._build(A, rtol, validate)
        else:
            if constraint.A.dtype != A.dtype:
                if jnp.finfo(A.dtype).eps < jnp.finfo(constraint.A.dtype).eps:
                    # Factors rounded to a coarser dtype would cap the accuracy of the
                    # result at that dtype's: refactorise in the finer one.
                    constraint = LinearConstraint._build(A, constraint._rtol, False)
                else:
                    constraint = constraint._replace(dtype=A.dtype)
            if rtol is not None:
                constraint = constraint._replace(rtol=rtol)
        self._constraint_object = constraint
        self.A = constraint.A
        self._constraint_basis_t = constraint._basis_t
        self._constraint_r_inv_t = constraint._r_inv_t
        self._constraint_log_det_half = constraint._log_det_half
        self._rtol = constraint._rtol
        self.k = k
        self.grad_estimator = grad_estimator
        super().__init__(batch_shape, (n,), validate_args=validate_args)
        cached = _precompute(factor, self.A, constraint._log_det_half, diagonal=self._diagonal)
        r_factor = cached.pop("r_factor")
        if validate and not_jax_tracer(r_factor):
            warn_if_unresolvable(
                np.asarray(r_factor),
                float(jnp.finfo(r_factor.dtype).eps),
                str(r_factor.dtype),
                (__file__, numpyro.__file__, jax.__file__),
            )
        for name, value in cached.items():
            setattr(self, name, value)
        self._leaf_batch_ndims = self._batch_ndims_of_leaves()

    @property
    def constraint(self) -> LinearConstraint:
        """The :class:`LinearConstraint` (validated and factorised ``A`` and ``rtol``);
        rebuilt from the pytree leaves, without refactorising, after jit / vmap / scan."""
        constraint = self.__dict__.get("_constraint_object")
        if constraint is None or constraint.A is not self.A:
            constraint = LinearConstraint._from_parts(
                self.A,
                self._constraint_basis_t,
                self._constraint_r_inv_t,
                self._constraint_log_det_half,
                self._rtol,
            )
            self.__dict__["_constraint_object"] = constraint
        return constraint

    @property
    def rtol(self) -> float:
        """The relative tolerance of the support check (see :class:`LinearConstraint`)."""
        return self.constraint.rtol

    @staticmethod
    def _arguments(
        loc,
        scale,
        covariance_matrix,
        scale_tril,
        A,
        k,
        validate: bool,
        constraint: LinearConstraint | None = None,
    ):
        """``(loc, factor, A, k, batch_shape)`` from the constructor's arguments, converted
        to one float dtype and checked (shapes always, values where concrete)."""
        matrix_a = constraint.A if constraint is not None else A
        dtype = _float_dtype((loc, scale, covariance_matrix, scale_tril, matrix_a, k))
        loc = _float_array(loc, "loc", dtype)
        if loc.ndim < 1:
            raise ValueError(f"loc must have at least one dimension (the event), got {loc.shape}")
        if validate:
            _check_finite("loc", loc)
        n = loc.shape[-1]

        if scale is not None:
            scale = _float_array(scale, "scale", dtype)
            if scale.ndim == 0:
                scale = scale[None]
            if scale.shape[-1] not in (1, n):
                raise ValueError(f"scale must have last dimension {n} (or 1), got {scale.shape}")
            if validate:
                _check_finite("scale", scale)
            factor = jnp.broadcast_to(scale, scale.shape[:-1] + (n,))
            factor_batch_shape = factor.shape[:-1]
        else:
            name = "covariance_matrix" if covariance_matrix is not None else "scale_tril"
            matrix = covariance_matrix if covariance_matrix is not None else scale_tril
            matrix = _float_array(matrix, name, dtype)
            if matrix.ndim < 2 or matrix.shape[-2:] != (n, n):
                raise ValueError(f"{name} must have shape (..., {n}, {n}), got {matrix.shape}")
            if validate:
                _check_finite(name, matrix)
            if covariance_matrix is not None:
                # A tracer gives a traced answer: checked only where concrete.
                positive_definite = _concrete(constraints.positive_definite(matrix))
                if validate and positive_definite is not None and not np.all(positive_definite):
                    raise ValueError("covariance_matrix must be symmetric positive definite")
                factor = jnp.linalg.cholesky(matrix)
            else:
                factor = matrix
            factor_batch_shape = factor.shape[:-2]

        if constraint is not None:
            A = constraint.A if constraint.A.dtype == dtype else constraint.A.astype(dtype)
            if A.shape[-1] != n:
                raise ValueError(
                    f"the constraint has n = {A.shape[-1]} columns, but loc has size {n}"
                )
        elif A is None:
            A = jnp.ones((1, n), dtype=dtype)
        else:
            A = _float_array(A, "A", dtype)
            if A.ndim < 2:
                raise ValueError(f"A must have shape (..., a, n), got {A.shape}")
            if A.shape[-1] != n:
                raise ValueError(
                    f"A must have n = {n} columns (the size of loc), got shape {A.shape}"
                )
            if validate:
                _check_finite("A", A)
        num_rows = A.shape[-2]
        if not 1 <= num_rows < n:
            raise ValueError(
                f"A must have between 1 and n - 1 = {n - 1} rows (rank a < n), got {num_rows}"
            )
        if k is None:
            k = jnp.zeros(num_rows, dtype=dtype)
        else:
            k = _float_array(k, "k", dtype)
            # A real right-hand side broadcasts as NumPy does: a scalar or a last dimension
            # of 1 gives every row the same value.
            if k.ndim == 0:
                k = k[None]
            if k.shape[-1] not in (1, num_rows):
                raise ValueError(
                    f"k must have shape (..., a) with a = {num_rows} (the rows of A), or a "
                    f"last dimension of 1, got {tuple(k.shape)}"
                )
            if validate:
                _check_finite("k", k)
            k = jnp.broadcast_to(k, k.shape[:-1] + (num_rows,))

        batch_shapes = {
            "loc": loc.shape[:-1],
            "scale" if scale is not None else "scale_tril": factor_batch_shape,
            "A": A.shape[:-2],
            "k": k.shape[:-1],
        }
        try:
            batch_shape = jnp.broadcast_shapes(*batch_shapes.values())
        except ValueError:
            shapes = ", ".join(f"{name} {shape}" for name, shape in batch_shapes.items())
            raise ValueError(
                f"the batch shapes of the parameters do not broadcast: {shapes}"
            ) from None
        return loc, factor, A, k, tuple(batch_shape)

    def _event_ndims(self, name: str) -> int:
        if name == "_factor":
            return 1 if self._diagonal else 2
        return _LEAF_EVENT_NDIMS[name]

    def _batch_ndims_of_leaves(self) -> tuple[int, ...]:
        return tuple(
            jnp.ndim(self.__dict__[name]) - self._event_ndims(name)
            for name in self.pytree_data_fields
        )

    def get_args(self) -> dict[str, jax.Array]:
        """The parameters as held: ``loc``, ``scale`` or ``scale_tril`` (a covariance_matrix
        argument is held as its Cholesky factor and checked at construction), ``A``, ``k``."""
        factor_name = "scale" if self._diagonal else "scale_tril"
        return {"loc": self.loc, factor_name: self._factor, "A": self.A, "k": self.k}

    def validate_args(self, strict: bool = True) -> None:
        """NumPyro's argument check, with every constraint evaluated in one jitted call.

        Same messages and the same rule for tracers as the base class (it runs under
        ``jax.ensure_compile_time_eval()``, so constants closed over inside ``jit`` are
        checked, and tracers are skipped, or raise ``RuntimeError`` when ``strict``); one
        compiled program per parameter shape instead of a dozen small eager operations,
        which dominate the cost of a new shape on CPU.
        """
        with jax.ensure_compile_time_eval():
            arguments = self.get_args()
            concrete = {name: value for name, value in arguments.items() if not_jax_tracer(value)}
            if strict and len(concrete) < len(arguments):
                raise RuntimeError("Cannot validate arguments inside jitted code.")
            valid = _check_arguments(concrete) if concrete else {}
            for name, is_valid in valid.items():
                if not np.all(np.asarray(is_valid)):
                    raise ValueError(
                        f"{type(self).__name__} distribution got invalid {name} parameter."
                    )

    @property
    def scale_tril(self) -> jax.Array:
        """Lower Cholesky factor of the unconditional covariance Sigma (n x n); formed on
        each access when the covariance is diagonal."""
        if not self._diagonal:
            return self._factor
        return self._factor[..., :, None] * jnp.eye(
            self._factor.shape[-1], dtype=self._factor.dtype
        )

    @property
    def scale(self) -> jax.Array:
        """Unconditional standard deviations, sqrt(diag Sigma)."""
        return self._factor if self._diagonal else jnp.sqrt(self._prior_variance)

    @classmethod
    def infer_shapes(
        cls, loc, scale=None, covariance_matrix=None, scale_tril=None, A=None, k=None, **kwargs
    ):
        batch_shapes = [loc[:-1]]
        if scale is not None:
            batch_shapes.append(scale[:-1])
        for matrix in (covariance_matrix, scale_tril, A):
            if matrix is not None:
                batch_shapes.append(matrix[:-2])
        if k is not None:
            batch_shapes.append(k[:-1])
        return jnp.broadcast_shapes(*batch_shapes), tuple(loc[-1:])

    def expand(self, batch_shape) -> LinearConstrainedNormal:
        batch_shape = tuple(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        check_expand(self.batch_shape, batch_shape)
        new = copy.copy(self)
        event = self.event_shape
        new.loc = jnp.broadcast_to(self.loc, batch_shape + event)
        if "_mean_cache" in self.__dict__:
            new._mean_cache = jnp.broadcast_to(self._mean_cache, batch_shape + event)
        new._log_normalizer = jnp.broadcast_to(self._log_normalizer, batch_shape)
        new._batch_shape = batch_shape
        new._leaf_batch_ndims = new._batch_ndims_of_leaves()
        return new

    @constraints.dependent_property(is_discrete=False, event_dim=1)
    def support(self) -> AffineSubspace:
        return AffineSubspace(self.constraint, self.k)

    @property
    def _mean(self) -> jax.Array:
        """``mu_bar``, computed on first use (the NLL, ``log_prob``, does not need it) and
        kept when concrete. Not a pytree leaf: a cache whose presence changed the tree
        structure would break ``lax.scan`` carries and ``jit`` arguments; a traced value is
        not kept, so none leaks out of a trace."""
        cached = self.__dict__.get("_mean_cache")
        if cached is not None:
            return cached
        with jax.ensure_compile_time_eval():
            mean = _mean_kernel(
                self.loc,
                self._factor,
                self.A,
                self.k,
                self._basis_t,
                self._r_inv_t,
                diagonal=self._diagonal,
            )
        if not_jax_tracer(mean):
            self.__dict__["_mean_cache"] = mean
        return mean

    @property
    def mean(self) -> jax.Array:
        """The conditional mean ``mu_bar``."""
        return self._mean

    @property
    def mode(self) -> jax.Array:
        return self._mean

    def _second_moment_factors(self) -> tuple[jax.Array, jax.Array]:
        """``(Y, Z)`` with ``Sigma_bar = Y Y^T + Z^T Z`` (see :func:`_second_moment_kernel`)."""
        return _second_moment_kernel(
            self._factor, self.A, self._basis_t, self._r_inv_t, diagonal=self._diagonal
        )

    @property
    def variance(self) -> jax.Array:
        """``diag Sigma_bar``, the squared row lengths of ``L N`` (``N`` an orthonormal
        basis of the whitened null space; see :func:`_second_moment_kernel`): no difference
        is taken, so each variance is accurate to a few ulps times the conditioning
        relative to itself, and a coordinate that the constraint fixes gets zero up to the
        rounding of the basis (exactly zero when its row of ``A`` is a unit vector). With a
        diagonal scale, ``scale^2 diag(I - Q Q^T)`` by :func:`_complement_diagonal`
        (leave-one-out factorisations for the rows of high leverage: O(n a^3) time,
        O(n a^2) memory); with a full covariance from the complete QR, O(n^2 a)."""
        return jnp.broadcast_to(self._variance(), self.batch_shape + self.event_shape)

    def _variance(self) -> jax.Array:
        """:attr:`variance` before broadcasting to the batch shape."""
        if self._diagonal:
            return _diagonal_variance_kernel(self._factor, self.A, self._basis_t, self._r_inv_t)
        factor, correction = self._second_moment_factors()
        return jnp.sum(jnp.square(factor), -1) + jnp.sum(jnp.square(correction), -2)

    @property
    def stddev(self) -> jax.Array:
        """``sqrt(variance)``, with a zero gradient (not NaN) where the variance is exactly
        zero: there the constraint fixes the coordinate, so it stays zero nearby."""
        variance = self.variance
        positive = variance > 0
        return jnp.where(positive, jnp.sqrt(jnp.where(positive, variance, 1.0)), 0.0)

    @property
    def covariance_matrix(self) -> jax.Array:
        """The conditional covariance ``Sigma_bar = (L N)(L N)^T`` (n x n, rank n - a, see
        :attr:`variance`): forms an n x n matrix."""
        factor, correction = self._second_moment_factors()
        bar = factor @ jnp.swapaxes(factor, -1, -2) + jnp.swapaxes(correction, -1, -2) @ correction
        bar = 0.5 * (bar + jnp.swapaxes(bar, -1, -2))
        return jnp.broadcast_to(bar, self.batch_shape + self.event_shape + self.event_shape)

    @property
    def marginals(self) -> Normal:
        """The conditional marginal ``N(mu_bar_i, Sigma_bar_ii)`` of each coordinate.

        A coordinate that the constraint fixes has standard deviation 0, which ``Normal``
        rejects, so the result is built without argument validation.
        """
        return Normal(self.mean, self.stddev, validate_args=False)

    def entropy(self) -> jax.Array:
        """``H = (n - a)/2 (1 + log 2 pi) + 1/2 log det Sigma - 1/2 log det S
        + 1/2 log det(A A^T)``, with respect to the Hausdorff measure on the subspace."""
        dim = self.event_shape[0] - self.A.shape[-2]
        return jnp.broadcast_to(0.5 * dim - self._log_normalizer, self.batch_shape)

    def log_prob(self, value: jax.Array) -> jax.Array:
        """Log density with respect to the Hausdorff measure on ``{z : A z = k}``; ``-inf``
        off it (with NumPyro's "Out-of-support values" warning when validating)."""
        value = as_concrete_where_possible(value)
        check_value_shape(jnp.shape(value), self.batch_shape, self.event_shape, type(self).__name__)
        constraint = self.constraint
        value_dtype = jnp.result_type(value)
        if not jnp.issubdtype(value_dtype, jnp.floating):
            value_dtype = self.A.dtype
        projected = self._diagonal and value_dtype == self.loc.dtype
        log_prob, _ = _log_prob_kernel(
            value,
            self.loc if projected else self._mean,
            self._factor,
            self._basis_t,
            self._log_normalizer,
            self.A,
            self.k,
            constraint._rtol_for(value_dtype),
            diagonal=self._diagonal,
            projected=projected,
        )
        # NumPyro's own rule (Distribution._validate_sample): warn for concrete values, and
        # score them -inf, which the kernel already does with or without validation. The
        # warning says by how much the value misses and how to loosen the tolerance.
        if self._validate_args:
            with jax.ensure_compile_time_eval():
                in_support = constraint._check(value, self.k)
            if not_jax_tracer(in_support) and not np.all(np.asarray(in_support)):
                warnings.warn(
                    f"{OUT_OF_SUPPORT_MESSAGE} {type(self).__name__}: "
                    + constraint._out_of_support_message(value, self.k),
                    UserWarning,
                    stacklevel=_stack_level_outside(),
                )
        return log_prob

    def _matheron_sample(self, key: jax.Array, sample_shape: tuple[int, ...]) -> jax.Array:
        shape = sample_shape + self.batch_shape + self.event_shape
        noise = jax.random.normal(key, shape, dtype=self.loc.dtype)
        return self._matheron_from_noise(noise)

    def _matheron_from_noise(self, noise: jax.Array) -> jax.Array:
        """Matheron's rule applied to standard normal ``noise`` of shape (..., n)."""
        return _matheron_kernel(
            noise,
            self._mean,
            self._factor,
            self.A,
            self.k,
            self._basis_t,
            self._r_inv_t,
            diagonal=self._diagonal,
        )

    def __repr__(self) -> str:
        # The covariance argument as stored: scale (diagonal) or its Cholesky factor.
        covariance = {"scale" if self._diagonal else "scale_tril": self._factor}
        return parameters_repr(
            type(self).__name__, {"loc": self.loc, **covariance, "A": self.A, "k": self.k}
        )

    def sample(self, key: jax.Array, sample_shape: tuple[int, ...] = ()) -> jax.Array:
        """An exact sample carrying the gradient chosen by ``grad_estimator``."""
        sample_shape = tuple(sample_shape)
        if self.grad_estimator == "pathwise":
            return self._matheron_sample(key, sample_shape)
        z = lax.stop_gradient(self._matheron_sample(key, sample_shape))
        proxy = jnp.broadcast_to(self._mean, z.shape)
        return z + (proxy - lax.stop_gradient(proxy))


@vmap_over.register
def _vmap_over_linear_constrained_normal(
    dist: LinearConstrainedNormal,
    loc=None,
    scale=None,
    covariance_matrix=None,
    scale_tril=None,
    A=None,
    k=None,
):
    """The axes of ``dist``'s leaves when the given constructor arguments are mapped.

    A parameter's own leaf gets its axis (``scale``, ``covariance_matrix`` and
    ``scale_tril`` all map the stored factor). A precomputed leaf is mapped, at axis 0, when a
    parameter it is computed from is: its own batch dimensions need not line up with a
    parameter's (the log normalizer of a (a, n) ``A`` mapped at axis 1 is a scalar), and any
    axis is right as long as the same ``out_axes`` is used to map over the result, as
    NumPyro's own rules do (``Beta._dirichlet``).
    """
    factor = next(
        (axis for axis in (scale, covariance_matrix, scale_tril) if axis is not None), None
    )

    def derived(*axes):
        return 0 if any(axis is not None for axis in axes) else None

    return vmap_over.dispatch(Distribution)(
        dist,
        loc=loc,
        _factor=factor,
        A=A,
        k=k,
        _basis_t=derived(factor, A),
        _r_inv_t=derived(factor, A),
        _prior_variance=derived(factor),
        _log_normalizer=derived(factor, A),
        _constraint_basis_t=derived(A),
        _constraint_r_inv_t=derived(A),
        _constraint_log_det_half=derived(A),
    )


@promote_batch_shape.register
def _promote_batch_shape_linear_constrained_normal(dist: LinearConstrainedNormal):
    """The batch shape after ``scan`` or ``vmap`` stacked leaves along new leading axes.

    The default rule cannot be used: it reads every ``arg_constraints`` attribute (with a
    diagonal covariance ``scale_tril`` and ``covariance_matrix`` would form n x n matrices,
    and the latter is the conditional covariance, broadcast to the stale batch shape), and it
    assumes every parameter is broadcast to the full batch shape, which the leaves here are
    not (an ``A`` shared by the batch stays (a, n): that is what keeps its products one
    matrix-matrix product). So the axes each leaf gained are its dimensions beyond those it
    was built with (``_leaf_batch_ndims``); the new batch shape is their broadcast followed
    by the old batch shape; and every leaf is reshaped (singleton axes between the stacked
    axes and its own, no copy of data) so that all of them line up with the new batch shape
    (a stacked (T, a, n) ``A`` beside a stacked (T, B, n) ``loc`` would otherwise broadcast
    T against B).
    """
    names = dist.pytree_data_fields
    old_ndim = len(dist.batch_shape)
    leaves = {name: dist.__dict__[name] for name in names}
    gained = {
        name: jnp.ndim(leaf) - dist._event_ndims(name) - built
        for (name, leaf), built in zip(leaves.items(), dist._leaf_batch_ndims, strict=True)
    }
    if not any(gained.values()):
        return copy.copy(dist)
    new_axes = jnp.broadcast_shapes(
        *(jnp.shape(leaf)[: gained[name]] for name, leaf in leaves.items())
    )
    batch_shape = tuple(new_axes) + tuple(dist.batch_shape)
    new = copy.copy(dist)
    for name, leaf in leaves.items():
        shape = jnp.shape(leaf)
        stacked, own = shape[: gained[name]], shape[gained[name] :]
        own_batch_ndim = len(own) - dist._event_ndims(name)
        aligned = (
            (1,) * (len(new_axes) - len(stacked))
            + stacked
            + (1,) * (old_ndim - own_batch_ndim)
            + own
        )
        if aligned != shape:
            setattr(new, name, jnp.reshape(leaf, aligned))
    # The LinearConstraint object kept for the unstacked leaves no longer matches them; the
    # constraint property rebuilds it from the new leaves.
    new.__dict__.pop("_constraint_object", None)
    new.__dict__.pop("_mean_cache", None)  # of the old batch shape; recomputed on use
    new._batch_shape = batch_shape
    new._leaf_batch_ndims = new._batch_ndims_of_leaves()
    return new


def _same_constraint(p: LinearConstrainedNormal, q: LinearConstrainedNormal) -> None:
    if p.event_shape != q.event_shape or p.A.shape[-2] != q.A.shape[-2]:
        raise ValueError(
            f"KL needs the same n and number of constraints, got A of shapes {p.A.shape} "
            f"and {q.A.shape}"
        )
    # Under jit A and k are tracers and cannot be compared: the caller is responsible.
    if is_concrete(p.A, q.A, p.k, q.k):
        try:
            same = bool(np.all(np.asarray(p.A) == np.asarray(q.A))) and bool(
                np.all(np.asarray(p.k) == np.asarray(q.k))
            )
        except ValueError:
            same = False
        if not same:
            raise ValueError(
                "KL between LinearConstrainedNormals needs the same A and k (different affine "
                "subspaces make the KL infinite or undefined)"
            )


@kl_divergence.register(LinearConstrainedNormal, LinearConstrainedNormal)
def _kl_linear_constrained_normal(
    p: LinearConstrainedNormal, q: LinearConstrainedNormal
) -> jax.Array:
    """``KL(p || q) = -H_p - E_p[log q(z)]`` for two with the same A and k.

    ``E_p[(z - mu_bar_q)^T Sigma_q^{-1} (z - mu_bar_q)] = tr(Sigma_q^{-1} Sigma_bar_p)
    + (mu_bar_p - mu_bar_q)^T Sigma_q^{-1} (mu_bar_p - mu_bar_q)``, where, with
    ``Sigma_bar_p = (L_p N_p)(L_p N_p)^T`` (see ``variance``),
    ``tr(Sigma_q^{-1} Sigma_bar_p) = ||L_q^{-1} L_p N_p||_F^2``, a sum of squares:
    ``sum_i Sigma_bar_p,ii / s_q,i^2`` when q's covariance is diagonal (O(n a^2) when p's
    is too), O(n^3) otherwise. That A and k agree is
    checked when they are concrete; under ``jit`` it cannot be.
    """
    _same_constraint(p, q)
    mean_diff = p.mean - q.mean
    if q._diagonal:
        q_variance = jnp.square(q.scale)
        trace = jnp.sum(p._variance() / q_variance, -1)
        maha = jnp.sum(jnp.square(mean_diff) / q_variance, -1)
    else:
        p_factor, p_correction = p._second_moment_factors()
        q_tril = q.scale_tril
        # One triangular solve for the three right-hand sides: independent batched solves
        # may run at once and deadlock (see _after).
        right = jnp.broadcast_shapes(
            p_factor.shape[:-2], p_correction.shape[:-2], mean_diff.shape[:-1]
        )
        n = mean_diff.shape[-1]
        columns = [
            jnp.broadcast_to(p_factor, right + p_factor.shape[-2:]),
            jnp.broadcast_to(
                jnp.swapaxes(p_correction, -1, -2), right + (n, p_correction.shape[-2])
            ),
            jnp.broadcast_to(mean_diff[..., None], right + (n, 1)),
        ]
        stacked = jnp.concatenate(columns, -1)
        batch = jnp.broadcast_shapes(q_tril.shape[:-2], stacked.shape[:-2])
        whitened = jax.scipy.linalg.solve_triangular(
            jnp.broadcast_to(q_tril, batch + q_tril.shape[-2:]),
            jnp.broadcast_to(stacked, batch + stacked.shape[-2:]),
            lower=True,
        )
        trace = jnp.sum(jnp.square(whitened[..., :-1]), (-2, -1))
        maha = jnp.sum(jnp.square(whitened[..., -1]), -1)
    cross_entropy = 0.5 * (trace + maha) - q._log_normalizer
    return cross_entropy - p.entropy()
