"""The one ``__repr__`` format of the distributions (``constrained_ppl/reprs.py``), with
shapes as tuples."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
from numpyro.util import not_jax_tracer

from constrained_ppl.reprs import parameters_repr as _parameters_repr


def _describe(value: jax.Array) -> tuple[str, float | None]:
    shape = tuple(np.shape(value))
    # Inside jit the value is a tracer: only its shape is known.
    if int(np.prod(shape)) != 1 or not not_jax_tracer(value):
        return str(shape), None
    return str(shape), np.asarray(value).reshape(()).item()


parameters_repr = partial(_parameters_repr, describe=_describe)
