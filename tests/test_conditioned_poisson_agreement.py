"""pyro_constrained and numpyro_constrained ConditionedPoisson agree on identical inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from numpyro.distributions.kl import kl_divergence as jax_kl_divergence

import numpyro_constrained
import pyro_constrained
from numpyro_constrained import losses as jax_losses
from pyro_constrained import losses as torch_losses

RNG = np.random.default_rng(11)
RATE = RNG.gamma(1.0, size=(3, 5)) + 0.05
OTHER_RATE = RNG.gamma(1.0, size=(3, 5)) + 0.05
K = np.array([0, 4, 9])
VALUE = np.stack([RNG.multinomial(k, r / r.sum()) for k, r in zip(K, RATE, strict=True)])
WEIGHTS = RNG.normal(size=(2, 3, 5))

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}
JAX_DTYPES = {"float32": jnp.float32, "float64": jnp.float64}


def _torch_results(dtype):
    rate = torch.tensor(RATE, dtype=dtype, requires_grad=True)
    value = torch.tensor(VALUE, dtype=dtype, requires_grad=True)
    d = pyro_constrained.ConditionedPoisson(rate, k=torch.tensor(K))
    q = pyro_constrained.ConditionedPoisson(
        torch.tensor(OTHER_RATE, dtype=dtype), k=torch.tensor(K)
    )
    z = d.rsample((2,))
    results = {
        "log_prob": d.log_prob(value),
        "mean": d.mean,
        "variance": d.variance,
        "entropy": d.entropy(),
        "log_constraint_prob": d.log_constraint_prob(),
        "kl": torch.distributions.kl_divergence(d, q),
        "l1": torch_losses.expected_l1_loss(d, value),
        "l2": torch_losses.expected_l2_loss(d, value),
    }
    scalar = sum(r.sum() for r in results.values()) + (torch.tensor(WEIGHTS, dtype=dtype) * z).sum()
    grad_rate, grad_value = torch.autograd.grad(scalar, (rate, value))
    out = {name: r.detach().numpy() for name, r in results.items()}
    out["grad_rate"], out["grad_value"] = grad_rate.numpy(), grad_value.numpy()
    out["sample_dtype"] = z.dtype
    return out


def _jax_results(dtype):
    def results(rate, value):
        d = numpyro_constrained.ConditionedPoisson(rate, k=K)
        q = numpyro_constrained.ConditionedPoisson(jnp.asarray(OTHER_RATE, dtype), k=K)
        return {
            "log_prob": d.log_prob(value),
            "mean": d.mean,
            "variance": d.variance,
            "entropy": d.entropy(),
            "log_constraint_prob": d.log_constraint_prob(),
            "kl": jax_kl_divergence(d, q),
            "l1": jax_losses.expected_l1_loss(d, value),
            "l2": jax_losses.expected_l2_loss(d, value),
        }

    def scalar(rate, value):
        z = numpyro_constrained.ConditionedPoisson(rate, k=K).sample(jax.random.PRNGKey(0), (2,))
        values = results(rate, value)
        total = sum(jnp.sum(r) for r in values.values())
        return total + jnp.sum(jnp.asarray(WEIGHTS, dtype) * z), values

    rate, value = jnp.asarray(RATE, dtype), jnp.asarray(VALUE, dtype)
    out = {}
    # Compiled whole, values and gradients in one program: eager JAX would compile every
    # primitive of the gradient separately, and a second program would compile the values
    # again.
    gradient = jax.jit(jax.grad(scalar, argnums=(0, 1), has_aux=True))
    (out["grad_rate"], out["grad_value"]), values = gradient(rate, value)
    out = {name: np.asarray(r) for name, r in values.items()} | out
    out["sample_dtype"] = (
        numpyro_constrained.ConditionedPoisson(rate, k=K).sample(jax.random.PRNGKey(1)).dtype
    )
    return out


# The user-config variant runs with the slow tests (see test_exactly_k_bernoulli_agreement).
@pytest.mark.user_config_slow
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_torch_and_jax_agree(dtype_name):
    torch_out = _torch_results(TORCH_DTYPES[dtype_name])
    jax_out = _jax_results(JAX_DTYPES[dtype_name])
    assert str(torch_out.pop("sample_dtype")).endswith(dtype_name)
    assert str(jax_out.pop("sample_dtype")) == dtype_name
    rtol, atol = (1e-4, 1e-4) if dtype_name == "float32" else (1e-10, 1e-12)
    for name, torch_value in torch_out.items():
        jax_value = np.asarray(jax_out[name])
        assert jax_value.dtype == torch_value.dtype, name
        np.testing.assert_allclose(jax_value, torch_value, rtol=rtol, atol=atol, err_msg=name)
