"""ExactlyKBernoulli's glue around the kernels (NumPyro): the free problem left by the
infinite logits, the exact values carrying their formulas' gradients, and the one-sided
derivatives at probs of exactly 0 and 1.

These are small jitted pure functions: in eager use every JAX operation compiles once per
shape, and one compilation for a dozen operations is about ten times cheaper. The kernels
stay separate calls so that their (larger) compilations are shared between the methods.
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from numpyro_constrained import exactly_k_kernels as kernels


def _softplus(x: jax.Array) -> jax.Array:
    # Exact (no linear threshold), with a custom JVP that is right at 0; relu(x) +
    # log1p(exp(-|x|)) has a wrong autograd derivative at x = 0. Inputs here are finite.
    return jax.nn.softplus(x)


class _FreeProblem(NamedTuple):
    """The kernels' problem: forced-on variables set to -inf and subtracted from k, k clamped
    into the feasible range (``infeasible`` marks where it was not), and the batch elements
    with a single k-hot vector in the support."""

    logits: jax.Array
    k: jax.Array
    infeasible: jax.Array
    deterministic: jax.Array


@partial(jax.jit, static_argnames="bound")
def _free_problem(logits: jax.Array, k: jax.Array, bound: int) -> _FreeProblem:
    """``bound``: the largest valid k, ``min(n, k_max)``. A k outside ``0..bound`` or not a
    whole number (possible only when traced: concrete ones are checked) is infeasible, and
    the kernels get k = 0 there, which every table size holds."""
    valid = (k >= 0) & (k <= bound)
    if jnp.issubdtype(k.dtype, jnp.floating):
        valid = valid & (k == jnp.floor(k))
    k = jnp.where(valid, k, 0).astype(jnp.int32)
    forced_on = logits == jnp.inf
    num_free = kernels.count(jnp.isfinite(logits))
    k_free = k - kernels.count(forced_on).astype(k.dtype)
    infeasible = ~valid | (k_free < 0) | (k_free > num_free)
    k_free = jnp.clip(k_free, 0, num_free).astype(k.dtype)
    deterministic = (k_free == 0) | (k_free == num_free)
    return _FreeProblem(jnp.where(forced_on, -jnp.inf, logits), k_free, infeasible, deterministic)


def _finite_part(logits: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(logits), logits, 0.0)


@jax.jit
def _centred(logits: jax.Array, tilt: jax.Array) -> jax.Array:
    """The logits plus the tilt (infinities kept). In a formula used for its gradient only
    (``theta . mu``, with ``sum mu = k`` fixed), adding a constant per row changes nothing in
    exact arithmetic; in floating point it keeps the products ``theta_j d mu_j`` as small as
    the tilted logits, where a shared offset (every logit near 1e6) would make them cancel
    to a fraction of the offset's rounding."""
    return logits + tilt.astype(logits.dtype)[..., None]


class _OddsTerms(NamedTuple):
    """Terms that give the derivatives in ``probs`` at exact 0 and 1, where the logits are
    infinite and the chain rule through them would be ``0 * inf``. Every quantity is a
    rational function of the odds ``w_i = p_i / (1 - p_i)`` near ``w_i = 0`` (and of
    ``v_j = (1 - p_j) / p_j`` near ``p_j = 1``). With ``Z`` the normaliser over the free
    variables (``k_free`` ones among them) and ``r_m = e_{k_free + m} / e_{k_free}`` (0
    where the count is out of range),

        Z_all / Z = 1 + r_-1 sum w + r_+1 sum v + r_-2 e_2(w) + r_+2 e_2(v) + sum w sum v
                    + (terms of third order in w, v),

    so ``log Z`` gains ``log1p`` of that sum and the marginals its derivatives, with the
    marginals ``M_m`` of the counts ``k_free + m`` (``_odds_series``): exact to second
    order, so that first and second derivatives (Hessians) are the one-sided ones. The
    fields are zeros carrying these derivatives (a ``custom_jvp``: the extra kernels run only under
    differentiation; coefficients held to the dtype's finite range). ``softplus``: the
    constraint probability's extra term, ``sum_{p_i = 0} log(1 - p_i) + sum_{p_j = 1}
    log p_j`` (0 at the point)."""

    log_normalizer: jax.Array
    marginals: jax.Array
    softplus: jax.Array


