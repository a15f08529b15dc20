"""PoissonBinomial: the number of ones among independent Bernoullis.

The math: ``docs/distributions/poisson_binomial.md``.

Built on the exactly-k kernels (:mod:`pyro_constrained.exactly_k_kernels`): ``P(K = k)`` is
``e_k(exp theta) / prod_i (1 + exp theta_i)``, and the kernels compute ``e_k`` exactly in
O(n log^2 n) after tilting the logits so that the expected count is k. Two ways to use them:

* one count at a time (``log_prob``): one tilted upward pass per count asked for, the
  kernels' ``log_constraint_prob_value`` (exact for any count, the far tails included), with
  the gradient ``d log P(K = k) / d theta = mu^(k) - sigmoid(theta)``, ``mu^(k)`` the
  exactly-k marginals (the kernels' ``log_normalizer`` carries them);
* every count (``log_pmf``, and ``cdf``, ``entropy``, KL from it): tilted windows. One
  upward pass tilted to a count t gives the root table of the tilted count distribution,
  whose entries are accurate relative to the table's largest entry (FFT rounding) and so
  relatively accurate where they are at least ``_WINDOW`` times that entry: a window of
  about ``+-3.7 sqrt(V_t)`` counts around t (``V_t`` the tilted count variance). Passes
  tilted to successive targets cover the counts from 0 up to the middle, and the same on the
  flipped logits (counting zeros) from n down; a pass only needs tables up to its window's
  top, so the tails cost O(n t) each on the direct sums. About ``0.4 sqrt(n)`` passes for
  spread-out logits, each O(n log^2 n) in the middle: the whole pmf costs
  O(n^1.5 log^2 n). When the logits require a gradient, ``log_pmf`` takes the per-count
  path for every count instead (exact values and gradients, O(n^2 log^2 n): for moderate n).
"""

import math

import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints
from torch.distributions.kl import register_kl
from torch.distributions.utils import lazy_property

from constrained_ppl.arguments import check_value_shape
from pyro_constrained import _count_edges as edges
from pyro_constrained import exactly_k_kernels as kernels
from pyro_constrained._autograd import is_differentiated
from pyro_constrained._bernoulli_arguments import (
    LOGITS_PROBS_CONSTRAINTS,
    forced_counts,
    logits_argument,
)
from pyro_constrained._ekb_terms import _infinite_slope
from pyro_constrained._repr import parameters_repr
from pyro_constrained.exactly_k_bernoulli import _softplus
from pyro_constrained.exactly_k_tracing import static_under_trace

__all__ = ["PoissonBinomial"]

# A root entry at least this fraction of its table's largest entry keeps its relative
# precision to about eps / _WINDOW (FFT rounding is relative to the largest entry; the
# direct sums are exact for every entry the window admits), times a factor that grows slowly
# with the number of FFT levels (benchmarks/README.md).
_WINDOW = 1e-3
# An entry j of a pass tilted by c to the target t carries a rounding error of about
# eps |c (j - t)| in log P (the tilt is rounded into every tilted logit and taken out again
# as c j): entries beyond this bound on |c (j - t)| are left to other passes (the target
# itself is always admitted). Matters only for huge tilts (logits such as +-1e4 or +-1e9).
_TILT_SPAN = 1024.0
# Rows of the per-count path per kernel call: about this many logits (memory of the tables).
_PER_COUNT_ENTRIES = 2**20


def _flipped(theta: torch.Tensor) -> torch.Tensor:
    """The logits of the zeros: ``-theta`` for the finite ones, ``-inf`` (excluded) stays."""
    return torch.where(theta > -torch.inf, -theta, theta)


