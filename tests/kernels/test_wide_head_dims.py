"""Head dims above 128 (issue 25, API.md 2e: every path takes 1 to 256), in the simulator.

Every path against the float64 reference on small awkward shapes: the forward in both loop
orders and every regime (CUDA cores, 16-bit and tf32x3 tensor cores), the backward in its three
loop orders on tensor cores (whose K/V kernels split dK_j, dV_j's columns between two warps per
16 keys above D = 128, ``tc_bwd.TcBwdLayout.col_split``: D = 256 splits evenly, D = 200 and
D = 136 leave the second warp a shorter part) and on CUDA cores, decode (contiguous and paged),
and a packed batch. 16-bit results are held to FlashAttention's rule (at most twice a plain
16-bit implementation's error), gradients to ``test_backward_tc``'s bounds. (The same paths at
D = 256 on the H200: tests/gpu/test_gpu_wide.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import backward_problem, gradient_error, plain_fp16_attention, to_numpy

import numba_flash
from numba_flash import reference, tile_table
from numba_flash.backward import gradients
from numba_flash.kernels import tc_bwd
from numba_flash.kernels.tc_ops import tc_ops

TC_TOL = {"float16": 5e-3, "bfloat16": 4e-2, "float32": 1e-5}  # test_backward_tc's (float32: tf32x3's)


def _qkv(rng, shape_q, shape_kv, dtype):
    return tuple(rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_kv, shape_kv))


def _within_fa_rule(o, q, k, v, causal):
    ref, _ = reference.attention(q, k, v, causal)
    plain = plain_fp16_attention(q, k, v, causal, None, dtype=q.dtype)
    err = np.abs(to_numpy(o).astype(np.float64) - ref).max()
    return err <= 2 * np.abs(plain.astype(np.float64) - ref).max() + 1e-6, err


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("dtype, precision, head_dim", [("float16", None, 256), ("float16", None, 200),
                                                        ("float32", "ieee", 256), ("float32", "tf32x3", 136)])
def test_forward(algorithm, dtype, precision, head_dim):
    rng = np.random.default_rng(head_dim)
    q, k, v = _qkv(rng, (1, 1, 19, head_dim), (1, 1, 23, head_dim), dtype)  # (GQA: the backward's tests)
    o = numba_flash.attention(q, k, v, causal=True, algorithm=algorithm, precision=precision)
    assert o.shape == q.shape
    if dtype == "float16":
        ok, err = _within_fa_rule(o, q, k, v, True)
        assert ok, err
    else:
        ref, _ = reference.attention(q, k, v, True)
        assert np.abs(to_numpy(o) - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("algorithm, deterministic, dtype, head_dim", [
    ("fa2", False, "float16", 256), ("fa2", True, "float16", 200), ("fa1", False, "bfloat16", 144)])
def test_backward_on_tensor_cores(algorithm, deterministic, dtype, head_dim):
    rng = np.random.default_rng(head_dim + 1)
    # (one head: GQA at D = 256, dK, dV summed over a KV head's query heads, is the packed batch's
    # test_packed_batch_forward_and_backward, 2 query heads on 1 KV head, FA-2 on tensor cores)
    do, q, k, v, o, lse = backward_problem(rng, 1, 1, 1, 19, 21, head_dim, dtype, True)
    grads = numba_flash.attention_backward(do, q, k, v, o, lse, causal=True, algorithm=algorithm,
                                           deterministic=deterministic)
    refs = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), causal=True)
    for name, got, ref, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        assert gradient_error(got, ref, refs) < TC_TOL[dtype], name


@pytest.mark.parametrize("algorithm, deterministic", [("fa2", False), ("fa1", False)])
def test_backward_with_shared_scores(algorithm, deterministic):
    """Q tiles of 32 queries: the two warps of each 16 keys split S^T, dP^T by queries and read
    P^T, dS^T from shared memory (``TcBwdLayout.shared_scores``; the GPU's default above D = 128)."""
    assert tc_bwd.tc_bwd_layout(algorithm, "f16", 200, 32, 16).shared_scores
    rng = np.random.default_rng(2)
    do, q, k, v, o, lse = backward_problem(rng, 1, 1, 1, 37, 21, 200, "float16", True)
    grads = gradients(do, q, k, v, o, lse, causal=True, algorithm=algorithm, deterministic=deterministic,
                      tiles=(32, 16))
    refs = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), causal=True)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert gradient_error(got, ref, refs) < TC_TOL["float16"], name


@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
def test_float32_backward(precision):
    """tf32x3 at D = 136 (float32 tiles: parts of 80 and 64 columns of 144) and CUDA cores."""
    rng = np.random.default_rng(7)
    do, q, k, v, o, lse = backward_problem(rng, 1, 1, 1, 9, 17, 136, "float32", False)
    grads = gradients(do, q, k, v, o, lse, precision=precision)
    refs = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)))
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert gradient_error(got, ref, refs) < TC_TOL["float32"], name


