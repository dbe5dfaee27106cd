"""Every research script on a machine without a GPU, CuPy or torch (both made unimportable, as
in an install without their extras): ``--help`` works, and the run a user would type either
works or exits non-zero with one line saying what it needs (``numba_flash.needs``) -- never a
traceback, never exit status 0 with nothing measured.

One interpreter runs them all (``runpy``, as ``python scripts/X.py`` would), so that numba is
imported once."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from numba_flash._world import simulated

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
# The run of each script a user would type first (``None``: it works here, exit status 0).
RUNS = {
    "bench.py": [],
    "decode_bench.py": [],
    "decode_sweep.py": [],
    "first_call.py": [],
    "flash_attn_grid.py": [],
    "hbm_read_ceiling.py": [],
    "fa3_bench.py": [],
    "fa3_ncu.py": ["--out", "{tmp}/ncu-fa3"],
    "mask_gallery.py": [],
    "mod_cost.py": [],
    "ncu_traffic.py": ["--out", "{tmp}/ncu"],
    "online_softmax_demo.py": None,
    "regimes.py": ["--out", "{tmp}/regimes"],
    "regression_timing.py": ["--base", str(ROOT)],
    "sanitize.py": [],
    "sass_fingerprint.py": ["--stats", "--match", "no-such-configuration"],  # with every tool here: nothing matched
    "train_toy.py": [],
    "varlen_bench.py": [],
}
DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback
sys.modules["cupy"] = None
sys.modules["torch"] = None
results = {}
for script, runs in json.loads(sys.argv[1]).items():
    for mode, argv in runs.items():
        out, err, code = io.StringIO(), io.StringIO(), 0
        sys.argv = [script, *argv]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exc:
                if isinstance(exc.code, str):  # sys.exit("message"): printed, status 1
                    print(exc.code, file=sys.stderr)
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            except BaseException:
                code = "traceback"
                traceback.print_exc()
        text = out.getvalue()  # (--help: its start, where usage is; a run: its end, where the verdict is)
        results[f"{mode} {script.rsplit('/', 1)[-1]}"] = dict(code=code, out=text[:3000] if mode == "help" else text[-3000:],
                                                             err=err.getvalue()[-3000:])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scripts")
    plan = {}
    for name, argv in RUNS.items():
        runs = {"help": ["--help"]}
        if simulated():
            runs["run"] = [a.replace("{tmp}", str(tmp)) for a in (argv or [])]
        plan[str(SCRIPTS / name)] = runs
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(plan)], capture_output=True, text=True,
                          timeout=600, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_script_is_listed():
    assert sorted(p.name for p in SCRIPTS.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_help_works(results, name):
    result = results[f"help {name}"]
    assert result["code"] == 0 and "usage:" in result["out"], result


@pytest.mark.skipif(not simulated(), reason="what a machine without a GPU says")
@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_run_works_or_says_in_one_line_what_it_needs(results, name):
    result = results[f"run {name}"]
    if RUNS[name] is None:
        assert result["code"] == 0, result
        return
    lines = [line for line in result["err"].splitlines() if line.strip()]
    assert result["code"] not in (0, "traceback") and len(lines) == 1 and "Traceback" not in result["err"], result
    assert lines[0].startswith(name) and (" needs " in lines[0] or name == "sass_fingerprint.py"), lines[0]


@pytest.mark.skipif(not simulated(), reason="what a machine without a GPU says")
def test_ring_check_says_what_it_needs_before_running_anything(tmp_path):
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    done = subprocess.run(["bash", str(SCRIPTS / "ring_check.sh")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.startswith("ring_check.sh needs a CUDA GPU") and len(done.stderr.splitlines()) == 1
    assert not (tmp_path / "ring-check").exists()
