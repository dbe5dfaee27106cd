"""Occupancy: the architecture rules against figures the H200's driver reported, and the
ptxas path (no GPU) against those same figures when the toolchain is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ptxas_available

from numba_flash.arch import ARCH
from numba_flash.research.profiling.occupancy import occupancy_from_resources

H100 = ARCH[(9, 0)]


@pytest.mark.parametrize(
    "regs, smem, threads, blocks, limiter",
    [
        (168, 32768, 128, 3, "registers"),  # FA-2 D=64 128x32: driver said 3 (H200, 2026-11-29)
        (127, 32768, 128, 4, "registers"),  # FA-1 D=64 128x32: driver said 4
        (255, 20480, 64, 4, "registers"),  # FA-2 D=128 64x16: driver said 4
        (222, 32768, 128, 2, "registers"),  # causal FA-2 before the register cap: driver said 2
        (32, 48 * 1024, 128, 4, "shared memory"),  # (48K + 1K reserved) x 4 <= 228K < x 5
        (144, 8192, 64, 6, "registers"),  # FA-2 D=32 64x16: driver said 6 (whole warps per sub-partition; 7 without)
        (80, 16384, 64, 12, "registers"),  # FA-1 D=32 64x32: driver said 12
        (128, 44544, 128, 4, "registers"),  # micro-tiled FA-2 D=64 64x32: driver said 4
        (128, 30720, 64, 7, "shared memory"),  # micro-tiled FA-2 D=64 32x32: driver said 7
        (167, 36608, 64, 6, "registers"),  # micro-tiled FA-2 D=128 32x16: driver said 6
        (102, 12032, 64, 8, "registers"),  # micro-tiled FA-2 D=32 32x16: driver said 8
        (16, 0, 1024, 2, "warps"),
        (16, 0, 32, 32, "blocks"),
    ],
)
def test_occupancy_rules(regs, smem, threads, blocks, limiter):
    assert occupancy_from_resources(regs, smem, threads, H100) == (blocks, limiter)


@pytest.mark.skipif(not ptxas_available(), reason="needs numba-flash[occupancy] (libNVVM and ptxas)")
def test_occupancy_command_without_gpu_matches_the_driver():
    """`numba-flash occupancy --json` with no GPU (ptxas path), against the H200 driver's
    figures for the same kernels (2026-11-29, micro-tiled kernels, D=64, tiles 64 x 32,
    128 threads): FA-2 128 registers, 44544 B shared, no spill, 4 blocks/SM; FA-1 128
    registers, 4 blocks/SM."""
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    out = subprocess.run(
        [sys.executable, "-m", "numba_flash", "occupancy", "--json", "--source", "ptxas",
         "--head-dim", "64", "--block-m", "64", "--block-n", "32"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    rows = {r["algorithm"]: r for r in json.loads(out)}
    keys = {"algorithm", "head_dim", "dtype", "block_m", "block_n", "threads", "regs", "smem_bytes",
            "local_bytes", "blocks_per_sm", "occupancy", "limiter"}
    assert keys <= set(rows["fa2"])
    assert rows["fa2"]["threads"] == 128
    assert rows["fa2"]["regs"] == 128 and rows["fa2"]["blocks_per_sm"] == 4
    assert rows["fa2"]["smem_bytes"] == 44544 and rows["fa2"]["local_bytes"] == 0
    assert rows["fa1"]["regs"] <= 128 and rows["fa1"]["blocks_per_sm"] == 4
