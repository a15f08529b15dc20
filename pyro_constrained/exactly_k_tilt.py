"""The tilt of the torch exactly-k kernels: a constant c per row with expected tilted count
about k (docs/numerics.md, "The exactly-k kernels"). The constants are shared with the JAX
kernels (``constrained_ppl.exactly_k_design``)."""

import torch

from constrained_ppl import exactly_k_design as design
from pyro_constrained.exactly_k_tracing import _static_control_flow

# The framework-free constants, with the reason for each value, live in one place for both
# packages.
_TILT_STEPS = design.TILT_STEPS
_TILT_TOLERANCE = design.TILT_TOLERANCE
_TILT_FLAT = design.TILT_FLAT
_TILT_MAX_STEPS = design.TILT_MAX_STEPS
_TILT_TRACED_STEPS = design.TILT_TRACED_STEPS


def tilt(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A constant c per batch element (shape ``batch + (1,)``, no gradient) with
    ``sum_i sigmoid(logits_i + c) ~= k``, for any finite logits however large.

    Newton's method on ``g(c) = log f(c) - log(n - f(c))``, f the expected count: g is
    increasing and close to linear with slope 1 in both tails (where Newton on f itself
    crawls). ``n - f`` counts each ``-inf`` logit (never on) as off, so no mask is needed.
    Steps that leave a bracket that provably holds the root are replaced by bisection, and
    the iteration stops once every step is below ``_TILT_TOLERANCE`` (usually after 2 or 3
    steps from the bracket ``[logit(t/m) - max x, logit(t/m) - min x]``, m the number of
    finite logits). That bracket is as wide as the spread of the logits: with masked logits
    (-1e4, -1e9) bisection cannot narrow it in a few steps, and inside a wide gap between
    the logits f is constant to working precision, so Newton may stop anywhere in the gap.
    Rows where either can have happened restart from order statistics (``_restart_tilt``).
    The target count t is clamped to [1/2, m - 1/2] because the exact solution is infinite
    for k = 0 and k = m; any finite c leaves the distribution unchanged, and the tables
    only need c roughly right.
    """
    with torch.no_grad():
        logits = logits.detach()
        finite = logits > -torch.inf  # the caller allows no +inf or NaN
        num_finite = finite.sum(-1, keepdim=True).to(logits.dtype)
        target = _tilt_target(k, num_finite)
        m = num_finite.clamp(min=1.0)
        largest = logits.amax(-1, keepdim=True)
        smallest = torch.where(finite, logits, torch.inf).amin(-1, keepdim=True)
        center = torch.log(target) - torch.log(m - target)
        low = torch.where(num_finite > 0, center - largest, 0.0)
        high = torch.where(num_finite > 0, center - smallest, 0.0)
        c, settled = _newton(logits, target, low, high, 0.5 * (low + high), _TILT_STEPS)
        unsettled = ~settled & (num_finite[:, 0] > 1)
        if _static_control_flow():
            # Every row restarts and keeps the restart where it did not settle: the same
            # values as below, without reading the mask in Python (a trace would replay
            # the first call's choice for every later input).
            restarted = _restart_tilt(logits, target, num_finite, _TILT_TRACED_STEPS)
            return torch.where(unsettled[:, None], restarted, c)
        if bool(unsettled.any()):
            rows = unsettled.nonzero()[:, 0]
            restarted = _restart_tilt(logits[rows], target[rows], num_finite[rows])
            # Out of place: c flows to the outputs (see _in_place_allowed).
            c = c.index_put((rows,), restarted)
        return c


def _tilt_target(k: torch.Tensor, num_finite: torch.Tensor) -> torch.Tensor:
    m = num_finite.clamp(min=1.0)
    target = torch.minimum(k.to(num_finite.dtype)[..., None].clamp(min=0.5), m - 0.5)
    return target.clamp(min=0.25)  # m = 1: any c in a wide range will do


def _newton(logits, target, low, high, c, max_steps: int):
    """Safeguarded Newton steps on g (see ``tilt``) from ``c`` inside ``[low, high]``.
    Returns (c, settled): settled rows took a last step below ``_TILT_TOLERANCE`` at a
    count variance of at least ``_TILT_FLAT``."""
    n = logits.shape[-1]
    goal = torch.log(target) - torch.log(n - target)
    # One buffer for all steps (fresh multi-megabyte tensors cost page faults); sums in
    # float64, so that n - f keeps its precision when f is close to n.
    # Out of place under torch.jit.trace (see _in_place_allowed).
    tracing = _static_control_flow()
    on = None if tracing else torch.empty_like(logits)
    for _ in range(max_steps):
        if tracing:
            on = torch.sigmoid(logits + c)
            squares = on * on
        else:
            torch.add(logits, c, out=on).sigmoid_()
        count_on = on.sum(-1, keepdim=True, dtype=torch.float64)
        count_off = n - count_on
        if not tracing:
            squares = on.square_()
        slope = count_on - squares.sum(-1, keepdim=True, dtype=torch.float64)
        count_on, count_off, slope = (t.to(logits.dtype) for t in (count_on, count_off, slope))
        g = torch.log(count_on) - torch.log(count_off)
        too_many = g > goal
        high = torch.where(too_many, c, high)
        low = torch.where(too_many, low, c)
        newton = c - (g - goal) / (slope * (1.0 / count_on + 1.0 / count_off))
        inside = (newton >= low) & (newton <= high)  # False for NaN steps too
        step = torch.where(inside, newton, 0.5 * (low + high)) - c
        c = c + step
        # The tables only need c to within a small fraction of a unit of log-odds.
        settled = (step.abs() <= _TILT_TOLERANCE) & (slope >= _TILT_FLAT)
        # Traced or compiled code takes every step (max_steps is the bound the eager
        # iteration is allowed as well; a converged row's further steps stay below the
        # tolerance, inside its bracket).
        if not tracing and bool(
            ((step.abs() <= _TILT_TOLERANCE) | (high - low <= _TILT_TOLERANCE)).all()
        ):
            break
    return c, settled[:, 0]


def _restart_tilt(logits, target, num_finite, max_steps: int = _TILT_MAX_STEPS):
    """The tilt of rows whose first attempt did not settle, from the order statistics
    ``a = x_(ceil t)`` and ``b = x_(floor t + 1)`` (descending): at
    ``c = -b + log(t / (floor t + 1 - t))`` the largest ``floor t + 1`` terms alone reach
    the count t, and at ``c = -a - log((m - t) / (t - ceil t + 1))`` the terms from rank
    ``ceil t`` down cannot lift it above t, so the root lies between, a bracket only
    ``a - b + O(log m)`` wide. When a - b is large (a gap), the root is within
    ``log(m) / 2`` of ``-(a + b) / 2 + log(t / (m - t)) / 2`` (the two saturated tails
    balance there), where Newton starts; f may be flat there to working precision, but the
    start is already as close as the tables need."""
    descending = logits.sort(-1, descending=True).values
    above = torch.ceil(target).long() - 1
    below = torch.floor(target).long()
    a = descending.gather(-1, above)
    b = descending.gather(-1, below.clamp(max=logits.shape[-1] - 1))
    low = -a - torch.log((num_finite - target) / (target - above - 0.0))
    high = -b + torch.log(target / (below + 1.0 - target))
    start = -(0.5 * a + 0.5 * b) + 0.5 * (torch.log(target) - torch.log(num_finite - target))
    start = torch.minimum(torch.maximum(start, low), high)
    return _newton(logits, target, low, high, start, max_steps)[0]
