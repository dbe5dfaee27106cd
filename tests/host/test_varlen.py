"""Packed batches of sequences of their own lengths (API.md 2d, issue 25): ``attention_varlen``
and ``attention_backward_varlen``.

Against the float64 oracle (``reference.attention_varlen``: one call per sequence), with lengths
0 and 1, lengths that are not multiples of a tile, GQA, causal and windows aligned per sequence,
ALiBi per sequence and softcap; a Hypothesis property that a packed batch gives, bit for bit,
what ``attention`` gives on each sequence alone; and the errors. In the simulator (small tiles).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import examples, gradient_error, plain_fp16_attention
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash import reference

LENS_Q = [5, 0, 1, 20, 9]  # an empty sequence, a one-row one, tails of tiles of 16
LENS_K = [7, 3, 0, 20, 33]  # a sequence with queries and no keys (o = 0, lse = -inf)
H, HKV, D = 2, 1, 16


def prefix_sums(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed(rng, lens_q, lens_k, dtype, heads=H, kv_heads=HKV, dim=D):
    """Fresh normal q (total_q, heads, dim), k, v (total_k, kv_heads, dim) and the prefix sums."""
    cu_q, cu_k = prefix_sums(lens_q), prefix_sums(lens_k)
    q = rng.standard_normal((cu_q[-1], heads, dim)).astype(dtype)
    k, v = (rng.standard_normal((cu_k[-1], kv_heads, dim)).astype(dtype) for _ in range(2))
    return q, k, v, cu_q, cu_k


def one_sequence(x, cu, b):
    """Rows cu[b]:cu[b+1] of a packed array as (1, heads, N, dim)."""
    return np.ascontiguousarray(x[cu[b] : cu[b + 1]].transpose(1, 0, 2))[None]


MODS = dict(window_size=(6, 2), softcap=3.0, alibi=True)  # (alibi: (B, H) slopes, a row per sequence)


@pytest.mark.parametrize("algorithm, dtype, mods", [
    ("fa1", "float32", dict(causal=True)),  # (CUDA cores: the simulator's slowest, one case each)
    ("fa2", "float32", MODS),
    ("fa1", "float16", MODS),  # (tensor cores)
    ("fa2", "float16", dict(MODS, causal=True)),
])
def test_matches_the_reference(algorithm, dtype, mods, rng):
    """Causal, windows, softcap and ALiBi per sequence; float16 within 3e-3 (inputs of scale 1:
    its rounding), float32 within float32's."""
    # (CUDA cores in the simulator: one Q tile per sequence, the simulator's time)
    lens_q, lens_k = (LENS_Q, LENS_K) if dtype == "float16" else ([5, 0, 1, 9], [7, 3, 0, 33])
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k, dtype)
    mods = dict(mods)
    if mods.pop("alibi", False):
        mods["alibi_slopes"] = rng.uniform(0.1, 1.0, (len(lens_q), H)).astype(np.float32)
    o, lse = numba_flash.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), algorithm=algorithm,
                                          precision="ieee" if dtype == "float32" else None, return_lse=True, **mods)
    ref_o, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **mods)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (H, len(q))
    np.testing.assert_allclose(o, ref_o, atol=2e-6 if dtype == "float32" else 3e-3, rtol=1e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))  # (the sequence with no keys)
    seen = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], atol=1e-5, rtol=1e-5)
    assert np.all(o[np.isneginf(ref_lse).T] == 0)


@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
def test_float16_within_twice_a_plain_implementation(algorithm, rng):
    """FlashAttention's rule per sequence, on tensor cores, causal with GQA."""
    q, k, v, cu_q, cu_k = packed(rng, LENS_Q, LENS_K, np.float16, heads=4, kv_heads=2)
    o = numba_flash.attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=True, algorithm=algorithm)
    ref_o, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=True)
    assert o.dtype == np.float16
    for b in range(len(LENS_Q)):
        rows = slice(cu_q[b], cu_q[b + 1])
        if not LENS_Q[b]:
            continue
        if not LENS_K[b]:
            assert np.all(o[rows] == 0)
            continue
        plain = plain_fp16_attention(one_sequence(q, cu_q, b), one_sequence(k, cu_k, b), one_sequence(v, cu_k, b),
                                     causal=True)[0].transpose(1, 0, 2)
        base = np.abs(plain.astype(np.float64) - ref_o[rows]).max()
        err = np.abs(o[rows].astype(np.float64) - ref_o[rows]).max()
        assert err <= 2 * base + 1e-6, (b, err, base)


