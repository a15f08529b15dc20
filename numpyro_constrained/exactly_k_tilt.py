"""The tilt of the JAX exactly-k kernels: a constant c per row with expected tilted count about
k (docs/numerics.md, "The exactly-k kernels"). The constants are shared with the torch
kernels (``constrained_ppl.exactly_k_design``)."""

import jax
import jax.numpy as jnp
from jax import lax

from constrained_ppl import exactly_k_design as design

# The framework-free constants, with the reason for each value, live in one place for both
# packages.
_TILT_STEPS = design.TILT_STEPS
_TILT_TOLERANCE = design.TILT_TOLERANCE
_TILT_FLAT = design.TILT_FLAT
_TILT_MAX_STEPS = design.TILT_MAX_STEPS


def tilt(logits: jax.Array, k: jax.Array) -> jax.Array:
    """A constant c per batch element (shape ``batch + (1,)``, under ``stop_gradient``) with
    ``sum_i sigmoid(logits_i + c) ~= k``, for any finite logits however large.

    Newton's method on ``g(c) = log f(c) - log(m - f(c))``, f the expected count and m the
    number of finite logits: g is increasing and close to linear with slope 1 in both tails
    (where Newton on f itself crawls), and exactly linear when m = 1. Steps that leave a
    bracket that provably holds the root are replaced by bisection, and the iteration stops
    once every step is below ``_TILT_TOLERANCE`` (usually after 2 or 3 steps from the
    bracket ``[logit(t/m) - max x, logit(t/m) - min x]``). That bracket is as wide as the
    spread of the logits: with masked logits (-1e4, -1e9) bisection cannot narrow it in a
    few steps, and inside a wide gap between the logits f is constant to working precision,
    so Newton may stop anywhere in the gap. Rows where either can have happened restart
    from order statistics (``_restart_tilt``; under ``vmap`` the restart is computed for
    every row, because ``lax.cond`` becomes a select). The target count t is clamped to
    [1/2, m - 1/2] because the exact solution is infinite for k = 0 and k = m; any finite c
    leaves the distribution unchanged, and the tables only need c roughly right.
    """
    logits = lax.stop_gradient(logits)
    dtype = logits.dtype
    finite = jnp.isfinite(logits)
    num_finite = count(finite)[..., None].astype(dtype)
    m = jnp.maximum(num_finite, 1.0)
    target = jnp.minimum(jnp.maximum(jnp.asarray(k).astype(dtype)[..., None], 0.5), m - 0.5)
    target = jnp.maximum(target, 0.25)  # m = 1: any c in a wide range will do
    largest = logits.max(-1, keepdims=True)
    smallest = jnp.where(finite, logits, jnp.inf).min(-1, keepdims=True)
    goal = jnp.log(target) - jnp.log(m - target)
    low = jnp.where(num_finite > 0, goal - largest, 0.0).astype(dtype)
    high = jnp.where(num_finite > 0, goal - smallest, 0.0).astype(dtype)
    c, settled = _newton(logits, finite, goal, low, high, 0.5 * (low + high), _TILT_STEPS)
    unsettled = ~settled & (num_finite > 1)

    def restart():
        return jnp.where(unsettled, _restart_tilt(logits, finite, target, goal, m), c)

    c = lax.cond(jnp.any(unsettled), restart, lambda: c)
    return lax.stop_gradient(c)


def count(mask: jax.Array) -> jax.Array:
    """The number of True entries of ``mask`` along its last axis (int32), summed in
    floating point where every partial sum is an exact integer (up to 2^24 entries in float32,
    2^53 in float64): XLA's CPU backend compiles an integer reduction of a long axis into a
    tree of about five kernels and a floating one into one, and compile time is what limits
    these kernels (see "Compile time" above)."""
    exact = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    if mask.shape[-1] > 2 ** (jnp.finfo(exact).nmant + 1):
        return mask.sum(-1, dtype=jnp.int32)
    return mask.astype(exact).sum(-1).astype(jnp.int32)


