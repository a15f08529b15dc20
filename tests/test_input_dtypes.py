"""Inputs' dtypes as the frameworks' own distributions treat them (a review of the input
conventions): results in the promotion of the parameters' and a floating value's or
target's dtypes, integer inputs of any width accepted as real numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import numpyro_constrained as nc
import pyro_constrained as pc
from numpyro_constrained.losses import expected_l1_loss as jax_l1
from numpyro_constrained.losses import expected_l2_loss as jax_l2
from pyro_constrained.losses import expected_l1_loss as torch_l1
from pyro_constrained.losses import expected_l2_loss as torch_l2

RATE = np.array([1.0, 2.0, 5.0])
TARGET = np.array([0.3, 1.7, 2.2])


def _l2_reference(rate, k, target):
    p = rate / rate.sum()
    return float((k * p * (1 - p) + (k * p - target) ** 2).sum())


def test_conditioned_poisson_expected_l2_promotes_the_target_as_l1_does():
    """float32 rates with a float64 target: float64, the target unrounded (it was cast to
    the rates' dtype, float32, in both packages); an integer target takes the rates'."""
    rates32 = RATE.astype(np.float32)
    expected = _l2_reference(rates32.astype(np.float64), 4, TARGET)
    d = pc.ConditionedPoisson(torch.tensor(rates32), k=4)
    target = torch.tensor(TARGET)
    for loss in (torch_l1, torch_l2):
        assert loss(d, target).dtype == torch.float64
        assert loss(d, torch.tensor([0, 2, 2])).dtype == torch.float32
    assert float(torch_l2(d, target)) == pytest.approx(expected, rel=1e-12)
    with jax.enable_x64(True):
        j = nc.ConditionedPoisson(jnp.asarray(rates32), k=4)
        for loss in (jax_l1, jax_l2):
            assert loss(j, jnp.asarray(TARGET)).dtype == jnp.float64
            assert loss(j, jnp.array([0, 2, 2])).dtype == jnp.float32
            assert loss(j, 0.5).dtype == jnp.float32  # a Python float is weakly typed
        assert float(jax_l2(j, jnp.asarray(TARGET))) == pytest.approx(expected, rel=1e-12)
        for loss in (jax_l1, jax_l2):  # a list, as an array of its values
            assert float(loss(j, TARGET.tolist())) == float(loss(j, jnp.asarray(TARGET)))
    for loss in (torch_l1, torch_l2):
        assert float(loss(d, TARGET.tolist())) == float(loss(d, torch.tensor(TARGET.tolist())))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8, torch.int32, torch.bool])
def test_linear_constrained_normal_takes_integer_inputs_of_any_width(dtype):
    """torch accepted int32, int64 and bool but refused int8, int16 and uint8 ("k must be a
    real array"), which NumPyro accepts; the result is that of the same numbers as floats."""
    A = torch.tensor([[1, 1, 0, 1]], dtype=dtype)
    k = torch.tensor([1], dtype=dtype)
    loc = torch.tensor([0, 1, 0, 0], dtype=dtype)
    got = pc.LinearConstrainedNormal(loc, torch.ones(4), A=A, k=k)
    floats = pc.LinearConstrainedNormal(loc.float(), torch.ones(4), A=A.float(), k=k.float())
    torch.testing.assert_close(got.mean, floats.mean)
    torch.testing.assert_close(got.entropy(), floats.entropy())


@pytest.mark.parametrize("kind", [list, tuple, np.array])
def test_torch_log_prob_takes_array_likes_as_the_other_classes(kind):
    """ExactlyKBernoulli and CountConstrainedBernoulli read value.shape first and raised
    AttributeError for a list; ConditionedPoisson, PoissonBinomial and LinearConstrainedNormal
    convert with torch.as_tensor. Uniform laws: log(1/3) and log(1/6)."""
    value = kind([1.0, 0.0, 0.0])
    ekb = pc.ExactlyKBernoulli(torch.zeros(3), k=1)
    ccb = pc.CountConstrainedBernoulli(torch.zeros(3), low=1, high=2)
    assert float(ekb.log_prob(value)) == pytest.approx(np.log(1 / 3), rel=1e-6)
    assert float(ccb.log_prob(value)) == pytest.approx(np.log(1 / 6), rel=1e-6)
