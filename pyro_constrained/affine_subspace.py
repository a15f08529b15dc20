"""The support of :class:`~pyro_constrained.LinearConstrainedNormal`, the affine subspace
``{z : A z = k}``, and the isometric bijection from ``R^(n - a)`` onto it, registered with
``biject_to`` and ``transform_to`` so that AutoGuides and HMC/NUTS can use the distribution as
a latent site, and the checks that name the remedy when such a site's support moves: at an
AutoGuide's setup (:func:`moving_subspaces`) and in ``log_prob``
(:data:`MOVED_SUPPORT_HINT`).

The math: ``docs/distributions/linear_constrained_normal.md``.
"""

from __future__ import annotations

import weakref

import pyro.distributions as dist
import torch
from pyro import poutine
from torch.distributions import biject_to, constraints, transform_to
from torch.distributions.transforms import Transform

from constrained_ppl.moving_support import refuse_once_per_guide
from pyro_constrained._compat import autoguide_being_set_up
from pyro_constrained.linear_constraint import LinearConstraint, _combine_rows, _rows_times

__all__ = ["AffineSubspace", "AffineSubspaceTransform", "moving_subspaces"]


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
    refuse_a_moving_subspace_to_an_autoguide()
    return AffineSubspaceTransform(constraint.constraint, constraint.k)


def _subspace_of(fn) -> AffineSubspace | None:
    """The subspace support of a site's distribution (through ``to_event``, ``mask`` and
    ``expand``), or ``None``."""
    while isinstance(fn, (dist.Independent, dist.MaskedDistribution, dist.ExpandedDistribution)):
        fn = fn.base_dist
    support = getattr(fn, "support", None)  # a plate's subsample site has none
    return support if isinstance(support, AffineSubspace) else None


def moving_subspaces(model, args=(), kwargs=None) -> dict[str, list[str]]:
    """For each latent site of ``model`` whose support is a subspace ``{z : A z = k}`` and
    whose ``A`` or ``k`` depend on the values of other latent sites or parameters: the
    names of those sites and parameters (an empty dict when no subspace moves).

    Found by differentiating ``A`` and ``k`` (a random direction) with respect to every
    floating-point latent value and parameter of one run of the model: a dependence whose
    derivative is zero there (``k = 0 * t``) is not one that moves. Discrete latent values
    are held fixed."""
    kwargs = {} if kwargs is None else kwargs
    # Forked: the caller's draws stay as they were (CUDA's generators only where CUDA is in
    # use: forking them would start it). Blocked: this runs inside the caller's own
    # inference, whose handlers must not see it.
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(cuda), torch.enable_grad(), poutine.block():
        first = poutine.trace(model).get_trace(*args, **kwargs)
        names = [
            name
            for name, site in first.nodes.items()
            if site["type"] == "sample"
            and not site["is_observed"]
            and _subspace_of(site["fn"]) is not None
        ]
        if not names:
            return {}
        values = {
            name: site["value"].detach().requires_grad_()
            for name, site in first.nodes.items()
            if site["type"] == "sample"
            and not site["is_observed"]
            and torch.is_tensor(site["value"])
            and site["value"].is_floating_point()
        }
        trace = poutine.trace(poutine.condition(model, data=values)).get_trace(*args, **kwargs)
        sources = dict(values)
        sources.update(
            (name, site["value"])
            for name, site in trace.nodes.items()
            if site["type"] == "param" and site["value"].requires_grad
        )
        moving = {}
        for name in names:
            subspace = _subspace_of(trace.nodes[name]["fn"])
            outputs = [x for x in (subspace.A, subspace.k) if x.requires_grad]
            if not outputs:
                continue
            gradients = torch.autograd.grad(
                outputs,
                list(sources.values()),
                grad_outputs=[torch.randn_like(x) for x in outputs],
                allow_unused=True,
            )
            by = [
                source
                for source, gradient in zip(sources, gradients, strict=True)
                if source != name and gradient is not None and bool((gradient != 0).any())
            ]
            if by:
                moving[name] = by
    return moving


# The AutoGuides already checked (their setup asks for a bijection more than once).
_CHECKED_GUIDES = weakref.WeakSet()


def refuse_a_moving_subspace_to_an_autoguide() -> None:
    """A ``ValueError`` naming :class:`~pyro_constrained.LinearConstrainedNormalReparam`
    when a Pyro AutoGuide is being set up on a model with a subspace that moves
    (:func:`moving_subspaces`). An AutoGuide builds each site's bijection once, from the
    prototype trace, and keeps it, so its values would stay on the prototype's subspace,
    off the model's (which ``log_prob`` refuses too, but a ``JitTrace_ELBO`` traced while
    the two still agree, as AutoDelta's first step, would score them ``-inf`` silently)."""
    found = autoguide_being_set_up()
    if found is None:
        return
    guide, args, kwargs = found
    # Its first request comes from inside the prototype trace (the initialisation strategy
    # asks for the bijection), where the model cannot be run again; later ones follow it.
    if guide.prototype_trace is None:
        return
    refuse_once_per_guide(
        guide, _CHECKED_GUIDES, lambda: moving_subspaces(guide.model, args, kwargs), "Pyro"
    )


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
