"""Torch and JAX LinearConstrainedNormal agree on identical inputs (float64 and float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from numpyro.distributions import kl_divergence as numpyro_kl
from numpyro.distributions.transforms import biject_to as numpyro_biject_to
from torch.distributions import biject_to as torch_biject_to
from torch.distributions import kl_divergence as torch_kl

import numpyro_constrained
import pyro_constrained
from numpyro_constrained import losses as numpyro_losses
from pyro_constrained import losses as pyro_losses
from tests.oracles import linear_gaussian as oracle

DTYPES = {
    "float64": (torch.float64, jnp.float64, 1e-12),
    "float32": (torch.float32, jnp.float32, 2e-5),
}


def both(case, dtype_name, seed=0, **kwargs):
    torch_dtype, jax_dtype, _ = DTYPES[dtype_name]
    params, *_ = oracle.random_parameters(case, n=5, a=2, seed=seed)
    if case == "diag":
        params = {**params, "loc": np.stack([params["loc"], -params["loc"]])}  # batch of 2
    torch_dist = pyro_constrained.LinearConstrainedNormal(
        **{name: torch.tensor(v, dtype=torch_dtype) for name, v in params.items()}, **kwargs
    )
    jax_dist = numpyro_constrained.LinearConstrainedNormal(
        **{name: jnp.asarray(v, dtype=jax_dtype) for name, v in params.items()}, **kwargs
    )
    return torch_dist, jax_dist


def close(torch_value, jax_value, dtype_name):
    tolerance = DTYPES[dtype_name][2]
    np.testing.assert_allclose(
        torch_value.detach().numpy(), np.asarray(jax_value), rtol=tolerance, atol=tolerance
    )


@pytest.mark.parametrize(
    ("case", "dtype_name"),
    [(case, "float64") for case in oracle.CASES] + [("diag", "float32"), ("full_cov", "float32")],
)
def test_every_quantity_agrees(case, dtype_name):
    torch_dist, jax_dist = both(case, dtype_name)
    for name in ("mean", "variance", "covariance_matrix"):
        close(getattr(torch_dist, name), getattr(jax_dist, name), dtype_name)
    close(torch_dist.entropy(), jax_dist.entropy(), dtype_name)
    # Identical noise through Matheron's rule gives identical samples.
    noise = np.random.default_rng(1).normal(size=(3,) + tuple(torch_dist.batch_shape) + (5,))
    torch_sample = torch_dist._matheron_from_noise(torch.tensor(noise, dtype=torch_dist.loc.dtype))
    jax_sample = jax_dist._matheron_from_noise(jnp.asarray(noise, dtype=jax_dist.loc.dtype))
    close(torch_sample, jax_sample, dtype_name)
    close(torch_dist.log_prob(torch_sample), jax_dist.log_prob(jax_sample), dtype_name)
    target = torch_sample[0]
    for torch_loss, jax_loss in (
        (pyro_losses.expected_l1_loss, numpyro_losses.expected_l1_loss),
        (pyro_losses.expected_l2_loss, numpyro_losses.expected_l2_loss),
    ):
        close(
            torch_loss(torch_dist, target),
            jax_loss(jax_dist, jnp.asarray(target.numpy())),
            dtype_name,
        )
    # The two QR factorisations may pick different bases of null(A), but the bijections have
    # the same range: the same projector B B^T and the same offset.
    torch_transform = torch_biject_to(torch_dist.support)
    jax_transform = numpyro_biject_to(jax_dist.support)
    close(
        torch_transform.basis @ torch_transform.basis.mT,
        jax_transform.basis @ jnp.swapaxes(jax_transform.basis, -1, -2),
        dtype_name,
    )
    close(torch_transform.offset, jax_transform.offset, dtype_name)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_kl_agrees(dtype_name):
    torch_p, jax_p = both("diag", dtype_name, seed=0)
    params_q, *_ = oracle.random_parameters("full_cov", seed=1)
    _, _, A, k = oracle.random_parameters("diag", seed=0)
    torch_dtype, jax_dtype, _ = DTYPES[dtype_name]
    params_q.update(A=A, k=k)
    torch_q = pyro_constrained.LinearConstrainedNormal(
        **{name: torch.tensor(v, dtype=torch_dtype) for name, v in params_q.items()}
    )
    jax_q = numpyro_constrained.LinearConstrainedNormal(
        **{name: jnp.asarray(v, dtype=jax_dtype) for name, v in params_q.items()}
    )
    close(torch_kl(torch_p, torch_q), numpyro_kl(jax_p, jax_q), dtype_name)
    close(torch_kl(torch_q, torch_p), numpyro_kl(jax_q, jax_p), dtype_name)


@pytest.mark.parametrize("estimator", ["marginal_expectation", "pathwise"])
def test_gradients_through_a_sample_agree(estimator):
    # The default estimator's gradient does not depend on the noise, so the frameworks' own
    # sampling paths are compared; the pathwise one is compared on identical noise.
    params, cov, A, k = oracle.random_parameters("diag")
    noise = np.random.default_rng(2).normal(size=(4, 5))
    weights = np.random.default_rng(3).normal(size=(4, 5))

    loc = torch.tensor(params["loc"], requires_grad=True)
    scale = torch.tensor(params["scale"], requires_grad=True)
    dist = pyro_constrained.LinearConstrainedNormal(
        loc, scale, A=torch.tensor(A), k=torch.tensor(k), grad_estimator=estimator
    )
    if estimator == "pathwise":
        z = dist._matheron_from_noise(torch.tensor(noise))
    else:
        z = dist.rsample((4,))
    torch_grads = torch.autograd.grad((torch.tensor(weights) * z).sum(), (loc, scale))

    def jax_value(loc, scale):
        dist = numpyro_constrained.LinearConstrainedNormal(
            loc, scale, A=A, k=k, grad_estimator=estimator
        )
        if estimator == "pathwise":
            z = dist._matheron_from_noise(jnp.asarray(noise))
        else:
            z = dist.sample(jax.random.PRNGKey(0), (4,))
        return jnp.sum(weights * z)

    jax_grads = jax.grad(jax_value, argnums=(0, 1))(params["loc"], params["scale"])
    for torch_g, jax_g in zip(torch_grads, jax_grads, strict=True):
        close(torch_g, jax_g, "float64")


@pytest.mark.parametrize(
    ("dtype_name", "per_example"), [("float64", False), ("float64", True), ("float32", False)]
)
def test_log_prob_gradients_agree(dtype_name, per_example):
    # Pyro differentiates the diagonal-scale log_prob by hand (_ProjectedLogDensity), JAX by
    # autodiff through the row-sorted QR: the same gradients in loc, scale and the value.
    torch_dtype, jax_dtype, _ = DTYPES[dtype_name]
    params, cov, A, k = oracle.random_parameters("diag", seed=6)
    rng = np.random.default_rng(7)
    loc = np.stack([params["loc"], -params["loc"], 0.5 * params["loc"]])
    scale = rng.uniform(0.5, 2.0, size=(3, 5)) if per_example else params["scale"]
    value = oracle.project(rng.normal(size=(3, 5)), A, k)
    weights = rng.normal(size=3)
    torch_inputs = [torch.tensor(v, dtype=torch_dtype, requires_grad=True) for v in (loc, scale)]
    torch_value = torch.tensor(value, dtype=torch_dtype, requires_grad=True)
    dist = pyro_constrained.LinearConstrainedNormal(
        *torch_inputs, A=torch.tensor(A, dtype=torch_dtype), k=torch.tensor(k, dtype=torch_dtype)
    )
    torch_grads = torch.autograd.grad(
        (torch.tensor(weights, dtype=torch_dtype) * dist.log_prob(torch_value)).sum(),
        (*torch_inputs, torch_value),
    )

    def jax_value(loc, scale, value):
        dist = numpyro_constrained.LinearConstrainedNormal(
            loc, scale, A=jnp.asarray(A, dtype=jax_dtype), k=jnp.asarray(k, dtype=jax_dtype)
        )
        return jnp.sum(weights.astype(jax_dtype) * dist.log_prob(value))

    jax_grads = jax.grad(jax_value, argnums=(0, 1, 2))(
        *(jnp.asarray(v, dtype=jax_dtype) for v in (loc, scale, value))
    )
    for torch_g, jax_g in zip(torch_grads, jax_grads, strict=True):
        close(torch_g, jax_g, dtype_name)
