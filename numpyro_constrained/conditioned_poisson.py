"""Independent Poissons conditioned on their sum: ``ConditionedPoisson(rate, k=k)``.

``z_i ~ Poisson(rate_i)`` independently, conditioned on ``sum_i z_i = k``, is
``Multinomial(k, p)`` with ``p = rate / sum(rate)`` (MATH.md section 3). Unlike
``numpyro.distributions.Multinomial``, ``k`` may vary over the batch (bags with different
known totals) and be traced under ``jit`` / ``vmap``, the support check demands
``sum z == k`` exactly, ``sample`` carries the straight-through marginal-expectation
gradient, and the entropy is exact and fast.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.scipy.special import gammaln
from numpyro.distributions import Binomial, constraints
from numpyro.distributions.batch_util import _default_vmap_over, vmap_over
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.kl import kl_divergence
from numpyro.util import not_jax_tracer

from constrained_ppl_common.binomial_tails import bennett_deviation, entropy_log_inverse_tail

__all__ = ["ConditionedPoisson", "integer_composition", "positive_finite"]

# Draw categorical indices (O(k log n) per event) unless k is this many times larger than n,
# where n sequential binomial draws (O(n) per event) are cheaper.
SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY = 32


class _PositiveFinite(constraints.Constraint):
    """Real numbers in (0, inf): ``constraints.positive`` lets ``inf`` through."""

    def __call__(self, x):
        xp = jnp if isinstance(x, jax.Array) else np
        return (x > 0) & xp.isfinite(x)

    def feasible_like(self, prototype):
        return jnp.ones_like(prototype)

    def tree_flatten(self):
        return (), ((), dict())

    def __repr__(self) -> str:
        return "PositiveFinite()"


positive_finite = _PositiveFinite()


def _is_integer_composition(value, total):
    """Whether each vector (last axis) of ``value`` is in the support, and whether all its
    entries are ``>= 0``."""
    xp = jnp if isinstance(value, jax.Array) or isinstance(total, jax.Array) else np
    is_nonnegative = xp.all(value >= 0, axis=-1)
    # floor(inf) == inf, so finiteness is checked separately; NaN fails every comparison.
    is_integer = xp.all((value == xp.floor(value)) & xp.isfinite(value), axis=-1)
    return is_nonnegative & is_integer & (xp.sum(value, axis=-1) == total), is_nonnegative


class _IntegerComposition(constraints.Constraint):
    """Integer vectors ``z >= 0`` (last axis) with ``sum(z) == total`` exactly.

    NumPyro's ``constraints.multinomial`` does not check that the entries are integers.
    """

    is_discrete = True
    event_dim = 1

    def __init__(self, total) -> None:
        self.total = total

    def __call__(self, x):
        return _is_integer_composition(x, self.total)[0]

    def feasible_like(self, prototype):
        # All of the total in the first category.
        first = jnp.broadcast_to(jnp.asarray(self.total, prototype.dtype), prototype.shape[:-1])
        return jnp.zeros_like(prototype).at[..., 0].set(first)

    def tree_flatten(self):
        return (self.total,), (("total",), dict())

    def eq(self, other, static: bool = False):
        if not isinstance(other, _IntegerComposition):
            return False
        if static:
            return self.total is other.total
        return jnp.array_equal(self.total, other.total)

    def __repr__(self) -> str:
        return f"IntegerComposition(total={self.total})"


integer_composition = _IntegerComposition


def _finite_log_zero(dtype) -> float:
    """A finite stand-in for ``log 0``: up to 1e8 times it, ``exp`` still underflows to 0, and
    unlike ``-inf`` it gives 0 (not NaN) times 0 and in gradients."""
    return float(jnp.finfo(dtype).min) / 1e8


def _log_p_and_log1m_p(rate):
    """``p``, ``log p`` and ``log(1 - p)`` for ``p = rate / sum(rate)``.

    Where ``p == 1`` (a single category) ``log(1 - p)`` is `_finite_log_zero` rather than
    ``-inf``, so that neither values nor gradients become NaN.
    """
    total = jnp.sum(rate, axis=-1, keepdims=True)
    p = rate / total
    log_p = jnp.log(rate) - jnp.log(total)
    is_certain = p >= 1
    log1m_p = jnp.log1p(-jnp.where(is_certain, 0.0, p))
    log1m_p = jnp.where(is_certain, _finite_log_zero(rate.dtype), log1m_p)
    return p, log_p, log1m_p


def _log_factorial_table(k_max: int, dtype):
    """``log m!`` for ``m = 0..k_max`` in ``dtype``; ``log 0! = log 1! = 0`` exactly (JAX's
    float32 ``gammaln(1)`` is not)."""
    return gammaln(jnp.arange(k_max + 1, dtype=dtype) + 1).at[:2].set(0.0)


def _entropy_window(rate, k, k_max: int) -> tuple[int, int]:
    """Half-width and width (static) of the window of binomial outcomes summed over.

    A window ``[floor(mean) - half_width, floor(mean) + half_width + 1]`` clipped to
    ``[0, k]`` holds every outcome within ``t`` of the mean, ``t`` from Bennett's
    inequality (`bennett_deviation`) at the largest variance in the batch when ``rate``
    and ``k`` are concrete, else at the bound ``k p (1 - p) <= k_max / 4``.
    """
    n = rate.shape[-1]
    eps = float(jnp.finfo(rate.dtype).eps)
    log_inverse_tail = entropy_log_inverse_tail(n, k_max, eps)
    concrete = not_jax_tracer(rate) and not_jax_tracer(k) and rate.size > 0
    if concrete:
        rate_np = np.asarray(rate, dtype=np.float64)
        p = rate_np / rate_np.sum(-1, keepdims=True)
        k_np = np.broadcast_to(np.asarray(k)[..., None], p.shape)
        mean = k_np * p
        max_variance = float(np.max(mean * (1 - p)))
    else:
        max_variance = k_max / 4.0
    # +1: floor(mean) may be off by one from the exact floor through rounding.
    half_width = math.ceil(bennett_deviation(max_variance, log_inverse_tail)) + 1
    if concrete:
        floor_mean = np.floor(mean)
        first = np.maximum(floor_mean - half_width, 0)
        last = np.minimum(floor_mean + half_width + 1, k_np)
        width = int(np.max(last - first)) + 1
    else:
        width = 2 * half_width + 2
    return half_width, max(1, min(width, k_max + 1))


@partial(jax.jit, static_argnames=("k_max", "half_width", "width"))
def _expected_log_factorials(rate, k, *, k_max: int, half_width: int, width: int):
    """``E[log z_i!]`` for ``z_i ~ Binomial(k, p_i)``, per coordinate, over the outcome
    windows of `_entropy_window`; the outcomes outside them are dropped, see
    `entropy_log_inverse_tail`. ``log m!`` is computed in ``rate``'s dtype."""
    dtype = rate.dtype
    p, log_p, log1m_p = _log_p_and_log1m_p(rate)
    k_event = jnp.broadcast_to(jnp.expand_dims(k, -1), p.shape).astype(jnp.result_type(int))
    k_float = k_event.astype(dtype)
    floor_mean = jnp.floor(lax.stop_gradient(k_float * p)).astype(k_event.dtype)
    first = jnp.maximum(floor_mean - half_width, 0)
    # A window running past k moves left, so that it holds no outcome beyond k if it can.
    first = jnp.minimum(first, jnp.maximum(k_event + 1 - width, 0))
    j = first[..., None] + jnp.arange(width, dtype=first.dtype)
    in_range = j <= k_event[..., None]
    j = jnp.minimum(j, k_event[..., None])
    log_factorials = _log_factorial_table(k_max, dtype)
    log_factorial_j = log_factorials[j]
    j_float = j.astype(dtype)
    log_pmf = (
        log_factorials[k_event][..., None]
        - log_factorial_j
        - log_factorials[k_event[..., None] - j]
        + j_float * log_p[..., None]
        + (k_float[..., None] - j_float) * log1m_p[..., None]
    )
    pmf = jnp.where(in_range, jnp.exp(log_pmf), 0.0)
    # Normalising over the window cancels the rounding error that log k! (about 8e4 for
    # k = 1e4) puts into every term alike.
    expected = jnp.sum(pmf * log_factorial_j, axis=-1) / jnp.sum(pmf, axis=-1)
    return jnp.where(p >= 1, log_factorials[k_event], expected)


