"""LinearConstraint: torch and JAX agree on identical inputs (projection, residual, the
distribution built from the constraint with per-example k, the support test, the bijection)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from numpyro.distributions.transforms import biject_to as jax_biject_to
from torch.distributions import biject_to as torch_biject_to

import numpyro_constrained
import pyro_constrained
from tests.oracles import linear_constraint as oracle

N, A_ROWS, BATCH = 7, 3, 5
TOLERANCE = {"float32": 2e-5, "float64": 1e-12}


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_torch_and_jax_agree(dtype_name):
    rng = np.random.default_rng(4)
    arrays = {
        "A": rng.normal(size=(A_ROWS, N)),
        "y": 3 * rng.normal(size=(BATCH, N)),
        "k": rng.normal(size=(BATCH, A_ROWS)),
        "loc": rng.normal(size=(BATCH, N)),
        "scale": rng.uniform(0.5, 2.0, size=N),
        "u": rng.normal(size=(BATCH, N - A_ROWS)),
    }
    arrays = {name: value.astype(dtype_name) for name, value in arrays.items()}
    t = {name: torch.tensor(value) for name, value in arrays.items()}
    j = {name: jnp.asarray(value) for name, value in arrays.items()}
    tc = pyro_constrained.LinearConstraint(t["A"], rtol=1e-6)
    jc = numpyro_constrained.LinearConstraint(j["A"], rtol=1e-6)
    td = tc.normal(t["loc"], t["scale"], k=t["k"])
    jd = jc.normal(j["loc"], j["scale"], k=j["k"])
    measured = oracle.perturbed(oracle.kkt_project(arrays["y"], arrays["A"], arrays["k"]), 1e-7, 2)
    pairs = {
        "project": (tc.project(t["y"], t["k"]), jc.project(j["y"], j["k"])),
        "residual": (tc.residual(t["y"], t["k"]), jc.residual(j["y"], j["k"])),
        "mean": (td.mean, jd.mean),
        "variance": (td.variance, jd.variance),
        "entropy": (td.entropy(), jd.entropy()),
        "log_prob": (
            td.log_prob(torch.tensor(measured.astype(dtype_name))),
            jd.log_prob(jnp.asarray(measured.astype(dtype_name))),
        ),
        "bijection": (
            torch_biject_to(td.support)(t["u"]),
            jax_biject_to(jd.support)(j["u"]),
        ),
    }
    tolerance = TOLERANCE[dtype_name]
    for name, (torch_value, jax_value) in pairs.items():
        torch_value = torch_value.detach().numpy()
        jax_value = np.asarray(jax_value)
        assert torch_value.dtype == jax_value.dtype == np.dtype(dtype_name), name
        scale = 1 + np.abs(torch_value).max()
        np.testing.assert_allclose(torch_value, jax_value, atol=tolerance * scale, err_msg=name)
    assert tc.rtol == jc.rtol == 1e-6
    np.testing.assert_array_equal(
        td.support.check(torch.tensor(measured.astype(dtype_name))).numpy(),
        np.asarray(jd.support(jnp.asarray(measured.astype(dtype_name)))),
    )
