"""ExactlyKBernoulli: independent Bernoullis conditioned on exactly k ones.

The math: ``docs/distributions/exactly_k_bernoulli.md``.


The numerical work (log normaliser, marginals, exact sampling) lives in
:mod:`numpyro_constrained.exactly_k_kernels`; this module handles parameters, infinite
logits, validation, shapes and the framework's protocols (pytree, ``vmap_over``, KL).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpyro.distributions import Bernoulli, constraints
from numpyro.distributions.batch_util import vmap_over
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.kl import kl_divergence
from numpyro.util import not_jax_tracer

from constrained_ppl.arguments import (
    DISCRETE_GRAD_ESTIMATORS,
    check_grad_estimator,
    check_static_bound,
    check_value_shape,
    keyword_only,
)
from constrained_ppl.enumeration import check_support_size, k_hot_table, single_count
from numpyro_constrained import exactly_k_kernels as kernels
from numpyro_constrained._batching import check_expand, vmap_over_broadcast_leaves
from numpyro_constrained._compat import refuse_scalar_coordinate_consumers
from numpyro_constrained._ekb_arguments import (
    KHot,
    _ArgConstraints,
    _as_k,
    _bound,
    _ExtendedReal,
    _logits_from_probs,
)
from numpyro_constrained._ekb_terms import (
    _centred,
    _complete_pair,
    _complete_selection,
    _entropy,
    _free_problem,
    _FreeProblem,
    _in_support,
    _infinite_slope,
    _kl,
    _log_constraint_prob,
    _log_prob,
    _mode,
    _odds_terms,
    _OddsTerms,
    _unbounded,
)
from numpyro_constrained._repr import parameters_repr
from numpyro_constrained.validation import (
    as_concrete_where_possible,
    is_concrete,
    warn_if_out_of_support,
)

__all__ = ["ExactlyKBernoulli", "KHot"]


class ExactlyKBernoulli(Distribution):
    r"""Independent Bernoullis ``z_i ~ Bernoulli(sigmoid(logits_i))`` conditioned on
    ``sum_i z_i = k``.

    The pmf, with respect to counting measure on k-hot vectors ``z`` in ``{0, 1}^n``, is

    .. math:: p(z) = \exp(\theta \cdot z) / e_k(\exp \theta),

    where ``e_k`` is the k-th elementary symmetric polynomial. Adding one constant to every
    logit leaves it unchanged. A logit of ``+inf`` (``probs = 1``) forces its variable on,
    ``-inf`` (``probs = 0``) forces it off; the distribution must remain feasible.

    **Numerics.** Every quantity is exact to the working precision for finite logits of any
    size (masking values such as -1e4 or -1e9 included), in float32 and float64: the kernels
    tilt the logits until the expected count is k (restarting from order statistics when the
    logits have wide gaps), so a variable whose tilted logit is saturated in the dtype
    contributes exactly what conditioning on its value would, and ``log_prob``, ``entropy``,
    KL and ``log_constraint_prob`` are evaluated as sums of one-signed terms of the tilted
    logits, in float64 (with x64 off: float32 with the large parts kept as error-free
    pairs), instead of as differences of large numbers. Their gradients are the formulas'
    own, with the logits centred by the tilt (a shared offset such as 1e6 then costs
    nothing), and are 0 at infinite logits; with ``probs`` of exactly 0 or 1, the
    derivatives in ``probs`` there are the one-sided ones (never NaN; an infinite one, the
    entropy's or the KL's in p, is the dtype's largest finite number with its sign). With
    validation off, an impossible constraint (k out of range, or infinite logits that rule
    out every k-hot vector) gives ``-inf`` log-probabilities and NaN moments; sampling it
    raises ``ValueError``.

    :param logits: log-odds, shape ``batch + (n,)``; entries may be ``+-inf``.
    :param probs: probabilities in [0, 1] instead of logits (exactly one of the two).
    :param k: the number of ones, broadcasting with ``logits.shape[:-1]``: a Python int, an
        integer array, or whole-number floats (``3.0``, as ``Binomial.total_count``); ``3.5``,
        a bool, a complex number or NaN is a ``ValueError`` whatever ``validate_args`` says.
        ``0 <= k <= n`` is checked with validation on (``ValueError``).
    :param k_max: an optional static bound on ``k`` (a Python int), for a ``k`` that is traced
        (under ``jit``, ``vmap``, a ``lax.scan`` carry): the kernels' tables are truncated at
        degree ``min(n, k_max)`` instead of n, O(n k_max) work instead of O(n^2). A concrete
        ``k`` above ``k_max`` is a ``ValueError``.

    **Table sizes.** The kernels are jitted with the size of their tables as a static
    argument, chosen at each call: from a concrete ``k``, its largest entry rounded up to a
    power of two (at most n), so that eager calls with small k stay fast and compile once
    per power of two; from a traced ``k``, ``min(n, k_max)`` (n without ``k_max``). The
    pytree's aux data is ``k_max`` exactly as given, never something derived from ``k``, so
    the tree structure does not depend on whether ``k`` is concrete. A traced ``k`` outside
    ``0..min(n, k_max)``, or not a whole number, gives ``-inf`` log-probabilities and
    log_constraint_prob, and NaN entropy, mean, variance, samples and KL: never a number.

    :param grad_estimator: ``"marginal_expectation"`` (default) or ``"score_function"``;
        anything else is a ``ValueError`` naming the two. See
        docs/distributions/choosing_gradient_estimator.md for which to choose.

    **Gradients.** With ``grad_estimator="marginal_expectation"``, ``sample`` returns an
    exact k-hot sample ``z`` whose gradient is that of the conditional marginals ``mu`` (the
    SIMPLE straight-through estimator): ``z + (mu - stop_gradient(mu))``, biased wherever
    the downstream function of ``z`` is not linear in ``z`` (low variance). With
    ``grad_estimator="score_function"``, ``sample`` returns the exact draw under
    ``stop_gradient`` and ``has_rsample`` is ``False``, so ELBOs treat the site as not
    reparameterised (unbiased, higher variance). NumPyro's ``Trace_ELBO`` (0.22) has no
    score-function term: it would leave out the score term of such a site, so use
    ``TraceGraph_ELBO``, which adds it, Rao-Blackwellised over the
    costs downstream of the site (NumPyro has no baselines).

    **Validation** (``validate_args``) checks concrete values only, as NumPyro's own
    ``Distribution.validate_args`` does, and the arguments are checked under
    ``jax.ensure_compile_time_eval()``, so constants closed over inside ``jit`` are still
    checked; traced values are not (they get the NaN / ``-inf`` above). ``log_prob`` of a
    concrete value outside the support warns (NumPyro's "Out-of-support values" warning)
    and returns ``-inf``; a value whose shape does not end in the event shape or does not
    broadcast with the batch shape is a ``ValueError`` always.

    Examples
    --------
    >>> import math
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from numpyro_constrained import ExactlyKBernoulli
    >>> d = ExactlyKBernoulli(logits=jnp.array([2.0, 0.0, -1.0, 0.5]), k=2)
    >>> d
    ExactlyKBernoulli(logits: (4,), k: 2)
    >>> z = d.sample(jax.random.PRNGKey(0), (3,))  # exact 2-hot draws, SIMPLE gradient
    >>> z.shape, bool((z.sum(-1) == 2).all())
    ((3, 4), True)
    >>> round(float(d.mean.sum()), 4)  # the inclusion probabilities sum to k
    2.0
    >>> support = d.enumerate_support()  # the C(4, 2) = 6 two-hot vectors
    >>> support.shape, round(float(jnp.exp(d.log_prob(support)).sum()), 4)
    ((6, 4), 1.0)
    >>> bool(d.entropy() < math.log(6))  # below the uniform k-subset's entropy
    True
    """

    # probs first: given probs, the logits derived from them are NaN where probs are invalid,
    # and the error should name what the caller passed. The last axis of logits and probs is
    # the event (event_dim 1): promote_batch_shape (numpyro.contrib.control_flow.scan) reads
    # the batch shape of every parameter from these event dims.
    # k: integer_interval(0, min(n, k_max)) on an instance (see _ArgConstraints).
    arg_constraints = _ArgConstraints(
        probs=constraints.independent(constraints.unit_interval, 1),
        logits=constraints.independent(_ExtendedReal(), 1),
        k=constraints.nonnegative_integer,
    )
    reparametrized_params = ["logits", "probs"]
    # NumPyro infers has_rsample from reparametrized_params covering arg_constraints, and k,
    # a count, has no gradient; the samples still carry the straight-through gradient, so
    # ELBOs must treat the site as reparameterised (not switch to score functions).
    has_enumerate_support = True
    #: Set per instance by __init__ (pytree aux data); see the class docstring.
    grad_estimator = "marginal_expectation"
    #: The largest support that `enumerate_support` builds (a ``ValueError`` beyond it).
    max_support = 2**16
    # All three are set by __init__, expand and tree_unflatten (probs is always stored, never
    # a lazy cache: Distribution.tree_flatten reads __dict__, so a cache that appears once
    # computed would change the tree structure). k_max is exactly what the caller passed.
    pytree_data_fields = ("logits", "probs", "k")
    # _from_probs: whether the caller gave probs, whose exact 0s and 1s then get their
    # one-sided derivatives (``_odds_terms``); False for logits, which need no extra work.
    pytree_aux_fields = ("k_max", "_from_probs", "grad_estimator")

    @keyword_only("k", usage="ExactlyKBernoulli(logits, k=k)")
    def __init__(
        self,
        logits=None,
        probs=None,
        *,
        k,
        k_max=None,
        grad_estimator="marginal_expectation",
        validate_args=None,
    ):
        self.grad_estimator = check_grad_estimator(grad_estimator, DISCRETE_GRAD_ESTIMATORS)
        if (logits is None) == (probs is None):
            raise ValueError("ExactlyKBernoulli: give exactly one of `logits` or `probs`")
        k_max = check_static_bound(k_max)
        given = "logits" if probs is None else "probs"
        # Under jit, constants closed over stay concrete (and so are still checked, and size
        # the tables by their k); traced arguments stay traced.
        with jax.ensure_compile_time_eval():
            k = _as_k(k)
            if probs is not None:
                probs = jnp.asarray(probs)
                if not jnp.issubdtype(probs.dtype, jnp.floating):
                    probs = probs.astype(jnp.result_type(float))
                if probs.ndim < 1:
                    raise ValueError("probs must have at least one dimension (the n variables)")
                logits = _logits_from_probs(probs)
            else:
                logits = jnp.asarray(logits)
                if not jnp.issubdtype(logits.dtype, jnp.floating):
                    logits = logits.astype(jnp.result_type(float))
                if logits.ndim < 1:
                    raise ValueError("logits must have at least one dimension (the n variables)")
                probs = jax.nn.sigmoid(logits)
            try:
                batch_shape = jnp.broadcast_shapes(logits.shape[:-1], jnp.shape(k))
            except ValueError as error:
                raise ValueError(
                    f"k of shape {jnp.shape(k)} does not broadcast with the batch shape "
                    f"{logits.shape[:-1]} of the logits"
                ) from error
            event_shape = logits.shape[-1:]
            self.logits = jnp.broadcast_to(logits, batch_shape + event_shape)
            self.probs = jnp.broadcast_to(probs, batch_shape + event_shape)
            self.k = jnp.broadcast_to(k, batch_shape)
            self.k_max = k_max
            self._from_probs = given == "probs"
            validate = self._validate_args if validate_args is None else validate_args
            # Before Distribution.__init__, whose checks of arg_constraints give less
            # specific messages: the parameter the caller gave is checked first (the other
            # one, derived from it, is invalid wherever it is), then k.
            if validate:
                verdict = type(self).arg_constraints[given](getattr(self, given))
                if not_jax_tracer(verdict) and not np.all(verdict):
                    raise ValueError(
                        f"ExactlyKBernoulli distribution got invalid {given} parameter."
                    )
            self._check_k(validate)
        super().__init__(batch_shape, event_shape, validate_args=validate_args)

    @property
    def has_rsample(self) -> bool:
        """Whether ELBOs may treat the site as reparameterised: False for the score-function
        estimator (NumPyro's ELBOs read ``site["fn"].has_rsample``)."""
        return self.grad_estimator != "score_function"

    def _check_k(self, validate: bool) -> None:
        """Checks of a concrete ``k``: not above ``k_max`` (always a ``ValueError``); with
        validation on, in 0..n and feasible with the infinite logits (``ValueError``). A
        traced ``k`` is not checked here; its out-of-range entries give -inf / NaN."""
        n = self.logits.shape[-1]
        if not is_concrete(self.k):
            return
        k = np.asarray(self.k)
        if self.k_max is not None and k.size and k.max() > self.k_max:
            raise ValueError(f"k must be at most k_max = {self.k_max}, got {k.max()}")
        if validate and k.size and (k.min() < 0 or k.max() > n):
            raise ValueError(f"k must be in 0..n = 0..{n}, got {np.unique(k).tolist()}")
        if validate and is_concrete(self.logits) and k.size:
            logits = np.asarray(self.logits)
            forced_on = (logits == np.inf).sum(-1)
            forced_off = (logits == -np.inf).sum(-1)
            if np.any((k < forced_on) | (k > n - forced_off)):
                raise ValueError(
                    "logits make the constraint impossible: some batch element has more than "
                    "k logits equal to +inf (probs = 1) or more than n - k equal to -inf "
                    "(probs = 0)"
                )

    @property
    def _table_size(self) -> int:
        """The static size of the kernels' tables, chosen at call time (see the class
        docstring): from a concrete k, its largest valid entry rounded up to a power of two
        (at most n), since every new size costs a compilation; from a traced k, the bound
        ``min(n, k_max)``. Cached against the identity of ``self.k`` (outside the pytree),
        so that eager calls read k back from the device once."""
        cached = self.__dict__.get("_table_cache")
        if cached is not None and cached[0] is self.k:
            return cached[1]
        n = self.event_shape[0]
        bound = _bound(n, self.k_max)
        size = bound
        if is_concrete(self.k):
            k = np.asarray(self.k)
            largest = int(np.clip(k, 0, bound).max()) if k.size else 0
            size = min(n, 1 << largest.bit_length())
        self._table_cache = (self.k, size)
        return size

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self) -> KHot:
        return KHot(self.k)

    @property
    def _problem(self) -> "_FreeProblem":
        return _free_problem(self.logits, self.k, _bound(self.event_shape[0], self.k_max))

    def _parts(self, problem: "_FreeProblem") -> kernels.NormalizerParts:
        return kernels.normalizer_parts(problem.logits, problem.k, self._table_size)

    def _log_normalizer_of(self, problem, parts) -> jax.Array:
        log_norm = kernels.log_normalizer(problem.logits, problem.k, self._table_size, parts)
        if self._from_probs:
            log_norm = log_norm + self._odds(problem).log_normalizer
        return jnp.where(problem.infeasible, -jnp.inf, log_norm)

    def _odds(self, problem) -> "_OddsTerms":
        """Zeros carrying the derivatives in ``probs`` at exact 0 and 1 (``_odds_terms``)."""
        # Room for k_free + 2 ones: the second-order terms' coefficients.
        size = min(self._table_size + 2, self.event_shape[0])
        return _odds_terms(self.probs, self.logits, problem, size)

    def _centred_logits(self, parts) -> jax.Array:
        return _centred(self.logits, parts.tilt)

    @property
    def _log_normalizer(self) -> jax.Array:
        """log e_{k_free}(exp logits) over the finite logits (-inf where infeasible)."""
        problem = self._problem
        return self._log_normalizer_of(problem, self._parts(problem))

    def _marginal_pair(self, problem) -> tuple[jax.Array, jax.Array]:
        """(mu, 1 - mu): mu_i = P(z_i = 1 | sum z = k), differentiable in the logits; its
        complement computed without rounding (no gradient)."""
        free_mu, free_complement = kernels.marginals_and_complements(
            problem.logits, problem.k, self._table_size
        )
        mu, complement = _complete_pair(free_mu, free_complement, self.logits, problem)
        if self._from_probs:
            mu = mu + self._odds(problem).marginals
        # The complement's value is exact; its derivative is -d mu.
        return mu, lax.stop_gradient(complement) - (mu - lax.stop_gradient(mu))

    @property
    def _marginal_probs(self) -> jax.Array:
        """mu_i = P(z_i = 1 | sum z = k), differentiable in the logits."""
        problem = self._problem
        free_mu = kernels.marginals(problem.logits, problem.k, self._table_size)
        mu = _complete_selection(free_mu, self.logits, problem)
        if self._from_probs:
            mu = mu + self._odds(problem).marginals
        return mu

    @property
    def mean(self) -> jax.Array:
        return self._marginal_probs

    @property
    def variance(self) -> jax.Array:
        mu, complement = self._marginal_pair(self._problem)
        return mu * complement

    @property
    def marginals(self) -> Bernoulli:
        """The conditional marginal of each coordinate, ``Bernoulli(mu)`` with batch shape
        ``batch + (n,)``."""
        return Bernoulli(probs=self._marginal_probs, validate_args=False)

    def enumerate_support(self, expand: bool = True) -> jax.Array:
        """Every k-hot vector of the support once, shape ``(count,) + batch_shape + (n,)``
        (``expand=True``) or ``(count,) + (1,) * len(batch_shape) + (n,)`` (``expand=False``),
        as NumPyro's ``OneHotCategorical``; in lexicographic order of the positions of the
        ones. Needs one concrete ``k`` over the batch (else a ``ValueError``). Variables
        with infinite logits (probs 0 or 1), when the logits are concrete, are fixed:
        vectors that violate them have probability 0 and are left out, so they must be the
        same over the batch (else a ``ValueError``); with traced logits every k-hot vector
        is listed and the impossible ones get ``-inf`` log-probabilities.
        ``count = C(n_free, k - n_on)`` is computed before anything is built; above
        ``max_support`` it is a ``ValueError``."""
        name = type(self).__name__
        refuse_scalar_coordinate_consumers(name)
        n = self.event_shape[0]
        with jax.ensure_compile_time_eval():
            k_all, logits = self.k, self.logits
            if not not_jax_tracer(k_all):
                raise ValueError(
                    f"{name}.enumerate_support needs a concrete k (the support's size is "
                    "static), got a traced one"
                )
            k = single_count(k_all, name)
            forced_on, forced_off = [], []
            if not_jax_tracer(logits):
                flat = np.asarray(logits).reshape(-1, n)
                on, off = flat == np.inf, flat == -np.inf
                if flat.shape[0] and ((on != on[:1]).any() or (off != off[:1]).any()):
                    raise ValueError(
                        f"{name}.enumerate_support needs the infinite logits (probs 0 or 1) "
                        "to be the same over the batch (one support)"
                    )
                if flat.shape[0]:
                    forced_on = np.flatnonzero(on[0]).tolist()
                    forced_off = np.flatnonzero(off[0]).tolist()
        free = n - len(forced_on) - len(forced_off)
        rest = k - len(forced_on)
        count = math.comb(free, rest) if 0 <= rest <= free else 0
        check_support_size(count, self.max_support, name)
        table = k_hot_table(n, k, forced_on, forced_off)
        values = jnp.asarray(table, dtype=jnp.result_type(self.logits.dtype))
        values = values.reshape((count,) + (1,) * len(self.batch_shape) + self.event_shape)
        if expand:
            values = jnp.broadcast_to(values, (count,) + self.batch_shape + self.event_shape)
        return values

    @property
    def mode(self) -> jax.Array:
        """The most likely k-hot vector: ones at the k largest logits (ties go to the lower
        index)."""
        return _mode(self.logits, self.k)

    def log_prob(self, value) -> jax.Array:
        """``theta . z - log e_k(exp theta)`` for k-hot ``z`` (counting measure); ``-inf``
        outside the support (not k-hot, or a 1 at a ``-inf`` logit / a 0 at a ``+inf`` one),
        with NumPyro's "Out-of-support values" warning when validation is on and the value
        concrete. A value whose shape does not end in ``event_shape`` or does not broadcast
        with ``batch_shape`` is a ``ValueError``. Differentiable in ``value`` too, so a
        straight-through sample passes its gradient on.

        The value is computed from the tilted logits (``kernels.log_prob_value``), exact to
        the dtype's precision for logits of any size; the gradient is that of the formula."""
        value = as_concrete_where_possible(value)
        check_value_shape(
            jnp.shape(value), self.batch_shape, self.event_shape, "ExactlyKBernoulli.log_prob"
        )
        problem = self._problem
        parts = self._parts(problem)
        exact = kernels.log_prob_value(problem.logits, parts, value)
        log_norm = self._log_normalizer_of(problem, parts)
        log_prob = _log_prob(self.logits, self.k, value, log_norm, exact, problem)
        if self._validate_args:
            # A support that also depends on the infinite logits.
            warn_if_out_of_support(lambda: _in_support(self.logits, self.k, value))
        return log_prob

    def __repr__(self) -> str:
        return parameters_repr(
            type(self).__name__, {"logits": self.logits, "k": self.k}, integers=("k",)
        )

    def sample(self, key, sample_shape=()) -> jax.Array:
        """An exact draw ``z`` (0.0 / 1.0 entries summing to k) carrying the straight-through
        marginal gradient ``z + (mu - stop_gradient(mu))``; its value is exactly ``z``.
        Raises ValueError (concrete values) where the constraint is impossible; under a
        trace such elements get NaN. With ``grad_estimator="score_function"``, the draw
        under ``stop_gradient`` (no marginals are computed)."""
        problem = self._problem
        if not_jax_tracer(problem.infeasible) and np.any(problem.infeasible):
            raise ValueError(
                "ExactlyKBernoulli.sample: the constraint is impossible for some batch element "
                "(k outside 0..n, or infinite logits that rule out every k-hot vector)"
            )
        z = kernels.sample_straight_through(
            key, problem.logits, problem.k, self._table_size, tuple(sample_shape)
        )
        z = _complete_selection(z, self.logits, problem)
        if not self.has_rsample:
            return lax.stop_gradient(z)
        # The straight-through gradient is the marginals', theirs at probs of 0 and 1 included.
        return z + self._odds(problem).marginals if self._from_probs else z

    def rsample(self, key, sample_shape=()) -> jax.Array:
        """``sample``; ``NotImplementedError`` with ``grad_estimator="score_function"``."""
        if not self.has_rsample:
            raise NotImplementedError(
                "ExactlyKBernoulli(grad_estimator='score_function') has no reparameterised sampler "
                "(has_rsample is False): use sample(); TraceGraph_ELBO then differentiates "
                "the site by the score function"
            )
        return self.sample(key, sample_shape)

    def entropy(self) -> jax.Array:
        """``H = log e_k(exp theta) - theta . mu`` (over the finite logits), evaluated as a
        sum of non-negative terms of the tilted logits (``kernels.cross_entropy_value``);
        NaN where the constraint is impossible."""
        problem = self._problem
        parts = self._parts(problem)
        mu, complement = self._marginal_pair(problem)
        exact = kernels.cross_entropy_value(problem.logits, parts, mu, complement)
        log_norm = self._log_normalizer_of(problem, parts)
        if self._from_probs:
            # The entropy's one-sided derivative at an exact 0 or 1 is infinite (see
            # _OddsTerms.unbounded).
            log_norm = log_norm + _infinite_slope(self.probs, _unbounded(self.probs, problem))
        return _entropy(self._centred_logits(parts), log_norm, mu, exact, problem)

    def log_constraint_prob(self) -> jax.Array:
        """``log P(sum z = k)`` under the unconstrained Bernoullis (Poisson-binomial pmf):
        ``log e_k(exp theta) - sum_i softplus(theta_i)``, shape ``batch``, evaluated without
        that difference's cancellation (``kernels.log_constraint_prob_value``); ``-inf``
        where the constraint is impossible. Near the mode, ``log P`` is only about
        ``-log(n) / 2`` while its parts are about n / 3: its tables are float64 whatever the
        logits' dtype when x64 is on; with x64 off they are float32 and the parts are
        subtracted as error-free float32 pairs (``kernels.log_constraint_prob_value``), which
        plain rounding would leave with a relative error of up to ``n eps``."""
        problem = self._problem
        parts = self._parts(problem)
        wide_logits = problem.logits.astype(kernels.wide_dtype(problem.logits.dtype))
        wide_parts = kernels.normalizer_parts(wide_logits, problem.k, self._table_size)
        exact = kernels.log_constraint_prob_value(problem.logits, problem.k, wide_parts)
        log_norm = self._log_normalizer_of(problem, parts)
        if self._from_probs:
            log_norm = log_norm + self._odds(problem).softplus
        return _log_constraint_prob(self.logits, log_norm, exact, problem)

    def expand(self, batch_shape) -> "ExactlyKBernoulli":
        """A view of this distribution with batch shape ``batch_shape`` (an instance of the
        same class whose parameters are broadcast, not an ``ExpandedDistribution``). Raises
        ``ValueError`` where the current batch shape does not broadcast to ``batch_shape``."""
        batch_shape = tuple(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        check_expand(self.batch_shape, batch_shape)
        new = type(self).__new__(type(self))
        new.logits = jnp.broadcast_to(self.logits, batch_shape + self.event_shape)
        new.probs = jnp.broadcast_to(self.probs, batch_shape + self.event_shape)
        new.k = jnp.broadcast_to(self.k, batch_shape)
        new.k_max = self.k_max
        new._from_probs = self._from_probs
        new.grad_estimator = self.grad_estimator
        Distribution.__init__(new, batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @classmethod
    def infer_shapes(cls, logits=None, probs=None, k=()):
        shape = logits if logits is not None else probs
        batch_shape = jnp.broadcast_shapes(tuple(shape[:-1]), tuple(k))
        return batch_shape, tuple(shape[-1:])


@vmap_over.register
def _vmap_over_exactly_k_bernoulli(dist: ExactlyKBernoulli, logits=None, probs=None, k=None):
    # logits and probs are always both stored, each derived from the other, so a vmapped
    # argument of either maps both (numpyro's test_vmap_dist passes the axis of one).
    shared = logits if logits is not None else probs
    return vmap_over_broadcast_leaves(dist, logits=shared, probs=shared, k=k)


@kl_divergence.register(ExactlyKBernoulli, ExactlyKBernoulli)
def _kl_exactly_k_bernoulli(p: ExactlyKBernoulli, q: ExactlyKBernoulli) -> jax.Array:
    """``KL(p || q) = mu_p . (theta_p - theta_q) - log e_k(p) + log e_k(q)`` over finite
    logits; ``+inf`` where p puts mass on a vector that q forbids. Evaluated as the
    difference of two cross-entropies of the tilted logits, variable by variable
    (``kernels.kl_value``), exactly 0 for p = q and exact for logits of any size; the
    gradient is the formula's."""
    if p.event_shape != q.event_shape:
        raise ValueError(f"KL needs the same n, got {p.event_shape[0]} and {q.event_shape[0]}")
    if is_concrete(p.k, q.k) and not np.array_equal(*np.broadcast_arrays(p.k, q.k)):
        raise ValueError("KL between ExactlyKBernoulli needs the same k")
    p_problem, q_problem = p._problem, q._problem
    p_parts, q_parts = p._parts(p_problem), q._parts(q_problem)
    mu, complement = p._marginal_pair(p_problem)
    exact = kernels.kl_value(p_problem.logits, p_parts, q_problem.logits, q_parts, mu, complement)
    p_log_norm = p._log_normalizer_of(p_problem, p_parts)
    if p._from_probs:
        # -H(p)'s infinite one-sided slope, or +inf where q has the same infinite logit
        # (moving p's mass onto a vector that q forbids makes the KL infinite).
        same = jnp.where(q.logits == p.logits, -1.0, 1.0)
        direction = -_unbounded(p.probs, p_problem) * same
        # (Subtracted: the KL's formula subtracts p's log normaliser.)
        p_log_norm = p_log_norm - _infinite_slope(p.probs, direction)
    return _kl(
        p._centred_logits(p_parts),
        mu,
        p_log_norm,
        q._centred_logits(q_parts),
        q._log_normalizer_of(q_problem, q_parts),
        exact,
        p_problem,
        q_problem,
    )