def _count_ratio(free_logits, problem: "_FreeProblem", log_norm, step: int, size: int):
    """``e_{k_free + step} / e_{k_free}`` over the free variables (0 where that count is
    impossible), at most the dtype's largest number, and the count used."""
    num_free = kernels.count(jnp.isfinite(problem.logits)).astype(problem.k.dtype)
    possible = (problem.k + step >= 0) & (problem.k + step <= num_free) & ~problem.infeasible
    k = jnp.where(possible, problem.k + step, problem.k)
    log_ratio = kernels.log_normalizer(free_logits, k, size) - log_norm
    ratio = jnp.exp(jnp.where(possible, log_ratio, -jnp.inf)).astype(free_logits.dtype)
    return jnp.minimum(ratio, float(jnp.finfo(free_logits.dtype).max)), k


def _odds_series(probs, ratios, neighbours, mu, infeasible):
    """(log Z_all - log Z, the marginals' change, the softplus term) as functions of the
    probs (0 at the point), to second order in the odds (see ``_OddsTerms``): for a
    normaliser whose neighbours (``step``: the change of the free variables' count, -1 and
    -2 for variables at 0 switched on, +1 and +2 for variables at 1 switched off) have the
    ratios ``ratios[step]`` and the marginals ``neighbours[step]``; ``mu`` the marginals at
    the point. The marginals are the derivatives of ``log(1 + ratio)``: ``d ratio /
    d theta_j / (1 + ratio)`` for a free j (``d r_s / d theta_j = r_s (M_s,j - mu_j)``),
    ``w_i d log(1 + ratio) / d w_i`` at a 0 and ``-v_i d log(1 + ratio) / d v_i`` at a 1.
    Shared with the count classes (``_count_edges``)."""
    off, on = probs == 0, probs == 1
    largest = float(jnp.finfo(probs.dtype).max)
    # Safe branches: the untaken side of a where must have a finite derivative.
    at_zero = jnp.where(off, probs, 0.0)
    at_one = jnp.where(on, probs, 1.0)
    w = at_zero / (1 - at_zero)
    v = (1 - at_one) / at_one
    sum_w, sum_v = w.sum(-1), v.sum(-1)
    pairs_w = (sum_w**2 - (w**2).sum(-1)) / 2
    pairs_v = (sum_v**2 - (v**2).sum(-1)) / 2
    coefficients = {-1: sum_w, 1: sum_v, -2: pairs_w, 2: pairs_v}
    ratio = sum(ratios[step] * coefficients[step] for step in coefficients)
    ratio = jnp.where(infeasible, 0.0, ratio + sum_w * sum_v)
    change = sum(
        coefficients[step][..., None]
        * jnp.nan_to_num(
            ratios[step][..., None] * (neighbours[step] - mu),
            nan=0.0,
            posinf=largest,
            neginf=-largest,
        )
        for step in coefficients
    )
    r = {step: ratios[step][..., None] for step in coefficients}
    at_off = w * (r[-1] + r[-2] * (sum_w[..., None] - w) + sum_v[..., None])
    at_on = -v * (r[1] + r[2] * (sum_v[..., None] - v) + sum_w[..., None])
    marginals = jnp.where(off, at_off, jnp.where(on, at_on, change)) / (1 + ratio)[..., None]
    softplus = (jnp.log1p(-at_zero) + jnp.log(at_one)).sum(-1)
    return jnp.log1p(ratio), marginals, softplus


