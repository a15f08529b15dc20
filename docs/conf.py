"""Sphinx configuration of the constrained-ppl documentation.

Build from the repository root (the README's command):

    sphinx-build -W --keep-going docs docs/_build/html

The tutorials (``notebooks/*.ipynb``, stored without outputs) are copied into
``docs/tutorials/`` and executed by myst-nb at build time, so that the rendered pages show
what the code does today; a failing cell fails the build. ``CONSTRAINED_PPL_DOCS_EXECUTE=0``
renders them without running them (a quick local build).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent

# The packages are imported from the checkout (autodoc, the figure script), and the
# notebook kernels inherit PYTHONPATH, so "import pyro_constrained" works in them too even
# without an installed package.
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)
# Figures in the notebooks render with the inline backend (no window), as in Jupyter.
os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")

import pyro_constrained  # noqa: E402

project = "constrained-ppl"
author = "constrained-ppl contributors"
copyright = "2026, constrained-ppl contributors"
version = release = pyro_constrained.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "sphinx.ext.intersphinx",
    "myst_nb",
]

# The CI machine reaches PyPI only: no inventories are downloaded at build time.
intersphinx_mapping: dict = {}

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
templates_path: list[str] = []

# ---- autodoc / napoleon: the docstrings use reST field lists and numpydoc sections.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Types go into the documented parameters only (the class docstrings describe __init__'s).
autodoc_typehints_description_target = "documented"
# The two packages define the same names: fully qualified type hints link to the right
# package's class, and are displayed unqualified.
autodoc_typehints_format = "fully-qualified"
python_use_unqualified_type_names = True
autodoc_default_options = {"members": True, "show-inheritance": True}
add_module_names = False
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False

# ---- MyST: $...$ and $$...$$ math, rendered by MathJax.
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# ---- myst-nb: execute the tutorials (cached by their code cells' content).
_execute = os.environ.get("CONSTRAINED_PPL_DOCS_EXECUTE", "1") != "0"
nb_execution_mode = "cache" if _execute else "off"
nb_execution_raise_on_error = True
nb_execution_timeout = 600
nb_execution_show_tb = True
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_merge_streams = True

html_theme = "alabaster"
html_title = f"constrained-ppl {release}"
html_theme_options = {
    "description": "Exactly-constrained distributions for Pyro and NumPyro",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "260px",
}


def _copy_tutorials() -> None:
    """``notebooks/*.ipynb`` -> ``docs/tutorials/`` (ignored by git): Sphinx reads sources
    only under ``docs/``. A notebook is rewritten only when it changed, so that an
    incremental build does not re-read the others."""
    target = DOCS / "tutorials"
    target.mkdir(exist_ok=True)
    sources = sorted((ROOT / "notebooks").glob("*.ipynb"))
    for source in sources:
        copy = target / source.name
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            shutil.copyfile(source, copy)
    for stale in set(target.glob("*.ipynb")) - {target / s.name for s in sources}:
        stale.unlink()


def _draw_figures() -> None:
    """The overview picture, drawn by ``docs/overview_figure.py`` into ``docs/_generated/``
    (ignored by git): the figure is regenerated from its script at every build."""
    subprocess.run(
        [sys.executable, str(DOCS / "overview_figure.py"), str(DOCS / "_generated")],
        check=True,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )


_copy_tutorials()
_draw_figures()