def _log_factorial_of_total(k):
    """``log k!`` for the (non-differentiable) total ``k``, exactly 0 for ``k <= 1``
    (JAX's float32 ``gammaln(1)`` is not)."""
    return jnp.where(k <= 1, 0.0, gammaln(k + 1))


@jax.jit
def _entropy_from_expected_log_factorials(rate, k, expected_log_factorials):
    p, log_p, _ = _log_p_and_log1m_p(rate)
    k = k.astype(rate.dtype)
    cross_entropy_term = k * jnp.sum(p * log_p, axis=-1)
    expected = jnp.sum(expected_log_factorials, axis=-1)
    return expected - _log_factorial_of_total(k) - cross_entropy_term


@jax.jit
def _log_prob_and_support(rate, k, value):
    """``log_prob`` (``-inf`` off the support) and the support indicator, one compiled call."""
    in_support, _ = _is_integer_composition(value, k)
    # gammaln(z + 1) at a negative integer is inf and its derivative NaN: evaluate there
    # at 0 instead (those entries get -inf below). where, not maximum: maximum(z, 0)
    # halves the gradient at z = 0.
    value = jnp.where(value >= 0, value, 0.0)
    log_p = jnp.log(rate) - jnp.log(jnp.sum(rate, axis=-1, keepdims=True))
    k = k.astype(rate.dtype)
    log_prob = (
        _log_factorial_of_total(k) - jnp.sum(gammaln(value + 1), -1) + jnp.sum(value * log_p, -1)
    )
    return jnp.where(in_support, log_prob, -jnp.inf), in_support


