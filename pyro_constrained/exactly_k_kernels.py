"""Numerical kernels of ExactlyKBernoulli (MATH.md section 1), PyTorch.

Pure functions of ``logits`` (shape ``batch + (n,)``, entries finite or ``-inf``), ``k``
(integer tensor of shape ``batch``, ``0 <= k <= number of finite logits``) and ``k_max`` (a
Python int, ``max(k) <= k_max <= n``; tables are truncated at it). The distribution calls
only these functions; ``+inf`` logits and feasibility are handled by the caller.

This version is sequential (O(n k_max) work, O(n) depth). The table it builds is the
Poisson-binomial pmf of the *tilted* Bernoullis, in log space,

    T[i, j] = log P(z_1 + ... + z_i = j),   z_l ~ Bernoulli(sigmoid(logits_l + c)),

with the tilt ``c`` chosen so that the expected count is about k. Entries near j = k then
stay near 0 whatever n is, so float32 keeps its relative precision (a table of
``log e_j`` would reach magnitudes of sum(logits) and lose it). The normaliser follows from

    log e_k(exp logits) = T[n, k] + sum_l softplus(logits_l + c) - k c.
"""

import torch

_BISECTION_STEPS = 40  # the bracket shrinks 1e12-fold; the tilt need not be exact


def _softplus(x: torch.Tensor) -> torch.Tensor:
    # F.softplus is the identity above a threshold (20 by default): off by up to 2e-9, not
    # float64-exact. relu(x) + log1p(exp(-|x|)) is exact but its autograd derivative is
    # wrong at x = 0 (the kinks of relu and |x| do not cancel there). logaddexp is exact,
    # and its derivatives are right for the finite inputs it gets here.
    return torch.logaddexp(x, torch.zeros_like(x))


def _logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """log(exp a + exp b), with first and second derivatives finite where a or b is -inf.

    torch.logaddexp computes exp(a - b) in its backward pass, which is NaN when both are
    -inf and makes second derivatives NaN; here no intermediate is ever NaN.
    """
    a_larger = a >= b
    high = torch.where(a_larger, a, b)
    low = torch.where(a_larger, b, a)
    finite = high > -torch.inf
    high_safe = torch.where(finite, high, torch.zeros_like(high))
    gap = torch.where(finite, low - high_safe, torch.full_like(low, -torch.inf))
    return torch.where(finite, high_safe + torch.log1p(torch.exp(gap)), high)