@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 24)), min_size=1, max_size=3),
       causal=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_a_packed_batch_is_its_sequences_one_by_one(lens, causal, seed):
    """The varlen kernel on a packed batch is ``attention`` on each sequence alone, bit for bit
    (same tiles, same walk: the sequence's rows cut out of the packed arrays)."""
    rng = np.random.default_rng(seed)
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k, np.float16)
    o, lse = numba_flash.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                          return_lse=True)
    for b in range(len(lens)):
        if not lens_q[b]:
            continue
        o_b, lse_b = numba_flash.attention(one_sequence(q, cu_q, b), one_sequence(k, cu_k, b),
                                           one_sequence(v, cu_k, b), causal=causal, return_lse=True)
        np.testing.assert_array_equal(o[cu_q[b] : cu_q[b + 1]], o_b[0].transpose(1, 0, 2))
        np.testing.assert_array_equal(lse[:, cu_q[b] : cu_q[b + 1]], lse_b[0])


def test_errors_name_the_argument(rng):
    q, k, v, cu_q, cu_k = packed(rng, [3, 4], [5, 2], np.float32)
    call = numba_flash.attention_varlen
    with pytest.raises(ValueError, match="q must be 3-D"):
        call(q[None], k, v, cu_q, cu_k, 4, 5)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        call(q, k, v, cu_q + 1, cu_k, 4, 5)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0, never decrease and end at k's total_k"):
        call(q, k, v, cu_q, np.array([0, 8, 7], np.int32), 4, 8)
    with pytest.raises(ValueError, match="max_seqlen_k = 4 is below the longest sequence"):
        call(q, k, v, cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_k must have cu_seqlens_q's length"):
        call(q, k[:5], v[:5], cu_q, np.array([0, 5], np.int32), 4, 5)
    with pytest.raises(TypeError, match="cu_seqlens_q must hold integers"):
        call(q, k, v, cu_q.astype(np.float32), cu_k, 4, 5)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        call(q, k, v, cu_q, cu_k, 4, 5, alibi_slopes=np.ones((3, H), np.float32))
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        call(q, k, v, cu_q, cu_k, 4, 5, return_lse=1)
    with pytest.raises(ValueError, match=r"q's heads \(2\) must be a positive multiple of k's and v's heads \(0\)"):
        call(q, k[:, :0], v[:, :0], cu_q, cu_k, 4, 5)
    with pytest.raises(ValueError, match=r"k and v must have the same shape .* got k \(7, 1, 16\) and v \(6, 1, 16\)"):
        call(q, k, v[:6], cu_q, cu_k, 4, 5)


def test_nothing_to_attend(rng):
    """No queries: empty results; queries without keys anywhere: o = 0, lse = -inf."""
    q, k, v, cu_q, cu_k = packed(rng, [0, 0], [3, 1], np.float32)
    o, lse = numba_flash.attention_varlen(q, k, v, cu_q, cu_k, 0, 3, return_lse=True)
    assert o.shape == (0, H, D) and lse.shape == (H, 0)
    q, k, v, cu_q, cu_k = packed(rng, [2, 3], [0, 0], np.float32)
    o, lse = numba_flash.attention_varlen(q, k, v, cu_q, cu_k, 3, 0, return_lse=True)
    assert np.all(o == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("algorithm, deterministic, dtype, mods", [
    ("fa2", False, "float16", dict(causal=True)),
    ("fa2", True, "float16", dict(MODS)),
    ("fa1", False, "float16", dict(causal=True, alibi=True)),
    ("fa2", True, "float32", dict(causal=True)),  # (CUDA cores)
])
def test_backward_matches_the_reference(algorithm, deterministic, dtype, mods, rng):
    """dq, dk, dv of every sequence against the float64 oracle (test_backward_tc's bounds for
    float16; float32's on CUDA cores), GQA, lengths 0 and 1 and a sequence without keys (zero
    gradients there); packed, C-contiguous results of the inputs' shapes and dtypes."""
    mods = dict(mods)  # (the parametrised dict is shared between runs)
    lens_q, lens_k = (LENS_Q, LENS_K) if dtype == "float16" else ([5, 0, 1, 9], [7, 3, 0, 33])
    # GQA 2:1; two KV heads on the default FA-2 case only (the others on one: the simulator's time)
    heads = 4 if (algorithm, deterministic, dtype) == ("fa2", False, "float16") else 2
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k, dtype, heads=heads, kv_heads=heads // 2)
    if mods.pop("alibi", False):
        mods["alibi_slopes"] = rng.uniform(0.1, 1.0, (heads,)).astype(np.float32)  # (H,): every sequence's
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    precision = "ieee" if dtype == "float32" else None
    o, lse = numba_flash.attention_varlen(q, k, v, *args, algorithm=algorithm, precision=precision, return_lse=True,
                                          **mods)
    do = rng.standard_normal(o.shape).astype(dtype)
    grads = numba_flash.attention_backward_varlen(do, q, k, v, o, lse, *args, algorithm=algorithm,
                                                  deterministic=deterministic, precision=precision, **mods)
    refs = reference.attention_backward_varlen(*(x.astype(np.float64) for x in (do, q, k, v, o)), lse, *args, **mods)
    for name, got, ref, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype and got.flags.c_contiguous, name
        err = gradient_error(got, ref, refs)
        assert err < (1e-4 if dtype == "float32" else 5e-3), (name, err)
    no_keys = slice(cu_q[2], cu_q[3])  # (the third sequence has queries and no keys)
    assert np.all(grads[0][no_keys] == 0)


@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
def test_more_queries_than_keys_align_per_sequence(algorithm, rng):
    """Causal with a window where sequences have more queries than keys and the other way round
    (bottom-right alignment per sequence: rows above a sequence's first diagonal see nothing), in
    float16 on tensor cores; and the default float32 regime (tf32x3)."""
    lens_q, lens_k = [11, 3, 6], [4, 6, 6]
    for dtype, tol in (("float16", 3e-3), ("float32", 1e-5)):
        q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k, dtype)
        mods = dict(causal=True, window_size=(3, -1))
        o, lse = numba_flash.attention_varlen(q, k, v, cu_q, cu_k, 11, 6, algorithm=algorithm, return_lse=True, **mods)
        ref_o, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, 11, 6, **mods)
        np.testing.assert_allclose(o, ref_o, atol=tol, rtol=1e-5)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        assert np.isneginf(ref_lse[:, :7]).all() and np.all(o[:7] == 0)  # (the first sequence's rows above the diagonal)


