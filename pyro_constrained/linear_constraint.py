"""The linear equality constraint ``A z = k``, validated and factorised once.

The math: ``docs/distributions/linear_constrained_normal.md``.


Holds :class:`LinearConstraint` and the linear algebra that it and
:class:`~pyro_constrained.linear_constrained_normal.LinearConstrainedNormal` share: products
over the last dimensions, the row-sorted QR, and the support tolerance.
"""

from __future__ import annotations

import math

import torch

from constrained_ppl.conditioning import DEFAULT_RTOL_ULPS, check_full_row_rank
from constrained_ppl.conditioning import check_rtol as _check_rtol
from constrained_ppl.conditioning import default_rtol as _default_rtol
from pyro_constrained._autograd import float64_values
from pyro_constrained.exactly_k_tracing import static_under_trace

__all__ = ["DEFAULT_RTOL_ULPS", "LinearConstraint"]


def default_rtol(dtype) -> float:
    """The default support tolerance for values of ``dtype``: 1e-6 in float64, 64 eps =
    7.6e-6 in float32 (see :func:`constrained_ppl.conditioning.default_rtol`)."""
    return _default_rtol(torch.finfo(dtype).eps)


def _rows_times(matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """``matrix @ vector`` over the last dimensions: (..., a, n) x (..., n) -> (..., a).

    Written as a row vector times the transposed matrix so that an unbatched ``matrix`` and
    a batched ``vector`` fold into one matrix-matrix product instead of a batch of
    matrix-vector products. Mixed float dtypes are promoted, as torch's elementwise
    operations promote them (``matmul`` itself refuses them).
    """
    if matrix.dtype != vector.dtype:
        dtype = torch.promote_types(matrix.dtype, vector.dtype)
        matrix, vector = matrix.to(dtype), vector.to(dtype)
    if matrix.dim() > 2 and matrix.shape[-2] == 1:
        # A batch of single dot products: a fused multiply-sum is several times faster than
        # the batched matrix product, which launches one tiny product per batch element.
        return (matrix * vector.unsqueeze(-2)).sum(-1)
    if matrix.dim() == 2:
        if vector.dim() == 2:
            # The same product transposed, (a, n) x (n, B): MKL's float32 GEMM takes 2-3x
            # as long for an output of a few columns (B x a) as for one of many (a x B),
            # and this product runs several times in a regression head's training step.
            return (matrix @ vector.mT).mT
        return vector @ matrix.mT
    # A batched matrix: a batch of matrix-vector products. (An unsqueezed vector is kept
    # away from the unbatched case: matmul folds a contiguous batch into one product but
    # falls back to one tiny product per row for a transposed one.)
    return (vector.unsqueeze(-2) @ matrix.mT).squeeze(-2)


def _combine_rows(coefficients: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``coefficients^T @ rows``: (..., a) x (..., a, n) -> (..., n), dtypes promoted."""
    if coefficients.dtype != rows.dtype:
        dtype = torch.promote_types(coefficients.dtype, rows.dtype)
        coefficients, rows = coefficients.to(dtype), rows.to(dtype)
    if rows.dim() == 2:
        # One product for the whole batch (an unsqueezed, transposed batch of coefficients,
        # as _rows_times returns, would make matmul run one product per row).
        return coefficients @ rows
    return (coefficients.unsqueeze(-2) @ rows).squeeze(-2)


def _row_sorted_qr(tall: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    with torch.no_grad():  # the order is an index: nothing to differentiate
        norms = torch.linalg.vector_norm(tall, dim=-1)
        order = torch.sort(norms, dim=-1, descending=True).indices
        inverse_order = torch.sort(order, dim=-1).indices
    if tall.dim() == 2:
        # One matrix (a scale shared by a batch): index_select is several times cheaper
        # than take_along_dim with its broadcast index.
        q, r = torch.linalg.qr(tall.index_select(0, order))
        return q.index_select(0, inverse_order), r
    q, r = torch.linalg.qr(torch.take_along_dim(tall, order.unsqueeze(-1), dim=-2))
    return torch.take_along_dim(q, inverse_order.unsqueeze(-1), dim=-2), r


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


def _leverage_order(tall: torch.Tensor, leverage: torch.Tensor):
    order = torch.sort(leverage.detach(), dim=-1, descending=True, stable=True).indices
    order = order.expand(tall.shape[:-1])
    return order, torch.sort(order, dim=-1).indices


def _complete_complement(tall: torch.Tensor, leverage: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis (..., n, n - a) of the orthogonal complement of the range of
    ``tall`` (..., n, a), full column rank: the last n - a columns of the complete QR
    factor, without autograd history (the callers differentiate it by hand); ``leverage``
    (..., n) are the leverages ``||Q_i||^2`` of ``tall``'s reduced QR. Its rows are
    accurate to a few ulps relative to their own length, also when that length is tiny
    (a coordinate almost fixed by the constraint), which ``1 - ||Q_i||^2`` is not; a row
    that the constraint fixes exactly comes out as exact zeros when the reflections do
    not mix it.
    """
    with torch.no_grad():
        tall = tall.detach()
        order, inverse_order = _leverage_order(tall, leverage)
        sorted_rows = torch.take_along_dim(tall, order.unsqueeze(-1), dim=-2)
        q = torch.linalg.qr(sorted_rows, mode="complete").Q
        return torch.take_along_dim(q, inverse_order.unsqueeze(-1), dim=-2)[..., tall.shape[-1] :]


_complete_complement.__doc__ += _LEVERAGE_ORDER_NOTE


def _complement_diagonal(tall: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``diag(I - Q Q^T)`` (..., n) for ``tall = Q R`` (..., n, a), accurate to a few
    ulps times its componentwise condition number, and differentiable (by autograd, to
    any order) with the same accuracy. O(n a^3) time, O(n a^2) memory.

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
    leverage = basis.square().sum(-1)
    special = torch.topk(leverage.detach(), m, dim=-1).indices  # (..., m)
    positions = torch.arange(n, device=tall.device)
    others = positions != special.unsqueeze(-1)  # (..., m, n)
    left_out = tall.unsqueeze(-3) * others.unsqueeze(-1)  # row i zeroed, (..., m, n, a)
    with torch.no_grad():
        singular = (_row_sorted_qr(left_out.detach())[1].diagonal(dim1=-2, dim2=-1) == 0).any(-1)
    # A singular factor has no derivative (its backward divides by the zero): factorise the
    # whole matrix there instead, and discard the result.
    left_out = torch.where(singular.unsqueeze(-1).unsqueeze(-1), tall.unsqueeze(-3), left_out)
    _, r_factor = _row_sorted_qr(left_out)  # (..., m, a, a)
    rows = torch.take_along_dim(tall, special.unsqueeze(-1), dim=-2)  # (..., m, a)
    solved = torch.linalg.solve_triangular(r_factor.mT, rows.unsqueeze(-1), upper=False)
    values = torch.where(singular, 0.0, 1 / (1 + solved.squeeze(-1).square().sum(-1)))
    return (1 - leverage).scatter(-1, special, values)


def _broadcast_shapes(*shapes) -> torch.Size:
    """``torch.broadcast_shapes`` of plain shapes, without the symbolic-shape machinery
    that makes it cost ~10 us a call (a distribution is built at every training step);
    ``RuntimeError`` when they do not broadcast, as torch's."""
    ndim = max(map(len, shapes), default=0)
    result = [1] * ndim
    for shape in shapes:
        for i, size in enumerate(shape, ndim - len(shape)):
            if size != 1:
                if result[i] != 1 and result[i] != size:
                    raise RuntimeError(f"shapes {shapes} do not broadcast")
                result[i] = size
    return torch.Size(result)


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{name} must be finite, but it contains NaN or +-inf")


def _as_float_tensor(value, name: str, dtype: torch.dtype, device) -> torch.Tensor:
    tensor = torch.as_tensor(value, device=device)
    # Real: floating, integer of any width (as NumPyro's jnp.integer) or bool, which is
    # every dtype of data but the complex ones.
    if tensor.is_complex():
        raise ValueError(f"{name} must be a real array, got dtype {tensor.dtype}")
    return tensor.to(dtype)


def _factorise(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Q1^T, R1^{-T}, R1)`` of the reduced QR ``A^T = Q1 R1`` (rows sorted by norm,
    see :func:`_row_sorted_qr`): O(n a^2), the one factorisation of ``A``."""
    q, r = _row_sorted_qr(A.mT)
    # An explicit triangular inverse (a x a) is as accurate here as a substitution, and a
    # small matrix product broadcasts where a batched solve would not.
    identity = torch.eye(r.shape[-1], dtype=r.dtype, device=r.device)
    r_inv_t = torch.linalg.solve_triangular(r, identity, upper=True).mT
    return q.mT.contiguous(), r_inv_t, r


class LinearConstraint:
    r"""The linear equalities ``A z = k``: ``A`` (..., a, n) of full row rank a <= n,
    validated and factorised once, for any number of right-hand sides ``k``.

    **Factorisation.** The reduced QR ``A^T = Q1 R1`` (Q1: n x a with orthonormal columns,
    R1: a x a upper triangular; Householder reflections on the rows sorted by norm). Then
    ``A A^T = R1^T R1``, ``A^T (A A^T)^{-1} = Q1 R1^{-T}`` and
    ``1/2 log det(A A^T) = sum log|R1_ii|``. Every use costs O(n a) per right-hand side;
    the orthonormal basis of null(A) (n x (n - a), for the bijection of AutoGuides and
    HMC/NUTS) is computed from a complete QR the first time it is needed and then kept.

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
    >>> import torch
    >>> from pyro_constrained import LinearConstraint
    >>> c = LinearConstraint(torch.tensor([[1.0, 1.0, 1.0]]))  # z1 + z2 + z3 = k
    >>> c.a, c.n
    (1, 3)
    >>> y = torch.tensor([1.0, 2.0, 3.0])
    >>> c.residual(y)  # A y - k, with k = 0 by default
    tensor([6.])
    >>> torch.allclose(c.project(y, k=3.0), torch.tensor([0.0, 1.0, 2.0]), atol=1e-6)
    True
    >>> d = c.normal(torch.zeros(2, 3), torch.ones(3), k=torch.tensor([[1.0], [2.0]]))
    >>> d.batch_shape, torch.allclose(d.mean.sum(-1), torch.tensor([1.0, 2.0]))
    (torch.Size([2]), True)
    """

    def __init__(self, A: torch.Tensor, *, rtol: float | None = None):
        A = torch.as_tensor(A)
        if not A.is_floating_point():
            A = _as_float_tensor(A, "A", torch.get_default_dtype(), A.device)
        self._setup(A, _check_rtol(rtol), validate=True)

    @classmethod
    def _build(cls, A: torch.Tensor, rtol: float | None, validate: bool) -> LinearConstraint:
        """A constraint from a float tensor ``A``, checked only when ``validate``: how
        :class:`LinearConstrainedNormal` builds one for its ``A=`` argument."""
        constraint = cls.__new__(cls)
        constraint._setup(A, rtol, validate)
        return constraint

    def _setup(self, A: torch.Tensor, rtol: float | None, validate: bool) -> None:
        if A.dim() < 2:
            raise ValueError(f"A must have shape (..., a, n), got {tuple(A.shape)}")
        # Python ints: under torch.jit.trace a size is a tensor, and a float times it a tensor
        # of the default dtype, float32, which would round the float64 offset below.
        with static_under_trace():
            num_rows, n = (int(size) for size in A.shape[-2:])
        if not 1 <= num_rows <= n:
            raise ValueError(
                f"A must have between 1 and n = {n} rows (full row rank a <= n), got {num_rows}"
            )
        if validate:
            _check_finite("A", A)
        self.A = A
        self._rtol = rtol
        self._basis_t, self._r_inv_t, r = _factorise(A)
        self._log_det_half = r.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)
        # The parts of a LinearConstrainedNormal's log-density that depend on A alone,
        # -1/2 log det(A A^T) - (n - a)/2 log(2 pi), and |A| for the support tolerance:
        # once per constraint, not per distribution or per check.
        self._log_density_offset = -self._log_det_half - 0.5 * (n - num_rows) * math.log(
            2 * math.pi
        )
        self._abs_A = A.detach().abs()
        self._null_basis_cache = None
        if validate:
            # R1 has the singular values of A (a x a: no n-sized SVD); they are judged with
            # A's rows scaled to unit length (see constrained_ppl.conditioning).
            check_full_row_rank(float64_values(r), n, torch.finfo(A.dtype).eps)

    def _replace(self, *, rtol: float | None = None, dtype=None, device=None) -> LinearConstraint:
        """A copy sharing the factorisation, with another ``rtol`` or converted (O(n a))."""
        new = LinearConstraint.__new__(LinearConstraint)
        new.__dict__.update(self.__dict__)
        if rtol is not None:
            new._rtol = rtol
        if dtype is not None or device is not None:
            for name in (
                "A",
                "_basis_t",
                "_r_inv_t",
                "_log_det_half",
                "_log_density_offset",
                "_abs_A",
            ):
                setattr(new, name, getattr(self, name).to(dtype=dtype, device=device))
            if self._null_basis_cache is not None:
                new._null_basis_cache = self._null_basis_cache.to(dtype=dtype, device=device)
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

    def _rtol_for(self, dtype: torch.dtype) -> float:
        """The tolerance for a value of ``dtype``: the default is that of the less precise
        of the value's and ``A``'s dtypes (a float32 value is on a float64 subspace only to
        float32 precision); a given ``rtol`` is used as given."""
        if self._rtol is not None:
            return self._rtol
        return max(default_rtol(dtype), default_rtol(self.A.dtype))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(a={self.a}, n={self.n}, rtol={self.rtol:.3g})"

    def _k_like(self, k, reference: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(self.A.dtype, reference.dtype)
        if k is None:
            return torch.zeros(self.a, dtype=dtype, device=self.A.device)
        k = _as_float_tensor(k, "k", dtype, self.A.device)
        if k.dim() == 0:
            k = k.unsqueeze(-1)
        if k.shape[-1] not in (1, self.a):
            raise ValueError(
                f"k must have shape (..., a) with a = {self.a} (the rows of A), or a last "
                f"dimension of 1, got {tuple(k.shape)}"
            )
        return k.expand(k.shape[:-1] + (self.a,))

    def _correct(self, z: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``z - A^T (A A^T)^{-1} (A z - k) = z - Q1 R1^{-T} (A z - k)``: the Euclidean
        projection of ``z`` onto ``{A z = k}``, O(n a) per point."""
        coefficients = _rows_times(self._r_inv_t, _rows_times(self.A, z) - k)
        return z - _combine_rows(coefficients, self._basis_t)

    def residual(self, z: torch.Tensor, k: torch.Tensor | float | None = None) -> torch.Tensor:
        """``A z - k``, shape (..., a): what is left of each equality (for reporting
        violations). ``k`` defaults to zeros and broadcasts with ``z``'s batch."""
        z = torch.as_tensor(z, device=self.A.device)
        if not z.is_floating_point():
            z = z.to(self.A.dtype)
        if z.dim() < 1 or z.shape[-1] != self.n:
            raise ValueError(f"z must have shape (..., {self.n}), got {tuple(z.shape)}")
        return _rows_times(self.A, z) - self._k_like(k, z)

    def project(self, y: torch.Tensor, k: torch.Tensor | float | None = None) -> torch.Tensor:
        """The Euclidean projection ``argmin_{A z = k} ||z - y||`` of each ``y`` (..., n):
        ``y - A^T (A A^T)^{-1} (A y - k)``, computed as ``y - Q1 R1^{-T} (A y - k)`` and
        repeated once (iterative refinement: the second step removes what rounding left of
        the residual, so the result satisfies the support tolerance). O(n a) per point;
        differentiable in ``y`` and ``k``."""
        y = torch.as_tensor(y, device=self.A.device)
        if not y.is_floating_point():
            y = y.to(self.A.dtype)
        if y.dim() < 1 or y.shape[-1] != self.n:
            raise ValueError(f"y must have shape (..., {self.n}), got {tuple(y.shape)}")
        k = self._k_like(k, y)
        return self._correct(self._correct(y, k), k)

    def _offset(self, k: torch.Tensor) -> torch.Tensor:
        """The point of ``{A z = k}`` nearest the origin, ``Q1 R1^{-T} k`` (refined)."""
        z0 = _combine_rows(_rows_times(self._r_inv_t, k), self._basis_t)
        return self._correct(z0, k)

    @property
    def _null_basis(self) -> torch.Tensor:
        """An orthonormal basis of null(A), (..., n, n - a): the last columns of the complete
        QR factor of ``A^T``. O(n^2 a) the first time, then kept (AutoGuides build the
        bijection at every step)."""
        if self._null_basis_cache is None:
            q = torch.linalg.qr(self.A.detach().mT, mode="complete").Q
            self._null_basis_cache = q[..., :, self.a :]
        return self._null_basis_cache

    def _violation(self, z: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(|A z - k|, |A| |z| + |k|)``, each (..., a), in the promoted dtype."""
        if not z.is_floating_point():
            z = z.to(self.A.dtype)
        residual = _rows_times(self.A, z) - k
        bound = _rows_times(self._abs_A, z.abs()) + k.abs()
        return residual.abs(), bound

    def _check(self, z: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Whether each point ``z`` satisfies ``A z = k`` to the tolerance (see the class)."""
        A = self.A
        if (
            A.dim() == 2
            and z.dim() == 2
            and z.dtype == A.dtype == k.dtype
            and (k.dim() == 1 or (k.dim() == 2 and k.shape[0] in (1, z.shape[0])))
        ):
            # One matrix and a batch of points (a regression head's targets, checked at
            # every step with validation off): the same test with the sums and the scaling
            # fused into the products, (a, n) x (n, B) as in _rows_times; 8 ops, not 11.
            rtol = self._rtol_for(z.dtype)
            k_columns = k.mT if k.dim() == 2 else k.unsqueeze(-1)  # (a, B) or (a, 1)
            scaled_bound = torch.addmm(
                k_columns.abs(), self._abs_A, z.abs().mT, beta=rtol, alpha=rtol
            )
            residual = torch.addmm(k_columns, A, z.mT, beta=-1)
            return (residual.abs() <= scaled_bound).all(0)
        residual, bound = self._violation(z, k)
        rtol = self._rtol_for(z.dtype if z.is_floating_point() else self.A.dtype)
        return (residual <= rtol * bound).all(-1)

    def _out_of_support_message(self, z: torch.Tensor, k: torch.Tensor) -> str:
        """What a value off the subspace violates, and how to loosen the check."""
        with torch.no_grad():
            not_finite = int((~torch.isfinite(z.detach())).any(-1).sum())
            if not_finite:  # their residuals and bounds are NaN: nothing to compare
                return f"{not_finite} value(s) have NaN or infinite entries."
            residual, bound = self._violation(z.detach(), k.detach())
            rtol = self._rtol_for(z.dtype if z.is_floating_point() else self.A.dtype)
            ratio = residual / bound.clamp(min=torch.finfo(bound.dtype).tiny)
            worst = int(ratio.flatten().argmax())
            failing = int((residual > rtol * bound).any(-1).sum())
        return (
            f"{failing} value(s) do not satisfy A z = k to the tolerance "
            f"|A z - k| <= rtol * (|A| |z| + |k|) per row: the largest violation is a "
            f"residual of {float(residual.flatten()[worst]):.3g} against a bound "
            f"(|A| |z| + |k|) of {float(bound.flatten()[worst]):.3g}, a relative residual of "
            f"{float(ratio.flatten()[worst]):.3g}, with rtol = {rtol:.3g} in force. If the "
            f"values are right to a known relative precision (measured data), pass rtol= "
            f"that precision to LinearConstraint or LinearConstrainedNormal (for example "
            f"rtol={max(float(ratio.max()) * 2, rtol):.1g}); otherwise project them first "
            f"with LinearConstraint.project."
        )

    def normal(
        self,
        loc: torch.Tensor,
        scale: torch.Tensor | None = None,
        *,
        covariance_matrix: torch.Tensor | None = None,
        scale_tril: torch.Tensor | None = None,
        k: torch.Tensor | float | None = None,
        grad_estimator: str = "marginal_expectation",
        validate_args: bool | None = None,
    ):
        """``LinearConstrainedNormal(loc, ..., constraint=self, k=k)``: ``N(loc, Sigma)``
        conditioned on ``A z = k``, reusing this factorisation of ``A`` (per call
        O(B n a^2) for a batch of B scales, O(B n a) when the scale is shared)."""
        from pyro_constrained.linear_constrained_normal import LinearConstrainedNormal

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
