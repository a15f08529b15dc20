"""The small-problem path of the ExactlyKBernoulli kernels, PyTorch (docs/numerics.md, "Small
problems").

Same inputs and outputs as the public functions of ``exactly_k_kernels`` (flattened here to
``(batch, n)`` logits, finite or ``-inf``, and integer ``k`` of shape ``(batch,)``), chosen
there by ``applies`` for small n. The answers are the same exact quantities; only the
arithmetic differs, chosen for few operator calls (at n = 50 a call of the general kernels is
hundreds of small operator dispatches, which is all of its cost):

* Tilt in closed form: ``c = -(x_(k) + x_(k+1)) / 2`` from the k-th and (k+1)-th largest
  logits (one sort), instead of Newton steps. It puts the boundary between the k chosen and
  the rest at 0, which is all the log-space tables need: the entries that carry the answer
  are then within about ``log C(n, k)`` of each table's largest one.
* Log-space tables: a leaf holds ``(log off-weight, log on-weight) = (-max(x, 0), min(x, 0))``
  with ``x = logit + c`` (both ``<= 0``, one of them 0, ``-inf`` exactly where impossible);
  a level of the binary tree is one truncated log-space convolution of all its pairs of
  nodes (a window view, one addition, one ``logsumexp``), each table then shifted by its own
  largest entry (the shifts summed in float64 for the log normaliser). Every entry is a
  sum of positive terms computed in log space, so it keeps its relative precision whatever
  its size, and impossible counts stay exactly ``-inf``.
* Marginals by the downward (outside) pass over the same tables, one correlation per level,
  ``mu_i = sigmoid(on_i + O_i[1] - off_i - O_i[0])`` (and the complement as
  ``sigmoid(-...)``, without rounding).
* Their derivative (what ``rsample``'s straight-through gradient and second derivatives of
  ``log_normalizer`` need) by a tangent pass over the saved tables: the Jacobian of the
  marginals is the covariance of z, symmetric, so the vector-Jacobian product is the
  directional derivative along the cotangent, propagated through each ``logsumexp`` by its
  softmax weights. Higher derivatives (create_graph through this) recompute the marginals
  with differentiable operations and differentiate those.
* Exact sampling top-down over the same tables: a node holding c ones gives m of them to its
  left child with probability proportional to ``exp(left[m] + right[c - m])``, drawn by
  Gumbel-max on the log weights (impossible splits are ``-inf`` and never drawn).

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
# benchmarks/README.md, "Small sites"): above them the small path's exp and log per entry and
# its (width x width) outside terms cost more than the general kernels' linear-space sums.
# The marginals (an upward and a downward pass, a tangent pass for their derivative) stay
# faster up to larger tables than the log normaliser and plain sampling do.
SMALL_N = 256
SMALL_ENTRIES = 1 << 15
SMALL_ENTRIES_MARGINALS = 1 << 16

_INF = float("inf")


def applies(logits: torch.Tensor, k_max: int, entries: int = SMALL_ENTRIES) -> bool:
    """Whether the small path is taken (sizes only; k_max = 0 is the callers' own case):
    ``entries`` is the most table entries, ``SMALL_ENTRIES_MARGINALS`` for the marginals."""
    n = int(logits.shape[-1])
    batch = logits.numel() // max(n, 1)
    return k_max > 0 and n <= SMALL_N and batch * n * (k_max + 1) <= entries


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
    """(2, batch, m) log leaf tables, m = n rounded up to a power of two: the padding
    variables have logit -inf (never on), which changes nothing else."""
    n = int(x.shape[-1])
    size = 1 << (n - 1).bit_length()
    if size > n:
        x = F.pad(x, (0, size - n), value=-_INF)
    return torch.stack([-x.clamp(min=0.0), x.clamp(max=0.0)], 0)


# Tables are stored width-major, (width, batch, nodes): every operation then runs over
# contiguous slabs of batch * nodes entries (with the small width innermost, broadcasting
# and reductions on CPU were 10x to 30x slower per entry at batch 128).


def _pad_width(table: torch.Tensor, before: int, after: int, value=-_INF) -> torch.Tensor:
    return F.pad(table, (0, 0, 0, 0, before, after), value=value)


# Index tensors of the windows, by (rows, columns, sign, offset, device): each is a few
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
    return torch.from_numpy(index).to(device)


def _convolve_terms(left, right, out_width: int, pad_value=-_INF) -> torch.Tensor:
    """Terms ``left[t] + right[j - t]``, shape (out_width, w, batch, nodes)."""
    w = int(left.shape[0])
    padded = _pad_width(right, w - 1, max(0, out_width - int(right.shape[0])), pad_value)
    return padded[_window_index(out_width, w, -1, w - 1, padded.device)] + left


def _correlate_terms(outside, sibling, pad_value=-_INF) -> torch.Tensor:
    """Terms ``outside[a + t] + sibling[t]``, shape (w, w, batch, nodes), w the sibling's
    width (the child's outside entry a sums them over t)."""
    w = int(sibling.shape[0])
    padded = _pad_width(outside, 0, max(0, 2 * w - 1 - int(outside.shape[0])), pad_value)
    return padded[_window_index(w, w, 1, 0, padded.device)] + sibling


def _logsumexp(terms: torch.Tensor, with_weights: bool = True):
    """(logsumexp over axis 1, the softmax weights of the terms, 0 where every term is
    -inf, or None without ``with_weights``). Written out: torch.logsumexp is several times
    slower on small CPU tensors, and the weights are the tangent pass's."""
    top = terms.amax(1, keepdim=True).clamp(min=torch.finfo(terms.dtype).min)
    weights = torch.exp(terms - top)
    total = weights.sum(1, keepdim=True)
    table = (torch.log(total) + top)[:, 0]
    return table, weights / total.clamp(min=1.0) if with_weights else None


def _logsumexp_value(terms: torch.Tensor) -> tuple[torch.Tensor, None]:
    return _logsumexp(terms, False)


def _shift(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The table less its largest entry. Every table has a finite entry (the count 0 of a
    subtree, or for an outside table some count that completes k), so the largest entry
    is finite."""
    top = table.amax(0, keepdim=True)
    return table - top, top


def _halves(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = int(table.shape[-1]) // 2
    return table[..., :half], table[..., half:]


def _upward(leaves: torch.Tensor, k_max: int, lse=_logsumexp, with_log_scale: bool = False):
    """The tables of every level, leaves first, root last (width, batch, 1); the softmax
    weights of each convolution's terms (for the tangent pass); the float64 sum of the
    shifts, shape (batch,), with ``with_log_scale``."""
    tables, weights_list = [leaves], []
    log_scale = leaves.new_zeros(leaves.shape[1], dtype=torch.float64)
    table = leaves
    while int(table.shape[-1]) > 1:
        out_width = min(2 * int(table.shape[0]) - 1, k_max + 1)
        table, weights = lse(_convolve_terms(*_halves(table), out_width))
        table, top = _shift(table)
        if with_log_scale:
            log_scale = log_scale + top[0].sum(-1, dtype=torch.float64)
        tables.append(table)
        weights_list.append(weights)
    return tables, weights_list, log_scale


def _root_outside(root: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    counts = _window_index(int(root.shape[0]), 1, 0, 0, root.device)[..., None]
    return torch.where(counts == k[:, None], 0.0, -_INF).to(root.dtype)


def _siblings(table: torch.Tensor) -> torch.Tensor:
    """Each node's sibling: the halves swapped."""
    return table.roll(int(table.shape[-1]) // 2, -1)


def _downward(tables, k: torch.Tensor, lse=_logsumexp):
    """Outside tables of the leaves (2, batch, m) and the softmax weights of each
    correlation's terms, root first."""
    outside = _root_outside(tables[-1], k)
    weights_list = []
    for table in reversed(tables[:-1]):
        outside, weights = lse(_correlate_terms(outside.repeat(1, 1, 2), _siblings(table)))
        outside = _shift(outside)[0]
        weights_list.append(weights)
    return outside, weights_list


def _log_odds(leaves: torch.Tensor, outside: torch.Tensor, n: int) -> torch.Tensor:
    """``on + O[1] - off - O[0]`` per variable (the log odds of its marginal), (batch, n)."""
    on = leaves[1, :, :n] + outside[1, :, :n]
    off = leaves[0, :, :n] + outside[0, :, :n]
    return on - off


def _prepare(
    logits: torch.Tensor, k: torch.Tensor, k_max: int, with_log_scale=False, lse=_logsumexp
):
    c = tilt(logits, k, k_max)
    x = logits + c
    leaves = _leaves(x)
    return c, x, leaves, _upward(leaves, k_max, lse, with_log_scale)


def _safe_logsumexp(terms: torch.Tensor) -> tuple[torch.Tensor, None]:
    """``logsumexp`` over axis 1 whose derivatives of every order are finite where all terms
    are -inf (torch's gives NaN there)."""
    top = terms.detach().amax(1, keepdim=True).clamp(min=torch.finfo(terms.dtype).min)
    total = torch.exp(terms - top).sum(1)
    possible = total > 0
    safe = torch.where(possible, total, 1.0)
    return torch.where(possible, top[:, 0] + torch.log(safe), -_INF), None


def _differentiable_marginals(logits: torch.Tensor, k: torch.Tensor, k_max: int):
    """The marginals from differentiable operations only (for derivatives of any order)."""
    c = tilt(logits, k, k_max)
    x = logits + c
    leaves = _leaves(x)
    tables = _upward(leaves, k_max, _safe_logsumexp)[0]
    outside = _downward(tables, k, _safe_logsumexp)[0]
    return torch.sigmoid(_log_odds(leaves, outside, int(x.shape[-1])))


def _tangent(x, tangent, tables, up_weights, down_weights, log_odds):
    """The derivative of the log odds along ``tangent`` (batch, n), over the saved tables
    and softmax weights. Each table's shift is a constant of that table, which cancels in
    the log odds, so its derivative is left out throughout."""
    n = int(x.shape[-1])
    d_off = torch.where(x > 0, -tangent, 0.0)
    d_on = torch.where((x > -_INF) & (x <= 0), tangent, 0.0)
    d_leaves = torch.stack([d_off, d_on], 0)
    size = int(tables[0].shape[-1])
    if size > n:
        d_leaves = F.pad(d_leaves, (0, size - n))
    d_tables, d_table = [d_leaves], d_leaves
    for weights in up_weights:
        d_terms = _convolve_terms(*_halves(d_table), int(weights.shape[0]), 0.0)
        d_table = (weights * d_terms).sum(1)
        d_tables.append(d_table)
    d_outside = torch.zeros_like(tables[-1])
    for d_table, weights in zip(reversed(d_tables[:-1]), down_weights, strict=True):
        d_terms = _correlate_terms(d_outside.repeat(1, 1, 2), _siblings(d_table), 0.0)
        d_outside = (weights * d_terms).sum(1)
    d_log_odds = (d_leaves[1] - d_leaves[0] + d_outside[1] - d_outside[0])[:, :n]
    return torch.where(log_odds.abs() < _INF, d_log_odds, 0.0)  # 0 where +-inf or NaN


def _forward_pass(logits: torch.Tensor, k: torch.Tensor, k_max: int):
    c, x, leaves, (tables, up_terms, _) = _prepare(logits.detach(), k, k_max)
    outside, down_terms = _downward(tables, k)
    log_odds = _log_odds(leaves, outside, int(x.shape[-1]))
    return x, tables, up_terms, down_terms, log_odds


class _Marginals(torch.autograd.Function):
    """The marginals and their complements (no gradient), then the tensors the tangent pass
    and the sampler use: x, the log odds, the tables (leaves first), the up- and downward
    softmax weights. All outputs are tensors (``torch.jit.trace`` records no others)."""

    # Plain tensor operations without decisions on values in forward and backward, so
    # torch.func can batch both (jacrev vmaps the backward over the cotangents).
    generate_vmap_rule = True

    @staticmethod
    def forward(logits, k, k_max):
        with torch.no_grad():
            x, tables, up_weights, down_weights, log_odds = _forward_pass(logits, k, k_max)
            mu, complement = torch.sigmoid(log_odds), torch.sigmoid(-log_odds)
        return (mu, complement, x, log_odds, *tables, *up_weights, *down_weights)

    @staticmethod
    def setup_context(ctx, inputs, output):
        logits, k, k_max = inputs
        mu, complement, x, log_odds = output[:4]
        levels = (len(output) - 5) // 3
        ctx.mark_non_differentiable(*output[1:])
        # The other outputs' gradients are never used: not materialised as zero tensors
        # (one operator call each, three per tree level).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, k, mu, complement, x, log_odds, *output[4:])
        ctx.save_for_forward(mu, complement, x, log_odds, *output[4:])
        ctx.levels, ctx.k_max = levels, k_max

    @staticmethod
    def jvp(ctx, logits_dot, *unused):
        # Forward mode (torch.func.jvp, jacfwd): the tangent pass is a directional
        # derivative already; only mu has one (the other outputs are non-differentiable).
        mu, complement, x, log_odds, *rest = ctx.saved_tensors
        levels = ctx.levels
        tables, up_weights = rest[: levels + 1], rest[levels + 1 : 2 * levels + 1]
        down_weights = rest[2 * levels + 1 :]
        d = _tangent(x, logits_dot, tables, up_weights, down_weights, log_odds)
        return (mu * complement * d,) + (None,) * (len(rest) + 3)

    @staticmethod
    def backward(ctx, grad, *unused):
        if grad is None:
            return None, None, None
        logits, k, mu, complement, x, log_odds, *rest = ctx.saved_tensors
        levels = ctx.levels
        tables, up_weights = rest[: levels + 1], rest[levels + 1 : 2 * levels + 1]
        down_weights = rest[2 * levels + 1 :]
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
            d = _tangent(x, grad, tables, up_weights, down_weights, log_odds)
            return mu * complement * d, None, None


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
        prepared = _prepare(flat_logits, flat_k, k_max, True, _logsumexp_value)
        c, (tables, _, log_scale) = prepared[0], prepared[3]
        root_k = tables[-1][:, :, 0].gather(0, flat_k.long()[None])[0]
        log_reduced = root_k.to(torch.float64) + log_scale
        batch_shape = logits.shape[:-1]

    # A partial, not a closure: the parts are kept on the distribution, which must pickle.
    saved_marginals = functools.partial(_marginals_of_kept_pass, tables, flat_k, logits.shape)
    tilt_part = c[:, 0].to(torch.float64).reshape(batch_shape)
    return tilt_part, log_reduced.reshape(batch_shape), saved_marginals


def _marginals_of_kept_pass(tables, flat_k, shape) -> torch.Tensor:
    """The downward pass over a kept upward pass (``normalizer_parts``): the marginals."""
    with torch.no_grad():
        outside = _downward(tables, flat_k, _logsumexp_value)[0]
        return torch.sigmoid(_log_odds(tables[0], outside, shape[-1])).reshape(shape)


def _draw(tables, k: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Counts of ones per leaf, (num_samples, batch, m), top-down from k."""
    counts = k.long()[None, :, None].expand(num_samples, -1, 1)  # (samples, batch, nodes)
    # The Gumbel noise of every level at once (a level's noise has the shape of its log
    # weights below: width, samples, batch, half the nodes).
    shapes = [
        (int(t.shape[0]), num_samples, int(t.shape[1]), int(t.shape[2]) // 2)
        for t in reversed(tables[:-1])
    ]
    sizes = [math.prod(shape) for shape in shapes]
    dtype, device = tables[0].dtype, tables[0].device
    uniform = torch.rand(sum(sizes), dtype=dtype, device=device)
    gumbel = -torch.log(-torch.log(uniform.clamp(min=torch.finfo(dtype).tiny)))
    noises = gumbel.split(sizes)
    for table, noise, shape in zip(reversed(tables[:-1]), noises, shapes, strict=True):
        left, right = _halves(table)
        w = shape[0]
        # The right child's entry c - m for m = 0..w-1, from its table padded with -inf.
        padded = _pad_width(right, w - 1, w - 1)[:, None]
        index = counts + _window_index(1, w, -1, w - 1, device).reshape(w, 1, 1, 1)
        log_weight = left[:, None] + padded.expand((padded.shape[0],) + counts.shape).gather(
            0, index
        )
        ones_left = (log_weight + noise.view(shape)).max(0).indices
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
        mu, levels = output[0], (len(output) - 5) // 3
        tables = output[4 : 5 + levels]
        mu = mu.reshape(logits.shape)
    else:
        with torch.no_grad():
            tables = _prepare(flat_logits.detach(), flat_k, k_max, lse=_logsumexp_value)[3][0]
        mu = None
    with torch.no_grad():
        counts = _draw(tables, flat_k, sample_shape.numel())  # no gradient: non-differentiable
        z = counts[..., : int(logits.shape[-1])].to(logits.dtype)
    return z.reshape(sample_shape + logits.shape), mu


def sample(logits: torch.Tensor, k: torch.Tensor, k_max: int, sample_shape=()) -> torch.Tensor:
    return sample_and_marginals(logits.detach(), k, k_max, sample_shape, False)[0]
