"""PoissonBinomial: the number of ones among independent Bernoullis.

The math: ``docs/distributions/poisson_binomial.md``; the method is that of
``pyro_constrained.poisson_binomial`` (see there), on the JAX exactly-k kernels
(:mod:`numpyro_constrained.exactly_k_kernels`):

* one count at a time (``log_prob``, jittable and differentiable): one tilted upward pass
  per count, the kernels' exact ``log_constraint_prob_value``, with the gradient of
  ``log e_k - sum softplus`` (the exactly-k marginals minus the probabilities);
* every count (``log_pmf``): from concrete logits, tilted windows (about ``0.4 sqrt(n)``
  passes, each admitting the root entries at least ``_WINDOW`` times the largest), with
  tables in float64 whatever the x64 mode (see ``_log_pmf_by_windows``); from traced logits
  (under ``jit``, ``grad``, ``vmap``), one pass per count (moderate n), in the kernels' wide
  dtype.

Each pass's table becomes log-probabilities on the host in float64
(``kernels.count_log_probs``).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpyro.distributions import constraints
from numpyro.distributions.batch_util import vmap_over
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.kl import kl_divergence

from constrained_ppl.arguments import check_value_shape
from numpyro_constrained import _count_edges as edges
from numpyro_constrained import exactly_k_kernels as kernels
from numpyro_constrained._batching import (
    check_expand,
    stored_batch_shape,
    vmap_over_broadcast_leaves,
)
from numpyro_constrained._bernoulli_arguments import (
    LOGITS_PROBS_CONSTRAINTS,
    forced_counts,
    logits_and_probs,
)
from numpyro_constrained._compat import enable_x64
from numpyro_constrained._ekb_terms import _infinite_slope
from numpyro_constrained._repr import parameters_repr
from numpyro_constrained.validation import (
    as_concrete_where_possible,
    is_concrete,
    warn_if_out_of_support,
)

__all__ = ["PoissonBinomial"]


# The torch module's constants (see there): with the tables in float64 (below), a root
# entry at least _WINDOW times its table's largest entry keeps its relative precision to
# about eps / _WINDOW, and entries with |c (j - t)| above _TILT_SPAN are left to other passes.
_WINDOW = 1e-3
_TILT_SPAN = 1024.0


def _flipped(theta):
    """The logits of the zeros: ``-theta`` for the finite ones, ``-inf`` (excluded) stays."""
    return jnp.where(theta > -jnp.inf, -theta, theta)


def _half_pmf(theta: jax.Array, half: np.ndarray) -> np.ndarray:
    """``log P(K = j)`` for ``j <= half`` (per row; ``-inf`` above), concrete kernel logits
    ``theta`` (rows, n), by tilted windows from the bottom up (the torch module's loop; every
    pass takes all rows, so that shapes, and compilations, repeat)."""
    rows, n = theta.shape
    out = np.full((rows, n + 1), -np.inf)
    best = np.full((rows, n + 1), -1.0)
    needed = np.arange(n + 1)[None, :] <= half[:, None]
    target = np.zeros(rows, dtype=np.int64)
    reach = np.zeros(rows, dtype=np.int64)
    active = half >= 0
    while active.any():
        top = np.minimum(half, target + (6.0 * np.sqrt(target + 1.0)).astype(np.int64) + 8)
        k_max = max(1, int(top[active].max()))
        t = np.where(active, target, 0)
        table = kernels.count_log_probs(theta, jnp.asarray(t, jnp.int32), k_max)
        log_p, ratio, c = table.log_probs, table.relative, table.tilt
        width = min(log_p.shape[-1], n + 1)
        log_p, ratio = log_p[:, :width], ratio[:, :width]
        j = np.arange(width)
        span = np.abs(c.astype(np.float64)[:, None] * (j[None, :] - t[:, None])) <= _TILT_SPAN
        accept = (((ratio >= _WINDOW) & span) | (j[None, :] == t[:, None])) & active[:, None]
        better = accept & (ratio > best[:, :width]) & needed[:, :width]
        out[:, :width] = np.where(better, log_p, out[:, :width])
        best[:, :width] = np.where(better, ratio, best[:, :width])
        above = np.where(accept & (j[None, :] >= t[:, None]), j, -1).max(-1)
        reach = np.where(active, np.maximum(above - t, 0), reach)
        covered = (best >= 0) | ~needed
        first = np.where(covered, n + 1, np.arange(n + 1)).min(-1)
        fell_short = first < t
        step = np.where(fell_short, 0, (0.8 * reach).astype(np.int64))
        target = np.where(active, np.maximum(np.minimum(first + step, half), 0), target)
        active = active & (first <= half)
    return out


def _log_pmf_by_windows(theta: jax.Array) -> jax.Array:
    """``log P(K = j)``, j = 0..n, (rows, n + 1), for concrete kernel logits ``theta``."""
    theta = lax.stop_gradient(theta)
    rows, n = theta.shape
    if n == 0:  # no Bernoullis: K = 0
        return jnp.zeros((rows, 1), kernels.wide_dtype(theta.dtype))
    m = np.asarray((theta > -jnp.inf).sum(-1), np.int64)
    low_half = m // 2
    half = np.concatenate([low_half, m - low_half - 1])
    # The tables in float64 whatever the logits' dtype and the x64 mode (this host loop is
    # never traced, so the mode can be switched for it): each leaf's weight exp(theta_i + c)
    # is rounded to the tables' dtype, and the roundings add up in log e_j to about j eps
    # when the logits are tied (the same rounding n times), whatever the FFTs' dtype: in
    # float32, far above float32's rounding of log P from n = 1000 (benchmarks/README.md).
    with enable_x64(True):
        theta = jnp.asarray(np.asarray(theta, np.float64))
        halves = _half_pmf(jnp.concatenate([theta, _flipped(theta)]), half)
    low, high = np.split(halves, 2)
    j = np.arange(n + 1)
    zeros = np.clip(m[:, None] - j, 0, n)
    from_high = np.take_along_axis(high, zeros, -1)
    use_high = (j[None, :] > low_half[:, None]) & (j[None, :] <= m[:, None])
    return jnp.asarray(np.where(use_high, from_high, low))


def _log_pmf_by_counts(theta: jax.Array, k: jax.Array) -> jax.Array:
    """``log P(K = k)`` for kernel logits ``theta`` (rows, n) and counts ``0 <= k <= m``
    (rows,), one tilted pass per row, counts above ``m / 2`` as zeros of the flipped logits:
    the kernels' exact value, carrying the gradient of ``log e_k - sum softplus``. Tables
    are sized ``n // 2`` (static), so this works under ``jit``."""
    wide = kernels.wide_dtype(theta.dtype)
    dtype = theta.dtype
    theta = theta.astype(wide)
    n = theta.shape[-1]
    m = (theta > -jnp.inf).sum(-1)
    flip = k > m - k
    logits = jnp.where(flip[:, None], _flipped(theta), theta)
    count = jnp.where(flip, m - k, k).astype(jnp.int32)
    k_max = n // 2
    parts = kernels.normalizer_parts(logits, count, k_max)
    exact = kernels.log_constraint_prob_value(logits, count, parts)
    finite = logits > -jnp.inf
    softplus = jnp.where(finite, jax.nn.softplus(jnp.where(finite, logits, 0.0)), 0.0).sum(-1)
    formula = kernels.log_normalizer(logits, count, k_max, parts) - softplus
    return (exact + (formula - lax.stop_gradient(formula))).astype(dtype)


