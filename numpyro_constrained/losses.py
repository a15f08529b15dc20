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
from functools import partial, singledispatch

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_constrained.conditioned_poisson import (
    ConditionedPoisson,
    _finite_log_zero,
    _log_poisson,
    _log_sqrt_2pi_z_plus_stirling_error,
    _normalized_log_probs,
    _probs_only,
)
from numpyro_constrained.count_constrained_bernoulli import CountConstrainedBernoulli
from numpyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli
from numpyro_constrained.linear_constrained_normal import LinearConstrainedNormal


@singledispatch
def expected_l1_loss(dist, target: jax.Array) -> jax.Array:
    """Expected L1 distance E ||z - target||_1 of a sample z ~ dist from target.

    Examples
    --------
    Against the average over the enumerated support:

    >>> import jax.numpy as jnp
    >>> from numpyro_constrained import ExactlyKBernoulli
    >>> from numpyro_constrained.losses import expected_l1_loss
    >>> d = ExactlyKBernoulli(jnp.array([1.0, 0.0, -1.0]), k=1)
    >>> y = jnp.array([1.0, 0.0, 0.0])
    >>> support = d.enumerate_support()
    >>> brute_force = (jnp.exp(d.log_prob(support)) * jnp.abs(support - y).sum(-1)).sum()
    >>> bool(jnp.isclose(expected_l1_loss(d, y), brute_force))
    True
    """
    raise NotImplementedError(f"no closed-form expected L1 loss for {type(dist).__name__}")


@singledispatch
def expected_l2_loss(dist, target: jax.Array) -> jax.Array:
    """Expected squared L2 distance E ||z - target||_2^2 of z ~ dist from target.

    Examples
    --------
    Against the average over the enumerated support:

    >>> import jax.numpy as jnp
    >>> from numpyro_constrained import ConditionedPoisson
    >>> from numpyro_constrained.losses import expected_l2_loss
    >>> d = ConditionedPoisson(jnp.array([1.0, 2.0, 5.0]), k=4)
    >>> y = jnp.array([1.0, 1.0, 2.0])
    >>> support = d.enumerate_support()
    >>> brute_force = (jnp.exp(d.log_prob(support)) * ((support - y) ** 2).sum(-1)).sum()
    >>> bool(jnp.isclose(expected_l2_loss(d, y), brute_force))
    True
    """
    raise NotImplementedError(f"no closed-form expected L2 loss for {type(dist).__name__}")


# ExactlyKBernoulli, with mu the conditional marginals (docs/distributions/exactly_k_bernoulli.md):
# E||z - y||^2 = sum_i mu_i (1 - 2 y_i) + y_i^2,
# E||z - y||_1 = sum_i mu_i |1 - y_i| + (1 - mu_i) |y_i|.


@expected_l1_loss.register
def _expected_l1_loss_exactly_k(dist: ExactlyKBernoulli, target: jax.Array) -> jax.Array:
    mu = dist.mean
    return (mu * abs(1 - target) + (1 - mu) * abs(target)).sum(-1)


@expected_l2_loss.register
def _expected_l2_loss_exactly_k(dist: ExactlyKBernoulli, target: jax.Array) -> jax.Array:
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
    dist: LinearConstrainedNormal, target: jax.Array
) -> jax.Array:
    offset = dist.mean - target
    return jnp.sum(jnp.square(offset) + dist.variance, -1)


@expected_l1_loss.register(LinearConstrainedNormal)
def _expected_l1_loss_linear_constrained_normal(
    dist: LinearConstrainedNormal, target: jax.Array
) -> jax.Array:
    offset = dist.mean - target
    variance = dist.variance
    spread = variance > 0
    # A coordinate fixed by the constraint has s_i = 0 and contributes |m_i|; the placeholder
    # variance keeps sqrt and the division finite there so that no NaN leaks into gradients.
    std = jnp.sqrt(jnp.where(spread, variance, jnp.ones_like(variance)))
    folded = std * math.sqrt(2 / math.pi) * jnp.exp(
        -0.5 * jnp.square(offset / std)
    ) + offset * jax.scipy.special.erf(offset / (math.sqrt(2) * std))
    return jnp.sum(jnp.where(spread, folded, jnp.abs(offset)), -1)


# ConditionedPoisson ------------------------------------------------------------------------
# z_i ~ Binomial(k, p_i) marginally (docs/distributions/conditioned_poisson.md, with the corrected
# L1 formula, not the published one). For a real target y with f = floor(y),
# E|z - y| = E|z - f| + (y - f)(2 F(f) - 1) (each outcome j <= f is y - f farther, each j > f
# that much nearer), which with the integer form at f is
# 2 (k - f) p Bin(f; k, p) + (k p - y)(1 - 2 F(f)): exact for any real y.


