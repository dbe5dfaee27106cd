"""scripts/fa3_ncu.py without a GPU: its readers of ncu's CSV pages (raw metrics with their units
row; the source page's per-kernel SASS rows) and the summary built from them."""

from __future__ import annotations

import pytest
from helpers import script_module


@pytest.fixture(scope="module")
def fa3_ncu():
    yield from script_module("fa3_ncu.py", "fa3_ncu_script")


RAW = '''"ID","Kernel Name","gpu__time_duration.sum","sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active","smsp__pcsamp_warps_issue_stalled_wait","smsp__pcsamp_warps_issue_stalled_barrier","smsp__pcsamp_warps_issue_stalled_wait_not_issued"
"","","usecond","%","","",""
"0","transpose_values","38.5","1.0","10","0","7"
"1","kernel[fa3]","826.9","37.3","300","100","250"
'''

SOURCE = '''"Kernel Name","transpose_values"
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"
"0x10","LDG.E R2, [R4.64]","5","100"
"Kernel Name","kernel[fa3]"
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"
"0x10","MUFU.EX2 R36, R36","30","64"
"0x20","@!P0  BRA 0x7f00","20","64"
"0x30","MUFU.EX2 R37, R37","30","64"
"0x40","FMNMX.NAN R195, R24, R25, !PT","15","64"
"0x50","WARPGROUP.DEPBAR.LE gsb0, 0x1","5","2"
'''


def test_raw_page_gives_each_kernel_its_metrics_and_the_units(fa3_ncu):
    kernels, units = fa3_ncu.raw_kernels(RAW)
    assert [name for name, _ in kernels] == ["transpose_values", "kernel[fa3]"]
    assert kernels[1][1]["gpu__time_duration.sum"] == 826.9 and units["gpu__time_duration.sum"] == "usecond"
    assert fa3_ncu.stall_reasons(kernels[1][1]) == [("wait", 0.75), ("barrier", 0.25)]  # the not-issued split left out


def test_source_page_sums_the_busiest_kernels_samples_by_opcode(fa3_ncu):
    stalls, executed = fa3_ncu.source_by_opcode(SOURCE)
    assert stalls == {"MUFU.EX2": 60.0, "BRA": 20.0, "FMNMX": 15.0, "WARPGROUP.DEPBAR.LE": 5.0}  # not the transpose's
    assert executed["MUFU.EX2"] == 128.0
    assert fa3_ncu.opcode("@!UP0 UIADD3 UR16, UR16, 0x2, URZ") == "UIADD3"