def _edge_terms(probs, free_logits, logits, problem: "_FreeProblem", size: int):
    """``_odds_series`` of the exactly-k normaliser: ratios ``e_{k_free + step} /
    e_{k_free}`` and the marginals of those counts, from the free logits (differentiable, so
    that JAX's second derivatives, mixed ones with interior probs included, are right)."""
    log_norm = kernels.log_normalizer(free_logits, problem.k, size)
    ratios, neighbours = {}, {}
    for step in (-2, -1, 1, 2):
        ratios[step], k = _count_ratio(free_logits, problem, log_norm, step, size)
        free = kernels.marginals(free_logits, k, size)
        neighbours[step] = _complete_selection(free, logits, problem._replace(k=k))
    mu = _complete_selection(kernels.marginals(free_logits, problem.k, size), logits, problem)
    return _odds_series(probs, ratios, neighbours, mu, problem.infeasible)


@partial(jax.custom_jvp, nondiff_argnums=(3,))
def _odds_terms(probs, logits, problem: "_FreeProblem", size: int) -> _OddsTerms:
    zeros = jnp.zeros_like(logits)
    return _OddsTerms(zeros.sum(-1), zeros, zeros.sum(-1))


@_odds_terms.defjvp
def _odds_terms_jvp(size, primals, tangents):
    probs, logits, problem = primals
    d_probs, d_problem = tangents[0], tangents[2]
    out = _odds_terms(probs, logits, problem, size)
    dtype = logits.dtype
    _, (d_log_norm, marginals, d_softplus) = jax.jvp(
        lambda p, free: _edge_terms(p, free, logits, problem, size),
        (probs, problem.logits),
        (d_probs, d_problem.logits),
    )
    tangent = _OddsTerms(d_log_norm, marginals, d_softplus)
    return out, jax.tree_util.tree_map(lambda t: t.astype(dtype), tangent)


def _unbounded(probs, problem: "_FreeProblem") -> jax.Array:
    """Per variable: +1 where p = 0 and the variable could be switched on, -1 where p = 1
    and it could be switched off, else 0: the entropy's one-sided derivative there is this
    sign times infinity (a ``-w log w`` term, as for a Bernoulli)."""
    num_free = kernels.count(jnp.isfinite(problem.logits)).astype(problem.k.dtype)
    feasible = ~problem.infeasible
    can_on = ((problem.k >= 1) & feasible)[..., None]
    can_off = ((problem.k + 1 <= num_free) & feasible)[..., None]
    direction = jnp.where((probs == 0) & can_on, 1.0, 0.0)
    return jnp.where((probs == 1) & can_off, -1.0, direction).astype(probs.dtype)


def _infinite_slope(probs, direction):
    """Zero (shape ``batch``) whose derivative in ``probs`` is ``direction`` times the
    dtype's largest finite number, standing for an infinite one-sided derivative: a true
    infinity would turn a zero cotangent (another output of a Jacobian, a masked entry)
    into NaN."""
    largest = float(jnp.finfo(probs.dtype).max)
    return ((probs - lax.stop_gradient(probs)) * (direction * largest)).sum(-1)


def _value_with_gradient_of(value: jax.Array, formula: jax.Array) -> jax.Array:
    """``value`` (computed accurately, without gradient) carrying the gradient of
    ``formula``, an expression equal to it in exact arithmetic but with rounding error in
    floating point; where the formula is not finite, ``value`` alone."""
    difference = formula - lax.stop_gradient(formula)
    return value + jnp.where(jnp.isfinite(formula), difference, 0.0)


def _complete(free, logits, problem: _FreeProblem, forced_on, forced_off, none_left):
    # Deterministic entries get exact values (and zero gradient, which is their derivative).
    free_mask = jnp.isfinite(logits)
    value = jnp.where((problem.k == kernels.count(free_mask))[..., None], 1.0 - none_left, free)
    value = jnp.where((problem.k == 0)[..., None], none_left, value)
    value = jnp.where(free_mask, value, jnp.where(logits == jnp.inf, forced_on, forced_off))
    value = jnp.where(problem.infeasible[..., None], jnp.nan, value)
    return value.astype(logits.dtype)


