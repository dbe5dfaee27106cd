"""``numba-flash warmup`` (``numba_flash.warmup``): its plan, its refusal without a GPU, and
that a failing case is reported while the rest still run (the calls themselves: tests/gpu)."""

from __future__ import annotations

import json

import pytest

from numba_flash import warmup as warm
from numba_flash.research.cli import main


def test_the_plan_covers_each_configuration_once():
    cases = warm.plan(backward=True, decode=True, algorithms=("fa2", "fa1"))
    labels = [c.label for c in cases]
    assert len(labels) == len(set(labels))
    # per dtype x D x mask: fa2 unsplit and split, its two backwards; fa1 unsplit and its backward;
    # decode unsplit and split for the 16-bit dtypes
    assert len(cases) == 3 * 2 * 2 * (4 + 2) + 2 * 2 * 2 * 2
    assert not any(c.call == "decode" and c.dtype == "float32" for c in cases)
    assert not any(c.algorithm == "fa1" and c.num_splits != 1 for c in cases)
    assert {c.head_dim for c in cases} == {64, 128} and {c.causal for c in cases} == {False, True}
    only = warm.plan(dtypes=("float16",), head_dims=(96,), causal=(True,))
    assert [c.label for c in only] == ["attention float16 D96 causal fa2", "attention float16 D96 causal fa2 splits=2"]


def test_dry_run_lists_the_cases_without_a_gpu(capsys):
    assert main(["warmup", "--dry-run", "--dtype", "float32", "--head-dim", "32", "--causal", "off", "--backward"]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == [
        "attention float32 D32 full fa2", "attention float32 D32 full fa2 splits=2",
        "attention_backward float32 D32 full fa2", "attention_backward float32 D32 full fa2 deterministic"]


def test_without_a_gpu_it_says_what_it_needs_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(warm, "needs_for", lambda cases: ["a CUDA GPU (Numba runs in its CUDA simulator here)", None])
    assert main(["warmup", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["numba-flash warmup needs a CUDA GPU (Numba runs in its CUDA simulator here); --dry-run lists the cases"]


def test_a_failing_case_is_reported_and_the_rest_still_run(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(warm, "needs_for", lambda cases: [None])
    ran = []

    def fake_run(case, rng):
        ran.append(case.label)
        if case.num_splits == 2:
            raise ValueError("no room")

    monkeypatch.setattr(warm, "run_case", fake_run)
    assert main(["warmup", "--dtype", "float16", "--head-dim", "64", "--causal", "on", "--json"]) == 1
    out = capsys.readouterr()
    rows = json.loads(out.out)
    assert ran == [r["case"] for r in rows] == ["attention float16 D64 causal fa2", "attention float16 D64 causal fa2 splits=2"]
    assert "error" not in rows[0] and rows[1]["error"] == "ValueError: no room"
    assert all(r["new_kernels"] == 0 and r["seconds"] >= 0 for r in rows)
    assert "[2/2] attention float16 D64 causal fa2 splits=2: " in out.err and "1 cases FAILED" in out.err


@pytest.mark.parametrize("argv", [["warmup", "--dtype", "float64"], ["warmup", "--head-dim", "0"]])
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
