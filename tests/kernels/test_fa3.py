"""algorithm="fa3": FlashAttention-3's warp-specialized forward (numba_flash.fa3, kernels.fa3) and
the Hopper primitives' simulator twins (kernels.hopper) it runs on in CI.

On the simulator every wgmma, TMA copy and mbarrier is a Python twin with the PTX semantics; the
same kernel source runs on the H200 (tests/gpu/test_gpu_fa3.py). Small shapes: a simulated block
has 256 threads (one producer and one consumer warpgroup).
"""

import numpy as np
import pytest

from helpers import plain_fp16_attention, rel_err
from conftest import SIMULATED

import numba_flash
from numba_flash import fa3, reference
from numba_flash.api import forward

pytestmark = pytest.mark.skipif(not SIMULATED, reason="the GPU runs these in tests/gpu/test_gpu_fa3.py")


def _inputs(B, H, Hkv, Nq, Nk, D, dtype, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Nq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
    return q, k, v


CASES = [  # B, H, Hkv, Nq, Nk, D, causal, window, block_n
    (1, 2, 1, 40, 150, 64, True, (-1, -1), 64),  # GQA, K/V tiles wrapping the stages, tails of both
    # (one Q tile here: Q tiles past the first, under causal, are the next case's three)
    (2, 1, 1, 130, 50, 40, True, (-1, -1), 64),  # Nq > Nk: rows that see no key; D padded to 64 by TMA
    (1, 1, 1, 65, 200, 100, False, (30, 10), 32),  # a window hiding tiles on both sides; D padded to 128
    (1, 2, 2, 1, 97, 64, False, (-1, -1), 64),  # one query row
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}x{c[4]}-D{c[5]}-causal{c[6]}-window{c[7]}")
def test_fa3_matches_float64(case):
    B, H, Hkv, Nq, Nk, D, causal, window, block_n = case
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, np.float16, seed=Nq + Nk)
    out = np.full((B, H, Nq, D), np.nan, np.float16)
    lse_out = np.full((B, H, Nq), np.nan, np.float32)
    o, lse = forward(q, k, v, causal=causal, window_size=window, algorithm="fa3", block_n=block_n,
                                 out=out, lse_out=lse_out)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, window_size=window)
    err = np.abs(o.astype(np.float64) - ref_o).max()
    plain = plain_fp16_attention(q, k, v, causal=window if window != (-1, -1) else causal).astype(np.float64)
    assert err <= 2 * np.abs(plain - ref_o).max() + 1e-5
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))  # rows that see no key: -inf
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4)
    assert not np.isnan(o).any()


def test_fa3_nan_propagates_to_the_rows_it_touches():
    """API.md section 1: a NaN score reaches exactly the rows that see it (the row max keeps NaN:
    ``max.NaN.f32``), never the others."""
    q, k, v = _inputs(1, 1, 1, 40, 40, 64, np.float16, seed=9)
    k[0, 0, 20, 3] = np.nan
    o, lse = fa3.forward(q, k, v, causal=True, block_n=16)
    rows_seeing = np.arange(40) >= 20
    assert np.isnan(o[0, 0, rows_seeing]).all(axis=-1).all() and np.isnan(lse[0, 0, rows_seeing]).all()
    assert np.isfinite(o[0, 0, ~rows_seeing]).all() and np.isfinite(lse[0, 0, ~rows_seeing]).all()


def test_fa3_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = _inputs(1, 1, 1, 33, 80, 64, ml_dtypes.bfloat16, seed=3)
    o = numba_flash.attention(q, k, v, algorithm="fa3", block_n=32)
    ref_o, _ = reference.attention(q, k, v)
    plain = plain_fp16_attention(q, k, v, dtype=ml_dtypes.bfloat16).astype(np.float64)
    assert 0 < rel_err(o, ref_o) <= 2 * rel_err(plain, ref_o)


def test_fa3_schedules_compute_the_same_function():
    """FA-3 Algorithm 2's overlapped order and Algorithm 1's do the same arithmetic per row:
    bitwise-equal outputs (and so does a deeper K/V ring)."""
    q, k, v = _inputs(1, 1, 1, 64, 100, 64, np.float16, seed=5)  # 4 K/V tiles: both rings wrap
    runs = [fa3.forward(q, k, v, causal=True, block_n=32, stages=st, overlap=ov)
            for st, ov in ((2, True), (2, False), (3, True))]
    for o, lse in runs[1:]:
        assert np.array_equal(o, runs[0][0]) and np.array_equal(lse, runs[0][1])


