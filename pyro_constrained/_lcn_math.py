"""The conditional-Gaussian math of :class:`~pyro_constrained.LinearConstrainedNormal` that
is not a method: the whitened projection its log-density is, the autograd Function that
differentiates that log-density by hand, and the KL divergence between two of them.

The math: ``docs/distributions/linear_constrained_normal.md``.
"""

from __future__ import annotations

import math

import torch

from pyro_constrained.linear_constraint import _combine_rows, _row_sorted_qr, _rows_times


def _whitened_projection(
    value: torch.Tensor, loc: torch.Tensor, scale: torch.Tensor, basis_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, (I - Q Q^T) w)`` with ``w = L^{-1} (z - loc)``, ``L = diag(scale)``.

    On the subspace, ``L^{-1} (z - mu_bar) = (I - Q Q^T) L^{-1} (z - loc)``: an orthogonal
    projection in whitened coordinates, which needs neither ``mu_bar`` (two refinement
    passes) nor ``k``, and is as accurate as the difference from ``mu_bar``.
    """
    whitened = (value - loc) / scale
    return whitened, whitened - _combine_rows(_rows_times(basis_t, whitened), basis_t)


def _log_density_gradients(value, loc, scale, basis_t) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d log p / d loc, d log p / d s)``, ``u / s`` and ``(u (2 w - u) + h - 1) / s``
    (see :class:`_ProjectedLogDensity`); ``d log p / d z = -u / s``."""
    whitened, projected = _whitened_projection(value, loc, scale, basis_t)
    leverage = basis_t.square().sum(-2)
    d_loc = projected / scale
    d_scale = torch.addcmul(leverage - 1, projected, 2 * whitened - projected) / scale
    return d_loc, d_scale


