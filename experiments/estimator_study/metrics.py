"""Bias, variance and error of a gradient estimator in cosine distance.

The math: ``docs/distributions/gradient_estimators.md``.


Given per-sample gradient estimates ``h_1 .. h_S`` (rows of ``estimates``) and the exact
gradient ``h_true``, with ``cd(a, b) = 1 - cos(a, b)`` and ``h_bar = mean_j h_j``:

- bias     = ``cd(h_bar, h_true)``
- variance = ``var_j cd(h_j, h_bar)`` (population variance, ddof = 0)
- error    = ``mean_j cd(h_j, h_true)``

Only directions count (a learning rate absorbs the magnitude). A zero vector has no
direction: its cosine with anything is taken as 0 (cosine distance 1), the convention of
``torch.nn.functional.cosine_similarity``; estimators return exact zeros when the sampled
loss or its gradient vanishes (e.g. a Poisson sample equal to the target).
"""

from __future__ import annotations

import torch

_EPS = 1e-300


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``1 - cos(a, b)`` over the last dimension, broadcasting the rest; 1 if either is 0."""
    a, b = torch.broadcast_tensors(a, b)
    dot = (a * b).sum(-1)
    norms = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
    cos = torch.where(norms > 0, dot / norms.clamp_min(_EPS), torch.zeros_like(dot))
    # Rounding can push |cos| a hair past 1; distances live in [0, 2].
    return 1.0 - cos.clamp(-1.0, 1.0)


def gradient_metrics(estimates: torch.Tensor, true_gradient: torch.Tensor) -> dict[str, float]:
    """Bias, variance and error (cosine distance) of ``estimates`` (S, p) against (p,)."""
    if estimates.dim() != 2:
        raise ValueError(f"estimates must have shape (samples, p), got {tuple(estimates.shape)}")
    if true_gradient.shape != estimates.shape[-1:]:
        raise ValueError(
            f"true_gradient must have shape ({estimates.shape[-1]},), "
            f"got {tuple(true_gradient.shape)}"
        )
    mean_estimate = estimates.mean(0)
    spread = cosine_distance(estimates, mean_estimate)
    return {
        "bias": float(cosine_distance(mean_estimate, true_gradient)),
        "variance": float(spread.var(correction=0)),
        "error": float(cosine_distance(estimates, true_gradient).mean()),
    }


def unbiased_bias_floor(estimates: torch.Tensor, true_gradient: torch.Tensor) -> float:
    """The bias an *unbiased* estimator shows through Monte-Carlo noise alone.

    If ``h_bar = h_true + e`` with ``e`` of covariance ``C / S``, then to second order
    ``1 - cos(h_bar, h_true) = |P e|^2 / (2 |h_true|^2)`` with ``P`` the projection
    orthogonal to ``h_true``, whose expectation is ``tr(P C P) / (2 S |h_true|^2)``.
    ``C`` is estimated from the samples. A measured bias near this floor is consistent
    with zero; a bias many times above it is real.
    """
    num_samples = estimates.shape[0]
    unit = true_gradient / torch.linalg.vector_norm(true_gradient)
    centred = estimates - estimates.mean(0)
    perpendicular = centred - (centred @ unit)[:, None] * unit
    trace = perpendicular.pow(2).sum() / (num_samples - 1)
    return float(trace / (2 * num_samples * true_gradient.pow(2).sum()))
