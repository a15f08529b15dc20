"""The arguments of :class:`~pyro_constrained.LinearConstrainedNormal`: their dtype, shapes and
broadcasting (always checked: a wrong shape has no meaning), and the constraints that torch's
own validation (``Distribution.__init__`` with ``validate_args``) checks their values against.

Split in two on purpose: :func:`parse_arguments` converts and shapes the arguments whatever
``validate_args`` says, and the value checks (finite, positive, lower Cholesky) are the
``arg_constraints`` that torch's validation loop runs. Two checks need the arguments before
they are stored and so run here when validating: a ``covariance_matrix`` must be positive
definite before its Cholesky factor is taken, and ``A`` must have full row rank before it is
factorised (in :class:`~pyro_constrained.LinearConstraint`).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.distributions import constraints

from constrained_ppl.arguments import LCN_GRAD_ESTIMATORS, check_grad_estimator
from pyro_constrained.linear_constraint import (
    LinearConstraint,
    _as_float_tensor,
    _broadcast_shapes,
    _check_finite,
    _check_rtol,
)


class _Finite(constraints.Constraint):
    """``base`` and finite (no NaN, no +-inf) in every entry: torch's ``real``,
    ``positive`` and ``lower_cholesky`` accept infinities, which no parameter here may
    hold."""

    is_discrete = False

    def __init__(self, base: constraints.Constraint):
        self.base = base
        self.event_dim = base.event_dim
        super().__init__()

    def check(self, value: torch.Tensor) -> torch.Tensor:
        finite = torch.isfinite(value)
        if self.event_dim:
            finite = finite.flatten(-self.event_dim).all(-1)
        return finite & self.base.check(value)

    def __repr__(self) -> str:
        return f"Finite({self.base!r})"


#: The constraints of the arguments as stored: ``loc``, the covariance as ``scale``
#: (diagonal) or ``scale_tril`` (a ``covariance_matrix`` argument is stored as its Cholesky
#: factor and checked as such, after the positive-definiteness check it needs first), ``A``
#: and ``k``. The attribute ``covariance_matrix`` of the distribution is the conditional
#: covariance (singular), not an argument, so it has no entry.
ARG_CONSTRAINTS = {
    "loc": _Finite(constraints.real_vector),
    "scale": _Finite(constraints.independent(constraints.positive, 1)),
    "scale_tril": _Finite(constraints.lower_cholesky),
    "A": _Finite(constraints.independent(constraints.real, 2)),
    "k": _Finite(constraints.real_vector),
}


def float_dtype(values) -> torch.dtype:
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


def _check_choices(scale, covariance_matrix, scale_tril, A, constraint, grad_estimator) -> None:
    check_grad_estimator(grad_estimator, LCN_GRAD_ESTIMATORS)
    if sum(p is not None for p in (scale, covariance_matrix, scale_tril)) != 1:
        raise ValueError("exactly one of scale, covariance_matrix or scale_tril must be given")
    if constraint is not None:
        if A is not None:
            raise ValueError(
                "give the constraint either as A or as constraint (a LinearConstraint), not both"
            )
        if not isinstance(constraint, LinearConstraint):
            raise ValueError(
                f"constraint must be a LinearConstraint, got {type(constraint).__name__}"
            )


def _covariance(scale, covariance_matrix, scale_tril, n, dtype, device, validate):
    """``(scale, scale_tril, batch shape)``, one of the first two None."""
    if scale is not None:
        scale = _as_float_tensor(scale, "scale", dtype, device)
        if scale.dim() == 0:
            scale = scale.expand(n)
        if scale.shape[-1] not in (1, n):
            raise ValueError(f"scale must have last dimension {n} (or 1), got {scale.shape}")
        scale = scale.expand(scale.shape[:-1] + (n,))
        return scale, None, scale.shape[:-1]
    name = "covariance_matrix" if covariance_matrix is not None else "scale_tril"
    matrix = covariance_matrix if covariance_matrix is not None else scale_tril
    matrix = _as_float_tensor(matrix, name, dtype, device)
    if matrix.dim() < 2 or matrix.shape[-2:] != (n, n):
        raise ValueError(f"{name} must have shape (..., {n}, {n}), got {matrix.shape}")
    if covariance_matrix is None:
        return None, matrix, matrix.shape[:-2]
    if validate:
        # Before the factorisation, whose result for a matrix that is not positive
        # definite would be checked (and named) as scale_tril instead.
        _check_finite("covariance_matrix", matrix)
        if not bool(constraints.positive_definite.check(matrix).all()):
            raise ValueError("covariance_matrix must be symmetric positive definite")
    # cholesky_ex, which traces and vmaps without a check on values; where the matrix is not
    # positive definite (validation off) the factor is NaN, as NumPyro's, not a partial one.
    scale_tril, info = torch.linalg.cholesky_ex(matrix)
    scale_tril = torch.where((info == 0)[..., None, None], scale_tril, torch.nan)
    return None, scale_tril, scale_tril.shape[:-2]


def _matrix_a(A, constraint, n, dtype, device) -> torch.Tensor:
    if constraint is not None:
        A = constraint.A
        if A.shape[-1] != n:
            raise ValueError(f"the constraint has n = {A.shape[-1]} columns, but loc has size {n}")
    elif A is None:
        A = torch.ones(1, n, dtype=dtype, device=device)
    else:
        A = _as_float_tensor(A, "A", dtype, device)
        if A.dim() < 2:
            raise ValueError(f"A must have shape (..., a, n), got {A.shape}")
        if A.shape[-1] != n:
            raise ValueError(f"A must have n = {n} columns (the size of loc), got shape {A.shape}")
    num_rows = A.shape[-2]
    if not 1 <= num_rows < n:
        raise ValueError(
            f"A must have between 1 and n - 1 = {n - 1} rows (rank a < n), got {num_rows}"
        )
    return A


def _right_hand_side(k, num_rows: int, dtype, device) -> torch.Tensor:
    if k is None:
        return torch.zeros(num_rows, dtype=dtype, device=device)
    k = _as_float_tensor(k, "k", dtype, device)
    # A real right-hand side broadcasts as torch does: a scalar or a last dimension of 1
    # gives every row the same value.
    if k.dim() == 0:
        k = k.unsqueeze(-1)
    if k.shape[-1] not in (1, num_rows):
        raise ValueError(
            f"k must have shape (..., a) with a = {num_rows} (the rows of A), or a last "
            f"dimension of 1, got {tuple(k.shape)}"
        )
    return k.expand(k.shape[:-1] + (num_rows,))


def _constraint_for(A, constraint, rtol, dtype, device, validate) -> LinearConstraint:
    """The :class:`LinearConstraint` of the distribution: built (validated, rank included,
    and factorised once per distribution) from ``A``, or the one given, converted to the
    parameters' dtype and device."""
    if constraint is None:
        return LinearConstraint._build(A, rtol, validate)
    if constraint.A.dtype != dtype or constraint.A.device != device:
        if torch.finfo(dtype).eps < torch.finfo(constraint.A.dtype).eps:
            # Factors rounded to a coarser dtype would cap the accuracy of the result at
            # that dtype's: refactorise in the finer one.
            constraint = LinearConstraint._build(
                constraint.A.to(dtype=dtype, device=device), constraint._rtol, False
            )
        else:
            constraint = constraint._replace(dtype=dtype, device=device)
    if rtol is not None:
        constraint = constraint._replace(rtol=rtol)
    return constraint