def test_fa3_ping_pong_turns_compute_the_same_function():
    """Two consumer warpgroups taking turns at the tensor cores (FA-3 section 3.1's ping-pong, named
    barriers) change when products are issued, not what they compute."""
    q, k, v = _inputs(1, 1, 1, 128, 40, 64, np.float16, seed=6)  # two K/V tiles, the second a tail
    turns = fa3.forward(q, k, v, block_m=128, block_n=32, pingpong=True)
    alone = fa3.forward(q, k, v, block_m=128, block_n=32, pingpong=False, overlap=False)
    assert np.array_equal(turns[0], alone[0]) and np.array_equal(turns[1], alone[1])
    ref_o, _ = reference.attention(q, k, v)
    assert rel_err(turns[0], ref_o) < 1e-3


def _rising_scores(seed):
    """Inputs whose row maxima rise from one 32-key tile to the next: by about 2 (log2 units)
    over tiles 0-2, then a jump of about 25 at tile 3, then 1.4 again at tile 4 (the last, 16 keys)."""
    q, k, v = _inputs(1, 1, 1, 40, 144, 64, np.float16, seed=seed)
    q[..., 0] = 8.0  # x scale 1/8: the score gains k[..., 0]
    k[..., 0] = np.repeat(np.array([0, 1.5, 3, 20, 21], np.float16), 32)[:144]
    return q, k, v


