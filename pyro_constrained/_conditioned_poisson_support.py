"""The supports of ``ConditionedPoisson``: its rates (`positive_finite`) and its values
(`integer_composition`, integer vectors with an exact sum)."""

from __future__ import annotations

import torch
from torch.distributions import constraints

from constrained_ppl.exact_integers import largest_exact_integer
from pyro_constrained._conditioned_poisson_tracing import static_under_trace

__all__ = ["integer_composition", "positive_finite"]


class _PositiveFinite(constraints.Constraint):
    """Real numbers in (0, inf): ``constraints.positive`` lets ``inf`` through."""

    def check(self, value: torch.Tensor) -> torch.Tensor:
        return (value > 0) & torch.isfinite(value)

    def __repr__(self) -> str:
        return "PositiveFinite()"


positive_finite = _PositiveFinite()


class _IntegerComposition(constraints.Constraint):
    """Integer vectors ``z >= 0`` (last dimension) with ``sum(z) == total`` exactly.

    ``torch.distributions.constraints.multinomial`` only checks ``sum(z) <= total``.
    """

    is_discrete = True
    event_dim = 1

    def __init__(self, total: torch.Tensor | int) -> None:
        self.total = total
        super().__init__()

    def check(self, value: torch.Tensor) -> torch.Tensor:
        return _is_integer_composition(value, self.total)[0]

    def __repr__(self) -> str:
        return f"IntegerComposition(total={self.total})"


integer_composition = _IntegerComposition


def _is_integer_composition(
    value: torch.Tensor, total: torch.Tensor | int, total_bound: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether each vector (last dimension) of ``value`` is in the support, and whether all
    its entries are ``>= 0``.

    Exact for any dtype of ``value``: a float sum that rounds (``2**24 - 1 + 1 + 1`` is
    ``2**24`` in float32) cannot pass for ``total``. Floats are summed as they are where
    ``total`` is below ``2**m`` (``m`` their significand bits), else, like integers,
    checked to lie in ``[0, total]`` and summed as int64. ``total_bound``: a static bound
    on ``total`` (a Python int, what the distribution sizes its tables by), else read from
    ``total``, a constant under ``torch.jit.trace``.
    """
    if not isinstance(total, torch.Tensor):
        total = torch.as_tensor(total, device=value.device)
    is_nonnegative = value >= 0
    entry_ok = is_nonnegative
    if value.is_floating_point():
        # frac is NaN for +-inf and NaN, which then fail the test.
        entry_ok = entry_ok & (torch.frac(value) == 0)
        if total_bound is None:
            with static_under_trace():
                total_bound = int(total.max()) if total.numel() else 0
        if total_bound < largest_exact_integer(str(value.dtype)):
            # Non-negative integers with a true sum up to 2**m are summed exactly in any
            # order; a larger true sum rounds to at least 2**m > total. So the float sum
            # tells exactly whether the sum is total.
            in_support = entry_ok.all(-1) & (value.sum(-1) == total)
            return in_support, is_nonnegative.all(-1)
    entry_ok = entry_ok & (value <= total.unsqueeze(-1))
    # Entries in [0, total], total <= 2**53: the cast is exact and the int64 sum cannot
    # overflow below 1024 entries; beyond, a sum that wrapped is far above total as a float.
    counts = torch.where(entry_ok, value, 0)
    in_support = entry_ok.all(-1) & (counts.long().sum(-1) == total.long())
    if value.shape[-1] >= 1024:
        in_support &= counts.double().sum(-1) <= 2 * total.double() + 1
    return in_support, is_nonnegative.all(-1)
