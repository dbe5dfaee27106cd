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


def check(q, k, v, lens, causal, o, lse):
    ref_o, ref_lse = reference.decode(q, k, v, cache_seqlens=list(lens), causal=causal)  # (float64, per sequence)
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


@settings(max_examples=examples(4), deadline=None)  # (the simulator's time)
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


@pytest.mark.parametrize(
    "position, bad, error, match",
    [
        (1, np.ones((2, 2, 5, 8), np.float64), TypeError, r"^k_cache must be float16, bfloat16 or float32"),
        (2, np.ones((2, 2, 5, 8), np.float16), TypeError, r"^q, k_cache and v_cache must have one dtype"),
        (2, np.ones((2, 2, 4, 8), np.float32), ValueError, r"^k_cache and v_cache must have the same shape; got k_cache"),
        (1, np.ones((1, 2, 5, 8), np.float32), ValueError, r"^k_cache and v_cache must have the same shape"),
        (1, [[1.0]], TypeError, r"^k_cache must be a NumPy array"),
        (2, 1.0, TypeError, r"^v_cache must be a NumPy array, .*; got builtins\.float"),
        (0, [1.0], TypeError, r"^q must be a NumPy array"),
    ],
)
def test_decode_errors_name_the_argument_as_api_md_spells_it(position, bad, error, match):
    """decode's arguments are q, k_cache, v_cache (API.md section 2b), not attention's k and v;
    a non-array is named too."""
    args = [np.ones((2, 4, 1, 8), np.float32), np.ones((2, 2, 5, 8), np.float32), np.ones((2, 2, 5, 8), np.float32)]
    args[position] = bad
    with pytest.raises(error, match=match):
        numba_flash.decode(*args)


def test_decode_names_lengths_that_are_not_an_array():
    q, k = np.ones((1, 2, 1, 8), np.float32), np.ones((1, 2, 5, 8), np.float32)
    with pytest.raises(TypeError, match=r"^cache_seqlens must be a NumPy array, .*; got builtins\.float"):
        numba_flash.decode(q, k, k, cache_seqlens=4.0)


def test_decode_heads_must_divide():
    with pytest.raises(ValueError, match="multiple"):
        numba_flash.decode(np.ones((1, 3, 1, 8), np.float32), np.ones((1, 2, 5, 8), np.float32), np.ones((1, 2, 5, 8), np.float32))


@pytest.mark.parametrize("kind", ["f16", "tf32"])
def test_decode_kernel_knobs_change_no_bit(kind):
    """The decode kernel's knobs (``tc_fa2_kernel``): K/V copies by row walks (``row_walk``,
    ``tc_ops.row_walk_default``: on the GPU 32 copies per thread of a 16 x 64 tile at D = 128,
    below the rule in the simulator's small tiles, so asked for here) and a ring of
    ``kv_stages`` K/V tiles. Same products in the same order: the partials are bit for bit the
    indexed one-stage kernel's, whatever the splits (full tiles walked, the tail tile indexed,
    rings deeper than a split's range), and right (merged on the host, against float64)."""
    from numba_flash import online
    from numba_flash.kernels.jit import LOG2E
    from numba_flash.kernels.tc_fa2 import tc_fa2_kernel
    from numba_flash.kernels.tc_ops import tc_layout
    from numba_flash.launch import numba_launch

    rng = np.random.default_rng(5)
    B, group, D, n_max, BN = 2, 4, 32, 48, 16  # D = 32: each thread walks 2 (f16) or 4 (tf32) rows
    lens = np.array([45, 32], np.int32)  # sequence 0: two full tiles and a tail of 13 keys
    dtype = np.float16 if kind == "f16" else np.float32
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in [(B, 1, group, D), *[(B, 1, n_max, D)] * 2])
    for b, n in enumerate(lens):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    bits = [x.view(np.uint16) if kind == "f16" else x for x in (q, k, v)]
    scale = 1 / np.sqrt(D)

    def run(walk, stages, n_splits):
        o = np.full((n_splits * B, 1, group, D), np.nan, np.float32)
        lse = np.full((n_splits * B, 1, group), np.nan, np.float32)
        kernel = tc_fa2_kernel(kind, D, 16, BN, False, True, True, None, walk, stages)
        numba_launch(kernel, (B * n_splits,), 32, None,
                     [*bits, o, lse, *_unread_state(), np.float32(scale * LOG2E), np.zeros(1, np.int32), lens, np.int32(n_splits),
                      np.int32(group), np.float32(0.0), np.zeros((1, 1), np.float32)],
                     shared_mem_bytes=tc_layout(kind, D, 16, BN, stages).smem_bytes)
        return o, lse

    for n_splits in (1, 2):
        o0, l0 = run(False, 1, n_splits)
        assert not np.isnan(o0).any() and not np.isnan(l0).any()
        for walk, stages in ((True, 1), (True, 2), (False, 3)):
            o1, l1 = run(walk, stages, n_splits)
            assert np.array_equal(o0, o1) and np.array_equal(l0, l1), (walk, stages, n_splits)
        for b, n in enumerate(lens):
            o, _ = online.combine(o0[b::B, 0].astype(np.float64), l0[b::B, 0].astype(np.float64))
            s = q[b, 0].astype(np.float64) @ k[b, 0, :n].astype(np.float64).T * scale
            p = np.exp(s - s.max(axis=1, keepdims=True))
            ref = p @ v[b, 0, :n].astype(np.float64) / p.sum(axis=1, keepdims=True)
            assert rel_err(o, ref) < (2e-3 if kind == "f16" else 5e-3)


