"""Gradient estimators for ``d/d theta E_{z ~ p_theta(z | constraint)} l(z, y)``.

Each estimator is a function ``(problem, num_samples) -> Tensor (num_samples, p)``: one
independent estimate per row, ``p`` the number of parameters (flattened in the order of
``problem.params``). They draw from the global torch RNG (seed it with
``pyro.set_rng_seed``).

Most are straight-through estimators (docs/distributions/gradient_estimators.md): the forward value
is an exact sample ``z`` of the constrained distribution and the backward pass differentiates a
proxy ``m(theta)``, so the estimate is ``(d m / d theta)^T grad_z l(z, y)``:

============================  ================================================  ==========
name                          proxy ``m(theta)``                                 families
============================  ================================================  ==========
``marginal_expectation``      the library's ``rsample``: ``E[z | constraint]``  all
``pathwise``                  the library's exact Matheron sample               Gaussian
``score_function``            REINFORCE: ``l(z, y) grad log p_theta(z)``        all
``constrained_marginal``      conditional marginal pdf/pmf at the sample        all
``unconstrained_marginal``    ``E[z_i]`` ignoring the constraint (docs)         all
``unconstrained_density``     unconstrained pdf/pmf at the sample (004 Tab. 1)  all
``constrained_layer``         ``Proj(loc + scale * eps)`` (004 Table 1)         Gaussian
``random``                    none: ``N(0, I)`` noise                           all
============================  ================================================  ==========

Per-sample gradients are computed in one backward pass by giving every sample its own copy
of the parameters (a batch of ``num_samples`` identical rows): the gradient of the summed
surrogate with respect to row ``j`` is sample ``j``'s estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from experiments.estimator_study.synthetic import (
    SyntheticProblem,
    pointwise_loss,
    pointwise_loss_gradient,
    project_onto_constraint,
)

Params = Mapping[str, torch.Tensor]


def per_sample_gradients(
    params: Params, num_samples: int, surrogate: Callable[[Params], torch.Tensor]
) -> torch.Tensor:
    """Gradients of ``surrogate(rows)[j]`` with respect to row ``j`` of the parameters.

    ``rows[name]`` has shape ``(num_samples, *params[name].shape)``, every row equal to
    ``params[name]``; ``surrogate`` returns shape ``(num_samples,)`` with entry ``j``
    depending on row ``j`` only. Returns ``(num_samples, p)``.
    """
    rows = {
        name: value.detach().expand(num_samples, *value.shape).clone().requires_grad_()
        for name, value in params.items()
    }
    values = surrogate(rows)
    if values.shape != (num_samples,):
        raise ValueError(f"surrogate must return shape ({num_samples},), got {values.shape}")
    grads = torch.autograd.grad(values.sum(), list(rows.values()), allow_unused=True)
    return torch.cat(
        [
            (torch.zeros_like(row) if grad is None else grad).reshape(num_samples, -1)
            for row, grad in zip(rows.values(), grads, strict=True)
        ],
        -1,
    )


def _exact_samples(problem: SyntheticProblem, num_samples: int) -> torch.Tensor:
    with torch.no_grad():
        return problem.constrained(problem.params).sample((num_samples,))


def _proxy_estimates(
    problem: SyntheticProblem,
    num_samples: int,
    proxy: Callable[[Params, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``(d proxy(theta, z_j) / d theta)^T grad_z l(z_j, y)`` for exact samples ``z_j``."""
    samples = _exact_samples(problem, num_samples)
    loss_gradient = pointwise_loss_gradient(samples, problem.target, problem.loss)
    return per_sample_gradients(
        problem.params,
        num_samples,
        lambda rows: (proxy(rows, samples) * loss_gradient).sum(-1),
    )


def marginal_expectation(problem: SyntheticProblem, num_samples: int) -> torch.Tensor:
    """The library's default: ``rsample`` with gradient through ``E[z | constraint]``."""
    return per_sample_gradients(
        problem.params,
        num_samples,
        lambda rows: pointwise_loss(
            problem.constrained(rows).rsample(), problem.target, problem.loss
        ),
    )


