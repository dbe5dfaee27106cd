"""The tensor-core kernels (``precision`` regimes, API.md section 2a) against the float64 reference.

In the simulator: small awkward shapes and one-warp tiles (every product is a barrier there).
float16 and bfloat16 must be within FlashAttention's rule (at most twice the error of a plain
implementation in the same dtype), ``tf32x3`` within float32-like error, ``tf32`` within TF32's.
Outputs are poisoned with NaN first, so an unwritten element fails.
"""

from __future__ import annotations

import contextlib
import os

import ml_dtypes
import numpy as np
import pytest
from helpers import examples, lse_matches, plain_fp16_attention, poisoned, random_qkv, rel_err, to_numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import reference
from numba_flash.api import attention, forward
from numba_flash.kernels.tc_ops import tc_layout
from numba_flash.problem import regime

ALGORITHMS = ["fa1", "fa2"]
NUMPY_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
PRECISION_OF = {"f16": ("float16", None), "bf16": ("bfloat16", None), "tf32": ("float32", "tf32"), "tf32x3": ("float32", "tf32x3")}



def qkv(rng, batch, heads, kv_heads, n_q, n_k, head_dim, dtype, scale=1.0):
    q, k, v = random_qkv(rng, batch, heads, kv_heads, n_q, n_k, head_dim, "float32", np, scale)
    return tuple(x.astype(NUMPY_DTYPE[dtype]) for x in (q, k, v))


def run_poisoned(q, k, v, **kw):
    B, H, Nq, D = q.shape
    o = np.full((B, H, Nq, D), np.nan, dtype=q.dtype)
    lse = poisoned(np, (B, H, Nq), np.float32)
    return forward(q, k, v, out=o, lse_out=lse, **kw)


def check(q, k, v, o, lse, causal, kind, scale=None):
    ref_o, ref_lse = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal, scale=scale)
    got = to_numpy(o).astype(np.float64)
    assert not np.isnan(got).any(), "an output element was not written (or is NaN)"
    if kind in ("f16", "bf16"):
        plain = plain_fp16_attention(q, k, v, causal, scale, dtype=q.dtype).astype(np.float64)
        base = np.abs(plain - ref_o).max()
        err = np.abs(got - ref_o).max()
        assert err <= 2 * base + 1e-6, f"{kind} error {err:.3g} > 2 x plain {kind} error {base:.3g}"
    elif kind == "tf32x3":
        assert rel_err(got, ref_o) < 1e-5, rel_err(got, ref_o)
    else:  # tf32: 10 mantissa bits in, float32 accumulation
        assert rel_err(got, ref_o) < 5e-3, rel_err(got, ref_o)
    lse_tol = 1e-2 if kind == "tf32" else 1e-4
    assert lse_matches(lse, ref_lse, atol=lse_tol, rtol=lse_tol), (to_numpy(lse), ref_lse)


@settings(max_examples=examples(6), deadline=None)
@given(
    kind=st.sampled_from(["f16", "bf16", "tf32", "tf32x3"]),
    algorithm=st.sampled_from(ALGORITHMS),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 2),
    n_q=st.integers(1, 20),
    n_k=st.integers(1, 36),
    head_dim=st.integers(1, 20),
    block_n=st.sampled_from([16, 32]),
    causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_tensor_core_kernels_match_reference(kind, algorithm, kv_heads, group, n_q, n_k, head_dim, block_n, causal, seed):
    dtype, precision = PRECISION_OF[kind]
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, 1, kv_heads * group, kv_heads, n_q, n_k, head_dim, dtype)
    o, lse = run_poisoned(q, k, v, causal=causal, algorithm=algorithm, precision=precision, block_m=16, block_n=block_n)
    assert o.dtype == q.dtype and lse.dtype == np.float32
    check(q, k, v, o, lse, causal, kind)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("kind, causal", [("f16", True), ("f16", False), ("bf16", True), ("tf32", True), ("tf32x3", True)])
def test_every_kind_over_many_kv_tiles(kind, causal, algorithm, rng):
    """Three K/V tiles and two Q tiles, keys not a tile multiple: the running max moves between
    tiles (FA-2's rescale, FA-1's O round trip are exercised), diagonal and tail tiles masked."""
    dtype, precision = PRECISION_OF[kind]
    q, k, v = qkv(rng, 1, 1, 1, 18, 40, 12, dtype)
    k[..., 28:, :] *= 3  # later keys score higher: the max moves after the first tiles
    o, lse = run_poisoned(q, k, v, causal=causal, algorithm=algorithm, precision=precision, block_m=16, block_n=16)
    check(q, k, v, o, lse, causal, kind)


