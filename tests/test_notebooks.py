"""The tutorial notebooks run top to bottom, and are stored without outputs.

Each notebook asserts its own headline result in its last cell, so executing it is the
test: a failing cell (an exception or a failed assertion) fails the test.

Executing them (``test_notebook_runs``, marked ``notebooks``) takes about three minutes of
CPU, a quarter of the suite's budget, and CI executes them anyway when it builds the
documentation (myst-nb, a failing cell fails the build). So the default test command
deselects them (``-m "not notebooks"`` in setup.cfg) and keeps the checks here that cost
nothing; ``python -m pytest -m notebooks`` runs them as a test.
"""

import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
EXPECTED = [
    "01_select_k_features.ipynb",
    "02_charge_neutral_prediction.ipynb",
    "03_count_deconvolution.ipynb",
    "04_constrained_vae_digits.ipynb",
    "05_discrete_inference.ipynb",
    "06_process_surrogate.ipynb",
    "07_counts.ipynb",
    "08_constrained_diffusion.ipynb",
    "09_k_subset_vae.ipynb",
]
# The issue allows three minutes per notebook on a 2-core CPU; idle, each takes under 40 s.
TIMEOUT_S = 180


def test_the_tutorials_exist():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_is_stored_without_outputs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells, name
    for cell in code_cells:
        assert cell.outputs == [], cell.source[:80]
        assert cell.execution_count is None, cell.source[:80]


@pytest.mark.notebooks
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs(name):
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    env = dict(os.environ)
    # Jupyter's inline backend: non-interactive (figures render with Agg, no window is
    # opened) and, unlike plain "Agg", it puts each figure into the cell's outputs.
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    client = NotebookClient(
        notebook,
        timeout=TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    start = time.perf_counter()
    client.execute(env=env)  # raises CellExecutionError if any cell fails
    elapsed = time.perf_counter() - start
    assert elapsed < TIMEOUT_S, f"{name} took {elapsed:.0f} s"
    figures = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if "image/png" in output.get("data", {})
    ]
    assert figures, f"{name} shows no plot or image"
