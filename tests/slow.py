"""The ``slow`` marker's shared parametrisations (CONTRIBUTING.md, "Tests").

A test marked ``slow`` is one of the suite's heaviest (about 10 s or more on one core): the
default test command leaves it out, to stay within about 12 minutes on two cores, and
``.ci/run`` runs it on every change (``python -m pytest -m slow``). Each such variant's
property is also checked by the default run in a cheaper configuration.
"""

import pytest

FRAMEWORKS = ["torch", "jax"]
DTYPES = ["float32", "float64"]


def framework_dtype_params() -> list:
    """``(framework, dtype)`` for torch and JAX in float32 and float64, JAX's float64 marked
    slow: its programs compile with x64 on and share nothing with the float32 variants, and
    the default run keeps both torch dtypes and JAX's float32 (x64 on and off)."""
    return [
        pytest.param(
            framework,
            dtype,
            marks=pytest.mark.slow if (framework, dtype) == ("jax", "float64") else (),
        )
        for framework in FRAMEWORKS
        for dtype in DTYPES
    ]
