"""ExactlyKBernoulli's parameters (Pyro): the constraints it declares (its support
``KHot`` among them), the count rule for ``k``, and the logits of ``probs`` with exact 0 and
1 kept infinite."""

import torch
from torch.distributions import constraints

from constrained_ppl.arguments import check_count
from pyro_constrained.exactly_k_tracing import static_under_trace

# The parameters' checks and the table size are Python numbers read from the logits and k,
# which torch.func.vmap over them cannot provide (docs/numerics.md, "torch.func").
VMAP_OVER_PARAMETERS = (
    "ExactlyKBernoulli checks k against the infinite logits and sizes its tables by the "
    "largest k among the free variables, Python numbers read from k and the logits, which "
    "torch.func.vmap over the logits or k cannot provide: give the distribution the batch "
    "of logits instead (it is batched natively); vmap over log_prob's values works"
)
VMAP_OVER_VALUES = (
    "ExactlyKBernoulli.log_prob checks its value against the infinite logits with a Python "
    "bool, which torch.func.vmap over the values cannot provide: construct the distribution "
    "with validate_args=False to vmap log_prob"
)


class _ExtendedReal(constraints.Constraint):
    """The extended real line [-inf, +inf]: anything but NaN (infinite logits force a
    variable off or on)."""

    def check(self, value: torch.Tensor) -> torch.Tensor:
        return value == value


class KHot(constraints.Constraint):
    """0/1 vectors (last dimension) with exactly ``k`` ones; ``k`` broadcasts with the batch."""

    is_discrete = True
    event_dim = 1

    def __init__(self, k: torch.Tensor):
        self.k = k
        super().__init__()

    def check(self, value: torch.Tensor) -> torch.Tensor:
        binary = ((value == 0) | (value == 1)).all(-1)
        # Counted as integers: cast to a boolean value's dtype, k = 2 would become True.
        return binary & (value.sum(-1) == self.k)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self.k})"


def _as_k(k, logits: torch.Tensor) -> torch.Tensor:
    """``k`` as a long tensor, after the count rule of ``check_count`` (an int, an integer
    tensor, or whole-number floats; 3.5, bools, complex numbers and NaN are a
    ``ValueError``). Torch values are always concrete, so a float k is checked entry by
    entry and its whole numbers converted exactly."""
    check_count(k, concrete=True, name="k")
    if isinstance(k, torch.Tensor):
        return k.to(device=logits.device, dtype=torch.long)
    with static_under_trace():  # a Python number is a constant of the trace
        return torch.as_tensor(k, device=logits.device).to(torch.long)


def _logits_from_probs(probs: torch.Tensor) -> torch.Tensor:
    # Exact 0 and 1 map to -inf and +inf (torch's probs_to_logits clamps them instead), and
    # invalid probs to NaN. The log is taken of interior probs only (the other branch of
    # the where gets 1/2): log(0)'s infinite derivative times a zero cotangent would be NaN.
    # The derivative at an exact 0 or 1 is supplied by _OddsTangents instead.
    interior = (probs > 0) & (probs < 1)
    safe = torch.where(interior, probs, 0.5)
    logits = torch.log(safe) - torch.log1p(-safe)
    edge = torch.where(probs == 0, -torch.inf, torch.where(probs == 1, torch.inf, torch.nan))
    return torch.where(interior, logits, edge.to(logits.dtype))


class _ArgConstraints(dict):
    """``arg_constraints`` as a dict (as torch and Pyro read a class's) that, read from an
    instance, declares ``k``'s exact range ``integer_interval(0, min(n, k_max))``: the range
    the constructor checks, which depends on the instance's n. So every ``k`` that satisfies
    the declared constraint is accepted, and torch's validation and the constructor's check
    agree. Read from the class (no n yet), ``k`` is a ``nonnegative_integer``."""

    def __get__(self, instance, owner=None):
        event_shape = None if instance is None else instance.__dict__.get("_event_shape")
        if not event_shape:
            return self
        k_max = instance.__dict__.get("k_max")
        bound = event_shape[0] if k_max is None else min(event_shape[0], k_max)
        return {**self, "k": constraints.integer_interval(0, bound)}
