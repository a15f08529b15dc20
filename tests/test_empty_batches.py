"""Empty batches and empty sample shapes give empty results in every class and both
packages, as ``Bernoulli`` and ``Multinomial`` do: an expanded ``(0,)`` batch (a plate of
size 0, a batch of no data) and a sample shape with a 0. In NumPyro the kernels' tree
reshaped ``(0, nodes, width)`` tables with a ``-1`` axis (``ZeroDivisionError``), which
failed every ``log_prob`` of an empty batch."""

import jax
import jax.numpy as jnp
import pytest
import torch
from numpyro.distributions.kl import kl_divergence as jax_kl

import numpyro_constrained as nc
import pyro_constrained as pc

N = 6
MAKERS = {
    "ekb": lambda lib, x: lib.ExactlyKBernoulli(x, k=2),
    "ccb": lambda lib, x: lib.CountConstrainedBernoulli(x, low=1, high=3),
    "pb": lambda lib, x: lib.PoissonBinomial(x),
    "cp": lambda lib, x: lib.ConditionedPoisson(abs(x) + 1.0, k=3),
}
EVENT = {"ekb": (N,), "ccb": (N,), "pb": (), "cp": (N,)}


def _results(framework, name):
    """The shapes of each method's result, for an expanded empty batch and for a sample
    shape (0,) of a batch of one."""
    if framework == "torch":
        lib, x = pc, torch.zeros((1, N))
        d = MAKERS[name](lib, x).expand((0,))
        one = MAKERS[name](lib, x)
        results = {
            "sample": d.sample(),
            "log_prob": d.log_prob(d.sample()),
            "entropy": d.entropy(),
            "mean": d.mean,
            "kl": torch.distributions.kl_divergence(d, d),
            "sample (0,)": one.sample((0,)),
            "log_prob (0,)": one.log_prob(one.sample((0,))),
        }
    else:
        lib, x, key = nc, jnp.zeros((1, N)), jax.random.PRNGKey(0)
        d = MAKERS[name](lib, x).expand((0,))
        one = MAKERS[name](lib, x)
        results = {
            "sample": d.sample(key),
            "log_prob": d.log_prob(d.sample(key)),
            "entropy": d.entropy(),
            "mean": d.mean,
            "kl": jax_kl(d, d),
            "sample (0,)": one.sample(key, (0,)),
            "log_prob (0,)": one.log_prob(one.sample(key, (0,))),
            "jit log_prob": jax.jit(lambda d: d.log_prob(d.sample(key)))(d),
        }
    return {what: tuple(value.shape) for what, value in results.items()}


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_empty_batches_and_sample_shapes_give_empty_results(framework, name):
    event = EVENT[name]
    expected = {
        "sample": (0,) + event,
        "log_prob": (0,),
        "entropy": (0,),
        "mean": (0,) + event,
        "kl": (0,),
        "sample (0,)": (0, 1) + event,
        "log_prob (0,)": (0, 1),
        "jit log_prob": (0,),
    }
    got = _results(framework, name)
    assert got == {what: expected[what] for what in got}
