"""Test-wide settings.

JAX runs with 64-bit types enabled so that float64 tests are possible; float32 tests pass
float32 arrays explicitly (the library keeps the dtype of its inputs). NumPy randomness in
tests comes from explicit ``np.random.default_rng(seed)`` generators.

Property-based tests (``hypothesis``) run under a profile chosen by the environment variable
``HYPOTHESIS_PROFILE``: ``ci`` (the default, a bounded number of examples and no deadline, so
that the whole suite stays within its time budget on a 2-core machine) or ``thorough`` (many
more examples, for local runs: ``HYPOTHESIS_PROFILE=thorough python -m pytest -k property``).
"""

import gc
import os
import shutil
import tempfile

import jax
import numpy as np
import numpyro
import pyro
import pytest
import torch
from hypothesis import HealthCheck, settings
from numpyro.distributions import distribution as numpyro_distribution

jax.config.update("jax_enable_x64", True)

# Most of the suite's time is XLA compiling the same JAX functions again: in every test that
# builds a distribution under a new jit or grad, and once in each xdist worker. A compilation
# cache shared by the run's processes (a fresh directory: nothing carries over between runs,
# and the compiled code is the same as without it) took 11% to 21% off the JAX test files.
# The process that loads this file first (xdist's controller, before it starts the workers,
# which inherit the variable) creates it and removes it at the end of the session.
_CACHE_VARIABLE = "CONSTRAINED_PPL_TEST_JAX_CACHE"
_created_cache = _CACHE_VARIABLE not in os.environ
if _created_cache:
    os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="constrained-ppl-jax-cache-")
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VARIABLE])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# The suite compiles thousands of small XLA programs that run for microseconds, and LLVM's
# optimisations take about 40% of each compilation: without them (JAX's own switch for this
# case, jax_disable_most_optimizations) the suite took 22% less CPU time (19 against 24
# minutes; 10.5 against 13 minutes of wall time on 2 cores). The operations are the same;
# the last bits of a result may differ, as they do on another backend (XLA's float64
# log-gamma of 2 is 8.9e-16 instead of 0), and the tests allow for that. The tutorials,
# the main jobs and the benchmarks run with XLA's defaults, and so does this suite with
# CONSTRAINED_PPL_TEST_XLA_OPTIMIZE=1.
if os.environ.get("CONSTRAINED_PPL_TEST_XLA_OPTIMIZE") != "1":
    jax.config.update("jax_disable_most_optimizations", True)
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


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Spread the run over every core (``-n auto``) when pytest-xdist is loaded and no
    ``-n`` was given.

    ``python -m pytest`` (the README's command) thus runs in parallel, while
    ``-p no:xdist`` (xdist not loaded, so no ``-n`` option) and ``-n 0`` run in one
    process. ``tryfirst``: this initial conftest is registered after the xdist plugin, so
    this hook runs before xdist's own ``pytest_cmdline_main``, which turns ``auto`` into
    a number of workers. xdist's workers receive their controller's options (``-n`` set
    there), and ``workerinput`` marks them.
    """
    if (
        config.pluginmanager.hasplugin("xdist")
        and not hasattr(config, "workerinput")
        and config.option.numprocesses is None
    ):
        config.option.numprocesses = "auto"
        # Work stealing: the workers start on contiguous halves of the test list (each keeps
        # its modules' compiled JAX programs) and an idle one takes from the other's tail,
        # instead of xdist's default round-robin chunks, which split every module.
        if getattr(config.option, "dist", "no") in ("no", "load"):
            config.option.dist = "worksteal"


# Process-wide settings that a test may change only for itself. Each test runs in a worker
# process after others, so a setting one of them left behind (a default dtype, a thread
# count, flushed denormals, a JAX flag) changes what later tests compute: a float32
# comparison that passes alone can then fail in the full run. The guard below restores
# every one of them after each test and fails the test that changed it.
_JAX_FLAGS = (
    "jax_enable_x64",
    "jax_disable_most_optimizations",
    "jax_default_matmul_precision",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
    "jax_debug_nans",
    "jax_debug_infs",
    "jax_disable_jit",
    "jax_default_prng_impl",
)


def _read_jax_flag(name):
    try:
        return jax.config.read(name)
    except AttributeError:  # flags that have a context manager are read as attributes
        return getattr(jax.config, name)


def _flushes_denormals() -> bool:
    # torch has no getter for set_flush_denormal: a denormal input reads as 0 when it is on.
    return float(torch.tensor([2.0**-1070], dtype=torch.float64).mul(1.0)) == 0.0


def _global_settings() -> dict:
    settings_now = {
        "torch default dtype": (torch.get_default_dtype(), torch.set_default_dtype),
        "torch threads": (torch.get_num_threads(), torch.set_num_threads),
        "torch grad mode": (torch.is_grad_enabled(), torch.set_grad_enabled),
        "torch anomaly detection": (torch.is_anomaly_enabled(), torch.set_anomaly_enabled),
        "torch deterministic algorithms": (
            torch.are_deterministic_algorithms_enabled(),
            torch.use_deterministic_algorithms,
        ),
        "torch float32 matmul precision": (
            torch.get_float32_matmul_precision(),
            torch.set_float32_matmul_precision,
        ),
        "torch flush denormal": (_flushes_denormals(), torch.set_flush_denormal),
        "numpyro validation": (
            numpyro_distribution._VALIDATION_ENABLED,
            numpyro.enable_validation,
        ),
        "numpy error handling": (np.geterr(), lambda errors: np.seterr(**errors)),
    }
    for name in _JAX_FLAGS:
        settings_now[name] = (
            _read_jax_flag(name),
            lambda value, name=name: jax.config.update(name, value),
        )
    return settings_now


@pytest.fixture(autouse=True)
def _restore_global_settings():
    """Restore the settings above after each test; fail the test that changed one."""
    before = _global_settings()
    yield
    changed = []
    for name, (value, _) in _global_settings().items():
        previous, restore = before[name]
        if value != previous:
            restore(previous)
            changed.append(f"{name}: {previous!r} -> {value!r}")
    if changed:
        pytest.fail("the test left global settings changed (now restored): " + "; ".join(changed))


@pytest.fixture(autouse=True)
def _seed_torch_and_clear_pyro():
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    # Validation on, as torch and Pyro default: a test (or a JIT ELBO) that switched it off
    # globally must not leak into the next test in the same worker.
    pyro.enable_validation(True)
    yield


def pytest_sessionfinish(session):
    if _created_cache:
        shutil.rmtree(os.environ.pop(_CACHE_VARIABLE), ignore_errors=True)


# --- NumPyro's default configuration ---------------------------------------------------
# The suite enables x64 (above) so that float64 can be tested, and compiles without XLA's
# optimisations to save time; a NumPyro user runs neither: x64 is off (no float64 exists
# inside the library's computations either) and XLA optimises. So every float32 test of the
# modules below runs a second time in that configuration, as the variant ``[user-config]``:
# the tests whose parameters include float32 (a dtype, its name, or a conformance case of
# that dtype) and those marked ``user_config``, except torch-only ones. ``x64_only`` keeps a
# float32 test out of it (it needs float64 in the test itself, say so in the reason). A
# module may name the tests that take part in ``USER_CONFIG_TESTS``. ``user_config_only``
# runs a test's JAX float32 variants in that configuration alone, not also as float32 arrays
# with x64 on: for tests that compare values to a tolerance, where x64 off is the harder case
# (x64 on lets the library accumulate in float64) and the x64 variant only repeated it at
# the cost of its compilations. Not for tests of dtypes: x64 on is where float32 can be
# promoted. ``user_config_slow`` marks a test's user-config variants ``slow`` (run by
# ``python -m pytest -m slow``, tests/slow.py): for heavy tests whose x64 float32 variant
# checks the same property in the default run, where the optimised compilations of the
# user-config variant cost the suite's time budget more than they add.
USER_CONFIG_MODULES = {
    "test_conditioned_poisson_agreement",
    "test_conditioned_poisson_numpyro",
    "test_conditioned_poisson_properties",
    "test_conformance_numpyro",
    "test_count_edge_gradients",
    "test_exactly_k_bernoulli_agreement",
    "test_exactly_k_bernoulli_numpyro",
    "test_exactly_k_kernels",
    "test_exactly_k_properties",
    "test_linear_constrained_normal_agreement",
    "test_linear_constrained_normal_numpyro",
    "test_linear_constrained_normal_properties",
    "test_linear_constraint_agreement",
    "test_linear_constraint_numpyro",
    "test_nn_numpyro",
}
_USER_CONFIG = "user-config"


def _is_float32(value) -> bool:
    if isinstance(value, str):
        return value == "float32"
    if value is torch.float32:
        return False
    if isinstance(value, type) and issubclass(value, np.generic):  # np.float32 itself
        return value is np.float32
    dtype = getattr(value, "dtype", value)
    if isinstance(dtype, str):
        return dtype == "float32"
    if not isinstance(dtype, (type, np.dtype)):
        return False
    try:
        return np.dtype(dtype) == np.float32
    except TypeError:
        return False


def _wants_user_config(item) -> bool:
    if item.get_closest_marker("x64_only"):
        return False
    params = {name: value for name, value in item.callspec.params.items() if name != "_jax_mode"}
    if params.get("framework") == "torch":
        return False
    if item.get_closest_marker("user_config"):
        return True
    names = getattr(item.module, "USER_CONFIG_TESTS", None)
    if names is not None and item.originalname not in names:
        return False
    return any(_is_float32(value) for value in params.values())


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "user_config: also run in NumPyro's default configuration (x64 off, XLA optimised)",
    )
    config.addinivalue_line(
        "markers", "x64_only: a float32 test that needs float64 itself; not run with x64 off"
    )
    config.addinivalue_line(
        "markers",
        "user_config_only: its JAX float32 variants run with x64 off only (see conftest.py)",
    )
    config.addinivalue_line(
        "markers",
        "user_config_slow: its user-config variants are marked slow (see conftest.py)",
    )


def pytest_generate_tests(metafunc):
    if metafunc.module.__name__.rpartition(".")[2] in USER_CONFIG_MODULES:
        metafunc.parametrize("_jax_mode", ["x64", _USER_CONFIG], indirect=True)


def _only_in_user_config(item) -> bool:
    """A JAX float32 variant with x64 on of a ``user_config_only`` test."""
    if not item.get_closest_marker("user_config_only"):
        return False
    params = {name: value for name, value in item.callspec.params.items() if name != "_jax_mode"}
    return params.get("framework") != "torch" and any(map(_is_float32, params.values()))


# tryfirst: the slow marks added here must be in place when -m "not slow" deselects.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    selected, deselected = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        mode = None if callspec is None else callspec.params.get("_jax_mode")
        if mode == _USER_CONFIG:
            (selected if _wants_user_config(item) else deselected).append(item)
            if item.get_closest_marker("user_config_slow"):
                item.add_marker(pytest.mark.slow)
        elif mode == "x64" and _only_in_user_config(item):
            deselected.append(item)
        else:
            selected.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@pytest.fixture(autouse=True)
def _jax_mode(request, _restore_global_settings):
    """The JAX configuration of one test: the suite's (``x64``) or NumPyro's default."""
    if getattr(request, "param", "x64") != _USER_CONFIG:
        yield
        return
    # jax_disable_most_optimizations is read when a program is compiled, not part of jit's
    # cache key; x64 is, so every program of this test is compiled here, optimised.
    optimizations_were_disabled = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        with jax.enable_x64(False):
            yield
    finally:
        jax.config.update("jax_disable_most_optimizations", optimizations_were_disabled)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's in-memory caches of traced and compiled programs after each test module.

    A worker process keeps every program it compiled, and the suite compiles thousands (each
    float32 test twice since the user-config variant): workers grew until they crashed late in
    the full run, while the same files alone passed. The persistent compilation cache (above)
    still serves a program that a later module compiles again. Only once the worker holds more
    than ``_RELEASE_ABOVE_BYTES`` (read on Linux; elsewhere after every module): a clear and a
    collection cost about a second each time, and the next module recompiles what it shares.
    """
    yield
    if _resident_bytes() > _RELEASE_ABOVE_BYTES:
        jax.clear_caches()
        gc.collect()


_RELEASE_ABOVE_BYTES = 3 << 30


def _resident_bytes() -> int:
    """This process's resident memory (Linux's /proc), or a number above any bound where
    that cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 1 << 62
