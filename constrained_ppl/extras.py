"""The frameworks are optional extras (``pip install "constrained-ppl[pyro]"`` /
``"constrained-ppl[numpyro]"``), so that a NumPyro user does not have to install PyTorch,
nor a Pyro user JAX. Each framework package checks for its own at import and, when it is
missing, says which extra to install, rather than failing with a bare
``ModuleNotFoundError`` from deep inside one of its modules."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence


def require_framework(package: str, extra: str, description: str, modules: Sequence[str]) -> None:
    """Raise an ``ImportError`` naming every one of the top-level ``modules`` that is not
    installed and the command that installs them, ``pip install "constrained-ppl[<extra>]"``.

    Only presence is checked (``importlib.util.find_spec``, which imports nothing): a
    framework that is installed but broken fails in the package's own imports with its own
    error, which installing the extra would not cure.
    """
    missing = [repr(module) for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        names, verb = missing[0], "is"
        if len(missing) > 1:
            names, verb = f"{', '.join(missing[:-1])} and {missing[-1]}", "are"
        raise ImportError(
            f"{package} needs {description}, and {names} {verb} not installed. "
            f'Install them with: pip install "constrained-ppl[{extra}]"'
        )
