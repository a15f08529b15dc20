"""The one ``__repr__`` format of the distributions, as ``torch.distributions`` prints.

``Normal(loc: (3,), scale: (3,))``: each parameter by name, its value when it has one element
and is concrete, else its shape (a tuple). Pyro's classes print the same way
(``pyro_constrained/_repr.py``), with the shape as a ``torch.Size``.
"""

from __future__ import annotations

import jax
import numpy as np
from numpyro.util import not_jax_tracer


def _format(value: jax.Array, integer: bool) -> str:
    shape = tuple(np.shape(value))
    # Inside jit the value is a tracer: only its shape is known.
    if int(np.prod(shape)) != 1 or not not_jax_tracer(value):
        return str(shape)
    item = np.asarray(value).reshape(()).item()
    # A count (k) may be stored as a float: print it as the integer it is, so that k reads
    # the same in every class.
    return str(int(item)) if integer and float(item).is_integer() else str(item)


def parameters_repr(
    name: str, parameters: dict[str, jax.Array], integers: tuple[str, ...] = ()
) -> str:
    """``name(p: value-or-shape, ...)`` for the parameters in the order given; the names in
    ``integers`` are counts, printed as integers when they have one element."""
    args = ", ".join(
        f"{key}: {_format(value, key in integers)}" for key, value in parameters.items()
    )
    return f"{name}({args})"
