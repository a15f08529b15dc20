"""Test-wide settings.

JAX runs with 64-bit types enabled so that float64 tests are possible; float32 tests pass
float32 arrays explicitly (the library keeps the dtype of its inputs). NumPy randomness in
tests comes from explicit ``np.random.default_rng(seed)`` generators.
"""

import jax
import pyro
import pytest

jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True)
def _seed_torch_and_clear_pyro():
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    yield
