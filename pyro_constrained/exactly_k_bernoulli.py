"""ExactlyKBernoulli: independent Bernoullis conditioned on exactly k ones.

The math: ``docs/distributions/exactly_k_bernoulli.md``.


The numerical work (log normaliser, marginals, exact sampling) lives in
:mod:`pyro_constrained.exactly_k_kernels`; this module handles parameters, infinite logits,
validation, shapes and the framework's protocols.
"""

import math
from contextlib import nullcontext

import torch
from pyro.distributions import Bernoulli, TorchDistribution
from torch.distributions import constraints
from torch.distributions.kl import register_kl
from torch.distributions.utils import lazy_property

from constrained_ppl.arguments import (
    DISCRETE_GRAD_ESTIMATORS,
    check_grad_estimator,
    check_static_bound,
    check_value_shape,
    keyword_only,
)
from constrained_ppl.enumeration import check_support_size, k_hot_table, single_count
from pyro_constrained import exactly_k_kernels as kernels
from pyro_constrained._autograd import is_differentiated
from pyro_constrained._ekb_arguments import (
    VMAP_OVER_PARAMETERS,
    VMAP_OVER_VALUES,
    KHot,
    _ArgConstraints,
    _as_k,
    _ExtendedReal,
    _logits_from_probs,
)
from pyro_constrained._ekb_terms import (
    _centred,
    _infinite_slope,
    _OddsTangents,
    _softplus,
    _value_with_gradient_of,
    odds_tangents,
)
from pyro_constrained._ekb_terms import _kl_exactly_k_bernoulli as _kl
from pyro_constrained._repr import parameters_repr
from pyro_constrained._score_parts import score_parts as _score_parts
from pyro_constrained._score_parts import straight_through_draw
from pyro_constrained.exactly_k_tracing import _static_control_flow, static_under_trace

__all__ = ["ExactlyKBernoulli", "KHot"]


