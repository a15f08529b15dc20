"""The main job: ``python -m pyro_constrained`` and ``python -m numpyro_constrained``.

Each package's showcase is run as a user runs it (a subprocess, with ``--quick`` for fewer
SVI steps) and its printed results table is parsed and checked against the issue's
promises: samples satisfy the constraint exactly (integers) or to float32 rounding
(the Gaussian), and the recovered quantities are close to the truth that generated the data.
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["pyro_constrained", "numpyro_constrained"]

COLUMNS = [
    "distribution",
    "model fitted with SVI",
    "steps",
    "final loss",
    "violation",
    "tol",
    "error vs truth",
    "error",
    "max",
    "time s",
    "ok",
]

# The promises, stated here independently of the thresholds the showcase prints.
MAX_VIOLATION = {
    "ExactlyKBernoulli": 0.0,  # k-hot vectors: exact
    "LinearConstrainedNormal": 1e-5,  # float32 rounding of a sum of ten charges
    "ConditionedPoisson": 0.0,  # integer counts: exact
}
MAX_ERROR = {
    "ExactlyKBernoulli": 0.1,  # relative L2 error of the regression coefficients
    "LinearConstrainedNormal": 0.01,  # mean absolute charge error; charges are of order 0.1 to 0.5
    "ConditionedPoisson": 0.15,  # mean relative error of the per-type rates
}


def _run_main(package):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", package, "--quick", "--no-progress"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_main_job_prints_a_passing_results_table(package):
    run = _run_main(package)
    assert run.returncode == 0, run.stdout + run.stderr
    table = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in run.stdout.splitlines()
        if line.startswith("| ")
    ]
    assert table[0] == COLUMNS, run.stdout
    rows = {cells[0]: dict(zip(COLUMNS, cells, strict=True)) for cells in table[1:]}
    assert set(rows) == set(MAX_VIOLATION), run.stdout
    for name, row in rows.items():
        assert int(row["steps"]) > 0
        assert np.isfinite(float(row["final loss"])), row
        assert 0.0 <= float(row["violation"]) <= MAX_VIOLATION[name], row
        assert 0.0 <= float(row["error"]) <= MAX_ERROR[name], row
        assert float(row["time s"]) > 0.0
        assert row["ok"] == "yes"
    assert "all checks passed" in run.stdout


@pytest.mark.parametrize("package", PACKAGES)
def test_both_packages_use_the_shared_data_generators(package):
    # Both showcases fit the same data because they call the one copy of the generators.
    import constrained_ppl.showcase

    showcase = importlib.import_module(f"{package}.showcase")
    for name in ["make_sparse_regression", "make_molecules", "make_bags", "ShowcaseResult"]:
        assert getattr(showcase, name) is getattr(constrained_ppl.showcase, name), name


@pytest.mark.parametrize(
    "module, foreign",
    [
        ("constrained_ppl.showcase", ["torch", "jax"]),
        ("pyro_constrained.showcase", ["jax"]),
        ("numpyro_constrained.showcase", ["torch"]),
    ],
)
def test_showcase_imports_only_its_own_framework(module, foreign):
    # Each package must work with only its own framework installed; a fresh interpreter
    # shows what importing the module really pulls in.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = f"import sys, {module}; print(sorted(m for m in {foreign!r} if m in sys.modules))"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


def test_molecule_charges_sum_to_the_total_charge():
    # The data generator's own promise, checked independently of any distribution.
    from constrained_ppl.showcase import make_molecules

    data = make_molecules(np.random.default_rng(0), n_molecules=50, n_atoms=7)
    np.testing.assert_allclose(data["charges"].sum(-1), data["total"], atol=1e-12)
    np.testing.assert_allclose(data["mean_charges"].sum(-1), data["total"], atol=1e-12)
    assert set(np.unique(data["total"])) <= {-1.0, 0.0, 1.0}
