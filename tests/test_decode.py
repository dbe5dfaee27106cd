"""``numba_flash.decode`` (API.md section 2b) in the simulator: GQA-packed rows, ragged caches
(the tail past each length poisoned with NaN: never read), causal alignment to each valid
length, splits, every dtype."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import examples, plain_fp16_attention, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash import reference

NUMPY_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def reference_decode(q, k, v, lens, causal):
    """Per sequence, attention over its valid keys (float64)."""
    outs, lses = [], []
    for b, n in enumerate(lens):
        o, lse = reference.attention(*(x[b : b + 1].astype(np.float64) for x in (q, k[:, :, :n], v[:, :, :n])), causal=causal)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def check(q, k, v, lens, causal, o, lse):
    ref_o, ref_lse = reference_decode(q, k, v, lens, causal)
    got = np.asarray(o).astype(np.float64)
    assert got.shape == q.shape and o.dtype == q.dtype
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(ref_lse))
    assert (got[~np.isfinite(ref_lse)] == 0).all()
    if q.dtype == np.float32:
        assert rel_err(got, ref_o) < 2e-6
    else:  # FlashAttention's rule against a plain implementation in the same dtype, per sequence
        for b, n in enumerate(lens):
            if n == 0:
                continue
            plain = plain_fp16_attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], causal, None, dtype=q.dtype)
            base = np.abs(plain.astype(np.float64) - ref_o[b : b + 1]).max()
            assert np.abs(got[b : b + 1] - ref_o[b : b + 1]).max() <= 2 * base + 1e-6
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-4, atol=1e-4)


@settings(max_examples=examples(6), deadline=None)
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    group=st.sampled_from([1, 2, 4]),
    n_q=st.integers(1, 3),
    n_max=st.integers(1, 48),
    causal=st.booleans(),
    num_splits=st.sampled_from([None, 1, 2, 3]),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_decode_matches_reference_with_poisoned_tail(dtype, group, n_q, n_max, causal, num_splits, data, seed):
    rng = np.random.default_rng(seed)
    B, Hkv, D = 2, 2, 16
    lens = np.array(data.draw(st.lists(st.integers(0, n_max), min_size=B, max_size=B)), dtype=np.int32)
    npdt = NUMPY_DTYPE[dtype]
    q = rng.standard_normal((B, Hkv * group, n_q, D)).astype(npdt)
    k = rng.standard_normal((B, Hkv, n_max, D)).astype(npdt)
    v = rng.standard_normal((B, Hkv, n_max, D)).astype(npdt)
    for b, n in enumerate(lens):  # past each valid length: NaN, which must never be read
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, causal=causal, num_splits=num_splits, return_lse=True)
    check(q, k, v, lens, causal, o, lse)


def test_decode_without_lengths_is_attention():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 4, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 33, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 33, 16)).astype(np.float32)
    o = numba_flash.decode(q, k, v, num_splits=3)
    assert rel_err(o, reference.attention(q, k, v)[0]) < 2e-6


def test_lengths_past_the_cache_are_clamped_and_lists_accepted():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 2, 1, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 20, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 20, 8)).astype(np.float32)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=[50, -3], return_lse=True)
    check(q, k, v, [20, 0], False, o, lse)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(cache_seqlens=np.array([3], np.int32)), ValueError, "cache_seqlens"),
        (dict(cache_seqlens=np.array([1.5, 2.0])), TypeError, "integers"),
        (dict(num_splits=0), ValueError, "num_splits"),
        (dict(return_lse=1), TypeError, "return_lse"),
    ],
)
def test_decode_errors(kwargs, error, match):
    q = np.ones((2, 4, 1, 8), np.float32)
    k = np.ones((2, 2, 5, 8), np.float32)
    with pytest.raises(error, match=match):
        numba_flash.decode(q, k, k, **kwargs)


def test_decode_heads_must_divide():
    with pytest.raises(ValueError, match="multiple"):
        numba_flash.decode(np.ones((1, 3, 1, 8), np.float32), np.ones((1, 2, 5, 8), np.float32), np.ones((1, 2, 5, 8), np.float32))
