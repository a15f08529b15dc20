"""The one-sided derivatives of the count distributions (``PoissonBinomial``,
``CountConstrainedBernoulli``) in ``probs`` of exactly 0 and 1 (NumPyro); the method is
that of ``pyro_constrained._count_edges`` (see there and docs/numerics.md). The terms are
zeros carrying those derivatives; the ones that need extra kernel passes are computed only
under differentiation (``range_zeros`` and ``_odds_terms``, ``custom_jvp`` functions)."""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_constrained._ekb_terms import _free_problem, _odds_series, _odds_terms
from numpyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli

__all__ = [
    "count_log_terms",
    "new_count_tangents",
    "range_direction",
    "range_terms",
    "range_zeros",
    "unbounded",
]


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def range_zeros(width: int, probs, logits, low, high):
    """Zeros shaped as ``range_terms``' outputs, whose derivatives are ``range_terms``':
    the extra kernel passes run only under differentiation."""
    batch = jnp.broadcast_shapes(probs.shape[:-1], jnp.shape(low), jnp.shape(high))
    n = probs.shape[-1]
    zeros = jnp.zeros(batch + (n + 1,), probs.dtype)
    return zeros[..., 0], zeros[..., :n], zeros[..., 0], zeros


@range_zeros.defjvp
def _range_zeros_jvp(width, primals, tangents):
    out = range_zeros(width, *primals)
    _, tangent = jax.jvp(partial(range_terms, width), primals, tangents)
    return out, tangent


def _delta(probs):
    return probs - lax.stop_gradient(probs)


def count_log_terms(probs, logits, counts) -> jax.Array:
    """Zeros of the counts' broadcast shape with the batch whose derivatives in the probs at
    exactly 0 and 1 are the one-sided ones of ``log P(K = counts)`` (to second order:
    ``ExactlyKBernoulli``'s odds terms, ``_odds_terms``); 0 where the probs rule the count
    out. ``counts``: whole numbers in 0..n."""
    n = logits.shape[-1]
    shape = jnp.broadcast_shapes(jnp.shape(counts), logits.shape[:-1])
    logits = jnp.broadcast_to(logits, shape + (n,))
    probs = jnp.broadcast_to(probs, shape + (n,))
    problem = _free_problem(logits, jnp.broadcast_to(counts, shape), n)
    odds = _odds_terms(probs, logits, problem, n)
    return jnp.where(problem.infeasible, 0.0, odds.log_normalizer + odds.softplus)


def unbounded(probs) -> jax.Array:
    """+1 at a 0, -1 at a 1, else 0: the count law's entropy moves by ``-w log w`` when such
    a variable moves, an infinite one-sided slope with this sign."""
    return jnp.where(probs == 0, 1.0, jnp.where(probs == 1, -1.0, 0.0)).astype(probs.dtype)


def new_count_tangents(probs, log_pmf) -> jax.Array:
    """Zeros of ``log_pmf``'s shape carrying the derivatives of ``P(K = j)`` at the two
    counts impossible at the point and possible to first order (``last + 1``: ``P(K =
    last) sum_{p_i = 0} dp_i``; ``first - 1``: ``-P(K = first) sum_{p_i = 1} dp_i``)."""
    n = probs.shape[-1]
    off, on = probs == 0, probs == 1
    d_off = jnp.where(off, _delta(probs), 0.0).sum(-1, keepdims=True)
    d_on = jnp.where(on, _delta(probs), 0.0).sum(-1, keepdims=True)
    shape = log_pmf.shape[:-1] + (1,)
    last = jnp.broadcast_to(n - off.sum(-1, keepdims=True), shape)
    first = jnp.broadcast_to(on.sum(-1, keepdims=True), shape)
    p_last = jnp.exp(jnp.take_along_axis(log_pmf, last, -1))
    p_first = jnp.exp(jnp.take_along_axis(log_pmf, first, -1))
    j = jnp.arange(n + 1)
    above = jnp.where(j == last + 1, p_last * d_off, 0.0)
    below = jnp.where(j == first - 1, -p_first * d_on, 0.0)
    return (above + below).astype(log_pmf.dtype)