def _newton(logits, finite, goal, low, high, c, max_steps: int):
    """Safeguarded Newton steps on g (see ``tilt``) from ``c`` inside ``[low, high]``.
    Returns (c, settled): settled rows took a last step below ``_TILT_TOLERANCE`` at a
    count variance of at least ``_TILT_FLAT``."""
    dtype = logits.dtype

    def step(state):
        # One sigmoid per step: 1 - on is exact to an absolute eps, which only matters where
        # the off-count is tiny, far from the root (the bracket catches it).
        steps, c, low, high, _, _ = state
        on = jax.nn.sigmoid(logits + c)
        off = jnp.where(finite, 1.0 - on, 0.0)
        # The three sums in one reduction, and both logs in one operation: each reduction of
        # its own, and each operation on the (batch, 1) results, compiled into a kernel.
        sums = jnp.stack([on, off, on * off], axis=-2).sum(-1)
        count_on, count_off, slope = (sums[..., i : i + 1] for i in range(3))
        logs = jnp.log(sums[..., :2])
        g = logs[..., :1] - logs[..., 1:]
        too_many = g > goal
        high = jnp.where(too_many, c, high)
        low = jnp.where(too_many, low, c)
        newton = c - (g - goal) / (slope * (1.0 / count_on + 1.0 / count_off))
        inside = (newton >= low) & (newton <= high)  # False for NaN steps too
        new_c = jnp.where(inside, newton, 0.5 * (low + high)).astype(dtype)
        small = jnp.abs(new_c - c) <= _TILT_TOLERANCE
        done = jnp.all(small | (high - low <= _TILT_TOLERANCE))
        return steps + 1, new_c, low, high, done, small & (slope >= _TILT_FLAT)

    def more(state):
        steps, _, _, _, done, _ = state
        return (steps < max_steps) & ~done

    settled = jnp.zeros(c.shape, bool)
    start = (jnp.int32(0), c.astype(dtype), low, high, jnp.bool_(False), settled)
    _, c, _, _, _, settled = lax.while_loop(more, step, start)
    return c, settled


def _restart_tilt(logits, finite, target, goal, m):
    """The tilt from the order statistics ``a = x_(ceil t)`` and ``b = x_(floor t + 1)``
    (descending): at ``c = -b + log(t / (floor t + 1 - t))`` the largest ``floor t + 1``
    terms alone reach the count t, and at ``c = -a - log((m - t) / (t - ceil t + 1))`` the
    terms from rank ``ceil t`` down cannot lift it above t, so the root lies between, a
    bracket only ``a - b + O(log m)`` wide. When a - b is large (a gap), the root is within
    ``log(m) / 2`` of ``-(a + b) / 2 + log(t / (m - t)) / 2`` (the two saturated tails
    balance there), where Newton starts; f may be flat there to working precision, but the
    start is already as close as the tables need."""
    descending = -jnp.sort(-logits, axis=-1)
    above = jnp.ceil(target) - 1
    below = jnp.minimum(jnp.floor(target), logits.shape[-1] - 1)
    a = jnp.take_along_axis(descending, above.astype(jnp.int32), axis=-1)
    b = jnp.take_along_axis(descending, below.astype(jnp.int32), axis=-1)
    # Rows without finite logits (not restarted) must not turn the loop's test into NaN.
    a, b = (jnp.where(jnp.isfinite(t), t, 0.0) for t in (a, b))
    low = -a - jnp.log((m - target) / (target - above))
    high = -b + jnp.log(target / (below + 1.0 - target))
    start = -(0.5 * a + 0.5 * b) + 0.5 * (jnp.log(target) - jnp.log(m - target))
    start = jnp.clip(start, low, high)
    return _newton(logits, finite, goal, low, high, start, _TILT_MAX_STEPS)[0]
