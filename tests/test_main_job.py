"""The main job: ``python -m pyro_constrained`` and ``python -m numpyro_constrained``.

Each package's showcase is run as a user runs it (a subprocess, with ``--quick`` for fewer
SVI steps) and its printed results table is parsed and checked against the issue's
promises: samples satisfy the constraint exactly (integers) or to float32 rounding
(the Gaussian), and the recovered quantities are close to the truth that generated the data.
"""

import importlib
import io
import os
import re
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
    # Progress on, into a pipe (not a terminal), as in a CI log or under nohup.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", package, "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# NumPyro's is a fresh process that compiles every program anew (about 18 s).
@pytest.mark.parametrize(
    "package", ["pyro_constrained", pytest.param("numpyro_constrained", marks=pytest.mark.slow)]
)
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
    _check_progress_lines(run.stderr, rows)
    _check_notes_and_code(run.stdout, rows, package)


def _check_progress_lines(stderr, rows):
    # Without a terminal: no bar redrawn with carriage returns, one line per model, whose
    # final loss is the table's, and a first line that names --no-progress.
    assert "\r" not in stderr, stderr
    lines = stderr.splitlines()
    assert "--no-progress" in lines[0], stderr
    for name, row in rows.items():
        mine = [line for line in lines if line.startswith(f"{name}: ")]
        assert len(mine) == 1, stderr
        assert f"{row['steps']} SVI steps" in mine[0], mine
        assert f"final loss {row['final loss']} " in mine[0], (mine, row)
        averaged = max(1, int(row["steps"]) // 10)
        assert f"(mean of the last {averaged})" in mine[0], mine


def _check_notes_and_code(stdout, rows, package):
    # The table says what "final loss" is, and names the file and function of each row.
    words = " ".join(stdout.split())  # the notes are wrapped
    assert "final loss: SVI's loss" in words and "averaged over the last tenth" in words, stdout
    showcase = importlib.import_module(f"{package}.showcase")
    for name in rows:
        where = re.search(rf"^  {name} +(\S+):(\d+), (\w+)\(\)$", stdout, re.M)
        assert where, stdout
        path, line, function = where.groups()
        code = getattr(showcase, function).__code__
        assert os.path.samefile(ROOT / path, code.co_filename), where.group(0)
        assert int(line) == code.co_firstlineno, where.group(0)


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


def test_progress_without_a_terminal_is_one_line_per_stage():
    from constrained_ppl.showcase.progress import StageProgress

    stream = io.StringIO()  # not a terminal
    stage = StageProgress(1000, "Model", stream=stream)
    for step in stage:
        stage.show_loss(step, 2.0 * step)
    stage.finish(123.0)
    assert stream.getvalue().count("\n") == 1, stream.getvalue()
    line = stream.getvalue()
    assert line.startswith("Model: 1000 SVI steps in ") and "\r" not in line, line
    assert "last step's loss 1998, final loss 123 (mean of the last 100)" in line, line


def test_progress_disabled_writes_nothing_and_a_terminal_gets_a_bar():
    from constrained_ppl.showcase.progress import StageProgress

    for enabled, interactive in [(False, False), (False, True)]:
        stream = io.StringIO()
        stage = StageProgress(50, "Model", enabled=enabled, stream=stream, interactive=interactive)
        for step in stage:
            stage.show_loss(step, 1.0)
        stage.finish(1.0)
        assert stream.getvalue() == ""
    stream = io.StringIO()
    stage = StageProgress(50, "Model", stream=stream, interactive=True)
    for step in stage:
        stage.show_loss(step, float(step))
    stage.finish(47.0)
    # tqdm redraws in place; its last state shows the last step's loss beside the mean.
    assert "\r" in stream.getvalue()
    assert "loss=49, mean_last_5=47" in stream.getvalue().rsplit("\r", 1)[-1]


def test_final_loss_is_the_mean_of_the_last_tenth():
    from constrained_ppl.showcase.progress import final_loss

    losses = [float(i) for i in range(1, 201)]  # the last tenth: 181..200
    assert final_loss(losses) == sum(range(181, 201)) / 20
    assert final_loss([3.0, 5.0]) == 5.0  # at least one step


def test_main_explains_its_progress_and_names_the_code(capsys):
    # The shared command line, with a stand-in experiment (no framework, no fit).
    from constrained_ppl.showcase import ShowcaseResult, main, run_experiments

    def fit_nothing(seed=0, progress=True, steps=100):
        return ShowcaseResult("Stand-in", "none", steps, 1.0, 0.0, 0.0, "none", 0.0, 1.0, 0.1)

    def run_showcase(seed, quick, progress):
        return run_experiments([fit_nothing], [20], seed=seed, quick=quick, progress=progress)

    assert main(["--quick"], "prog", "description", run_showcase) == 0
    out, err = capsys.readouterr()
    assert "--no-progress" in err  # capsys is not a terminal
    # The note (wrapped) says that the final loss averages a tenth of the 20 steps.
    assert "last tenth of the steps (2 here)" in " ".join(out.split()), out
    code = fit_nothing.__code__
    where = f"{os.path.relpath(code.co_filename)}:{code.co_firstlineno}, fit_nothing()"
    assert f"  Stand-in  {where}" in out, out
    assert main(["--no-progress"], "prog", "description", run_showcase) == 0
    assert capsys.readouterr().err == ""
