"""The framework-free half of the showcase (``python -m pyro_constrained`` and
``python -m numpyro_constrained``): the NumPy data generators, the results row and table,
and the command line.

It imports neither torch nor JAX, so each package's ``showcase`` module, which holds only
its own models and SVI loop, works with only its own framework installed.
"""

from constrained_ppl.showcase.cli import main, parse_args, run_experiments
from constrained_ppl.showcase.data import (
    ELECTRONEGATIVITY,
    ELEMENT_FREQUENCY,
    HARDNESS,
    make_bags,
    make_molecules,
    make_sparse_regression,
)
from constrained_ppl.showcase.report import ShowcaseResult, format_table

__all__ = [
    "ELECTRONEGATIVITY",
    "ELEMENT_FREQUENCY",
    "HARDNESS",
    "ShowcaseResult",
    "format_table",
    "main",
    "make_bags",
    "make_molecules",
    "make_sparse_regression",
    "parse_args",
    "run_experiments",
]
