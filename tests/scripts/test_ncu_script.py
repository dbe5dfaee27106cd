"""The pure parts of scripts/ncu_traffic.py (the run itself needs a GPU and ncu)."""

from __future__ import annotations

import math
import pathlib

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def ncu():
    return load_script("ncu_traffic.py", "ncu_traffic")


def _csv(kernels):
    head = '"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","sm__warps_active.avg.pct_of_peak_sustained_active","gpu__time_duration.sum"'
    units = '"","","byte","byte","%","nsecond"'
    lines = ["==PROF== Disconnected", head, units]
    for i, (name, rd, wr, occ, t) in enumerate(kernels):
        lines.append(f'"{i}","{name}","{rd:,}","{wr}","{occ}","{t}"')
    return "\n".join(lines)


def test_groups_kernels_between_markers(ncu):
    runs = [dict(algorithm="fa2", seq=8, block_m=4, block_n=4, sweep="seq"),
            dict(algorithm="standard", seq=8, block_m=4, block_n=4, sweep="seq")]
    text = _csv([
        ("ncu_run_marker(Array)", 0, 0, 1, 1),
        ("fa2_forward", 1000, 200, 20, 100),
        ("ncu_run_marker(Array)", 0, 0, 1, 1),
        ("cutlass_gemm", 3000, 1000, 50, 300),
        ("exp_kernel", 500, 500, 30, 100),
        ("ncu_run_marker(Array)", 0, 0, 1, 1),
    ])
    res = ncu.group_runs(ncu.parse_ncu_csv(text), runs)
    assert [r["kernels"] for r in res] == [1, 2]
    assert res[0]["dram_bytes"] == 1200 and res[1]["dram_bytes"] == 5000
    # achieved occupancy, weighted by kernel time: (50*300 + 30*100) / 400 / 100
    assert math.isclose(res[1]["achieved_occupancy"], 0.45)
    assert math.isclose(res[1]["time_ms"], 400 / 1e6)


def test_marker_count_mismatch_is_an_error(ncu):
    text = _csv([("ncu_run_marker", 0, 0, 1, 1), ("fa1_forward", 1, 1, 1, 1), ("ncu_run_marker", 0, 0, 1, 1)])
    with pytest.raises(RuntimeError, match="planned 2"):
        ncu.group_runs(ncu.parse_ncu_csv(text), [{}, {}])


def test_plan_caps_the_standard_baseline(ncu):
    runs = ncu.plan([1024, 8192], [16])
    assert not any(r["algorithm"] == "standard" and r["seq"] == 8192 for r in runs)
    assert sum(r["sweep"] == "block_n" for r in runs) == 2


def test_model_columns_and_markdown(ncu, tmp_path):
    res = [dict(algorithm="fa2", seq=1024, block_m=128, block_n=32, sweep="seq", kernels=1,
                dram_bytes=5e7, achieved_occupancy=0.2, time_ms=1.0)]
    ncu.add_model(res, 60 * 2**20)
    assert res[0]["model_dram_bytes"] > 0 and res[0]["model_global_bytes"] >= res[0]["model_dram_bytes"]
    assert "| seq | fa2 | 1024 | 32 |" in ncu.markdown(res)
    paths = ncu.plot(res, str(tmp_path))
    assert all(pathlib.Path(p).stat().st_size > 0 for p in paths)
