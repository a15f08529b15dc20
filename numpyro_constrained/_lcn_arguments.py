"""The one validation layer of :class:`~numpyro_constrained.LinearConstrainedNormal`: the
constructor's arguments converted to one float dtype and checked (:func:`parse_arguments`),
and NumPyro's ``arg_constraints`` check of the held parameters (:func:`check_held`).

As in NumPyro's own ``validate_args``, checks on values run under
``jax.ensure_compile_time_eval()`` on concrete arrays only: constants closed over inside
``jit`` or ``vmap`` are checked, tracers are skipped; shapes are always checked.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import constraints
from numpyro.util import not_jax_tracer

from constrained_ppl.arguments import LCN_GRAD_ESTIMATORS, check_grad_estimator
from numpyro_constrained.linear_constraint import LinearConstraint, _check_finite, _check_rtol

#: ``LinearConstrainedNormal.arg_constraints``: the constructor's arguments.
ARG_CONSTRAINTS = {
    "loc": constraints.real_vector,
    "scale": constraints.independent(constraints.positive, 1),
    "covariance_matrix": constraints.positive_definite,
    "scale_tril": constraints.lower_cholesky,
    "A": constraints.independent(constraints.real, 2),
    "k": constraints.real_vector,
}


class Arguments(NamedTuple):
    """The constructor's arguments as the distribution holds them."""

    loc: jax.Array
    factor: jax.Array  # the standard deviations (diagonal) or the Cholesky factor of Sigma
    diagonal: bool
    constraint: LinearConstraint
    k: jax.Array
    batch_shape: tuple[int, ...]
    grad_estimator: str


def parse_arguments(
    loc,
    scale,
    covariance_matrix,
    scale_tril,
    A,
    k,
    constraint: LinearConstraint | None,
    rtol,
    grad_estimator,
    validate: bool,
) -> Arguments:
    """The constructor's arguments in one float dtype, checked (shapes always, values where
    concrete and ``validate``); ``A`` validated and factorised as a :class:`LinearConstraint`
    unless one is given."""
    grad_estimator = check_grad_estimator(grad_estimator, LCN_GRAD_ESTIMATORS)
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
    rtol = _check_rtol(rtol)
    # Under compile-time evaluation, arrays closed over inside jit stay concrete through the
    # conversions below and their values get checked; tracers are converted (and staged)
    # as usual and only their shapes are checked.
    with jax.ensure_compile_time_eval():
        matrix_a = constraint.A if constraint is not None else A
        dtype = _float_dtype((loc, scale, covariance_matrix, scale_tril, matrix_a, k))
        loc = _float_array(loc, "loc", dtype)
        if loc.ndim < 1:
            raise ValueError(f"loc must have at least one dimension (the event), got {loc.shape}")
        if validate:
            _check_finite("loc", loc)
        n = loc.shape[-1]
        if scale is not None:
            factor, factor_name = _scale(scale, n, dtype, validate), "scale"
        elif covariance_matrix is not None:
            factor = _covariance_factor(covariance_matrix, n, dtype, validate)
            factor_name = "scale_tril"
        else:
            factor = _square_matrix(scale_tril, "scale_tril", n, dtype, validate)
            factor_name = "scale_tril"
        A = _constraint_matrix(A, constraint, n, dtype, validate)
        k = _right_hand_side(k, A.shape[-2], dtype, validate)
        factor_event_ndim = 1 if scale is not None else 2
        batch_shape = _broadcast_batch_shapes(
            {
                "loc": loc.shape[:-1],
                factor_name: factor.shape[: factor.ndim - factor_event_ndim],
                "A": A.shape[:-2],
                "k": k.shape[:-1],
            }
        )
    constraint = _resolved_constraint(constraint, A, rtol, validate)
    return Arguments(loc, factor, scale is not None, constraint, k, batch_shape, grad_estimator)


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


def _concrete(value):
    """``value`` where it is concrete, else None: a check on values runs only on concrete
    arrays (NumPyro's rule; a tracer cannot be inspected)."""
    return value if not_jax_tracer(value) else None


def _scale(scale, n: int, dtype, validate: bool) -> jax.Array:
    """The standard deviations, (..., n); a scalar or a last dimension of 1 is broadcast."""
    scale = _float_array(scale, "scale", dtype)
    if scale.ndim == 0:
        scale = scale[None]
    if scale.shape[-1] not in (1, n):
        raise ValueError(f"scale must have last dimension {n} (or 1), got {scale.shape}")
    if validate:
        _check_finite("scale", scale)
    return jnp.broadcast_to(scale, scale.shape[:-1] + (n,))


def _square_matrix(matrix, name: str, n: int, dtype, validate: bool) -> jax.Array:
    matrix = _float_array(matrix, name, dtype)
    if matrix.ndim < 2 or matrix.shape[-2:] != (n, n):
        raise ValueError(f"{name} must have shape (..., {n}, {n}), got {matrix.shape}")
    if validate:
        _check_finite(name, matrix)
    return matrix


