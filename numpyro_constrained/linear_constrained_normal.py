"""A Gaussian conditioned on linear equalities ``A z = k``: :class:`LinearConstrainedNormal`.

The math: ``docs/distributions/linear_constrained_normal.md``. The class lives here; its
pieces in the modules it imports, each importable from here as before:

- ``_lcn_arguments.py``: the constructor's arguments and their one validation layer;
- ``_lcn_kernels.py``: the jitted conditional-Gaussian kernels (whitened QR, mean,
  ``log_prob``, Matheron's sampler, second moments);
- ``_lcn_support.py``: the support :class:`AffineSubspace` and the isometric bijection
  :class:`AffineSubspaceTransform` onto it (registered with ``biject_to``, so that AutoGuides
  and NUTS can use the distribution as a latent site), and :func:`moving_subspaces`, the
  check that refuses an AutoGuide a subspace that moves;
- ``_lcn_rules.py``: its ``vmap_over``, ``promote_batch_shape`` and KL rules, registered at
  the end of this module.
"""

from __future__ import annotations

import copy
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from jax import lax
from numpyro.distributions import Distribution, Normal, constraints
from numpyro.distributions.batch_util import promote_batch_shape, vmap_over
from numpyro.distributions.kl import kl_divergence
from numpyro.util import not_jax_tracer

from constrained_ppl.arguments import LCN_GRAD_ESTIMATORS, check_value_shape, keyword_only
from constrained_ppl.conditioning import warn_if_unresolvable
from numpyro_constrained._batching import check_expand
from numpyro_constrained._compat import default_validate_args
from numpyro_constrained._lcn_arguments import ARG_CONSTRAINTS, check_held, parse_arguments
from numpyro_constrained._lcn_kernels import (
    _diagonal_variance_kernel,
    _log_prob_kernel,
    _matheron_kernel,
    _mean_kernel,
    _precompute,
    _second_moment_kernel,
)
from numpyro_constrained._lcn_rules import (
    _kl_linear_constrained_normal,
    _promote_batch_shape_linear_constrained_normal,
    _vmap_over_linear_constrained_normal,
)
from numpyro_constrained._lcn_support import (
    AffineSubspace,
    AffineSubspaceTransform,
    _as_constraint,  # noqa: F401 (importable from here, as before the split)
    _min_norm_point_and_basis,  # noqa: F401 (numpyro_constrained.reparam imports it from here)
    moving_subspaces,
)
from numpyro_constrained._products import matmul
from numpyro_constrained._repr import parameters_repr
from numpyro_constrained.linear_constraint import LinearConstraint
from numpyro_constrained.validation import (
    OUT_OF_SUPPORT_MESSAGE,
    _stack_level_outside,
    as_concrete_where_possible,
)

__all__ = [
    "GRAD_ESTIMATORS",
    "AffineSubspace",
    "AffineSubspaceTransform",
    "moving_subspaces",
    "LinearConstrainedNormal",
    "LinearConstraint",
]

#: The values of ``grad_estimator`` (``constrained_ppl.arguments.LCN_GRAD_ESTIMATORS``).
GRAD_ESTIMATORS = LCN_GRAD_ESTIMATORS


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
    ``|A z - k| <= rtol * (|A| |z| + |k|)`` per row (``rtol`` default ``max(1e-6, 64 eps)``; see
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
        by default ``max(1e-6, 64 eps)`` of the dtype (see :class:`LinearConstraint`). Set it to the
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

    arg_constraints = ARG_CONSTRAINTS
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
        arguments = parse_arguments(
            loc,
            scale,
            covariance_matrix,
            scale_tril,
            A,
            k,
            constraint,
            rtol,
            grad_estimator,
            validate,
        )
        constraint = arguments.constraint
        # Kept at its own shape, as A, k and the factor are: a leaf broadcast to the batch
        # shape would keep, inside a vmap over another parameter, the axis mapped away
        # (``vmap_over(d, scale=0)`` would give one row of log-densities per element).
        self.loc = arguments.loc
        self._factor = arguments.factor
        self._diagonal = arguments.diagonal
        self._constraint_object = constraint
        self.A = constraint.A
        self._constraint_basis_t = constraint._basis_t
        self._constraint_r_inv_t = constraint._r_inv_t
        self._constraint_log_det_half = constraint._log_det_half
        self._rtol = constraint._rtol
        self.k = arguments.k
        self.grad_estimator = arguments.grad_estimator
        n = self.loc.shape[-1]
        super().__init__(arguments.batch_shape, (n,), validate_args=validate_args)
        cached = _precompute(
            self._factor, self.A, constraint._log_det_half, diagonal=self._diagonal
        )
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
        """NumPyro's argument check of the held parameters, with every constraint evaluated
        in one jitted call (see :func:`~numpyro_constrained._lcn_arguments.check_held`)."""
        check_held(self.get_args(), type(self).__name__, strict)

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
        """A view of this distribution with batch shape ``batch_shape`` (an instance of the same
        class whose parameters are broadcast, not an ``ExpandedDistribution``). Raises
        ``ValueError`` where the current batch shape does not broadcast to ``batch_shape``."""
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
        bar = matmul(factor, jnp.swapaxes(factor, -1, -2)) + matmul(
            jnp.swapaxes(correction, -1, -2), correction
        )
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


vmap_over.register(LinearConstrainedNormal, _vmap_over_linear_constrained_normal)
promote_batch_shape.register(
    LinearConstrainedNormal, _promote_batch_shape_linear_constrained_normal
)
kl_divergence.register(LinearConstrainedNormal, LinearConstrainedNormal)(
    _kl_linear_constrained_normal
)
