"""CountConstrainedBernoulli: independent Bernoullis conditioned on low <= sum z <= high.

The math: ``docs/distributions/count_constrained_bernoulli.md``.

A mixture over the counts in the range: given its count k, z is ``ExactlyKBernoulli(logits,
k)``, and the count has the Poisson-binomial law truncated to the range. Every quantity is
built from one ``ExactlyKBernoulli`` whose batch is stacked over the counts (``R`` of them:
the widest range of the batch), so each inherits its exactness (tilted kernels, one-signed
sums) and its gradients: R kernel passes per batch element.
"""

import math

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints
from torch.distributions.kl import kl_divergence, register_kl
from torch.distributions.utils import lazy_property

from constrained_ppl.arguments import check_count, check_value_shape
from constrained_ppl.enumeration import check_support_size, k_hot_table
from pyro_constrained import _count_edges as edges
from pyro_constrained._bernoulli_arguments import (
    LOGITS_PROBS_CONSTRAINTS,
    forced_counts,
    logits_argument,
)
from pyro_constrained._ekb_terms import _infinite_slope
from pyro_constrained._repr import parameters_repr
from pyro_constrained._score_parts import score_parts as _score_parts
from pyro_constrained._score_parts import straight_through_draw
from pyro_constrained.exactly_k_bernoulli import ExactlyKBernoulli
from pyro_constrained.exactly_k_tracing import static_under_trace

__all__ = ["CountConstrainedBernoulli", "CountRange"]


class CountRange(constraints.Constraint):
    """0/1 vectors (last dimension) with ``low <= sum <= high``; the bounds broadcast with
    the batch."""

    is_discrete = True
    event_dim = 1

    def __init__(self, low: torch.Tensor, high: torch.Tensor):
        self.low, self.high = low, high
        super().__init__()

    def check(self, value: torch.Tensor) -> torch.Tensor:
        binary = ((value == 0) | (value == 1)).all(-1)
        total = value.sum(-1)
        # The bounds as integers: in a boolean value's dtype, high = 2 would be True, i.e. 1.
        return binary & (total >= self.low) & (total <= self.high)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(low={self.low}, high={self.high})"


def _as_bound(bound, default: int, logits: torch.Tensor, name: str) -> torch.Tensor:
    if bound is None:
        bound = default
    check_count(bound, concrete=True, name=name)
    return torch.as_tensor(bound, device=logits.device).to(torch.long)


