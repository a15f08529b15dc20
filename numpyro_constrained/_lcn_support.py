"""The support of :class:`~numpyro_constrained.LinearConstrainedNormal`, the affine subspace
``{z : A z = k}``, and the isometric bijection onto it from ``R^(n - a)``, registered with
``biject_to`` so that AutoGuides and NUTS can use the distribution as a latent site, and
the check that refuses an AutoGuide a subspace that moves (:func:`moving_subspaces`).

The math: ``docs/distributions/linear_constrained_normal.md``.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
from numpyro.distributions import (
    ExpandedDistribution,
    Independent,
    MaskedDistribution,
    constraints,
)
from numpyro.distributions.transforms import Transform, biject_to

from constrained_ppl.moving_support import refuse_once_per_guide
from numpyro_constrained._compat import DynamicSupport, autoguide_being_set_up
from numpyro_constrained.linear_constraint import LinearConstraint, _combine_rows, _rows_times
from numpyro_constrained.validation import is_concrete


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


class AffineSubspace(DynamicSupport):
    """The affine subspace ``{z in R^n : A z = k}`` with ``A`` of shape (..., a, n), rank a.

    ``A`` is a :class:`LinearConstraint` (whose factorisation and ``rtol`` are used) or a
    matrix. A value passes when its residual is within the constraint's tolerance,
    ``|A z - k| <= rtol * (|A| |z| + |k|)`` per row (see :class:`LinearConstraint`).
    Its bijection is :class:`AffineSubspaceTransform` (``biject_to``).

    This support moves whenever ``A`` or ``k`` depends on another latent variable. Its base
    class, ``numpyro_constrained._compat.DynamicSupport``, is what makes NumPyro replay the
    model to map MCMC draws back to the support of each draw rather than to that of the
    initial trace; the class defines every method itself, so that base adds nothing else.
    """

    is_discrete = False
    event_dim = 1

    def __init__(self, A: LinearConstraint | jax.Array, k: jax.Array):
        self.constraint = _as_constraint(A, k)
        self.k = k

    @property
    def A(self) -> jax.Array:
        return self.constraint.A

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
    refuse_a_moving_subspace_to_an_autoguide()
    return AffineSubspaceTransform(constraint.constraint, constraint.k)


def _subspace_of(fn) -> AffineSubspace | None:
    """The subspace support of a site's distribution (through ``to_event``, ``mask`` and
    ``expand``), or ``None``."""
    while isinstance(fn, (Independent, MaskedDistribution, ExpandedDistribution)):
        fn = fn.base_dist
    support = getattr(fn, "support", None)  # a plate's subsample site has none
    return support if isinstance(support, AffineSubspace) else None


def moving_subspaces(model, args=(), kwargs=None) -> dict[str, list[str]]:
    """For each latent site of ``model`` whose support is a subspace ``{z : A z = k}`` and
    whose ``A`` or ``k`` depend on the values of other latent sites or parameters: the
    names of those sites and parameters (an empty dict when no subspace moves).

    Found by differentiating ``A`` and ``k`` with respect to every floating-point latent
    value and parameter of one trace of the model (``jax.linearize``, a random direction):
    a dependence whose derivative is zero there (``k = 0 * t``) is not one that moves.
    Discrete latent values are held fixed."""
    kwargs = {} if kwargs is None else kwargs
    seeded = handlers.seed(model, rng_seed=0)

    def run(values):
        # Blocked: this runs inside the caller's own inference, whose handlers must not see it.
        with handlers.block():
            return handlers.trace(handlers.substitute(seeded, data=values)).get_trace(
                *args, **kwargs
            )

    # Evaluated where it can be: inside jit or a scan body every result would be a tracer
    # (jit stages out even the operations on constants). With this, the sampled values and
    # every derivative that does not involve the traced data are concrete.
    with jax.ensure_compile_time_eval():
        return _moving_in_trace(run, run({}))


def _moving_in_trace(run, first) -> dict[str, list[str]]:
    names = [
        name
        for name, site in first.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and _subspace_of(site["fn"]) is not None
    ]
    if not names:
        return {}
    inputs = {
        name: site["value"]
        for name, site in first.items()
        if (site["type"] == "param" or (site["type"] == "sample" and not site["is_observed"]))
        and jnp.issubdtype(jnp.result_type(site["value"]), jnp.inexact)
    }

    def subspaces(values):
        trace = run(values)
        return {
            name: (subspace.A, subspace.k)
            for name in names
            for subspace in [_subspace_of(trace[name]["fn"])]
        }

    rng = np.random.default_rng(0)
    directions = {
        name: jnp.asarray(rng.standard_normal(jnp.shape(value)), jnp.result_type(value))
        for name, value in inputs.items()
    }
    zeros = {name: jnp.zeros_like(value) for name, value in inputs.items()}
    _, tangents = jax.linearize(subspaces, inputs)

    def moved_by(direction) -> list[str]:
        # A derivative that stays a tracer (it involves data traced by the caller's jit) is
        # not known to be non-zero, and such a site is not refused.
        return [
            name
            for name, moves in tangents(direction).items()
            if any(is_concrete(move) and bool(jnp.any(move != 0)) for move in moves)
        ]

    moving = {}
    if moved_by(directions):  # then which input moves which site, one input at a time
        for source, direction in directions.items():
            for name in moved_by({**zeros, source: direction}):
                if name != source:
                    moving.setdefault(name, []).append(source)
    return moving


# The AutoGuides already checked (their setup asks for a bijection several times).
_CHECKED_GUIDES = weakref.WeakSet()


def refuse_a_moving_subspace_to_an_autoguide() -> None:
    """A ``ValueError`` naming :class:`~numpyro_constrained.LinearConstrainedNormalReparam`
    when a NumPyro AutoGuide is being set up on a model with a subspace that moves
    (:func:`moving_subspaces`). An AutoGuide builds each site's bijection once, from the
    initial trace, and keeps it, so its values would stay on the initial subspace, off the
    model's, and every ELBO would be ``inf``; NUTS and the other callers of ``biject_to``
    rebuild it from the current support and are not refused."""
    found = autoguide_being_set_up()
    if found is None:
        return
    guide, args, kwargs = found
    refuse_once_per_guide(
        guide, _CHECKED_GUIDES, lambda: moving_subspaces(guide.model, args, kwargs), "NumPyro"
    )