@partial(jax.jit, static_argnames=("k_max", "sample_shape"))
def _sample_counts_categorical(key, rate, k, *, k_max: int, sample_shape: tuple[int, ...]):
    """Exact counts from ``k_max`` categorical draws per event, those past each event's own
    ``k`` masked out: inverse-CDF search (O(k log n)), not Gumbel-max (O(k n))."""
    dtype = rate.dtype
    batch_shape, n = rate.shape[:-1], rate.shape[-1]
    rows = math.prod(batch_shape)
    num_samples = math.prod(sample_shape)
    cumulative = jnp.cumsum(rate.reshape(rows, n), axis=-1)
    uniforms = jax.random.uniform(key, (rows, num_samples * k_max), dtype=dtype)
    # Scaling by the last cumulative sum (not 1) makes the search match the rounded cumsum.
    targets = uniforms * cumulative[:, -1:]
    draws = jax.vmap(lambda c, t: jnp.searchsorted(c, t, side="right"))(cumulative, targets)
    draws = jnp.minimum(draws, n - 1).reshape(rows, num_samples, k_max)
    k_rows = jnp.broadcast_to(k, batch_shape).reshape(rows, 1, 1)
    keep = (jnp.arange(k_max) < k_rows).astype(dtype)
    row_index = jnp.arange(rows)[:, None, None]
    sample_index = jnp.arange(num_samples)[None, :, None]
    counts = jnp.zeros((rows, num_samples, n), dtype)
    counts = counts.at[row_index, sample_index, draws].add(jnp.broadcast_to(keep, draws.shape))
    counts = jnp.moveaxis(counts, 1, 0)
    return counts.reshape(sample_shape + batch_shape + (n,))


@partial(jax.jit, static_argnames=("sample_shape",))
def _sample_counts_sequentially(key, rate, k, *, sample_shape: tuple[int, ...]):
    """``z_i ~ Binomial(k - z_1 - ... - z_{i-1}, rate_i / sum_{j >= i} rate_j)``, the last
    coordinate taking the remainder: O(n) binomial draws per event whatever k is, and no
    static bound on k needed (k may be traced)."""
    dtype = rate.dtype
    shape = sample_shape + rate.shape[:-1]
    n = rate.shape[-1]
    # Tail sums of the rates, not 1 - cumsum(p): no cancellation for the last categories.
    tail = jnp.flip(jnp.cumsum(jnp.flip(rate, -1), -1), -1)
    conditional_p = jnp.clip(rate / tail, 0.0, 1.0)
    conditional_p = jnp.moveaxis(jnp.broadcast_to(conditional_p, shape + (n,)), -1, 0)
    remaining = jnp.broadcast_to(jnp.asarray(k, dtype), shape)

    def draw(remaining, key_and_p):
        key_i, p_i = key_and_p
        z_i = jax.random.binomial(key_i, remaining, p_i, shape=shape, dtype=dtype)
        # The binomial sampler may round; the count can never exceed what is left.
        z_i = jnp.minimum(jnp.round(z_i), remaining)
        return remaining - z_i, z_i

    keys = jax.random.split(key, n - 1) if n > 1 else jnp.zeros((0,) + key.shape, key.dtype)
    remaining, counts = lax.scan(draw, remaining, (keys, conditional_p[:-1]))
    counts = jnp.concatenate([counts, remaining[None]], axis=0)
    return jnp.moveaxis(counts, 0, -1)