@partial(jax.jit, static_argnames=("k_max", "dtype"))
def _poisson_expected_l1(rate, k, target, *, k_max: int, dtype):
    """``sum_i 2 (k - f_i) p_i Bin(f_i; k, p_i) + (k p_i - y_i)(1 - 2 F(f_i))``, ``f = floor(y)``,
    in the accumulation dtype; NaN where ``k > k_max`` (a traced ``k`` above the static
    bound: the outcome grid is too short)."""
    p = _probs_only(rate)
    accumulation = p.dtype
    y = target.astype(accumulation)
    target_floor = lax.stop_gradient(jnp.floor(y))
    k_float = jnp.asarray(k).astype(accumulation)[..., None]
    pmf_at_f, cdf_at_f = _binomial_pmf_and_cdf_at(rate, k_float, target_floor, k_max)
    terms = 2 * (k_float - target_floor) * p * pmf_at_f + (k_float * p - y) * (1 - 2 * cdf_at_f)
    return jnp.where(k > k_max, jnp.nan, jnp.sum(terms, -1)).astype(dtype)


def _binomial_pmf_and_cdf_at(rate, k, target_floor, k_max: int):
    """``Binomial(f_i; k, p_i)`` and its CDF ``F(f_i)`` at integers ``f`` (any, also outside
    ``[0, k]``) by summing the pmf over ``0..k_max``, in the accumulation dtype: differentiable
    in the rates. Each pmf is ``Poisson(j; k p) Poisson(k - j; k (1 - p)) / Poisson(k; k)``
    in Loader's form (`_log_poisson`), so that float32 (x64 off) keeps its precision at large
    ``k``, where ``log k! - log j! - log (k - j)!`` keeps no digit."""
    log_p, log1m_p = _normalized_log_probs(rate)
    accumulation = log_p.dtype
    log1m_p = jnp.maximum(log1m_p, _finite_log_zero(accumulation))
    j = jnp.arange(k_max + 1, dtype=accumulation)
    k = k[..., None]
    in_range = j <= k
    j_in_range = jnp.minimum(j, k)
    log_k = jnp.log(jnp.maximum(k, 1.0))
    k_safe = jnp.maximum(k, 1.0)
    log_total = jnp.where(k >= 1, _log_sqrt_2pi_z_plus_stirling_error(k_safe), 0.0)
    log_pmf = (
        _log_poisson(j_in_range, k * jnp.exp(log_p)[..., None], log_k + log_p[..., None])
        + _log_poisson(k - j_in_range, k * jnp.exp(log1m_p)[..., None], log_k + log1m_p[..., None])
        + log_total
    )
    pmf = jnp.where(in_range, jnp.exp(log_pmf), 0.0)
    f = target_floor[..., None]
    pmf_at_f = jnp.sum(jnp.where(j == f, pmf, 0.0), -1)
    cdf_at_f = jnp.sum(jnp.where(j <= f, pmf, 0.0), -1)
    return pmf_at_f, cdf_at_f


@expected_l1_loss.register
def _(dist: ConditionedPoisson, target) -> jax.Array:
    """``sum_i 2 (k - f_i) p_i Bin(f_i; k, p_i) + (k p_i - y_i)(1 - 2 F(f_i))`` with
    ``f = floor(y)`` and ``F`` the Binomial(k, p_i) CDF: exact for any real target ``y``
    (integer or not, inside ``[0, k]`` or not), accumulated in float64 where JAX has it (else
    in float32, in a form that keeps float32's precision) and returned in the promotion of
    the rates' and a floating target's dtypes. Its gradient in ``y`` is ``2 F(f) - 1``,
    one-sided at integer ``y``, where the loss has a kink."""
    k_bound = dist._table_bound()
    if k_bound is None:
        raise ValueError("the expected L1 loss of ConditionedPoisson needs k_max when k is traced")
    target, dtype = _poisson_target(dist, target)
    loss = _poisson_expected_l1(dist.rate, dist.k, jnp.asarray(target), k_max=k_bound, dtype=dtype)
    # NaN, not a finite number, where a traced k is negative or fractional.
    return dist._mask_out_of_range_k(loss, jnp.nan, event=False)


@expected_l2_loss.register
def _(dist: ConditionedPoisson, target) -> jax.Array:
    """``sum_i k p_i (1 - p_i) + (k p_i - y_i)^2``."""
    target, dtype = _poisson_target(dist, target)
    return jnp.sum(dist.variance + (dist.mean - jnp.asarray(target, dtype)) ** 2, -1)


def _poisson_target(dist: ConditionedPoisson, target):
    """(the target, a list or tuple made an array; the losses' dtype): the promotion of the
    rates' and a floating target's dtypes (a Python float weakly typed, as in jnp), the
    rates' for an integer target."""
    if isinstance(target, (list, tuple)):
        target = jnp.asarray(target)
    if jnp.issubdtype(jnp.result_type(target), jnp.floating):
        return target, jnp.result_type(dist.rate, target)
    return target, dist.rate.dtype


# CountConstrainedBernoulli (docs/distributions/count_constrained_bernoulli.md, expected
# losses): z is binary, so (z_i - y_i)^2 = z_i (1 - 2 y_i) + y_i^2 and
# |z_i - y_i| = z_i |1 - y_i| + (1 - z_i) |y_i| are linear in z_i, and their expectations
# need only the conditional marginals mu_i = P(z_i = 1 | low <= |z| <= high): the
# exactly-k formulas above, with the range's marginals.
expected_l1_loss.register(CountConstrainedBernoulli, _expected_l1_loss_exactly_k)
expected_l2_loss.register(CountConstrainedBernoulli, _expected_l2_loss_exactly_k)
