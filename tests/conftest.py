"""Test-wide settings.

JAX runs with 64-bit types enabled so that float64 tests are possible; float32 tests pass
float32 arrays explicitly (the library keeps the dtype of its inputs). NumPy randomness in
tests comes from explicit ``np.random.default_rng(seed)`` generators.

Property-based tests (``hypothesis``) run under a profile chosen by the environment variable
``HYPOTHESIS_PROFILE``: ``ci`` (the default, a bounded number of examples and no deadline, so
that the whole suite stays within its time budget on a 2-core machine) or ``thorough`` (many
more examples, for local runs: ``HYPOTHESIS_PROFILE=thorough python -m pytest -k property``).
"""

import os

import jax
import pyro
import pytest
import torch
from hypothesis import HealthCheck, settings

jax.config.update("jax_enable_x64", True)
# The suite runs on a 2-core machine: torch's intra-op thread pool contends with JAX's and
# with pytest-xdist workers and slows tiny kernels by orders of magnitude.
torch.set_num_threads(1)

# Derandomized and without the example database in CI, so that every run (a fresh clone or
# a developer's checkout) tries the same examples and a red run is reproducible; the
# thorough profile explores and remembers failures.
_SLOW_EXAMPLES = [HealthCheck.too_slow, HealthCheck.data_too_large]
# 25 examples: the JAX cases compile their kernels for every new (n, k) an example draws,
# which made the property tests a fifth of the suite's time at 40; the derandomized examples
# still include the boundaries (k = 0, k = n, infinite and -1e9 logits) the strategies
# favour, and the thorough profile is the search.
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=_SLOW_EXAMPLES,
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    print_blob=True,
    suppress_health_check=_SLOW_EXAMPLES,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed_torch_and_clear_pyro():
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    yield