def parse_arguments(
    loc, scale, covariance_matrix, scale_tril, A, k, constraint, rtol, grad_estimator, validate
) -> SimpleNamespace:
    """The arguments converted to tensors of one dtype and device and checked for shape:
    ``loc`` (broadcast to the batch shape), ``scale`` or ``scale_tril`` (the other None),
    ``k``, ``constraint`` (a :class:`LinearConstraint`), ``batch_shape`` and ``n``.
    ``ValueError`` naming the argument for a wrong shape or choice, whatever ``validate``
    says; with ``validate``, also for a covariance matrix that is not positive definite and
    an ``A`` without full row rank (the values of the others are torch's validation's)."""
    _check_choices(scale, covariance_matrix, scale_tril, A, constraint, grad_estimator)
    rtol = _check_rtol(rtol)
    matrix_a = constraint.A if constraint is not None else A
    dtype = float_dtype((loc, scale, covariance_matrix, scale_tril, matrix_a, k))
    device = loc.device if isinstance(loc, torch.Tensor) else None
    loc = _as_float_tensor(loc, "loc", dtype, device)
    device = loc.device
    if loc.dim() < 1:
        raise ValueError(f"loc must have at least one dimension (the event), got {loc.shape}")
    n = loc.shape[-1]
    scale, scale_tril, cov_batch_shape = _covariance(
        scale, covariance_matrix, scale_tril, n, dtype, device, validate
    )
    A = _matrix_a(A, constraint, n, dtype, device)
    k = _right_hand_side(k, A.shape[-2], dtype, device)
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
        raise ValueError(f"the batch shapes of the parameters do not broadcast: {shapes}") from None
    return SimpleNamespace(
        loc=loc.expand(batch_shape + (n,)),
        scale=scale,
        scale_tril=scale_tril,
        k=k,
        constraint=_constraint_for(A, constraint, rtol, dtype, device, validate),
        batch_shape=batch_shape,
        n=n,
    )
