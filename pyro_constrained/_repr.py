"""The one ``__repr__`` format of the distributions, as ``torch.distributions`` prints.

``Normal(loc: torch.Size([3]), scale: torch.Size([3]))``: each parameter by name, its value
when it has one element, else its shape. NumPyro's classes print the same way
(``numpyro_constrained/_repr.py``), with the shape as a tuple.
"""

from __future__ import annotations

import torch


def _format(value: torch.Tensor, integer: bool) -> str:
    if value.numel() != 1:
        return str(value.shape)
    item = value.item()
    # A count (k) is stored in the parameters' float dtype by some classes: print it as the
    # integer it is, so that k reads the same in every class.
    return str(int(item)) if integer and float(item).is_integer() else str(item)


def parameters_repr(
    name: str, parameters: dict[str, torch.Tensor], integers: tuple[str, ...] = ()
) -> str:
    """``name(p: value-or-shape, ...)`` for the parameters in the order given; the names in
    ``integers`` are counts, printed as integers when they have one element."""
    args = ", ".join(
        f"{key}: {_format(value, key in integers)}" for key, value in parameters.items()
    )
    return f"{name}({args})"
