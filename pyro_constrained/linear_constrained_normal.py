"""A Gaussian conditioned on linear equalities ``A z = k``.

The math: ``docs/distributions/linear_constrained_normal.md``.


Holds :class:`LinearConstrainedNormal`, its support constraint (the affine subspace
``{z : A z = k}``), the isometric bijection from ``R^(n - a)`` onto that subspace (registered
with ``biject_to`` and ``transform_to`` so that AutoGuides and HMC/NUTS can use the
distribution as a latent site) and its KL rule (registered with ``register_kl``).
"""

from __future__ import annotations

import math

import pyro
import torch
from pyro.distributions import Normal, TorchDistribution
from torch.distributions import biject_to, constraints, transform_to
from torch.distributions.kl import register_kl
from torch.distributions.transforms import Transform
from torch.distributions.utils import _standard_normal, lazy_property

from constrained_ppl.arguments import check_value_shape, keyword_only
from constrained_ppl.conditioning import warn_if_unresolvable
from pyro_constrained._repr import parameters_repr
from pyro_constrained.linear_constraint import (
    LinearConstraint,
    _as_float_tensor,
    _broadcast_shapes,
    _check_finite,
    _check_rtol,
    _combine_rows,
    _complement_diagonal,
    _complete_complement,
    _row_sorted_qr,
    _rows_times,
)

GRAD_ESTIMATORS = ("marginal_expectation", "pathwise")


def _float_dtype(values) -> torch.dtype:
    """The dtype of the parameters: torch's promotion of the floating dtypes of the arrays
    among ``values`` (tensors and NumPy arrays; Python numbers and lists are weakly typed
    and do not take part), or the default dtype when there are none."""
    dtype = None
    for value in values:
        if value is None or isinstance(value, (bool, int, float, list, tuple)):
            continue
        value_dtype = torch.as_tensor(value).dtype
        if value_dtype.is_floating_point:
            dtype = value_dtype if dtype is None else torch.promote_types(dtype, value_dtype)
    return torch.get_default_dtype() if dtype is None else dtype


def _as_constraint(A, k: torch.Tensor) -> LinearConstraint:
    """``A`` itself when it is a :class:`LinearConstraint`, else one built (unchecked) from
    the matrix ``A`` in the dtype of ``k``'s promotion with it."""
    if isinstance(A, LinearConstraint):
        return A
    A = torch.as_tensor(A)
    dtype = torch.promote_types(A.dtype, k.dtype) if A.is_floating_point() else k.dtype
    return LinearConstraint._build(A.to(dtype), None, validate=False)


def _check_not_stale(value, constraint: LinearConstraint, k: torch.Tensor) -> None:
    """Raise if ``value`` came from an :class:`AffineSubspaceTransform` of another subspace
    and is off this one (HMC/NUTS and AutoGuides freeze the transform of a site at the first
    trace, so a site whose ``A`` or ``k`` depends on a latent would otherwise score -inf)."""
    origin = getattr(value, "_lcn_subspace", None)
    if origin is None or (origin[0] is constraint.A and origin[1] is k):
        return
    if not bool(constraint._check(value.detach(), k.detach()).all()):
        raise ValueError(
            "LinearConstrainedNormal: the value was mapped onto the subspace A z = k of an "
            "earlier trace, and A or k have changed since (they depend on another latent "
            "variable). HMC/NUTS and AutoGuides fix the support of a site at the first trace; "
            "reparameterise the site with pyro.poutine.reparam(model, config={name: "
            "pyro_constrained.LinearConstrainedNormalReparam()})."
        )