@pytest.mark.parametrize("kind, D", [("f16", 16), ("bf16", 64)])
def test_decode_key_warps_merge_to_the_one_warp_result(kind, D):
    """``key_warps``: the warps of a block split every K/V tile's keys between them, each with its
    own (m, l, O~), merged at the end of the walk (``tc_fa2.merge_key_warps``). The merge is the
    online softmax's, so the result is the one-warp kernel's up to rounding (and right against
    float64), for any split count,
    with a warp that never sees a key (sequence 1: 10 keys, all in the first warp's half of the
    one tile) and an empty sequence (2); NaN-poisoned cache tails are never read. The key-warp
    tiles are swizzled instead of padded (``tc_layout``'s ``swizzle_mask``: 1 at D = 16, 7 at
    D = 64), so this also checks the copies and ``ldmatrix`` reads of that layout."""
    from numba_flash import online
    from numba_flash.kernels.jit import LOG2E
    from numba_flash.kernels.tc_fa2 import tc_fa2_kernel
    from numba_flash.kernels.tc_ops import tc_layout
    from numba_flash.launch import numba_launch

    rng = np.random.default_rng(7)
    B, group, n_max, BN = 3, 4, 80, 32
    assert tc_layout(kind, D, 16, BN, 2, key_warps=2).swizzle_mask == min(7, D // 8 - 1)
    lens = np.array([77, 10, 0], np.int32)  # 77: two full tiles and a tail of 13 keys (warp 1 sees none of it)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in [(B, 1, group, D), *[(B, 1, n_max, D)] * 2])
    for b, n in enumerate(lens):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    if kind == "f16":
        q, k, v = (x.astype(np.float16) for x in (q, k, v))
        bits = [x.view(np.uint16) for x in (q, k, v)]
    else:  # bfloat16 bit patterns (round to nearest even), and the values they stand for
        bits = [_bf16_bits(x) for x in (q, k, v)]
        q, k, v = (_bf16_values(x) for x in bits)
    scale = 1 / np.sqrt(D)

    def run(stages, warps, n_splits):
        o = np.full((n_splits * B, 1, group, D), np.nan, np.float32)
        lse = np.full((n_splits * B, 1, group), np.nan, np.float32)
        kernel = tc_fa2_kernel(kind, D, 16, BN, False, True, True, None, None, stages, key_warps=warps)
        layout = tc_layout(kind, D, 16, BN, stages, key_warps=warps)
        numba_launch(kernel, (B * n_splits,), layout.threads, None,
                     [*bits, o, lse, *_unread_state(), np.float32(scale * LOG2E), np.zeros(1, np.int32), lens, np.int32(n_splits),
                      np.int32(group), np.float32(0.0), np.zeros((1, 1), np.float32)],
                     shared_mem_bytes=layout.smem_bytes)
        return o, lse

    for n_splits in (1, 2) if D == 16 else (2,):  # D = 64: the swizzle's other mask, one configuration
        o1, l1 = run(2, 1, n_splits)
        for stages in (2, 3) if D == 16 else (3,):
            o2, l2 = run(stages, 2, n_splits)
            assert not np.isnan(o2).any() and not np.isnan(l2).any(), (stages, n_splits)
            # P~ goes to the products in float16, rounded against each warp's own max: O differs
            # from the one-warp kernel's by float16 rounding of P~, lse only by float32 rounding
            np.testing.assert_allclose(o2, o1, rtol=0, atol=1e-3)
            np.testing.assert_allclose(l2, l1, rtol=1e-6, atol=0)  # -inf of the empty rows equal too
        for b, n in enumerate(lens):
            o, lse = online.combine(o2[b::B, 0].astype(np.float64), l2[b::B, 0].astype(np.float64))
            if n == 0:
                assert np.all(o == 0) and np.all(lse == -np.inf)
                continue
            s = q[b, 0].astype(np.float64) @ k[b, 0, :n].astype(np.float64).T * scale
            p = np.exp(s - s.max(axis=1, keepdims=True))
            ref = p @ v[b, 0, :n].astype(np.float64) / p.sum(axis=1, keepdims=True)
            assert rel_err(o, ref) < (2e-3 if kind == "f16" else 1.6e-2)


def _unread_state():
    """The o_hbm, l_hbm, m_hbm arguments a Q-outer walk never reads (``kernels.forward``)."""
    return np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32)