class CountConstrainedBernoulli(TorchDistribution):
    r"""Independent Bernoullis ``z_i ~ Bernoulli(sigmoid(logits_i))`` conditioned on
    ``low <= sum_i z_i <= high``:

    .. math:: p(z) = \exp(\theta \cdot z) / \sum_{k=\mathrm{low}}^{\mathrm{high}}
        e_k(\exp \theta), \qquad \mathrm{low} \le |z| \le \mathrm{high}.

    "At most k" is ``low=0, high=k`` (a budget: select up to k items), "at least k" is
    ``low=k`` (``high`` defaults to n), and ``low = high = k`` is ``ExactlyKBernoulli``. A
    logit of ``+inf`` forces its variable on, ``-inf`` off.

    Given its count K, z is ``ExactlyKBernoulli(logits, K)``, and K has the Poisson-binomial
    law truncated to the range; every quantity is computed from that mixture, with the
    exactness of ``ExactlyKBernoulli`` (any finite logit, float32 and float64) and one kernel
    pass per count in the range (``R = max(high - low) + 1`` passes per batch element: a
    range of a few hundred counts is cheap, ``low=0, high=n / 2`` at large n is not).

    :param logits: log-odds, shape ``batch + (n,)``; entries may be ``+-inf``.
    :param probs: probabilities in [0, 1] instead of logits (exactly one of the two).
    :param low: the smallest allowed count (default 0), broadcasting with the batch.
    :param high: the largest allowed count (default n), broadcasting with the batch.

    With validation on, ``0 <= low <= high <= n`` and a range that the infinite logits leave
    feasible are checked (``ValueError``). ``rsample`` returns an exact sample carrying the
    straight-through gradient of the conditional marginals, ``z + (mu - mu.detach())``.

    Examples
    --------
    >>> import torch
    >>> from pyro_constrained import CountConstrainedBernoulli
    >>> d = CountConstrainedBernoulli(logits=torch.tensor([2.0, 1.0, 0.5, -1.0]), high=2)
    >>> z = d.sample((5,))
    >>> bool((z.sum(-1) <= 2).all())
    True
    >>> round(float(d.log_prob(d.enumerate_support()).exp().sum()), 6)
    1.0
    """

    arg_constraints = {
        **LOGITS_PROBS_CONSTRAINTS,
        "low": constraints.nonnegative_integer,
        "high": constraints.nonnegative_integer,
    }
    has_rsample = True
    # Enumerated guide sites are scored, not pathwise (see _score_parts).
    score_parts = _score_parts
    has_enumerate_support = True
    #: The largest support that `enumerate_support` builds (a ``ValueError`` beyond it).
    max_support = 2**16

    def __init__(
        self,
        logits: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        *,
        low: int | torch.Tensor | None = None,
        high: int | torch.Tensor | None = None,
        validate_args: bool | None = None,
    ):
        logits, probs = logits_argument(logits, probs, "CountConstrainedBernoulli")
        n = logits.shape[-1]
        low = _as_bound(low, 0, logits, "low")
        high = _as_bound(high, n, logits, "high")
        try:
            batch_shape = torch.broadcast_shapes(logits.shape[:-1], low.shape, high.shape)
        except RuntimeError as error:
            raise ValueError(
                f"low {tuple(low.shape)} and high {tuple(high.shape)} do not broadcast with "
                f"the batch shape {tuple(logits.shape[:-1])} of the logits"
            ) from error
        event_shape = logits.shape[-1:]
        self.logits = logits.expand(batch_shape + event_shape)
        if probs is not None:
            self.probs = probs.expand(batch_shape + event_shape)
        self.low, self.high = low.expand(batch_shape), high.expand(batch_shape)
        # Resolved before Distribution.__init__ (whose checks give less specific messages)
        # as it resolves it: self._validate_args is still the class-wide default.
        validate = self._validate_args if validate_args is None else validate_args
        try:
            self._check_bounds(validate)
        except RuntimeError as error:  # torch.func.vmap cannot read a batched value
            raise RuntimeError(
                "CountConstrainedBernoulli checks its bounds and sizes its stack of counts "
                "by Python numbers read from the logits and bounds, which torch.func.vmap "
                "over them (or over log_prob's values) cannot provide: give the distribution "
                "the batch of logits instead (it is batched natively)"
            ) from error
        super().__init__(batch_shape, event_shape, validate_args=validate_args)

    def _check_bounds(self, validate: bool) -> None:
        n = self.logits.shape[-1]
        with torch.no_grad():
            forced_on, forced_off = forced_counts(self.logits)
            first = torch.maximum(self.low, forced_on)
            last = torch.minimum(self.high, n - forced_off)
        if validate and self.low.numel():
            if self.low.min() < 0 or self.high.max() > n or (self.low > self.high).any():
                raise ValueError(f"the bounds must satisfy 0 <= low <= high <= n = {n}")
            if (first > last).any():
                raise ValueError(
                    "logits make the constraint impossible: the infinite logits (probs 0 or 1) "
                    "leave no count in low..high for some batch element"
                )
        self._first, self._last = first, last
        self._infeasible = first > last
        if torch.jit.is_tracing():
            # A trace fixes the number of stacked counts: every count (NumPyro's form under
            # jit), not the range that the first call's infinite logits leave.
            with static_under_trace():
                self._width = int(n) + 1
            return
        width = (last - first).clamp(min=0) + 1
        self._width = int(width.max()) if width.numel() else 1

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self) -> CountRange:
        return CountRange(self.low, self.high)

    @lazy_property
    def probs(self) -> torch.Tensor:
        return torch.sigmoid(self.logits)

    @lazy_property
    def _counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the counts of the stacked rows, shape ``(R,) + batch``, each clamped into the
        feasible range; whether a row is a distinct count of the range)."""
        r = torch.arange(self._width, device=self.logits.device).reshape(
            (-1,) + (1,) * len(self.batch_shape)
        )
        counts = self._first + r
        in_range = counts <= self._last
        return torch.minimum(counts, self._last).clamp(min=0), in_range

    @lazy_property
    def _stacked(self) -> ExactlyKBernoulli:
        """``ExactlyKBernoulli(logits, k)`` for every count k of the range (leading dim)."""
        counts, _ = self._counts
        logits = self.logits.expand((self._width,) + self.logits.shape)
        safe = torch.where(self._infeasible, 0, counts)
        finite_logits = torch.where(self._infeasible[..., None], 0.0, logits)
        return ExactlyKBernoulli(
            logits=finite_logits,
            k=safe,
            k_max=edges.traced_k_max(self.event_shape[0]),
            validate_args=False,
        )

    @lazy_property
    def _count_log_probs(self) -> torch.Tensor:
        """``log P(K = k)`` of the unconstrained Bernoullis for the stacked counts (``-inf``
        for repeated rows), differentiable."""
        _, in_range = self._counts
        log_p = self._stacked.log_constraint_prob()
        return torch.where(in_range, log_p, torch.full_like(log_p, -torch.inf))

    @lazy_property
    def _edge_tangents(self):
        """(``_OddsTangents`` of the range's normaliser, the count table's extra tangents)
        where given probs hold an exact 0 or 1 and require grad (``_count_edges``), else
        None: the one-sided derivatives there."""
        probs = edges.edge_probs(self.__dict__.get("probs"), self.logits)
        if probs is None:
            return None
        return edges.range_tangents(probs, self.logits, self.low, self.high)

    @lazy_property
    def _log_range_prob(self) -> torch.Tensor:
        """``log P(range)`` less the probs' own ``log(1 - p)`` at 0s and ``log p`` at 1s
        (which every count's probability shares)."""
        log_range = torch.logsumexp(self._count_log_probs, 0)
        if self._edge_tangents is not None:
            log_range = log_range + self._edge_tangents[0].log_normalizer
        return log_range

    @lazy_property
    def _count_weights(self) -> torch.Tensor:
        """``P(K = k | low <= K <= high)`` for the stacked counts."""
        return torch.exp(self._count_log_probs - self._log_range_prob)

    def log_range_prob(self) -> torch.Tensor:
        """``log P(low <= sum z <= high)`` under the unconstrained Bernoullis (the
        Poisson-binomial probability of the range); ``-inf`` where it is impossible."""
        log_range = self._log_range_prob
        if self._edge_tangents is not None:
            log_range = log_range + self._edge_tangents[0].softplus
        return torch.where(self._infeasible, -torch.inf, log_range)

    @property
    def count_distribution(self) -> torch.Tensor:
        """``P(sum z = k)`` under this distribution for k = 0..n, shape ``batch + (n + 1,)``."""
        counts, in_range = self._counts
        n = self.logits.shape[-1]
        weights = torch.where(in_range, self._count_weights, 0.0)
        table = weights.new_zeros(self.batch_shape + (n + 1,))
        table = table.scatter_add(-1, counts.movedim(0, -1), weights.movedim(0, -1))
        if self._edge_tangents is not None:
            table = table + self._edge_tangents[1]
        return table

    @lazy_property
    def _marginal_probs(self) -> torch.Tensor:
        _, in_range = self._counts
        mu = self._stacked.mean
        weights = self._count_weights
        if self._edge_tangents is not None:
            # The tangents' marginals carry the normaliser's share of the derivative at the
            # 0s and 1s: the weights here must not carry it too.
            log_range = torch.logsumexp(self._count_log_probs, 0)
            weights = torch.exp(self._count_log_probs - log_range)
        terms = torch.where(in_range[..., None], weights[..., None] * mu, 0.0)
        mu = terms.sum(0)
        if self._edge_tangents is not None:
            mu = mu + self._edge_tangents[0].marginals
        return torch.where(self._infeasible[..., None], torch.nan, mu)

    @property
    def mean(self) -> torch.Tensor:
        """The conditional marginals ``P(z_i = 1 | low <= sum z <= high)``: the mixture of
        the exactly-k marginals over the counts (the derivative of the log-normaliser)."""
        return self._marginal_probs

    @property
    def variance(self) -> torch.Tensor:
        mu = self._marginal_probs
        return mu * (1 - mu)

    @property
    def mode(self) -> torch.Tensor:
        """The most likely vector: ones at the k largest logits, k the number of positive
        logits clamped into the range (the sum of the top k logits grows while they are
        positive); ties go to the lower index."""
        positive = (self.logits > 0).sum(-1)
        k = torch.minimum(torch.maximum(positive, self._first), self._last)
        order = torch.sort(self.logits, dim=-1, descending=True, stable=True).indices
        ranks = torch.argsort(order, dim=-1)
        return (ranks < k[..., None]).to(self.logits.dtype)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """``log P(z | K = |z|) + log P(K = |z| | range)``: the exact ``ExactlyKBernoulli``
        log-probability of z at its own count plus the log weight of that count; ``-inf``
        outside the support (``ValueError`` with validation on)."""
        if not isinstance(value, torch.Tensor):  # array-likes, as the other classes take
            value = torch.as_tensor(value, device=self.logits.device)
        check_value_shape(
            tuple(value.shape), self.batch_shape, self.event_shape, "CountConstrainedBernoulli"
        )
        if self._validate_args:
            self._validate_sample(value)
        shape = torch.broadcast_shapes(value.shape[:-1], self.batch_shape)
        value = value.expand(shape + self.event_shape)
        total = value.detach().sum(-1)
        binary = ((value == 0) | (value == 1)).all(-1)
        low, high = self._first.expand(shape), self._last.expand(shape)
        inside = binary & (total >= low) & (total <= high) & ~self._infeasible.expand(shape)
        # Outside the support a placeholder count in 0..max(high, 0), whose result is
        # discarded: low itself exceeds high (and may exceed n) where the range is empty.
        placeholder = torch.minimum(low, high).clamp(min=0)
        k = torch.where(inside, total.round().long(), placeholder)
        logits = self.logits.expand(shape + self.event_shape)
        within = ExactlyKBernoulli(
            logits=logits, k=k, k_max=edges.traced_k_max(self.event_shape[0]), validate_args=False
        )
        safe = torch.where(inside[..., None], value, within.mode)
        given_count = within.log_prob(safe)
        # log P(K = k | range): the stacked row of count k.
        row = (k - low).clamp(min=0, max=self._width - 1)
        log_weights = self._count_log_probs - self._log_range_prob
        extra = (1,) * (len(shape) - len(self.batch_shape))
        log_weights = log_weights.reshape((self._width,) + extra + self.batch_shape)
        log_weights = log_weights.expand((self._width,) + shape)
        log_weight = log_weights.gather(0, row[None])[0]
        score = given_count + log_weight
        return torch.where(inside, score, torch.full_like(score, -torch.inf))

    def sample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        """Exact draws: a count from the truncated count distribution, then a k-hot vector
        from ``ExactlyKBernoulli`` at that count."""
        with torch.no_grad():
            return self._draw(torch.Size(sample_shape))

    def _draw(self, sample_shape: torch.Size) -> torch.Tensor:
        if self._infeasible.any():
            raise ValueError(
                "CountConstrainedBernoulli.sample: the constraint is impossible for some batch "
                "element (no count in low..high that the infinite logits allow)"
            )
        counts, _ = self._counts
        weights = self._count_weights.detach().movedim(0, -1)  # batch + (R,)
        # torch.multinomial draws at least one row: an empty sample shape takes none of them.
        draws = sample_shape.numel()
        rows = torch.multinomial(weights.reshape(-1, self._width), max(draws, 1), True)
        rows = rows[:, :draws].T.reshape(sample_shape + self.batch_shape)
        k = counts.movedim(0, -1).expand(sample_shape + counts.shape[1:] + (self._width,))
        k = k.gather(-1, rows[..., None])[..., 0]
        logits = self.logits.detach().expand(sample_shape + self.logits.shape)
        return ExactlyKBernoulli(logits=logits, k=k, validate_args=False).sample()

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        """An exact sample ``z`` with the straight-through gradient of the conditional
        marginals: ``z + (mu - mu.detach())`` (its value is exactly ``z``)."""
        with torch.no_grad():
            z = self._draw(torch.Size(sample_shape))
        mu = self._marginal_probs
        return straight_through_draw(z + (mu - mu.detach()))

    def entropy(self) -> torch.Tensor:
        """``H(K) + sum_k P(k | range) H(z | K = k)`` (z determines its count): the entropy
        of the truncated count law plus the mixture of the exact ``ExactlyKBernoulli``
        entropies."""
        _, in_range = self._counts
        w = self._count_weights
        # 0 at the repeated rows (log weight -inf): a masked 0 * inf has a NaN gradient.
        log_w = torch.where(in_range, self._count_log_probs - self._log_range_prob, 0.0)
        terms = torch.where(in_range, w * (self._stacked.entropy() - log_w), 0.0)
        entropy = terms.sum(0)
        if self._edge_tangents is not None:  # -w log w where a 0 or 1 can move
            tangents = self._edge_tangents[0]
            entropy = entropy + _infinite_slope(tangents.probs, tangents.unbounded)
        return torch.where(self._infeasible, torch.nan, entropy)

    def enumerate_support(self, expand: bool = True) -> torch.Tensor:
        """Every vector of the support once, the counts in increasing order and each count's
        vectors in lexicographic order of the positions of the ones; shape ``(count,) +
        batch_shape + (n,)`` (``expand=True``) or ``(count,) + (1,) * len(batch_shape) +
        (n,)``. Needs one range and the same infinite logits over the batch (else a
        ``ValueError``); above ``max_support`` vectors it is a ``ValueError``."""
        name = type(self).__name__
        n = self.event_shape[0]
        lows, highs = self._first.unique(), self._last.unique()
        flat_on = (self.logits == torch.inf).reshape(-1, n)
        flat_off = (self.logits == -torch.inf).reshape(-1, n)
        same = (flat_on == flat_on[:1]).all() and (flat_off == flat_off[:1]).all()
        if lows.numel() != 1 or highs.numel() != 1 or not same:
            raise ValueError(
                f"{name}.enumerate_support needs one range and the same infinite logits over "
                "the batch (one support)"
            )
        on = torch.nonzero(flat_on[0]).flatten().tolist()
        off = torch.nonzero(flat_off[0]).flatten().tolist()
        free, first, last = n - len(on) - len(off), int(lows), int(highs)
        count = sum(math.comb(free, k - len(on)) for k in range(first, last + 1))
        check_support_size(count, self.max_support, name)
        tables = [k_hot_table(n, k, on, off) for k in range(first, last + 1)]
        values = torch.as_tensor(
            [row for table in tables for row in table.tolist()], dtype=self.logits.dtype
        ).reshape(count, n)
        values = values.reshape((count,) + (1,) * len(self.batch_shape) + self.event_shape)
        if expand:
            values = values.expand((count,) + self.batch_shape + self.event_shape)
        return values

    def expand(self, batch_shape, _instance=None) -> "CountConstrainedBernoulli":
        new = self._get_checked_instance(CountConstrainedBernoulli, _instance)
        batch_shape = torch.Size(batch_shape)
        new.logits = self.logits.expand(batch_shape + self.event_shape)
        if "probs" in self.__dict__:
            new.probs = self.probs.expand(batch_shape + self.event_shape)
        new.low, new.high = self.low.expand(batch_shape), self.high.expand(batch_shape)
        new._first, new._last = self._first.expand(batch_shape), self._last.expand(batch_shape)
        new._infeasible = self._infeasible.expand(batch_shape)
        new._width = self._width
        super(CountConstrainedBernoulli, new).__init__(
            batch_shape, self.event_shape, validate_args=False
        )
        new._validate_args = self._validate_args
        return new

    @classmethod
    def infer_shapes(cls, logits=None, probs=None, low=(), high=()):
        shape = logits if logits is not None else probs
        batch_shape = torch.broadcast_shapes(
            torch.Size(shape[:-1]), torch.Size(low), torch.Size(high)
        )
        return batch_shape, torch.Size(shape[-1:])

    def __repr__(self) -> str:
        return parameters_repr(
            type(self).__name__,
            {"logits": self.logits, "low": self.low, "high": self.high},
            integers=("low", "high"),
        )


@register_kl(CountConstrainedBernoulli, CountConstrainedBernoulli)
def _kl_count_constrained(p: CountConstrainedBernoulli, q: CountConstrainedBernoulli):
    """The chain rule over the count (z determines it): ``KL(P_K || Q_K) + sum_k P(k)
    KL(p(z | k) || q(z | k))``, the second from the exact ``ExactlyKBernoulli`` rule."""
    if p.event_shape != q.event_shape:
        raise ValueError(f"KL needs the same n, got {p.event_shape[0]} and {q.event_shape[0]}")
    # Broadcast batch shapes, as the other classes' KL: the stacked rows below need one.
    batch_shape = torch.broadcast_shapes(p.batch_shape, q.batch_shape)
    p, q = p.expand(batch_shape), q.expand(batch_shape)
    same = torch.equal(*torch.broadcast_tensors(p.low, q.low)) and torch.equal(
        *torch.broadcast_tensors(p.high, q.high)
    )
    # The same stacked counts: the same first and last feasible count in every batch element
    # (the stacked ExactlyKBernoulli pairs need the same k).
    p_counts, q_counts = p._counts[0], q._counts[0]
    if (
        not same
        or p._width != q._width
        or not torch.equal(*torch.broadcast_tensors(p_counts, q_counts))
    ):
        raise ValueError(
            "KL between CountConstrainedBernoulli needs the same bounds (and the same "
            "feasible range under the infinite logits)"
        )
    _, in_range = p._counts
    w = p._count_weights
    log_ratio = (p._count_log_probs - p._log_range_prob) - (q._count_log_probs - q._log_range_prob)
    log_ratio = torch.where(in_range, log_ratio, 0.0)  # as in entropy: no -inf - -inf
    within = kl_divergence(p._stacked, q._stacked)
    terms = torch.where(in_range, w * (log_ratio + within), 0.0)
    kl = terms.sum(0)
    if p._edge_tangents is not None:
        # -H(p)'s infinite slope, or +inf where q has the same infinite logit (moving p's
        # mass onto vectors that q forbids makes the KL infinite).
        tangents = p._edge_tangents[0]
        same = torch.where(q.logits == p.logits, -1.0, 1.0).to(p.logits.dtype)
        kl = kl + _infinite_slope(tangents.probs, -tangents.unbounded * same)
    return torch.where(p._infeasible | q._infeasible, torch.nan, kl)
