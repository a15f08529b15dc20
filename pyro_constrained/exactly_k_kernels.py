"""Numerical kernels of ExactlyKBernoulli (docs/distributions/exactly_k_bernoulli.md), PyTorch.

Pure functions of ``logits`` (shape ``batch + (n,)``, entries finite or ``-inf``), ``k``
(integer tensor of shape ``batch``, ``0 <= k <= number of finite logits``) and ``k_max`` (a
Python int, ``max(k) <= k_max <= n``; tables are truncated at it). The distribution calls
only these functions; ``+inf`` logits and feasibility are handled by the caller.

Method (SIMPLE Algorithms 4 and 5, in scaled linear space; the same as
``numpyro_constrained.exactly_k_kernels``, docs/numerics.md "The exactly-k kernels"):

* Tilt (``exactly_k_tilt``): add a constant c (no gradient) so that the tilted Bernoullis
  ``z_i ~ Bernoulli(sigmoid(x_i))``, ``x = logits + c``, have expected count about k.
  This leaves the conditional distribution unchanged and puts the bulk of every table
  near the entries that matter.
* Upward pass (``exactly_k_tree``): each leaf holds the table ``[1, exp(x_i)]``, each
  internal node the product of its children's polynomials truncated at degree ``k_max``: a
  binary tree of depth ``ceil(log2 n)`` and O(n k_max) work. Every table is stored divided
  by the power of two at or below its largest entry (an exact division), with the exponent
  kept aside, so nothing overflows; entries below ``sqrt(tiny)`` after the division are set
  to zero, so every product of two stored entries is a normal float (denormal arithmetic is
  up to 100x slower on CPUs, and such entries are invisible at working precision next to
  the largest one). The root's entry k is ``e_k(exp x)`` up to the kept factors:

      log e_k(exp logits) = log root[k] + (sum of kept exponents) log 2
                            + sum_i max(x_i, 0) - k c.

* Downward pass (inside-outside): the outside table of the root is the indicator of k; a
  child's outside table is the correlation of its parent's outside table with its
  sibling's table. At a leaf with outside table ``[o_0, o_1]``,
  ``mu_i = exp(x_i) o_1 / (o_0 + exp(x_i) o_1)``, a ratio of positive terms (small marginals
  keep their relative precision). The marginals are built from differentiable operations,
  so they can be differentiated again (the straight-through gradient of ``rsample``), and
  ``log_normalizer``'s gradient is defined to be these marginals.
* Sampling (``exactly_k_draw``, SIMPLE Algorithm 5): the root holds k ones; a node holding
  c ones gives its left child m of them with probability proportional to
  ``left[m] right[c - m]``, down to the leaves.
* FFT path (cost independent of k): levels at least ``design.TORCH_FFT_WIDTH_*`` wide go
  by FFT (``exactly_k_convolution``) when every row's tilted count variance is at least
  ``design.FFT_MIN_VARIANCE``; docs/numerics.md states why that keeps every result exact to
  working precision.
"""

import functools
from typing import NamedTuple

import torch

from pyro_constrained import exactly_k_small as _small
from pyro_constrained.exactly_k_draw import _draw
from pyro_constrained.exactly_k_tilt import tilt
from pyro_constrained.exactly_k_tracing import _sizes_only, _static_control_flow
from pyro_constrained.exactly_k_tree import _marginals_from, _prepare
from pyro_constrained.exactly_k_values import (
    NormalizerParts,
    _positive_part_sum,
    _tilted,
    cross_entropy_value,
    log_constraint_prob_value,
    log_normalizer_value,
    log_prob_value,
)

__all__ = [
    "CountTable",
    "NormalizerParts",
    "count_log_probs",
    "cross_entropy_value",
    "log_constraint_prob_value",
    "log_normalizer",
    "log_normalizer_value",
    "log_prob_value",
    "marginals",
    "marginals_and_complements",
    "normalizer_parts",
    "sample",
    "sample_and_marginals",
    "tilt",
]


