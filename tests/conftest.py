"""Test-wide settings.

JAX runs with 64-bit types enabled so that float64 tests are possible; float32 tests pass
float32 arrays explicitly (the library keeps the dtype of its inputs). NumPy randomness in
tests comes from explicit ``np.random.default_rng(seed)`` generators.
"""

import jax
import pyro
import pytest
import torch

jax.config.update("jax_enable_x64", True)
# The suite runs on a 2-core machine: torch's intra-op thread pool contends with JAX's and
# with pytest-xdist workers and slows tiny kernels by orders of magnitude.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_torch_and_clear_pyro():
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    yield
