"""Strided NumPy views on every path in the simulator: a (B, N, H, D) buffer viewed as
(B, H, N, D) (``transpose(0, 2, 1, 3)``, not contiguous) gives bit for bit what its contiguous
copy gives, and the caller's buffers stay unchanged. Forward on tensor cores (float16 at D = 16,
the view path without padding; float32 in tf32 and tf32x3), decode with a transposed float16
cache, backward in float32 (tf32x3) and float16 with a strided ``do`` (issue 26: these crashed in
numba's argument transfer, ``sentry_contiguous``)."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash


def _views(rng, shape_bnhd, dtype, n):
    buffers = [rng.standard_normal(shape_bnhd).astype(dtype) for _ in range(n)]
    views = [b.transpose(0, 2, 1, 3) for b in buffers]
    assert not any(v.flags.c_contiguous for v in views)
    return buffers, views


def _same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g.view(np.uint8), w.view(np.uint8))


@pytest.mark.parametrize("dtype, precision", [("float16", None), ("float32", "tf32"), ("float32", "tf32x3")])
def test_forward_on_tensor_cores(dtype, precision):
    rng = np.random.default_rng(1)
    buffers, (q, k, v) = _views(rng, (1, 5, 2, 16), dtype, 3)
    before = [b.copy() for b in buffers]
    got = numba_flash.attention(q, k, v, causal=True, precision=precision, return_lse=True)
    want = numba_flash.attention(*(np.ascontiguousarray(x) for x in (q, k, v)), causal=True, precision=precision,
                                 return_lse=True)
    _same(got, want)
    _same(buffers, before)


def test_decode_with_a_transposed_cache():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float16)
    buffers, (k_cache, v_cache) = _views(rng, (2, 9, 2, 16), np.float16, 2)
    got = numba_flash.decode(q, k_cache, v_cache, cache_seqlens=[9, 4], return_lse=True)
    want = numba_flash.decode(q, np.ascontiguousarray(k_cache), np.ascontiguousarray(v_cache), cache_seqlens=[9, 4],
                              return_lse=True)
    _same(got, want)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_backward_with_strided_inputs_and_do(dtype):
    rng = np.random.default_rng(3)
    buffers, (q, k, v, do) = _views(rng, (1, 5, 2, 16), dtype, 4)
    before = [b.copy() for b in buffers]
    o, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    got = numba_flash.attention_backward(do, q, k, v, o, lse, causal=True)
    want = numba_flash.attention_backward(*(np.ascontiguousarray(x) for x in (do, q, k, v)), o, lse, causal=True)
    _same(got, want)
    _same(buffers, before)
