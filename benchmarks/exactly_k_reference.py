"""Reference implementations the exactly-k kernels are measured against (benchmarks only).

* The sequential log-space dynamic programme of the SIMPLE paper's code
  (github.com/UCLA-StarAI/SIMPLE, ``log_pr_exactly_k``, ``marginals``, ``sample``),
  re-written in torch and JAX: a table ``a[i, j + 1] = log P(z_1 + ... + z_i = j)`` built one
  variable at a time (O(n) sequential steps of O(k) work), marginals as the autograd gradient
  of ``log P(sum z = k)`` with respect to ``log p`` (``log(1 - p)`` held fixed), and the
  sequential sampler that walks the table from i = n down to 1. As in the original, the
  table has a sentinel column for j = -1 and uses a large negative number instead of
  ``-inf`` (``torch.logaddexp`` gives NaN gradients at ``-inf``); the original's -300 is
  not small enough once n is in the hundreds (log P(count = 0) passes it and the sampler
  then draws impossible states), so this copy uses -1e30.
* Gumbel-top-k: the inexact baseline (a sample of a different distribution, no gradient).
"""

from functools import partial

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from jax import lax

_SENTINEL = -1e30  # stand-in for log 0 (the SIMPLE code has -300)


# ----------------------------------------------------------------------------- torch


def torch_log_pr_exactly_k(log_p: torch.Tensor, log_q: torch.Tensor, k: int) -> torch.Tensor:
    """(batch, n + 1, k + 2) table; column j + 1 holds log P(count = j), column 0 is j = -1."""
    batch, n = log_p.shape
    state = torch.full((batch, k + 2), _SENTINEL, dtype=log_p.dtype)
    state[:, 1] = 0.0
    rows = [state]
    sentinel = torch.full((batch, 1), _SENTINEL, dtype=log_p.dtype)
    for i in range(n):
        on = state[:, :-1] + log_p[:, i : i + 1]
        off = state[:, 1:] + log_q[:, i : i + 1]
        state = torch.cat([sentinel, torch.logaddexp(on, off)], dim=1)
        rows.append(state)
    return torch.stack(rows, dim=1)


def torch_marginals(logits: torch.Tensor, k: int) -> torch.Tensor:
    """d log P(sum = k) / d log p_i = P(z_i = 1 | sum = k), by autograd."""
    log_p = F.logsigmoid(logits).detach().requires_grad_()
    log_q = F.logsigmoid(-logits).detach()
    table = torch_log_pr_exactly_k(log_p, log_q, k)
    (grad,) = torch.autograd.grad(table[:, -1, k + 1].sum(), log_p)
    return grad


def torch_sample(logits: torch.Tensor, k: int) -> torch.Tensor:
    """One exact draw per batch row: the table, then z_n, ..., z_1 in turn."""
    with torch.no_grad():
        log_p = F.logsigmoid(logits)
        table = torch_log_pr_exactly_k(log_p, F.logsigmoid(-logits), k)
        batch, n = logits.shape
        left = torch.full((batch, 1), k, dtype=torch.long)
        z = torch.zeros_like(logits)
        uniforms = torch.rand(batch, n, dtype=logits.dtype)
        for i in range(n, 0, -1):
            before = table[:, i - 1].gather(1, left)  # column j: count j - 1
            after = table[:, i].gather(1, left + 1)
            prob_on = torch.exp(before[:, 0] + log_p[:, i - 1] - after[:, 0])
            on = uniforms[:, i - 1] < prob_on
            z[:, i - 1] = on.to(z.dtype)
            left = left - on.long()[:, None]
        return z


def torch_gumbel_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    uniform = torch.rand_like(logits).clamp(min=torch.finfo(logits.dtype).tiny)
    keys = logits - torch.log(-torch.log(uniform))
    return torch.zeros_like(logits).scatter_(-1, keys.topk(k, dim=-1).indices, 1.0)


# ----------------------------------------------------------------------------- JAX


def _jax_table(log_p: jax.Array, log_q: jax.Array, k: int):
    batch = log_p.shape[0]
    first = jnp.full((batch, k + 2), _SENTINEL, log_p.dtype).at[:, 1].set(0.0)
    sentinel = jnp.full((batch, 1), _SENTINEL, log_p.dtype)

    def step(state, probs):
        on, off = probs
        new = jnp.concatenate(
            [sentinel, jnp.logaddexp(state[:, :-1] + on[:, None], state[:, 1:] + off[:, None])],
            axis=1,
        )
        return new, state

    last, before = lax.scan(step, first, (log_p.T, log_q.T))
    return last, before  # before[i] = row i, i = 0..n-1


@partial(jax.jit, static_argnums=1)
def jax_marginals(logits: jax.Array, k: int) -> jax.Array:
    log_q = jax.nn.log_sigmoid(-logits)

    def log_pr(log_p):
        last, _ = _jax_table(log_p, log_q, k)
        return last[:, k + 1].sum()

    return jax.grad(log_pr)(jax.nn.log_sigmoid(logits))


@partial(jax.jit, static_argnums=2)
def jax_sample(key: jax.Array, logits: jax.Array, k: int) -> jax.Array:
    log_p = jax.nn.log_sigmoid(logits)
    last, before = _jax_table(log_p, jax.nn.log_sigmoid(-logits), k)
    after = jnp.concatenate([before[1:], last[None]], axis=0)
    batch, n = logits.shape
    uniforms = jax.random.uniform(key, (n, batch), logits.dtype)

    def step(left, inputs):
        row_before, row_after, on_prob, u = inputs
        b = jnp.take_along_axis(row_before, left[:, None], axis=1)[:, 0]
        a = jnp.take_along_axis(row_after, left[:, None] + 1, axis=1)[:, 0]
        on = u < jnp.exp(b + on_prob - a)
        return left - on.astype(left.dtype), on.astype(logits.dtype)

    left = jnp.full((batch,), k, jnp.int32)
    _, z = lax.scan(step, left, (before, after, log_p.T, uniforms), reverse=True)
    return z.T


@partial(jax.jit, static_argnums=2)
def jax_gumbel_top_k(key: jax.Array, logits: jax.Array, k: int) -> jax.Array:
    keys = logits + jax.random.gumbel(key, logits.shape, logits.dtype)
    _, indices = lax.top_k(keys, k)
    rows = jnp.arange(logits.shape[0])[:, None]
    return jnp.zeros_like(logits).at[rows, indices].set(1.0)
