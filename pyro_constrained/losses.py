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

import torch

from pyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli


@singledispatch
def expected_l1_loss(dist, target: torch.Tensor) -> torch.Tensor:
    """Expected L1 distance E ||z - target||_1 of a sample z ~ dist from target."""
    raise NotImplementedError(f"no closed-form expected L1 loss for {type(dist).__name__}")


@singledispatch
def expected_l2_loss(dist, target: torch.Tensor) -> torch.Tensor:
    """Expected squared L2 distance E ||z - target||_2^2 of z ~ dist from target."""
    raise NotImplementedError(f"no closed-form expected L2 loss for {type(dist).__name__}")


# ExactlyKBernoulli, with mu the conditional marginals (MATH.md section 5):
# E||z - y||^2 = sum_i mu_i (1 - 2 y_i) + y_i^2,
# E||z - y||_1 = sum_i mu_i |1 - y_i| + (1 - mu_i) |y_i|.


@expected_l1_loss.register
def _expected_l1_loss_exactly_k(dist: ExactlyKBernoulli, target: torch.Tensor) -> torch.Tensor:
    mu = dist.mean
    return (mu * (1 - target).abs() + (1 - mu) * target.abs()).sum(-1)


@expected_l2_loss.register
def _expected_l2_loss_exactly_k(dist: ExactlyKBernoulli, target: torch.Tensor) -> torch.Tensor:
    mu = dist.mean
    return (mu * (1 - 2 * target) + target**2).sum(-1)
