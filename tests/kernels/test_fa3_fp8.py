"""fa3 on float8 (e4m3) inputs: FlashAttention-3's fp8 forward (numba_flash.fp8, kernels.fa3 with
kind "e4m3", kernels.e4m3) in the simulator; the H200 runs tests/gpu/test_gpu_fa3.py's fp8 cases.

The bar (the issue's): the error against float64 (on the dequantized inputs) at most twice that of
a plain fp8 implementation (``helpers.plain_fp8_attention``: float32 S, e4m3 P, float32 O, bfloat16 out).
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers import examples, plain_fp8_attention
from conftest import SIMULATED

import numba_flash
from numba_flash import fa3, fp8, reference
from numba_flash.api import forward
from numba_flash.kernels import e4m3

ml_dtypes = pytest.importorskip("ml_dtypes")
F8 = ml_dtypes.float8_e4m3fn


def _inputs(B, H, Hkv, Nq, Nk, D, seed, spread=1.0):
    rng = np.random.default_rng(seed)
    return tuple((rng.standard_normal(shape) * spread).astype(F8)
                 for shape in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)))


# ------------------------------------------------------------------------------ the format


def test_e4m3_values_match_ml_dtypes_for_every_pattern():
    bits = np.arange(256, dtype=np.uint8)
    ours, theirs = e4m3.values_of(bits), bits.view(F8).astype(np.float64)
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    assert np.array_equal(ours[~np.isnan(ours)], theirs[~np.isnan(theirs)])
    assert e4m3.values_of(0x7E) == 448.0 and e4m3.values_of(0x01) == 2.0 ** -9


@settings(max_examples=examples(200), deadline=None)
@given(st.floats(min_value=-440, max_value=440, allow_nan=False, width=32))
def test_e4m3_rounding_matches_ml_dtypes(x):
    assert int(e4m3.bits_of(x)) == int(np.float32(x).astype(F8).view(np.uint8))


def test_e4m3_ties_to_even_saturates_and_keeps_nan():
    assert e4m3.values_of(e4m3.bits_of([2.0 ** -10, 3 * 2.0 ** -10, 1.0625, 1.1875])).tolist() == \
        [0.0, 2.0 ** -8, 1.0, 1.25]  # halfway cases: the even neighbour
    assert e4m3.values_of(e4m3.bits_of([449.0, 1e30, -1e30])).tolist() == [448.0, 448.0, -448.0]
    assert int(e4m3.bits_of(np.nan)) == e4m3.NAN_BITS


# ------------------------------------------------------------------------------ V's layout


def test_value_order_is_a_permutation_of_each_32_keys():
    order = fp8.value_order()
    assert sorted(order.tolist()) == list(range(32))
    # thread t's A register holds k-positions 4t..4t+3; its accumulator entries are keys 2t, 2t+1, 8+2t, 9+2t
    for t in range(4):
        assert order[4 * t: 4 * t + 4].tolist() == [2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t]


def test_transposed_values_is_v_transposed_in_value_order():
    rng = np.random.default_rng(1)
    v = rng.integers(1, 255, (2, 3, 45, 7)).astype(np.uint8)
    vt = fp8.transposed_values(v)
    assert vt.shape == (2, 3, 7, 64) and vt.flags.c_contiguous
    order = fp8.value_order()
    for c in range(2):
        for p in range(32):
            key = 32 * c + order[p]
            expected = v[:, :, key, :] if key < 45 else 0
            assert np.array_equal(vt[:, :, :, 32 * c + p], np.broadcast_to(expected, (2, 3, 7)))


# ------------------------------------------------------------------------------ the kernel

CASES = [  # B, H, Hkv, Nq, Nk, D, causal, descales (q, k, v): numbers or "array"
    (1, 2, 1, 40, 150, 100, True, (0.5, 0.25, 2.0)),  # GQA, tails, D padded to 128, scalar descales
    (2, 1, 1, 40, 130, 128, False, "array"),  # (B, Hkv) descales, two K/V tiles
]


@pytest.mark.skipif(not SIMULATED, reason="the GPU runs fp8 in tests/gpu/test_gpu_fa3.py")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[3]}x{c[4]}-D{c[5]}-causal{c[6]}")
def test_fa3_fp8_matches_float64_within_twice_plain_fp8(case):
    B, H, Hkv, Nq, Nk, D, causal, scales = case
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, seed=Nq + Nk, spread=2.0)
    if scales == "array":
        rng = np.random.default_rng(7)
        scales = tuple(rng.uniform(0.3, 2.0, (B, Hkv)).astype(np.float32) for _ in range(3))
    qs, ks, vs = scales
    out = np.full((B, H, Nq, D), np.nan, ml_dtypes.bfloat16)
    lse_out = np.full((B, H, Nq), np.nan, np.float32)
    o, lse = forward(q, k, v, causal=causal, algorithm="fa3", q_descale=qs, k_descale=ks,
                                     v_descale=vs, out=out, lse_out=lse_out)
    assert o.dtype == ml_dtypes.bfloat16

    def real(x, s):  # the dequantized values, per (batch, K/V head) when s is an array
        s = np.asarray(s, np.float64)
        s = np.repeat(s, x.shape[1] // s.shape[1], axis=1)[:, :, None, None] if s.ndim == 2 else s
        return x.astype(np.float64) * s

    group = H // Hkv
    qd = real(q, np.repeat(np.asarray(qs, np.float64), group, axis=1) if np.ndim(qs) == 2 else qs)
    kd, vd = real(k, ks), real(v, vs)
    ref_o, ref_lse = reference.attention(qd, kd, vd, causal=causal)
    err = np.abs(o.astype(np.float64) - ref_o).max()
    plain = np.abs(plain_fp8_attention(qd, kd, vd, causal=causal).astype(np.float64) - ref_o).max()
    assert 0 < err <= 2 * plain
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)  # the 2^8 offset of P taken out
    assert not np.isnan(o.astype(np.float32)).any()


@pytest.mark.skipif(not SIMULATED, reason="the GPU runs these tiles in tests/gpu/test_gpu_fa3.py")
@pytest.mark.parametrize("block_n", [192, 96])
def test_fa3_fp8_tiles_of_64_and_32_byte_value_rows(block_n):
    """block_n = 192 and 96 keys: V^T in three boxes of 64- or 32-byte rows (kernels.fa3.value_row_bytes,
    TMA's 64- and 32-byte swizzles, the wgmma descriptor's modes 2 and 3, the products' steps from
    box to box), over two K/V tiles, the second partial; the error against float64 at most twice a
    plain fp8 implementation's."""
    from numba_flash.kernels.fa3 import value_row_bytes

    assert value_row_bytes(block_n) == {192: 64, 96: 32}[block_n]
    B, H, Nq, Nk, D = 1, 1, 20, block_n + 40, 128
    q, k, v = _inputs(B, H, H, Nq, Nk, D, seed=block_n, spread=2.0)
    o, lse = forward(q, k, v, algorithm="fa3", block_m=64, block_n=block_n)
    qd, kd, vd = (x.astype(np.float64) for x in (q, k, v))
    ref_o, ref_lse = reference.attention(qd, kd, vd)
    err = np.abs(o.astype(np.float64) - ref_o).max()
    plain = np.abs(plain_fp8_attention(qd, kd, vd).astype(np.float64) - ref_o).max()
    assert 0 < err <= 2 * plain
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)