class _ProjectedLogDensity(torch.autograd.Function):
    r"""``log p(z) = -1/2 ||(I - Q Q^T) w||^2 + log_normalizer``, ``w = (z - loc) / s``, for
    a diagonal scale, with a hand-written backward.

    Why: differentiating this through the recorded factorisation ``(A diag(s))^T = Q R``
    records the row sort, the QR and their backward nodes, a dozen small matrix products
    whose per-op overhead dominates a training step at these sizes (measurements in
    ``benchmarks/README.md``), while the gradient needs no derivative of the QR. With
    ``u = (I - Q Q^T) w`` and the leverages ``h_i = ||Q_i||^2`` (``diag Q Q^T``):

    - ``d log p / d loc = u / s`` and ``d log p / d z = -u / s``;
    - ``d log p / d s = (u (2 w - u) + h - 1) / s`` (elementwise).

    Derivation: ``Q Q^T`` projects onto the range of ``M = diag(s) A^T``, whose derivative
    gives ``d(1/2 w^T P w) = -u^T dM c + u^T dw`` with ``P = I - Q Q^T`` and
    ``c = M^+ w``; ``M c = Q Q^T w = w - u`` turns the first term into
    ``-sum ds_i u_i (w_i - u_i) / s_i``, and ``dw_i = -w_i ds_i / s_i`` the second into
    ``-sum ds_i u_i w_i / s_i``. ``log_normalizer = sum log|R_ii| - sum log s_i + const``
    and ``d sum log|R_ii| = 1/2 d log det(M^T M) = tr(M^+ dM) = sum ds_i h_i / s_i``.
    Without constraint (``Q = 0``) these are the gradients of ``log N(z; loc, s^2)``.

    ``basis_t`` (``Q^T``) and ``log_normalizer`` come from the detached scale; the scale's
    gradient is the formula above. Values off the subspace (``off_subspace``) score
    ``-inf`` with zero gradient, as a ``torch.where`` would give.

    Written for ``torch.func`` as well (``setup_context``, a generated vmap rule and a
    ``jvp``), so ``grad``, ``vmap``, ``jacrev``, ``jacfwd`` and ``hessian`` run it. Second
    derivatives (``create_graph=True``: Laplace approximations, Hessians; ``torch.func``,
    which always builds the graph) differentiate the backward itself: there it takes ``Q``
    from the factorisation of the scale recorded by autograd (``A``, an input that needs no
    gradient, is what that factorisation needs), so the formula above, an exact function of
    ``(z, loc, s)``, has exact derivatives too.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(value, loc, scale, A, basis_t, log_normalizer, off_subspace):
        _, projected = _whitened_projection(value, loc, scale, basis_t)
        log_prob = torch.add(log_normalizer, projected.square().sum(-1), alpha=-0.5)
        if off_subspace is not None:
            log_prob = log_prob.masked_fill(off_subspace, -math.inf)
        return log_prob

    @staticmethod
    def setup_context(ctx, inputs, output):
        value, loc, scale, A, basis_t, _, off_subspace = inputs
        ctx.save_for_backward(value, loc, scale, A, basis_t, off_subspace)
        ctx.save_for_forward(value, loc, scale, A, basis_t, off_subspace)

    @staticmethod
    def backward(ctx, grad):
        value, loc, scale, A, basis_t, off_subspace = ctx.saved_tensors
        if off_subspace is not None:
            grad = grad.masked_fill(off_subspace, 0.0)
        if torch.is_grad_enabled():
            # The gradient will itself be differentiated: Q as a function of the scale.
            basis_t = _row_sorted_qr(scale.unsqueeze(-1) * A.mT)[0].mT
        d_loc, d_scale = _log_density_gradients(value, loc, scale, basis_t)
        grad = grad.unsqueeze(-1)
        needs_value, needs_loc, needs_scale = ctx.needs_input_grad[:3]
        return (
            (-grad * d_loc).sum_to_size(value.shape) if needs_value else None,
            (grad * d_loc).sum_to_size(loc.shape) if needs_loc else None,
            (grad * d_scale).sum_to_size(scale.shape) if needs_scale else None,
            None,
            None,
            None,
            None,
        )

    @staticmethod
    def jvp(ctx, value_dot, loc_dot, scale_dot, *constant_dots):
        value, loc, scale, _, basis_t, off_subspace = ctx.saved_tensors
        d_loc, d_scale = _log_density_gradients(value, loc, scale, basis_t)
        total = torch.zeros_like(d_loc)
        if value_dot is not None:
            total = total - d_loc * value_dot
        if loc_dot is not None:
            total = total + d_loc * loc_dot
        if scale_dot is not None:
            total = total + d_scale * scale_dot
        total = total.sum(-1)
        if off_subspace is not None:
            total = total.masked_fill(off_subspace, 0.0)
        return total


def _same_constraint(p, q) -> None:
    if p.event_shape != q.event_shape:
        raise ValueError(f"KL needs the same n, got {p.event_shape} and {q.event_shape}")
    try:
        same = bool((p.A == q.A).all()) and bool((p.k == q.k).all())
    except RuntimeError:
        same = False
    if not same:
        raise ValueError(
            "KL between LinearConstrainedNormals needs the same A and k (different affine "
            "subspaces make the KL infinite or undefined)"
        )


def kl_linear_constrained_normal(p, q) -> torch.Tensor:
    """``KL(p || q) = -H_p - E_p[log q(z)]`` for two with the same A and k.

    ``E_p[(z - mu_bar_q)^T Sigma_q^{-1} (z - mu_bar_q)] = tr(Sigma_q^{-1} Sigma_bar_p)
    + (mu_bar_p - mu_bar_q)^T Sigma_q^{-1} (mu_bar_p - mu_bar_q)``, where, with
    ``Sigma_bar_p = (L_p N_p)(L_p N_p)^T`` (see ``variance``),
    ``tr(Sigma_q^{-1} Sigma_bar_p) = ||L_q^{-1} L_p N_p||_F^2``, a sum of squares:
    ``sum_i Sigma_bar_p,ii / s_q,i^2`` when q's covariance is diagonal (O(n a^2) when p's
    is too), O(n^3) otherwise.
    """
    _same_constraint(p, q)
    mean_diff = p.mean - q.mean
    if q._diagonal:
        q_variance = q.scale.square()
        trace = (p._variance() / q_variance).sum(-1)
        maha = (mean_diff.square() / q_variance).sum(-1)
    else:
        p_factor, p_correction = p._second_moment_factors
        q_tril = q.scale_tril

        def whiten(matrix: torch.Tensor) -> torch.Tensor:
            batch = torch.broadcast_shapes(q_tril.shape[:-2], matrix.shape[:-2])
            return torch.linalg.solve_triangular(
                q_tril.expand(batch + q_tril.shape[-2:]),
                matrix.expand(batch + matrix.shape[-2:]),
                upper=False,
            )

        trace = whiten(p_factor).square().sum((-2, -1)) + whiten(p_correction.mT).square().sum(
            (-2, -1)
        )
        maha = whiten(mean_diff.unsqueeze(-1)).squeeze(-1).square().sum(-1)
    cross_entropy = 0.5 * (trace + maha) - q._log_normalizer
    return cross_entropy - p.entropy()
