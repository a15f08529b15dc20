"""Where NumPyro's out-of-support warning points (numpyro_constrained/validation.py): at the
user's line that called ``log_prob``, past the frames of this package and of NumPyro, and
not past a user's own module whose directory merely starts with either package's name."""

from __future__ import annotations

import os
import warnings

import jax.numpy as jnp
import numpyro
import pytest

import numpyro_constrained
from numpyro_constrained import ConditionedPoisson, ExactlyKBernoulli, LinearConstrainedNormal

# Each: a distribution with validation on, and a value outside its support.
CASES = {
    "ExactlyKBernoulli": lambda: (
        ExactlyKBernoulli(logits=jnp.zeros(4), k=2, validate_args=True),
        jnp.array([1.0, 1.0, 1.0, 0.0]),  # three ones, k = 2
    ),
    "ConditionedPoisson": lambda: (
        ConditionedPoisson(jnp.ones(3), k=4, validate_args=True),
        jnp.array([1.0, 1.0, 1.0]),  # sums to 3, k = 4
    ),
    "LinearConstrainedNormal": lambda: (
        LinearConstrainedNormal(
            jnp.zeros(3), jnp.ones(3), A=jnp.ones((1, 3)), k=jnp.ones(1), validate_args=True
        ),
        jnp.zeros(3),  # sums to 0, A z = 1 wanted
    ),
}


def _out_of_support_warnings(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    found = [w for w in caught if "Out-of-support values" in str(w.message)]
    assert found, [str(w.message) for w in caught]
    return found


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_warning_points_at_the_line_that_called_log_prob(name):
    distribution, value = CASES[name]()
    for caught in _out_of_support_warnings(lambda: distribution.log_prob(value)):
        assert caught.filename == __file__, (caught.filename, caught.lineno)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("package", [numpyro, numpyro_constrained], ids=lambda m: m.__name__)
def test_a_caller_beside_a_package_with_its_name_as_prefix_is_not_skipped(name, package):
    # The caller's code lives in (a file named as if in) `<site-packages>/numpyro_user/`, or
    # `<...>/numpyro_constrained_user/`: not inside numpyro or this package, though the
    # directory's name starts with theirs.
    caller = os.path.dirname(os.path.abspath(package.__file__)) + "_user" + os.sep + "model.py"
    distribution, value = CASES[name]()
    code = compile("distribution.log_prob(value)\n", caller, "exec")
    namespace = {"distribution": distribution, "value": value}
    for caught in _out_of_support_warnings(lambda: exec(code, namespace)):
        assert (caught.filename, caught.lineno) == (caller, 1)