class AffineSubspace(constraints.Constraint):
    """The affine subspace ``{z in R^n : A z = k}`` with ``A`` of shape (..., a, n), rank a.

    ``A`` is a :class:`LinearConstraint` (whose factorisation and ``rtol`` are used) or a
    matrix. ``check`` accepts a value whose residual is within the constraint's tolerance,
    ``|A z - k| <= rtol * (|A| |z| + |k|)`` per row (see :class:`LinearConstraint`).
    """

    is_discrete = False
    event_dim = 1

    def __init__(self, A: LinearConstraint | torch.Tensor, k: torch.Tensor):
        self.constraint = _as_constraint(A, k)
        self.A = self.constraint.A
        self.k = k
        super().__init__()

    def check(self, value: torch.Tensor) -> torch.Tensor:
        return self.constraint._check(value, self.k)

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
    the distribution's): the O(n^2 a) QR for ``B`` runs once per constraint, not once per
    transform, so an AutoGuide that builds this transform at every step does not refactorise.
    Each call is O(n (n - a)) per point.
    """

    domain = constraints.real_vector
    bijective = True

    def __init__(self, A: LinearConstraint | torch.Tensor, k: torch.Tensor, cache_size: int = 0):
        super().__init__(cache_size=cache_size)
        self.constraint = _as_constraint(A, k)
        self.A = self.constraint.A
        self.k = k
        self.basis = self.constraint._null_basis
        self.offset = self.constraint._offset(k)

    @constraints.dependent_property(is_discrete=False, event_dim=1)
    def codomain(self) -> constraints.Constraint:
        return AffineSubspace(self.constraint, self.k)

    def with_cache(self, cache_size: int = 1) -> AffineSubspaceTransform:
        if self._cache_size == cache_size:
            return self
        return AffineSubspaceTransform(self.constraint, self.k, cache_size=cache_size)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, AffineSubspaceTransform)
            and self.A.shape == other.A.shape
            and self.k.shape == other.k.shape
            and bool((self.A == other.A).all())
            and bool((self.k == other.k).all())
        )

    def _call(self, u: torch.Tensor) -> torch.Tensor:
        z = self.constraint._correct(self.offset + _rows_times(self.basis, u), self.k)
        # Remember the subspace this value was mapped onto, so that a LinearConstrainedNormal
        # whose subspace has since moved (HMC/NUTS and AutoGuides freeze this transform at
        # the first trace) can name the fix instead of silently returning -inf.
        z._lcn_subspace = (self.A, self.k)
        return z

    def _inverse(self, z: torch.Tensor) -> torch.Tensor:
        return _combine_rows(z - self.offset, self.basis)

    def log_abs_det_jacobian(self, u: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        shape = torch.broadcast_shapes(u.shape[:-1], z.shape[:-1])
        return torch.zeros(shape, dtype=z.dtype, device=z.device)

    def forward_shape(self, shape: torch.Size) -> torch.Size:
        if len(shape) < 1 or shape[-1] != self.basis.shape[-1]:
            raise ValueError(f"expected an input of size {self.basis.shape[-1]}, got {shape}")
        return torch.broadcast_shapes(shape[:-1], self.offset.shape[:-1]) + self.basis.shape[-2:-1]

    def inverse_shape(self, shape: torch.Size) -> torch.Size:
        if len(shape) < 1 or shape[-1] != self.basis.shape[-2]:
            raise ValueError(f"expected an input of size {self.basis.shape[-2]}, got {shape}")
        return torch.broadcast_shapes(shape[:-1], self.offset.shape[:-1]) + self.basis.shape[-1:]


@biject_to.register(AffineSubspace)
@transform_to.register(AffineSubspace)
def _transform_to_affine_subspace(constraint: AffineSubspace) -> AffineSubspaceTransform:
    return AffineSubspaceTransform(constraint.constraint, constraint.k)


def _functorch_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, jacrev, ...) is running: those need
    an autograd.Function written for them (``setup_context``), so ``log_prob`` then takes
    the recorded path, which they differentiate as any torch code."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _whitened_projection(
    value: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor, basis_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, (I - Q Q^T) w)`` with ``w = L^{-1} (z - loc)``, ``L = diag(scale)``.

    On the subspace, ``L^{-1} (z - mu_bar) = (I - Q Q^T) L^{-1} (z - loc)``: an orthogonal
    projection in whitened coordinates, which needs neither ``mu_bar`` (two refinement
    passes) nor ``k``, and is as accurate as the difference from ``mu_bar``.
    """
    whitened = (value - loc) / scale
    return whitened, whitened - _combine_rows(_rows_times(basis_t, whitened), basis_t)


class _ProjectedLogDensity(torch.autograd.Function):
    r"""``log p(z) = -1/2 ||(I - Q Q^T) w||^2 + log_normalizer``, ``w = (z - loc) / s``, for
    a diagonal scale, with a hand-written backward.

    Why: differentiating this through the recorded factorisation ``(A diag(s))^T = Q R``
    (row sort, QR and their backward nodes, a dozen small matrix products) made the
    regression head's training step 1.6x the plain MLP's, all of it per-op overhead at these
    sizes. The gradient needs no derivative of the QR. With ``u = (I - Q Q^T) w`` and the
    leverages ``h_i = ||Q_i||^2`` (row norms of Q, i.e. ``diag Q Q^T``):

    - ``d log p / d loc = u / s`` and ``d log p / d z = -u / s``;
    - ``d log p / d s = (u (2 w - u) + h - 1) / s`` (elementwise).

    Derivation: ``Q Q^T`` projects onto the range of ``M = diag(s) A^T``, whose derivative
    gives ``d(1/2 w^T P w) = -u^T dM c + u^T dw`` with ``P = I - Q Q^T`` and
    ``c = M^+ w``; ``M c = Q Q^T w = w - u`` turns the first term into
    ``-sum ds_i u_i (w_i - u_i) / s_i``, and ``dw_i = -w_i ds_i / s_i`` the second into
    ``-sum ds_i u_i w_i / s_i``. ``log_normalizer = sum log|R_ii| - sum log s_i + const``
    and ``d sum log|R_ii| = 1/2 d log det(M^T M) = tr(M^+ dM) = sum ds_i h_i / s_i``.
    Without constraint (``Q = 0``) these are the gradients of ``log N(z; loc, s^2)``.

    ``basis_t`` (``Q^T``) and ``log_normalizer`` come from the detached scale; the scale's
    gradient is the formula above. Values off the subspace (``off_subspace``) score
    ``-inf`` with zero gradient, as a ``torch.where`` would give. Second derivatives
    (``create_graph=True``: Laplace approximations, Hessians) are taken by autograd through
    the recorded path, which the backward then runs, so they are exact as well.
    """

    @staticmethod
    def forward(ctx, value, loc, scale, basis_t, log_normalizer, off_subspace, dist):
        whitened, projected = _whitened_projection(value, loc, scale, basis_t)
        log_prob = torch.add(log_normalizer, projected.square().sum(-1), alpha=-0.5)
        if off_subspace is not None:
            log_prob = log_prob.masked_fill(off_subspace, -math.inf)
        ctx.save_for_backward(value, loc, scale)
        # Computed in forward, which autograd runs without recording: plain tensors.
        ctx.whitened, ctx.projected, ctx.basis_t = whitened, projected, basis_t
        ctx.off_subspace, ctx.dist = off_subspace, dist
        return log_prob

    @staticmethod
    def backward(ctx, grad):
        value, loc, scale = ctx.saved_tensors
        if ctx.off_subspace is not None:
            grad = grad.masked_fill(ctx.off_subspace, 0.0)
        needs_value, needs_loc, needs_scale = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():
            # create_graph=True: return gradients that are themselves differentiable, by
            # autograd through the recorded factorisation of the same density.
            inputs = [
                tensor
                for tensor, needed in zip(
                    (value, loc, scale), ctx.needs_input_grad[:3], strict=True
                )
                if needed
            ]
            dist = ctx.dist
            recorded = LinearConstrainedNormal(
                loc, scale, constraint=dist._constraint, k=dist.k, validate_args=False
            )
            grads = iter(
                torch.autograd.grad(
                    recorded._log_prob_recorded(value, None),
                    inputs,
                    grad,
                    create_graph=True,
                    allow_unused=True,
                )
            )
            return (
                tuple(next(grads) if needed else None for needed in ctx.needs_input_grad[:3])
                + (None,) * 4
            )
        whitened, projected = ctx.whitened, ctx.projected
        grad_value = grad_loc = grad_scale = None
        d_loc = grad.unsqueeze(-1) * projected / scale
        if needs_value:
            grad_value = (-d_loc).sum_to_size(value.shape)
        if needs_loc:
            grad_loc = d_loc.sum_to_size(loc.shape)
        if needs_scale:
            leverage = ctx.basis_t.square().sum(-2)
            grad_scale = torch.addcmul(
                d_loc * (2 * whitened - projected), grad.unsqueeze(-1), (leverage - 1) / scale
            ).sum_to_size(scale.shape)
        return grad_value, grad_loc, grad_scale, None, None, None, None