def _covariance_factor(covariance_matrix, n: int, dtype, validate: bool) -> jax.Array:
    """The lower Cholesky factor of ``covariance_matrix``, checked positive definite."""
    matrix = _square_matrix(covariance_matrix, "covariance_matrix", n, dtype, validate)
    # A tracer gives a traced answer: checked only where concrete.
    positive_definite = _concrete(constraints.positive_definite(matrix))
    if validate and positive_definite is not None and not np.all(positive_definite):
        raise ValueError("covariance_matrix must be symmetric positive definite")
    return jnp.linalg.cholesky(matrix)


def _constraint_matrix(A, constraint, n: int, dtype, validate: bool) -> jax.Array:
    """``A`` (..., a, n) in ``dtype``: the given constraint's, the given matrix, or the
    default single row of ones."""
    if constraint is not None:
        A = constraint.A if constraint.A.dtype == dtype else constraint.A.astype(dtype)
        if A.shape[-1] != n:
            raise ValueError(f"the constraint has n = {A.shape[-1]} columns, but loc has size {n}")
    elif A is None:
        A = jnp.ones((1, n), dtype=dtype)
    else:
        A = _float_array(A, "A", dtype)
        if A.ndim < 2:
            raise ValueError(f"A must have shape (..., a, n), got {A.shape}")
        if A.shape[-1] != n:
            raise ValueError(f"A must have n = {n} columns (the size of loc), got shape {A.shape}")
        if validate:
            _check_finite("A", A)
    if not 1 <= A.shape[-2] < n:
        raise ValueError(
            f"A must have between 1 and n - 1 = {n - 1} rows (rank a < n), got {A.shape[-2]}"
        )
    return A


def _right_hand_side(k, num_rows: int, dtype, validate: bool) -> jax.Array:
    """``k`` (..., a); default zeros. A real right-hand side broadcasts as NumPy does: a
    scalar or a last dimension of 1 gives every row the same value."""
    if k is None:
        return jnp.zeros(num_rows, dtype=dtype)
    k = _float_array(k, "k", dtype)
    if k.ndim == 0:
        k = k[None]
    if k.shape[-1] not in (1, num_rows):
        raise ValueError(
            f"k must have shape (..., a) with a = {num_rows} (the rows of A), or a "
            f"last dimension of 1, got {tuple(k.shape)}"
        )
    if validate:
        _check_finite("k", k)
    return jnp.broadcast_to(k, k.shape[:-1] + (num_rows,))


def _broadcast_batch_shapes(batch_shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    try:
        return tuple(jnp.broadcast_shapes(*batch_shapes.values()))
    except ValueError:
        shapes = ", ".join(f"{name} {shape}" for name, shape in batch_shapes.items())
        raise ValueError(f"the batch shapes of the parameters do not broadcast: {shapes}") from None


def _resolved_constraint(
    constraint: LinearConstraint | None, A: jax.Array, rtol: float | None, validate: bool
) -> LinearConstraint:
    """The :class:`LinearConstraint` of ``A`` in the parameters' dtype with ``rtol``."""
    if constraint is None:
        # Validated (rank included, where A is concrete) and factorised here, once per
        # distribution; a LinearConstraint given instead was validated and factorised
        # once for all.
        return LinearConstraint._build(A, rtol, validate)
    if constraint.A.dtype != A.dtype:
        if jnp.finfo(A.dtype).eps < jnp.finfo(constraint.A.dtype).eps:
            # Factors rounded to a coarser dtype would cap the accuracy of the result at
            # that dtype's: refactorise in the finer one.
            constraint = LinearConstraint._build(A, constraint._rtol, False)
        else:
            constraint = constraint._replace(dtype=A.dtype)
    if rtol is not None:
        constraint = constraint._replace(rtol=rtol)
    return constraint


def check_held(arguments: dict[str, jax.Array], name: str, strict: bool) -> None:
    """NumPyro's ``Distribution.validate_args`` on the held parameters ``arguments`` against
    :data:`ARG_CONSTRAINTS`, with every constraint evaluated in one jitted call: the same
    messages and the same rule for tracers (skipped, or ``RuntimeError`` when ``strict``),
    one compiled program per parameter shape instead of a dozen small eager operations,
    which dominate the cost of a new shape on CPU."""
    with jax.ensure_compile_time_eval():
        concrete = {key: value for key, value in arguments.items() if not_jax_tracer(value)}
        if strict and len(concrete) < len(arguments):
            raise RuntimeError("Cannot validate arguments inside jitted code.")
        valid = _check_constraints(concrete) if concrete else {}
        for key, is_valid in valid.items():
            if not np.all(np.asarray(is_valid)):
                raise ValueError(f"{name} distribution got invalid {key} parameter.")


@jax.jit
def _check_constraints(arguments: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Whether each argument satisfies its ``ARG_CONSTRAINTS`` entry (all events)."""
    return {key: jnp.all(ARG_CONSTRAINTS[key](value)) for key, value in arguments.items()}
