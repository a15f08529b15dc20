"""The support of :class:`~pyro_constrained.LinearConstrainedNormal`, the affine subspace
``{z : A z = k}``, and the isometric bijection from ``R^(n - a)`` onto it, registered with
``biject_to`` and ``transform_to`` so that AutoGuides and HMC/NUTS can use the distribution as
a latent site, and the check that names the remedy when such a site's support moves
(:data:`MOVED_SUPPORT_HINT`).

The math: ``docs/distributions/linear_constrained_normal.md``.
"""

from __future__ import annotations

import torch
from torch.distributions import biject_to, constraints, transform_to
from torch.distributions.transforms import Transform

from pyro_constrained.linear_constraint import LinearConstraint, _combine_rows, _rows_times

__all__ = ["AffineSubspace", "AffineSubspaceTransform"]


def _as_constraint(A, k: torch.Tensor) -> LinearConstraint:
    """``A`` itself when it is a :class:`LinearConstraint`, else one built (unchecked) from
    the matrix ``A`` in the dtype of ``k``'s promotion with it."""
    if isinstance(A, LinearConstraint):
        return A
    A = torch.as_tensor(A)
    dtype = torch.promote_types(A.dtype, k.dtype) if A.is_floating_point() else k.dtype
    return LinearConstraint._build(A.to(dtype), None, validate=False)


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
        return self.constraint._correct(self.offset + _rows_times(self.basis, u), self.k)

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


# HMC/NUTS and AutoGuides build the bijection of a latent site's support once, at the
# first trace: where A or k depend on another latent, later values lie on that first
# subspace, not on the site's current one.
MOVED_SUPPORT_HINT = (
    " If this is a latent site under HMC/NUTS or an AutoGuide and A or k depend on another "
    "latent variable, its support moves while the inference keeps the bijection of the first "
    "trace: reparameterise the site with pyro.poutine.reparam(model, config={name: "
    "pyro_constrained.LinearConstrainedNormalReparam()})."
)


def may_come_from_a_frozen_bijection(dist, value: torch.Tensor) -> bool:
    """Whether ``value`` may be the image of a bijection that HMC/NUTS or an AutoGuide built
    for an earlier support of ``dist`` (see :data:`MOVED_SUPPORT_HINT`): the support moves
    only with ``A`` or ``k``, which then depend on a latent variable or a parameter and so
    are differentiated, and inference's values depend on its own differentiated
    coordinates. Pyro's NUTS runs its warmup with validation off, where nothing else
    would say why every proposal scores ``-inf``. Attributes only: no tensor is read
    unless all three hold."""
    return value.requires_grad and (dist.k.requires_grad or dist.A.requires_grad)


def refuse_a_moved_support(off_subspace: torch.Tensor, name: str) -> None:
    if bool(off_subspace.any()):
        raise ValueError(
            f"{name}.log_prob: a value that depends on differentiated inputs lies off the "
            "subspace A z = k, while A or k are differentiated too." + MOVED_SUPPORT_HINT
        )