def _bf16_bits(x):
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even (no NaN among the valid values)
    u = np.where(np.isnan(x), 0x7FC0, u)
    return u.astype(np.uint16)


def _bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_key_warps_need_a_ring_and_whole_key_tiles():
    from numba_flash.kernels.tc_fa2 import tc_fa2_kernel

    with pytest.raises(ValueError, match="ring"):
        tc_fa2_kernel("f16", 16, 16, 32, False, True, True, None, None, 1, key_warps=2)
    with pytest.raises(ValueError, match="16 keys"):
        tc_fa2_kernel("f16", 16, 16, 16, False, True, True, None, None, 2, key_warps=2)


def test_float32_decode_at_the_gpu_default_tiles(monkeypatch):
    """float32 decode runs FA-2 on CUDA cores at its default tiles: on a GPU, 128 x 64 at 8 rows
    per thread for D <= 64 (``tile_table.forward_tiles``; the simulator's own default is 64 x 32).
    Here at those tiles: ragged and split (the kernel's ragged, split-output specialisation),
    NaN-poisoned tails, a sequence of length 0."""
    from numba_flash import plans, tile_table
    from numba_flash.specs import kernel_spec

    monkeypatch.setattr(tile_table, "simulated", lambda: False)
    kernel_spec.cache_clear()
    plans.clear()
    try:
        from numba_flash import api

        calls = []
        real_run = api.run
        monkeypatch.setattr(api, "run", lambda ctx, call, *a, **kw: (calls.append(call), real_run(ctx, call, *a, **kw)))
        rng = np.random.default_rng(11)
        B, H, Hkv, n_q, n_max, D = 2, 2, 1, 2, 80, 40  # (GQA 2:1 on one KV head: a second ran the same rows)
        q = rng.standard_normal((B, H, n_q, D)).astype(np.float32)
        k, v = (rng.standard_normal((B, Hkv, n_max, D)).astype(np.float32) for _ in range(2))
        lens = [67, 0]  # two K/V tiles of 64, the second ragged; nothing at all
        for b, n in enumerate(lens):
            k[b, :, n:] = np.nan
            v[b, :, n:] = np.nan
        o, lse = numba_flash.decode(q, k, v, cache_seqlens=np.array(lens, np.int32), causal=True, num_splits=2,
                                    return_lse=True)
        assert [(c.block_m, c.block_n, c.num_splits) for c in calls] == [(128, 64, 2)]
        check(q, k, v, lens, True, o, lse)
    finally:
        kernel_spec.cache_clear()
        plans.clear()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_appended_keys_are_written_in_place_and_attended(dtype, causal):
    """``k_new``, ``v_new`` (API.md 2e): written into the caches at each sequence's length, the
    rest of the caches untouched, the caller's lengths not advanced; the result is the
    reference's decode with the keys appended (lengths 5, 0 and 17 of 24, 3 new keys, GQA)."""
    rng = np.random.default_rng(21)
    B, H, Hkv, Nq, D, n_max, n_new = 3, 2, 1, 2, 16, 24, 3  # (GQA 2:1 on one KV head: the simulator's time)
    q = rng.standard_normal((B, H, Nq, D)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((B, Hkv, n_max, D)).astype(dtype) for _ in range(2))
    k_new, v_new = (rng.standard_normal((B, Hkv, n_new, D)).astype(dtype) for _ in range(2))
    lengths = np.array([5, 0, 17], np.int32)
    k_before, v_before, lengths_before = k_cache.copy(), v_cache.copy(), lengths.copy()
    o, lse = numba_flash.decode(q, k_cache, v_cache, cache_seqlens=lengths, k_new=k_new, v_new=v_new, causal=causal,
                                return_lse=True)
    want_o, want_lse = reference.decode(q, k_before, v_before, cache_seqlens=lengths, k_new=k_new, v_new=v_new,
                                        causal=causal)
    assert rel_err(o, want_o) <= (2e-3 if dtype == "float16" else 1e-5)  # (float16: o's own rounding is ~5e-4)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(lengths, lengths_before)
    for b, n in enumerate(lengths.tolist()):
        np.testing.assert_array_equal(k_cache[b, :, n:n + n_new], k_new[b])
        np.testing.assert_array_equal(v_cache[b, :, n:n + n_new], v_new[b])
        untouched = np.ones(n_max, bool)
        untouched[n:n + n_new] = False
        np.testing.assert_array_equal(k_cache[b, :, untouched], k_before[b, :, untouched])
        np.testing.assert_array_equal(v_cache[b, :, untouched], v_before[b, :, untouched])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(k_new="both"), ValueError, "k_new and v_new go together"),
    (dict(lengths=None), ValueError, "k_new needs cache_seqlens"),
    (dict(lengths=np.array([2, 22], np.int32)), ValueError, r"cache_seqlens\[1\] = 22 plus Nnew = 3 runs past"),
    (dict(shape=(2, 2, 3, 8)), ValueError, r"k_new must have shape \(2, 1, 3, 8\)"),
    (dict(new_dtype="float64"), TypeError, "k_new must have k_cache's dtype float32"),
    (dict(lengths=np.array([1.5, 2.0])), TypeError, "cache_seqlens must hold integers"),  # (decode's contract)
    (dict(lengths=np.array([1, 2, 3], np.int32)), ValueError, r"cache_seqlens must have shape \(2,\)"),
])
def test_appending_checks_everything_before_writing(kwargs, error, match):
    rng = np.random.default_rng(22)
    q = rng.standard_normal((2, 2, 1, 8)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((2, 1, 24, 8)).astype(np.float32) for _ in range(2))
    shape = kwargs.get("shape", (2, 1, 3, 8))
    k_new = rng.standard_normal(shape).astype(kwargs.get("new_dtype", "float32"))
    v_new = rng.standard_normal((2, 1, 3, 8)).astype(np.float32)
    lengths = kwargs.get("lengths", np.array([2, 4], np.int32))
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(error, match=match):
        numba_flash.decode(q, k_cache, v_cache, cache_seqlens=lengths, k_new=k_new,
                           v_new=None if kwargs.get("k_new") == "both" else v_new)
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])