def test_a_batch_must_match_its_arrays(rng):
    """A PackedBatch made for other rows is refused before any launch; CPU prefix sums of another
    library are read as host ones; the backward checks in the packed layout's words."""
    from numba_flash.arrays import ArrayContext
    from numba_flash.varlen import packed_batch

    q, k, v, cu_q, cu_k = packed(rng, [3, 4], [5, 2], np.float32)
    other = packed_batch(ArrayContext("numpy", q), [0, 3, 9], [0, 4, 6], 6, 4, 9, 6)
    with pytest.raises(ValueError, match="batch was made for total_q = 9, total_k = 6; the arrays have 7 and 7"):
        numba_flash.attention_varlen(q, k, v, cu_q, cu_k, 4, 5, batch=other)
    o, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, 4, 5)
    o, lse = o.astype(np.float32), lse.astype(np.float32)
    with pytest.raises(ValueError, match=r"do must have q's shape \(7, 2, 16\); got \(6, 2, 16\)"):
        numba_flash.attention_backward_varlen(o[:6], q, k, v, o, lse, cu_q, cu_k, 4, 5)
    with pytest.raises(ValueError, match=r"lse must have shape \(H, total_q\) = \(2, 7\)"):
        numba_flash.attention_backward_varlen(o, q, k, v, o, lse.T, cu_q, cu_k, 4, 5)
    with pytest.raises(ValueError, match=r"got k \(7, 1, 16\) and v \(6, 1, 16\)"):
        numba_flash.attention_backward_varlen(o, q, k, v[:6], o, lse, cu_q, cu_k, 4, 5)
    with pytest.raises(ValueError, match="batch was made for"):
        numba_flash.attention_backward_varlen(o, q, k, v, o, lse, cu_q, cu_k, 4, 5, batch=other)


def test_backward_with_nothing_to_attend(rng):
    """No queries anywhere: empty dq, zero dk and dv; no keys anywhere: zero gradients."""
    for lens_q, lens_k in (([0, 0], [3, 1]), ([2, 3], [0, 0])):
        q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k, np.float32)
        o, lse = numba_flash.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True)
        grads = numba_flash.attention_backward_varlen(np.ones_like(o), q, k, v, o, lse, cu_q, cu_k, max(lens_q),
                                                      max(lens_k))
        for g, x in zip(grads, (q, k, v)):
            assert g.shape == x.shape and np.all(g == 0)