@contextlib.contextmanager
def presplit_mode(mode):
    """``NUMBA_FLASH_TF32X3_PRESPLIT=mode`` for the block, with the memoised layouts, kernels and
    specs that read it made afresh (and again after)."""
    from numba_flash import specs
    from numba_flash.kernels import engines, forward, tc_ops

    def clear():
        for f in (tc_ops.tc_layout, tc_ops.tc_ops, engines.mma_engine, forward.forward_kernel, specs.kernel_spec):
            f.cache_clear()

    before = os.environ.get("NUMBA_FLASH_TF32X3_PRESPLIT")
    os.environ["NUMBA_FLASH_TF32X3_PRESPLIT"] = mode
    clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("NUMBA_FLASH_TF32X3_PRESPLIT")
        else:
            os.environ["NUMBA_FLASH_TF32X3_PRESPLIT"] = before
        clear()


@pytest.mark.parametrize("algorithm, mode, causal, n_k", [("fa2", "qv", True, 20), ("fa2", "kv", False, 20),
                                                        ("fa1", "qkv", True, 16)])
def test_tf32x3_presplit_operands_at_large_head_dim(algorithm, mode, causal, n_k, rng):
    """tf32x3 at D > 64 with 128-row Q tiles splits Q_i, V_j (and K_j) into TF32 big/small
    fragments once, in shared memory (``tc_ops.presplit_operands``): the default "qv" and the
    walks of the other operands (FA-2 over two K/V tiles), 20 of 128 rows, D = 68 (80 padded).
    10-15 s each in the simulator (every product is a barrier of 256 threads)."""
    with presplit_mode(mode):
        from numba_flash import switches
        from numba_flash.specs import kernel_spec

        assert tc_layout("tf32x3", 68, 128, 16, presplit_mode=switches.tf32x3_presplit()).presplit == mode
        assert kernel_spec("fa2", 68, "float32", 128, 16, regime="tf32x3").presplit == mode  # what the kernels get
        q, k, v = qkv(rng, 1, 1, 1, 20, n_k, 68, "float32")
        k[..., 12:, :] *= 3  # the max moves in the second tile: O~ is rescaled
        o, lse = run_poisoned(q, k, v, causal=causal, algorithm=algorithm, precision="tf32x3", block_m=128, block_n=16)
        check(q, k, v, o, lse, causal, "tf32x3")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_masked_rows_give_zero_and_minus_inf(algorithm, rng):
    """Causal with Nq > Nk: the first Nq - Nk rows see no key: o = 0, lse = -inf, never NaN."""
    q, k, v = qkv(rng, 1, 2, 1, 21, 5, 16, "float16")
    o, lse = run_poisoned(q, k, v, causal=True, algorithm=algorithm)
    check(q, k, v, o, lse, True, "f16")
    assert (to_numpy(o)[:, :, :16] == 0).all() and np.isneginf(to_numpy(lse)[:, :, :16]).all()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_nan_query_reaches_only_its_row(algorithm, rng):
    q, k, v = qkv(rng, 1, 1, 1, 5, 7, 8, "float16")
    q[0, 0, 2, 3] = np.nan
    o = to_numpy(run_poisoned(q, k, v, algorithm=algorithm)[0]).astype(np.float32)
    assert np.isnan(o[0, 0, 2]).all()
    assert np.isfinite(o[0, 0, [0, 1, 3, 4]]).all()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_huge_logits_stay_finite_bfloat16(algorithm, rng):
    """Scores of ~1e3 in bfloat16: the running max keeps every exp2 argument <= 0."""
    q, k, v = qkv(rng, 1, 1, 1, 9, 17, 8, "bfloat16", scale=8.0)
    o, lse = run_poisoned(q, k, v, scale=30.0, algorithm=algorithm)
    assert np.isfinite(to_numpy(o).astype(np.float32)).all() and np.isfinite(to_numpy(lse)).all()
    check(q, k, v, o, lse, False, "bf16", scale=30.0)


def test_one_row_one_key_and_no_keys(rng):
    q, k, v = qkv(rng, 1, 1, 1, 1, 1, 3, "float16")
    o, lse = run_poisoned(q, k, v)
    np.testing.assert_allclose(to_numpy(o).astype(np.float32), v.astype(np.float32), rtol=1e-3)
    q, k, v = qkv(rng, 1, 1, 1, 3, 0, 8, "bfloat16")
    o, lse = attention(q, k, v, return_lse=True)
    assert (to_numpy(o).astype(np.float32) == 0).all() and np.isneginf(lse).all()


def test_bfloat16_on_cuda_cores_is_widened(rng):
    """precision='ieee' runs bfloat16 on the CUDA-core kernels (float32 inside), output bfloat16."""
    q, k, v = qkv(rng, 1, 2, 1, 6, 9, 5, "bfloat16")
    o, lse = run_poisoned(q, k, v, causal=True, precision="ieee", block_m=4, block_n=4)
    assert o.dtype == ml_dtypes.bfloat16
    check(q, k, v, o, lse, True, "bf16")


@pytest.mark.parametrize(
    "precision, dtype, expected",
    [(None, "float16", "f16"), (None, "bfloat16", "bf16"), (None, "float32", "ieee"), ("ieee", "float16", "ieee"),
     ("ieee", "bfloat16", "ieee"), ("tf32", "float32", "tf32"), ("tf32x3", "float32", "tf32x3")],
)
def test_precision_picks_the_regime(precision, dtype, expected):
    assert regime(precision, dtype) == expected


