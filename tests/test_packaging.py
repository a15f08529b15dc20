"""Packaging promises: each framework is an optional extra, so each package says which extra
to install when its framework is missing; the framework-free package needs only NumPy;
one version; every module ships. (`.ci/check_wheel` checks the built wheel itself in fresh
venvs with one framework each.)

A missing framework is simulated in a fresh interpreter by ``sys.modules[name] = None`` for
its top-level modules, which the import system and ``importlib.util.find_spec`` treat as a
package that is not installed.
"""

import configparser
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["constrained_ppl", "pyro_constrained", "numpyro_constrained"]
FRAMEWORKS = ["torch", "pyro", "jax", "jaxlib", "numpyro", "funsor"]

# A module that is not installed: `import` raises ModuleNotFoundError naming it, and
# importlib.util.find_spec returns None, as for a package pip never installed.
_BLOCK = """
import sys

assert not {blocked!r} & set(sys.modules), "imported before the block"
for name in {blocked!r}:
    sys.modules[name] = None
"""


def _run_without(blocked: set[str], code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    script = _BLOCK.format(blocked=blocked) + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )


def _import_error_of(package: str, blocked: set[str]) -> str:
    run = _run_without(
        blocked,
        f"""
        try:
            import {package}
        except ImportError as error:
            print(type(error).__name__, getattr(error, "name", None), "|", error)
        else:
            print("imported")
        """,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytest.mark.parametrize(
    "package, blocked, extra, missing",
    [
        ("pyro_constrained", {"torch", "pyro"}, "pyro", "'torch' and 'pyro' are"),
        ("pyro_constrained", {"pyro"}, "pyro", "'pyro' is"),  # torch alone is not enough
        (
            "numpyro_constrained",
            {"jax", "jaxlib", "numpyro"},
            "numpyro",
            "'jax', 'jaxlib' and 'numpyro' are",
        ),
        ("numpyro_constrained", {"numpyro"}, "numpyro", "'numpyro' is"),
        ("numpyro_constrained", {"jaxlib"}, "numpyro", "'jaxlib' is"),  # jax without its backend
    ],
)
def test_a_missing_framework_names_the_extra_to_install(package, blocked, extra, missing):
    message = _import_error_of(package, blocked)
    assert message.startswith("ImportError "), message  # not the bare ModuleNotFoundError
    assert f'pip install "constrained-ppl[{extra}]"' in message, message
    assert missing in message, message


def test_a_broken_framework_shows_its_own_error():
    # Pyro is installed but one of its own dependencies is not: that is not solved by the
    # extra's install command, so the original error comes through unchanged.
    message = _import_error_of("pyro_constrained", {"opt_einsum"})
    assert message.startswith("ModuleNotFoundError opt_einsum |"), message
    assert "constrained-ppl[" not in message, message


def test_the_framework_free_package_needs_only_numpy():
    # Every module of constrained_ppl (the showcase half included) imports with the
    # frameworks and SciPy blocked, and pulls in nothing beyond NumPy and the standard library.
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in (ROOT / "constrained_ppl").rglob("*.py")
    )
    assert "constrained_ppl.showcase.process_simulator" in modules, modules
    run = _run_without(
        set(FRAMEWORKS) | {"scipy"},
        f"""
        import importlib
        before = set(sys.modules)
        for module in {modules!r}:
            importlib.import_module(module)
        third_party = {{
            name.split(".")[0] for name in set(sys.modules) - before
        }} - set(sys.stdlib_module_names) - {{"constrained_ppl", "numpy"}}
        print(sorted(third_party))
        """,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


def test_one_version_read_by_setup_and_both_packages():
    import constrained_ppl
    import numpyro_constrained
    import pyro_constrained

    version = constrained_ppl.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert pyro_constrained.__version__ == numpyro_constrained.__version__ == version
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert setup["metadata"]["version"] == "attr: constrained_ppl.__version__"
    # The changelog has a section for the version (or it is the one being prepared).
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M)
    assert "MIT License" in (ROOT / "LICENSE").read_text()


def _requirements(text: str) -> set[str]:
    return {re.split(r"[<>=!~; ]", line.strip())[0] for line in text.splitlines() if line.strip()}


def test_each_framework_is_an_extra():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    required = _requirements(setup["options"]["install_requires"])
    extras = {name: _requirements(value) for name, value in setup["options.extras_require"].items()}
    assert not required & {"torch", "pyro-ppl", "jax", "jaxlib", "numpyro"}, required
    assert extras["pyro"] == {"torch", "pyro-ppl"}
    assert extras["numpyro"] == {"jax", "jaxlib", "numpyro"}
    assert extras["all"] == extras["pyro"] | extras["numpyro"]
    assert extras["pyro"] | extras["numpyro"] <= extras["test"]


def test_every_module_directory_is_a_package():
    # `packages = find:` ships only directories with an __init__.py: a module in any other
    # directory would be missing from the wheel (.ci/check_wheel checks the wheel itself).
    from setuptools import find_packages

    patterns = [name + suffix for name in PACKAGES for suffix in ["", ".*"]]
    found = set(find_packages(where=str(ROOT), include=patterns))
    with_modules = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
    }
    assert with_modules == found, with_modules ^ found


@pytest.mark.parametrize("package", ["pyro_constrained", "numpyro_constrained"])
def test_readme_quick_start_runs(package):
    # The README's first example for each framework; .ci/check_wheel runs the same block
    # against the installed wheel.
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    block = next(b for b in blocks if f"from {package} import" in b)
    exec(compile(block, f"README.md ({package})", "exec"), {})


def test_every_extra_declares_the_framework_floors_that_ci_tests():
    # .ci/check_oldest installs the floors of the [all] extra and runs the framework tests
    # there (.ci/run calls it): every other extra naming a framework must declare the same
    # floor, or a floor would go untested.
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    floors = {}
    for line in setup["options.extras_require"]["all"].split():
        match = re.fullmatch(r"([a-z-]+)>=(\d+\.\d+\.\d+)", line)
        assert match, f"[all]: {line!r} is not NAME>=X.Y.Z (the floor that CI installs)"
        floors[match[1]] = match[2]
    assert set(floors) == {"torch", "pyro-ppl", "jax", "jaxlib", "numpyro"}
    for extra, value in setup["options.extras_require"].items():
        for line in value.split():
            name = re.split(r"[<>=!~; ]", line)[0]
            if name in floors:
                assert line == f"{name}>={floors[name]}", (extra, line)
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "bash .ci/check_oldest" in ci_lines