def _with_tangents(log_table, tangents):
    """``log(P + dP)`` to first order where ``log P`` is finite: ``dP / P`` added."""
    finite = jnp.isfinite(log_table)
    scale = jnp.exp(lax.stop_gradient(jnp.where(finite, log_table, 0.0)))
    return jnp.where(finite, log_table + tangents / scale, log_table)


def _cumulative(log_p, reverse: bool = False):
    """Running log-sum-exp along the last axis (``lax`` takes no negative axes)."""
    return lax.cumlogsumexp(log_p, axis=log_p.ndim - 1, reverse=reverse)


class PoissonBinomial(Distribution):
    r"""The number of ones ``K = sum_i z_i`` among independent ``z_i ~
    Bernoulli(sigmoid(logits_i))``: the Poisson-binomial distribution,

    .. math:: P(K = k) = e_k(\exp\theta) / \prod_i (1 + \exp\theta_i).

    Batch shape ``logits.shape[:-1]``, event shape ``()``, support ``0..n``. A logit of
    ``+inf`` (``probs = 1``) is always one, ``-inf`` (``probs = 0``) never: counts they rule
    out have probability 0. The numerics and costs are those of
    ``pyro_constrained.PoissonBinomial``: ``log_prob`` keeps the relative precision of the
    wide dtype (float64 with x64 on) at every count, the far tails included, one kernel pass
    per count asked for (n = 1e6 works); ``log_pmf`` and what is built on it (``cdf``,
    ``log_cdf``, ``log_survival_function``, ``entropy``, ``mode``, KL) take about
    ``0.4 sqrt(n)`` passes from concrete logits and one pass per count from traced ones.

    :param logits: log-odds, shape ``batch + (n,)``; entries may be ``+-inf``.
    :param probs: probabilities in [0, 1] instead of logits (exactly one of the two).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from numpyro_constrained import PoissonBinomial
    >>> d = PoissonBinomial(probs=jnp.array([0.1, 0.5, 0.9]))
    >>> [round(float(p), 4) for p in jnp.exp(d.log_prob(jnp.arange(4)))]
    [0.045, 0.455, 0.455, 0.045]
    """

    arg_constraints = LOGITS_PROBS_CONSTRAINTS
    has_enumerate_support = True
    pytree_data_fields = ("logits", "probs")
    # Whether the caller gave probs, whose exact 0s and 1s then get their one-sided
    # derivatives (_count_edges).
    pytree_aux_fields = ("_from_probs",)

    def __init__(self, logits=None, probs=None, *, validate_args=None):
        validate = self._validate_args if validate_args is None else validate_args
        self._from_probs = probs is not None
        with jax.ensure_compile_time_eval():
            self.logits, self.probs = logits_and_probs(logits, probs, "PoissonBinomial", validate)
        super().__init__(self.logits.shape[:-1], (), validate_args=validate_args)

    @property
    def total_count(self) -> int:
        """n, the number of Bernoullis."""
        return self.logits.shape[-1]

    @constraints.dependent_property(is_discrete=True, event_dim=0)
    def support(self) -> constraints.Constraint:
        return constraints.integer_interval(0, self.total_count)

    def _kernel_logits(self):
        """The logits with the always-on Bernoullis removed (-inf), and their number."""
        forced_on, _ = forced_counts(self.logits)
        return jnp.where(self.logits == jnp.inf, -jnp.inf, self.logits), forced_on

    @property
    def mean(self) -> jax.Array:
        finite = jnp.isfinite(self.logits)
        p = jnp.where(finite, jax.nn.sigmoid(self.logits), 0.0).sum(-1)
        mean = p + (self.logits == jnp.inf).sum(-1).astype(self.logits.dtype)
        if self._from_probs:  # d mean / d p_i = 1 at a 0 or 1 too
            delta = self.probs - lax.stop_gradient(self.probs)
            mean = mean + jnp.where(finite, 0.0, delta).sum(-1)
        return mean

    @property
    def variance(self) -> jax.Array:
        # sigmoid(x) sigmoid(-x), not p (1 - p): no cancellation for p near 1.
        finite = jnp.isfinite(self.logits)
        x = jnp.where(finite, self.logits, 0.0)
        variance = jnp.where(finite, jax.nn.sigmoid(x) * jax.nn.sigmoid(-x), 0.0).sum(-1)
        if self._from_probs:  # p (1 - p) is 0 at a 0 or 1, with slope 1 - 2 p
            edge = jnp.where(finite, 0.0, self.probs * (1 - self.probs))
            variance = variance + edge.sum(-1)
        return variance

    def log_prob(self, value) -> jax.Array:
        """``log P(K = value)``: exact to the wide dtype's precision for any count (one
        tilted kernel pass per entry of the broadcast value); ``-inf`` for counts outside
        ``0..n``, not whole, or ruled out by infinite logits (with NumPyro's
        "Out-of-support values" warning when validation is on and the value concrete).
        Differentiable in the logits; works under ``jit``."""
        value = as_concrete_where_possible(value)
        check_value_shape(jnp.shape(value), self.batch_shape, (), "PoissonBinomial.log_prob")
        if self._validate_args:
            warn_if_out_of_support(lambda: self.support(value))
        n = self.total_count
        shape = jnp.broadcast_shapes(jnp.shape(value), stored_batch_shape(self.logits, 1))
        value = jnp.broadcast_to(value, shape)
        whole = (value == jnp.floor(value)) & (value >= 0) & (value <= n)
        theta, forced_on = self._kernel_logits()
        num_free = jnp.isfinite(self.logits).sum(-1)
        count = jnp.where(whole, value, 0).astype(jnp.int32) - forced_on
        possible = whole & (count >= 0) & (count <= num_free)
        count = jnp.minimum(jnp.maximum(count, 0), num_free)
        rows = jnp.broadcast_to(theta, shape + (n,)).reshape(math.prod(shape), n)
        log_p = _log_pmf_by_counts(rows, count.reshape(-1)).reshape(shape)
        if self._from_probs:
            total = jnp.where(possible, value, forced_on).astype(jnp.int32)
            log_p = log_p + edges.count_log_terms(self.probs, self.logits, total)
        # In the dtype the logits and the value promote to, as NumPyro's Binomial.
        log_p = log_p.astype(jnp.result_type(log_p, value))
        return jnp.where(possible, log_p, -jnp.inf)

    def log_pmf(self) -> jax.Array:
        """``log P(K = j)`` for every count j = 0..n, shape ``batch + (n + 1,)``;
        differentiable in the logits when they are traced (then one kernel pass per count)."""
        n = self.total_count
        theta, forced_on = self._kernel_logits()
        batch_shape = stored_batch_shape(self.logits, 1)
        rows = math.prod(batch_shape)
        theta = theta.reshape(rows, n)
        if is_concrete(theta):
            log_p = _log_pmf_by_windows(theta).astype(self.logits.dtype)
        else:
            free = jnp.isfinite(self.logits).sum(-1).reshape(-1, 1)
            j = jnp.broadcast_to(jnp.arange(n + 1), (rows, n + 1))
            counts = jnp.minimum(j, free).reshape(-1)
            log_p = _log_pmf_by_counts(jnp.repeat(theta, n + 1, axis=0), counts)
            log_p = jnp.where(j <= free, log_p.reshape(rows, n + 1), -jnp.inf)
        j = jnp.arange(n + 1)[None, :] - forced_on.reshape(-1, 1)
        shifted = jnp.take_along_axis(log_p, jnp.maximum(j, 0), -1)
        shifted = jnp.where(j >= 0, shifted, -jnp.inf)
        shifted = shifted.reshape(batch_shape + (n + 1,))
        if self._from_probs and not is_concrete(theta):
            counts = jnp.arange(n + 1)
            terms = edges.count_log_terms(
                self.probs[..., None, :], self.logits[..., None, :], counts
            )
            shifted = jnp.where(jnp.isfinite(shifted), shifted + terms, shifted)
        return shifted

    def _cumulative_tables(self, reverse: bool):
        """(log P(K <= j), or log P(K >= j) with ``reverse``; j = 0..n), carrying the
        derivatives that the counts impossible at the point contribute (``_count_edges``)."""
        log_pmf = self.log_pmf()
        table = _cumulative(log_pmf, reverse=reverse)
        if not self._from_probs:
            return table, None
        tangents = edges.new_count_tangents(self.probs, log_pmf)
        if reverse:
            tangents = jnp.flip(jnp.cumsum(jnp.flip(tangents, -1), -1), -1)
        else:
            tangents = jnp.cumsum(tangents, -1)
        return table, tangents

    def _at(self, table, value, name: str, below: float = -jnp.inf) -> jax.Array:
        value = jnp.asarray(value)
        check_value_shape(jnp.shape(value), self.batch_shape, (), f"PoissonBinomial.{name}")
        shape = jnp.broadcast_shapes(jnp.shape(value), stored_batch_shape(self.logits, 1))
        n = self.total_count
        # A NaN value reads NaN (as NumPyro's cdf methods give), not an index cast from NaN.
        nan = jnp.isnan(value)
        index = jnp.clip(jnp.floor(jnp.where(nan, 0, value)), -1, n).astype(jnp.int32) + 1
        padded = jnp.concatenate([jnp.full_like(table[..., :1], below), table], -1)
        padded = jnp.broadcast_to(padded, shape + padded.shape[-1:])
        index = jnp.broadcast_to(index, shape)[..., None]
        return jnp.where(nan, jnp.nan, jnp.take_along_axis(padded, index, -1)[..., 0])

    def log_cdf(self, value) -> jax.Array:
        """``log P(K <= value)``, relatively exact in the lower tail."""
        table, tangents = self._cumulative_tables(reverse=False)
        if tangents is not None:
            table = _with_tangents(table, tangents)
        return self._at(table, value, "log_cdf")

    def cdf(self, value) -> jax.Array:
        """``P(K <= value)``."""
        table, tangents = self._cumulative_tables(reverse=False)
        table = jnp.exp(table)
        if tangents is not None:  # P(K <= first - 1) is 0 with a nonzero slope
            table = table + tangents
        return self._at(table, value, "cdf", below=0.0)

    def log_survival_function(self, value) -> jax.Array:
        """``log P(K > value)``, relatively exact in the upper tail."""
        reverse, tangents = self._cumulative_tables(reverse=True)
        if tangents is not None:
            reverse = _with_tangents(reverse, tangents)
        table = jnp.concatenate([reverse[..., 1:], jnp.full_like(reverse[..., :1], -jnp.inf)], -1)
        result = self._at(table, value, "log_survival_function")
        return jnp.where(jnp.asarray(value) < 0, 0.0, result)

    def entropy(self) -> jax.Array:
        """``-sum_k P(K = k) log P(K = k)`` from ``log_pmf``."""
        log_p = self.log_pmf()
        p = jnp.exp(log_p)
        entropy = -jnp.where(p > 0, p * jnp.where(p > 0, log_p, 0.0), 0.0).sum(-1)
        if self._from_probs:  # a new count's -w log w: an infinite slope
            entropy = entropy + _infinite_slope(self.probs, edges.unbounded(self.probs))
        return entropy

    @property
    def mode(self) -> jax.Array:
        """The most likely count (the smaller of two tied ones)."""
        return jnp.argmax(self.log_pmf(), -1).astype(self.logits.dtype)

    def sample(self, key, sample_shape=()) -> jax.Array:
        """Exact draws: the sum of independent Bernoulli draws (O(n) per draw)."""
        shape = tuple(sample_shape) + self.batch_shape + (self.total_count,)
        probs = lax.stop_gradient(jnp.broadcast_to(self.probs, shape))
        draws = jax.random.uniform(key, shape, dtype=probs.dtype) < probs
        return draws.sum(-1).astype(self.logits.dtype)

    def enumerate_support(self, expand: bool = True) -> jax.Array:
        """The counts 0..n, shape ``(n + 1,) + batch_shape`` (``expand=True``) or
        ``(n + 1,) + (1,) * len(batch_shape)``, as NumPyro's ``Binomial``."""
        values = jnp.arange(self.total_count + 1, dtype=self.logits.dtype)
        values = values.reshape((-1,) + (1,) * len(self.batch_shape))
        if expand:
            values = jnp.broadcast_to(values, values.shape[:1] + self.batch_shape)
        return values

    def expand(self, batch_shape) -> "PoissonBinomial":
        """A view with batch shape ``batch_shape`` (parameters broadcast); NumPyro's
        ``ValueError`` where the current batch shape does not broadcast to it."""
        batch_shape = tuple(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        check_expand(self.batch_shape, batch_shape)
        new = type(self).__new__(type(self))
        n = self.total_count
        new.logits = jnp.broadcast_to(self.logits, batch_shape + (n,))
        new.probs = jnp.broadcast_to(self.probs, batch_shape + (n,))
        new._from_probs = self._from_probs
        Distribution.__init__(new, batch_shape, (), validate_args=False)
        new._validate_args = self._validate_args
        return new

    @classmethod
    def infer_shapes(cls, logits=None, probs=None):
        shape = logits if logits is not None else probs
        return tuple(shape[:-1]), ()

    def __repr__(self) -> str:
        return parameters_repr(type(self).__name__, {"logits": self.logits})


@vmap_over.register
def _vmap_over_poisson_binomial(dist: PoissonBinomial, logits=None, probs=None):
    # logits and probs are always both stored, each derived from the other, so a vmapped
    # argument of either maps both.
    shared = logits if logits is not None else probs
    return vmap_over_broadcast_leaves(dist, logits=shared, probs=shared)


@kl_divergence.register(PoissonBinomial, PoissonBinomial)
def _kl_poisson_binomial(p: PoissonBinomial, q: PoissonBinomial) -> jax.Array:
    """``sum_k P(k) (log P(k) - log Q(k))`` over the counts (no closed form); ``+inf``
    where p puts mass on a count q rules out."""
    log_p, log_q = p.log_pmf(), q.log_pmf()
    size = max(log_p.shape[-1], log_q.shape[-1])

    def pad(table):
        width = [(0, 0)] * (table.ndim - 1) + [(0, size - table.shape[-1])]
        return jnp.pad(table, width, constant_values=-jnp.inf)

    log_p, log_q = jnp.broadcast_arrays(pad(log_p), pad(log_q))
    mass = jnp.exp(log_p)
    safe = jnp.where(mass > 0, log_p - log_q, 0.0)
    kl = jnp.where(mass > 0, mass * safe, 0.0).sum(-1)
    if p._from_probs:
        # Moving p's 0 (1) gives mass to the count just above (below) p's range: -w log w,
        # an infinite slope down, unless q rules that count out (the KL becomes infinite).
        probs = p.probs
        padded = jnp.pad(log_q, [(0, 0)] * (log_q.ndim - 1) + [(1, 2)], constant_values=-jnp.inf)
        last = p.total_count - (probs == 0).sum(-1, keepdims=True)
        first = (probs == 1).sum(-1, keepdims=True)
        shape = padded.shape[:-1] + (1,)
        q_above = jnp.take_along_axis(padded, jnp.broadcast_to(last + 2, shape), -1) > -jnp.inf
        q_below = jnp.take_along_axis(padded, jnp.broadcast_to(first, shape), -1) > -jnp.inf
        opens = jnp.where(probs == 0, q_above, jnp.where(probs == 1, q_below, True))
        direction = edges.unbounded(probs) * jnp.where(opens, -1.0, 1.0).astype(probs.dtype)
        kl = kl + _infinite_slope(probs, direction)
    return kl
