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


def test_both_packages_build_the_same_data():
    # The showcases mirror each other; their NumPy data generators are kept identical.
    pyro_showcase = importlib.import_module("pyro_constrained.showcase")
    numpyro_showcase = importlib.import_module("numpyro_constrained.showcase")
    builders = [
        ("make_sparse_regression", dict(n_data=20, n_features=8, k=3, noise=0.5)),
        ("make_molecules", dict(n_molecules=5, n_atoms=6)),
        ("make_bags", dict(n_bags=7, rate=np.array([1.0, 2.0, 3.0]))),
    ]
    for name, kwargs in builders:
        a = getattr(pyro_showcase, name)(np.random.default_rng(3), **kwargs)
        b = getattr(numpyro_showcase, name)(np.random.default_rng(3), **kwargs)
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{name}: {key}")


def test_molecule_charges_sum_to_the_total_charge():
    # The data generator's own promise, checked independently of any distribution.
    from pyro_constrained.showcase import make_molecules

    data = make_molecules(np.random.default_rng(0), n_molecules=50, n_atoms=7)
    np.testing.assert_allclose(data["charges"].sum(-1), data["total"], atol=1e-12)
    np.testing.assert_allclose(data["mean_charges"].sum(-1), data["total"], atol=1e-12)
    assert set(np.unique(data["total"])) <= {-1.0, 0.0, 1.0}
