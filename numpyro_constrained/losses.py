"""Closed-form expected losses of a constrained distribution against a target.

``expected_l1_loss(dist, target) = E_{z ~ dist} ||z - target||_1`` and
``expected_l2_loss(dist, target) = E_{z ~ dist} ||z - target||_2^2``, summed over the
event dimension: one value per batch element, differentiable in the distribution's
parameters (MATH.md section 5). The target should satisfy the distribution's constraint.

The generic functions dispatch on the type of the distribution, as ``kl_divergence``
finds a KL rule; each distribution's closed forms are registered in a section of its own
below.
"""

from functools import singledispatch

import jax


@singledispatch
def expected_l1_loss(dist, target: jax.Array) -> jax.Array:
    """Expected L1 distance E ||z - target||_1 of a sample z ~ dist from target."""
    raise NotImplementedError(f"no closed-form expected L1 loss for {type(dist).__name__}")


@singledispatch
def expected_l2_loss(dist, target: jax.Array) -> jax.Array:
    """Expected squared L2 distance E ||z - target||_2^2 of z ~ dist from target."""
    raise NotImplementedError(f"no closed-form expected L2 loss for {type(dist).__name__}")
