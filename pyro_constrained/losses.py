"""Closed-form expected losses of a constrained distribution against a target.

``expected_l1_loss(dist, target) = E_{z ~ dist} ||z - target||_1`` and
``expected_l2_loss(dist, target) = E_{z ~ dist} ||z - target||_2^2``, summed over the
event dimension: one value per batch element, differentiable in the distribution's
parameters (the closed forms on each page of ``docs/distributions/``). The target should satisfy the
distribution's constraint.

The generic functions dispatch on the type of the distribution, as ``kl_divergence``
finds a KL rule; each distribution's closed forms are registered in a section of its own
below.
"""

import math
from functools import singledispatch

import torch

from pyro_constrained.conditioned_poisson import (
    ConditionedPoisson,
    _finite_log_zero,
    _normalized_log_probs,
    _probs_only,
)
from pyro_constrained.count_constrained_bernoulli import CountConstrainedBernoulli
from pyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli
from pyro_constrained.linear_constrained_normal import LinearConstrainedNormal


@singledispatch
def expected_l1_loss(dist, target: torch.Tensor) -> torch.Tensor:
    """Expected L1 distance E ||z - target||_1 of a sample z ~ dist from target.

    Examples
    --------
    Against the average over the enumerated support:

    >>> import torch
    >>> from pyro_constrained import ExactlyKBernoulli
    >>> from pyro_constrained.losses import expected_l1_loss
    >>> d = ExactlyKBernoulli(torch.tensor([1.0, 0.0, -1.0]), k=1)
    >>> y = torch.tensor([1.0, 0.0, 0.0])
    >>> support = d.enumerate_support()
    >>> brute_force = (d.log_prob(support).exp() * (support - y).abs().sum(-1)).sum()
    >>> bool(torch.isclose(expected_l1_loss(d, y), brute_force))
    True
    """
    raise NotImplementedError(f"no closed-form expected L1 loss for {type(dist).__name__}")


@singledispatch
def expected_l2_loss(dist, target: torch.Tensor) -> torch.Tensor:
    """Expected squared L2 distance E ||z - target||_2^2 of z ~ dist from target.

    Examples
    --------
    Against the average over the enumerated support:

    >>> import torch
    >>> from pyro_constrained import ConditionedPoisson
    >>> from pyro_constrained.losses import expected_l2_loss
    >>> d = ConditionedPoisson(torch.tensor([1.0, 2.0, 5.0]), k=4)
    >>> y = torch.tensor([1.0, 1.0, 2.0])
    >>> support = d.enumerate_support()
    >>> brute_force = (d.log_prob(support).exp() * ((support - y) ** 2).sum(-1)).sum()
    >>> bool(torch.isclose(expected_l2_loss(d, y), brute_force))
    True
    """
    raise NotImplementedError(f"no closed-form expected L2 loss for {type(dist).__name__}")


# ExactlyKBernoulli, with mu the conditional marginals (docs/distributions/exactly_k_bernoulli.md):
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


# ---------------------------------------------------------------------------------------
# LinearConstrainedNormal (docs/distributions/linear_constrained_normal.md, expected losses). With
# m_i = mu_bar_i - y_i and s_i^2 = Sigma_bar_ii every coordinate is N(m_i, s_i^2) around the target,
# so E|z_i - y_i| = s_i sqrt(2/pi) exp(-m_i^2 / (2 s_i^2)) + m_i erf(m_i / (sqrt(2) s_i)), the
# folded-normal mean (the published formula has the variance where s_i belongs; see the errata), and
# E(z_i - y_i)^2 = m_i^2 + s_i^2.


@expected_l2_loss.register(LinearConstrainedNormal)
def _expected_l2_loss_linear_constrained_normal(
    dist: LinearConstrainedNormal, target: torch.Tensor
) -> torch.Tensor:
    offset = dist.mean - target
    return (offset.square() + dist.variance).sum(-1)


@expected_l1_loss.register(LinearConstrainedNormal)
def _expected_l1_loss_linear_constrained_normal(
    dist: LinearConstrainedNormal, target: torch.Tensor
) -> torch.Tensor:
    offset = dist.mean - target
    variance = dist.variance
    spread = variance > 0
    # A coordinate fixed by the constraint has s_i = 0 and contributes |m_i|; the placeholder
    # variance keeps sqrt and the division finite there so that no NaN leaks into gradients.
    std = torch.where(spread, variance, torch.ones_like(variance)).sqrt()
    folded = std * math.sqrt(2 / math.pi) * torch.exp(
        -0.5 * (offset / std).square()
    ) + offset * torch.erf(offset / (math.sqrt(2) * std))
    return torch.where(spread, folded, offset.abs()).sum(-1)


