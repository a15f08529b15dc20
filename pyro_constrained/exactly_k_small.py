"""The small-problem path of the ExactlyKBernoulli kernels, PyTorch (docs/numerics.md, "Small
problems").

Same inputs and outputs as the public functions of ``exactly_k_kernels`` (flattened here to
``(batch, n)`` logits, finite or ``-inf``, and integer ``k`` of shape ``(batch,)``), chosen
there by ``applies`` for small n. The answers are the same exact quantities; only the
arithmetic differs, chosen for few operator calls (at n = 50 a call of the general kernels is
hundreds of small operator dispatches, which is all of its cost):

* Tilt in closed form: ``c = -(x_(k) + x_(k+1)) / 2`` from the k-th and (k+1)-th largest
  logits (one sort), instead of Newton steps. It puts the boundary between the k chosen and
  the rest at 0: the configuration with those k on then has weight 1, and every other
  weighs less.
* Linear-space tables in float64 whatever the logits' dtype: a leaf holds
  ``(off-weight, on-weight) = (exp(-max(x, 0)), exp(min(x, 0)))`` with ``x = logit + c``
  (both in [0, 1], one of them 1, 0 exactly where impossible); a level of the binary tree is
  one truncated polynomial product of all its pairs of nodes (a window gather, a product
  and a sum). Every entry is a sum of products of weights at most 1, and the table of a
  subtree of m variables holds at most ``C(m, j)`` at count j, so at n <= ``SMALL_N`` no
  entry overflows (``C(256, 128)`` is about 6e75) and none needs rescaling. An entry keeps
  its relative precision (sums of positive terms) unless it is below float64's smallest
  normal number, 1e-308 against the weight-1 configuration: every float32 result, and
  every float64 one above about 1e-216, is exact to working precision (the general kernels
  flush entries below ``sqrt(tiny)`` of their table's largest).
* Marginals by the downward (outside) pass over the same tables, one correlation per level:
  with ``a = on_i O_i[1]`` and ``b = off_i O_i[0]``, ``mu_i = a / (a + b)`` and its
  complement ``b / (a + b)``, ratios of positive terms (no rounding of 1 - mu).
* Their derivative (what ``rsample``'s straight-through gradient and second derivatives of
  ``log_normalizer`` need) by a tangent pass over the saved tables and outside tables, each
  product differentiated by the product rule: the Jacobian of the marginals is the
  covariance of z, symmetric, so the vector-Jacobian product is the directional derivative
  along the cotangent. Higher derivatives (create_graph through this) recompute the
  marginals with differentiable operations and differentiate those.
* Exact sampling top-down over the same tables: a node holding c ones gives m of them to its
  left child with probability proportional to ``left[m] right[c - m]``, drawn by Gumbel-max
  on the logs of those weights (impossible splits weigh 0 and are never drawn).

Python branches read only sizes (n, k_max, the batch size), never values, so
``torch.jit.trace`` replays the same computation for any later input.
"""

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from pyro_constrained.exactly_k_tracing import _static_control_flow

# The largest n that takes this path, and the most table entries (batch * n * (k_max + 1)),
# set from paired measurements against the general kernels (float32, one thread;
# benchmarks/README.md, "Small sites"): above them the small path's (width x width) window
# terms per node cost more than the general kernels' shift-and-add levels.
SMALL_N = 256
SMALL_ENTRIES = 1 << 17

_INF = float("inf")


def applies(logits: torch.Tensor, k_max: int) -> bool:
    """Whether the small path is taken (sizes only; k_max = 0 is the callers' own case)."""
    n = int(logits.shape[-1])
    batch = logits.numel() // max(n, 1)
    return k_max > 0 and n <= SMALL_N and batch * n * (k_max + 1) <= SMALL_ENTRIES


