"""The project's own promises: CI runs the README's test command."""

import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands():
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_ci_runs_the_readme_test_command():
    commands = _readme_commands()
    test_commands = [c for c in commands if "pytest" in c]
    assert len(test_commands) == 1, commands
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_commands[0] in ci_lines


def test_readme_main_job_runs_a_package():
    commands = _readme_commands()
    assert any(c.rstrip().endswith("python -m pyro_constrained") for c in commands), commands


def test_myst_directive_options_fit_on_their_line():
    # MyST reads a directive's ":name: value" options one line each: an indented next line
    # ends them and becomes the content (the overview figure's alt text once rendered as a
    # caption starting mid-sentence). A long value goes in a YAML block between --- lines.
    for path in sorted((ROOT / "docs").rglob("*.md")):
        if "_build" in path.parts:
            continue
        in_options = False
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if re.match(r"^(`{3,}|:{3,})\{[\w-]+\}", line):
                in_options = True
            elif in_options and re.match(r"^:[\w-]+:", line):
                continue
            elif (
                in_options
                and line.strip()
                and line[0] in " \t"
                and re.match(r"^:[\w-]+:", lines[number - 2])
            ):
                pytest.fail(f"{path.name}:{number}: an option continued on the next line")
            else:
                in_options = False


def test_overview_figure_labels_are_whole():
    # Every title and annotation of docs/overview_figure.py's panels lies inside the figure
    # and clear of the other axes (the colorbar once cut the corner label "z2 = 12").
    pytest.importorskip("matplotlib")
    pytest.importorskip("pyro_constrained")
    spec = importlib.util.spec_from_file_location(
        "overview_figure", ROOT / "docs" / "overview_figure.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fig = module.make_figure()
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        texts = [(ax, text) for ax in fig.axes for text in [ax.title, *ax.texts] if text.get_text()]
        assert any(text.get_text() == "z2 = 12" for _, text in texts)
        for ax, text in texts:
            box = text.get_window_extent(renderer)
            assert box.x0 >= 0 and box.y0 >= 0, text
            assert box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1, text
            for other in fig.axes:
                if other is not ax:
                    assert not box.overlaps(other.get_tightbbox(renderer)), text
    finally:
        module.plt.close(fig)


def _readme_python_blocks():
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_readme_has_its_python_snippets():
    # The quick-starts of both packages and the regression head.
    assert len(_readme_python_blocks()) >= 3


@pytest.mark.parametrize("index", range(len(_readme_python_blocks())))
def test_readme_python_snippet_runs_as_written(index):
    # Each block pasted as it stands into a fresh namespace (no names from elsewhere),
    # with JAX's 64-bit types off, as a NumPyro user runs it (this suite turns them on).
    import jax

    block = _readme_python_blocks()[index]
    with jax.enable_x64(False):
        exec(compile(block, f"README.md, python block {index + 1}", "exec"), {})


def _pytest(*args, env=None):
    """``python -m pytest`` in a fresh interpreter, from the repository root, running one
    cheap test of this file (the child runs a test other than the one that calls it)."""
    env = {**os.environ, **(env or {})}
    env.pop("PYTEST_ADDOPTS", None)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    command += ["tests/test_project.py", "-k", "test_ci_runs_the_readme_test_command"]
    return subprocess.run(
        command + list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_pytest_runs_without_xdist():
    # CONTRIBUTING's quick command for one file: no "unrecognized arguments: -n".
    run = _pytest("-p", "no:xdist")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout, run.stdout


def test_the_readme_test_command_still_spreads_over_workers():
    # The README's plain `python -m pytest` gets `-n auto` from tests/conftest.py
    # (xdist reads the number of workers "auto" means from this variable).
    run = _pytest(env={"PYTEST_XDIST_AUTO_NUM_WORKERS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "created: 1/1 worker" in run.stdout, run.stdout
    assert "1 passed" in run.stdout, run.stdout


def _docstring_layout(obj) -> tuple[list[str], list[str]]:
    """The ``:param name:`` entries and the numpydoc section headings, in order."""
    lines = (inspect.getdoc(obj) or "").splitlines()
    params = [m.group(1) for line in lines if (m := re.match(r"\s*:param (\w+):", line))]
    headings = [
        lines[i].strip()
        for i in range(len(lines) - 1)
        if re.fullmatch(r"-{3,}", lines[i + 1].strip()) and lines[i].strip()
    ]
    return params, headings


def test_public_docstrings_have_the_same_layout_in_both_packages():
    pyro_constrained = pytest.importorskip("pyro_constrained")
    numpyro_constrained = pytest.importorskip("numpyro_constrained")
    shared = sorted(set(pyro_constrained.__all__) & set(numpyro_constrained.__all__))
    assert {"ExactlyKBernoulli", "LinearConstrainedNormal", "ConditionedPoisson"} <= set(shared)
    compared = 0
    for name in shared:
        pyro_obj = getattr(pyro_constrained, name)
        numpyro_obj = getattr(numpyro_constrained, name)
        if name == "losses":  # a module: compare its public functions
            functions = ("expected_l1_loss", "expected_l2_loss")
            pairs = [(getattr(pyro_obj, f), getattr(numpyro_obj, f)) for f in functions]
        elif name == "nn":  # a Module in Pyro, functions in NumPyro: different by design
            continue
        else:
            pairs = [(pyro_obj, numpyro_obj)]
        for left, right in pairs:
            layout = _docstring_layout(left)
            assert layout[1], f"{left} has no sections"
            assert layout == _docstring_layout(right), (left, right)
            compared += 1
    assert compared >= 7