@pytest.mark.parametrize("dtype, page_size", [("float16", None), ("float16", 16), ("float32", None)])
def test_decode(dtype, page_size):
    rng = np.random.default_rng(11)
    B, Hkv, N, D = 2, 1, 20, 256  # GQA 2:1 on one KV head (two would run the same rows twice)
    q = rng.standard_normal((B, 2, 1, D)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((B, Hkv, N, D)).astype(dtype) for _ in range(2))
    lengths = np.array([19, 9], np.int32)
    ref = reference.decode(q, k_cache, v_cache, cache_seqlens=lengths)
    ref = ref[0] if isinstance(ref, tuple) else ref
    if page_size is None:
        o = numba_flash.decode(q, k_cache, v_cache, cache_seqlens=lengths)
    else:  # FlashAttention's layout (pages, page_size, Hkv, D), pages in reverse order
        pages_per_seq = N // page_size + 1
        table = np.arange(B * pages_per_seq, dtype=np.int32)[::-1].reshape(B, pages_per_seq).copy()
        pk, pv = (np.zeros((B * pages_per_seq, page_size, Hkv, D), dtype) for _ in range(2))
        for b in range(B):
            for j in range(N):
                pk[table[b, j // page_size], j % page_size] = k_cache[b, :, j]
                pv[table[b, j // page_size], j % page_size] = v_cache[b, :, j]
        o = numba_flash.decode(q, pk, pv, cache_seqlens=lengths, block_table=table)
    bound = 2e-3 if dtype == "float16" else 1e-5
    assert np.abs(to_numpy(o).astype(np.float64) - ref).max() <= bound * np.abs(ref).max()


def test_packed_batch_forward_and_backward():
    rng = np.random.default_rng(5)
    cu = np.array([0, 7, 7, 20], np.int32)  # lengths 7, 0, 13
    q, k, v = _qkv(rng, (20, 2, 256), (20, 1, 256), "float16")
    o, lse = numba_flash.attention_varlen(q, k, v, cu, cu, 13, 13, causal=True, return_lse=True)
    ref = reference.attention_varlen(q, k, v, cu, cu, 13, 13, causal=True)
    ref_o = ref[0] if isinstance(ref, tuple) else ref
    assert np.abs(to_numpy(o).astype(np.float64) - ref_o).max() <= 2e-3 * np.abs(ref_o).max()
    do = rng.standard_normal(o.shape).astype("float16")
    grads = numba_flash.attention_backward_varlen(do, q, k, v, o, lse, cu, cu, 13, 13, causal=True)
    refs = reference.attention_backward_varlen(*(x.astype(np.float64) for x in (do, q, k, v)), to_numpy(o),
                                               to_numpy(lse), cu, cu, 13, 13, causal=True)
    for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
        assert gradient_error(got, want, refs) < TC_TOL["float16"], name


def test_column_split_layout():
    """Above D = 128 the K/V kernels have two warps per 16 keys, each on its part of the columns:
    the parts cover the padded head dim, even counts of 8-wide tiles, the first part whole."""
    for d in (128, 136, 200, 256):
        lay = tc_bwd.tc_bwd_layout("fa2", "f16", d, 32, 64)
        assert lay.col_split == (2 if d > 128 else 1)
        assert lay.warps == 4 * lay.col_split and tc_bwd.tc_bwd_layout("dq", "f16", d, 32, 64).col_split == 1
        ops = tc_ops("f16", d, 64, 32, col_split=lay.col_split)
        tiles = lay.padded_dim // 8
        assert ops.out_tiles % 2 == 0 and ops.out_tiles * lay.col_split >= tiles > ops.out_tiles * (lay.col_split - 1)
    with pytest.raises(ValueError, match="col_split"):
        tc_ops("f16", 256, 16, 64, key_warps=2, col_split=2)
    with pytest.raises(ValueError, match="512 threads, more than the 256"):  # 128 keys: 16 warps above D = 128
        tc_bwd.check_tc_bwd_tiles("f16", 256, 16, 128)
    tc_bwd.check_tc_bwd_tiles("f16", 128, 16, 128)  # (8 warps at D <= 128)


def test_tile_table_has_wide_entries(monkeypatch):
    """Every path's default at D = 256 fits the GPU: the tiles' shared memory and threads."""
    from numba_flash.arch import SMEM_OPTIN_LIMIT
    from numba_flash.kernels.tc_ops import tc_layout
    from numba_flash.kernels.tiles import check_tiles

    monkeypatch.setattr(tile_table, "simulated", lambda: False)
    assert tile_table.MAX_HEAD_DIM == 256
    check_tiles(256, *tile_table.comparison_tiles(256))
    for kind in ("f16", "bf16", "tf32", "tf32x3"):
        assert tc_layout(kind, 256, *tile_table.forward_tc_tiles(kind, 256)).smem_bytes <= SMEM_OPTIN_LIMIT
    for kind in ("f16", "bf16", "tf32x3"):
        for order in ("fa1", "fa2"):
            kernels = [order] + (["dq"] if order == "fa2" else [])
            tc_bwd.check_tc_bwd_tiles(kind, 256, *tile_table.backward_tc_tiles(256, kind, order), kernels)
    assert tc_bwd.tc_bwd_layout("fa2", "f16", 256, *tile_table.backward_tc_tiles(256, "f16")).shared_scores
    assert tile_table.backward_block(256) == 16


def test_head_dims_past_256_raise():
    q = np.zeros((1, 1, 2, 257), np.float32)
    with pytest.raises(ValueError, match="head_dim .* from 1 to 256"):
        numba_flash.attention(q, q, q)
