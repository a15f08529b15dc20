"""The one ``__repr__`` format of the distributions of both packages, as
``torch.distributions`` prints: ``Normal(loc: torch.Size([3]), scale: torch.Size([3]))``,
each parameter by name, its value when it has one element, else its shape.

The frameworks differ only in how a value shows its shape and whether its element can be
read (``pyro_constrained/_repr.py``, ``numpyro_constrained/_repr.py``); the format lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def parameters_repr(
    name: str,
    parameters: Mapping[str, Any],
    describe: Callable[[Any], tuple[str, float | None]],
    integers: tuple[str, ...] = (),
) -> str:
    """``name(p: value-or-shape, ...)`` for the parameters in the order given.

    ``describe(value)`` returns the value's shape as the framework prints it and its one
    element, or ``None`` when it has several (or cannot be read, as inside ``jit``). The
    names in ``integers`` are counts, which some classes store in the parameters' float
    dtype: they print as the integers they are, so that ``k`` reads the same in every class.
    """
    args = []
    for key, value in parameters.items():
        shape, item = describe(value)
        if item is None:
            text = shape
        elif key in integers and float(item).is_integer():
            text = str(int(item))
        else:
            text = str(item)
        args.append(f"{key}: {text}")
    return f"{name}({', '.join(args)})"
