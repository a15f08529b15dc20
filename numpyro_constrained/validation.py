"""NumPyro's rule for values outside the support, for supports it cannot check itself.

``numpyro.distributions.Distribution._validate_sample`` warns ("Out-of-support values ...")
when a concrete value is outside the support and lets ``log_prob`` return ``-inf``. The
classes here check more than ``support(value)`` in places (infinite logits that force a
coordinate, exact integer sums), and ``log_prob`` evaluates the check inside a jitted
kernel, where even a constant closed over by the caller's ``jit`` is a tracer. So the check
is evaluated again, on its own, under ``jax.ensure_compile_time_eval()``: constants stay
concrete there and are checked, as NumPyro's own distributions check them; traced values
are skipped.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro.util import not_jax_tracer

__all__ = ["as_concrete_where_possible", "is_concrete", "warn_if_out_of_support"]

OUT_OF_SUPPORT_MESSAGE = (
    "Out-of-support values provided to log prob method. "
    "The value argument should be within the support."
)


def _inside(path: str, directory: str) -> bool:
    """Whether the file ``path`` lies in ``directory`` or below it, compared by whole path
    components: ``site-packages/numpyro_extras/x.py`` is not inside ``site-packages/numpyro``,
    which a plain string prefix test (as ``numpyro.util.find_stack_level`` makes) says it is."""
    return os.path.abspath(path).startswith(os.path.join(directory, ""))


def _stack_level_outside() -> int:
    """The ``stacklevel`` of the first caller outside NumPyro and this package, where the
    out-of-support warning should point: the user's line that called ``log_prob``.

    ``numpyro.util.find_stack_level`` is the public helper for NumPyro's own warnings, but it
    cannot do this: it skips NumPyro's frames only, so from this package it stops at this
    package's own ``log_prob`` (it skips them only where this package is installed beside
    NumPyro, and then only through the string prefix test above, which also skips any
    ``numpyro_*`` package of the user). Python's ``warnings.warn(skip_file_prefixes=...)``
    would, but only from Python 3.12. So the frames are walked here, with whole-directory
    tests. The level counts this function's frame, as ``find_stack_level`` counts its own:
    the caller passes the result straight to ``warnings.warn``."""
    inside = (
        os.path.abspath(os.path.dirname(numpyro.__file__)),
        os.path.dirname(os.path.abspath(__file__)),
    )
    frame, level = inspect.currentframe(), 0
    while frame is not None and any(_inside(inspect.getfile(frame), d) for d in inside):
        frame, level = frame.f_back, level + 1
    return level


def is_concrete(*arrays) -> bool:
    """Whether none of ``arrays`` is a JAX tracer (their values can be checked)."""
    return all(not_jax_tracer(array) for array in arrays)


def as_concrete_where_possible(value) -> jax.Array:
    """``jnp.asarray(value)``, concrete when ``value`` is a constant (also inside ``jit``)."""
    with jax.ensure_compile_time_eval():
        return jnp.asarray(value)


def warn_if_out_of_support(in_support: Callable[[], jax.Array]) -> None:
    """NumPyro's "Out-of-support values" ``UserWarning`` if ``in_support()``, evaluated
    under ``jax.ensure_compile_time_eval()``, is concrete and not all true."""
    with jax.ensure_compile_time_eval():
        mask = in_support()
    if not_jax_tracer(mask) and not np.all(np.asarray(mask)):
        warnings.warn(OUT_OF_SUPPORT_MESSAGE, UserWarning, stacklevel=_stack_level_outside())
