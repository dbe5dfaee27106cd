"""The thread layout of a tile (``kernels.tiles.TileLayout``) and the direct launcher's
argument packing (``numba_flash.launch``): properties that every kernel specialisation
relies on, checked without running a kernel."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numba_flash.arch import SMEM_OPTIN_LIMIT, STATIC_SMEM_LIMIT
from numba_flash.kernels.tiles import (
    BLOCK_M_CHOICES,
    BLOCK_N_CHOICES,
    check_tiles,
    smem_bytes,
    tile_layout,
)
from numba_flash.tile_table import forward_tiles

head_dims = st.integers(1, 128)
block_ms = st.sampled_from(BLOCK_M_CHOICES)
block_ns = st.sampled_from(BLOCK_N_CHOICES)


@given(head_dims, block_ms, block_ns)
def test_layout_covers_the_tile_exactly(d, bm, bn):
    L = tile_layout(d, bm, bn)
    # every query row of the tile belongs to exactly one row of threads, every key to one lane
    assert L.rows_per_thread * (L.threads // L.threads_per_row) == bm
    assert L.threads_per_row * L.cols_per_thread == bn
    # the threads of a row are lanes of one warp: shuffles stay inside it
    assert L.threads_per_row <= 32 and 32 % L.threads_per_row == 0
    assert L.threads <= 1024 and (L.threads & (L.threads - 1)) == 0
    # the padded head dim holds D, is a power of two, and splits into 4-float groups per lane
    assert d <= L.padded_dim and (L.padded_dim & (L.padded_dim - 1)) == 0
    assert L.padded_dim == 4 * L.threads_per_row * L.dim_groups
    # 128-bit loads need row strides in multiples of four floats
    assert L.q_stride % 4 == 0 and L.k_stride % 4 == 0
    assert L.p_stride % 4 == 0 or L.key_chunk < 4
    assert L.key_chunk <= bn and bn % L.key_chunk == 0


@given(head_dims, block_ms, block_ns)
def test_copy_share_covers_each_kv_tile_once(d, bm, bn):
    """Each thread copies ``kv_loads`` elements of a K/V tile (``tile_ops.make_row_copy``:
    threads span the padded head dim, then step over rows); together they must cover
    every (key, d) of the tile exactly once."""
    L = tile_layout(d, bm, bn)
    assert L.copy_threads * L.copy_rows_per_pass == L.threads
    assert L.copy_threads * L.copy_d_passes == L.padded_dim
    seen = np.zeros((bn, L.padded_dim), dtype=int)
    for tid in range(L.threads):
        c_base, d_base = divmod(tid, L.copy_threads)
        for n in range(L.kv_loads):
            c = c_base + L.copy_rows_per_pass * (n // L.copy_d_passes)
            dd = d_base + L.copy_threads * (n % L.copy_d_passes)
            if c < bn:
                seen[c, dd] += 1
    assert (seen == 1).all()


def test_shared_memory_formula_by_hand():
    # D = 64, 64 x 32: Q 64 x 68, K 32 x 68, V 32 x 64, P~ 64 x 40 floats
    assert smem_bytes(64, 64, 32) == 4 * (64 * 68 + 32 * 68 + 32 * 64 + 64 * 40) == 44544
    # D = 100 pads to 128; D = 128, 32 x 16
    assert smem_bytes(100, 32, 16) == smem_bytes(128, 32, 16) == 4 * (32 * 132 + 16 * 132 + 16 * 128 + 32 * 24)


@pytest.mark.parametrize("d", [1, 16, 32, 40, 64, 96, 128])
@pytest.mark.parametrize("algorithm, dtype", [("fa2", "float32"), ("fa2", "float16"), ("fa1", "float32")])
def test_defaults_fit_and_are_accepted(d, algorithm, dtype, monkeypatch):
    from numba_flash import tile_table
    from numba_flash.tile_table import forward_rows_per_thread

    monkeypatch.setattr(tile_table, "simulated", lambda: False)  # the GPU's defaults (the simulator keeps 64 x 32)

    bm, bn = forward_tiles(algorithm, d, dtype, False)
    rows = forward_rows_per_thread(d, bm, bn)
    check_tiles(d, bm, bn, rows)
    if (algorithm, dtype) == ("fa2", "float32") and d <= 64:  # 128 x 64 at 8 rows, dynamic shared memory
        assert (bm, bn, rows) == (128, 64, 8) and STATIC_SMEM_LIMIT < smem_bytes(d, bm, bn) <= SMEM_OPTIN_LIMIT
    else:
        assert rows == 4 and smem_bytes(d, bm, bn) <= STATIC_SMEM_LIMIT


def test_too_much_shared_memory_names_the_fitting_block_n():
    with pytest.raises(ValueError, match=r"block_n can be one of \[1, 2, 4, 8, 16, 32, 64\]"):
        check_tiles(128, 128, 128)


def test_more_threads_than_registers_allow_is_refused():
    # D = 128 runs uncapped (up to 255 registers): 256 threads per block at most; D = 64 at 128: 512
    with pytest.raises(ValueError, match="512 threads per block, more than the 256"):
        check_tiles(128, 256, 8)
    check_tiles(64, 256, 32)  # 512 threads under the cap, 124.5 KiB
    check_tiles(64, 256, 32, rows_per_thread=8)  # uncapped, but 8 rows per thread: 256 threads


def test_tiles_above_48_kib_use_dynamic_shared_memory():
    from numba_flash.kernels.tiles import uses_dynamic_smem
    from numba_flash.specs import kernel_spec

    assert not uses_dynamic_smem(64, 64, 32)  # today's default: static, as measured
    assert uses_dynamic_smem(64, 128, 32) and smem_bytes(64, 128, 32) == 4 * (128 * 68 + 32 * 68 + 32 * 64 + 128 * 40)
    spec = kernel_spec("fa2", 64, "float32", 128, 64, True, rows_per_thread=4)
    assert (spec.static_smem, spec.dynamic_smem, spec.threads) == (0, smem_bytes(64, 128, 64), 256)
    spec = kernel_spec("fa1", 64, "float32", 64, 32, True, rows_per_thread=8)
    assert (spec.static_smem, spec.dynamic_smem, spec.threads, spec.register_cap) == (44544, 0, 64, None)


def test_direct_launch_packs_numbas_array_abi():
    """numba passes an array as meminfo, parent, size, itemsize, data, shape..., strides...
    (bytes); the layout in the signature is C only for C-contiguous arrays."""
    from numba.cuda import types

    from numba_flash.launch import DeviceArray, _signature

    strided = DeviceArray(0xABC0, (2, 3, 5, 8), (960, 32, 192, 4), "float16", 2, 240, False)
    dense = DeviceArray(0x1000, (2, 3), (12, 4), "float32", 4, 6, True)
    assert strided.abi_fields() == [0, 0, 240, 2, 0xABC0, 2, 3, 5, 8, 960, 32, 192, 4]
    sig = _signature([strided, dense, np.float32(0.5)])
    assert sig[0] == types.Array(types.float16, 4, "A")
    assert sig[1] == types.Array(types.float32, 2, "C")
    assert sig[2] == types.float32
    with pytest.raises(TypeError, match="no direct launch"):
        _signature([1.5])