@pytest.mark.parametrize(
    "precision, dtype, message",
    [("tf32", "float16", "float32 inputs"), ("tf32x3", "bfloat16", "float32 inputs"), ("fp8", "float32", "precision must be"),
     ("TF32", "float32", "precision must be"), (3, "float32", "precision must be")],
)
def test_bad_precision_is_refused_before_any_launch(precision, dtype, message, rng):
    q, k, v = qkv(rng, 1, 1, 1, 2, 2, 4, dtype)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, precision=precision)


@pytest.mark.parametrize("block_m, block_n", [(8, 16), (16, 8), (48, 16), (16, 256), (True, 16)])
def test_tensor_core_tiles_are_checked(block_m, block_n, rng):
    q, k, v = qkv(rng, 1, 1, 1, 2, 2, 4, "float16")
    with pytest.raises(ValueError, match="on tensor cores"):
        attention(q, k, v, block_m=block_m, block_n=block_n)


def test_tile_order_knob_needs_the_cuda_core_kernels(rng):
    q, k, v = qkv(rng, 1, 1, 1, 2, 20, 4, "float16")
    with pytest.raises(ValueError, match="precision='ieee'"):
        forward(q, k, v, kv_tile_order=[1, 0], block_n=16)
    with pytest.raises(ValueError, match="precision='ieee'"):  # an order for CUDA-core tiles
        forward(q, k, v, kv_tile_order=[4, 3, 2, 1, 0])


@pytest.mark.parametrize("order", ["native", "swapped"])
@pytest.mark.parametrize("kind", ["f16", "tf32x3"])
def test_read_only_and_big_endian_inputs_are_read_as_they_are(kind, order, rng):
    """Inputs are never written (read-only NumPy works), and non-native byte order is honoured."""
    dtype, precision = PRECISION_OF[kind]
    q, k, v = qkv(rng, 1, 2, 1, 7, 9, 8, dtype)
    foreign = ">" if np.little_endian else "<"
    swapped = [x.astype(x.dtype.newbyteorder(foreign if order == "swapped" else "=")) for x in (q, k, v)]
    for x in swapped:
        x.setflags(write=False)
    before = [x.copy() for x in swapped]
    o = np.full(q.shape, np.nan, dtype=q.dtype)  # results in the machine's byte order
    o, lse = forward(*swapped, causal=True, precision=precision, out=o)
    check(q, k, v, o, lse, True, kind)
    assert all(np.array_equal(x, b) for x, b in zip(swapped, before))
    with pytest.raises(ValueError, match="byte order"):
        forward(*swapped, precision=precision, out=np.empty(q.shape, q.dtype.newbyteorder(foreign)))


def test_strided_and_odd_head_dim_inputs_are_untouched(rng):
    """A (B, N, H, D) buffer viewed as (B, H, N, D) with D = 5 (padded to 8 for cp.async)."""
    buf = [rng.standard_normal((1, 7, 2, 5)).astype(np.float16) for _ in range(3)]
    before = [b.copy() for b in buf]
    q, k, v = (b.transpose(0, 2, 1, 3) for b in buf)
    o, lse = run_poisoned(q, k, v, causal=True)
    check(q, k, v, o, lse, True, "f16")
    for b, b0 in zip(buf, before):
        assert np.array_equal(b, b0)


@pytest.mark.parametrize("kind", ["f16", "tf32x3"])
def test_deterministic(kind, rng):
    dtype, precision = PRECISION_OF[kind]
    q, k, v = qkv(rng, 1, 1, 1, 9, 20, 8, dtype)
    a = to_numpy(attention(q, k, v, precision=precision))
    b = to_numpy(attention(q, k, v, precision=precision))
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_head_dims_above_128_read_q_from_shared_memory(dtype):
    """Above D = 128 the 16-bit kernels keep Q_i in shared memory and read each head-dim step's
    fragment there (``tc_ops``' ``Q_IN_REGS``, issue 25's D = 256): FA-2 at D = 256 within
    FlashAttention's rule, causal, a tail row tile. (On the H200: docs/performance-log.md 17.)"""
    from numba_flash.kernels.tc_ops import tc_ops

    assert tc_ops("f16", 256, 16, 16).q_frag_rows == 1 and tc_ops("f16", 128, 16, 16).q_frag_rows == 8
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 1, 20, 256)).astype(NUMPY_DTYPE[dtype]) for _ in range(3))
    o = to_numpy(attention(q, k, v, causal=True))
    ref, _ = reference.attention(q, k, v, True)
    plain = plain_fp16_attention(q, k, v, True, None, dtype=NUMPY_DTYPE[dtype])
    assert np.abs(o.astype(np.float64) - ref).max() <= 2 * np.abs(plain.astype(np.float64) - ref).max() + 1e-6