def test_fa3_conditional_rescale_matches_float64():
    """``rescale_threshold=8`` (FlashAttention-4's conditional rescaling): the max a row subtracts
    stays up to 8 behind while tiles rise a little (O and l not rescaled), and moves at the jump
    (rescaled there); O and the logsumexp are the every-tile kernel's within rounding and within
    FlashAttention's rule of float64. Causal with Nq < Nk: the first rows see the first tiles only.
    (Causal only: every row still sees the rising tiles and the jump at tile 3, and the tiles left
    of the diagonal are walked unmasked as a non-causal call's are; a non-causal case added no branch.)"""
    causal = True
    q, k, v = _rising_scores(seed=11)
    out = np.full(q.shape, np.nan, np.float16)
    lse_out = np.full(q.shape[:3], np.nan, np.float32)
    o, lse = fa3.forward(q, k, v, causal=causal, block_n=32, rescale_threshold=8.0, out=out, lse_out=lse_out)
    every, every_lse = fa3.forward(q, k, v, causal=causal, block_n=32, rescale_threshold=0.0)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal)
    plain = plain_fp16_attention(q, k, v, causal=causal).astype(np.float64)
    assert np.abs(o.astype(np.float64) - ref_o).max() <= 2 * np.abs(plain - ref_o).max() + 1e-5
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)
    assert not np.array_equal(o, every)  # the stale max was used: other roundings, same function
    np.testing.assert_allclose(o.astype(np.float32), every.astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(lse, every_lse, atol=1e-5)


def test_fa3_output_through_tma_is_the_threads_output(monkeypatch):
    """O written through shared memory and a TMA store (FA-3's epilogue: 16-bit, unsplit, rows of a
    multiple of 16 bytes) is bitwise the output every thread stores as pairs; D = 40 (the store's
    columns past the head dim not written; two query heads on one K/V head: the store's head
    coordinate) and Nq = 70 (a Q tile's rows past Nq not written). (Full-width rows go through the
    TMA store in every default fa3 call of this file's other tests.)"""
    q, k, v = _inputs(1, 2, 1, 70, 40, 40, np.float16, seed=40)  # (one K/V tile: the epilogue is under test)
    assert fa3.stores_o_by_tma(q, "numpy", False, 1)
    assert not fa3.stores_o_by_tma(q[..., :36], "numpy", False, 1)  # 72-byte rows: pairs
    assert not fa3.stores_o_by_tma(q, "numpy", False, 2)  # split-KV: float32 partials
    out = np.full(q.shape, np.nan, np.float16)
    by_tma, lse = fa3.forward(q, k, v, causal=True, out=out)
    assert by_tma is out and not np.isnan(by_tma).any()
    monkeypatch.setattr(fa3, "stores_o_by_tma", lambda *a: False)
    by_threads, lse_threads = fa3.forward(q, k, v, causal=True)
    assert np.array_equal(by_tma.view(np.uint16), by_threads.view(np.uint16))
    assert np.array_equal(lse, lse_threads)


def test_tma_store_twin_writes_the_box_within_the_tensor():
    """The simulator's TMA store (``hopper.tma_box_storer``) undoes the load's swizzle and writes
    nothing past the tensor's rows and columns: a box loaded from one tensor and stored into a
    smaller one lands where it came from, and the rest stays as it was."""
    from numba_flash.kernels import hopper

    src = np.arange(2 * 3 * 70 * 64, dtype=np.uint16).reshape(2, 3, 70, 64)
    smem = np.zeros(64 * 128 + 64, np.uint8)
    hopper.mbarrier_init(smem, 64 * 128, 1)
    hopper.tma_box_loader(64)(smem, 0, None, src, 0, 32, 2, 1, 64 * 128)
    assert not np.array_equal(smem[:128].view(np.uint16)[8:16], src[1, 2, 33, :8])  # row 1 is swizzled
    dst = np.full((2, 3, 50, 40), 7, np.uint16)
    hopper.tma_box_storer(64)(smem, 0, None, dst, 0, 32, 2, 1)
    assert np.array_equal(dst[1, 2, 32:50], src[1, 2, 32:50, :40])
    untouched = np.ones(dst.shape, bool)
    untouched[1, 2, 32:50] = False
    assert np.all(dst[untouched] == 7)


@pytest.mark.parametrize("row_bytes, rows_sharing_a_pattern", [(128, 1), (64, 2), (32, 4)])
def test_swizzles_permute_each_rows_chunks_by_the_address_bits_above_them(row_bytes, rows_sharing_a_pattern):
    """TMA's SWIZZLE_{128,64,32}B (CUTLASS's Swizzle<3|2|1, 4, 3> on byte addresses): a row's
    16-byte chunks are permuted within the row, by the row's address bits 7 and up (so 64-byte rows
    pair up, 32-byte rows go by fours), and the pattern repeats every 1024 bytes at most."""
    from numba_flash.kernels import hopper

    chunks = row_bytes // 16
    for row in range(16):
        start = row * row_bytes
        landed = [(hopper.swizzle(start + 16 * c, row_bytes) - start) // 16 for c in range(chunks)]
        assert sorted(landed) == list(range(chunks)), (row, landed)  # a permutation of the row's chunks
        key = (row // rows_sharing_a_pattern) % chunks
        assert landed == [c ^ key for c in range(chunks)], (row, landed)
        assert hopper.swizzle(start + 5, row_bytes) % 16 == 5  # bytes within a chunk stay
    assert hopper.swizzle(3 * 128 + 16) == 3 * 128 + 32  # 128-byte rows by default


def test_byte_perm_twin_follows_prmt():
    """``hopper.byte_perm``'s simulator twin, against the PTX ISA's ``prmt.b32`` (default mode): each
    selector nibble picks one of the eight bytes {b, a}; a nibble with bit 3 set copies that byte's
    sign bit over the whole byte."""
    from numba_flash.kernels import hopper

    a, b = 0x33221100, 0x77665544
    assert hopper.byte_perm(a, b, 0x5140) == 0x55114400  # a0 b0 a1 b1
    assert hopper.byte_perm(a, b, 0x7632) == 0x77663322
    assert hopper.byte_perm(0x80000000, 0, 0x000B) == 0x000000FF  # byte 3 (0x80) negative: all ones
    assert hopper.byte_perm(0x7F000000, 0, 0x000B) == 0  # byte 3 (0x7F) positive: zero


@pytest.mark.parametrize("bad", [-1.0, 8.5, True, "8"])
def test_fa3_refuses_a_bad_rescale_threshold(bad):
    q, k, v = _inputs(1, 1, 1, 8, 8, 16, np.float16, seed=0)
    with pytest.raises(ValueError, match="rescale_threshold"):
        fa3.forward(q, k, v, rescale_threshold=bad)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kv_tile_order=[0]), ValueError, "kv_tile_order"),
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(block_m=96), ValueError, "block_m"),
    (dict(block_n=24), ValueError, "block_n"),
    (dict(block_m=192, block_n=208), ValueError, "128 registers"),  # ptxas: insufficient registers
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(precision="ieee"), ValueError, "precision"),
])
def test_fa3_refuses_what_it_cannot_run(kwargs, error, match):
    q, k, v = _inputs(1, 1, 1, 8, 8, 16, np.float16, seed=0)
    with pytest.raises(error, match=match):
        forward(q, k, v, algorithm="fa3", **kwargs)


def _result_buffers():
    out = np.zeros((1, 1, 8, 16), np.float16)
    read_only = out.copy()
    read_only.flags.writeable = False
    rows_overlap = np.lib.stride_tricks.as_strided(np.zeros(64, np.float16), (1, 1, 8, 16), (256, 256, 8, 2))
    return out, read_only, rows_overlap


