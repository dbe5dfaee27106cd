"""scripts/flash_attn_grid.py without a GPU: FlashAttention's grid sizes and what is cut from them,
--dry-run, the comparison rule on synthetic numbers, the references against numba_flash's, and
--simulate --max-cases 2 end to end in the simulator."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import script_module

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "flash_attn_grid.py"


@pytest.fixture(scope="module")
def grid():
    yield from script_module("flash_attn_grid.py", "flash_attn_grid_script")


# FlashAttention tests/test_flash_attn.py at 0251105a, counted by hand from its decorators:
# test_flash_attn_output: kvpacked 2, dtype 2, mha_type 3, deterministic 2, alibi 2, local 2, causal 2,
# d 11, (seqlen_q, seqlen_k) 10, dropout_p 2, softcap 2; it skips softcap > 0 with dropout > 0 (1/4).
OUTPUT_TOTAL = 2 * 2 * 3 * 2 * 2 * 2 * 2 * 11 * 10 * 2 * 2  # 84480
# Kept: every d (up to 256 since issue 25), no dropout (softcap, local windows and ALiBi run since
# issue 24); the forward ignores deterministic.
FORWARD_KEPT = 2 * 2 * 3 * 2 * 11 * 10 * 2 * 2 * 2  # kvpacked, dtype, mha_type, causal, d, seqlens, local, softcap, alibi
# test_flash_attn_kvcache: dtype 1, num_splits 2, mha_type 3, new_kv 2, alibi 2, local 2, causal 2,
# seqlen_new_eq_seqlen_q 2, rotary_interleaved 2, rotary_fraction 3, paged 2, has_leftpad 2,
# has_batch_idx 1, d 6, seqlens 11; the paged axis gains issue 25's page sizes 16 and 64 (4 values).
KVCACHE_TOTAL = 2 * 3 * 2 * 2 * 2 * 2 * 2 * 2 * 3 * 4 * 2 * 6 * 11  # 608256
# num_splits, mha_type, causal, d (all 6), seqlens, local, alibi, paged 4, and new_kv: False (seqlen_new_eq_seqlen_q
# collapsed) or True with both values: 38016
KVCACHE_KEPT = 2 * 3 * 2 * 6 * 11 * 2 * 2 * 4 * 3


def test_grid_sizes_and_exclusions(grid):
    fwd, fc = grid.grid("forward")
    bwd, bc = grid.grid("backward")
    kv, kc = grid.grid("kvcache")
    assert fc["total"] == bc["total"] == OUTPUT_TOTAL and fc["skipped by FlashAttention"] == OUTPUT_TOTAL // 4
    assert fc["FlashAttention cases kept"] == FORWARD_KEPT and bc["FlashAttention cases kept"] == 2 * FORWARD_KEPT
    assert len(fwd) == 2 * FORWARD_KEPT  # FA-2 and FA-1
    assert len(bwd) == 2 * FORWARD_KEPT + FORWARD_KEPT  # FA-2 with deterministic False / True, FA-1 once
    assert kc["total"] == KVCACHE_TOTAL and kc["FlashAttention cases kept"] == len(kv) == KVCACHE_KEPT
    for counts in (fc, bc, kc):  # every case of FA's grid is accounted for once
        assert sum(n for what, n in counts.items() if what not in ("total", "runs (with our variants)")) == counts["total"]
    dropped = {what.split(":")[0] for what in fc if "=" in what.split(":")[0]}
    assert dropped == {"dropout_p=0.17"}
    dropped = {what.split(":")[0] for what in kc if "=" in what.split(":")[0]}
    assert dropped == {"has_leftpad=True", "rotary_fraction=0.5", "rotary_fraction=1.0"}
    assert max(c.p["d"] for c in fwd) == max(c.p["d"] for c in kv) == 256  # issue 25: every head dim of FA's grids
    for c in fwd + bwd + kv:  # nothing numba_flash cannot run is left
        assert c.p.get("dropout_p", 0) == 0 and c.p.get("rotary_fraction", 0) == 0
    assert {c.p["paged_kv_block_size"] for c in kv} == {None, 16, 64, 256} and {c.p["new_kv"] for c in kv} == {False, True}
    assert {c.p["local"] for c in fwd + kv} == {False, True} and {c.p["softcap"] for c in fwd} == {0.0, 50.0}
    assert {c.p["alibi"] for c in fwd + bwd + kv} == {False, True}
    assert {c.p["seqlens"] for c in fwd} == set(grid.OUTPUT_GRID["seqlens"]) and len(grid.OUTPUT_GRID["seqlens"]) == 10
    assert len(grid.grid("forward", algorithms=["fa2"])[0]) == FORWARD_KEPT
    assert len(grid.grid("backward", algorithms=["fa1"])[0]) == FORWARD_KEPT


def test_each_process_takes_whole_kernel_configurations(grid):
    cases = grid.grid("forward")[0][:300]
    parts = grid.chunks(cases)
    assert sorted(c.name for cs in parts for c in cs) == sorted(c.name for c in cases)
    for cs in parts:
        assert len({(c.p["dtype"], c.p["d"], c.p["causal"]) for c in cs}) == 1


def test_dry_run_lists_the_cases_and_counts(grid, capsys):
    assert grid.main(["--dry-run", "--part", "kvcache", "--max-cases", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"  {KVCACHE_TOTAL:7d}  total" in out and f"  {KVCACHE_KEPT:7d}  FlashAttention cases kept" in out
    assert sum(line.startswith("kvcache float16 ") for line in out) == 5
    assert out[-1].startswith("5 cases to run; ~") and "kernel configurations" in out[-1]


@pytest.mark.parametrize("part, err, plain, passed", [
    ("forward", 2.0e-3, 1e-3, True), ("forward", 2.01e-3, 1e-3, False),  # o: twice the plain error
    ("backward", 2.9e-3, 1e-3, True), ("backward", 3.1e-3, 1e-3, False),  # dq, dk, dv: three times
    ("kvcache", 3.0e-3 + 1e-5, 1e-3, True), ("kvcache", 3.0e-3 + 2e-5, 1e-3, False),  # 3x + 1e-5
    ("forward", math.nan, 1e-3, False), ("forward", 1e-9, 0.0, False)])
def test_the_rule_on_synthetic_errors(grid, part, err, plain, passed):
    allowed, ratio, ok = grid.judge(part, "float16", {"o": err}, {"o": plain})
    assert ok is passed and (ratio <= 1) is passed
    _, _, ok = grid.judge(part, "float16", {"o": 1e-4, "dk": err}, {"o": 1e-3, "dk": plain})
    assert ok is passed  # one tensor over its bound fails the case


def test_float32_is_held_to_a_fixed_tolerance(grid):
    assert grid.judge("forward", "float32", {"o": 0.9e-5}, {"o": None})[2]
    assert not grid.judge("forward", "float32", {"o": 1.1e-5}, {"o": None})[2]
    assert not grid.judge("backward", "float32", {"dq": 1.1e-4}, {"dq": None})[2]


def test_references_are_numba_flash_reference_and_the_plain_baseline(grid):
    from helpers import plain_fp16_attention

    from numba_flash import reference

    A, rng = grid.Arrays(simulate=True), np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 9, 11)).astype(np.float16)  # Nq > Nk causal: rows that see no key
    k, v = (rng.standard_normal((1, 2, 6, 11)).astype(np.float16) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float16)
    visible = grid.visible_keys(A, 1, 9, 6, True)
    ref = grid.materialised(A, q, k, v, visible, "float64", do)
    want = reference.attention_backward(do, q, k, v, causal=True)
    for name, w in zip(("dq", "dk", "dv"), want):
        assert np.allclose(ref[name], w, rtol=1e-10, atol=1e-12), name
    o = grid.materialised(A, q, k, v, visible, "float64")["o"]
    assert np.allclose(o, reference.attention(q, k, v, causal=True)[0], rtol=1e-10, atol=1e-12)
    plain = grid.materialised(A, q, k, v, visible, "float16")["o"]
    assert np.abs(plain - plain_fp16_attention(q, k, v, causal=True)).max() <= 2e-3  # an ulp or two at |o| ~ 1
    lens = np.array([4], np.int32)  # a cache of 4 valid keys: the rest is never seen
    seen = grid.materialised(A, q[:, :, :2], k, v, grid.visible_keys(A, 1, 2, 6, True, lens), "float64")["o"]
    assert np.allclose(seen, reference.attention(q[:, :, :2], k[:, :, :4], v[:, :, :4], causal=True)[0])
    slopes = rng.uniform(0.1, 0.5, (1, 4)).astype(np.float32)  # ALiBi: FA's bias, the reference's rule
    bias = grid.alibi_bias(A, slopes, 9, 6)
    ref = grid.materialised(A, q, k, v, visible, "float64", do, bias=bias)
    want = reference.attention_backward(do, q, k, v, causal=True, alibi_slopes=slopes)
    for name, w in zip(("dq", "dk", "dv"), want):
        assert np.allclose(ref[name], w, rtol=1e-10, atol=1e-12), name
    biased = grid.materialised(A, q[:, :, :2], k, v, grid.visible_keys(A, 1, 2, 6, False, lens), "float64",
                               bias=grid.alibi_bias(A, slopes, 2, 6, lens))["o"]
    want = reference.attention(q[:, :, :2], k[:, :, :4], v[:, :, :4], alibi_slopes=slopes)[0]
    assert np.allclose(biased, want) and not np.allclose(seen, want)


def test_a_failing_case_exits_1(grid, monkeypatch, capsys):
    row = dict(part="forward", case="forward x", variant="fa2", dtype="float16", errors={"o": 3e-3},
               plain={"o": 1e-3}, allowed={"o": 2e-3}, ratio=1.5, passed=False, error=None, seconds=0.1)
    monkeypatch.setattr(grid, "run_all", lambda cases, simulate, jobs, rows=None: [row, dict(row, case="forward y", passed=True)])
    assert grid.main(["--simulate", "--part", "forward", "--max-cases", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED forward x" in out and "1 of 2 cases passed, 1 FAILED" in out


def test_a_run_stopped_by_sigterm_keeps_what_it_reached(grid, monkeypatch, capsys, tmp_path):
    row = dict(part="forward", case="forward x", variant="fa2", dtype="float16", errors={"o": 1e-3},
               plain={"o": 1e-3}, allowed={"o": 2e-3}, ratio=0.5, passed=True, error=None, seconds=0.1)

    def stopped(cases, simulate, jobs, rows=None):
        rows.append(row)  # one case reached, then timeout's SIGTERM
        grid._terminated(15, None)

    monkeypatch.setattr(grid, "run_all", stopped)
    with pytest.raises(SystemExit, match="terminated"):
        grid.main(["--simulate", "--part", "forward", "--max-cases", "3", "--json", str(tmp_path / "g.json")])
    written = json.loads((tmp_path / "g.json").read_text())
    assert written["finished"] is False and [r["case"] for r in written["rows"]] == ["forward x"]
    assert "INTERRUPTED after 1 of 3 cases" in capsys.readouterr().out


def test_simulate_end_to_end(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--simulate", "--max-cases", "1", "--json", str(tmp_path / "g.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "g.json").read_text())["rows"]
    assert [r["part"] for r in rows] == ["forward", "backward", "varlen", "kvcache"]  # (one case of each part)
    tensors = {"backward": {"dq", "dk", "dv"}, "varlen": {"o", "dq", "dk", "dv"}}
    for r in rows:
        assert r["passed"] and r["error"] is None and 0 < r["ratio"] <= 1 and r["seconds"] > 0, r
        assert set(r["errors"]) == tensors.get(r["part"], {"o"})
        assert all(0 < r["errors"][n] <= r["allowed"][n] for n in r["errors"])
    progress = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == 4 and all(" s left)" in line for line in progress)
    assert "4 of 4 cases passed" in done.stdout and "| forward |" in done.stdout and "| varlen |" in done.stdout
