"""A Gaussian conditioned on linear equalities ``A z = k``.

The math: ``docs/distributions/linear_constrained_normal.md``.

Holds :class:`LinearConstrainedNormal` and registers its KL rule (``register_kl``). Its
parts live beside it: the arguments and their constraints in ``_lcn_arguments``, the
support and its bijection (registered with ``biject_to`` and ``transform_to`` for
AutoGuides and HMC/NUTS) in :mod:`pyro_constrained.affine_subspace`, and the
log-density's autograd Function and the KL divergence in ``_lcn_math``.
"""

from __future__ import annotations

import math

import pyro
import torch
from pyro.distributions import Normal, TorchDistribution
from torch.distributions import constraints
from torch.distributions.kl import register_kl
from torch.distributions.utils import lazy_property

from constrained_ppl.arguments import LCN_GRAD_ESTIMATORS, check_value_shape, keyword_only
from constrained_ppl.conditioning import warn_if_unresolvable
from pyro_constrained._autograd import float64_values, is_differentiated
from pyro_constrained._lcn_arguments import ARG_CONSTRAINTS, parse_arguments
from pyro_constrained._lcn_math import (
    _ProjectedLogDensity,
    _whitened_projection,
    kl_linear_constrained_normal,
)
from pyro_constrained._repr import parameters_repr
from pyro_constrained.affine_subspace import (
    MOVED_SUPPORT_HINT,
    AffineSubspace,
    AffineSubspaceTransform,
    may_come_from_a_frozen_bijection,
    moving_subspaces,
    refuse_a_moved_support,
)
from pyro_constrained.exactly_k_tracing import static_under_trace
from pyro_constrained.linear_constraint import (
    LinearConstraint,
    _combine_rows,
    _complement_diagonal,
    _complete_complement,
    _row_sorted_qr,
    _rows_times,
)

__all__ = [
    "AffineSubspace",
    "AffineSubspaceTransform",
    "LinearConstrainedNormal",
    "moving_subspaces",
]

#: The options of ``grad_estimator`` (the name this module had for them).
GRAD_ESTIMATORS = LCN_GRAD_ESTIMATORS


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
    Shapes are checked whatever ``validate_args`` says; the values of the arguments are
    checked by torch's own validation against ``arg_constraints``, which name the
    attributes that store them: ``loc``, ``scale`` or ``scale_tril`` (a
    ``covariance_matrix`` argument is stored as its Cholesky factor, after a
    positive-definiteness check), ``A`` and ``k``. The attribute :attr:`covariance_matrix`
    is the conditional covariance (rank n - a), not an argument, and has no entry.

    **A support that moves.** HMC/NUTS and AutoGuides build the bijection onto a latent
    site's support once, at the first trace. Where ``A`` or ``k`` depend on another latent
    variable, later values then lie on the first subspace: with validation on that is a
    ``ValueError`` naming :class:`~pyro_constrained.LinearConstrainedNormalReparam`, the
    exact remedy. With validation off (as Pyro's NUTS runs its warmup) the same error is
    raised where the value and ``A`` or ``k`` are all differentiated, the mark of inference
    on a moving support; any other value off the support scores ``-inf``.

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
    the QR; its second derivatives differentiate that formula with ``Q`` from the recorded
    factorisation (also under ``torch.func``).

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

    arg_constraints = ARG_CONSTRAINTS
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
        # torch's own rule for the default: the class-wide setting unless given.
        validate = self._validate_args if validate_args is None else validate_args
        parsed = parse_arguments(
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
        self.loc = parsed.loc
        self._diagonal = parsed.scale is not None
        if self._diagonal:
            self.scale = parsed.scale
        else:
            self.scale_tril = parsed.scale_tril
        self.k = parsed.k
        self._constraint = parsed.constraint
        self.A = parsed.constraint.A
        self.grad_estimator = grad_estimator
        # torch's validation checks the values of the arguments given (arg_constraints).
        super().__init__(parsed.batch_shape, torch.Size((parsed.n,)), validate_args=validate_args)

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
                float64_values(r_factor),
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
        """A view of this distribution with batch shape ``batch_shape`` (an instance of the same
        class whose parameters are broadcast, not an ``ExpandedDistribution``). Raises
        ``ValueError`` where the current batch shape does not broadcast to ``batch_shape``."""
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
        with static_under_trace():  # a Python int, as in LinearConstraint._setup
            dim = int(self.event_shape[0] - self.A.shape[-2])
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

        A value off the subspace raises ``ValueError`` with validation on (naming, besides
        the residual, the usual cause when the value came from inference: HMC/NUTS or an
        AutoGuide froze the bijection of a site whose ``A`` or ``k`` depend on a latent) and
        scores ``-inf`` with validation off.
        """
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
                + MOVED_SUPPORT_HINT
            )
        # Validation raised unless every value is on the subspace: no mask needed then.
        off_subspace = None if self._validate_args else ~self._constraint._check(value, self.k)
        if off_subspace is not None and may_come_from_a_frozen_bijection(self, value):
            refuse_a_moved_support(off_subspace, type(self).__name__)
        if self._projects(value) and not is_differentiated(self.A):
            basis_t, log_normalizer = self._detached_factors()
            return _ProjectedLogDensity.apply(
                value, self.loc, self.scale, self.A, basis_t, log_normalizer, off_subspace
            )
        return self._log_prob_recorded(value, off_subspace)

    def _log_prob_recorded(
        self, value: torch.Tensor, off_subspace: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`log_prob` (of a checked value of the promoted dtype) differentiated by
        autograd through the recorded factorisation: for a full covariance, an ``A`` that
        requires grad, and a value of another dtype than the parameters."""
        log_prob = -0.5 * self._mahalanobis_from_mean(value) + self._log_normalizer.to(value.dtype)
        if off_subspace is None:
            return log_prob
        return log_prob.masked_fill(off_subspace, -math.inf)

    def _matheron_sample(self, sample_shape: torch.Size) -> torch.Tensor:
        shape = self._extended_shape(sample_shape)
        noise = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        return self._matheron_from_noise(noise)

    def _matheron_from_noise(self, noise: torch.Tensor) -> torch.Tensor:
        """Matheron's rule applied to standard normal ``noise`` of shape (..., n), in whitened
        form: ``z = mu_bar + L (noise - Q Q^T noise)``, then one refinement step.

        The projection is orthogonal, hence accurate however ill-conditioned ``A L`` is; the
        refinement step removes what rounding left of ``A z - k`` (see the class docstring).
        Every step is out of place: ``torch.jit.trace`` does not record ``no_grad``, so a
        write into an existing buffer (``out=``, ``sub_``) made safe by it would be replayed
        with inputs that require grad, which autograd refuses (Pyro's JIT ELBOs replay so).
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


register_kl(LinearConstrainedNormal, LinearConstrainedNormal)(kl_linear_constrained_normal)