def _tilted_variance(theta: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    x = theta + kernels.tilt(theta, target)
    return (torch.sigmoid(x) * torch.sigmoid(-x)).sum(-1)


def _half_pmf(theta: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """``log P(K = j)`` for ``j <= half`` (per row; ``-inf`` above), kernel logits ``theta``
    (rows, n) float64, by tilted windows from the bottom up (module docstring)."""
    rows, n = theta.shape
    device = theta.device
    out = torch.full((rows, n + 1), -torch.inf, dtype=torch.float64, device=device)
    best = torch.full((rows, n + 1), -1.0, dtype=torch.float64, device=device)
    counts = torch.arange(n + 1, device=device)
    needed = counts[None, :] <= half[:, None]
    target = torch.zeros(rows, dtype=torch.long, device=device)
    # a window's upper half-width, in counts
    reach = torch.zeros(rows, dtype=torch.long, device=device)
    active = half >= 0
    while bool(active.any()):
        index = active.nonzero()[:, 0]
        t = target[index]
        top = torch.minimum(half[index], t + (6.0 * torch.sqrt(t + 1.0)).long() + 8)
        spread = _tilted_variance(theta[index], t) >= 4.0
        # The kernels take the FFT path only if every row of a call may: calls split by it.
        for group in (spread, ~spread):
            if not bool(group.any()):
                continue
            rows_g = index[group]
            k_max = max(1, int(top[group].max()))
            table = kernels.count_log_probs(theta[rows_g], t[group], k_max)
            log_p, ratio, c = table.log_probs, table.relative, table.tilt
            width = log_p.shape[-1]
            j = torch.arange(width, device=device)
            span = (c[:, None] * (j[None, :] - t[group][:, None])).abs() <= _TILT_SPAN
            accept = ((ratio >= _WINDOW) & span) | (j[None, :] == t[group][:, None])
            better = accept & (ratio > best[rows_g, :width]) & needed[rows_g, :width]
            out[rows_g, :width] = torch.where(better, log_p, out[rows_g, :width])
            best[rows_g, :width] = torch.where(better, ratio, best[rows_g, :width])
            above = torch.where(accept & (j[None, :] >= t[group][:, None]), j, -1).amax(-1)
            reach[rows_g] = (above - t[group]).clamp(min=0)
        covered = (best >= 0) | ~needed
        first = torch.where(covered[index], n + 1, counts).amin(-1)
        done = first > half[index]
        # Aim the next pass so that its window reaches down to the first uncovered count; if
        # the last pass fell short of it, aim at it (a pass always covers its target).
        fell_short = first < t
        step = torch.where(fell_short, 0, (0.8 * reach[index]).long())
        target[index] = torch.minimum(first + step, half[index]).clamp(min=0)
        active[index] = ~done
    return out


def log_pmf_by_windows(theta: torch.Tensor) -> torch.Tensor:
    """``log P(K = j)``, j = 0..n, (rows, n + 1) float64, for kernel logits ``theta`` (rows,
    n) (``-inf`` excluded; no ``+inf``), no gradient."""
    with torch.no_grad():
        theta = theta.detach().to(torch.float64)
        rows, n = theta.shape
        if n == 0:  # no Bernoullis: K = 0
            return theta.new_zeros((rows, 1))
        m = (theta > -torch.inf).sum(-1)
        low_half = m // 2
        both = torch.cat([theta, _flipped(theta)])
        halves = _half_pmf(both, torch.cat([low_half, m - low_half - 1]))
        low, high = halves.chunk(2)
        # Count j > m // 2 is m - j zeros of the flipped logits.
        j = torch.arange(n + 1, device=theta.device)
        zeros = (m[:, None] - j).clamp(min=0, max=n)
        from_high = high.gather(-1, zeros)
        use_high = (j[None, :] > low_half[:, None]) & (j[None, :] <= m[:, None])
        return torch.where(use_high, from_high, low)


def log_pmf_by_counts(theta: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``log P(K = k)`` for kernel logits ``theta`` (rows, n) and counts ``k`` (rows,) with
    ``0 <= k <= m`` (the number of finite logits): one tilted pass per row, counts above
    ``m / 2`` as zeros of the flipped logits (smaller tables). Computed in float64 (a
    float32 table leaves ``log P`` near the mode a relative error of up to ``n eps``, see
    ``ExactlyKBernoulli.log_constraint_prob``); the value is the kernels' exact
    ``log_constraint_prob_value``, its gradient that of ``log e_k - sum softplus``."""
    dtype = theta.dtype
    theta = theta.to(torch.float64)
    m = (theta > -torch.inf).sum(-1)
    flip = k > m - k
    logits = torch.where(flip[:, None], _flipped(theta), theta)
    count = torch.where(flip, m - k, k)
    with static_under_trace():  # sizes, which a trace fixes
        rows, n = (int(size) for size in theta.shape)
    out = theta.new_zeros(rows)
    if rows == 0 or n == 0:  # no Bernoullis: log P(K = 0) = 0
        return out.to(dtype)
    if torch.jit.is_tracing():
        # A trace fixes the Python control flow: one call for every row with tables of
        # n // 2 (the largest count after the flip), as NumPyro's, not the first call's
        # groups and largest count.
        return _log_pmf_rows(logits, count, n // 2).to(dtype)
    # The kernels take the FFT path only if every row of a call may: rows whose tilted count
    # distribution is nearly deterministic go separately (direct sums, O(n k)).
    with torch.no_grad():
        spread = _tilted_variance(logits.detach(), count) >= 4.0
    chunk = max(1, _PER_COUNT_ENTRIES // max(n, 1))
    for group in (spread, ~spread):
        index = group.nonzero()[:, 0]
        for start in range(0, index.numel(), chunk):
            rows_c = index[start : start + chunk]
            x, c = logits[rows_c], count[rows_c]
            out = out.index_put((rows_c,), _log_pmf_rows(x, c, int(c.max())))
    return out.to(dtype)


def _log_pmf_rows(x: torch.Tensor, c: torch.Tensor, k_max: int) -> torch.Tensor:
    """``log P(K = c)`` per row of kernel logits ``x`` (float64), ``c <= k_max``: the kernels'
    exact value with the gradient of ``log e_c - sum softplus``."""
    parts = kernels.normalizer_parts(x, c, k_max)
    exact = kernels.log_constraint_prob_value(x, c, parts)
    softplus = torch.where(x > -torch.inf, _softplus(x), 0.0).sum(-1)
    formula = kernels.log_normalizer(x, c, k_max, parts) - softplus
    return exact + (formula - formula.detach())


def _with_tangents(log_table: torch.Tensor, tangents: torch.Tensor) -> torch.Tensor:
    """``log(P + dP)`` to first order where ``log P`` is finite: ``dP / P`` added."""
    finite = torch.isfinite(log_table)
    scale = torch.where(finite, log_table, 0.0).detach().exp()
    return torch.where(finite, log_table + tangents / scale, log_table)


class PoissonBinomial(TorchDistribution):
    r"""The number of ones ``K = sum_i z_i`` among independent ``z_i ~
    Bernoulli(sigmoid(logits_i))``: the Poisson-binomial distribution,

    .. math:: P(K = k) = e_k(\exp\theta) / \prod_i (1 + \exp\theta_i),

    ``e_k`` the k-th elementary symmetric polynomial. Batch shape ``logits.shape[:-1]``,
    event shape ``()``, support ``0..n``. A logit of ``+inf`` (``probs = 1``) is always one,
    ``-inf`` (``probs = 0``) never: counts they rule out have probability 0.

    **Numerics.** ``log_prob`` of every count, the far tails included, keeps the relative
    precision of the working dtype for logits of any size (no floor at 1e-17, no clamping):
    each count is computed from the exactly-k kernels tilted to that count, in float64
    whatever the logits' dtype. ``log_prob`` costs one O(n log^2 n) pass per count asked
    for (n = 1e6 works); ``log_pmf`` (all counts) and what is built on it (``cdf``,
    ``log_cdf``, ``log_survival_function``, ``entropy``, ``mode``, KL) cost about
    ``0.4 sqrt(n)`` passes when the logits need no gradient, and one pass per count when
    they do or under ``torch.jit.trace`` (moderate n only). The entries of ``log_pmf`` are
    accurate to about 1e-13 relative in float64 near each pass's target, 1e-12 at the edges
    of its window (the numbers: benchmarks/README.md), and to float32's rounding of
    ``log P`` in float32.

    :param logits: log-odds, shape ``batch + (n,)``; entries may be ``+-inf``.
    :param probs: probabilities in [0, 1] instead of logits (exactly one of the two).

    ``log_prob`` of a value outside ``0..n`` or not a whole number is a ``ValueError`` with
    validation on and ``-inf`` without; a value whose shape does not broadcast with the batch
    shape is a ``ValueError`` always.

    Examples
    --------
    >>> import torch
    >>> from pyro_constrained import PoissonBinomial
    >>> d = PoissonBinomial(probs=torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    >>> [round(p, 4) for p in d.log_prob(torch.arange(4.0)).exp().tolist()]
    [0.045, 0.455, 0.455, 0.045]
    >>> float(d.mean), round(float(d.variance), 4)
    (1.5, 0.43)
    """

    arg_constraints = LOGITS_PROBS_CONSTRAINTS
    has_enumerate_support = True

    def __init__(
        self,
        logits: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        *,
        validate_args: bool | None = None,
    ):
        self.logits, given_probs = logits_argument(logits, probs, "PoissonBinomial")
        if given_probs is not None:
            self.probs = given_probs
        # Exact 0s and 1s of given probs get their one-sided derivatives (_count_edges).
        self._from_probs = given_probs is not None
        super().__init__(self.logits.shape[:-1], torch.Size(), validate_args=validate_args)

    @property
    def total_count(self) -> int:
        """n, the number of Bernoullis."""
        return self.logits.shape[-1]

    @constraints.dependent_property(is_discrete=True, event_dim=0)
    def support(self) -> constraints.Constraint:
        return constraints.integer_interval(0, self.total_count)

    @lazy_property
    def probs(self) -> torch.Tensor:
        return torch.sigmoid(self.logits)

    @lazy_property
    def _forced_on(self) -> torch.Tensor:
        return forced_counts(self.logits)[0]

    @lazy_property
    def _kernel_logits(self) -> torch.Tensor:
        """The logits with the always-on Bernoullis removed (-inf), as the kernels want."""
        return torch.where(self.logits == torch.inf, -torch.inf, self.logits)

    @lazy_property
    def _num_free(self) -> torch.Tensor:
        return torch.isfinite(self.logits).sum(-1)

    @property
    def _edge_probs(self) -> torch.Tensor | None:
        """The given probs where their exact 0s and 1s need one-sided derivatives."""
        given = self.probs if self._from_probs else None
        return edges.edge_probs(given, self.logits)

    @property
    def mean(self) -> torch.Tensor:
        p = torch.where(torch.isfinite(self.logits), torch.sigmoid(self.logits), 0.0)
        mean = p.sum(-1) + self._forced_on.to(self.logits.dtype)
        probs = self._edge_probs
        if probs is not None:  # d mean / d p_i = 1 at a 0 or 1 too
            mean = mean + torch.where(torch.isfinite(self.logits), 0.0, probs - probs.detach()).sum(
                -1
            )
        return mean

    @property
    def variance(self) -> torch.Tensor:
        # sigmoid(x) sigmoid(-x), not p (1 - p): no cancellation for p near 1.
        on, off = torch.sigmoid(self.logits), torch.sigmoid(-self.logits)
        variance = torch.where(torch.isfinite(self.logits), on * off, 0.0).sum(-1)
        probs = self._edge_probs
        if probs is not None:  # p (1 - p) is 0 at a 0 or 1, with slope 1 - 2 p
            edge = torch.where(torch.isfinite(self.logits), 0.0, probs * (1 - probs))
            variance = variance + edge.sum(-1)
        return variance

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """``log P(K = value)``: exact to the working precision for any count (one tilted
        pass of the kernels per entry of the broadcast value); ``-inf`` for counts the
        infinite logits rule out. Differentiable in the logits."""
        value = torch.as_tensor(value, device=self.logits.device)
        if value.dtype == torch.bool:  # counts 0 and 1 (torch has no floor of a bool)
            value = value.to(self.logits.dtype)
        check_value_shape(tuple(value.shape), self.batch_shape, (), "PoissonBinomial.log_prob")
        if self._validate_args:
            self._validate_sample(value)
        n = self.total_count
        shape = torch.broadcast_shapes(value.shape, self.batch_shape)
        value = value.expand(shape)
        whole = (value == torch.floor(value)) & (value >= 0) & (value <= n)
        count = torch.where(whole, value, 0).long() - self._forced_on
        possible = whole & (count >= 0) & (count <= self._num_free)
        count = torch.minimum(count.clamp(min=0), self._num_free.expand(shape))
        theta = self._kernel_logits.expand(shape + (n,)).reshape(shape.numel(), n)
        log_p = log_pmf_by_counts(theta, count.reshape(-1)).reshape(shape)
        probs = self._edge_probs
        if probs is not None:
            total = torch.where(possible, value, self._forced_on).long()
            log_p = log_p + edges.count_log_terms(probs, total)
        # In the dtype the logits and the value promote to, as torch's Binomial.
        log_p = log_p.to(torch.promote_types(log_p.dtype, value.dtype))
        return torch.where(possible, log_p, torch.full_like(log_p, -torch.inf))

    def log_pmf(self) -> torch.Tensor:
        """``log P(K = j)`` for every count j = 0..n, shape ``batch + (n + 1,)``, in the
        logits' dtype; differentiable in the logits (then one kernel pass per count)."""
        n = self.total_count
        rows = self.batch_shape.numel()
        theta = self._kernel_logits.reshape(rows, n)
        # Under torch.jit.trace the windows' passes (Python loops on values) would freeze:
        # the per-count path, whose control flow a trace fixes, as under differentiation.
        if is_differentiated(self.logits) or torch.jit.is_tracing():
            j = torch.arange(n + 1, device=theta.device).expand(rows, n + 1)
            free = self._num_free.reshape(-1, 1)
            theta_rows = theta.repeat_interleave(n + 1, dim=0)
            counts = torch.minimum(j, free).reshape(-1)
            log_p = log_pmf_by_counts(theta_rows, counts).reshape(rows, n + 1)
            log_p = torch.where(j <= free, log_p, torch.full_like(log_p, -torch.inf))
        else:
            log_p = log_pmf_by_windows(theta).to(self.logits.dtype)
        # The always-on Bernoullis shift the count.
        shift = self._forced_on.reshape(-1, 1)
        j = torch.arange(n + 1, device=shift.device)[None, :] - shift
        shifted = log_p.gather(-1, j.clamp(min=0))
        shifted = torch.where(j >= 0, shifted, torch.full_like(shifted, -torch.inf))
        shifted = shifted.reshape(self.batch_shape + (n + 1,))
        probs = self._edge_probs
        if probs is not None:
            counts = torch.arange(n + 1, device=probs.device)
            terms = edges.count_log_terms(probs[..., None, :], counts)
            shifted = torch.where(torch.isfinite(shifted), shifted + terms, shifted)
        return shifted

    def _cumulative_tangents(self, log_pmf: torch.Tensor, reverse: bool) -> torch.Tensor | None:
        """Zeros carrying the derivatives of ``P(K <= j)`` (``P(K >= j)`` with ``reverse``)
        that the counts impossible at the point contribute (``_count_edges``)."""
        probs = self._edge_probs
        if probs is None:
            return None
        tangents = edges.new_count_tangents(probs, log_pmf)
        if reverse:
            return tangents.flip(-1).cumsum(-1).flip(-1)
        return tangents.cumsum(-1)

    def _log_cdf_table(self) -> torch.Tensor:
        log_pmf = self.log_pmf()
        table = torch.logcumsumexp(log_pmf, -1)
        tangents = self._cumulative_tangents(log_pmf, reverse=False)
        if tangents is not None:
            table = _with_tangents(table, tangents)
        return table

    def _at(
        self, table: torch.Tensor, value: torch.Tensor, name: str, below: float = -math.inf
    ) -> torch.Tensor:
        """``table[..., floor(value)]`` broadcast over the value's sample dimensions (counts
        below 0 read ``below``, above n the last entry); ``table`` holds the counts 0..n."""
        value = torch.as_tensor(value, device=self.logits.device, dtype=self.logits.dtype)
        check_value_shape(tuple(value.shape), self.batch_shape, (), f"PoissonBinomial.{name}")
        if self._validate_args and bool(torch.isnan(value).any()):
            raise ValueError(f"PoissonBinomial.{name}: value is NaN")
        shape = torch.broadcast_shapes(value.shape, self.batch_shape)
        n = self.total_count
        # A NaN value reads NaN (validation off), not an index cast from NaN.
        nan = torch.isnan(value)
        index = torch.floor(torch.where(nan, 0.0, value)).clamp(min=-1, max=n).long() + 1
        padded = torch.cat([torch.full_like(table[..., :1], below), table], -1)
        padded = padded.expand(shape + padded.shape[-1:])
        result = padded.gather(-1, index.expand(shape)[..., None])[..., 0]
        return torch.where(nan, torch.nan, result)

    def log_cdf(self, value: torch.Tensor) -> torch.Tensor:
        """``log P(K <= value)``, relatively exact in the lower tail."""
        return self._at(self._log_cdf_table(), value, "log_cdf")

    def cdf(self, value: torch.Tensor) -> torch.Tensor:
        """``P(K <= value)``."""
        log_pmf = self.log_pmf()
        table = torch.logcumsumexp(log_pmf, -1).exp()
        tangents = self._cumulative_tangents(log_pmf, reverse=False)
        if tangents is not None:  # P(K <= first - 1) is 0 with a nonzero slope
            table = table + tangents
        return self._at(table, value, "cdf", below=0.0)

    def log_survival_function(self, value: torch.Tensor) -> torch.Tensor:
        """``log P(K > value)``, relatively exact in the upper tail."""
        log_pmf = self.log_pmf()
        reverse = torch.logcumsumexp(log_pmf.flip(-1), -1).flip(-1)
        tangents = self._cumulative_tangents(log_pmf, reverse=True)
        if tangents is not None:
            reverse = _with_tangents(reverse, tangents)
        # P(K > j) = P(K >= j + 1): shift left by one, P(K > n) = 0.
        table = torch.cat([reverse[..., 1:], torch.full_like(reverse[..., :1], -torch.inf)], -1)
        value = torch.as_tensor(value, device=self.logits.device, dtype=self.logits.dtype)
        below = torch.zeros((), dtype=table.dtype, device=table.device)
        result = self._at(table, value, "log_survival_function")
        return torch.where(value < 0, below, result)

    def entropy(self) -> torch.Tensor:
        """``-sum_k P(K = k) log P(K = k)`` from ``log_pmf``."""
        log_p = self.log_pmf()
        p = torch.exp(log_p)
        entropy = -torch.where(p > 0, p * log_p, 0.0).sum(-1)
        probs = self._edge_probs
        if probs is not None:  # a new count's -w log w: an infinite slope
            entropy = entropy + _infinite_slope(probs, edges.unbounded(probs))
        return entropy

    @property
    def mode(self) -> torch.Tensor:
        """The most likely count (the smaller of two tied ones)."""
        return self.log_pmf().argmax(-1).to(self.logits.dtype)

    def sample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        """Exact draws: the sum of independent Bernoulli draws (O(n) per draw)."""
        shape = self._extended_shape(torch.Size(sample_shape))
        with torch.no_grad():
            probs = self.probs.detach().expand(shape + (self.total_count,))
            return torch.bernoulli(probs).sum(-1)

    def enumerate_support(self, expand: bool = True) -> torch.Tensor:
        """The counts 0..n, shape ``(n + 1,) + batch_shape`` (``expand=True``) or
        ``(n + 1,) + (1,) * len(batch_shape)``, as ``torch.distributions.Binomial``."""
        values = torch.arange(
            self.total_count + 1, dtype=self.logits.dtype, device=self.logits.device
        )
        values = values.reshape((-1,) + (1,) * len(self.batch_shape))
        if expand:
            values = values.expand((-1,) + self.batch_shape)
        return values

    def expand(self, batch_shape, _instance=None) -> "PoissonBinomial":
        new = self._get_checked_instance(PoissonBinomial, _instance)
        batch_shape = torch.Size(batch_shape)
        new.logits = self.logits.expand(batch_shape + self.logits.shape[-1:])
        if "probs" in self.__dict__:
            new.probs = self.probs.expand(batch_shape + self.logits.shape[-1:])
        new._from_probs = self._from_probs
        super(PoissonBinomial, new).__init__(batch_shape, torch.Size(), validate_args=False)
        new._validate_args = self._validate_args
        return new

    @classmethod
    def infer_shapes(cls, logits=None, probs=None):
        shape = logits if logits is not None else probs
        return torch.Size(shape[:-1]), torch.Size()

    def __repr__(self) -> str:
        return parameters_repr(type(self).__name__, {"logits": self.logits})


@register_kl(PoissonBinomial, PoissonBinomial)
def _kl_poisson_binomial(p: PoissonBinomial, q: PoissonBinomial) -> torch.Tensor:
    """``sum_k P(k) (log P(k) - log Q(k))`` over the counts (no closed form); ``+inf``
    where p puts mass on a count q rules out."""
    n_p, n_q = p.total_count, q.total_count
    log_p, log_q = p.log_pmf(), q.log_pmf()
    if n_p < n_q:
        log_p = torch.cat([log_p, log_p.new_full(log_p.shape[:-1] + (n_q - n_p,), -math.inf)], -1)
    elif n_q < n_p:
        log_q = torch.cat([log_q, log_q.new_full(log_q.shape[:-1] + (n_p - n_q,), -math.inf)], -1)
    log_p, log_q = torch.broadcast_tensors(log_p, log_q)
    mass = torch.exp(log_p)
    terms = torch.where(mass > 0, mass * (log_p - log_q), 0.0)
    kl = terms.sum(-1)
    probs = p._edge_probs
    if probs is not None:
        # Moving p's 0 (1) gives mass to the count just above (below) p's range: -w log w,
        # an infinite slope down, unless q rules that count out (the KL becomes infinite).
        n = p.total_count
        last = (n - (probs == 0).sum(-1, keepdim=True)) + 1
        first = (probs == 1).sum(-1, keepdim=True) - 1
        shape = log_q.shape[:-1] + (1,)
        padded = torch.cat(
            [log_q.new_full(shape, -math.inf), log_q, log_q.new_full(shape, -math.inf)], -1
        )
        q_above = padded.gather(-1, (last + 1).expand(shape)) > -math.inf
        q_below = padded.gather(-1, (first + 1).expand(shape)) > -math.inf
        # Tensors on both sides: a traced aten::where takes no Python bool.
        opens = torch.where(probs == 1, q_below, torch.ones_like(q_below))
        opens = torch.where(probs == 0, q_above, opens)
        direction = edges.unbounded(probs) * torch.where(opens, -1.0, 1.0).to(probs.dtype)
        kl = kl + _infinite_slope(probs, direction)
    return kl