class LinearConstrainedNormal(TorchDistribution):
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
    for ``loc = 0``, ``Sigma = s^2 I`` and the default zero-sum constraint it equals NumPyro's
    ``ZeroSumNormal(s, event_shape=(n,))``. It does not depend on a choice of coordinates.
    "On the subspace" means within the support tolerance,
    ``|A z - k| <= rtol * (|A| |z| + |k|)`` per row (``rtol`` default 1e-6 in float64,
    7.6e-6 in float32; see :class:`LinearConstraint`). A value off the subspace raises
    ``ValueError`` with validation on (stating the largest residual, its bound, the ``rtol``
    in force and how to loosen it) and gets ``-inf`` with it off. A value whose shape does
    not end in ``(n,)`` or whose leading dimensions do not broadcast with the batch shape is
    a ``ValueError`` naming the expected shape, with validation on or off. A value of
    another float dtype than the parameters is promoted (``torch.promote_types``), and so is
    the result.

    **Sampling** is exact, by Matheron's rule in whitened form (above). :meth:`rsample`
    returns this sample with the gradient chosen by ``grad_estimator``:
    ``"marginal_expectation"`` (default): straight-through through the conditional mean,
    ``z + (mu_bar - mu_bar.detach())`` with ``z`` detached (biased, low variance);
    ``"pathwise"``: the gradient of the Matheron sample itself (exact reparameterisation,
    unbiased; the refinement step adds ``K (k - A z)``, which vanishes identically in exact
    arithmetic, so it adds nothing to the gradient either).

    **Validation** (``validate_args``, on by default): NaN or +-inf in any parameter, a
    non-positive scale, a covariance that is not positive definite, an ``A`` that is
    rank-deficient or has a >= n rows, and shapes that do not fit raise ``ValueError``
    naming the argument. Parameters of different float dtypes are promoted together.
    ``arg_constraints`` describe the constructor's arguments (each argument given is checked
    against its entry); the property :attr:`covariance_matrix` is the conditional
    covariance (rank n - a), not the argument.

    **Tracing.** No operation writes into a tensor in place, and the draw is detached (not
    only computed under ``no_grad``, which a trace does not record), so what
    ``torch.jit.trace`` records (Pyro's ``JitTrace_ELBO`` and friends) replays sampling and
    scoring with the same values and gradients as eager execution.

    **Cost.** With a diagonal covariance (``scale``) the whitened factorisation costs
    O(n a^2 + a^3), on first use (construction only checks and stores the arguments), and
    every call O(n a); no n x n matrix is formed except by :attr:`covariance_matrix`. With a
    full covariance the Cholesky factor costs O(n^3) once and each sample or log_prob
    O(n^2). With a diagonal scale, :meth:`log_prob` is differentiated by a hand-written
    backward (see :class:`_ProjectedLogDensity`: gradients ``u / s`` and
    ``(u (2 w - u) + h - 1) / s`` with ``u = (I - Q Q^T) w``), which needs no derivative of
    the QR; its second derivatives are taken by autograd through the factorisation.

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
        by default 1e-6 in float64, 7.6e-6 in float32 (see :class:`LinearConstraint`). Set
        it to the precision of measured data that satisfies its balances only to that precision.
    :param grad_estimator: ``"marginal_expectation"`` or ``"pathwise"``.

    Examples
    --------
    >>> import torch
    >>> from pyro_constrained import LinearConstrainedNormal
    >>> d = LinearConstrainedNormal(torch.zeros(3), torch.ones(3), k=1.0)  # z1 + z2 + z3 = 1
    >>> d  # doctest: +NORMALIZE_WHITESPACE
    LinearConstrainedNormal(loc: torch.Size([3]), scale: torch.Size([3]),
                            A: torch.Size([1, 3]), k: 1.0)
    >>> d.mean
    tensor([0.3333, 0.3333, 0.3333])
    >>> z = d.rsample((2,))  # exact draws on the plane, reparameterised
    >>> z.shape, torch.allclose(z.sum(-1), torch.ones(2))
    (torch.Size([2, 3]), True)
    >>> A = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, -1.0]])  # two equalities
    >>> d2 = LinearConstrainedNormal(torch.zeros(3), torch.ones(3), A=A, k=torch.tensor([1.0, 0.0]))
    >>> torch.allclose(A @ d2.mean, torch.tensor([1.0, 0.0]))
    True
    >>> torch.linalg.matrix_rank(d2.covariance_matrix).item()  # n - a = 1
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
    has_rsample = True

    @keyword_only("A", "k", usage="LinearConstrainedNormal(loc, scale, A=A, k=k)")
    def __init__(
        self,
        loc: torch.Tensor,
        scale: torch.Tensor | None = None,
        *,
        covariance_matrix: torch.Tensor | None = None,
        scale_tril: torch.Tensor | None = None,
        A: torch.Tensor | None = None,
        k: torch.Tensor | float | None = None,
        constraint: LinearConstraint | None = None,
        rtol: float | None = None,
        grad_estimator: str = "marginal_expectation",
        validate_args: bool | None = None,
    ):
        validate = (
            torch.distributions.Distribution._validate_args
            if validate_args is None
            else validate_args
        )
        if grad_estimator not in GRAD_ESTIMATORS:
            raise ValueError(
                f"grad_estimator must be one of {GRAD_ESTIMATORS}, got {grad_estimator!r}"
            )
        if sum(p is not None for p in (scale, covariance_matrix, scale_tril)) != 1:
            raise ValueError("exactly one of scale, covariance_matrix or scale_tril must be given")
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
        matrix_a = constraint.A if constraint is not None else A
        dtype = _float_dtype((loc, scale, covariance_matrix, scale_tril, matrix_a, k))
        device = loc.device if isinstance(loc, torch.Tensor) else None
        loc = _as_float_tensor(loc, "loc", dtype, device)
        device = loc.device
        if loc.dim() < 1:
            raise ValueError(f"loc must have at least one dimension (the event), got {loc.shape}")
        if validate:
            _check_finite("loc", loc)
        n = loc.shape[-1]

        if scale is not None:
            scale = _as_float_tensor(scale, "scale", dtype, device)
            if scale.dim() == 0:
                scale = scale.expand(n)
            if scale.shape[-1] not in (1, n):
                raise ValueError(f"scale must have last dimension {n} (or 1), got {scale.shape}")
            if validate:
                _check_finite("scale", scale)
            scale = scale.expand(scale.shape[:-1] + (n,))
            cov_batch_shape = scale.shape[:-1]
        else:
            name = "covariance_matrix" if covariance_matrix is not None else "scale_tril"
            matrix = covariance_matrix if covariance_matrix is not None else scale_tril
            matrix = _as_float_tensor(matrix, name, dtype, device)
            if matrix.dim() < 2 or matrix.shape[-2:] != (n, n):
                raise ValueError(f"{name} must have shape (..., {n}, {n}), got {matrix.shape}")
            if validate:
                _check_finite(name, matrix)
            if covariance_matrix is not None:
                if validate and not constraints.positive_definite.check(matrix).all():
                    raise ValueError("covariance_matrix must be symmetric positive definite")
                scale_tril = torch.linalg.cholesky_ex(matrix).L
            else:
                scale_tril = matrix
            cov_batch_shape = scale_tril.shape[:-2]

        if constraint is not None:
            A = constraint.A
            if A.shape[-1] != n:
                raise ValueError(
                    f"the constraint has n = {A.shape[-1]} columns, but loc has size {n}"
                )
        elif A is None:
            A = torch.ones(1, n, dtype=dtype, device=device)
        else:
            A = _as_float_tensor(A, "A", dtype, device)
            if A.dim() < 2:
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
            k = torch.zeros(num_rows, dtype=dtype, device=device)
        else:
            k = _as_float_tensor(k, "k", dtype, device)
            # A real right-hand side broadcasts as torch does: a scalar or a last dimension
            # of 1 gives every row the same value.
            if k.dim() == 0:
                k = k.unsqueeze(-1)
            if k.shape[-1] not in (1, num_rows):
                raise ValueError(
                    f"k must have shape (..., a) with a = {num_rows} (the rows of A), or a "
                    f"last dimension of 1, got {tuple(k.shape)}"
                )
            if validate:
                _check_finite("k", k)
            k = k.expand(k.shape[:-1] + (num_rows,))

        batch_shapes = {
            "loc": loc.shape[:-1],
            "scale" if scale is not None else "scale_tril": cov_batch_shape,
            "A": A.shape[:-2],
            "k": k.shape[:-1],
        }
        try:
            batch_shape = _broadcast_shapes(*batch_shapes.values())
        except RuntimeError:
            shapes = ", ".join(f"{name} {tuple(shape)}" for name, shape in batch_shapes.items())
            raise ValueError(
                f"the batch shapes of the parameters do not broadcast: {shapes}"
            ) from None

        self.loc = loc.expand(batch_shape + (n,))
        if scale is not None:
            self.scale = scale
        else:
            self.scale_tril = scale_tril
        self._diagonal = scale is not None
        self.k = k
        self.grad_estimator = grad_estimator
        # torch's own check reads every arg_constraints entry with getattr, and
        # ``covariance_matrix`` here is the conditional covariance (n x n, singular): the
        # arguments given are checked against their constraints below instead.
        super().__init__(batch_shape, torch.Size((n,)), validate_args=False)
        if validate_args is None:
            del self._validate_args  # follow the class-wide default, as torch does
        else:
            self._validate_args = validate_args
        if validate:
            factor_name, factor = (
                ("scale", scale) if scale is not None else ("scale_tril", scale_tril)
            )
            arguments = {"loc": self.loc, factor_name: factor, "k": k}
            if constraint is None:
                arguments["A"] = A
            for name, value in arguments.items():
                if not bool(self.arg_constraints[name].check(value).all()):
                    raise ValueError(
                        f"{type(self).__name__}: parameter {name} (of shape "
                        f"{tuple(value.shape)}) does not satisfy the constraint "
                        f"{self.arg_constraints[name]!r}"
                    )

        if constraint is None:
            # Validated (rank included) and factorised here, once per distribution; a
            # LinearConstraint given instead was validated and factorised once for all.
            constraint = LinearConstraint._build(A, rtol, validate)
        else:
            if constraint.A.dtype != dtype or constraint.A.device != device:
                if torch.finfo(dtype).eps < torch.finfo(constraint.A.dtype).eps:
                    # Factors rounded to a coarser dtype would cap the accuracy of the
                    # result at that dtype's: refactorise in the finer one.
                    constraint = LinearConstraint._build(
                        constraint.A.to(dtype=dtype, device=device), constraint._rtol, False
                    )
                else:
                    constraint = constraint._replace(dtype=dtype, device=device)
            if rtol is not None:
                constraint = constraint._replace(rtol=rtol)
        self._constraint = constraint
        self.A = constraint.A

    @property
    def constraint(self) -> LinearConstraint:
        """The :class:`LinearConstraint` (validated and factorised ``A`` and ``rtol``)."""
        return self._constraint

    @property
    def rtol(self) -> float:
        """The relative tolerance of the support check (see :class:`LinearConstraint`)."""
        return self._constraint.rtol

    def _whiten_and_factorise(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(Q^T, R, log_normalizer)`` of the whitened factorisation ``(A L)^T = Q R``
        (rows sorted by norm, see :func:`_row_sorted_qr`): O(n a^2 + a^3) (diagonal), once
        per distinct scale; ``Q^T`` is (..., a, n), with orthonormal rows.

        ``log p(z) = -1/2 (z - mu_bar)^T Sigma^{-1} (z - mu_bar) + log_normalizer`` on the
        subspace: for ``A z = k`` the cross term with ``mu_bar - loc = K (k - A loc)``
        vanishes, so the squared distance from ``loc`` splits into this one plus the one of
        ``log N(k; A loc, S)``. ``1/2 log det S = sum log|R_ii|`` and
        ``1/2 log det(A A^T) = sum log|R'_ii|`` (the constraint's).
        """
        whitened_t = self._whitened_t()
        if self._diagonal:
            log_det_sigma_half = self.scale.log().sum(-1)
        else:
            log_det_sigma_half = self.scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        basis, r_factor = _row_sorted_qr(whitened_t)
        if self._validate_args and not self.__dict__.get("_precision_checked", False):
            # Once per distribution (the factorisation may run twice: recorded and detached).
            self.__dict__["_precision_checked"] = True
            warn_if_unresolvable(
                r_factor.detach().to(torch.float64).cpu().numpy(),
                torch.finfo(r_factor.dtype).eps,
                str(r_factor.dtype).removeprefix("torch."),
                (__file__, torch.__file__, pyro.__file__),
            )
        log_normalizer = (
            r_factor.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1) - log_det_sigma_half
        ) + self._constraint._log_density_offset
        basis_t = basis.mT  # Q^T; contiguous when batched, for the batched products
        return (basis_t.contiguous() if basis_t.dim() > 2 else basis_t), r_factor, log_normalizer

    def _whitened_t(self) -> torch.Tensor:
        """``(A L)^T`` (..., n, a), recorded."""
        if self._diagonal:
            return self.scale.unsqueeze(-1) * self.A.mT
        return self.scale_tril.mT @ self.A.mT

    # The factorisation is computed on first use, not at construction: a training step
    # scores with log_prob, whose diagonal-scale path (_ProjectedLogDensity) factorises the
    # detached scale without recording autograd nodes and differentiates by hand, so the
    # recorded factorisation (with its QR backward) is needed only by mean, sample,
    # variance, entropy and KL.

    @lazy_property
    def _whitened_factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`_whiten_and_factorise`, recorded by autograd."""
        return self._whiten_and_factorise()

    @lazy_property
    def _basis_t(self) -> torch.Tensor:
        """``Q^T`` (..., a, n): orthonormal rows spanning the whitened constrained directions."""
        return self._whitened_factors[0]

    @lazy_property
    def _r_factor(self) -> torch.Tensor:
        """``R`` (..., a, a), upper triangular, ``R^T R = A Sigma A^T``."""
        return self._whitened_factors[1]

    @lazy_property
    def _log_normalizer(self) -> torch.Tensor:
        """The log-density at the conditional mean (see :meth:`_whiten_and_factorise`)."""
        return self._whitened_factors[2]

    @lazy_property
    def _prior_variance(self) -> torch.Tensor:
        """``diag Sigma``."""
        if self._diagonal:
            return self.scale.square()
        return self.scale_tril.square().sum(-1)

    def _detached_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q^T, log_normalizer)`` without autograd history, for
        :class:`_ProjectedLogDensity`: the recorded factors when they exist, else the
        factorisation of the detached scale (kept)."""
        recorded = self.__dict__.get("_whitened_factors")
        if recorded is not None:
            return recorded[0].detach(), recorded[2].detach()
        detached = self.__dict__.get("_detached_factors_cache")
        if detached is None:
            with torch.no_grad():
                basis_t, _, log_normalizer = self._whiten_and_factorise()
            # detach() as well: torch.jit.trace does not record no_grad (see _matheron_sample).
            detached = (basis_t.detach(), log_normalizer.detach())
            self.__dict__["_detached_factors_cache"] = detached
        return detached

    @lazy_property
    def _r_inv_t(self) -> torch.Tensor:
        """``R^{-T}`` (..., a, a), so that ``K r = L Q (R^{-T} r)`` costs one pass over Q;
        on first use (``log_prob`` does not need it). An explicit triangular inverse is as
        accurate here as a substitution, and a small matrix product broadcasts where a
        batched solve would not."""
        r_factor = self._r_factor
        identity = torch.eye(r_factor.shape[-1], dtype=r_factor.dtype, device=r_factor.device)
        return torch.linalg.solve_triangular(r_factor, identity, upper=True).mT

    @lazy_property
    def _mean(self) -> torch.Tensor:
        """``mu_bar``, computed on first use: the NLL (``log_prob``) does not need it."""
        return self._refine(self._refine(self.loc))

    @lazy_property
    def _second_moment_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(Y, Z)``, (..., n, n - a) and (..., a, n), with ``Sigma_bar = Y Y^T + Z^T Z``:
        the second moments as sums of squares, without the cancellation of
        ``Sigma - (L Q)(L Q)^T``.

        ``Sigma_bar = L P L^T`` with ``P = I - Q Q^T = N N^T``, ``N`` an orthonormal basis
        of the complement of range(M), ``M = (A L)^T``, from the complete QR
        (:func:`_complete_complement`, rows in leverage order). ``Y = L N`` and ``Z = 0`` in
        value; the
        derivatives come from writing ``P`` as a function of ``M`` around the detached
        ``M0`` whose basis ``N0`` was computed: with ``D = (M - M0)^T N0`` (zero in value)
        and ``C = R^{-T} D``, the exact identities ``P(M) N0 = N0 - Q C =: N_d`` and
        ``N_d^T N_d = I - C^T C`` give ``P = N_d (I - C^T C)^{-1} N_d^T
        = N_d N_d^T + (C N_d^T)^T (C N_d^T) + O(|M - M0|^4)``, differentiable through the
        reduced QR (Q, R) alone (torch has no derivative of the complete QR). So
        ``Y = L N_d``, ``Z = C N_d^T L^T``: values exact to the basis' rounding, first to
        third derivatives exact.
        """
        whitened_t = self._whitened_t()
        fixed = whitened_t.detach()
        basis_t, r_inv_t = self._basis_t, self._r_inv_t
        complement = _complete_complement(fixed, basis_t.detach().square().sum(-2))
        coefficients = r_inv_t @ ((whitened_t - fixed).mT @ complement)  # C, zero-valued
        moved = complement - basis_t.mT @ coefficients  # N_d
        crossed = coefficients @ moved.mT  # C N_d^T, (..., a, n)
        if self._diagonal:
            return self.scale.unsqueeze(-1) * moved, crossed * self.scale.unsqueeze(-2)
        return self.scale_tril @ moved, crossed @ self.scale_tril.mT

    def _refine(self, z: torch.Tensor) -> torch.Tensor:
        """``z + K (k - A z)`` with ``K = L Q R^{-T}``: the Sigma^{-1}-orthogonal projection
        onto ``{A z = k}``; Q is read once (it is (batch, a, n) when the scale is batched)."""
        coefficients = _rows_times(self._r_inv_t, self.k - _rows_times(self.A, z))
        direction = _combine_rows(coefficients, self._basis_t)
        if not self._diagonal:
            return z + _rows_times(self.scale_tril, direction)
        return torch.addcmul(z, self.scale, direction)

    @lazy_property
    def scale_tril(self) -> torch.Tensor:
        """Lower Cholesky factor of the unconditional covariance Sigma (n x n)."""
        return torch.diag_embed(self.scale)

    @lazy_property
    def scale(self) -> torch.Tensor:
        """Unconditional standard deviations, sqrt(diag Sigma)."""
        return self._prior_variance.sqrt()

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
        return torch.broadcast_shapes(*batch_shapes), torch.Size(loc[-1:])

    def expand(self, batch_shape, _instance=None) -> LinearConstrainedNormal:
        new = self._get_checked_instance(LinearConstrainedNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        new.__dict__.update(self.__dict__)
        event = self.event_shape
        new.loc = self.loc.expand(batch_shape + event)
        # The caches that depend on loc (or k) follow the new batch shape; those of the
        # scale and A alone broadcast against it as they are.
        if "_mean" in self.__dict__:
            new._mean = self._mean.expand(batch_shape + event)
        super(LinearConstrainedNormal, new).__init__(batch_shape, event, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @constraints.dependent_property(is_discrete=False, event_dim=1)
    def support(self) -> AffineSubspace:
        return AffineSubspace(self._constraint, self.k)

    @property
    def mean(self) -> torch.Tensor:
        """The conditional mean ``mu_bar``."""
        return self._mean

    @property
    def mode(self) -> torch.Tensor:
        return self._mean

    @property
    def variance(self) -> torch.Tensor:
        """``diag Sigma_bar``, the squared row lengths of ``L N`` (``N`` an orthonormal
        basis of the whitened null space; see :attr:`_second_moment_factors`): no
        difference is taken, so each variance is accurate to a few ulps times the
        conditioning relative to itself, and a coordinate that the constraint fixes gets
        zero up to the rounding of the basis (exactly zero when its row of ``A`` is a unit
        vector). With a diagonal scale, ``scale^2 diag(I - Q Q^T)`` by
        :func:`_complement_diagonal` (leave-one-out factorisations for the rows of high
        leverage: O(n a^3) time, O(n a^2) memory); with a full covariance from the
        complete QR, O(n^2 a)."""
        return self._variance().expand(self.batch_shape + self.event_shape)

    def _variance(self) -> torch.Tensor:
        """:attr:`variance` before broadcasting to the batch shape."""
        if self._diagonal:
            complement = _complement_diagonal(self._whitened_t(), self._basis_t.mT)
            return self.scale.square() * complement
        factor, correction = self._second_moment_factors
        return factor.square().sum(-1) + correction.square().sum(-2)

    @property
    def stddev(self) -> torch.Tensor:
        """``sqrt(variance)``, with a zero gradient (not NaN) where the variance is exactly
        zero: there the constraint fixes the coordinate, so it stays zero nearby."""
        variance = self.variance
        positive = variance > 0
        return torch.where(positive, torch.where(positive, variance, 1.0).sqrt(), 0.0)

    @property
    def covariance_matrix(self) -> torch.Tensor:
        """The conditional covariance ``Sigma_bar = (L N)(L N)^T`` (n x n, rank n - a, see
        :attr:`variance`): forms an n x n matrix."""
        factor, correction = self._second_moment_factors
        bar = factor @ factor.mT + correction.mT @ correction
        bar = 0.5 * (bar + bar.mT)
        return bar.expand(self.batch_shape + self.event_shape + self.event_shape)

    @property
    def marginals(self) -> Normal:
        """The conditional marginal ``N(mu_bar_i, Sigma_bar_ii)`` of each coordinate.

        A coordinate that the constraint fixes has standard deviation 0, which ``Normal``
        rejects, so the result is built without argument validation.
        """
        return Normal(self.mean, self.stddev, validate_args=False)

    def entropy(self) -> torch.Tensor:
        """``H = (n - a)/2 (1 + log 2 pi) + 1/2 log det Sigma - 1/2 log det S
        + 1/2 log det(A A^T)``, with respect to the Hausdorff measure on the subspace."""
        dim = self.event_shape[0] - self.A.shape[-2]
        return (0.5 * dim - self._log_normalizer).expand(self.batch_shape)

    def _projects(self, value: torch.Tensor) -> bool:
        """Whether :meth:`log_prob` scores ``value`` by the whitened projection
        (:func:`_whitened_projection`): a diagonal scale and a value of the parameters'
        dtype (a finer value is scored against ``mu_bar`` in its own dtype)."""
        return self._diagonal and value.dtype == self.loc.dtype

    def _mahalanobis_from_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self._projects(value):
            _, projected = _whitened_projection(value, self.loc, self.scale, self._basis_t)
            return projected.square().sum(-1)
        diff = value - self._mean.to(value.dtype)
        if self._diagonal:
            return (diff / self.scale.to(value.dtype)).square().sum(-1)
        scale_tril = self.scale_tril.to(value.dtype)
        batch = torch.broadcast_shapes(diff.shape[:-1], scale_tril.shape[:-2])
        solved = torch.linalg.solve_triangular(
            scale_tril.expand(batch + scale_tril.shape[-2:]),
            diff.expand(batch + diff.shape[-1:]).unsqueeze(-1),
            upper=False,
        )
        return solved.squeeze(-1).square().sum(-1)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log density with respect to the Hausdorff measure on ``{z : A z = k}``.

        Raises ValueError (validation on or off) for a value that an
        :class:`AffineSubspaceTransform` built for another ``(A, k)`` mapped off this
        subspace: the symptom of a transform frozen while ``A`` or ``k`` depend on a latent.
        """
        _check_not_stale(value, self._constraint, self.k)
        value = torch.as_tensor(value, device=self.loc.device)
        check_value_shape(value.shape, self.batch_shape, self.event_shape, type(self).__name__)
        dtype = self.loc.dtype
        if value.is_floating_point():
            dtype = torch.promote_types(value.dtype, dtype)
        value = value.to(dtype)
        if self._validate_args and not bool(self._constraint._check(value, self.k).all()):
            raise ValueError(
                f"{type(self).__name__}.log_prob: a value is outside the support: "
                + self._constraint._out_of_support_message(value, self.k)
            )
        # Validation raised unless every value is on the subspace: no mask needed then.
        off_subspace = None if self._validate_args else ~self._constraint._check(value, self.k)
        if self._projects(value) and not self.A.requires_grad and not _functorch_active():
            basis_t, log_normalizer = self._detached_factors()
            return _ProjectedLogDensity.apply(
                value, self.loc, self.scale, basis_t, log_normalizer, off_subspace, self
            )
        return self._log_prob_recorded(value, off_subspace)

    def _log_prob_recorded(
        self, value: torch.Tensor, off_subspace: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`log_prob` (of a checked value of the promoted dtype) differentiated by
        autograd through the recorded factorisation: for a full covariance, an ``A`` that
        requires grad, and second derivatives of the diagonal-scale path."""
        log_prob = -0.5 * self._mahalanobis_from_mean(value) + self._log_normalizer.to(value.dtype)
        if off_subspace is None:
            return log_prob
        return log_prob.masked_fill(off_subspace, -math.inf)

    def _matheron_sample(self, sample_shape: torch.Size) -> torch.Tensor:
        shape = self._extended_shape(sample_shape)
        noise = _standard_normal(shape, dtype=self.loc.dtype, device=self.loc.device)
        return self._matheron_from_noise(noise)

    def _matheron_from_noise(self, noise: torch.Tensor) -> torch.Tensor:
        """Matheron's rule applied to standard normal ``noise`` of shape (..., n), in whitened
        form: ``z = mu_bar + L (noise - Q Q^T noise)``, then one refinement step.

        The projection is orthogonal, hence accurate however ill-conditioned ``A L`` is; the
        refinement step removes what rounding left of ``A z - k`` (see the class docstring).
        Every step is out of place: ``torch.jit.trace`` does not record ``no_grad``, so a
        write into an existing buffer (``out=``, ``sub_``) made safe by it is replayed with
        inputs that require grad, which autograd refuses (Pyro's JIT ELBOs failed so). The
        buffers it saved were a small part of the cost, which is reading the batched Q.
        """
        projected = noise - _combine_rows(_rows_times(self._basis_t, noise), self._basis_t)
        if self._diagonal:
            z = torch.addcmul(self._mean, self.scale, projected)
        else:
            z = self._mean + _rows_times(self.scale_tril, projected)
        return self._refine(z)

    def __repr__(self) -> str:
        # The covariance argument as stored: scale (diagonal) or its Cholesky factor.
        covariance = {"scale": self.scale} if self._diagonal else {"scale_tril": self.scale_tril}
        return parameters_repr(
            type(self).__name__, {"loc": self.loc, **covariance, "A": self.A, "k": self.k}
        )

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        """An exact sample; its gradient is the one chosen by ``grad_estimator``."""
        sample_shape = torch.Size(sample_shape)
        if self.grad_estimator == "pathwise":
            return self._matheron_sample(sample_shape)
        z = self.sample(sample_shape)
        proxy = self._mean.expand(z.shape)
        return z + (proxy - proxy.detach())

    def sample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        """An exact sample, without gradient."""
        with torch.no_grad():
            z = self._matheron_sample(torch.Size(sample_shape))
        # torch.jit.trace does not record no_grad (it only spares building the graph when
        # run eagerly): the detach is what keeps a traced replay, as in Pyro's JIT ELBOs,
        # from differentiating through the draw.
        return z.detach()


def _same_constraint(p: LinearConstrainedNormal, q: LinearConstrainedNormal) -> None:
    if p.event_shape != q.event_shape:
        raise ValueError(f"KL needs the same n, got {p.event_shape} and {q.event_shape}")
    try:
        same = bool((p.A == q.A).all()) and bool((p.k == q.k).all())
    except RuntimeError:
        same = False
    if not same:
        raise ValueError(
            "KL between LinearConstrainedNormals needs the same A and k (different affine "
            "subspaces make the KL infinite or undefined)"
        )


@register_kl(LinearConstrainedNormal, LinearConstrainedNormal)
def _kl_linear_constrained_normal(
    p: LinearConstrainedNormal, q: LinearConstrainedNormal
) -> torch.Tensor:
    """``KL(p || q) = -H_p - E_p[log q(z)]`` for two with the same A and k.

    ``E_p[(z - mu_bar_q)^T Sigma_q^{-1} (z - mu_bar_q)] = tr(Sigma_q^{-1} Sigma_bar_p)
    + (mu_bar_p - mu_bar_q)^T Sigma_q^{-1} (mu_bar_p - mu_bar_q)``, where, with
    ``Sigma_bar_p = (L_p N_p)(L_p N_p)^T`` (see ``variance``),
    ``tr(Sigma_q^{-1} Sigma_bar_p) = ||L_q^{-1} L_p N_p||_F^2``, a sum of squares:
    ``sum_i Sigma_bar_p,ii / s_q,i^2`` when q's covariance is diagonal (O(n a^2) when p's
    is too), O(n^3) otherwise.
    """
    _same_constraint(p, q)
    mean_diff = p.mean - q.mean
    if q._diagonal:
        q_variance = q.scale.square()
        trace = (p._variance() / q_variance).sum(-1)
        maha = (mean_diff.square() / q_variance).sum(-1)
    else:
        p_factor, p_correction = p._second_moment_factors
        q_tril = q.scale_tril

        def whiten(matrix: torch.Tensor) -> torch.Tensor:
            batch = torch.broadcast_shapes(q_tril.shape[:-2], matrix.shape[:-2])
            return torch.linalg.solve_triangular(
                q_tril.expand(batch + q_tril.shape[-2:]),
                matrix.expand(batch + matrix.shape[-2:]),
                upper=False,
            )

        trace = whiten(p_factor).square().sum((-2, -1)) + whiten(p_correction.mT).square().sum(
            (-2, -1)
        )
        maha = whiten(mean_diff.unsqueeze(-1)).squeeze(-1).square().sum(-1)
    cross_entropy = 0.5 * (trace + maha) - q._log_normalizer
    return cross_entropy - p.entropy()
