"""Independent Poissons conditioned on their sum: ``ConditionedPoisson(rate, k=k)``.

``z_i ~ Poisson(rate_i)`` independently, conditioned on ``sum_i z_i = k``, is
``Multinomial(k, p)`` with ``p = rate / sum(rate)`` (docs/distributions/conditioned_poisson.md).
Unlike ``numpyro.distributions.Multinomial``, ``k`` may vary over the batch (bags with different
known totals) and be traced under ``jit`` / ``vmap``, the support check demands ``sum z == k``
exactly, ``sample`` carries the straight-through marginal-expectation gradient, and the entropy is
exact and fast.

The class and its KL are here; the supports, numerics, entropy and samplers are in the
``_conditioned_poisson_*`` modules beside this one (mirrored file for file in
``pyro_constrained``), and are re-exported from here.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpyro.distributions import Binomial, constraints
from numpyro.distributions.batch_util import vmap_over
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.kl import kl_divergence
from numpyro.util import not_jax_tracer

from constrained_ppl.arguments import (
    DISCRETE_GRAD_ESTIMATORS,
    check_count,
    check_grad_estimator,
    check_static_bound,
    check_value_shape,
    keyword_only,
)
from constrained_ppl.conditioned_poisson import (  # noqa: F401
    LOG_FACTORIAL_TABLE_MAX_SIZE,
    SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY,
)
from constrained_ppl.enumeration import check_support_size, compositions, single_count
from constrained_ppl.exact_integers import (
    check_k_max_bounds_k,
    check_total_in_exact_range,
    largest_exact_integer,
)
from numpyro_constrained._batching import check_expand, vmap_over_broadcast_leaves
from numpyro_constrained._compat import refuse_scalar_coordinate_consumers
from numpyro_constrained._conditioned_poisson_entropy import _entropy, _entropy_window
from numpyro_constrained._conditioned_poisson_numerics import (
    _bd0,  # noqa: F401
    _finite_log_zero,  # noqa: F401
    _log_poisson,  # noqa: F401
    _log_poisson_of_total,
    _log_prob_and_support,
    _log_probs_only,
    _log_sqrt_2pi_z_plus_stirling_error,  # noqa: F401
    _mode_counts,
    _normalized_log_probs,
    _probs_only,
    _relative_entropy,
    _stirling_error,  # noqa: F401
)
from numpyro_constrained._conditioned_poisson_sampler import _sample_counts
from numpyro_constrained._conditioned_poisson_support import (
    _IntegerComposition,
    _is_integer_composition,
    integer_composition,
    positive_finite,
)
from numpyro_constrained._repr import parameters_repr
from numpyro_constrained.validation import as_concrete_where_possible, warn_if_out_of_support

__all__ = ["ConditionedPoisson", "integer_composition", "positive_finite"]
# The imports marked noqa are re-exports: names of the _conditioned_poisson_* modules that
# losses.py and callers import from this module.


class ConditionedPoisson(Distribution):
    r"""Independent ``Poisson(rate_i)`` counts conditioned on summing to exactly ``k``.

    The conditional distribution is ``Multinomial(k, p)`` with ``p = rate / sum(rate)``
    (only the rates' proportions matter)::

        log_prob(z) = log k! - sum_i log z_i! + sum_i z_i log p_i

    on integer vectors ``z >= 0`` with ``sum_i z_i = k``, with respect to counting measure
    on that set. ``k`` is a count (below) broadcast with ``rate.shape[:-1]``: the batch
    shape is the broadcast of the two, the event shape ``rate.shape[-1:]``.

    ``sample`` returns an exact sample whose gradient is the straight-through
    marginal-expectation estimator through ``E[z] = k p``
    (docs/distributions/gradient_estimators.md): the value is exactly integer and sums exactly to
    ``k``; ``has_rsample`` is true, so ``Trace_ELBO`` treats the site as reparameterised.
    It is biased wherever the downstream function of ``z`` is not linear in ``z``. With
    ``grad_estimator="score_function"``, ``sample`` returns the exact draw under
    ``stop_gradient`` and ``has_rsample`` is ``False`` (unbiased, higher variance).
    NumPyro's ``Trace_ELBO`` (0.22) has no score-function term: it would leave out the
    score term of such a site, so use ``TraceGraph_ELBO``, which adds it, Rao-Blackwellised
    over the costs downstream of the site (NumPyro has no baselines). Which to choose:
    docs/distributions/choosing_gradient_estimator.md.
    ``marginals`` are ``Binomial(k, p_i)``.

    Numerics: ``p`` is normalised in log space, and ``log_prob``, ``entropy``, ``mean``,
    ``variance``, KL and ``log_constraint_prob`` accumulate in float64 where JAX has it
    (``jax_enable_x64``; float32 otherwise, with float32's cancellation at large ``k``)
    before rounding to ``rate``'s dtype. ``k`` and the samples live in ``rate``'s dtype,
    which must hold every count exactly: ``k`` (or ``k_max``) above ``2**24`` (float32) or
    ``2**53`` (float64) is a ``ValueError``.

    ``k``: an int, an integer array, or whole-number floats (``3.0``, as
    ``Binomial.total_count``); ``3.5``, a bool, a complex number or NaN is a ``ValueError``
    whatever ``validate_args`` says (`constrained_ppl.arguments.check_count`). A
    negative ``k`` is a ``ValueError`` with validation on; with it off (or with a traced
    ``k``, which cannot be checked) a negative or fractional ``k`` gives ``-inf``
    log-probabilities and NaN ``mean``, ``variance``, ``entropy`` and samples, never a
    finite number.

    ``k_max``, a static bound on ``k``, is kept exactly as given (None or an int): it is pytree
    aux data, so that a distribution built with a concrete ``k`` and one built with a traced
    ``k`` have the same tree structure (a ``lax.scan`` carry, a ``jit`` argument). The size of
    the tables a call needs is decided when it is called: from ``k``'s values when ``k`` is
    concrete, else from ``k_max`` (the attribute ``k_max`` is what was passed, as in
    ``ExactlyKBernoulli`` and in Pyro). A traced ``k`` without ``k_max`` has none: ``sample``
    then draws sequential binomials, ``entropy`` raises. A concrete ``k`` above ``k_max`` is a
    ``ValueError``; a traced ``k`` above it gives ``-inf`` log-probabilities and NaN moments
    and samples rather than anything silently wrong. A traced ``k`` beyond the exact integers
    of ``rate``'s dtype without ``k_max`` cannot be detected.

    Parameter constraints: ``rate`` has event_dim 1 (its last axis is the event), ``k``
    event_dim 0, which is what ``promote_batch_shape`` (``numpyro.contrib.control_flow.scan``)
    reads.

    :param rate: positive, finite Poisson rates, shape ``batch + (n,)``.
    :param k: the known total, a non-negative integer (per batch element or shared), as
        above.
    :param k_max: a static upper bound on ``k`` (a Python int), needed only where ``k`` is
        traced (an argument of ``jit``, ``vmap``, ``scan``): with it, sampling keeps the
        categorical sampler, and ``entropy`` and the expected L1 loss are possible.
    :param grad_estimator: ``"marginal_expectation"`` (default) or ``"score_function"``
        (above); anything else is a ``ValueError`` naming the two.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> import numpyro.distributions as dist
    >>> from numpyro_constrained import ConditionedPoisson
    >>> rate = jnp.array([1.0, 2.0, 5.0])
    >>> d = ConditionedPoisson(rate, k=8)
    >>> d
    ConditionedPoisson(rate: (3,), k: 8)
    >>> np.round(d.mean, 4).tolist()  # k p, with p = rate / sum(rate)
    [1.0, 2.0, 5.0]
    >>> z = d.sample(jax.random.PRNGKey(0), (4,))  # exact integer draws summing to 8
    >>> z.shape, bool((z.sum(-1) == 8).all()), bool((z == jnp.round(z)).all())
    ((4, 3), True, True)
    >>> value = jnp.array([1.0, 2.0, 5.0])
    >>> multinomial = dist.Multinomial(8, probs=rate / rate.sum())
    >>> bool(jnp.isclose(d.log_prob(value), multinomial.log_prob(value)))
    True
    """

    arg_constraints = {
        "rate": constraints.independent(positive_finite, 1),
        "k": constraints.nonnegative_integer,
    }
    reparametrized_params = ["rate"]
    pytree_data_fields = ("rate", "k")
    has_enumerate_support = True
    #: The largest support that `enumerate_support` builds (a ``ValueError`` beyond it).
    max_support = 2**16
    # Exactly what the user passed, never derived from k: see the class docstring.
    pytree_aux_fields = ("k_max", "grad_estimator")
    #: Set per instance by __init__ (pytree aux data); see the class docstring.
    grad_estimator = "marginal_expectation"

    @keyword_only("k", usage="ConditionedPoisson(rate, k=k)")
    def __init__(
        self,
        rate,
        *,
        k,
        k_max: int | None = None,
        grad_estimator: str = "marginal_expectation",
        validate_args: bool | None = None,
    ) -> None:
        self.grad_estimator = check_grad_estimator(grad_estimator, DISCRETE_GRAD_ESTIMATORS)
        k_max = check_static_bound(k_max)
        check_count(k, concrete=not_jax_tracer(k), name="k")
        # Constants closed over inside jit stay concrete here (NumPyro's own validation
        # evaluates them so too), so that they are still checked and size the tables;
        # tracers stay tracers.
        with jax.ensure_compile_time_eval():
            rate = jnp.asarray(rate)
            if not jnp.issubdtype(rate.dtype, jnp.floating):
                rate = rate.astype(jnp.result_type(float))
            if rate.ndim < 1:
                raise ValueError(
                    "rate must have at least one dimension (the categories), got shape "
                    f"{rate.shape}"
                )
            if rate.shape[-1] < 1:
                raise ValueError("rate must have at least one category (rate.shape[-1] >= 1)")
            k = jnp.asarray(k)
            if not_jax_tracer(k):
                largest_k = _largest_finite(np.asarray(k))
                if largest_k is not None:
                    if k_max is not None:
                        check_k_max_bounds_k(k_max, largest_k)
                    if jnp.issubdtype(k.dtype, jnp.floating):
                        check_total_in_exact_range(largest_k, str(k.dtype), argument="k")
                    check_total_in_exact_range(largest_k, str(rate.dtype), argument="k")
            if k_max is not None:
                check_total_in_exact_range(k_max, str(rate.dtype), argument="k_max")
            try:
                batch_shape, event_shape = self.infer_shapes(rate.shape, k.shape)
            except ValueError as error:
                raise ValueError(
                    f"k of shape {k.shape} does not broadcast with the batch shape "
                    f"{rate.shape[:-1]} of rate (shape {rate.shape})"
                ) from error
            self.rate = jnp.broadcast_to(rate, batch_shape + event_shape)
            self.k = jnp.broadcast_to(k, batch_shape)
        self.k_max = k_max
        super().__init__(batch_shape, event_shape, validate_args=validate_args)

    @classmethod
    def infer_shapes(cls, rate: tuple[int, ...], k: tuple[int, ...] = ()):
        batch_shape = jnp.broadcast_shapes(tuple(rate[:-1]), tuple(k))
        return batch_shape, tuple(rate[-1:])

    @property
    def has_rsample(self) -> bool:
        """False for the score-function estimator (NumPyro's ELBOs read
        ``site["fn"].has_rsample``)."""
        return self.grad_estimator != "score_function"

    def expand(self, batch_shape) -> ConditionedPoisson:
        """A view of this distribution with batch shape ``batch_shape`` (an instance of the same
        class whose parameters are broadcast, not an ``ExpandedDistribution``). Raises
        ``ValueError`` where the current batch shape does not broadcast to ``batch_shape``."""
        batch_shape = tuple(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        check_expand(self.batch_shape, batch_shape)
        new = ConditionedPoisson.__new__(ConditionedPoisson)
        new.rate = jnp.broadcast_to(self.rate, batch_shape + self.event_shape)
        new.k = jnp.broadcast_to(self.k, batch_shape)
        new.k_max = self.k_max
        new.grad_estimator = self.grad_estimator
        Distribution.__init__(new, batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    def _table_bound(self) -> int | None:
        """The static bound on ``k`` that sizes the tables of a call: the largest ``k`` (at
        least 0) when ``k`` is concrete, else the ``k_max`` passed, else None. Worked out
        when called, never stored, so that the pytree does not depend on whether ``k`` is
        concrete."""
        if not_jax_tracer(self.k):
            largest = _largest_finite(np.asarray(self.k))
            return 0 if largest is None else max(largest, 0)
        return self.k_max

    def _k_out_of_range(self):
        """Where ``k`` is no count within the bound (negative, fractional, NaN, or above the
        ``k_max`` passed), shape ``batch_shape``; None where ``k`` is concrete and in range
        everywhere, so that eager calls on valid ``k`` pay nothing. What is flagged gets
        ``-inf`` log-probabilities and NaN moments and samples."""
        k = self.k
        if not_jax_tracer(k):
            k_np = np.asarray(k)
            # NaN != NaN flags NaN too.
            bad = (k_np < 0) | (k_np != np.floor(k_np))
            if self.k_max is not None:
                bad |= k_np > self.k_max
            return jnp.asarray(bad) if bad.any() else None
        bad = k < 0
        if jnp.issubdtype(k.dtype, jnp.floating):
            bad = bad | (k != jnp.floor(k))
        if self.k_max is not None:
            bad = bad | (k > self.k_max)
        return bad

    def _mask_out_of_range_k(self, x, fill, *, event: bool):
        """``x`` with ``fill`` where ``k`` is out of range (`_k_out_of_range`); ``event``:
        ``x`` has the event dimension last."""
        bad = self._k_out_of_range()
        if bad is None:
            return x
        return jnp.where(bad[..., None] if event else bad, fill, x)

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self) -> constraints.Constraint:
        return _IntegerComposition(self.k)

    def _log_probs(self):
        """``log p`` and ``log(1 - p)`` in the accumulation dtype (`_normalized_log_probs`)."""
        return _normalized_log_probs(self.rate)

    def _log_p(self):
        """``log p`` in the accumulation dtype (`_log_probs_only`)."""
        return _log_probs_only(self.rate)

    def enumerate_support(self, expand: bool = True) -> jax.Array:
        """Every composition of ``k`` into ``n`` non-negative parts once (all have positive
        probability), shape ``(count,) + batch_shape + (n,)`` (``expand=True``) or
        ``(count,) + (1,) * len(batch_shape) + (n,)`` (``expand=False``), as NumPyro's
        ``OneHotCategorical``; in reverse lexicographic order (the first is
        ``(k, 0, ..., 0)``). Needs one concrete ``k`` over the batch (else a
        ``ValueError``). ``count = C(k + n - 1, n - 1)`` is computed before anything is
        built; above ``max_support`` it is a ``ValueError``."""
        name = type(self).__name__
        refuse_scalar_coordinate_consumers(name)
        with jax.ensure_compile_time_eval():
            if not not_jax_tracer(self.k):
                raise ValueError(
                    f"{name}.enumerate_support needs a concrete k (the support's size is "
                    "static), got a traced one"
                )
            k = single_count(self.k, name)
        if k < 0:
            raise ValueError(f"{name}.enumerate_support: k = {k} has an empty support")
        n = self.event_shape[0]
        count = math.comb(k + n - 1, n - 1)
        check_support_size(count, self.max_support, name)
        values = jnp.asarray(compositions(n, k), dtype=self.rate.dtype)
        values = values.reshape((count,) + (1,) * len(self.batch_shape) + self.event_shape)
        if expand:
            values = jnp.broadcast_to(values, (count,) + self.batch_shape + self.event_shape)
        return values

    @property
    def mode(self):
        """The most likely composition (a multinomial mode), exact, by the algorithm of
        Pyro's ``mode``: every mode is at least ``floor(k p)`` entrywise (the log-pmf is
        separable and concave in the counts), and the remaining units go to the candidates
        of largest gain ``log p_i - log(z_i + 1)``, chosen by one sort, with no loop. Ties
        go to the lower index, so among equally likely compositions the result is
        deterministic. Works under ``jit``; NaN where ``k`` is out of range."""
        log_p = self._log_p()
        k = jnp.maximum(jnp.asarray(self.k, log_p.dtype), 0)
        k_bound = self._table_bound()
        if k_bound is None:  # a traced k without k_max: the dtype's exact integers bound it
            k_bound = largest_exact_integer(str(self.rate.dtype))
        counts = _mode_counts(log_p, jnp.broadcast_to(k, self.batch_shape), k_bound)
        return self._mask_out_of_range_k(counts.astype(self.rate.dtype), jnp.nan, event=True)

    @property
    def probs(self):
        """``p = rate / sum(rate)``, the multinomial probabilities."""
        return _probs_only(self.rate).astype(self.rate.dtype)

    @property
    def mean(self):
        """``k p``; NaN where ``k`` is out of range."""
        p = _probs_only(self.rate)
        mean = (self.k.astype(p.dtype)[..., None] * p).astype(self.rate.dtype)
        return self._mask_out_of_range_k(mean, jnp.nan, event=True)

    @property
    def variance(self):
        """``k p (1 - p)``; NaN where ``k`` is out of range."""
        # k p (1 - p) with 1 - p exact also where p rounds to 1.
        log_p, log1m_p = self._log_probs()
        k = self.k.astype(log_p.dtype)[..., None]
        variance = (k * jnp.exp(log_p + log1m_p)).astype(self.rate.dtype)
        return self._mask_out_of_range_k(variance, jnp.nan, event=True)

    @property
    def marginals(self) -> Binomial:
        """The conditional marginal of each coordinate: ``z_i ~ Binomial(k, p_i)``."""
        p = self.probs
        total_count = jnp.broadcast_to(self.k[..., None], p.shape)
        return Binomial(total_count=total_count, probs=p, validate_args=False)

    def log_constraint_prob(self):
        """``log P(sum_i z_i = k)`` under the unconstrained Poissons, ``log Poisson(k; sum(rate))``
        (the count likelihood of a bag of known total); ``-inf`` where ``k`` is out of
        range."""
        log_prob = _log_poisson_of_total(self.rate, jnp.maximum(self.k, 0))
        return self._mask_out_of_range_k(log_prob.astype(self.rate.dtype), -jnp.inf, event=False)

    def log_prob(self, value):
        """``log k! - sum_i log z_i! + sum_i z_i log p_i``; ``-inf`` off the support (and
        where a traced ``k`` is out of range), where, with validation on and a concrete
        value and ``k``, NumPyro's "Out-of-support values" ``UserWarning`` is emitted too
        (as by NumPyro's own distributions; under ``jit`` too for closed-over constants).
        Differentiable in ``value`` too. A value whose shape does not end in the event
        shape, or whose leading dimensions do not broadcast with the batch shape, is a
        ``ValueError`` naming the expected shape.

        The support check is exact whatever ``value``'s dtype (an integer count above
        ``2**24`` is not rounded into the support of a float32 distribution); the sum is
        accumulated in float64 where JAX has it and returned in the promotion of ``rate``'s
        and a floating ``value``'s dtypes.
        """
        # A constant closed over inside jit stays concrete, so that it is still checked.
        value = as_concrete_where_possible(value)
        check_value_shape(value.shape, self.batch_shape, self.event_shape, "ConditionedPoisson")
        if jnp.issubdtype(value.dtype, jnp.floating):
            dtype = jnp.result_type(self.rate.dtype, value.dtype)
        else:
            dtype = self.rate.dtype
        k_bound = self._table_bound()
        total_below_2_to_the_m = (
            k_bound is not None
            and jnp.issubdtype(value.dtype, jnp.floating)
            and k_bound < largest_exact_integer(str(value.dtype))
        )
        log_prob, _ = _log_prob_and_support(
            self.rate, self.k, value, dtype=dtype, total_below_2_to_the_m=total_below_2_to_the_m
        )
        if self._validate_args:
            warn_if_out_of_support(lambda: _is_integer_composition(value, self.k)[0])
        return self._mask_out_of_range_k(log_prob, -jnp.inf, event=False)

    def __repr__(self) -> str:
        return parameters_repr(
            type(self).__name__, {"rate": self.rate, "k": self.k}, integers=("k",)
        )

    def sample(self, key, sample_shape: tuple[int, ...] = ()):
        """An exact sample ``z`` returned as ``z + (m - stop_gradient(m))`` with ``m = k p``:
        the value is exactly ``z``, the gradient that of the conditional mean (zero, not
        absent, where ``k = 0``). NaN where ``k`` is out of range (a traced ``k`` above
        ``k_max``, a negative or fractional ``k``). With ``grad_estimator="score_function"``,
        ``z`` under ``stop_gradient``.

        Categorical draws (O(k log n) per event) where a static bound on ``k`` is known
        (`k_max`) and small beside n, else sequential binomials (O(n) per event, no bound
        needed)."""
        sample_shape = tuple(sample_shape)
        dtype = self.rate.dtype
        rate = lax.stop_gradient(self.rate)
        k = lax.stop_gradient(self.k)
        z = _sample_counts(key, rate, k, self._table_bound(), sample_shape, dtype)
        z = self._mask_out_of_range_k(z, jnp.nan, event=True)
        if not self.has_rsample:
            return lax.stop_gradient(z)
        m = jnp.broadcast_to(self.mean, z.shape)
        return z + (m - lax.stop_gradient(m))

    def rsample(self, key, sample_shape=()) -> jax.Array:
        """``sample``; ``NotImplementedError`` with ``grad_estimator="score_function"``."""
        if not self.has_rsample:
            raise NotImplementedError(
                "ConditionedPoisson(grad_estimator='score_function') has no reparameterised "
                "sampler (has_rsample is False): use sample(); TraceGraph_ELBO then differentiates "
                "the site by the score function"
            )
        return self.sample(key, sample_shape)

    def entropy(self):
        """Exact entropy ``-log k! - k sum_i p_i log p_i + sum_i E[log z_i!]``,
        ``z_i ~ Binomial(k, p_i)``.

        The expectations sum only over binomial outcomes within a Bennett-inequality window
        around each mean; the dropped terms total at most ``0.01`` times the machine epsilon
        of ``rate``'s dtype (absolute), see `entropy_log_inverse_tail`. The window sums run
        in ``rate``'s dtype on quantities centred in the accumulation dtype (`_entropy`).
        Needs a static bound on ``k`` (`k_max`): with a traced ``k``, pass ``k_max``. NaN
        where ``k`` is out of range.
        """
        k_bound = self._table_bound()
        if k_bound is None:
            raise ValueError(
                "ConditionedPoisson.entropy needs a static bound on k: pass k_max= when k is "
                "traced (inside jit or vmap)"
            )
        dtype = self.rate.dtype
        log_p, log1m_p = self._log_probs()
        if self.event_shape[0] == 1:
            # A single category: z = k surely. 0 with a zero gradient.
            entropy = jnp.sum(log_p, -1) * self.k
        else:
            eps = float(jnp.finfo(dtype).eps)
            half_width, width = _entropy_window(log_p, log1m_p, self.k, k_bound, eps)
            entropy = _entropy(
                log_p,
                log1m_p,
                self.k,
                k_max=k_bound,
                half_width=half_width,
                width=width,
                dtype=np.dtype(dtype),
            )
        return self._mask_out_of_range_k(entropy.astype(dtype), jnp.nan, event=False)


def _largest_finite(k: np.ndarray) -> int | None:
    """The largest entry of a concrete ``k`` as an int; None when empty or not finite (NaN
    and negative ``k`` are left to the validation of ``k``)."""
    if k.size == 0:
        return None
    largest = np.max(k)
    if not np.isfinite(largest):
        return None
    return int(largest)


@vmap_over.register
def _vmap_over_conditioned_poisson(dist: ConditionedPoisson, rate=None, k=None):
    # rate and k are both stored broadcast to the batch shape: a mapped batch axis maps both.
    return vmap_over_broadcast_leaves(dist, rate=rate, k=k)


@kl_divergence.register(ConditionedPoisson, ConditionedPoisson)
def _kl_conditioned_poisson(p: ConditionedPoisson, q: ConditionedPoisson):
    """``KL(p || q) = k sum_i p_i log(p_i / q_i)`` for two with the same ``k`` and ``n``, in
    the promotion of their dtypes, never negative and accurate also where the two are close
    (`_relative_entropy`); NaN where ``k`` is out of range."""
    if p.event_shape != q.event_shape:
        raise ValueError(
            f"KL between ConditionedPoisson needs the same number of categories, got "
            f"{p.event_shape[0]} and {q.event_shape[0]}"
        )
    if not_jax_tracer(p.k) and not_jax_tracer(q.k):
        if not np.array_equal(*np.broadcast_arrays(np.asarray(p.k), np.asarray(q.k))):
            raise ValueError("KL between ConditionedPoisson needs the same k")
    relative_entropy = _relative_entropy(p.rate, q.rate)
    kl = p.k.astype(relative_entropy.dtype) * relative_entropy
    kl = kl.astype(jnp.result_type(p.rate.dtype, q.rate.dtype))
    return p._mask_out_of_range_k(kl, jnp.nan, event=False)
