"""Independent Poissons conditioned on their sum: ``ConditionedPoisson(rate, k=k)``.

``z_i ~ Poisson(rate_i)`` independently, conditioned on ``sum_i z_i = k``, is
``Multinomial(k, p)`` with ``p = rate / sum(rate)`` (docs/distributions/conditioned_poisson.md).
Unlike ``torch.distributions.Multinomial``, ``k`` may vary over the batch (bags with different known
totals), the support check demands ``sum z == k`` exactly, ``rsample`` carries the straight-through
marginal-expectation gradient, and the entropy is exact and fast.

The class and its KL are here; the supports, numerics, entropy and samplers are in the
``_conditioned_poisson_*`` modules beside this one (mirrored file for file in
``numpyro_constrained``), and are re-exported from here.
"""

from __future__ import annotations

import math

import torch
from pyro.distributions import Binomial, TorchDistribution
from torch.distributions import constraints
from torch.distributions.kl import register_kl

from constrained_ppl.arguments import (
    DISCRETE_GRAD_ESTIMATORS,
    check_count,
    check_grad_estimator,
    check_static_bound,
    check_value_shape,
    keyword_only,
)
from constrained_ppl.conditioned_poisson import SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY  # noqa: F401
from constrained_ppl.enumeration import check_support_size, compositions, single_count
from constrained_ppl.exact_integers import check_k_max_bounds_k, check_total_in_exact_range
from pyro_constrained._conditioned_poisson_entropy import _expected_log_factorials
from pyro_constrained._conditioned_poisson_numerics import (
    _bd0,  # noqa: F401
    _finite_log_zero,  # noqa: F401
    _log_factorial_of_counts,
    _log_poisson,  # noqa: F401
    _log_poisson_of_total,
    _log_probs_only,
    _mode_counts,
    _normalized_log_probs,
    _probs_only,
    _relative_entropy,
    _stirling_error,  # noqa: F401
)
from pyro_constrained._conditioned_poisson_sampler import _sample_counts
from pyro_constrained._conditioned_poisson_support import (
    _IntegerComposition,
    _is_integer_composition,
    integer_composition,
    positive_finite,
)
from pyro_constrained._conditioned_poisson_tracing import static_under_trace
from pyro_constrained._repr import parameters_repr
from pyro_constrained._score_parts import score_parts as _score_parts
from pyro_constrained._score_parts import straight_through_draw

__all__ = ["ConditionedPoisson", "integer_composition", "positive_finite"]
# The imports marked noqa are re-exports: names of the _conditioned_poisson_* modules that
# losses.py and callers import from this module.

_EMPTY_SIZE = torch.Size()


