"""The `numba-flash` command, in whichever world this machine has (simulator in CI)."""

from __future__ import annotations

import json

import pytest

from numba_flash.cli import main


def test_compare_prints_both_algorithms_side_by_side(capsys):
    assert main(["compare", "--seq", "9", "--head-dim", "5", "--heads", "2", "--kv-heads", "1",
                 "--block-m", "4", "--block-n", "4", "--causal"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert "FA-1" in header and "FA-2" in header
    for row in ("relative error", "shared memory / block", "modelled global traffic", "TFLOP/s"):
        assert row in out
    rel = [line for line in out.splitlines() if line.startswith("| relative error")][0]
    assert all(float(cell) < 1e-5 for cell in rel.strip("|").split("|")[1:])


def test_compare_json(capsys):
    assert main(["compare", "--seq", "6", "--head-dim", "3", "--block-m", "2", "--block-n", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["algorithm"] for r in rows] == ["fa1", "fa2"]
    assert all(r["rel_err"] < 1e-5 and r["modelled_bytes"] > 0 for r in rows)
    assert rows[0]["modelled_bytes"] > rows[1]["modelled_bytes"]  # FA-1's round trips


def test_compare_refuses_bad_problems_in_one_line(capsys):
    assert main(["compare", "--block-m", "3"]) == 2
    assert "block_m=3 is not supported" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", "--seq", "0"])


def test_demo_prints_the_seed_example(capsys):
    assert main(["demo"]) == 0
    assert "1.0" in capsys.readouterr().out


def test_autotune_needs_a_gpu(capsys):
    from numba_flash._world import simulated

    if not simulated():
        pytest.skip("on a GPU autotune would run for minutes")
    assert main(["autotune"]) == 2
    assert "GPU" in capsys.readouterr().err