class ConditionedPoisson(Distribution):
    r"""Independent ``Poisson(rate_i)`` counts conditioned on summing to exactly ``k``.

    The conditional distribution is ``Multinomial(k, p)`` with ``p = rate / sum(rate)``
    (only the rates' proportions matter)::

        log_prob(z) = log k! - sum_i log z_i! + sum_i z_i log p_i

    on integer vectors ``z >= 0`` with ``sum_i z_i = k``, with respect to counting measure
    on that set. ``k`` is a Python int or an integer array broadcast with
    ``rate.shape[:-1]``: the batch shape is the broadcast of the two, the event shape
    ``rate.shape[-1:]``.

    ``sample`` returns an exact sample whose gradient is the straight-through
    marginal-expectation estimator through ``E[z] = k p`` (MATH.md section 4): the value is
    exactly integer and sums exactly to ``k``; ``has_rsample`` is true, so ``Trace_ELBO``
    treats the site as reparameterised. ``marginals`` are ``Binomial(k, p_i)``.

    :param rate: positive, finite Poisson rates, shape ``batch + (n,)``.
    :param k: the known total, a non-negative integer (per batch element or shared).
    :param k_max: a static upper bound on ``k``, taken from ``k`` when it is concrete.
        Needed only where ``k`` is traced at construction (inside ``jit``): sampling then
        falls back to sequential binomials without it, and ``entropy`` needs it.
    """

    arg_constraints = {"rate": positive_finite, "k": constraints.nonnegative_integer}
    reparametrized_params = ["rate"]
    pytree_data_fields = ("rate", "k")
    pytree_aux_fields = ("k_max",)

    def __init__(
        self,
        rate,
        *,
        k,
        k_max: int | None = None,
        validate_args: bool | None = None,
    ) -> None:
        rate = jnp.asarray(rate)
        if not jnp.issubdtype(rate.dtype, jnp.floating):
            rate = rate.astype(jnp.result_type(float))
        if rate.ndim < 1:
            raise ValueError(
                f"rate must have at least one dimension (the categories), got shape {rate.shape}"
            )
        if rate.shape[-1] < 1:
            raise ValueError("rate must have at least one category (rate.shape[-1] >= 1)")
        if isinstance(k, bool) or jnp.asarray(k).dtype == jnp.bool_:
            raise ValueError("k must be a non-negative integer, got a boolean")
        if k_max is None and not_jax_tracer(k):
            # From the input, before jnp.asarray: inside jit even a Python int becomes a tracer.
            k_concrete = np.asarray(k)
            k_max = int(np.max(k_concrete)) if k_concrete.size else 0
        k = jnp.asarray(k)
        try:
            batch_shape, event_shape = self.infer_shapes(rate.shape, k.shape)
        except ValueError as error:
            raise ValueError(
                f"k of shape {k.shape} does not broadcast with the batch shape "
                f"{rate.shape[:-1]} of rate (shape {rate.shape})"
            ) from error
        self.rate = jnp.broadcast_to(rate, batch_shape + event_shape)
        self.k = jnp.broadcast_to(k, batch_shape)
        self.k_max = None if k_max is None else max(int(k_max), 0)
        super().__init__(batch_shape, event_shape, validate_args=validate_args)

    @classmethod
    def infer_shapes(cls, rate: tuple[int, ...], k: tuple[int, ...] = ()):
        batch_shape = jnp.broadcast_shapes(tuple(rate[:-1]), tuple(k))
        return batch_shape, tuple(rate[-1:])

    @property
    def has_rsample(self) -> bool:
        return True

    def expand(self, batch_shape) -> ConditionedPoisson:
        batch_shape = tuple(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        new = ConditionedPoisson.__new__(ConditionedPoisson)
        new.rate = jnp.broadcast_to(self.rate, batch_shape + self.event_shape)
        new.k = jnp.broadcast_to(self.k, batch_shape)
        new.k_max = self.k_max
        Distribution.__init__(new, batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self) -> constraints.Constraint:
        return _IntegerComposition(self.k)

    @property
    def probs(self):
        """``p = rate / sum(rate)``, the multinomial probabilities."""
        return self.rate / jnp.sum(self.rate, axis=-1, keepdims=True)

    @property
    def _k_float(self):
        return self.k.astype(self.rate.dtype)

    @property
    def mean(self):
        return self._k_float[..., None] * self.probs

    @property
    def variance(self):
        p = self.probs
        return self._k_float[..., None] * p * (1 - p)

    @property
    def marginals(self) -> Binomial:
        """The conditional marginal of each coordinate: ``z_i ~ Binomial(k, p_i)``."""
        p = self.probs
        total_count = jnp.broadcast_to(self.k[..., None], p.shape)
        return Binomial(total_count=total_count, probs=p, validate_args=False)

    def log_constraint_prob(self):
        """``log P(sum_i z_i = k)`` under the unconstrained Poissons, ``log Poisson(k; sum(rate))``
        (the count likelihood of a bag of known total)."""
        total = jnp.sum(self.rate, axis=-1)
        k = self._k_float
        return k * jnp.log(total) - total - _log_factorial_of_total(k)

    def log_prob(self, value):
        """``log k! - sum_i log z_i! + sum_i z_i log p_i``; ``-inf`` off the support (or a
        ``ValueError`` there with validation on, where the value is concrete).
        Differentiable in ``value`` too."""
        value = jnp.asarray(value, dtype=self.rate.dtype)
        if value.shape[-1:] != self.event_shape:
            raise ValueError(
                f"value of shape {value.shape} does not end in the event shape "
                f"{self.event_shape} of ConditionedPoisson"
            )
        log_prob, in_support = _log_prob_and_support(self.rate, self.k, value)
        if self._validate_args and not_jax_tracer(in_support) and not bool(jnp.all(in_support)):
            raise ValueError(
                "The value argument to ConditionedPoisson.log_prob must be vectors of "
                f"integers >= 0 that sum to exactly k, got {value} with k = {self.k}"
            )
        return log_prob

    def sample(self, key, sample_shape: tuple[int, ...] = ()):
        """An exact sample ``z`` returned as ``z + (m - stop_gradient(m))`` with ``m = k p``:
        the value is exactly ``z``, the gradient that of the conditional mean."""
        sample_shape = tuple(sample_shape)
        rate = lax.stop_gradient(self.rate)
        k = lax.stop_gradient(self.k)
        n = rate.shape[-1]
        if self.k_max == 0:
            z = jnp.zeros(sample_shape + rate.shape, rate.dtype)
        elif (
            self.k_max is not None
            and self.k_max < SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY * n
            and math.prod(sample_shape + self.batch_shape) > 0
        ):
            z = _sample_counts_categorical(
                key, rate, k, k_max=self.k_max, sample_shape=sample_shape
            )
        else:
            z = _sample_counts_sequentially(key, rate, k, sample_shape=sample_shape)
        m = jnp.broadcast_to(self.mean, z.shape)
        return z + (m - lax.stop_gradient(m))

    def entropy(self):
        """Exact entropy ``-log k! - k sum_i p_i log p_i + sum_i E[log z_i!]``,
        ``z_i ~ Binomial(k, p_i)``.

        The expectations sum only over binomial outcomes within a Bennett-inequality window
        around each mean; the dropped terms total at most ``0.01`` times the machine epsilon
        of ``rate``'s dtype (absolute), see `entropy_log_inverse_tail`. ``log m!`` is
        computed in ``rate``'s dtype. Under ``jit`` with a traced ``k``, needs ``k_max``.
        """
        if self.k_max is None:
            raise ValueError(
                "ConditionedPoisson.entropy needs a static bound on k: pass k_max= when k is "
                "traced (inside jit or vmap)"
            )
        half_width, width = _entropy_window(self.rate, self.k, self.k_max)
        expected_log_factorials = _expected_log_factorials(
            self.rate, self.k, k_max=self.k_max, half_width=half_width, width=width
        )
        return _entropy_from_expected_log_factorials(self.rate, self.k, expected_log_factorials)


@vmap_over.register
def _vmap_over_conditioned_poisson(dist: ConditionedPoisson, rate=None, k=None):
    return _default_vmap_over(dist, rate=rate, k=k)


@kl_divergence.register(ConditionedPoisson, ConditionedPoisson)
def _kl_conditioned_poisson(p: ConditionedPoisson, q: ConditionedPoisson):
    """``KL(p || q) = k sum_i p_i log(p_i / q_i)`` for two with the same ``k`` and ``n``."""
    if p.event_shape != q.event_shape:
        raise ValueError(
            f"KL between ConditionedPoisson needs the same number of categories, got "
            f"{p.event_shape[0]} and {q.event_shape[0]}"
        )
    if not_jax_tracer(p.k) and not_jax_tracer(q.k):
        if not np.array_equal(*np.broadcast_arrays(np.asarray(p.k), np.asarray(q.k))):
            raise ValueError("KL between ConditionedPoisson needs the same k")
    _, log_p, _ = _log_p_and_log1m_p(p.rate)
    _, log_q, _ = _log_p_and_log1m_p(q.rate)
    return p._k_float * jnp.sum(p.probs * (log_p - log_q), axis=-1)
