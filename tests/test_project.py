"""The project's own promises: CI runs the README's test command."""

import re
from pathlib import Path

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