def pathwise(problem: SyntheticProblem, num_samples: int) -> torch.Tensor:
    """The library's exact reparameterisation (Gaussian only): Matheron's rule
    ``z = x + K (k - A x)``, ``x = loc + scale * eps``, differentiated through. Unbiased.
    The same estimator as 004's "constrained reparametrization"."""
    if problem.family != "gaussian":
        raise ValueError(f"pathwise needs a Gaussian problem, got {problem.family!r}")
    return per_sample_gradients(
        problem.params,
        num_samples,
        lambda rows: pointwise_loss(
            problem.constrained(rows, grad_estimator="pathwise").rsample(),
            problem.target,
            problem.loss,
        ),
    )


def score_function(problem: SyntheticProblem, num_samples: int) -> torch.Tensor:
    """REINFORCE without a baseline: ``l(z, y) grad_theta log p_theta(z)``. Unbiased.

    For the Gaussian, ``log_prob`` is a density on the fixed subspace ``A z = k``; the base
    measure does not depend on ``theta``, so the score has mean zero as it must.
    """
    samples = _exact_samples(problem, num_samples)
    loss = pointwise_loss(samples, problem.target, problem.loss)
    return per_sample_gradients(
        problem.params,
        num_samples,
        lambda rows: loss * problem.constrained(rows).log_prob(samples),
    )


def constrained_marginal(problem: SyntheticProblem, num_samples: int) -> torch.Tensor:
    """Proxy: the conditional marginal's pdf/pmf at the sample, ``p_theta(z_i | constraint)``
    (``Bernoulli(mu)``, ``Normal(mu_bar, sqrt(diag Sigma_bar))``, ``Binomial(k, p)``)."""
    return _proxy_estimates(
        problem,
        num_samples,
        lambda rows, samples: problem.constrained(rows).marginals.log_prob(samples).exp(),
    )


def unconstrained_marginal(problem: SyntheticProblem, num_samples: int) -> torch.Tensor:
    """Proxy: the mean ``E[z_i]`` of the variables before conditioning
    (docs/distributions/gradient_estimators.md): ``sigmoid(logits)``, ``loc``, ``rate``."""
    return _proxy_estimates(
        problem, num_samples, lambda rows, samples: problem.unconstrained(rows).mean
    )


def unconstrained_density(problem: SyntheticProblem, num_samples: int) -> torch.Tensor:
    """Proxy: the unconstrained marginal pdf/pmf at the sample, ``p_theta(z_i)`` (the
    literal reading of "Unconstrained Marginal" in Table 1 of 004)."""
    return _proxy_estimates(
        problem,
        num_samples,
        lambda rows, samples: problem.unconstrained(rows).log_prob(samples).exp(),
    )


def constrained_layer(problem: SyntheticProblem, num_samples: int) -> torch.Tensor:
    """Reparameterised unconstrained sample, then the Euclidean projection onto
    ``A z = k`` (004 Table 1, Stoian et al.'s layer), differentiated through.

    It is the exact gradient of ``E l(Proj(x), y)`` for ``x ~ N(loc, diag(scale^2))``, a
    different distribution from the conditional unless all scales are equal. Even then only
    the gradient in ``loc`` is unbiased: moving a single scale makes them unequal, where
    projection and conditioning part ways.
    """
    if problem.family != "gaussian":
        raise ValueError(f"constrained_layer needs a Gaussian problem, got {problem.family!r}")
    noise = torch.randn(num_samples, problem.n, dtype=problem.target.dtype)
    return per_sample_gradients(
        problem.params,
        num_samples,
        lambda rows: pointwise_loss(
            project_onto_constraint(rows["loc"] + rows["scale"] * noise, problem.A, problem.k),
            problem.target,
            problem.loss,
        ),
    )


def random(problem: SyntheticProblem, num_samples: int) -> torch.Tensor:
    """A direction chosen at random: ``N(0, I_p)``, the papers' reference for "no signal"."""
    return torch.randn(num_samples, problem.num_params, dtype=problem.target.dtype)


ESTIMATORS: dict[str, Callable[[SyntheticProblem, int], torch.Tensor]] = {
    "marginal_expectation": marginal_expectation,
    "pathwise": pathwise,
    "score_function": score_function,
    "constrained_marginal": constrained_marginal,
    "unconstrained_marginal": unconstrained_marginal,
    "unconstrained_density": unconstrained_density,
    "constrained_layer": constrained_layer,
    "random": random,
}

GAUSSIAN_ONLY = frozenset({"pathwise", "constrained_layer"})


def estimators_for(family: str) -> list[str]:
    """Names of the estimators that apply to a distribution family, in display order."""
    return [name for name in ESTIMATORS if family == "gaussian" or name not in GAUSSIAN_ONLY]
