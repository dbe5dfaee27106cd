"""The README's first minutes: two copy-paste commands (the main job; the tests, exactly as CI
runs them) and a NumPy example that runs without a GPU."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)


def test_readme_opens_with_two_commands():
    """Before any other code block: one bash command that installs and runs the main job,
    one that installs and runs the tests."""
    (lang1, main_job), (lang2, tests) = BLOCKS[:2]
    assert (lang1, lang2) == ("bash", "bash")
    for command in (main_job, tests):
        assert len(command.strip().splitlines()) == 1, "one line to copy and paste"
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install -e ")
    assert main_job.strip().endswith("&& numba-flash compare")
    assert tests.strip().endswith("&& python -m pytest -q -n auto")
    assert README.index("```bash") < README.index("## ")  # they open the README


def test_test_command_is_what_ci_runs():
    """.ci/run installs the same extras and runs the same test command as the README says."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme_cmd = BLOCKS[1][1].strip()
    install = re.search(r'pip install -e "[^"]*"', readme_cmd).group(0)
    assert re.search(rf"^{re.escape(install)}$", ci, re.M), f"{install} not in .ci/run"
    assert re.search(r"^python -m pytest -q -n auto$", ci, re.M)
    assert ci.strip().splitlines()[-1] == "python -m pytest -q -n auto"


def test_numpy_example_runs_without_a_gpu():
    example = next(code for lang, code in BLOCKS if lang == "python" and "import numpy" in code)
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    shape, err = done.stdout.rsplit(")", 1)
    assert shape + ")" == "(1, 2, 64, 32)" and float(err) < 1e-6
