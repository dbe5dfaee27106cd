"""The CUDA-core forward's larger tiles: shared memory above 48 KiB (dynamic, opted in) and the
8-row micro-tile (``NUMBA_FLASH_FFMA_ROWS_PER_THREAD=8``), against the float64 reference.

Lengths are not tile multiples, causal with Nq > Nk leaves rows that see no key (o = 0,
lse = -inf), and outputs are NaN-poisoned (``helpers.run_poisoned``)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_against_reference, random_qkv, run_poisoned, to_numpy

from numba_flash.kernels.forward import Variant
from numba_flash.kernels.tiles import smem_bytes, uses_dynamic_smem
from numba_flash.switches import FFMA_ROWS_PER_THREAD as ROWS_PER_THREAD_ENV
from numba_flash.specs import kernel_spec


def check_masked_rows(o, lse, n_q, n_k):
    hidden = n_q - n_k
    if hidden > 0:
        assert (to_numpy(o)[:, :, :hidden] == 0).all()
        assert np.isneginf(to_numpy(lse)[:, :, :hidden]).all()


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("causal", [True])  # the masked path; the tiles' memory is the same without it
def test_tiles_in_dynamic_shared_memory(algorithm, causal, xp, rng):
    """D = 128, 32 x 32: 54 KiB, beyond the 48 KiB of static shared memory."""
    assert uses_dynamic_smem(128, 32, 32) and smem_bytes(128, 32, 32) == 55296
    n_q, n_k = 45, 37
    q, k, v = random_qkv(rng, 1, 1, 1, n_q, n_k, 100, "float32", xp)  # D = 100: padded to 128
    o, lse = run_poisoned(xp, q, k, v, causal=causal, algorithm=algorithm, block_m=32, block_n=32)
    check_against_reference(q, k, v, o, lse, causal)
    if causal:
        check_masked_rows(o, lse, n_q, n_k)


def test_ablation_variant_in_dynamic_shared_memory(xp, rng):
    """A split_q variant that is no named point (FA-1's loop order, a block per Q tile)."""
    variant = Variant("kv_outer", "heads_x_qtiles", "every_step")
    q, k, v = random_qkv(rng, 1, 1, 1, 40, 33, 128, "float32", xp)
    o, lse = run_poisoned(xp, q, k, v, causal=True, block_m=32, block_n=32, variant=variant)
    check_against_reference(q, k, v, o, lse, True)
    check_masked_rows(o, lse, 40, 33)


@pytest.fixture
def eight_rows(monkeypatch):
    """The 8-row micro-tile for this test (kernel specifications are memoised per configuration:
    cleared before and after, so that no other test sees them)."""
    monkeypatch.setenv(ROWS_PER_THREAD_ENV, "8")
    kernel_spec.cache_clear()
    yield
    kernel_spec.cache_clear()


@pytest.mark.parametrize("algorithm, tiles", [("fa1", (16, 16)), ("fa2", (32, 8))], ids=["fa1-S8x2", "fa2-S8x1"])
def test_eight_rows_per_thread(algorithm, tiles, eight_rows, xp, rng):
    block_m, block_n = tiles
    assert kernel_spec(algorithm, 32, "float32", block_m, block_n, True).rows_per_thread == 8
    n_q, n_k = 37, 29
    q, k, v = random_qkv(rng, 1, 2, 1, n_q, n_k, 20, "float32", xp)
    for causal in (True, False):
        o, lse = run_poisoned(xp, q, k, v, causal=causal, algorithm=algorithm, block_m=block_m, block_n=block_n)
        check_against_reference(q, k, v, o, lse, causal)
        if causal:
            check_masked_rows(o, lse, n_q, n_k)


def test_rows_per_thread_from_the_environment(monkeypatch):
    from numba_flash.tile_table import forward_rows_per_thread

    monkeypatch.delenv(ROWS_PER_THREAD_ENV, raising=False)
    assert forward_rows_per_thread() == 4
    assert forward_rows_per_thread(64, 128, 64) == 8  # the measured 8-row tile
    assert forward_rows_per_thread(128, 128, 64) == 4 and forward_rows_per_thread(64, 64, 32) == 4
    monkeypatch.setenv(ROWS_PER_THREAD_ENV, "4")
    assert forward_rows_per_thread(64, 128, 64) == 4
    monkeypatch.setenv(ROWS_PER_THREAD_ENV, "8")
    assert forward_rows_per_thread() == 8
    monkeypatch.setenv(ROWS_PER_THREAD_ENV, "6")
    with pytest.raises(ValueError, match="must be one of \\[4, 8\\]"):
        forward_rows_per_thread()


def test_register_cap_knob(monkeypatch):
    from numba_flash import switches
    from numba_flash.kernels.tiles import register_cap
    from numba_flash.switches import FFMA_MAXREG as MAXREG_ENV

    def cap(d, rows=4):  # the cap as the host makes it: the switch read, passed to the kernels' function
        return register_cap(d, rows, switches.ffma_maxreg())

    monkeypatch.delenv(MAXREG_ENV, raising=False)
    assert cap(64) == 128 and cap(64, 8) is None and cap(128) is None
    monkeypatch.setenv(MAXREG_ENV, "168")
    assert cap(64, 8) == 168 and cap(64) == 168
    kernel_spec.cache_clear()
    try:
        assert kernel_spec("fa2", 64, "float32", 64, 32).register_cap == 168  # the spec reads it too
    finally:
        kernel_spec.cache_clear()
    monkeypatch.setenv(MAXREG_ENV, "0")
    assert cap(64) is None


def test_fa2_float32_default_tiles_by_name(xp, rng):
    """FA-2's float32 default on the GPU at D <= 64 (``tile_table.forward_tiles``; the simulator keeps
    64 x 32 as its default): 128 x 64 at 8 rows per thread, 103 KiB of dynamic shared memory."""
    spec = kernel_spec("fa2", 40, "float32", 128, 64, True)
    assert spec.rows_per_thread == 8 and spec.dynamic_smem > 48 * 1024 and spec.threads == 128
    n_q, n_k = 70, 75
    q, k, v = random_qkv(rng, 1, 1, 1, n_q, n_k, 40, "float32", xp)
    o, lse = run_poisoned(xp, q, k, v, causal=True, block_m=128, block_n=64)
    check_against_reference(q, k, v, o, lse, True)
