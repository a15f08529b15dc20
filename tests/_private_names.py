"""The AST scan for private framework names that the ``_compat`` tests of both packages run
over their package (``tests/test_compat_numpyro.py``, ``tests/test_compat_pyro.py``)."""

from __future__ import annotations

import ast
import pathlib


def private_framework_names(path: pathlib.Path, frameworks: tuple[str, ...]) -> set:
    """``(file, dotted name)`` of each private name of one of ``frameworks`` (top-level
    module names) that ``path``'s code imports or reaches through an imported framework
    module (strings and comments aside)."""
    tree = ast.parse(path.read_text())
    modules = {}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in frameworks:
                    modules[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in frameworks:
                for alias in node.names:
                    dotted = f"{node.module}.{alias.name}"
                    modules[alias.asname or alias.name] = dotted
                    if any(part.startswith("_") for part in dotted.split(".")):
                        found.add((path.name, dotted))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.insert(0, base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                dotted = ".".join([modules[base.id], *chain])
                if any(p.startswith("_") and not p.startswith("__") for p in chain):
                    found.add((path.name, dotted))
    return found
