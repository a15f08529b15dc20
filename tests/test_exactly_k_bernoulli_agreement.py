"""pyro_constrained and numpyro_constrained ExactlyKBernoulli agree on identical inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from numpyro.distributions.kl import kl_divergence as jax_kl
from torch.distributions import kl_divergence as torch_kl

import numpyro_constrained
import pyro_constrained
from numpyro_constrained import losses as jax_losses
from pyro_constrained import losses as torch_losses

INF = math.inf
LOGITS = np.array(
    [
        [0.5, -1.0, 2.0, 0.0, -0.3, 1.1],
        [INF, -INF, 1.0, -1.5, 0.7, 3.0],
        [-2.0, 4.0, -INF, 0.2, 0.2, -0.6],
    ]
)
OTHER = np.array(
    [
        [0.1, 0.3, -2.0, 1.0, 0.0, -0.5],
        [INF, 0.0, 1.0, 2.0, -0.2, 0.4],
        [1.0, -3.0, 0.5, 0.2, -1.0, 2.0],
    ]
)
KS = np.array([2, 3, 1])
VALUES = np.array(
    [[1.0, 0.0, 1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
)


# The user-config variant (x64 off, optimised XLA) runs with the slow tests: float32 with
# x64 on compares the same outputs in the default run, at half its cost.
@pytest.mark.user_config_slow
@pytest.mark.parametrize(
    "torch_dtype, jax_dtype, tolerance",
    [(torch.float64, jnp.float64, 1e-12), (torch.float32, jnp.float32, 2e-5)],
)
def test_torch_and_jax_agree(torch_dtype, jax_dtype, tolerance):
    t_logits = torch.tensor(LOGITS, dtype=torch_dtype, requires_grad=True)
    j_logits = jnp.asarray(LOGITS, dtype=jax_dtype)
    t = pyro_constrained.ExactlyKBernoulli(logits=t_logits, k=torch.tensor(KS))
    j = numpyro_constrained.ExactlyKBernoulli(logits=j_logits, k=jnp.asarray(KS))
    t_other = pyro_constrained.ExactlyKBernoulli(
        logits=torch.tensor(OTHER, dtype=torch_dtype), k=torch.tensor(KS)
    )
    j_other = numpyro_constrained.ExactlyKBernoulli(
        logits=jnp.asarray(OTHER, dtype=jax_dtype), k=jnp.asarray(KS)
    )
    t_values = torch.tensor(VALUES, dtype=torch_dtype)
    j_values = jnp.asarray(VALUES, dtype=jax_dtype)
    pairs = {
        "log_prob": (t.log_prob(t_values), j.log_prob(j_values)),
        "mean": (t.mean, j.mean),
        "variance": (t.variance, j.variance),
        "entropy": (t.entropy(), j.entropy()),
        "log_constraint_prob": (t.log_constraint_prob(), j.log_constraint_prob()),
        "mode": (t.mode, j.mode),
        "kl": (torch_kl(t, t_other), jax_kl(j, j_other)),
        "l1": (
            torch_losses.expected_l1_loss(t, t_values),
            jax_losses.expected_l1_loss(j, j_values),
        ),
        "l2": (
            torch_losses.expected_l2_loss(t, t_values),
            jax_losses.expected_l2_loss(j, j_values),
        ),
    }
    for name, (t_value, j_value) in pairs.items():
        assert j_value.dtype == jax_dtype, name
        assert t_value.dtype == torch_dtype, name
        np.testing.assert_allclose(
            t_value.detach().numpy(), np.asarray(j_value), atol=tolerance, err_msg=name
        )

    # Gradients, including the second derivative SVI takes through a straight-through sample.
    weights = np.arange(6.0)
    t_objective = t.entropy().sum() + (t.mean * torch.tensor(weights, dtype=torch_dtype)).sum()
    (t_grad,) = torch.autograd.grad(t_objective, t_logits)

    def j_objective(x):
        d = numpyro_constrained.ExactlyKBernoulli(logits=x, k=jnp.asarray(KS))
        return d.entropy().sum() + (d.mean * jnp.asarray(weights, dtype=jax_dtype)).sum()

    j_grad = jax.grad(j_objective)(j_logits)
    np.testing.assert_allclose(t_grad.numpy(), np.asarray(j_grad), atol=10 * tolerance)
