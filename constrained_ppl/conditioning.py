"""Rank and conditioning checks of a linear constraint, framework-free (NumPy only).

Both packages factorise ``A^T = Q1 R1`` (the constraint alone) and ``(A L)^T = Q R`` (the
constraint in whitened coordinates, ``Sigma = L L^T``), and judge the rank and the
conditioning from the a x a triangular factor, whose singular values are those of the tall
matrix. The judgement is made on that factor with its columns scaled to unit length, which
is the factor of ``A`` (or ``A L``) with its rows scaled to unit length: scaling a row of
``A`` (an equation multiplied by a constant) changes neither the subspace ``A z = k`` nor the
conditional distribution, so it must not change the verdict either. Column equilibration is
within a factor sqrt(a) of the best diagonal scaling (van der Sluis 1969).
"""

from __future__ import annotations

import inspect
import math
import os
import warnings

import numpy as np

__all__ = [
    "DEFAULT_RTOL_FLOOR",
    "DEFAULT_RTOL_ULPS",
    "PrecisionWarning",
    "check_rtol",
    "default_rtol",
    "equilibrated_singular_values",
    "check_full_row_rank",
    "warn_if_unresolvable",
    "whitened_condition",
]


# The default support tolerance of ``A z = k``, ``|A z - k| <= rtol (|A| |z| + |k|)`` per
# row, is ``max(DEFAULT_RTOL_FLOOR, DEFAULT_RTOL_ULPS * eps)`` of the dtype.
#
# The ulps part covers the rounding of the check itself and of our own projection and
# sampler: a residual of length-n dot products is off by at most ``n u (|A| |z| + |k|)``
# (u = eps / 2; Higham, Accuracy and Stability, section 3.1) and in practice by about
# ``sqrt(n) u`` of it, plus one such rounding for a point we computed. 64 eps = 128 u covers
# the worst case for n up to 128 and the typical case for n in the thousands. In float32 it
# is 7.6e-6 and decides.
#
# The floor accepts what other tools compute on the subspace. A sampler that factorises the
# singular conditional covariance (``scipy.stats.multivariate_normal(allow_singular=True)``,
# by eigendecomposition; a Cholesky factor with jitter) computes its zero eigenvalues as
# about eps |Sigma| and scales by their square roots, which leaves residuals of about
# ``sqrt(eps)`` relative: 1e-8 to 5e-8 in float64, far above 64 eps = 1.4e-14. 1e-6 is the
# tolerance of torch's and NumPyro's ``simplex`` constraints (and NumPyro's ``zero_sum``
# accepts about 10 n eps, 1.2e-6 n, in float32), so in float64 a value on the subspace by
# these tools' standard is on it by ours. A value off the subspace by more than 1e-6 of its
# terms (data measured to fewer than 6 digits) still needs ``rtol`` set to its precision.
DEFAULT_RTOL_ULPS = 64
DEFAULT_RTOL_FLOOR = 1e-6


def default_rtol(eps: float) -> float:
    """The default support tolerance for a dtype whose machine epsilon is ``eps``:
    ``max(DEFAULT_RTOL_FLOOR, DEFAULT_RTOL_ULPS * eps)``, 1e-6 in float64 and 7.6e-6 in
    float32 (see the comment above :data:`DEFAULT_RTOL_ULPS`)."""
    return max(DEFAULT_RTOL_FLOOR, DEFAULT_RTOL_ULPS * float(eps))


def check_rtol(rtol) -> float | None:
    """``rtol`` as a Python float (None stays None), or a ``ValueError`` unless it is a
    positive finite number: a Python number or a one-element array of any framework."""
    if rtol is None:
        return None
    shape = tuple(getattr(rtol, "shape", ()))
    if math.prod(shape) != 1:
        raise ValueError(f"rtol must be a positive number, got an array of shape {shape}")
    try:
        rtol = float(rtol)
    except (TypeError, ValueError):
        raise ValueError(f"rtol must be a positive finite number, got {rtol!r}") from None
    if not rtol > 0 or rtol == float("inf"):
        raise ValueError(f"rtol must be a positive finite number, got {rtol}")
    return rtol


