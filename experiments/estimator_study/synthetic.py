"""The papers' synthetic problems: an identity decoder and a closed-form expected loss.

A problem fixes a constrained distribution's parameters ``theta``, a target ``y`` and a
point-wise loss ``l(z, y) = ||z - y||_1`` or ``||z - y||_2^2``; the quantity whose gradient
the estimators approximate is ``L(theta) = E_{z ~ p_theta(z | constraint)} l(z, y)``, and
the exact gradient comes from autodiff of the library's closed-form expected loss
(the closed forms in ``docs/distributions/``). ``theta`` is, as in the papers:

- Bernoulli: the logits (n values), with ``y ~ N(0, I)`` as in SIMPLE section 4.1;
- Gaussian: ``(loc, scale)`` of a diagonal Gaussian (2n values), conditioned on ``A z = k``;
- Poisson: the rates (n values), conditioned on ``sum z = k``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributions as tdist

import pyro_constrained
from pyro_constrained import losses

LOSSES = ("l1", "l2")
FAMILIES = ("bernoulli", "gaussian", "poisson")


def pointwise_loss(z: torch.Tensor, target: torch.Tensor, loss: str) -> torch.Tensor:
    """``||z - y||_1`` or ``||z - y||_2^2`` summed over the last dimension."""
    if loss == "l1":
        return (z - target).abs().sum(-1)
    if loss == "l2":
        return (z - target).pow(2).sum(-1)
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")


def pointwise_loss_gradient(z: torch.Tensor, target: torch.Tensor, loss: str) -> torch.Tensor:
    """``d l(z, y) / d z``: ``sign(z - y)`` (0 at ties, the usual subgradient) or ``2 (z - y)``."""
    if loss == "l1":
        return torch.sign(z - target)
    if loss == "l2":
        return 2.0 * (z - target)
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")


def project_onto_constraint(x: torch.Tensor, A: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of ``x`` onto ``{z : A z = k}``: ``x - A^T (A A^T)^{-1} (A x - k)``.

    This is the "constrained layer" of the papers' Table 1: it enforces the constraint but
    ignores the covariance (Matheron's rule weights the correction by ``Sigma`` instead).
    """
    residual = x @ A.mT - k
    correction = torch.linalg.solve(A @ A.mT, residual.unsqueeze(-1)).squeeze(-1)
    return x - correction @ A


@dataclass(frozen=True)
class SyntheticProblem:
    """One synthetic problem: parameters ``theta`` (named tensors), a target, a loss.

    ``distribution`` labels the problem in the study's CSV; ``family`` says which
    constrained distribution it uses. ``k`` is an int (Bernoulli, Poisson) or a tensor of
    right-hand sides (Gaussian, with constraint matrix ``A``).
    """

    distribution: str
    family: str
    loss: str
    params: Mapping[str, torch.Tensor]
    target: torch.Tensor
    k: int | torch.Tensor
    A: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return self.target.shape[-1]

    @property
    def num_params(self) -> int:
        return sum(value.numel() for value in self.params.values())

    def constrained(self, params: Mapping[str, torch.Tensor], **options):
        """The library's constrained distribution at ``params`` (batched or not)."""
        if self.family == "bernoulli":
            return pyro_constrained.ExactlyKBernoulli(logits=params["logits"], k=self.k)
        if self.family == "gaussian":
            return pyro_constrained.LinearConstrainedNormal(
                params["loc"], params["scale"], A=self.A, k=self.k, **options
            )
        return pyro_constrained.ConditionedPoisson(params["rate"], k=self.k)

    def unconstrained(self, params: Mapping[str, torch.Tensor]) -> tdist.Distribution:
        """The independent variables before conditioning (for the baselines that ignore it)."""
        if self.family == "bernoulli":
            return tdist.Bernoulli(logits=params["logits"])
        if self.family == "gaussian":
            return tdist.Normal(params["loc"], params["scale"])
        return tdist.Poisson(params["rate"])

    def expected_loss(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``E l(z, y)`` in closed form (the library's ``losses`` module)."""
        closed_form = losses.expected_l1_loss if self.loss == "l1" else losses.expected_l2_loss
        return closed_form(self.constrained(params), self.target)

    def true_gradient(self) -> torch.Tensor:
        """``d E l(z, y) / d theta`` by autodiff of the closed form, flattened to (p,)."""
        leaves = {
            name: value.detach().clone().requires_grad_() for name, value in self.params.items()
        }
        grads = torch.autograd.grad(self.expected_loss(leaves).sum(), list(leaves.values()))
        return torch.cat([grad.reshape(-1) for grad in grads])


def _normal(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


def bernoulli_problem(n: int, k: int, loss: str, generator: torch.Generator) -> SyntheticProblem:
    """SIMPLE's problem: logits ``~ N(0, I)``, target ``b ~ N(0, I)`` (real-valued; the
    closed forms hold for any real target because ``z_i^2 = z_i``)."""
    return SyntheticProblem(
        distribution="bernoulli",
        family="bernoulli",
        loss=loss,
        params={"logits": _normal(generator, n)},
        target=_normal(generator, n),
        k=k,
    )


def gaussian_problem(
    n: int, loss: str, constraint: str, generator: torch.Generator
) -> SyntheticProblem:
    """``loc ~ N(0, I)``, ``scale = exp(N(0, 0.25))`` (unequal, so that the projection and
    Matheron's rule differ), target ``y ~ N(0, I)`` and ``k = A y`` so that ``A y = k``.

    ``constraint="sum"``: ``A`` is one row of ones (sum-to-k). ``"general"``: ``A`` has
    ``max(2, n // 4)`` rows of i.i.d. ``N(0, 1)`` entries (full rank almost surely).
    """
    if constraint == "sum":
        A = torch.ones(1, n, dtype=torch.float64)
    elif constraint == "general":
        A = _normal(generator, max(2, n // 4), n)
    else:
        raise ValueError(f"constraint must be 'sum' or 'general', got {constraint!r}")
    if A.shape[0] >= n:
        raise ValueError(f"n must exceed the number of constraints {A.shape[0]}, got {n}")
    loc = _normal(generator, n)
    scale = torch.exp(0.5 * _normal(generator, n))
    target = _normal(generator, n)
    return SyntheticProblem(
        distribution=f"gaussian_{'sum_to_k' if constraint == 'sum' else 'general_A'}",
        family="gaussian",
        loss=loss,
        params={"loc": loc, "scale": scale},
        target=target,
        k=A @ target,
        A=A,
    )


def poisson_problem(n: int, k: int, loss: str, generator: torch.Generator) -> SyntheticProblem:
    """``rate = exp(N(0, I))``, an integer target with ``sum y = k`` drawn from
    ``Multinomial(k, softmax(N(0, I)))``; ``k = n`` in the study, as in the workshop paper."""
    rate = torch.exp(_normal(generator, n))
    target_probs = torch.softmax(_normal(generator, n), -1)
    counts = torch.multinomial(target_probs, k, replacement=True, generator=generator)
    target = torch.bincount(counts, minlength=n).to(torch.float64)
    return SyntheticProblem(
        distribution="poisson",
        family="poisson",
        loss=loss,
        params={"rate": rate},
        target=target,
        k=k,
    )
