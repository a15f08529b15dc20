"""CountConstrainedBernoulli: independent Bernoullis conditioned on low <= sum z <= high.

The math: ``docs/distributions/count_constrained_bernoulli.md``; the method is that of
``pyro_constrained.count_constrained_bernoulli``: a mixture over the counts of the range of
``ExactlyKBernoulli``, stacked on a leading dimension of ``R`` counts (the widest range of
the batch when the bounds are concrete, all ``n + 1`` counts when they are traced).
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
from numpyro.util import not_jax_tracer

from constrained_ppl.arguments import check_count, check_value_shape
from constrained_ppl.enumeration import check_support_size, k_hot_table
from numpyro_constrained import _count_edges as edges
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
from numpyro_constrained._compat import refuse_scalar_coordinate_consumers
from numpyro_constrained._ekb_terms import _infinite_slope
from numpyro_constrained._repr import parameters_repr
from numpyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli
from numpyro_constrained.validation import (
    as_concrete_where_possible,
    is_concrete,
    warn_if_out_of_support,
)

__all__ = ["CountConstrainedBernoulli", "CountRange"]


class CountRange(constraints.Constraint):
    """0/1 vectors (last dimension) with ``low <= sum <= high``; the bounds broadcast with
    the batch."""

    is_discrete = True
    event_dim = 1

    def __init__(self, low, high):
        self.low, self.high = low, high

    def __call__(self, x):
        xp = jnp if isinstance(x, jax.Array) else np
        binary = xp.all((x == 0) | (x == 1), axis=-1)
        total = xp.sum(x, axis=-1)
        return binary & (total >= self.low) & (total <= self.high)

    def feasible_like(self, prototype):
        n = jnp.shape(prototype)[-1]
        first = jnp.arange(n) < jnp.expand_dims(jnp.asarray(self.low), -1)
        return jnp.broadcast_to(first, jnp.shape(prototype)).astype(jnp.result_type(prototype))

    def tree_flatten(self):
        return (self.low, self.high), (("low", "high"), dict())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(low={self.low}, high={self.high})"


def _as_bound(bound, default: int, name: str):
    if bound is None:
        return jnp.asarray(default)
    check_count(bound, concrete=not_jax_tracer(bound), name=name)
    return jnp.asarray(bound).astype(jnp.int32)


class CountConstrainedBernoulli(Distribution):
    r"""Independent Bernoullis ``z_i ~ Bernoulli(sigmoid(logits_i))`` conditioned on
    ``low <= sum_i z_i <= high``:

    .. math:: p(z) = \exp(\theta \cdot z) / \sum_{k=\mathrm{low}}^{\mathrm{high}}
        e_k(\exp \theta), \qquad \mathrm{low} \le |z| \le \mathrm{high}.

    "At most k" is ``low=0, high=k``, "at least k" is ``low=k`` (``high`` defaults to n),
    and ``low = high = k`` is ``ExactlyKBernoulli``. A logit of ``+inf`` forces its variable
    on, ``-inf`` off. The mixture over the counts of ``ExactlyKBernoulli`` (see
    ``pyro_constrained.CountConstrainedBernoulli``): one kernel pass per count of the
    widest range when the bounds are concrete, per count 0..n when they are traced.

    :param logits: log-odds, shape ``batch + (n,)``; entries may be ``+-inf``.
    :param probs: probabilities in [0, 1] instead of logits (exactly one of the two).
    :param low: the smallest allowed count (default 0), broadcasting with the batch.
    :param high: the largest allowed count (default n), broadcasting with the batch.

    ``sample`` returns an exact draw carrying the straight-through gradient of the
    conditional marginals, ``z + (mu - stop_gradient(mu))``.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from numpyro_constrained import CountConstrainedBernoulli
    >>> d = CountConstrainedBernoulli(logits=jnp.array([2.0, 1.0, 0.5, -1.0]), high=2)
    >>> z = d.sample(jax.random.PRNGKey(0), (5,))
    >>> bool((z.sum(-1) <= 2).all())
    True
    >>> round(float(jnp.exp(d.log_prob(d.enumerate_support())).sum()), 5)
    1.0
    """

    arg_constraints = {
        **LOGITS_PROBS_CONSTRAINTS,
        "low": constraints.nonnegative_integer,
        "high": constraints.nonnegative_integer,
    }
    has_enumerate_support = True
    reparametrized_params = ["logits", "probs"]
    # NumPyro infers has_rsample from reparametrized_params covering arg_constraints, and the
    # bounds, counts, have no gradient; the samples carry the straight-through gradient, so
    # ELBOs must treat the site as reparameterised (not switch to score functions).
    has_rsample = True
    pytree_data_fields = ("logits", "probs", "low", "high")
    # Whether the caller gave probs, whose exact 0s and 1s then get their one-sided
    # derivatives (_count_edges).
    pytree_aux_fields = ("_from_probs",)
    #: The largest support that `enumerate_support` builds (a ``ValueError`` beyond it).
    max_support = 2**16

    def __init__(self, logits=None, probs=None, *, low=None, high=None, validate_args=None):
        validate = self._validate_args if validate_args is None else validate_args
        self._from_probs = probs is not None
        with jax.ensure_compile_time_eval():
            logits, probs = logits_and_probs(logits, probs, "CountConstrainedBernoulli", validate)
            n = logits.shape[-1]
            low, high = _as_bound(low, 0, "low"), _as_bound(high, n, "high")
            try:
                batch_shape = jnp.broadcast_shapes(logits.shape[:-1], low.shape, high.shape)
            except ValueError as error:
                raise ValueError(
                    f"low {low.shape} and high {high.shape} do not broadcast with the batch "
                    f"shape {logits.shape[:-1]} of the logits"
                ) from error
            self.logits = jnp.broadcast_to(logits, batch_shape + (n,))
            self.probs = jnp.broadcast_to(probs, batch_shape + (n,))
            self.low, self.high = (
                jnp.broadcast_to(low, batch_shape),
                jnp.broadcast_to(high, batch_shape),
            )
            if validate:
                self._check_bounds()
        super().__init__(batch_shape, (n,), validate_args=validate_args)

    def _check_bounds(self) -> None:
        n = self.logits.shape[-1]
        if is_concrete(self.low, self.high) and self.low.size:
            low, high = np.asarray(self.low), np.asarray(self.high)
            if low.min() < 0 or high.max() > n or np.any(low > high):
                raise ValueError(f"the bounds must satisfy 0 <= low <= high <= n = {n}")
            if is_concrete(self.logits):
                first, last = (np.asarray(b) for b in self._range())
                if np.any(first > last):
                    raise ValueError(
                        "logits make the constraint impossible: the infinite logits (probs 0 "
                        "or 1) leave no count in low..high for some batch element"
                    )

    def _range(self):
        """(first, last): the bounds narrowed to the counts the infinite logits allow."""
        n = self.logits.shape[-1]
        forced_on, forced_off = forced_counts(self.logits)
        first = jnp.maximum(self.low, forced_on)
        last = jnp.minimum(self.high, n - forced_off)
        return first, last

    def _width(self) -> int:
        """R, the number of stacked counts: static (the widest range when the bounds and
        logits are concrete, n + 1 otherwise)."""
        n = self.logits.shape[-1]
        with jax.ensure_compile_time_eval():
            first, last = self._range()
        if is_concrete(first, last) and first.size:
            return max(1, int(np.max(np.asarray(last) - np.asarray(first))) + 1)
        return n + 1

    def _stack(self):
        """(stacked ExactlyKBernoulli over the counts, counts, in_range, infeasible)."""
        width = self._width()
        # Concrete where the logits and bounds are (constants closed over under jit): then
        # the stacked ExactlyKBernoulli gets a concrete k and k_max, the same tables and so
        # the same draws from a key as outside jit.
        with jax.ensure_compile_time_eval():
            first, last = self._range()
        infeasible = first > last
        r = jnp.arange(width).reshape((-1,) + (1,) * len(stored_batch_shape(self.logits, 1)))
        in_range = first + r <= last
        counts = jnp.maximum(jnp.minimum(first + r, last), 0)
        counts = jnp.where(infeasible, 0, counts)
        logits = jnp.broadcast_to(self.logits, (width,) + self.logits.shape)
        logits = jnp.where(infeasible[..., None], 0.0, logits)
        k_max = (
            min(self.logits.shape[-1], max(0, int(np.max(np.asarray(last)))))
            if is_concrete(last) and last.size
            else None
        )
        stacked = ExactlyKBernoulli(logits=logits, k=counts, k_max=k_max, validate_args=False)
        return stacked, counts, in_range, infeasible

    def _edge_terms(self):
        """Zeros carrying the one-sided derivatives at given probs of exactly 0 and 1 (see
        ``_count_edges.range_terms``), or None from logits."""
        if not self._from_probs:
            return None
        args = (self.probs, self.logits, self.low, self.high)
        return edges.range_zeros(self._width(), *args)

    def _log_weights(self, stacked, in_range, edge=None):
        """(log P(K = k | range) for the stacked counts, log P(range))."""
        log_p = jnp.where(in_range, stacked.log_constraint_prob(), -jnp.inf)
        log_range = jax.nn.logsumexp(log_p, axis=0)
        if edge is not None:  # the normaliser's one-sided derivatives at 0s and 1s
            log_range = log_range + edge[0]
        return log_p - log_range, log_range

    def log_range_prob(self) -> jax.Array:
        """``log P(low <= sum z <= high)`` under the unconstrained Bernoullis."""
        stacked, _, in_range, infeasible = self._stack()
        edge = self._edge_terms()
        log_range = self._log_weights(stacked, in_range, edge)[1]
        if edge is not None:  # the probs' own log(1 - p) and log p at the 0s and 1s
            log_range = log_range + edge[2]
        return jnp.where(infeasible, -jnp.inf, log_range)

    @property
    def count_distribution(self) -> jax.Array:
        """``P(sum z = k)`` under this distribution for k = 0..n, shape ``batch + (n + 1,)``."""
        stacked, counts, in_range, _ = self._stack()
        edge = self._edge_terms()
        log_w = self._log_weights(stacked, in_range, edge)[0]
        weights = jnp.where(in_range, jnp.exp(log_w), 0.0)
        n = self.logits.shape[-1]
        one_hot = jax.nn.one_hot(counts, n + 1, dtype=weights.dtype)
        table = (weights[..., None] * one_hot).sum(0)
        return table if edge is None else table + edge[3]

    def _marginals(self):
        stacked, _, in_range, infeasible = self._stack()
        log_w, _ = self._log_weights(stacked, in_range)
        terms = jnp.where(in_range[..., None], jnp.exp(log_w)[..., None] * stacked.mean, 0.0)
        mu = terms.sum(0)
        edge = self._edge_terms()
        if edge is not None:
            # The terms carry the normaliser's share of the derivative at the 0s and 1s
            # (the weights here do not).
            mu = mu + edge[1]
        return jnp.where(infeasible[..., None], jnp.nan, mu)

    @property
    def mean(self) -> jax.Array:
        """The conditional marginals ``P(z_i = 1 | low <= sum z <= high)``."""
        return self._marginals()

    @property
    def variance(self) -> jax.Array:
        mu = self._marginals()
        return mu * (1 - mu)

    @property
    def support(self) -> CountRange:
        return CountRange(self.low, self.high)

    @property
    def mode(self) -> jax.Array:
        """The most likely vector: ones at the k largest logits, k the number of positive
        logits clamped into the range; ties go to the lower index."""
        first, last = self._range()
        k = jnp.minimum(jnp.maximum((self.logits > 0).sum(-1), first), last)
        order = jnp.argsort(-self.logits, axis=-1, stable=True)
        ranks = jnp.argsort(order, axis=-1, stable=True)
        return (ranks < k[..., None]).astype(self.logits.dtype)

    def log_prob(self, value) -> jax.Array:
        """``log P(z | K = |z|) + log P(K = |z| | range)`` (exact); ``-inf`` outside the
        support, with NumPyro's "Out-of-support values" warning when validation is on and
        the value concrete."""
        value = as_concrete_where_possible(value)
        check_value_shape(
            jnp.shape(value), self.batch_shape, self.event_shape, "CountConstrainedBernoulli"
        )
        if self._validate_args:
            warn_if_out_of_support(lambda: self.support(value))
        stacked, _, in_range, infeasible = self._stack()
        log_w, _ = self._log_weights(stacked, in_range, self._edge_terms())
        batch_shape = stored_batch_shape(self.logits, 1)
        shape = jnp.broadcast_shapes(jnp.shape(value)[:-1], batch_shape)
        value = jnp.broadcast_to(value, shape + self.event_shape)
        first, last = (jnp.broadcast_to(b, shape) for b in self._range())
        total = lax.stop_gradient(value).sum(-1)
        binary = jnp.all((value == 0) | (value == 1), axis=-1)
        inside = binary & (total >= first) & (total <= last) & ~jnp.broadcast_to(infeasible, shape)
        # Outside the support a placeholder count in 0..max(last, 0) (so at most k_max),
        # whose result is discarded: first itself exceeds last where low > high.
        placeholder = jnp.clip(first, 0, jnp.maximum(last, 0))
        k = jnp.where(inside, jnp.round(total), placeholder).astype(jnp.int32)
        logits = jnp.broadcast_to(self.logits, shape + self.event_shape)
        within = ExactlyKBernoulli(logits=logits, k=k, k_max=stacked.k_max, validate_args=False)
        safe = jnp.where(inside[..., None], value, within.mode)
        width = log_w.shape[0]
        extra = (1,) * (len(shape) - len(batch_shape))
        log_w = jnp.broadcast_to(log_w.reshape((width,) + extra + batch_shape), (width,) + shape)
        row = jnp.clip(k - first, 0, width - 1)
        log_weight = jnp.take_along_axis(log_w, row[None], axis=0)[0]
        return jnp.where(inside, within.log_prob(safe) + log_weight, -jnp.inf)

    def sample(self, key, sample_shape=()) -> jax.Array:
        """An exact draw (a count from the truncated count law, then a k-hot vector at that
        count) carrying the straight-through gradient of the conditional marginals."""
        stacked, counts, in_range, infeasible = self._stack()
        if not_jax_tracer(infeasible) and np.any(infeasible):
            raise ValueError(
                "CountConstrainedBernoulli.sample: the constraint is impossible for some batch "
                "element (no count in low..high that the infinite logits allow)"
            )
        sample_shape = tuple(sample_shape)
        log_w, _ = self._log_weights(stacked, in_range)
        key_count, key_vector = jax.random.split(key)
        log_w = lax.stop_gradient(jnp.moveaxis(log_w, 0, -1))
        rows = jax.random.categorical(
            key_count, log_w, shape=sample_shape + stored_batch_shape(self.logits, 1)
        )
        k = jnp.take_along_axis(
            jnp.broadcast_to(jnp.moveaxis(counts, 0, -1), rows.shape + (counts.shape[0],)),
            rows[..., None],
            axis=-1,
        )[..., 0]
        logits = lax.stop_gradient(jnp.broadcast_to(self.logits, sample_shape + self.logits.shape))
        within = ExactlyKBernoulli(logits=logits, k=k, k_max=stacked.k_max, validate_args=False)
        z = lax.stop_gradient(within.sample(key_vector))
        mu = self._marginals()
        return z + (mu - lax.stop_gradient(mu))

    def entropy(self) -> jax.Array:
        """``H(K) + sum_k P(k | range) H(z | K = k)`` from the exact exactly-k entropies."""
        stacked, _, in_range, infeasible = self._stack()
        log_w, _ = self._log_weights(stacked, in_range)
        terms = jnp.where(
            in_range, jnp.exp(log_w) * (stacked.entropy() - jnp.where(in_range, log_w, 0.0)), 0.0
        )
        entropy = terms.sum(0)
        if self._from_probs:  # -w log w where a 0 or 1 can move: an infinite slope
            entropy = entropy + _infinite_slope(self.probs, self._edge_direction())
        return jnp.where(infeasible, jnp.nan, entropy)

    def _edge_direction(self):
        return edges.range_direction(self.probs, self.logits, self.low, self.high)

    def enumerate_support(self, expand: bool = True) -> jax.Array:
        """Every vector of the support once (counts in increasing order, each count's vectors
        in lexicographic order of the positions of the ones); needs concrete bounds and
        logits, one range and the same infinite logits over the batch (else a
        ``ValueError``)."""
        name = type(self).__name__
        n = self.event_shape[0]
        if not is_concrete(self.logits, self.low, self.high):
            raise ValueError(f"{name}.enumerate_support needs concrete logits and bounds")
        first, last = (np.asarray(b) for b in self._range())
        # Funsor's enumeration cannot represent a vector site. The Gibbs samplers' flips of
        # one coordinate can move between the counts of a range, but never within one count.
        refuse_scalar_coordinate_consumers(name, gibbs=bool(np.any(first == last)))
        first, last = np.unique(first), np.unique(last)
        logits = np.asarray(self.logits).reshape(-1, n)
        on, off = logits == np.inf, logits == -np.inf
        same = (on == on[:1]).all() and (off == off[:1]).all()
        if first.size != 1 or last.size != 1 or not same:
            raise ValueError(
                f"{name}.enumerate_support needs one range and the same infinite logits over "
                "the batch (one support)"
            )
        forced_on, forced_off = np.nonzero(on[0])[0].tolist(), np.nonzero(off[0])[0].tolist()
        free = n - len(forced_on) - len(forced_off)
        lo, hi = int(first[0]), int(last[0])
        count = sum(math.comb(free, k - len(forced_on)) for k in range(lo, hi + 1))
        check_support_size(count, self.max_support, name)
        table = np.concatenate(
            [k_hot_table(n, k, forced_on, forced_off) for k in range(lo, hi + 1)]
            or [np.zeros((0, n))]
        )
        values = jnp.asarray(table, dtype=self.logits.dtype)
        values = values.reshape((count,) + (1,) * len(self.batch_shape) + self.event_shape)
        if expand:
            values = jnp.broadcast_to(values, (count,) + self.batch_shape + self.event_shape)
        return values

    def expand(self, batch_shape) -> "CountConstrainedBernoulli":
        """A view with batch shape ``batch_shape`` (parameters broadcast); NumPyro's
        ``ValueError`` where the current batch shape does not broadcast to it."""
        batch_shape = tuple(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        check_expand(self.batch_shape, batch_shape)
        new = type(self).__new__(type(self))
        new.logits = jnp.broadcast_to(self.logits, batch_shape + self.event_shape)
        new.probs = jnp.broadcast_to(self.probs, batch_shape + self.event_shape)
        new.low = jnp.broadcast_to(self.low, batch_shape)
        new.high = jnp.broadcast_to(self.high, batch_shape)
        new._from_probs = self._from_probs
        Distribution.__init__(new, batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @classmethod
    def infer_shapes(cls, logits=None, probs=None, low=(), high=()):
        shape = logits if logits is not None else probs
        batch_shape = jnp.broadcast_shapes(tuple(shape[:-1]), tuple(low), tuple(high))
        return batch_shape, tuple(shape[-1:])

    def __repr__(self) -> str:
        return parameters_repr(
            type(self).__name__,
            {"logits": self.logits, "low": self.low, "high": self.high},
            integers=("low", "high"),
        )


@vmap_over.register
def _vmap_over_count_constrained_bernoulli(
    dist: CountConstrainedBernoulli, logits=None, probs=None, low=None, high=None
):
    # logits and probs are always both stored, each derived from the other, so a vmapped
    # argument of either maps both.
    shared = logits if logits is not None else probs
    return vmap_over_broadcast_leaves(dist, logits=shared, probs=shared, low=low, high=high)


@kl_divergence.register(CountConstrainedBernoulli, CountConstrainedBernoulli)
def _kl_count_constrained(p: CountConstrainedBernoulli, q: CountConstrainedBernoulli):
    """The chain rule over the count: ``KL(P_K || Q_K) + sum_k P(k) KL(p(z | k) || q(z | k))``."""
    if p.event_shape != q.event_shape:
        raise ValueError(f"KL needs the same n, got {p.event_shape[0]} and {q.event_shape[0]}")
    if is_concrete(p.low, q.low, p.high, q.high) and not (
        np.array_equal(*np.broadcast_arrays(p.low, q.low))
        and np.array_equal(*np.broadcast_arrays(p.high, q.high))
    ):
        raise ValueError("KL between CountConstrainedBernoulli needs the same bounds")
    # Broadcast batch shapes, as the other classes' KL: the stacked rows below need one.
    batch_shape = jnp.broadcast_shapes(p.batch_shape, q.batch_shape)
    p, q = p.expand(batch_shape), q.expand(batch_shape)
    p_stack, _, in_range, p_bad = p._stack()
    q_stack, _, q_in_range, q_bad = q._stack()
    if p_stack.batch_shape != q_stack.batch_shape or (
        is_concrete(in_range, q_in_range) and not np.array_equal(in_range, q_in_range)
    ):
        raise ValueError(
            "KL between CountConstrainedBernoulli needs the same feasible range under the "
            "infinite logits"
        )
    p_log_w, _ = p._log_weights(p_stack, in_range)
    q_log_w, _ = q._log_weights(q_stack, in_range, q._edge_terms())
    within = kl_divergence(p_stack, q_stack)
    ratio = jnp.where(in_range, p_log_w - q_log_w, 0.0)
    terms = jnp.where(in_range, jnp.exp(p_log_w) * (ratio + within), 0.0)
    kl = terms.sum(0)
    if p._from_probs:
        # -H(p)'s infinite slope, or +inf where q has the same infinite logit (moving p's
        # mass onto vectors that q forbids makes the KL infinite).
        same = jnp.where(q.logits == p.logits, -1.0, 1.0).astype(p.probs.dtype)
        kl = kl + _infinite_slope(p.probs, -p._edge_direction() * same)
    return jnp.where(p_bad | q_bad, jnp.nan, kl)