class PrecisionWarning(UserWarning):
    """The working precision cannot resolve a problem: its results may have no correct
    digit. ``warnings.simplefilter("error", PrecisionWarning)`` turns it into an error."""


def equilibrated_singular_values(r) -> np.ndarray:
    """The singular values (..., a), in decreasing order, of the triangular factor ``r``
    (..., a, a) with its columns scaled to unit Euclidean length, in float64.

    A zero column (a zero row of ``A``) stays zero, so it counts as rank-deficient."""
    r = np.asarray(r, dtype=np.float64)
    norms = np.linalg.norm(r, axis=-2, keepdims=True)
    scaled = r / np.where(norms > 0, norms, 1.0)
    return np.linalg.svd(scaled, compute_uv=False)


def check_full_row_rank(r, n: int, eps: float) -> None:
    """``ValueError`` unless ``A`` (whose ``A^T = Q1 R1`` has the factor ``r``) has full row
    rank at precision ``eps``: the smallest singular value of the row-equilibrated ``A`` is
    above ``n eps`` times the largest (the rounding of ``A`` itself in the working dtype
    makes a smaller one indistinguishable from zero)."""
    singular_values = equilibrated_singular_values(r)
    num_rows = singular_values.shape[-1]
    if not np.all(singular_values[..., -1] > n * eps * singular_values[..., 0]):
        largest = singular_values[..., 0]
        # A zero A (every singular value 0) is as rank-deficient as it gets: ratio 0, not NaN.
        ratio = np.min(singular_values[..., -1] / np.where(largest > 0, largest, 1.0))
        raise ValueError(
            f"A must have full row rank {num_rows}; it is rank-deficient at the working "
            f"precision: with its rows scaled to unit length, its smallest singular value is "
            f"{ratio:.3g} times its largest, not above n * eps = {n * eps:.3g}"
        )


def whitened_condition(r) -> np.ndarray:
    """The condition number (...,) of the whitened constraint ``A L`` with its rows scaled
    to unit length, from the triangular factor ``r`` of ``(A L)^T = Q R``."""
    singular_values = equilibrated_singular_values(r)
    smallest = singular_values[..., -1]
    with np.errstate(divide="ignore"):
        return np.where(smallest > 0, singular_values[..., 0] / smallest, np.inf)


def _stack_level_outside(inside: tuple[str, ...]) -> int:
    """The ``stacklevel`` for a warning issued here that points at the first caller whose
    file is outside this module and the directories ``inside``."""
    inside = (os.path.abspath(__file__), *(os.path.dirname(path) for path in inside))
    frame, level = inspect.currentframe(), 0
    while frame is not None and inspect.getfile(frame).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def warn_if_unresolvable(r, eps: float, dtype_name: str, inside: tuple[str, ...] = ()) -> None:
    """A :class:`PrecisionWarning` when the condition number of the row-equilibrated ``A L``
    (see :func:`whitened_condition`) reaches ``1 / eps`` of the working dtype: the
    conditional mean, covariance, ``log_prob`` and entropy then have errors of order one
    (in units of the conditional standard deviations) or larger. The estimate is an upper
    bound: the row-sorted QR also resolves some problems beyond it (scales that differ by
    many orders of magnitude between loosely coupled coordinates), so this warns rather
    than raises. ``inside``: the ``__file__`` of modules (the packages and frameworks)
    whose frames the warning skips to point at the user's call."""
    condition = whitened_condition(r)
    worst = float(np.max(condition)) if condition.size else 0.0
    if worst * eps >= 1.0:
        warnings.warn(
            f"LinearConstrainedNormal: {dtype_name} cannot resolve this problem. The "
            f"whitened constraint A diag(scale) (A L for a full covariance), with its rows "
            f"scaled to unit length, has condition number {worst:.3g}, at or above "
            f"1 / eps = {1 / eps:.3g} of {dtype_name}: the mean, covariance, log_prob and "
            f"entropy may have no correct digit. Compute in float64 (torch: .double(); JAX: "
            f"jax.config.update('jax_enable_x64', True) and float64 arrays), or rescale the "
            f"problem so that the constrained coordinates have comparable scales.",
            PrecisionWarning,
            stacklevel=_stack_level_outside(inside),
        )