class ConditionedPoisson(TorchDistribution):
    r"""Independent ``Poisson(rate_i)`` counts conditioned on summing to exactly ``k``.

    The conditional distribution is ``Multinomial(k, p)`` with ``p = rate / sum(rate)``
    (only the rates' proportions matter)::

        log_prob(z) = log k! - sum_i log z_i! + sum_i z_i log p_i

    on integer vectors ``z >= 0`` with ``sum_i z_i = k``, with respect to counting measure
    on that set. ``k`` is a count (below) broadcast with ``rate.shape[:-1]``: the batch
    shape is the broadcast of the two, the event shape ``rate.shape[-1:]``.

    ``rsample`` returns an exact sample whose gradient is the straight-through
    marginal-expectation estimator through ``E[z] = k p``
    (docs/distributions/gradient_estimators.md): the value is exactly integer and sums exactly to
    ``k``. It is biased wherever the downstream function of ``z`` is not linear in ``z``.
    With ``grad_estimator="score_function"``, ``has_rsample`` is ``False`` on the instance,
    so ``pyro.sample`` draws with :meth:`sample` (exact, no gradient) and Pyro's ELBOs
    differentiate the site by the score function (unbiased, higher variance; baselines
    through ``TraceGraph_ELBO`` and the site's ``infer={"baseline": ...}``); ``rsample``
    then raises ``NotImplementedError``. Which to choose:
    docs/distributions/choosing_gradient_estimator.md. ``marginals`` are
    ``Binomial(k, p_i)``. ``sample``, ``rsample`` and ``log_prob`` use no
    in-place op, so that they run under ``torch.jit.trace`` (``JitTrace_ELBO`` and its kin).

    Numerics: ``p`` is normalised in log space in float64 (rates from 1e-300 to 1e300
    side by side are fine), and ``log_prob``, ``entropy``, ``mean``, ``variance``, KL and
    ``log_constraint_prob`` accumulate in float64 before rounding to ``rate``'s dtype, so
    that float32 results keep float32 relative accuracy at large ``k``. ``k`` and the
    samples live in ``rate``'s dtype, which must hold every count exactly: ``k`` (or
    ``k_max``) above ``2**24`` (float32) or ``2**53`` (float64) is a ``ValueError``.

    ``k``: an int, an integer tensor, or whole-number floats (``3.0``, as
    ``Binomial.total_count``); ``3.5``, a bool, a complex number or NaN is a ``ValueError``
    whatever ``validate_args`` says (`constrained_ppl.arguments.check_count`), as in
    ``numpyro_constrained``. A negative ``k`` is a ``ValueError`` with validation on; with
    it off it gives ``-inf`` log-probabilities and NaN ``mean``, ``variance``, ``entropy``
    and samples, never a finite number.

    Parameter constraints: ``rate`` has event_dim 1 (its last dimension is the event),
    ``k`` event_dim 0.

    :param rate: positive, finite Poisson rates, shape ``batch + (n,)``.
    :param k: the known total, a non-negative integer (per batch element or shared), as
        above.
    :param k_max: an optional static upper bound on ``k`` (a Python int), for parity with
        ``numpyro_constrained``, where it sizes jitted tables when ``k`` is traced; here
        ``k`` is always concrete, so it is only checked: a ``k`` above it is a
        ``ValueError``.
    :param grad_estimator: ``"marginal_expectation"`` (default) or ``"score_function"``
        (above); anything else is a ``ValueError`` naming the two.

    Examples
    --------
    >>> import torch
    >>> from pyro_constrained import ConditionedPoisson
    >>> rate = torch.tensor([1.0, 2.0, 5.0])
    >>> d = ConditionedPoisson(rate, k=8)
    >>> d
    ConditionedPoisson(rate: torch.Size([3]), k: 8)
    >>> d.mean  # k p, with p = rate / sum(rate)
    tensor([1., 2., 5.])
    >>> z = d.sample((4,))  # exact integer draws summing to 8
    >>> z.shape, bool((z.sum(-1) == 8).all()), bool((z == z.round()).all())
    (torch.Size([4, 3]), True, True)
    >>> value = torch.tensor([1.0, 2.0, 5.0])
    >>> multinomial = torch.distributions.Multinomial(8, probs=rate / rate.sum())
    >>> bool(torch.isclose(d.log_prob(value), multinomial.log_prob(value)))
    True
    """

    arg_constraints = {
        "rate": constraints.independent(positive_finite, 1),
        "k": constraints.nonnegative_integer,
    }
    has_rsample = True
    # Enumerated guide sites are scored, not pathwise (see _score_parts).
    score_parts = _score_parts
    has_enumerate_support = True
    #: The largest support that `enumerate_support` builds (a ``ValueError`` beyond it).
    max_support = 2**16

    @keyword_only("k", usage="ConditionedPoisson(rate, k=k)")
    def __init__(
        self,
        rate: torch.Tensor,
        *,
        k: int | float | torch.Tensor,
        k_max: int | None = None,
        grad_estimator: str = "marginal_expectation",
        validate_args: bool | None = None,
    ) -> None:
        self.grad_estimator = check_grad_estimator(grad_estimator, DISCRETE_GRAD_ESTIMATORS)
        # Per instance: Pyro's ELBOs read site["fn"].has_rsample to choose between the
        # pathwise and the score-function term.
        self.has_rsample = grad_estimator == "marginal_expectation"
        k_max = check_static_bound(k_max)
        rate = rate if isinstance(rate, torch.Tensor) else torch.as_tensor(rate)
        if not rate.is_floating_point():
            rate = rate.to(torch.get_default_dtype())
        # Shapes and k only: static under torch.jit.trace (see _k_bound).
        with static_under_trace():
            try:
                batch_shape = self._check_shapes_and_k(rate, k, k_max)
            except RuntimeError as error:  # torch.func.vmap cannot read a batched value
                raise RuntimeError(
                    "ConditionedPoisson checks k (a count within the integers of rate's dtype) "
                    "as Python numbers, which torch.func.vmap over k cannot provide: give the "
                    "distribution the batch of k instead (it is batched natively)"
                ) from error
            if not isinstance(k, torch.Tensor):
                k = torch.as_tensor(k)
            k = k.to(rate.device)
        event_shape = rate.shape[-1:]
        self.rate = rate.expand(batch_shape + event_shape)
        # Stored in rate's dtype, as Binomial stores total_count (exact: checked above).
        self.k = k.to(rate.dtype).expand(batch_shape)
        self.k_max = k_max
        super().__init__(batch_shape, event_shape, validate_args=validate_args)

    @staticmethod
    def _check_shapes_and_k(rate: torch.Tensor, k, k_max: int | None) -> torch.Size:
        """The batch shape, after a ``ValueError`` for a ``rate`` without categories, a ``k``
        that is no count, that does not broadcast with the batch, or that exceeds ``k_max``
        or the exact integers of ``rate``'s dtype."""
        if rate.dim() < 1:
            raise ValueError(
                "rate must have at least one dimension (the categories), got shape "
                f"{tuple(rate.shape)}"
            )
        if rate.shape[-1] < 1:
            raise ValueError("rate must have at least one category (rate.shape[-1] >= 1)")
        check_count(k, concrete=True, name="k")
        k = (
            k.to(rate.device)
            if isinstance(k, torch.Tensor)
            else torch.as_tensor(k, device=rate.device)
        )
        try:
            batch_shape = torch.broadcast_shapes(rate.shape[:-1], k.shape)
        except RuntimeError as error:
            raise ValueError(
                f"k of shape {tuple(k.shape)} does not broadcast with the batch shape "
                f"{tuple(rate.shape[:-1])} of rate (shape {tuple(rate.shape)})"
            ) from error
        _check_k_is_exact(k, rate.dtype, k_max)
        return batch_shape

    @classmethod
    def infer_shapes(cls, rate: tuple[int, ...], k: tuple[int, ...] = ()):
        batch_shape = torch.broadcast_shapes(tuple(rate[:-1]), tuple(k))
        return batch_shape, tuple(rate[-1:])

    def expand(self, batch_shape, _instance=None) -> ConditionedPoisson:
        """A view of this distribution with batch shape ``batch_shape`` (an instance of the same
        class whose parameters are broadcast, not an ``ExpandedDistribution``). Raises
        ``ValueError`` where the current batch shape does not broadcast to ``batch_shape``."""
        new = self._get_checked_instance(ConditionedPoisson, _instance)
        batch_shape = torch.Size(batch_shape)
        try:
            new.rate = self.rate.expand(batch_shape + self.event_shape)
        except RuntimeError as error:
            raise ValueError(
                f"Cannot broadcast distribution of shape {tuple(self.batch_shape)} to shape "
                f"{tuple(batch_shape)}"
            ) from error
        new.k = self.k.expand(batch_shape)
        new.k_max = self.k_max
        new.grad_estimator = self.grad_estimator
        new.has_rsample = self.has_rsample
        super(ConditionedPoisson, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self) -> constraints.Constraint:
        return _IntegerComposition(self.k)

    def _log_probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``log p`` and ``log(1 - p)`` in float64 (`_normalized_log_probs`)."""
        return _normalized_log_probs(self.rate)

    def _log_p(self) -> torch.Tensor:
        """``log p`` in float64 (`_log_probs_only`)."""
        return _log_probs_only(self.rate)

    @property
    def probs(self) -> torch.Tensor:
        """``p = rate / sum(rate)``, the multinomial probabilities."""
        return _probs_only(self.rate).to(self.rate.dtype)

    def enumerate_support(self, expand: bool = True) -> torch.Tensor:
        """Every composition of ``k`` into ``n`` non-negative parts once (all have positive
        probability), shape ``(count,) + batch_shape + (n,)`` (``expand=True``) or
        ``(count,) + (1,) * len(batch_shape) + (n,)`` (``expand=False``), as
        ``torch.distributions.OneHotCategorical``; in reverse lexicographic order (the
        first is ``(k, 0, ..., 0)``). Needs one ``k`` over the batch (else a
        ``ValueError``). ``count = C(k + n - 1, n - 1)`` is computed before anything is
        built; above ``max_support`` it is a ``ValueError``."""
        name = type(self).__name__
        k = single_count(self.k.detach().cpu().numpy(), name)
        if k < 0:
            raise ValueError(f"{name}.enumerate_support: k = {k} has an empty support")
        n = self.event_shape[0]
        count = math.comb(k + n - 1, n - 1)
        check_support_size(count, self.max_support, name)
        table = compositions(n, k)
        values = torch.as_tensor(table, dtype=self.rate.dtype, device=self.rate.device)
        values = values.reshape((count,) + (1,) * len(self.batch_shape) + self.event_shape)
        if expand:
            values = values.expand((count,) + self.batch_shape + self.event_shape)
        return values

    @property
    def mode(self) -> torch.Tensor:
        """The most likely composition (a multinomial mode), exact: a lower bound on every
        mode plus the remaining units of largest gain ``log p_i - log(z_i + 1)`` (the
        log-pmf is separable and concave in the counts), chosen among a static number of
        candidates by one sort (`_mode_counts`), with no loop and no decision on values, so
        that it replays under ``torch.jit.trace`` and runs under ``torch.func.vmap`` over
        ``rate``. Ties go to the lower index, so among equally likely compositions the
        result is deterministic. NaN where ``k < 0`` (validation off)."""
        counts = _mode_counts(self._log_p(), self._k_long, self._k_bound).to(self.rate.dtype)
        return torch.where(self._k_is_negative[..., None], math.nan, counts)

    @property
    def _k_bound(self) -> int:
        """A static bound on ``k``, at least 0, which sizes the tables, the sampler's draws and
        the entropy's windows: the largest ``k``, or under ``torch.jit.trace`` the ``k_max``
        passed where there is one. A trace fixes this number: ``k`` is a constant of the
        trace unless ``k_max`` bounds it (`pyro_constrained._conditioned_poisson_tracing`)."""
        if torch.jit.is_tracing() and self.k_max is not None:
            return self.k_max
        with static_under_trace():
            return max(int(self.k.max()), 0) if self.k.numel() else 0

    @property
    def _k_long(self) -> torch.Tensor:
        """``k`` as a long tensor, negative entries (validation off) as 0: what the
        samplers and the entropy's tables can take; `_k_is_negative` marks them."""
        return self.k.clamp(min=0).long()

    @property
    def _k_is_negative(self) -> torch.Tensor:
        """Where ``k < 0`` (possible with validation off), shape ``batch_shape``: those get
        ``-inf`` log-probabilities and NaN moments and samples. A mask, not a branch on its
        values, so that it stays right under ``torch.jit.trace``."""
        return self.k < 0

    @property
    def mean(self) -> torch.Tensor:
        """``k p``; NaN where ``k < 0``."""
        mean = (self.k.double().unsqueeze(-1) * _probs_only(self.rate)).to(self.rate.dtype)
        return mean.masked_fill(self._k_is_negative.unsqueeze(-1), math.nan)

    @property
    def variance(self) -> torch.Tensor:
        """``k p (1 - p)``; NaN where ``k < 0``."""
        # k p (1 - p) with 1 - p exact also where p rounds to 1.
        log_p, log1m_p = self._log_probs()
        variance = (self.k.double().unsqueeze(-1) * (log_p + log1m_p).exp()).to(self.rate.dtype)
        return variance.masked_fill(self._k_is_negative.unsqueeze(-1), math.nan)

    @property
    def marginals(self) -> Binomial:
        """The conditional marginal of each coordinate: ``z_i ~ Binomial(k, p_i)``."""
        p = self.probs
        return Binomial(total_count=self.k.unsqueeze(-1).expand_as(p), probs=p, validate_args=False)

    def log_constraint_prob(self) -> torch.Tensor:
        """``log P(sum_i z_i = k)`` under the unconstrained Poissons, ``log Poisson(k; sum(rate))``
        (the count likelihood of a bag of known total); ``-inf`` where ``k < 0``."""
        log_prob = _log_poisson_of_total(self.rate, self._k_long)
        return log_prob.to(self.rate.dtype).masked_fill(self._k_is_negative, -math.inf)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """``log k! - sum_i log z_i! + sum_i z_i log p_i``; ``-inf`` off the support (or a
        ``ValueError`` there with validation on). Differentiable in ``value`` too. A value
        whose shape does not end in the event shape, or whose leading dimensions do not
        broadcast with the batch shape, is a ``ValueError`` naming the expected shape.

        The support check is exact whatever ``value``'s dtype (an int64 count above
        ``2**24`` is not rounded into the support of a float32 distribution); the sum is
        accumulated in float64 and returned in the promotion of ``rate``'s and a floating
        ``value``'s dtypes (torch's type promotion).
        """
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value, device=self.rate.device)
        with static_under_trace():  # shapes
            check_value_shape(value.shape, self.batch_shape, self.event_shape, "ConditionedPoisson")
        if value.is_floating_point():
            dtype = torch.promote_types(self.rate.dtype, value.dtype)
        else:
            dtype = self.rate.dtype
        k_bound = self._k_bound
        in_support, _ = _is_integer_composition(value, self.k, k_bound)
        # Not under torch.jit.trace: a trace cannot raise on values; it gives -inf there.
        if self._validate_args and not torch.jit.is_tracing() and not bool(in_support.all()):
            raise ValueError(
                "The value argument to ConditionedPoisson.log_prob must be vectors of "
                f"integers >= 0 that sum to exactly k, got {value} with k = {self.k}"
            )
        # lgamma(z + 1) at a negative integer is inf and its derivative NaN: evaluate off
        # the support at 0 instead (those entries get -inf below; where keeps the gradient
        # of the others exact, unlike clamping, which halves it at 0). Always, not behind a
        # check of the values: torch.jit.trace would freeze that branch.
        value = torch.where(in_support.unsqueeze(-1), value, 0)
        counts = value.to(torch.float64)
        log_p = self._log_p()
        k = self.k.double()
        log_prob = (
            torch.lgamma(k + 1)
            - _log_factorial_of_counts(counts, k_bound).sum(-1)
            + torch.linalg.vecdot(counts, log_p)
        )
        # A negative k (validation off) has no value in its support.
        log_prob = torch.where(in_support, log_prob, -math.inf)
        return log_prob.to(dtype)

    def __repr__(self) -> str:
        return parameters_repr(
            type(self).__name__, {"rate": self.rate, "k": self.k}, integers=("k",)
        )

    def sample(self, sample_shape=_EMPTY_SIZE) -> torch.Tensor:
        """An exact sample (no gradient); NaN where ``k < 0``."""
        # detach, not only no_grad: torch.jit.trace does not record no_grad, and a traced
        # sampler whose inputs required grad would be differentiated through its draws.
        with torch.no_grad():
            z = _sample_counts(
                self.rate.detach(), self._k_long, self._k_bound, torch.Size(sample_shape)
            )
            return z.masked_fill(self._k_is_negative.unsqueeze(-1), math.nan)

    def rsample(self, sample_shape=_EMPTY_SIZE) -> torch.Tensor:
        """An exact sample ``z`` returned as ``z + (m - m.detach())`` with ``m = k p``: the
        value is exactly ``z``, the gradient that of the conditional mean (zero, not absent,
        where ``k = 0``). ``NotImplementedError`` with ``grad_estimator="score_function"``
        (no reparameterised sampler)."""
        if not self.has_rsample:
            raise NotImplementedError(
                "ConditionedPoisson(grad_estimator='score_function') has no reparameterised "
                "sampler (has_rsample is False): use sample(); Pyro's ELBOs then "
                "differentiate the site by the score function"
            )
        z = self.sample(sample_shape)
        m = self.mean.expand(z.shape)
        return straight_through_draw(z + (m - m.detach()))

    def entropy(self) -> torch.Tensor:
        """Exact entropy ``-log k! - k sum_i p_i log p_i + sum_i E[log z_i!]``,
        ``z_i ~ Binomial(k, p_i)``; NaN where ``k < 0``.

        The expectations sum only over binomial outcomes within a Bennett-inequality window
        around each mean; the dropped terms total at most ``0.01`` times the machine epsilon
        of ``rate``'s dtype (absolute), see `entropy_log_inverse_tail`. The O(n w) loop runs
        in ``rate``'s dtype on quantities centred in float64 (`_expected_log_factorials`),
        the O(n) sums in float64. Cost O(n w) per batch element with ``w <= k + 1`` the
        window width (about 20 for ``k = 100`` spread over ``n = 1000`` categories).
        """
        dtype = self.rate.dtype
        log_p, log1m_p = self._log_probs()
        with static_under_trace():  # a size
            single_category = bool(self.event_shape[0] == 1)
        if single_category:
            # A single category: z = k surely. 0 with a zero gradient.
            entropy = (log_p.sum(-1) * self.k).to(dtype)
        else:
            k_long = self._k_long
            k = k_long.double()
            try:
                log_c_factorial, correction = _expected_log_factorials(
                    log_p, log1m_p, k_long, self._k_bound, dtype
                )
            except RuntimeError as error:  # torch.func.vmap cannot read a batched value
                raise RuntimeError(
                    "ConditionedPoisson.entropy sizes its windows of outcomes by Python "
                    "numbers read from the rates, which torch.func.vmap over them cannot "
                    "provide: give the distribution the batch of rates instead (it is "
                    "batched natively)"
                ) from error
            cross_entropy = k * (log_p.exp() * log_p).sum(-1)
            # Grouped so that a near-certain outcome (entropy 1e-28 beside log k! = 8.5, say)
            # keeps its relative accuracy: the log-factorials cancel exactly there.
            log_factorials = log_c_factorial.sum(-1) - torch.lgamma(k + 1)
            entropy = (log_factorials + (correction.sum(-1) - cross_entropy)).to(dtype)
        return entropy.masked_fill(self._k_is_negative, math.nan)