class ExactlyKBernoulli(TorchDistribution):
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
    logits, in float64, instead of as differences of large numbers. Their gradients are the
    formulas' own, with the logits centred by the tilt (a shared offset such as 1e6 then
    costs nothing), and are 0 at infinite logits; with ``probs`` of exactly 0 or 1, the
    derivatives in ``probs`` there are the one-sided ones (never NaN; an infinite one, the
    entropy's or the KL's in p, is the dtype's largest finite number with its sign). With
    validation off, an impossible constraint (k out of range, or infinite logits that rule
    out every k-hot vector) gives ``-inf`` log-probabilities and NaN moments; sampling it
    raises ``ValueError``.

    :param logits: log-odds, shape ``batch + (n,)``; entries may be ``+-inf``.
    :param probs: probabilities in [0, 1] instead of logits (exactly one of the two).
    :param k: the number of ones, broadcasting with ``logits.shape[:-1]``: a Python int, an
        integer tensor, or whole-number floats (``3.0``, as ``Binomial.total_count``), stored
        as a long tensor; ``3.5``, a bool, a complex number or NaN is a ``ValueError``
        whatever ``validate_args`` says. ``0 <= k <= n`` is checked with validation on
        (``ValueError``); without it, out-of-range entries give ``-inf`` log-probabilities
        and NaN moments.
    :param k_max: an optional bound on ``k`` (a Python int), for API parity with NumPyro,
        where it sizes the tables of a traced ``k``; here k is always concrete, the tables
        are sized by its largest entry, and a ``k`` above ``k_max`` is a ``ValueError``.

    ``log_prob`` of a value outside the support is a ``ValueError`` with validation on and
    ``-inf`` without; a value whose shape does not end in the event shape or does not
    broadcast with the batch shape is a ``ValueError`` always.

    :param grad_estimator: ``"marginal_expectation"`` (default) or ``"score_function"``;
        anything else is a ``ValueError`` naming the two. See
        docs/distributions/choosing_gradient_estimator.md for which to choose.

    **Gradients.** With ``grad_estimator="marginal_expectation"``, ``rsample`` returns an
    exact k-hot sample ``z`` whose gradient is that of the conditional marginals ``mu`` (the
    SIMPLE straight-through estimator): ``z + (mu - mu.detach())``. It is biased wherever
    the downstream function of ``z`` is not linear in ``z`` (low variance). With
    ``grad_estimator="score_function"``, ``has_rsample`` is ``False`` on the instance, so
    ``pyro.sample`` draws with :meth:`sample` (exact, no gradient) and ``Trace_ELBO`` /
    ``TraceGraph_ELBO`` / ``TraceEnum_ELBO`` differentiate the site by the score function
    (unbiased; ``TraceGraph_ELBO`` adds Rao-Blackwellisation and the baselines given in the
    site's ``infer={"baseline": ...}``); ``rsample`` then raises ``NotImplementedError``.

    Examples
    --------
    >>> import math
    >>> import torch
    >>> from pyro_constrained import ExactlyKBernoulli
    >>> d = ExactlyKBernoulli(logits=torch.tensor([2.0, 0.0, -1.0, 0.5]), k=2)
    >>> d
    ExactlyKBernoulli(logits: torch.Size([4]), k: 2)
    >>> z = d.rsample((3,))  # exact 2-hot draws carrying the SIMPLE gradient
    >>> z.shape, bool((z.sum(-1) == 2).all())
    (torch.Size([3, 4]), True)
    >>> round(float(d.mean.sum()), 4)  # the inclusion probabilities sum to k
    2.0
    >>> support = d.enumerate_support()  # the C(4, 2) = 6 two-hot vectors
    >>> support.shape, round(float(d.log_prob(support).exp().sum()), 4)
    (torch.Size([6, 4]), 1.0)
    >>> bool(d.entropy() < math.log(6))  # below the uniform k-subset's entropy
    True
    """

    # probs first: given probs, the logits derived from them are NaN where probs are invalid,
    # and the error should name what the caller passed.
    # The last axis of logits and probs is the event (event_dim 1), as torch's
    # test_params_constraints and NumPyro's promote_batch_shape read it.
    # k: integer_interval(0, min(n, k_max)) on an instance (see _ArgConstraints).
    arg_constraints = _ArgConstraints(
        probs=constraints.independent(constraints.unit_interval, 1),
        logits=constraints.independent(_ExtendedReal(), 1),
        k=constraints.nonnegative_integer,
    )
    has_rsample = True
    # Enumerated guide sites are scored, not pathwise (see _score_parts).
    score_parts = _score_parts
    has_enumerate_support = True
    #: The largest support that `enumerate_support` builds (a ``ValueError`` beyond it).
    max_support = 2**16

    @keyword_only("k", usage="ExactlyKBernoulli(logits, k=k)")
    def __init__(
        self,
        logits: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        *,
        k: int | float | torch.Tensor,
        k_max: int | None = None,
        grad_estimator: str = "marginal_expectation",
        validate_args: bool | None = None,
    ):
        self.grad_estimator = check_grad_estimator(grad_estimator, DISCRETE_GRAD_ESTIMATORS)
        # Per instance: Pyro's ELBOs read site["fn"].has_rsample to choose between the
        # pathwise and the score-function term.
        self.has_rsample = grad_estimator == "marginal_expectation"
        if (logits is None) == (probs is None):
            raise ValueError("ExactlyKBernoulli: give exactly one of `logits` or `probs`")
        self.k_max = check_static_bound(k_max)
        self._k_is_constant = not isinstance(k, torch.Tensor)
        if probs is not None:
            if not isinstance(probs, torch.Tensor):
                probs = torch.as_tensor(probs)
            if not probs.is_floating_point():
                probs = probs.to(torch.get_default_dtype())
            if probs.dim() < 1:
                raise ValueError("probs must have at least one dimension (the n variables)")
            logits = _logits_from_probs(probs)
        else:
            if not isinstance(logits, torch.Tensor):
                logits = torch.as_tensor(logits)
            if not logits.is_floating_point():
                logits = logits.to(torch.get_default_dtype())
            if logits.dim() < 1:
                raise ValueError("logits must have at least one dimension (the n variables)")
        k = _as_k(k, logits)
        try:
            batch_shape = torch.broadcast_shapes(logits.shape[:-1], k.shape)
        except RuntimeError as error:
            raise ValueError(
                f"k of shape {tuple(k.shape)} does not broadcast with the batch shape "
                f"{tuple(logits.shape[:-1])} of the logits"
            ) from error
        event_shape = logits.shape[-1:]
        self.logits = logits.expand(batch_shape + event_shape)
        if probs is not None:
            self.probs = probs.expand(batch_shape + event_shape)
        self.k = k.expand(batch_shape)
        self._from_probs = probs is not None
        # Before Distribution.__init__, whose checks of arg_constraints give less specific
        # messages; validate_args resolved as it resolves it: no instance attribute is set
        # yet, so self._validate_args reads the class-wide default that
        # Distribution.set_default_validate_args sets.
        validate = self._validate_args if validate_args is None else validate_args
        try:
            self._check_k(validate, self._k_is_constant)
        except RuntimeError as error:  # torch.func.vmap cannot read a batched value
            raise RuntimeError(VMAP_OVER_PARAMETERS) from error
        super().__init__(batch_shape, event_shape, validate_args=validate_args)

    def _check_k(self, validate: bool, k_is_constant: bool = False) -> None:
        """k not above ``k_max`` (always a ``ValueError``); with validation on, k in 0..n and
        feasible with the infinite logits (``ValueError`` otherwise). Sets ``_table_size``
        (the kernels' table size, the largest count among the free variables) and, with
        validation off, marks the batch elements whose constraint is impossible: their
        log-probabilities are ``-inf``."""
        with static_under_trace():
            n = int(self.logits.shape[-1])
        # Under torch.jit.trace, checks of a k given as Python numbers read a constant.
        static = static_under_trace if k_is_constant else nullcontext
        with static():
            if self.k_max is not None and self.k.numel() and self.k.max() > self.k_max:
                raise ValueError(f"k must be at most k_max = {self.k_max}, got {int(self.k.max())}")
        with torch.no_grad():
            forced_on = (self.logits == torch.inf).sum(-1)
            forced_off = (self.logits == -torch.inf).sum(-1)
            infeasible = (self.k < forced_on) | (self.k > n - forced_off)
        if validate:
            with static():
                k_out_of_range = self.k.numel() and (self.k.min() < 0 or self.k.max() > n)
            if k_out_of_range:
                raise ValueError(f"k must be in 0..n = 0..{n}, got {self.k.unique().tolist()}")
            if infeasible.any():
                raise ValueError(
                    "logits make the constraint impossible: some batch element has more "
                    "than k logits equal to +inf (probs = 1) or more than n - k equal to "
                    "-inf (probs = 0)"
                )
        self._infeasible = infeasible
        if torch.jit.is_tracing():
            # The table size is a shape, fixed in a trace: it must not follow the number of
            # +inf logits on the first call. k_max bounds a traced k; a constant k its own.
            with static():
                empty = not self.k.numel()
                largest = self.k_max if self.k_max is not None or empty else int(self.k.max())
            self._table_size = 0 if empty else min(largest, n)
            return
        k_free = (self.k - forced_on).clamp(min=0)
        self._table_size = int(k_free.max().clamp(max=n)) if self.k.numel() else 0

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self) -> KHot:
        return KHot(self.k)

    @lazy_property
    def probs(self) -> torch.Tensor:
        return torch.sigmoid(self.logits)

    @lazy_property
    def _forced_on(self) -> torch.Tensor:
        return self.logits == torch.inf

    @lazy_property
    def _finite(self) -> torch.Tensor:
        return torch.isfinite(self.logits)

    @lazy_property
    def _k_free(self) -> torch.Tensor:
        """k minus the number of variables forced on: the count among the free ones, clamped
        into the feasible range (the infeasible elements' results are overwritten)."""
        k_free = self.k - self._forced_on.sum(-1)
        return torch.minimum(k_free.clamp(min=0), self._finite.sum(-1))

    @lazy_property
    def _kernel_logits(self) -> torch.Tensor:
        """The logits with forced-on variables removed (set to -inf), as the kernels want."""
        return torch.where(self._forced_on, torch.full_like(self.logits, -torch.inf), self.logits)

    @lazy_property
    def _finite_logits(self) -> torch.Tensor:
        return torch.where(self._finite, self.logits, torch.zeros_like(self.logits))

    @lazy_property
    def _normalizer_parts(self) -> kernels.NormalizerParts:
        return kernels.normalizer_parts(self._kernel_logits, self._k_free, self._table_size)

    @lazy_property
    def _log_normalizer(self) -> torch.Tensor:
        """log e_{k_free}(exp logits) over the finite logits (-inf where infeasible)."""
        log_norm = kernels.log_normalizer(
            self._kernel_logits, self._k_free, self._table_size, self._normalizer_parts
        )
        if self._odds_tangents is not None:
            log_norm = log_norm + self._odds_tangents.log_normalizer
        return torch.where(self._infeasible, -torch.inf, log_norm)

    @lazy_property
    def _odds_tangents(self) -> _OddsTangents | None:
        """The derivatives in ``probs`` at exact 0 and 1 (see ``_OddsTangents``); None unless
        the distribution was built from ``probs`` that are differentiated (in either mode)
        and hold a 0 or a 1."""
        probs = self.__dict__.get("probs")
        if not self._from_probs or probs is None or not is_differentiated(probs):
            return None
        off, on = probs == 0, probs == 1
        # Under torch.jit.trace the tangents are always built (zero where no prob is 0 or 1):
        # skipping them would freeze the first call's answer.
        if not torch.jit.is_tracing() and not bool((off | on).any()):
            return None
        # Differentiable coefficients (log_normalizer's gradient is the marginals), so that
        # mixed second derivatives with an interior prob are right. Tables with room for
        # k_free + 2 ones: the second-order terms' coefficients.
        with static_under_trace():  # a size, which a trace fixes (else a traced tensor)
            size = min(self._table_size + 2, int(self.event_shape[0]))
        r, neighbours = {}, {}
        for step in (-2, -1, 1, 2):
            r[step], k = self._count_ratio(step, size)
            free = kernels.marginals(self._kernel_logits, k, size) if size else None
            free = torch.zeros_like(self.logits) if free is None else free
            neighbours[step] = self._complete(free, 1.0, 0.0, 0.0, k_free=k)
        mu = self._free_marginal_pair[0]
        return odds_tangents(probs, r, neighbours, mu, self._infeasible)

    def _count_ratio(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``e_{k_free + step} / e_{k_free}`` over the free variables (0 where that count is
        impossible), at most the dtype's largest number, and the count used."""
        k_free, num_free = self._k_free, self._finite.sum(-1)
        possible = (k_free + step >= 0) & (k_free + step <= num_free) & ~self._infeasible
        k = torch.where(possible, k_free + step, k_free)
        logits = self._kernel_logits
        log_ratio = kernels.log_normalizer(logits, k, size) - kernels.log_normalizer(
            logits, k_free, size, self._normalizer_parts
        )
        ratio = torch.where(possible, log_ratio, -torch.inf).exp().to(self.logits.dtype)
        return ratio.clamp(max=torch.finfo(self.logits.dtype).max), k

    @lazy_property
    def _deterministic(self) -> torch.Tensor:
        """Batch elements with a single k-hot vector in the support."""
        return (self._k_free == 0) | (self._k_free == self._finite.sum(-1))

    def _complete(
        self, free: torch.Tensor, forced_on: float, forced_off: float, none_left: float, k_free=None
    ):
        # Deterministic entries get exact values (and zero gradient, which is their derivative).
        k_free = self._k_free if k_free is None else k_free
        num_free = self._finite.sum(-1)
        all_on = (k_free == num_free)[..., None]
        value = torch.where(all_on, 1.0 - none_left, free)
        value = torch.where((k_free == 0)[..., None], none_left, value)
        # Of the logits' dtype: a where between two Python numbers is a tensor of torch's
        # default dtype, which would promote float32 results under a float64 default.
        constant = torch.where(self._forced_on, torch.full_like(value, forced_on), forced_off)
        value = torch.where(self._finite, value, constant)
        return torch.where(self._infeasible[..., None], torch.nan, value)

    @lazy_property
    def _free_marginal_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        free, free_complement = kernels.marginals_and_complements(
            self._kernel_logits, self._k_free, self._table_size
        )
        return self._complete(free, 1.0, 0.0, 0.0), self._complete(free_complement, 0.0, 1.0, 1.0)

    @lazy_property
    def _marginal_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu, 1 - mu): mu_i = P(z_i = 1 | sum z = k), differentiable in the parameters; its
        complement computed without rounding, carrying the derivative ``-d mu``."""
        mu, complement = self._free_marginal_pair
        mu = self._with_edge_derivatives(mu)
        return mu, complement.detach() - (mu - mu.detach())

    def _with_edge_derivatives(self, mu: torch.Tensor) -> torch.Tensor:
        """The marginals plus the zeros carrying their derivatives in ``probs`` at exact 0s
        and 1s (``_odds_tangents``)."""
        return mu if self._odds_tangents is None else mu + self._odds_tangents.marginals

    @property
    def _marginal_probs(self) -> torch.Tensor:
        return self._marginal_pair[0]

    @property
    def mean(self) -> torch.Tensor:
        return self._marginal_probs

    @property
    def variance(self) -> torch.Tensor:
        mu, complement = self._marginal_pair
        return mu * complement

    @property
    def marginals(self) -> Bernoulli:
        """The conditional marginal of each coordinate, ``Bernoulli(mu)`` with batch shape
        ``batch + (n,)``."""
        return Bernoulli(probs=self._marginal_probs, validate_args=False)

    @property
    def mode(self) -> torch.Tensor:
        """The most likely k-hot vector: ones at the k largest logits (ties go to the lower
        index)."""
        order = torch.sort(self.logits, dim=-1, descending=True, stable=True).indices
        # The inverse permutation (out of place, so that it can be traced by torch.jit).
        ranks = torch.argsort(order, dim=-1)
        return (ranks < self.k[..., None]).to(self.logits.dtype)

    def enumerate_support(self, expand: bool = True) -> torch.Tensor:
        """Every k-hot vector of the support once, shape ``(count,) + batch_shape + (n,)``
        (``expand=True``) or ``(count,) + (1,) * len(batch_shape) + (n,)`` (``expand=False``),
        as ``torch.distributions.OneHotCategorical``; in lexicographic order of the
        positions of the ones. Needs one ``k`` over the batch. Variables with infinite
        logits (probs 0 or 1) are fixed: vectors that violate them have probability 0 and
        are left out, so the infinite logits must be the same over the batch (else a
        ``ValueError``). ``count = C(n_free, k - n_on)`` is computed before anything is
        built; above ``max_support`` it is a ``ValueError``."""
        name = type(self).__name__
        k = single_count(self.k.detach().cpu().numpy(), name)
        n = self.event_shape[0]
        on = self.logits == torch.inf
        off = self.logits == -torch.inf
        flat_on, flat_off = on.reshape(-1, n), off.reshape(-1, n)
        if flat_on.shape[0] and (
            (flat_on != flat_on[:1]).any() or (flat_off != flat_off[:1]).any()
        ):
            raise ValueError(
                f"{name}.enumerate_support needs the infinite logits (probs 0 or 1) to be "
                "the same over the batch (one support)"
            )
        forced_on = torch.nonzero(flat_on[0]).flatten().tolist() if flat_on.shape[0] else []
        forced_off = torch.nonzero(flat_off[0]).flatten().tolist() if flat_on.shape[0] else []
        free = n - len(forced_on) - len(forced_off)
        rest = k - len(forced_on)
        count = math.comb(free, rest) if 0 <= rest <= free else 0
        check_support_size(count, self.max_support, name)
        table = k_hot_table(n, k, forced_on, forced_off)
        values = torch.as_tensor(table, dtype=self.logits.dtype, device=self.logits.device)
        values = values.reshape((count,) + (1,) * len(self.batch_shape) + self.event_shape)
        if expand:
            values = values.expand((count,) + self.batch_shape + self.event_shape)
        return values

    def _respects_infinite_logits(self, value: torch.Tensor) -> torch.Tensor:
        """Per event: no 1 where the logit is -inf and no 0 where it is +inf."""
        on = value == 1
        return ~((on & (self.logits == -torch.inf)) | (~on & self._forced_on)).any(-1)

    def _validate_sample(self, value: torch.Tensor) -> None:
        super()._validate_sample(value)
        try:
            respected = bool(self._respects_infinite_logits(value).all())
        except RuntimeError as error:  # a Python bool of a value batched by torch.func.vmap
            raise RuntimeError(VMAP_OVER_VALUES) from error
        if not respected:
            raise ValueError(
                "ExactlyKBernoulli.log_prob: value puts a 1 where the logit is -inf (probs = 0) "
                "or a 0 where it is +inf (probs = 1): it is outside the support"
            )

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """``theta . z - log e_k(exp theta)`` for k-hot ``z`` (counting measure). Outside the
        support: ``ValueError`` with validation on, ``-inf`` with it off. A value whose shape
        does not end in ``event_shape`` or does not broadcast with ``batch_shape`` is a
        ``ValueError`` always. Differentiable in ``value`` too, so a straight-through sample
        passes its gradient on.

        The value is computed from the tilted logits (``kernels.log_prob_value``), exact to
        the dtype's precision for logits of any size; the gradient is that of the formula."""
        if not isinstance(value, torch.Tensor):  # array-likes, as the other classes take
            value = torch.as_tensor(value, device=self.logits.device)
        with static_under_trace():  # sizes only, which a trace fixes
            check_value_shape(
                tuple(value.shape), self.batch_shape, self.event_shape, "ExactlyKBernoulli.log_prob"
            )
        if self._validate_args:
            self._validate_sample(value)
        dtype = torch.promote_types(self.logits.dtype, value.dtype)
        exact = kernels.log_prob_value(self._kernel_logits, self._normalizer_parts, value)
        exact = torch.where(self._deterministic, 0.0, exact)
        formula = (self._finite_logits * value).sum(-1) - self._log_normalizer
        score = _value_with_gradient_of(exact.to(dtype), formula)
        if self._validate_args and not _static_control_flow():
            # Every value and the constraint were checked (else ValueError): all possible. A
            # traced program keeps the mask below, since it replays no check.
            return score
        possible = self.support.check(value) & self._respects_infinite_logits(value)
        possible = possible & ~self._infeasible
        return torch.where(possible, score, torch.full_like(score, -torch.inf))

    def sample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        """Exact draws of the conditional distribution: 0.0 / 1.0 entries summing to k."""
        self._check_can_sample()
        with torch.no_grad():
            z = kernels.sample(self._kernel_logits, self._k_free, self._table_size, sample_shape)
            z = torch.where(self._forced_on, torch.ones_like(z), z)
            return torch.where(self._infeasible[..., None], torch.nan, z)

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        """An exact sample ``z`` with the straight-through marginal gradient:
        ``z + (mu - mu.detach())`` (its value is exactly ``z``). ``NotImplementedError``
        with ``grad_estimator="score_function"`` (no reparameterised sampler)."""
        if not self.has_rsample:
            raise NotImplementedError(
                "ExactlyKBernoulli(grad_estimator='score_function') has no reparameterised "
                "sampler (has_rsample is False): use sample(); Pyro's ELBOs then "
                "differentiate the site by the score function"
            )
        self._check_can_sample()
        z, free = kernels.sample_and_marginals(
            self._kernel_logits, self._k_free, self._table_size, sample_shape
        )
        z = torch.where(self._forced_on, torch.ones_like(z), z.detach())
        z = torch.where(self._infeasible[..., None], torch.nan, z)
        mu = self._with_edge_derivatives(self._complete(free, 1.0, 0.0, 0.0))
        return straight_through_draw(z + (mu - mu.detach()))

    def _check_can_sample(self) -> None:
        # Under torch.jit.trace this check would be frozen at its first outcome (a Python
        # branch on the logits): traced samples of an impossible constraint are NaN instead.
        if not torch.jit.is_tracing() and self._infeasible.any():
            raise ValueError(
                "ExactlyKBernoulli.sample: the constraint is impossible for some batch element "
                "(k outside 0..n, or infinite logits that rule out every k-hot vector)"
            )

    def entropy(self) -> torch.Tensor:
        """``H = log e_k(exp theta) - theta . mu`` (over the finite logits), evaluated as a
        sum of non-negative terms of the tilted logits (``kernels.cross_entropy_value``);
        NaN where the constraint is impossible."""
        mu, complement = self._marginal_pair
        exact = kernels.cross_entropy_value(
            self._kernel_logits, self._normalizer_parts, mu, complement
        )
        exact = torch.where(self._deterministic, 0.0, exact)
        centred = _centred(self.logits, self._finite, self._normalizer_parts.tilt)
        formula = self._log_normalizer - (centred * mu).sum(-1)
        if self._odds_tangents is not None:
            tangents = self._odds_tangents
            formula = formula + _infinite_slope(tangents.probs, tangents.unbounded)
        entropy = _value_with_gradient_of(exact.to(self.logits.dtype), formula)
        return torch.where(self._infeasible, torch.nan, entropy)

    def log_constraint_prob(self) -> torch.Tensor:
        """``log P(sum z = k)`` under the unconstrained Bernoullis (Poisson-binomial pmf):
        ``log e_k(exp theta) - sum_i softplus(theta_i)``, shape ``batch``, evaluated without
        that difference's cancellation (``kernels.log_constraint_prob_value``); ``-inf``
        where the constraint is impossible. Its tables are float64 whatever the logits'
        dtype: near the mode, ``log P`` is only about ``-log(n) / 2``, and float32 tables
        would leave it a relative error of up to ``n eps``."""
        parts = self._normalizer_parts
        if self.logits.dtype != torch.float64:
            wide_logits = self._kernel_logits.detach().to(torch.float64)
            parts = kernels.normalizer_parts(wide_logits, self._k_free, self._table_size)
        exact = kernels.log_constraint_prob_value(self._kernel_logits, self._k_free, parts)
        softplus = torch.where(self._finite, _softplus(self._finite_logits), 0.0)
        formula = self._log_normalizer - softplus.sum(-1)
        if self._odds_tangents is not None:
            formula = formula + self._odds_tangents.softplus
        value = _value_with_gradient_of(exact.to(self.logits.dtype), formula)
        return torch.where(self._infeasible, -torch.inf, value)

    def expand(self, batch_shape, _instance=None) -> "ExactlyKBernoulli":
        """A view of this distribution with batch shape ``batch_shape`` (an instance of the
        same class whose parameters are broadcast, not an ``ExpandedDistribution``). Raises
        ``ValueError`` where the current batch shape does not broadcast to ``batch_shape``."""
        new = self._get_checked_instance(ExactlyKBernoulli, _instance)
        batch_shape = torch.Size(batch_shape)
        try:
            if torch.broadcast_shapes(self.batch_shape, batch_shape) != batch_shape:
                raise RuntimeError
        except RuntimeError as error:
            raise ValueError(
                f"Cannot broadcast distribution of shape {tuple(self.batch_shape)} to shape "
                f"{tuple(batch_shape)}"
            ) from error
        new.logits = self.logits.expand(batch_shape + self.event_shape)
        if "probs" in self.__dict__:
            new.probs = self.probs.expand(batch_shape + self.event_shape)
        new.k = self.k.expand(batch_shape)
        new._from_probs = self._from_probs
        new._k_is_constant = self._k_is_constant
        new._table_size = self._table_size
        new.k_max = self.k_max
        new.grad_estimator = self.grad_estimator
        new.has_rsample = self.has_rsample
        new._infeasible = self._infeasible.expand(batch_shape)
        super(ExactlyKBernoulli, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @classmethod
    def infer_shapes(cls, logits=None, probs=None, k=()):
        shape = logits if logits is not None else probs
        batch_shape = torch.broadcast_shapes(torch.Size(shape[:-1]), torch.Size(k))
        return batch_shape, torch.Size(shape[-1:])

    def __repr__(self) -> str:
        return parameters_repr(
            type(self).__name__, {"logits": self.logits, "k": self.k}, integers=("k",)
        )


# The KL lives with the other formulas; registered here, where the class is defined.
register_kl(ExactlyKBernoulli, ExactlyKBernoulli)(_kl)