def tilt(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A constant c per batch element (shape ``batch + (1,)``, no gradient) with
    sum_i sigmoid(logits_i + c) ~= k, found by bisection on a bracket that provably holds it.

    The target count is clamped to [1/2, m - 1/2] (m = number of finite logits), since the
    exact solution is infinite for k = 0 and k = m; any finite c leaves the distribution
    unchanged, so the clamp costs nothing.
    """
    with torch.no_grad():
        logits = logits.detach()
        finite = torch.isfinite(logits)
        num_finite = finite.sum(-1).to(logits.dtype)
        target = torch.minimum(k.to(logits.dtype).clamp(min=0.5), num_finite - 0.5)
        target = torch.where(num_finite > 0, target, torch.zeros_like(target))
        safe = torch.where(finite, logits, torch.zeros_like(logits))
        largest = torch.where(finite, logits, torch.full_like(logits, -torch.inf)).amax(-1)
        smallest = torch.where(finite, logits, torch.full_like(logits, torch.inf)).amin(-1)
        m = num_finite.clamp(min=1)
        t = target.clamp(min=0.25)  # only guards log(0) when m = 0
        # sum sigmoid(x_i + c) <= m exp(max x + c) and >= m (1 - exp(-(min x + c))).
        low = torch.log(t / m) - largest
        high = torch.log(m / (m - torch.minimum(t, m - 0.25))) - smallest
        low = torch.where(num_finite > 0, low, torch.zeros_like(low))
        high = torch.where(num_finite > 0, high, torch.zeros_like(high))
        for _ in range(_BISECTION_STEPS):
            middle = 0.5 * (low + high)
            count = torch.where(finite, torch.sigmoid(safe + middle[..., None]), 0.0).sum(-1)
            too_many = count > target
            high = torch.where(too_many, middle, high)
            low = torch.where(too_many, low, middle)
        return (0.5 * (low + high))[..., None]


def _tilted_log_probs(logits: torch.Tensor, k: torch.Tensor):
    """(c, log p, log(1 - p), sum softplus) of the tilted Bernoullis; -inf logits give
    log p = -inf and log(1 - p) = 0 with zero gradient."""
    c = tilt(logits, k)
    finite = torch.isfinite(logits)
    shifted = torch.where(finite, logits, torch.zeros_like(logits)) + c
    log_on = torch.where(finite, -_softplus(-shifted), torch.full_like(shifted, -torch.inf))
    log_off = torch.where(finite, -_softplus(shifted), torch.zeros_like(shifted))
    softplus_sum = torch.where(finite, _softplus(shifted), torch.zeros_like(shifted)).sum(-1)
    return c[..., 0], log_on, log_off, softplus_sum


def _tables(log_on: torch.Tensor, log_off: torch.Tensor, k_max: int) -> list[torch.Tensor]:
    """[T[0], ..., T[n]], each of shape ``batch + (k_max + 1,)``."""
    batch = log_on.shape[:-1]
    table = torch.full(batch + (k_max + 1,), -torch.inf, dtype=log_on.dtype, device=log_on.device)
    table[..., 0] = 0.0
    tables = [table]
    minus_inf = torch.full(batch + (1,), -torch.inf, dtype=log_on.dtype, device=log_on.device)
    for i in range(log_on.shape[-1]):
        one_more = torch.cat([minus_inf, table[..., :-1]], dim=-1) + log_on[..., i : i + 1]
        table = _logaddexp(table + log_off[..., i : i + 1], one_more)
        tables.append(table)
    return tables


def log_normalizer(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """log e_k(exp logits), shape ``batch``; twice differentiable without NaN."""
    c, log_on, log_off, softplus_sum = _tilted_log_probs(logits, k)
    table = _tables(log_on, log_off, k_max)[-1]
    log_pk = table.gather(-1, k[..., None].long())[..., 0]
    return log_pk + softplus_sum - k.to(logits.dtype) * c


def marginals(logits: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """mu_i = P(z_i = 1 | sum z = k) = d log e_k / d logits_i, shape ``batch + (n,)``.

    Differentiable again when ``logits`` requires grad (the graph is kept).
    """
    needs_graph = logits.requires_grad and torch.is_grad_enabled()
    with torch.enable_grad():
        x = logits if needs_graph else logits.detach().requires_grad_()
        (mu,) = torch.autograd.grad(log_normalizer(x, k, k_max).sum(), x, create_graph=needs_graph)
    return mu


def _draw(
    log_on: torch.Tensor,
    tables: list[torch.Tensor],
    k: torch.Tensor,
    sample_shape: torch.Size,
) -> torch.Tensor:
    """SIMPLE Algorithm 2: from i = n down to 1 with j ones left to place,
    P(z_i = 1) = exp(log p_i + T[i-1, j-1] - T[i, j])."""
    n = log_on.shape[-1]
    shape = torch.Size(sample_shape) + log_on.shape[:-1]
    left = k.long().expand(shape).clone()
    uniforms = torch.rand(shape + (n,), dtype=log_on.dtype, device=log_on.device)
    z = torch.zeros(shape + (n,), dtype=log_on.dtype, device=log_on.device)
    minus_inf = torch.tensor(-torch.inf, dtype=log_on.dtype, device=log_on.device)
    for i in range(n, 0, -1):
        before = tables[i - 1].expand(shape + tables[i - 1].shape[-1:])
        after = tables[i].expand(shape + tables[i].shape[-1:])
        log_before = before.gather(-1, (left - 1).clamp(min=0)[..., None])[..., 0]
        log_before = torch.where(left > 0, log_before, minus_inf)
        log_after = after.gather(-1, left[..., None])[..., 0]
        # A state is reached only with positive probability, so log_after is finite; when
        # z_i is forced the ratio is exactly 0 or exactly exp(0) = 1 (see _logaddexp).
        prob_on = torch.exp(log_on[..., i - 1] + log_before - log_after)
        on = uniforms[..., i - 1] < prob_on
        z[..., i - 1] = on.to(z.dtype)
        left = left - on.long()
    return z


def sample(
    logits: torch.Tensor, k: torch.Tensor, k_max: int, sample_shape: tuple[int, ...] = ()
) -> torch.Tensor:
    """Exact draws, shape ``sample_shape + batch + (n,)``, entries 0.0 / 1.0 summing to k."""
    with torch.no_grad():
        _, log_on, log_off, _ = _tilted_log_probs(logits.detach(), k)
        return _draw(log_on, _tables(log_on, log_off, k_max), k, sample_shape)


def sample_and_marginals(
    logits: torch.Tensor, k: torch.Tensor, k_max: int, sample_shape: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample(...), marginals(...)) for rsample."""
    return sample(logits, k, k_max, sample_shape), marginals(logits, k, k_max)