def _check_k_is_exact(k: torch.Tensor, dtype: torch.dtype, k_max: int | None) -> None:
    """``ValueError`` when ``k`` exceeds ``k_max`` or the integers that ``dtype`` (and a
    floating ``k``'s own dtype) hold exactly, or ``k_max`` exceeds those of ``dtype``;
    negative ``k`` is left to the validation of ``k`` (NaN is refused by `check_count`)."""
    if k_max is not None:
        check_total_in_exact_range(k_max, str(dtype), argument="k_max")
    if k.numel() == 0:
        return
    largest = int(k.max())
    if k_max is not None:
        check_k_max_bounds_k(k_max, largest)
    if k.is_floating_point():
        check_total_in_exact_range(largest, str(k.dtype), argument="k")
    check_total_in_exact_range(largest, str(dtype), argument="k")


@register_kl(ConditionedPoisson, ConditionedPoisson)
def _kl_conditioned_poisson(p: ConditionedPoisson, q: ConditionedPoisson) -> torch.Tensor:
    """``KL(p || q) = k sum_i p_i log(p_i / q_i)`` for two with the same ``k`` and ``n``, in
    the promotion of their dtypes, never negative and accurate also where the two are close
    (`_relative_entropy`); NaN where ``k < 0``."""
    with static_under_trace():  # sizes
        same_n = bool(p.event_shape == q.event_shape)
    if not same_n:
        raise ValueError(
            f"KL between ConditionedPoisson needs the same number of categories, got "
            f"{p.event_shape[0]} and {q.event_shape[0]}"
        )
    with static_under_trace():  # k is a constant of a trace
        same_k = torch.equal(*torch.broadcast_tensors(p.k.double(), q.k.double()))
    if not same_k:
        raise ValueError("KL between ConditionedPoisson needs the same k")
    kl = p.k.double() * _relative_entropy(p.rate, q.rate)
    kl = kl.to(torch.promote_types(p.rate.dtype, q.rate.dtype))
    return kl.masked_fill(p._k_is_negative, math.nan)
