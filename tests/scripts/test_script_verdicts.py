"""A script whose rows all failed exits non-zero: bench.py (no row measured), sass_fingerprint.py
(no configuration compiled), regression_timing.py (a case not timed in both trees). Their
measurements are stubbed out, and what they need is said to be here."""

from __future__ import annotations

import json
import pathlib

import pytest
from helpers import load_script

from numba_flash import needs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name: str):
    return load_script(name, f"verdict_{name[:-3]}")


@pytest.fixture
def everything_here(monkeypatch):
    monkeypatch.setattr(needs, "gpu", lambda: None)
    monkeypatch.setattr(needs, "module", lambda name: None)
    monkeypatch.setattr(needs, "tool", lambda name, how: None)


def test_bench_fails_when_no_row_was_measured(everything_here, monkeypatch, tmp_path):
    bench = load("bench.py")
    monkeypatch.setattr(bench, "sdpa_backend_names", lambda args: {})
    monkeypatch.setattr(bench, "environment", lambda argv, args: {"GPU": "a GPU"})
    monkeypatch.setattr(bench, "write_plots", lambda rows, out, gpu: [])
    monkeypatch.setattr(bench, "markdown_report", lambda rows, meta: "")
    statuses = []
    monkeypatch.setattr(bench, "run_plan", lambda plan, args, meta, out: [
        bench.new_row(cfg, impl, statuses.pop(0)) for cfg, entries in plan for impl, _ in entries])
    argv = ["--seq", "512", "--head-dim", "64", "--dtype", "float32", "--causal", "off", "--impl", "fa1", "fa2",
            "--out", str(tmp_path)]
    statuses[:] = ["failed: CUDA_ERROR_NO_DEVICE", "failed: CUDA_ERROR_NO_DEVICE"]
    assert bench.main(argv) == 1
    statuses[:] = ["failed: OutOfMemoryError", "ok"]  # a peer or a long row may fail: the sweep still measured
    assert bench.main(argv) == 0


def test_sass_fingerprint_fails_when_nothing_compiled(monkeypatch, capsys, tmp_path):
    sass = load("sass_fingerprint.py")
    monkeypatch.setattr(sass, "unmet_toolchain", lambda: None, raising=False)

    def refuse(spec):
        raise RuntimeError("ptxas fatal: Unsupported .version")

    monkeypatch.setattr(sass, "FAMILIES", {"combine": lambda: [("one", None), ("two", None)]})
    monkeypatch.setattr(sass, "compile_spec", refuse)
    assert sass.main(["--stats"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == "sass_fingerprint.py: all 2 configurations failed to compile"
    assert sass.main(["--out", str(tmp_path / "f.json"), "--match", "nothing"]) == 1


def test_regression_timing_fails_when_a_case_was_not_timed(everything_here, monkeypatch):
    timing = load("regression_timing.py")
    cases = [c for c in timing.CASES if "1M" in map(str, c)]
    timed = {json.dumps(list(c)): dict(case=list(c), ms=1.0) for c in cases}
    monkeypatch.setattr(timing, "run_tree", lambda root, repeats, match: {})  # every child failed
    argv = ["--base", str(ROOT), "--match", "1M", "--rounds", "1"]
    assert timing.main(argv) == 1
    monkeypatch.setattr(timing, "run_tree", lambda root, repeats, match: timed)
    assert timing.main(argv) == 0