@pytest.mark.parametrize("which, error, match", [
    ("lse_out float16", TypeError, "lse_out must be float32"),
    ("out float32", TypeError, "out must be float16"),
    ("out read-only", ValueError, "out must be writeable"),
    ("out rows overlapping", ValueError, "share memory"),
    ("out a list", TypeError, "out"),
])
def test_fa3_refuses_result_buffers_it_cannot_write(which, error, match):
    """Checked before any launch (fa3 writes strided views in place, so their strides are checked:
    rows 4 elements apart hold 16 each)."""
    q, k, v = _inputs(1, 1, 1, 8, 8, 16, np.float16, seed=0)
    out, read_only, rows_overlap = _result_buffers()
    kwargs = {"lse_out float16": dict(lse_out=np.zeros((1, 1, 8), np.float16)),
              "out float32": dict(out=out.astype(np.float32)), "out read-only": dict(out=read_only),
              "out rows overlapping": dict(out=rows_overlap), "out a list": dict(out=out.tolist())}[which]
    with pytest.raises(error, match=match):
        fa3.forward(q, k, v, **kwargs)


def test_fa3_writes_a_strided_view_in_place():
    """A view whose elements are distinct (every other row of a larger buffer) is a valid ``out``."""
    q, k, v = _inputs(1, 1, 1, 8, 8, 16, np.float16, seed=0)
    buffer = np.full((1, 1, 16, 16), np.nan, np.float16)
    o, _ = fa3.forward(q, k, v, out=buffer[:, :, ::2])
    want, _ = fa3.forward(q, k, v)
    assert np.array_equal(buffer[:, :, ::2], want) and np.isnan(buffer[:, :, 1::2]).all()


def test_fa3_refuses_a_batch_past_the_grids_z():
    """fa3's grid holds the batch (x splits) along z, which CUDA caps at 65535 blocks: a clear
    ValueError before any launch, not a launch error (fa2's 1-D grid takes it)."""
    q = np.ones((65536, 1, 1, 8), np.float16)
    with pytest.raises(ValueError, match="65535"):
        fa3.forward(q, q, q)


def test_fa3_refuses_float32_and_wide_heads():
    q, k, v = _inputs(1, 1, 1, 8, 8, 16, np.float32, seed=0)
    with pytest.raises(TypeError, match="float16, bfloat16 and float8_e4m3fn"):
        numba_flash.attention(q, k, v, algorithm="fa3")
    q, k, v = _inputs(1, 1, 1, 8, 8, 257, np.float16, seed=0)
    with pytest.raises(ValueError, match="256"):
        numba_flash.attention(q, k, v, algorithm="fa3")


def test_fa3_empty_problems():
    q, k, v = _inputs(1, 2, 2, 5, 0, 16, np.float16, seed=0)
    o, lse = numba_flash.attention(q, k, v, algorithm="fa3", return_lse=True)
    assert np.all(o == 0) and np.all(np.isneginf(lse))
    q, k, v = _inputs(1, 2, 2, 0, 7, 16, np.float16, seed=0)
    o = numba_flash.attention(q, k, v, algorithm="fa3")
    assert o.shape == (1, 2, 0, 16)


def test_tensor_map_readiness():
    """TMA reads an array in place only with 16-byte strides and base; else the host copies it."""
    from numba_flash.launch import DeviceArray

    def arr(shape, strides, ptr=0):
        return DeviceArray(ptr, shape, strides, "uint16", 2, int(np.prod(shape)), False)

    assert fa3.tma_ready(arr((2, 4, 100, 64), (4 * 100 * 128, 100 * 128, 128, 2)))
    assert not fa3.tma_ready(arr((2, 4, 100, 60), (4 * 100 * 120, 100 * 120, 120, 2)))  # rows of 120 bytes
    assert not fa3.tma_ready(arr((2, 4, 100, 64), (4 * 100 * 128, 100 * 128, 128, 2), ptr=8))  # misaligned base
    assert not fa3.tma_ready(arr((2, 4, 100, 64), (4 * 100 * 128, 128, 4 * 128, 4)))  # strided head dim
    assert fa3.tma_ready(arr((1, 4, 100, 64), (0, 100 * 128, 128, 2)))  # a dimension of one: its stride unused


def test_kernel_head_dims():
    assert [fa3.kernel_head_dim(d) for d in (1, 64, 65, 128, 129, 256)] == [64, 64, 128, 128, 256, 256]


def test_fa3_refuses_a_gpu_that_is_not_hopper(monkeypatch):
    """API.md 2f: elsewhere than compute capability 9.0, a ValueError naming the GPU and what it can run."""
    from numba_flash._cuda import cuda

    class Ampere:
        name = b"NVIDIA A100-SXM4-80GB"
        compute_capability = (8, 0)

    monkeypatch.setattr(fa3, "simulated", lambda: False)
    monkeypatch.setattr(cuda, "get_current_device", lambda: Ampere())
    with pytest.raises(ValueError, match=r"A100.*8\.0.*'fa2' or 'fa1'"):
        fa3.require_fa3_device(None)