def range_direction(probs, logits, low, high) -> jax.Array:
    """Per variable: +1 at a 0 that the range lets switch on, -1 at a 1 that it lets switch
    off, else 0 (the sign of the entropy's infinite one-sided slope)."""
    n = logits.shape[-1]
    on_count = (logits == jnp.inf).sum(-1)
    top = n - (logits == -jnp.inf).sum(-1)

    def room(shift):  # a count of the free variables, shifted by ``shift``, in the range
        return jnp.maximum(low + shift, on_count) <= jnp.minimum(high + shift, top)

    feasible = room(0)
    can_on = (room(-1) & feasible)[..., None]
    can_off = (room(1) & feasible)[..., None]
    direction = jnp.where((probs == 0) & can_on, 1.0, 0.0)
    return jnp.where((probs == 1) & can_off, -1.0, direction).astype(probs.dtype)


def range_terms(width: int, probs, logits, low, high):
    """(log P(range) less its value and the probs' own log(1 - p), log p; the marginals;
    the probs' ``sum log(1 - p) + sum log p`` at the 0s and 1s; the count table's share
    from the neighbouring counts), zero-valued functions of the probs with the one-sided
    derivatives at exact 0s and 1s (see ``pyro_constrained._count_edges.range_tangents``).
    ``width``: the static number of counts in the widest range; evaluate it through
    ``range_zeros``."""
    n = logits.shape[-1]
    on_count = (logits == jnp.inf).sum(-1)
    top = n - (logits == -jnp.inf).sum(-1)
    first, last = jnp.maximum(low, on_count), jnp.minimum(high, top)
    infeasible = first > last
    step = jnp.arange(width + 4).reshape((-1,) + (1,) * first.ndim)
    counts = first + step - 2
    possible = (counts >= on_count) & (counts <= top) & ~infeasible
    safe = jnp.where(possible, counts, jnp.where(infeasible, 0, first)).astype(jnp.int32)
    finite = jnp.where(infeasible[..., None], 0.0, logits)
    rows = ExactlyKBernoulli(
        logits=jnp.broadcast_to(finite, (width + 4,) + logits.shape),
        k=safe,
        k_max=n,
        validate_args=False,
    )
    log_p = jnp.where(possible, rows.log_constraint_prob(), -jnp.inf)
    mu_rows = rows.mean
    largest = float(jnp.finfo(logits.dtype).max)
    log_sums, mixtures = {}, {}
    for shift in (-2, -1, 0, 1, 2):
        inside = (counts >= low + shift) & (counts <= high + shift)
        log_w = jnp.where(inside, log_p, -jnp.inf)
        log_sums[shift] = jax.nn.logsumexp(log_w, axis=0)
        weights = jnp.nan_to_num(jax.nn.softmax(log_w, axis=0), nan=0.0)[..., None]
        mixtures[shift] = jnp.where(weights > 0, weights * mu_rows, 0.0).sum(0)
    ratio = {
        shift: jnp.nan_to_num(jnp.minimum(jnp.exp(log_sums[shift] - log_sums[0]), largest))
        for shift in (-2, -1, 1, 2)
    }
    log_normalizer, marginals, softplus = _odds_series(
        probs, ratio, mixtures, mixtures[0], infeasible
    )
    relative = jnp.where(possible, jnp.nan_to_num(jnp.exp(log_p - log_sums[0])), 0.0)
    sum_off = jnp.where(probs == 0, _delta(probs), 0.0).sum(-1)
    sum_on = jnp.where(probs == 1, _delta(probs), 0.0).sum(-1)
    table = jnp.zeros(first.shape + (n + 1,), probs.dtype)
    for move, shift in ((sum_off, 1), (-sum_on, -1)):
        target = counts + shift
        inside = (target >= low) & (target <= high) & (target >= 0) & (target <= n)
        share = jnp.where(inside, relative, 0.0) * move
        one_hot = jax.nn.one_hot(jnp.clip(target, 0, n), n + 1, dtype=probs.dtype)
        table = table + (share[..., None] * one_hot).sum(0)
    return log_normalizer, marginals, softplus, table