# ConditionedPoisson ------------------------------------------------------------------------
# z_i ~ Binomial(k, p_i) marginally (docs/distributions/conditioned_poisson.md, with the corrected
# L1 formula, not the published one). For a real target y with f = floor(y),
# E|z - y| = E|z - f| + (y - f)(2 F(f) - 1) (each outcome j <= f is y - f farther, each j > f
# that much nearer), which with the integer form at f is
# 2 (k - f) p Bin(f; k, p) + (k p - y)(1 - 2 F(f)): exact for any real y.


def _binomial_pmf_and_cdf_at(dist: ConditionedPoisson, target_floor: torch.Tensor):
    """``Binomial(f_i; k, p_i)`` and its CDF ``F(f_i)`` at integers ``f`` (any, also outside
    ``[0, k]``), in float64, by summing the pmf over ``0..k``: differentiable in the rates."""
    log_p, log1m_p = _normalized_log_probs(dist.rate)
    log1m_p = log1m_p.clamp(min=_finite_log_zero(torch.float64))
    # The static bound on k, not k's values read here: see ConditionedPoisson._k_bound.
    k_max = dist._k_bound
    j = torch.arange(k_max + 1, dtype=torch.float64, device=log_p.device)
    k = dist.k.double().unsqueeze(-1).unsqueeze(-1)
    in_range = j <= k
    j_in_range = torch.minimum(j, k)
    log_pmf = (
        torch.lgamma(k + 1)
        - torch.lgamma(j_in_range + 1)
        - torch.lgamma(k - j_in_range + 1)
        + j_in_range * log_p.unsqueeze(-1)
        + (k - j_in_range) * log1m_p.unsqueeze(-1)
    )
    pmf = torch.where(in_range, log_pmf.exp(), 0.0)
    f = target_floor.unsqueeze(-1)
    pmf, f = torch.broadcast_tensors(pmf, f)
    pmf_at_f = torch.where(j == f, pmf, 0.0).sum(-1)
    cdf_at_f = torch.where(j <= f, pmf, 0.0).sum(-1)
    return pmf_at_f, cdf_at_f


@expected_l1_loss.register
def _(dist: ConditionedPoisson, target: torch.Tensor) -> torch.Tensor:
    """``sum_i 2 (k - f_i) p_i Bin(f_i; k, p_i) + (k p_i - y_i)(1 - 2 F(f_i))`` with
    ``f = floor(y)`` and ``F`` the Binomial(k, p_i) CDF: exact for any real target ``y``
    (integer or not, inside ``[0, k]`` or not), accumulated in float64 and returned in the
    promotion of the rates' and a floating target's dtypes. Its gradient in ``y`` is
    ``2 F(f) - 1``, one-sided at integer ``y``, where the loss has a kink."""
    target = _poisson_target(dist, target)
    dtype = torch.promote_types(dist.rate.dtype, target.dtype)
    y = target.double()
    target_floor = torch.floor(y).detach()
    p = _probs_only(dist.rate)
    k = dist.k.double().unsqueeze(-1)
    pmf_at_f, cdf_at_f = _binomial_pmf_and_cdf_at(dist, target_floor)
    terms = 2 * (k - target_floor) * p * pmf_at_f + (k * p - y) * (1 - 2 * cdf_at_f)
    return terms.sum(-1).to(dtype)


@expected_l2_loss.register
def _(dist: ConditionedPoisson, target: torch.Tensor) -> torch.Tensor:
    """``sum_i k p_i (1 - p_i) + (k p_i - y_i)^2``."""
    return (dist.variance + (dist.mean - _poisson_target(dist, target)) ** 2).sum(-1)


def _poisson_target(dist: ConditionedPoisson, target) -> torch.Tensor:
    """The target as a tensor: of the rates' dtype if it is an integer one (a floating one
    keeps its dtype, which the losses promote with the rates')."""
    if not isinstance(target, torch.Tensor):  # as_tensor of a tensor warns under jit.trace
        target = torch.as_tensor(target, device=dist.rate.device)
    return target if target.is_floating_point() else target.to(dist.rate.dtype)


# CountConstrainedBernoulli (docs/distributions/count_constrained_bernoulli.md, expected
# losses): z is binary, so (z_i - y_i)^2 = z_i (1 - 2 y_i) + y_i^2 and
# |z_i - y_i| = z_i |1 - y_i| + (1 - z_i) |y_i| are linear in z_i, and their expectations
# need only the conditional marginals mu_i = P(z_i = 1 | low <= |z| <= high): the
# exactly-k formulas above, with the range's marginals.
expected_l1_loss.register(CountConstrainedBernoulli, _expected_l1_loss_exactly_k)
expected_l2_loss.register(CountConstrainedBernoulli, _expected_l2_loss_exactly_k)
