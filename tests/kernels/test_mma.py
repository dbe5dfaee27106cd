"""The tensor-core primitives (``numba_flash.kernels.mma``) against NumPy matmul.

One test kernel runs each product the way the attention kernels do: A from shared memory by
``ldsm_x4`` (or from float32 accumulators packed in registers, as P~ is), B by ``ldsm_x4``
from a K-like (n x k) tile or by ``ldsm_x4_trans`` from a V-like (k x n) tile, and stores the
accumulator fragments by the documented C layout. Random fragments through it must equal the
float64 product of the same (rounded) values. In the simulator this checks the simulated
per-lane semantics; on a GPU the same test checks the inline PTX against them.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash._cuda import cuda, float32
from numba_flash.kernels import mma


STRIDE = 24  # 16 columns + 16 bytes of padding, as the kernels' shared rows
TILE = 16 * STRIDE  # a constant: numba needs a shared array's size at compile time


def _bf16(x):
    """float32 -> bfloat16 bit patterns (round to nearest even) and their float32 values."""
    bits = np.array([mma._bf16_bits(v) for v in np.asarray(x, np.float32).ravel()], np.uint16).reshape(np.shape(x))
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


@functools.lru_cache(maxsize=None)
def product16_kernel(kind: str, a_from_registers: bool):
    MMA, PACK = mma.MMA_16[kind], mma.PACK_16[kind]
    SCRATCH = mma.scratch_floats(32)

    @cuda.jit
    def product16(a_bits, a_f32, bt_bits, b_bits, c_k, c_v):
        """c_k = A @ Bt^T (B from an n x k tile), c_v = A @ B (B from a k x n tile); 16 x 16 each."""
        a_s = cuda.shared.array(TILE, mma.uint16)
        bt_s = cuda.shared.array(TILE, mma.uint16)
        b_s = cuda.shared.array(TILE, mma.uint16)
        scratch = cuda.shared.array(SCRATCH, float32)
        lane = cuda.threadIdx.x
        for i in range(lane, 256, 32):
            r, c = i // 16, i % 16
            a_s[r * STRIDE + c] = a_bits[r, c]
            bt_s[r * STRIDE + c] = bt_bits[r, c]
            b_s[r * STRIDE + c] = b_bits[r, c]
        cuda.syncthreads()
        g, t = lane // 4, lane % 4
        if a_from_registers:  # A given as float32 in the accumulator layout of two 8-wide tiles
            a0 = PACK(a_f32[g, 2 * t], a_f32[g, 2 * t + 1])
            a1 = PACK(a_f32[g + 8, 2 * t], a_f32[g + 8, 2 * t + 1])
            a2 = PACK(a_f32[g, 8 + 2 * t], a_f32[g, 8 + 2 * t + 1])
            a3 = PACK(a_f32[g + 8, 8 + 2 * t], a_f32[g + 8, 8 + 2 * t + 1])
        else:
            a = mma.ldsm_x4(a_s, 0, 0, STRIDE)
            a0, a1, a2, a3 = a[0], a[1], a[2], a[3]
        acc_k = cuda.local.array((2, 4), float32)
        acc_v = cuda.local.array((2, 4), float32)
        for n in range(2):
            for e in range(4):
                acc_k[n, e] = float32(0.0)
                acc_v[n, e] = float32(0.0)
        kb = mma.ldsm_x4(bt_s, 0, 0, STRIDE)
        MMA(acc_k, 0, a0, a1, a2, a3, kb[0], kb[2], scratch)
        MMA(acc_k, 1, a0, a1, a2, a3, kb[1], kb[3], scratch)
        vb = mma.ldsm_x4_trans(b_s, 0, 0, STRIDE)
        MMA(acc_v, 0, a0, a1, a2, a3, vb[0], vb[1], scratch)
        MMA(acc_v, 1, a0, a1, a2, a3, vb[2], vb[3], scratch)
        for n in range(2):
            for e in range(4):
                r = g + 8 * (e // 2)
                c = 8 * n + 2 * t + e % 2
                c_k[r, c] = acc_k[n, e]
                c_v[r, c] = acc_v[n, e]

    return product16


def _rounded16(kind, x):
    """(bit patterns, float64 values) of ``x`` rounded to the 16-bit kind."""
    if kind == "f16":
        h = np.asarray(x, np.float32).astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    bits, values = _bf16(x)
    return bits, values.astype(np.float64)


def _close(got, want):
    tol = 1e-5 * (1 + np.abs(want).max())
    assert np.abs(got - want).max() <= tol, np.abs(got - want).max()


@settings(max_examples=examples(6), deadline=None)
@given(kind=st.sampled_from(["f16", "bf16"]), a_from_registers=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_m16n8k16_fragments_equal_numpy_matmul(kind, a_from_registers, seed):
    rng = np.random.default_rng(seed)
    a_bits, a = _rounded16(kind, rng.standard_normal((16, 16)))
    bt_bits, bt = _rounded16(kind, rng.standard_normal((16, 16)))  # n x k (as K_j)
    b_bits, b = _rounded16(kind, rng.standard_normal((16, 16)))  # k x n (as V_j)
    c_k = np.full((16, 16), np.nan, np.float32)
    c_v = np.full((16, 16), np.nan, np.float32)
    kernel = product16_kernel(kind, a_from_registers)
    a_dev, bt_dev, b_dev, ck_dev, cv_dev = (cuda.to_device(x) for x in (a_bits, bt_bits, b_bits, c_k, c_v))
    kernel[1, 32](a_dev, cuda.to_device(a.astype(np.float32)), bt_dev, b_dev, ck_dev, cv_dev)
    _close(ck_dev.copy_to_host(), a @ bt.T)
    _close(cv_dev.copy_to_host(), a @ b)


@functools.lru_cache(maxsize=None)
def product_tf32_kernel():
    SCRATCH = mma.scratch_floats(32)

    @cuda.jit
    def product_tf32(a, bt, c):
        """c = tf32(A) @ tf32(Bt)^T for A 16 x 8, Bt 8 x 8 (fragments read by the m16n8k8 layout)."""
        scratch = cuda.shared.array(SCRATCH, float32)
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        acc = cuda.local.array((1, 4), float32)
        for e in range(4):
            acc[0, e] = float32(0.0)
        mma.mma_tf32(
            acc, 0, mma.to_tf32(a[g, t]), mma.to_tf32(a[g + 8, t]), mma.to_tf32(a[g, t + 4]),
            mma.to_tf32(a[g + 8, t + 4]), mma.to_tf32(bt[g, t]), mma.to_tf32(bt[g, t + 4]), scratch,
        )
        for e in range(4):
            c[g + 8 * (e // 2), 2 * t + e % 2] = acc[0, e]

    return product_tf32


def _tf32(x):
    return np.array([mma._tf32_bits(v) for v in np.asarray(x, np.float32).ravel()], np.uint32).view(np.float32).reshape(np.shape(x))


@settings(max_examples=examples(4), deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_m16n8k8_tf32_fragments_equal_numpy_matmul(seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    bt = rng.standard_normal((8, 8)).astype(np.float32)
    c = cuda.to_device(np.full((16, 8), np.nan, np.float32))
    product_tf32_kernel()[1, 32](cuda.to_device(a), cuda.to_device(bt), c)
    _close(c.copy_to_host(), _tf32(a).astype(np.float64) @ _tf32(bt).astype(np.float64).T)


@settings(max_examples=examples(40), deadline=None)
@given(x=st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_tf32_rounding_keeps_ten_mantissa_bits_and_splits_exactly(x):
    """tf32(x) has its 13 low mantissa bits clear, is within half a TF32 ulp of x, and the
    tf32x3 split big + small recovers x to about 2^-22 relative (the point of tf32x3)."""
    x = np.float32(x)
    big = _tf32(x)
    assert int(np.asarray(big).view(np.uint32)) & 0x1FFF == 0
    if np.isfinite(big) and abs(x) > 1e-30:
        assert abs(float(big) - float(x)) <= 2.0**-11 * abs(float(x)) * 1.0001
        small = _tf32(np.float32(x - big))
        assert abs(float(big) + float(small) - float(x)) <= 2.0**-21 * abs(float(x))


@settings(max_examples=examples(40), deadline=None)
@given(x=st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_fast_tf32x3_split_as_the_tensor_core_reads_it(x):
    """split_tf32: big = bits + 0x1000, small = x - big, both read by the tensor core with their
    13 low bits dropped: big is x rounded to TF32, and big + small is x within 2^-21."""
    x = np.float32(x)
    big, small = mma._split_bits(x)
    big_v = float(np.uint32(big & mma._TF32_MASK).view(np.float32))
    small_v = float(np.uint32(small & mma._TF32_MASK).view(np.float32))
    if np.isfinite(big_v) and abs(x) > 1e-30:
        assert abs(big_v - float(x)) <= 2.0**-11 * abs(float(x)) * 1.0001
        assert abs(big_v + small_v - float(x)) <= 2.0**-21 * abs(float(x))


def test_bf16_rounding_is_round_to_nearest_even():
    # 1 + 2^-8 is halfway between bfloat16 neighbours 1 and 1 + 2^-7: ties go to even (1).
    assert mma._bf16_bits(np.float32(1 + 2.0**-8)) == 0x3F80
    assert mma._bf16_bits(np.float32(1 + 3 * 2.0**-8)) == 0x3F82  # tie to even, upwards
    assert mma._bf16_bits(np.float32(np.nan)) & 0x7FC0 == 0x7FC0
    assert mma._bf16_bits(np.float32(-np.inf)) == 0xFF80


# ---------------------------------------------------------------------------------------------
# The backward's additions: A = X^T by ldmatrix.trans, packed 16-bit stores of accumulators,
# vector float32 reductions, 16-bit values.
# ---------------------------------------------------------------------------------------------

DS_STRIDE = 24


@functools.lru_cache(maxsize=None)
def transposed_a_kernel(kind: str):
    """c = X^T @ B where X (16 x 16, k x m) is stored row-major and read as the A operand by
    ``ldsm_x4_a_trans``, after a round trip of the accumulators of P = X (given as float32 in
    the C layout of two 8-wide tiles) through ``st_shared_u32`` (as the backward stores dS^T);
    and ``out[n, d:d+2] += c[n, d:d+2]`` by ``red_add_f32x2`` from every lane's fragments."""
    MMA, PACK = mma.MMA_16[kind], mma.PACK_16[kind]
    SCRATCH = mma.scratch_floats(32)

    @cuda.jit
    def transposed_a(x_f32, b_bits, c, out):
        x_s = cuda.shared.array(16 * DS_STRIDE, mma.uint16)
        b_s = cuda.shared.array(TILE, mma.uint16)
        scratch = cuda.shared.array(SCRATCH, float32)
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        for i in range(lane, 256, 32):
            b_s[(i // 16) * STRIDE + i % 16] = b_bits[i // 16, i % 16]
        # X's accumulators (rows g, g + 8; columns 2t, 2t + 1 of two 8-wide tiles) -> shared
        for n in range(2):
            c0 = 8 * n + 2 * t
            mma.st_shared_u32(x_s, g * DS_STRIDE + c0, PACK(x_f32[g, c0], x_f32[g, c0 + 1]))
            mma.st_shared_u32(x_s, (g + 8) * DS_STRIDE + c0, PACK(x_f32[g + 8, c0], x_f32[g + 8, c0 + 1]))
        cuda.syncthreads()
        a = mma.ldsm_x4_a_trans(x_s, 0, 0, DS_STRIDE)
        acc = cuda.local.array((2, 4), float32)
        for n in range(2):
            for e in range(4):
                acc[n, e] = float32(0.0)
        vb = mma.ldsm_x4_trans(b_s, 0, 0, STRIDE)
        MMA(acc, 0, a[0], a[1], a[2], a[3], vb[0], vb[1], scratch)
        MMA(acc, 1, a[0], a[1], a[2], a[3], vb[2], vb[3], scratch)
        for n in range(2):
            for e in range(4):
                c[g + 8 * (e // 2), 8 * n + 2 * t + e % 2] = acc[n, e]
            for i in range(2):
                mma.red_add_f32x2(out, g + 8 * i, 8 * n + 2 * t, acc[n, 2 * i], acc[n, 2 * i + 1])

    return transposed_a


@settings(max_examples=examples(4), deadline=None)
@given(kind=st.sampled_from(["f16", "bf16"]), seed=st.integers(0, 2**32 - 1))
def test_transposed_a_operand_and_packed_stores_equal_numpy(kind, seed):
    rng = np.random.default_rng(seed)
    x_bits, x = _rounded16(kind, rng.standard_normal((16, 16)))
    b_bits, b = _rounded16(kind, rng.standard_normal((16, 16)))
    c = cuda.to_device(np.full((16, 16), np.nan, np.float32))
    start = rng.standard_normal((16, 16)).astype(np.float32)
    out = cuda.to_device(start.copy())
    transposed_a_kernel(kind)[1, 32](cuda.to_device(x.astype(np.float32)), cuda.to_device(b_bits), c, out)
    _close(c.copy_to_host(), x.T @ b)
    _close(out.copy_to_host(), start + (x.T @ b).astype(np.float32))


@functools.lru_cache(maxsize=None)
def values_kernel(kind: str):
    VALUE = mma.VALUE_16[kind]

    @cuda.jit
    def values(bits, out):
        i = cuda.grid(1)
        if i < bits.shape[0]:
            out[i] = VALUE(bits[i])

    return values


@settings(max_examples=examples(4), deadline=None)
@given(kind=st.sampled_from(["f16", "bf16"]), seed=st.integers(0, 2**32 - 1))
def test_16_bit_values_are_exact(kind, seed):
    """f16_value / bf16_value: the float32 value of a 16-bit pattern, exactly (normal,
    subnormal, zero, inf)."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.standard_normal(60) * 10.0 ** rng.integers(-6, 4, 60), [0.0, -0.0, np.inf, -np.inf]])
    bits, values = _rounded16(kind, x)
    out = cuda.to_device(np.full(len(x), np.nan, np.float32))
    values_kernel(kind)[1, 64](cuda.to_device(np.ascontiguousarray(bits)), out)
    np.testing.assert_array_equal(out.copy_to_host(), values.astype(np.float32))