@_sizes_only
def normalizer_parts(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> NormalizerParts:
    """The parts of ``log e_k(exp logits)`` (see ``NormalizerParts``), from one upward pass."""
    with torch.no_grad():
        logits = logits.detach()
        if k_max == 0:  # e_0 = 1: no tilt, log_reduced = -sum max(logits, 0)
            zero_tilt = logits.new_zeros(logits.shape[:-1], dtype=torch.float64)
            return NormalizerParts(zero_tilt, -_positive_part_sum(_tilted(logits, zero_tilt)))
        if _small.applies(logits, k_max):  # small n: see exactly_k_small
            return NormalizerParts(*_small.normalizer_parts(logits, k, k_max))
        flat_k, batch_shape, c, weights, root, levels, log_scale = _prepare(logits, k, k_max, True)
        root_k = root.gather(-1, flat_k.long()[:, None])[:, 0]
        log_reduced = torch.log(root_k.to(torch.float64)) + log_scale

        # A partial of a module-level function, not a closure: the parts are kept on the
        # distribution (a lazy property), which must stay picklable.
        saved_marginals = functools.partial(
            _marginals_of_kept_pass, flat_k, weights, root, levels, logits.shape
        )
        return NormalizerParts(
            c.to(torch.float64).reshape(batch_shape),
            log_reduced.reshape(batch_shape),
            saved_marginals,
        )


def _marginals_of_kept_pass(flat_k, weights, root, levels, shape) -> torch.Tensor:
    """The downward pass over a kept upward pass (``normalizer_parts``): the marginals."""
    with torch.no_grad():
        return _marginals_from(flat_k, weights, root, levels).reshape(shape)


def _zeros_with_gradient(logits: torch.Tensor) -> torch.Tensor:
    """Zeros that depend on the logits (with zero derivative), so that a caller's backward
    pass gets zero gradients rather than none."""
    return torch.where(logits > -torch.inf, logits, 0.0) * 0.0


class _LogNormalizer(torch.autograd.Function):
    """log e_k(exp logits) (from precomputed parts) with the marginals as its gradient. The
    backward pass takes them from the parts' kept upward pass (``saved_marginals``, one
    downward pass) where it need not be differentiable; with create_graph=True it computes
    them from differentiable operations, so second derivatives work."""

    @staticmethod
    def forward(logits, k, k_max, tilt, log_reduced, saved_marginals):
        value = log_normalizer_value(logits, k, NormalizerParts(tilt, log_reduced))
        return value.to(logits.dtype)

    # A separate setup_context is what torch.func transforms (grad, jacrev) require; the
    # forward is plain tensor operations, so vmap can batch it (over a log_prob's values:
    # vmap over the logits stops earlier, at the table size, a Python int).
    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, k, k_max = inputs[:3]
        ctx.save_for_backward(logits, k)
        ctx.save_for_forward(logits, k)
        ctx.k_max, ctx.saved_marginals = k_max, inputs[5]

    @staticmethod
    def jvp(ctx, logits_dot, *unused):
        # Forward mode (torch.func.jvp, jacfwd): the marginals dotted with the tangent.
        logits, k = ctx.saved_tensors
        return (marginals(logits, k, ctx.k_max) * logits_dot).sum(-1)

    @staticmethod
    def backward(ctx, grad):
        logits, k = ctx.saved_tensors
        if ctx.saved_marginals is not None and not torch.is_grad_enabled():
            mu = ctx.saved_marginals()
        else:  # create_graph (torch.func's transforms always ask for it): differentiable
            mu = marginals(logits, k, ctx.k_max)
        return grad[..., None] * mu, None, None, None, None, None


def log_normalizer(
    logits: torch.Tensor, k: torch.Tensor, k_max: int, parts: NormalizerParts | None = None
) -> torch.Tensor:
    """log e_k(exp logits), shape ``batch``; its gradient is ``marginals`` (differentiable
    again, without NaN at ``-inf`` logits). ``parts``: from ``normalizer_parts``, if the
    caller has them already."""
    if parts is None:
        parts = normalizer_parts(logits, k, k_max)
    k = k.expand(logits.shape[:-1])
    # A traced or compiled program would replay the first call's tables: recompute there.
    saved = None if _static_control_flow() else parts.marginals
    return _LogNormalizer.apply(logits, k, k_max, parts.tilt, parts.log_reduced, saved)


@_sizes_only
def marginals(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """mu_i = P(z_i = 1 | sum z = k) = d log e_k(exp logits) / d logits_i, shape
    ``batch + (n,)``; differentiable again when ``logits`` requires grad."""
    if k_max == 0:
        return _zeros_with_gradient(logits)
    if _small.applies(logits, k_max):  # small n: see exactly_k_small
        return _small.marginals(logits, k, k_max)
    flat_k, batch_shape, _, weights, root, levels, _ = _prepare(logits, k, k_max)
    return _marginals_from(flat_k, weights, root, levels).reshape(logits.shape)


@_sizes_only
def marginals_and_complements(
    logits: torch.Tensor, k: torch.Tensor, k_max: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``marginals``, ``1 - marginals`` without rounding: from the leaves' off-weights, no
    gradient), so that a marginal near 1 keeps the relative precision of its complement."""
    if k_max == 0:
        return _zeros_with_gradient(logits), torch.ones_like(logits).detach()
    if _small.applies(logits, k_max):  # small n: see exactly_k_small
        return _small.marginals_and_complements(logits, k, k_max)
    flat_k, batch_shape, _, weights, root, levels, _ = _prepare(logits, k, k_max)
    mu, complement = _marginals_from(flat_k, weights, root, levels, with_complements=True)
    return mu.reshape(logits.shape), complement.reshape(logits.shape)


def _sample_and_maybe_marginals(logits, k, k_max, sample_shape, with_marginals):
    sample_shape = torch.Size(sample_shape)
    out_shape = sample_shape + logits.shape
    if k_max == 0:
        return logits.new_zeros(out_shape).detach(), _zeros_with_gradient(logits)
    flat_k, _, _, weights, root, levels, _ = _prepare(logits, k, k_max)
    with torch.no_grad():
        detached = [
            level._replace(left=level.left.detach(), right=level.right.detach()) for level in levels
        ]
        counts = _draw(flat_k, detached, sample_shape.numel())
        z = counts.to(logits.dtype).reshape(out_shape)
    mu = None
    if with_marginals:
        mu = _marginals_from(flat_k, weights, root, levels).reshape(logits.shape)
    return z, mu


@_sizes_only
def sample(
    logits: torch.Tensor, k: torch.Tensor, k_max: int, sample_shape: tuple[int, ...] = ()
) -> torch.Tensor:
    """Exact draws, shape ``sample_shape + batch + (n,)``, entries 0.0 / 1.0 summing to k.
    No gradient."""
    if _small.applies(logits, k_max):  # small n: see exactly_k_small
        return _small.sample(logits, k, k_max, sample_shape)
    with torch.no_grad():
        return _sample_and_maybe_marginals(logits.detach(), k, k_max, sample_shape, False)[0]


@_sizes_only
def sample_and_marginals(
    logits: torch.Tensor, k: torch.Tensor, k_max: int, sample_shape: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample(...), marginals(...)) from one upward pass (for ``rsample``)."""
    if _small.applies(logits, k_max):  # small n: see exactly_k_small
        return _small.sample_and_marginals(logits, k, k_max, sample_shape)
    return _sample_and_maybe_marginals(logits, k, k_max, sample_shape, True)


class CountTable(NamedTuple):
    """The distribution of the count ``K = sum_i z_i`` of independent
    ``z_i ~ Bernoulli(sigmoid(logits_i))`` from one upward pass tilted at k (the root
    table), float64, no gradient; ``width`` is at least ``k_max + 1`` where n allows.

    ``log_probs[..., j] = log P(K = j)`` (``-inf`` where the table's entry was flushed to
    zero); ``relative[..., j]``: the root's entry j over its largest entry, in [0, 1]. On
    the direct path every entry keeps its relative precision; on the FFT path (wide tables,
    spread-out counts) an entry's error is about 1e-16 ``/ relative`` relative, so a caller
    that needs every count tilts at several k and keeps each entry from a pass where
    ``relative`` is large (``PoissonBinomial`` does). ``tilt``: the pass's tilt c."""

    log_probs: torch.Tensor
    relative: torch.Tensor
    tilt: torch.Tensor


@_sizes_only
def count_log_probs(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> CountTable:
    """``log P(sum z = j)`` for ``j = 0 .. k_max`` (see ``CountTable``), tilted at ``k``
    (``0 <= k <= k_max``): the entries near k are the ones the tilt resolves best."""
    with torch.no_grad():
        logits = logits.detach()
        batch_shape = logits.shape[:-1]
        flat_k, _, c, _, root, _, log_scale = _prepare(logits, k, max(k_max, 1), True)
        root = root.to(torch.float64)
        largest = root.amax(-1, keepdim=True).clamp(min=torch.finfo(root.dtype).tiny)
        theta = logits.reshape(-1, logits.shape[-1]).to(torch.float64)
        c = c.to(torch.float64)
        on, rest = _count_terms(theta, c)
        j = torch.arange(root.shape[-1], dtype=torch.float64, device=root.device)
        log_p = torch.log(root) + (log_scale + rest)[:, None] + c[:, None] * (on[:, None] - j)
        width = root.shape[-1]
        return CountTable(
            log_p.reshape(batch_shape + (width,)),
            (root / largest).reshape(batch_shape + (width,)),
            c.reshape(batch_shape),
        )


def _count_terms(theta: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, rest) with ``log P(K = j) = log root[j] + log_scale + c (P - j) + rest`` for
    float64 logits ``theta`` (rows, n) tilted by ``c`` (rows,): the count-independent parts
    of ``log_constraint_prob_value``, written without forming ``theta + c`` (see there); P
    is the number of non-negative tilted logits, and ``c (P - j)`` is formed as one product
    (``c P - c j`` would cancel at the size of c)."""
    x = theta + c[:, None]
    finite = theta > -torch.inf
    x_on, theta_on = (x >= 0) & finite, (theta >= 0) & finite
    shift = torch.where(x_on & ~theta_on, theta, 0.0).sum(-1)
    shift = shift - torch.where(theta_on & ~x_on, theta, 0.0).sum(-1)
    tails = torch.where(finite, torch.log1p(torch.exp(-theta.abs())), 0.0).sum(-1)
    return x_on.sum(-1), shift - tails