def tilt(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """``-(x_(k) + x_(k+1)) / 2`` per row (shape ``(batch, 1)``, the logits' dtype, no
    gradient), x_(j) the j-th largest logit; the one that exists for k = 0 or k = the number
    of finite logits, and 0 where there is none."""
    with torch.no_grad():
        ordered = logits.detach().topk(min(k_max + 1, int(logits.shape[-1])), -1).values
        # The first and last entries repeated at either end: (x_(k), x_(k+1)) is then the
        # pair of columns k, k + 1 for every k from 0 (x_(1) twice) to n (x_(n) twice).
        ordered = torch.cat([ordered[:, :1], ordered, ordered[:, -1:]], -1)
        index = k.long()[:, None] + _window_index(1, 2, 1, 0, ordered.device)
        upper, lower = ordered.gather(-1, index).unbind(-1)
        lower = torch.where(lower > -_INF, lower, upper)
        # -(upper / 2 + lower / 2): halves first, so that the sum cannot overflow.
        c = torch.sub(upper * -0.5, lower, alpha=0.5)
        return torch.nan_to_num(c, nan=0.0, posinf=0.0, neginf=0.0)[:, None]


def _leaves(x: torch.Tensor) -> torch.Tensor:
    """(2, batch, m) leaf tables (off-weight ``exp(-max(x, 0))``, on-weight
    ``exp(min(x, 0))``) of the float64 tilted logits, m = n rounded up to a power of two:
    the padding variables have logit -inf (never on), which changes nothing else. The
    derivative of the on-weight is taken at x = 0 and the off-weight's is not, so that
    their ratio ``exp(x)`` has derivative ``exp(x)`` there too."""
    n = int(x.shape[-1])
    size = 1 << (n - 1).bit_length()
    if size > n:
        x = F.pad(x, (0, size - n), value=-_INF)
    return torch.stack([-torch.relu(x), x.clamp(max=0.0)], 0).exp()


# Tables are stored width-major, (width, batch, nodes): every operation then runs over
# contiguous slabs of batch * nodes entries (with the small width innermost, broadcasting
# and reductions on CPU were 3x to 30x slower per entry at batch 128).


def _pad_width(table: torch.Tensor, before: int, after: int) -> torch.Tensor:
    return F.pad(table, (0, 0, 0, 0, before, after))


# Index tensors of the windows, by (rows, columns, sign, offset): each is a few
# operator calls to build, and a call at n = 50 needs about 20 of them, every one of which
# depends on sizes only.
_INDEX_CACHE: dict = {}
_INDEX_CACHE_SIZE = 512


def _window_index(rows: int, columns: int, sign: int, offset: int, device) -> torch.Tensor:
    """``offset + arange(rows)[:, None] + sign * arange(columns)``, shape (rows, columns).
    The cache holds NumPy arrays, made into tensors at each call by ``torch.from_numpy``
    (no operator call): a cached tensor made inside a ``torch.func`` transform would belong
    to that transform's level and could not be used at another. Traced and compiled code
    builds its own (a trace records operators, not a NumPy constant)."""
    if _static_control_flow():  # traced or compiled: operators the program records
        return torch.arange(rows, device=device)[:, None] + (
            sign * torch.arange(columns, device=device) + offset
        )
    key = (rows, columns, sign, offset)
    index = _INDEX_CACHE.get(key)
    if index is None:
        index = np.arange(rows)[:, None] + sign * np.arange(columns) + offset
        if len(_INDEX_CACHE) >= _INDEX_CACHE_SIZE:  # a bound on its memory
            _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = index
    index = torch.from_numpy(index)
    return index if index.device == device else index.to(device)


def _convolve(left: torch.Tensor, right: torch.Tensor, out_width: int) -> torch.Tensor:
    """The truncated product of the polynomials, ``sum_t left[t] right[j - t]`` for
    j < ``out_width``: one window gather of ``right``, a product and a sum."""
    w = int(right.shape[0])
    padded = _pad_width(right, w - 1, max(0, out_width - 1))
    return (padded[_window_index(out_width, w, -1, w - 1, padded.device)] * left).sum(1)


def _correlate(outside: torch.Tensor, sibling: torch.Tensor) -> torch.Tensor:
    """``sum_t outside[a + t] sibling[t]`` for a below the sibling's width w (the child's
    outside entry a: the completions of its count a to k outside the child)."""
    w = int(sibling.shape[0])
    padded = _pad_width(outside, 0, max(0, 2 * w - 1 - int(outside.shape[0])))
    return (padded[_window_index(w, w, 1, 0, padded.device)] * sibling).sum(1)


def _halves(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = int(table.shape[-1]) // 2
    return table[..., :half], table[..., half:]


def _siblings(table: torch.Tensor) -> torch.Tensor:
    """Each node's sibling: the halves swapped."""
    return table.roll(int(table.shape[-1]) // 2, -1)


def _upward(leaves: torch.Tensor, k_max: int) -> list[torch.Tensor]:
    """The tables of every level, leaves first, root last (width, batch, 1)."""
    tables, table = [leaves], leaves
    while int(table.shape[-1]) > 1:
        out_width = min(2 * int(table.shape[0]) - 1, k_max + 1)
        table = _convolve(*_halves(table), out_width)
        tables.append(table)
    return tables


def _root_outside(root: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    counts = _window_index(int(root.shape[0]), 1, 0, 0, root.device)[..., None]
    return (counts == k[:, None]).to(root.dtype)


def _downward(tables, k: torch.Tensor) -> list[torch.Tensor]:
    """The outside tables of every level, root first, leaves last (2, batch, m)."""
    outsides = [_root_outside(tables[-1], k)]
    for table in reversed(tables[:-1]):
        outsides.append(_correlate(outsides[-1].repeat(1, 1, 2), _siblings(table)))
    return outsides


def _ratios(leaves: torch.Tensor, outside: torch.Tensor, n: int) -> torch.Tensor:
    """(1 - mu, mu), shape (2, batch, n): each leaf's off- and on-weight times its outside
    entry, over their sum (which is the root's entry k)."""
    terms = (leaves * outside)[..., :n]
    return terms / terms.sum(0)


def _prepare(logits: torch.Tensor, k: torch.Tensor, k_max: int):
    """(tilt, float64 tilted logits, tables); no gradient."""
    c = tilt(logits, k, k_max)
    x = logits.detach().to(torch.float64) + c.to(torch.float64)
    return c, x, _upward(_leaves(x), k_max)


def _differentiable_marginals(logits: torch.Tensor, k: torch.Tensor, k_max: int):
    """The marginals from differentiable operations only (for derivatives of any order)."""
    x = logits.to(torch.float64) + tilt(logits, k, k_max).to(torch.float64)
    tables = _upward(_leaves(x), k_max)
    outside = _downward(tables, k)[-1]
    return _ratios(tables[0], outside, int(x.shape[-1]))[1].to(logits.dtype)


def _tangent(x, tangent, tables, outsides, ratios):
    """The derivative of the marginals along ``tangent`` (batch, n), over the saved tables
    and outside tables: the same passes, each product differentiated by the product rule.
    With a = on * O[1] and b = off * O[0], ``d mu = (da b - a db) / (a + b)^2``."""
    n = int(x.shape[-1])
    tangent = tangent.to(torch.float64)
    d_leaves = torch.stack([torch.where(x > 0, -tangent, 0.0), torch.where(x > 0, 0.0, tangent)])
    size = int(tables[0].shape[-1])
    if size > n:
        d_leaves = F.pad(d_leaves, (0, size - n))
    d_tables = [tables[0] * d_leaves]
    for table in tables[:-1]:
        out_width = int(tables[len(d_tables)].shape[0])
        (left, right), (d_left, d_right) = _halves(table), _halves(d_tables[-1])
        d_tables.append(_convolve(d_left, right, out_width) + _convolve(left, d_right, out_width))
    d_outside = torch.zeros_like(outsides[0])
    for table, d_table, outside in zip(
        reversed(tables[:-1]), reversed(d_tables[:-1]), outsides[:-1], strict=True
    ):
        d_outside = _correlate(d_outside.repeat(1, 1, 2), _siblings(table)) + _correlate(
            outside.repeat(1, 1, 2), _siblings(d_table)
        )
    terms = (tables[0] * outsides[-1])[..., :n]
    d_terms = (d_tables[0] * outsides[-1] + tables[0] * d_outside)[..., :n]
    total = terms.sum(0)
    return (d_terms[1] * terms[0] - terms[1] * d_terms[0]) / (total * total)


class _Marginals(torch.autograd.Function):
    """The marginals and their complements (no gradient), then the tensors the tangent pass
    and the sampler use: the float64 tilted logits, the tables (leaves first) and the
    outside tables (root first). All outputs are tensors (``torch.jit.trace`` records no
    others)."""

    # Plain tensor operations without decisions on values in forward and backward, so
    # torch.func can batch both (jacrev vmaps the backward over the cotangents).
    generate_vmap_rule = True

    @staticmethod
    def forward(logits, k, k_max):
        with torch.no_grad():
            _, x, tables = _prepare(logits, k, k_max)
            outsides = _downward(tables, k)
            ratios = _ratios(tables[0], outsides[-1], int(x.shape[-1])).to(logits.dtype)
        return (ratios[1], ratios[0], x, *tables, *outsides)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, k, k_max = inputs
        ctx.mark_non_differentiable(*output[1:])
        # The other outputs' gradients are never used: not materialised as zero tensors
        # (one operator call each, two per tree level).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, k, *output)
        ctx.save_for_forward(*output)
        ctx.levels, ctx.k_max = (len(output) - 3) // 2, k_max

    @staticmethod
    def _tangent_of(ctx, saved, tangent):
        mu, complement, x, *rest = saved
        tables, outsides = rest[: ctx.levels], rest[ctx.levels :]
        return _tangent(x, tangent, tables, outsides, None).to(mu.dtype)

    @staticmethod
    def jvp(ctx, logits_dot, *unused):
        # Forward mode (torch.func.jvp, jacfwd): the tangent pass is a directional
        # derivative already; only mu has one (the other outputs are non-differentiable).
        saved = ctx.saved_tensors
        return (_Marginals._tangent_of(ctx, saved, logits_dot),) + (None,) * (len(saved) - 1)

    @staticmethod
    def backward(ctx, grad, *unused):
        if grad is None:
            return None, None, None
        logits, k, *saved = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiable again
            # Recomputed from differentiable operations on the input itself, so that the
            # result is a function of it in the graph being built.
            # torch.func.vjp, not autograd.grad: it also runs where torch.func calls this
            # backward (jacrev batches it over cotangents whose logits need no grad).
            _, pullback = torch.func.vjp(
                lambda x: _differentiable_marginals(x, k, ctx.k_max), logits
            )
            return pullback(grad)[0], None, None
        with torch.no_grad():
            return _Marginals._tangent_of(ctx, saved, grad), None, None


def _flatten(logits: torch.Tensor, k: torch.Tensor):
    n = int(logits.shape[-1])
    return logits.reshape(-1, n), k.expand(logits.shape[:-1]).reshape(-1)


def marginals_and_complements(logits: torch.Tensor, k: torch.Tensor, k_max: int):
    """(mu, 1 - mu without rounding, no gradient), shape ``batch + (n,)``; mu differentiable
    (see ``exactly_k_kernels.marginals_and_complements``)."""
    mu, complement = _Marginals.apply(*_flatten(logits, k), k_max)[:2]
    return mu.reshape(logits.shape), complement.reshape(logits.shape)


def marginals(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    return marginals_and_complements(logits, k, k_max)[0]


def normalizer_parts(logits: torch.Tensor, k: torch.Tensor, k_max: int):
    """(tilt, log_reduced), float64, shape ``batch``, and the function that returns the
    marginals from this upward pass's tables by one downward pass (see
    ``exactly_k_kernels.NormalizerParts``)."""
    with torch.no_grad():
        flat_logits, flat_k = _flatten(logits.detach(), k)
        c, _, tables = _prepare(flat_logits, flat_k, k_max)
        log_reduced = tables[-1][:, :, 0].gather(0, flat_k.long()[None])[0].log()
        batch_shape = logits.shape[:-1]

    # A partial, not a closure: the parts are kept on the distribution, which must pickle.
    saved_marginals = functools.partial(_marginals_of_kept_pass, tables, flat_k, logits)
    tilt_part = c[:, 0].to(torch.float64).reshape(batch_shape)
    return tilt_part, log_reduced.reshape(batch_shape), saved_marginals


def _marginals_of_kept_pass(tables, flat_k, logits) -> torch.Tensor:
    """The downward pass over a kept upward pass (``normalizer_parts``): the marginals."""
    with torch.no_grad():
        outside = _downward(tables, flat_k)[-1]
        mu = _ratios(tables[0], outside, int(logits.shape[-1]))[1]
        return mu.to(logits.dtype).reshape(logits.shape)


def _draw(tables, k: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Counts of ones per leaf, (num_samples, batch, m), top-down from k: a node holding c
    ones gives m to its left child with probability ``left[m] right[c - m]`` over their sum,
    drawn by inversion (the first m whose cumulative weight exceeds a uniform fraction of
    the total; a split of weight 0 is never drawn)."""
    counts = k.long()[None, :, None].expand(num_samples, -1, 1)  # (samples, batch, nodes)
    # One uniform per parent node, every level's at once.
    shapes = [(num_samples, int(t.shape[1]), int(t.shape[2]) // 2) for t in reversed(tables[:-1])]
    sizes = [math.prod(shape) for shape in shapes]
    dtype, device = tables[0].dtype, tables[0].device
    uniforms = torch.rand(sum(sizes), dtype=dtype, device=device).split(sizes)
    for table, uniform, shape in zip(reversed(tables[:-1]), uniforms, shapes, strict=True):
        left, right = _halves(table)
        w = int(table.shape[0])
        # The right child's entry c - m for m = 0..w-1, from its table padded with zeros.
        padded = _pad_width(right, w - 1, w - 1)[:, None]
        index = counts + _window_index(1, w, -1, w - 1, device).reshape(w, 1, 1, 1)
        weight = left[:, None] * padded.expand((padded.shape[0],) + counts.shape).gather(0, index)
        cumulative = weight.cumsum(0)
        ones_left = (cumulative <= uniform.view(shape) * cumulative[-1]).sum(0)
        counts = torch.cat([ones_left, counts - ones_left], -1)
    return counts


def sample_and_marginals(
    logits: torch.Tensor, k: torch.Tensor, k_max: int, sample_shape=(), with_marginals=True
):
    """(draws, shape ``sample_shape + batch + (n,)`` in the logits' dtype, no gradient;
    marginals, differentiable, or None without ``with_marginals``)."""
    sample_shape = torch.Size(sample_shape)
    flat_logits, flat_k = _flatten(logits, k)
    if with_marginals:
        output = _Marginals.apply(flat_logits, flat_k, k_max)
        tables = output[3 : 3 + (len(output) - 3) // 2]
        mu = output[0].reshape(logits.shape)
    else:
        with torch.no_grad():
            tables = _prepare(flat_logits.detach(), flat_k, k_max)[2]
        mu = None
    with torch.no_grad():
        counts = _draw(tables, flat_k, sample_shape.numel())  # no gradient: non-differentiable
        z = counts[..., : int(logits.shape[-1])].to(logits.dtype)
    return z.reshape(sample_shape + logits.shape), mu


def sample(logits: torch.Tensor, k: torch.Tensor, k_max: int, sample_shape=()) -> torch.Tensor:
    return sample_and_marginals(logits.detach(), k, k_max, sample_shape, False)[0]