def test_fa3_fp8_refuses_a_batch_past_the_transposes_grid():
    """fp8's V^T pass runs a grid whose z is the batch x K/V heads (at most 65535): 40000 x 2 is
    refused with a ValueError, though fa3's own grid (z = 40000) would take the batch."""
    q = np.ones((40000, 2, 1, 16), np.float32).astype(F8)
    with pytest.raises(ValueError, match="K/V heads"):
        forward(q, q, q, algorithm="fa3")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(q_descale=-1.0), ValueError, "positive"),
    (dict(k_descale=float("nan")), ValueError, "positive"),
    (dict(v_descale=np.ones((3, 1), np.float32)), ValueError, "shape"),
    (dict(q_descale=np.ones((1, 1), np.float64)), TypeError, "float32"),
    (dict(q_descale=True), TypeError, "bool"),
    (dict(block_n=48), ValueError, "multiple of 32"),
])
def test_fa3_fp8_refuses_bad_arguments(kwargs, error, match):
    q, k, v = _inputs(1, 1, 1, 8, 8, 64, seed=0)
    with pytest.raises(error, match=match):
        forward(q, k, v, algorithm="fa3", **kwargs)


def test_fp8_only_on_fa3_and_descales_only_with_fp8():
    q, k, v = _inputs(1, 1, 1, 8, 8, 64, seed=0)
    with pytest.raises(TypeError, match="algorithm='fa3'"):
        numba_flash.attention(q, k, v, algorithm="fa2")
    h = [x.astype(np.float16) for x in (q, k, v)]
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        numba_flash.attention(*h, algorithm="fa3", q_descale=2.0)
    with pytest.raises(ValueError, match="algorithm='fa3'"):
        numba_flash.attention(*h, algorithm="fa2", v_descale=2.0)
    with pytest.raises(ValueError, match="head dim"):
        numba_flash.attention(q, k, v[..., :32], algorithm="fa3")


def test_fp8_kernel_head_dims():
    assert [fa3.kernel_head_dim(d, True) for d in (1, 64, 128, 129, 256)] == [128, 128, 128, 256, 256]
    with pytest.raises(ValueError):
        fa3.kernel_head_dim(257, True)
    assert math.isclose(float(e4m3.values_of(e4m3.bits_of(256.0))), 256.0)  # P~'s largest value, 2^8, is exact


@pytest.mark.skipif(not SIMULATED, reason="the GPU path is tests/gpu/test_gpu_fa3.py's (fp8 through CuPy arrays)")
def test_transpose_kernel_matches_the_host_layout():
    """kernels.value_transpose (the device path of fp8.transposed_values) writes what the NumPy
    path writes: keys past Nk zero, head-dim rows past a tile edge included (D = 200: two tiles
    across), padded head-dim bytes (rows of whole words past D) not written."""
    from numba_flash.kernels.value_transpose import THREADS, TILE_BYTES, TILE_KEYS, transpose_values

    rng = np.random.default_rng(4)
    # 70 keys: a partial chunk; 160: past a 128-key tile; 300 x 128: two tiles wholly inside (the
    # untested loads and stores), then a partial one
    for n_k, d, d_words in ((70, 200, 50), (160, 20, 8), (300, 128, 32)):
        v = rng.integers(1, 255, (1, 2, n_k, d)).astype(np.uint8)
        expected = fp8.transposed_values(v)
        vt = np.full(expected.shape, 0xAB, np.uint8)  # poisoned
        padded = np.zeros(v.shape[:3] + (4 * d_words,), np.uint8)  # rows of whole words (d_words 8: D padded to 32)
        padded[..., :d] = v
        grid = (-(-vt.shape[3] // TILE_KEYS), -(-4 * d_words // TILE_BYTES), v.shape[0] * v.shape[1])
        words = vt.view(np.uint32)
        transpose_values[grid, THREADS](padded.view(np.uint32).reshape(-1), words.reshape(-1), np.int32(n_k),
                                        np.int32(d_words), np.int32(d), np.int32(vt.shape[3] // 4))
        assert np.array_equal(words.view(np.uint8), expected), (n_k, d)
