"""``numba_flash.tile_table``, ``numba_flash.arch`` and ``numba_flash.switches``.

The tile table replaced six tile policies (``kernels.tiles.default_tiles`` and
``forward_rows_per_thread``, ``tc_ops.default_tc_tiles`` with ``tensor_cores.tc_tiles``'
simulator branch, ``tc_bwd.default_tc_bwd_tiles``, ``bwd.backward_block``,
``backward.backward_tc_tiles``, ``decoding._decode_tiles`` / ``_decode_pipeline``). Its entries
must give exactly what those gave for every input, in both worlds, or the kernels compiled
for the defaults would change. ``tile_table_aa02300.json`` holds the old functions' answers
over a grid of inputs, recorded once from commit aa02300 (with ``NUMBA_ENABLE_CUDASIM`` 0 and
1): a policy, not computed output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from numba_flash import arch, switches, tile_table
from numba_flash.kernels import bwd
from numba_flash.kernels.tc_ops import kernel_head_dim

OLD = json.loads((Path(__file__).parent / "tile_table_aa02300.json").read_text())
WORLDS = {"gpu": False, "simulator": True}


@pytest.fixture(params=sorted(WORLDS), ids=["device-branch", "simulator-branch"])
def world(request, monkeypatch):
    """The old values of one world, with the tile table answering as in that world (and no
    experiment switch set)."""
    monkeypatch.setattr(tile_table, "simulated", lambda: WORLDS[request.param])
    for name in switches.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    return OLD[request.param]


def _key(*parts) -> str:
    return " ".join(str(int(p) if isinstance(p, bool) else p) for p in parts)


def test_forward_tiles_are_the_old_defaults(world):
    for key, expected in world["forward"].items():
        algorithm, d, dtype, causal = key.split()
        assert list(tile_table.forward_tiles(algorithm, int(d), dtype, bool(int(causal)))) == expected, key
    for d, expected in world["comparison"].items():
        assert list(tile_table.comparison_tiles(int(d))) == expected, d
    for key, expected in world["rows"].items():
        assert tile_table.forward_rows_per_thread(*map(int, key.split())) == expected, key
    assert tile_table.forward_rows_per_thread() == world["rows_default"]


def test_forward_tc_tiles_are_the_old_defaults(world):
    for key, expected in world["forward_tc"].items():
        kind, d = key.split()
        assert list(tile_table.forward_tc_tiles(kind, int(d))) == expected, key


def test_backward_tiles_are_the_old_defaults(world):
    for d, expected in world["backward_block"].items():
        assert tile_table.backward_block(int(d)) == expected, d
    for d, expected in world["backward_threads"].items():  # backward.backward_tiles' third entry
        block = tile_table.backward_block(int(d))
        assert bwd.bwd_layout("fa2", int(d), block).threads == expected, d
    for key, expected in world["backward_tc"].items():
        kind, d = key.split()
        assert list(tile_table.backward_tc_tiles(int(d), kind)) == expected, key


def test_decode_tiles_are_the_old_defaults(world):
    for key, expected in world["decode"].items():
        dtype, rows, d = key.split()
        assert list(tile_table.decode_tiles(dtype, int(rows), int(d))) == expected, key
    for key, expected in world["decode_pipeline"].items():
        assert list(tile_table.decode_pipeline(*map(int, key.split()))) == expected, key


def test_the_grid_covers_every_path():
    assert sorted(OLD["gpu"]) == sorted(OLD["simulator"]) == sorted(
        ["backward_block", "backward_tc", "backward_threads", "comparison", "decode", "decode_pipeline", "forward",
         "forward_tc", "rows", "rows_default"])
    assert len(OLD["gpu"]["backward_block"]) == tile_table.WIDE_HEAD_DIM  # every head dim then (up to 128)


def test_backward_block_follows_its_rule(monkeypatch):
    """The table's square tile is the rule's: the largest candidate whose FA-2 K/V kernel leaves
    ``BACKWARD_MIN_BLOCKS_PER_SM`` blocks per SM by shared memory (arch's limits)."""
    monkeypatch.setattr(tile_table, "simulated", lambda: False)
    for d in range(1, tile_table.MAX_HEAD_DIM + 1):
        rule = next((b for b in tile_table.BACKWARD_BLOCK_CHOICES
                     if arch.blocks_per_sm_by_smem(bwd.bwd_layout("fa2", d, b).smem_bytes)
                     >= tile_table.BACKWARD_MIN_BLOCKS_PER_SM), tile_table.BACKWARD_BLOCK_CHOICES[-1])
        assert tile_table.backward_block(d) == rule, d


def test_tc_tiles_take_the_kernel_head_dim(monkeypatch):
    """``tensor_cores.tc_tiles`` reads the table at the kernel's head dim (D rounded up to the copy
    width), as before."""
    from numba_flash.tensor_cores import tc_tiles

    monkeypatch.setattr(tile_table, "simulated", lambda: False)
    for kind in ("f16", "tf32"):
        for d in (1, 61, 64, 65, 127):
            assert tc_tiles(kind, d, None, None) == tile_table.forward_tc_tiles(kind, kernel_head_dim(kind, d))


def test_switches_override_the_table(monkeypatch):
    monkeypatch.setattr(tile_table, "simulated", lambda: False)
    monkeypatch.setenv(switches.TC_BWD_TILES, "32X64")
    assert tile_table.backward_tc_tiles(128, "tf32x3") == (32, 64)
    monkeypatch.setattr(tile_table, "simulated", lambda: True)
    assert tile_table.backward_tc_tiles(128) == (16, 16)  # the simulator ignores it, as before
    monkeypatch.setenv(switches.FFMA_ROWS_PER_THREAD, " 8 ")
    assert tile_table.forward_rows_per_thread(128, 32, 16) == 8


def test_switch_values(monkeypatch):
    for name in switches.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert (switches.ffma_rows_per_thread(), switches.ffma_maxreg(), switches.tc_maxreg(),
            switches.tf32x3_presplit(), switches.tc_bwd_tiles()) == (None,) * 5
    monkeypatch.setenv(switches.FFMA_MAXREG, "  ")
    assert switches.ffma_maxreg() is None
    monkeypatch.setenv(switches.FFMA_MAXREG, "0")
    assert switches.ffma_maxreg() == 0
    monkeypatch.setenv(switches.TC_MAXREG, "128")
    assert switches.tc_maxreg() == 128
    for text, mode in (("none", ""), ("0", ""), (" QV ", "qv"), ("k", "kv"), ("vkq", "qkv")):
        monkeypatch.setenv(switches.TF32X3_PRESPLIT, text)
        assert switches.tf32x3_presplit() == mode, text
    monkeypatch.setenv(switches.TF32X3_PRESPLIT, "qx")
    with pytest.raises(ValueError, match="letters of 'qkv'"):
        switches.tf32x3_presplit()
    monkeypatch.setenv(switches.FFMA_ROWS_PER_THREAD, "6")
    with pytest.raises(ValueError, match=r"must be one of \[4, 8\]"):
        switches.ffma_rows_per_thread()
    with pytest.raises(KeyError):
        switches.raw("PATH")


def test_arch_limits_are_sm90s():
    assert arch.TARGET is arch.ARCH[(9, 0)]
    assert (arch.STATIC_SMEM_LIMIT, arch.SMEM_OPTIN_LIMIT, arch.SMEM_PER_SM, arch.SMEM_RESERVED, arch.SM_REGISTERS) == (
        48 * 1024, 227 * 1024, 228 * 1024, 1024, 64 * 1024)
    assert arch.blocks_per_sm_by_smem(76 * 1024) == 2


def test_no_environment_read_under_kernels():
    kernels = Path(tile_table.__file__).parent / "kernels"
    for path in kernels.glob("*.py"):
        text = path.read_text()
        assert "os.environ" not in text and "getenv" not in text, path.name
    assert os.path.basename(switches.__file__) == "switches.py"