@jax.jit
def _complete_selection(free, logits, problem: _FreeProblem):
    """Marginals, or draws (which carry the free marginals' derivative,
    ``kernels.sample_straight_through``), of the full problem from the free one's: forced
    variables are 1 or 0, and deterministic rows their only k-hot vector, constants."""
    return _complete(free, logits, problem, 1.0, 0.0, 0.0)


@jax.jit
def _complete_pair(free_mu, free_complement, logits, problem: _FreeProblem):
    mu = _complete(free_mu, logits, problem, 1.0, 0.0, 0.0)
    return mu, _complete(free_complement, logits, problem, 0.0, 1.0, 1.0)


@jax.jit
def _mode(logits: jax.Array, k: jax.Array) -> jax.Array:
    order = jnp.argsort(-logits, axis=-1, stable=True)
    ranks = jnp.argsort(order, axis=-1, stable=True)
    return (ranks < k[..., None]).astype(logits.dtype)


@jax.jit
def _in_support(logits, k, value) -> jax.Array:
    """Whether ``value`` is k-hot with a 1 at every ``+inf`` logit and a 0 at every
    ``-inf`` one (``KHot``'s test and the infinite logits' in one count, see
    ``kernels.count``)."""
    on = value == 1
    off = value == 0
    wrong = ~(on | off) | (on & (logits == -jnp.inf)) | (off & (logits == jnp.inf))
    return (kernels.count(wrong) == 0) & (value.sum(-1) == k)


@jax.jit
def _log_prob(logits, k, value, log_normalizer, exact, problem) -> jax.Array:
    in_support = _in_support(logits, k, value)
    dtype = jnp.result_type(logits, value)
    exact = jnp.where(problem.deterministic, 0.0, exact).astype(dtype)
    formula = (_finite_part(logits) * value).sum(-1) - log_normalizer
    score = _value_with_gradient_of(exact, formula)
    possible = in_support & ~problem.infeasible
    return jnp.where(possible, score, -jnp.inf)


@jax.jit
def _entropy(logits, log_normalizer, mu, exact, problem) -> jax.Array:
    exact = jnp.where(problem.deterministic, 0.0, exact).astype(logits.dtype)
    formula = log_normalizer - (_finite_part(logits) * mu).sum(-1)
    entropy = _value_with_gradient_of(exact, formula)
    return jnp.where(problem.infeasible, jnp.nan, entropy)


@jax.jit
def _log_constraint_prob(logits, log_normalizer, exact, problem) -> jax.Array:
    softplus = jnp.where(jnp.isfinite(logits), _softplus(_finite_part(logits)), 0.0)
    formula = log_normalizer - softplus.sum(-1)
    value = _value_with_gradient_of(exact.astype(logits.dtype), formula)
    return jnp.where(problem.infeasible, -jnp.inf, value)


@jax.jit
def _kl(p_logits, p_mu, p_log_normalizer, q_logits, q_log_normalizer, exact, p_problem, q_problem):
    cross = (p_mu * _finite_part(q_logits)).sum(-1)
    own = (p_mu * _finite_part(p_logits)).sum(-1)
    formula = own - cross - p_log_normalizer + q_log_normalizer
    both_deterministic = p_problem.deterministic & q_problem.deterministic
    exact = jnp.where(both_deterministic, 0.0, exact).astype(formula.dtype)
    kl = _value_with_gradient_of(exact, formula)
    # (The centred logits keep the infinities of the logits.)
    forbidden = q_logits == -jnp.inf
    required = q_logits == jnp.inf
    escapes = kernels.count(((p_mu > 0) & forbidden) | ((p_mu < 1) & required)) > 0
    kl = jnp.where(escapes, jnp.inf, kl)
    return jnp.where(p_problem.infeasible | q_problem.infeasible, jnp.nan, kl)
