"""The float64 oracle for batches as they come (API.md 2d, 2e; issue 25): variable-length
packed batches (``reference.attention_varlen`` and its backward), KV caches contiguous or paged
with appended keys (``reference.decode``), and a V head dim of its own (up to 256).

Each function against an independent statement of it: varlen against a loop over the sequences
and against one attention call over the whole packed batch with a document mask (a ``mask_mod``
and, for ALiBi, a ``score_mod`` written from API.md's words); its backward against central finite
differences; the paged cache against the contiguous cache holding the same keys; appended keys
against the cache with them written in. NumPy only. Warnings are errors throughout.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import reference

pytestmark = pytest.mark.filterwarnings("error")

STEP = 1e-5  # central differences, as test_reference_backward.py
TIGHT = dict(rtol=1e-12, atol=1e-12)  # two float64 routes through the same sums


def prefix_sums(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def per_sequence(x: np.ndarray, cu: np.ndarray, b: int) -> np.ndarray:
    """Rows cu[b]:cu[b+1] of a packed (total, heads, dim) array as (1, heads, N, dim)."""
    return np.ascontiguousarray(x[cu[b] : cu[b + 1]].transpose(1, 0, 2))[None]


@st.composite
def varlen_problems(draw, max_len=5, max_batch=4):
    """A packed batch: lengths 0..max_len each (0 and 1 included), GQA, D and Dv 1..4, and
    section 2c's window, softcap and ALiBi (per head or per sequence)."""
    batch = draw(st.integers(1, max_batch))
    lengths_q = draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    lengths_k = draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 2))
    dim, v_dim = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cu_q, cu_k = prefix_sums(lengths_q), prefix_sums(lengths_k)
    q = rng.standard_normal((cu_q[-1], heads, dim))
    k = rng.standard_normal((cu_k[-1], kv_heads, dim))
    v = rng.standard_normal((cu_k[-1], kv_heads, v_dim))
    do = rng.standard_normal((cu_q[-1], heads, v_dim))
    slopes = draw(st.sampled_from([None, (heads,), (batch, heads)]))
    kwargs = dict(
        causal=draw(st.booleans()),
        window_size=draw(st.tuples(st.integers(-1, 3), st.integers(-1, 3))),
        softcap=draw(st.sampled_from([0.0, 1.5])),
        alibi_slopes=None if slopes is None else rng.uniform(0.1, 1.0, slopes),
        scale=draw(st.sampled_from([None, 0.7])),
    )
    return do, q, k, v, cu_q, cu_k, kwargs


def sequence_kwargs(kwargs, b):
    """``kwargs`` of sequence ``b`` alone: its row of (B, H) ALiBi slopes."""
    slopes = kwargs["alibi_slopes"]
    return {**kwargs, "alibi_slopes": slopes[b]} if slopes is not None and slopes.ndim == 2 else kwargs


# --------------------------------------------------------------------------- varlen forward


@given(varlen_problems())
@settings(max_examples=examples(40))
def test_varlen_is_attention_on_each_sequence(problem):
    _, q, k, v, cu_q, cu_k, kwargs = problem
    o, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, 5, 5, **kwargs)
    assert o.shape == q.shape[:2] + v.shape[2:] and lse.shape == (q.shape[1], q.shape[0])
    for b in range(len(cu_q) - 1):
        seq = [per_sequence(x, c, b) for x, c in ((q, cu_q), (k, cu_k), (v, cu_k))]
        want_o, want_lse = reference.attention(*seq, **sequence_kwargs(kwargs, b))
        np.testing.assert_allclose(o[cu_q[b] : cu_q[b + 1]], want_o[0].transpose(1, 0, 2), **TIGHT)
        np.testing.assert_allclose(lse[:, cu_q[b] : cu_q[b + 1]], want_lse[0], **TIGHT)


def document_mask(cu_q, cu_k, window_size, causal):
    """A mask_mod over the whole packed batch that is section 2d in API.md's words: query row
    ``i`` sees key row ``j`` iff both are of one sequence and, in that sequence's own positions
    and bottom-right offset, inside 2c's window (causal: ``right = 0``)."""
    left, right = window_size
    if causal:
        right = 0 if right == -1 else min(right, 0)
    lengths_q, lengths_k = np.diff(cu_q), np.diff(cu_k)
    doc_q = np.repeat(np.arange(len(lengths_q)), lengths_q)
    doc_k = np.repeat(np.arange(len(lengths_k)), lengths_k)
    local_q = np.arange(cu_q[-1]) - cu_q[doc_q]
    local_k = np.arange(cu_k[-1]) - cu_k[doc_k]
    diagonal = local_q + (lengths_k - lengths_q)[doc_q]  # bottom-right in each sequence

    def mask_mod(b, h, i, j):
        seen = doc_q[i] == doc_k[j]
        if right != -1:
            seen = seen & (local_k[j] <= diagonal[i] + right)
        if left != -1:
            seen = seen & (diagonal[i] - left <= local_k[j])
        return seen

    def alibi(slopes):  # a score_mod: - slope |i + (Nk - Nq) - j| in the sequence's positions
        table = np.broadcast_to(slopes.reshape(-1, slopes.shape[-1]), (len(lengths_q), slopes.shape[-1]))

        def score_mod(score, b, h, i, j):
            return score - table[doc_q[i], h] * np.abs(diagonal[i] - local_k[j])

        return score_mod

    return mask_mod, alibi


@given(varlen_problems())
@settings(max_examples=examples(40))
def test_varlen_is_one_attention_over_the_packed_batch_with_a_document_mask(problem):
    _, q, k, v, cu_q, cu_k, kwargs = problem
    o, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, 5, 5, **kwargs)
    mask_mod, alibi = document_mask(cu_q, cu_k, kwargs["window_size"], kwargs["causal"])
    score_mod = None if kwargs["alibi_slopes"] is None else alibi(kwargs["alibi_slopes"])
    whole = [x.transpose(1, 0, 2)[None] for x in (q, k, v)]
    want_o, want_lse = reference.attention(*whole, scale=kwargs["scale"], softcap=kwargs["softcap"],
                                           mask_mod=mask_mod, score_mod=score_mod)
    np.testing.assert_allclose(o, want_o[0].transpose(1, 0, 2), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse[0], rtol=1e-10, atol=1e-12)


def test_varlen_lengths_zero_and_one():
    """A sequence without keys gives o = 0, lse = -inf; one key gives o = v exactly;
    a sequence without queries adds no row."""
    rng = np.random.default_rng(1)
    cu_q, cu_k = prefix_sums([2, 0, 1, 1]), prefix_sums([0, 3, 1, 2])
    q, k, v = rng.standard_normal((4, 2, 3)), rng.standard_normal((6, 1, 3)), rng.standard_normal((6, 1, 2))
    o, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, 2, 3, causal=True)
    assert np.all(o[:2] == 0) and np.all(lse[:, :2] == -np.inf)
    np.testing.assert_array_equal(o[2], np.broadcast_to(v[3], (2, 2)))  # its one key
    # the last sequence: one query, two keys, causal offset 1: it sees both
    assert np.all(np.isfinite(lse[:, 3])) and not np.allclose(o[3], v[4]) and not np.allclose(o[3], v[5])


# --------------------------------------------------------------------------- varlen backward


@given(varlen_problems(max_len=4, max_batch=3))
@settings(max_examples=examples(25))
def test_varlen_backward_is_attention_backward_on_each_sequence(problem):
    do, q, k, v, cu_q, cu_k, kwargs = problem
    o, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, 4, 4, **kwargs)
    dq, dk, dv = reference.attention_backward_varlen(do, q, k, v, o, lse, cu_q, cu_k, 4, 4, **kwargs)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for b in range(len(cu_q) - 1):
        seq = [per_sequence(x, c, b) for x, c in ((do, cu_q), (q, cu_q), (k, cu_k), (v, cu_k))]
        want = reference.attention_backward(*seq, **sequence_kwargs(kwargs, b))
        for got, w, cu in zip((dq, dk, dv), want, (cu_q, cu_k, cu_k)):
            np.testing.assert_allclose(got[cu[b] : cu[b + 1]], w[0].transpose(1, 0, 2), **TIGHT)


@pytest.mark.parametrize(
    "kwargs",
    [dict(causal=True), dict(window_size=(1, 0), softcap=2.0, alibi_slopes=np.array([[0.3, 0.5], [0.2, 0.9], [0.4, 0.1]]))],
)
def test_varlen_backward_matches_finite_differences(kwargs):
    """Every entry of q, k and v, Dv != D, lengths 2/3, 0/1 and 1/0 (GQA, two heads on one)."""
    rng = np.random.default_rng(7)
    cu_q, cu_k = prefix_sums([2, 0, 1]), prefix_sums([3, 1, 0])
    q, k, v = rng.standard_normal((3, 2, 2)), rng.standard_normal((4, 1, 2)), rng.standard_normal((4, 1, 3))
    do = rng.standard_normal((3, 2, 3))
    o, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, 2, 3, **kwargs)
    grads = reference.attention_backward_varlen(do, q, k, v, o, lse, cu_q, cu_k, 2, 3, **kwargs)

    def loss(*qkv):
        return float(np.sum(do * reference.attention_varlen(*qkv, cu_q, cu_k, 2, 3, **kwargs)[0]))

    for which, grad in enumerate(grads):
        numeric = np.zeros_like(grad)
        for idx in itertools.product(*map(range, grad.shape)):
            plus, minus = [x.copy() for x in (q, k, v)], [x.copy() for x in (q, k, v)]
            plus[which][idx] += STEP
            minus[which][idx] -= STEP
            numeric[idx] = (loss(*plus) - loss(*minus)) / (2 * STEP)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)
    assert np.any(grads[1] != 0) and np.all(grads[0][2] == 0)  # k is reached; the keyless row gets 0


# --------------------------------------------------------------------------- decode


def cache_problem(rng, batch, heads, kv_heads, n_q, n_max, dim, v_dim):
    q = rng.standard_normal((batch, heads, n_q, dim))
    k = rng.standard_normal((batch, kv_heads, n_max, dim))
    v = rng.standard_normal((batch, kv_heads, n_max, v_dim))
    return q, k, v


def paged(cache: np.ndarray, lengths, page_size: int, seed: int, reserve=None, spare: int = 3):
    """The first ``lengths[b]`` keys of the contiguous ``cache`` (B, Hkv, Nmax, D) in pages
    (num_blocks, page_size, Hkv, D) at a permutation of the page indices drawn from ``seed``,
    with ``spare`` pages nobody uses, and its block table. Every other row is NaN (a read of one
    would show); the table's entries past the pages of ``reserve[b]`` keys (default
    ``lengths``) are -1."""
    rng = np.random.default_rng(seed)
    reserve = lengths if reserve is None else reserve
    batch, kv_heads, n_max, dim = cache.shape
    max_blocks = n_max // page_size
    num_blocks = batch * max_blocks + spare
    table = rng.permutation(num_blocks)[: batch * max_blocks].reshape(batch, max_blocks).astype(np.int32)
    pages = np.full((num_blocks, page_size, kv_heads, dim), np.nan)
    for b in range(batch):
        rows = cache[b].transpose(1, 0, 2)  # (Nmax, Hkv, D)
        for j in range(lengths[b]):
            pages[table[b, j // page_size], j % page_size] = rows[j]
        table[b, -(-reserve[b] // page_size) :] = -1
    return pages, table


@given(st.integers(0, 2**32 - 1), st.booleans(), st.integers(1, 3), st.integers(1, 2))
@settings(max_examples=examples(20))
def test_decode_is_attention_on_each_sequences_valid_keys(seed, causal, n_q, group):
    """Contiguous: numba_flash.decode's semantics (lengths clamped to [0, Nmax], keys past them
    never read, causal aligned to each length), against attention on the valid keys."""
    rng = np.random.default_rng(seed)
    q, k, v = cache_problem(rng, 4, 2 * group, 2, n_q, 7, 3, 2)
    lengths = np.array([0, 1, 7, rng.integers(2, 7)], dtype=np.int32)
    k[..., 7:, :] = np.nan
    poisoned_k, poisoned_v = k.copy(), v.copy()
    for b, n in enumerate(lengths):
        poisoned_k[b, :, n:] = np.nan
        poisoned_v[b, :, n:] = np.nan
    o, lse = reference.decode(q, poisoned_k, poisoned_v, cache_seqlens=lengths, causal=causal)
    for b, n in enumerate(lengths):
        want_o, want_lse = reference.attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], causal=causal)
        np.testing.assert_allclose(o[b], want_o[0], **TIGHT)
        np.testing.assert_allclose(lse[b], want_lse[0], **TIGHT)
    clamped = reference.decode(q, k, v, cache_seqlens=np.array([-3, 1, 99, lengths[3]]), causal=causal)
    np.testing.assert_array_equal(clamped[1], reference.decode(q, k, v, cache_seqlens=[0, 1, 7, lengths[3]],
                                                               causal=causal)[1])
    np.testing.assert_array_equal(reference.decode(q, k, v, causal=causal)[0],
                                  reference.attention(q, k, v, causal=causal)[0])


@pytest.mark.parametrize("page_size", [16, 64])
@given(seed=st.integers(0, 2**32 - 1), causal=st.booleans(), n_q=st.integers(1, 3))
@settings(max_examples=examples(8))
def test_paged_decode_is_the_contiguous_decode(page_size, seed, causal, n_q):
    rng = np.random.default_rng(seed)
    n_max = 3 * page_size
    q, k, v = cache_problem(rng, 3, 4, 2, n_q, n_max, 5, 3)
    lengths = np.array([rng.integers(0, n_max + 1), n_max, rng.integers(1, page_size + 1)], dtype=np.int32)
    (k_pages, table), (v_pages, v_table) = (paged(c, lengths, page_size, seed) for c in (k, v))
    np.testing.assert_array_equal(table, v_table)  # the same permutation
    o, lse = reference.decode(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table, causal=causal)
    want_o, want_lse = reference.decode(q, k, v, cache_seqlens=lengths, causal=causal)
    np.testing.assert_allclose(o, want_o, **TIGHT)
    np.testing.assert_allclose(lse, want_lse, **TIGHT)
    assert np.all(np.isfinite(o))


def write_in(cache, lengths, new):
    """The contiguous cache with ``new`` (B, Hkv, Nnew, D) written at each ``lengths[b]``."""
    out = cache.copy()
    for b, n in enumerate(lengths):
        out[b, :, n : n + new.shape[2]] = new[b]
    return out


@pytest.mark.parametrize("page_size", [None, 16])
@given(seed=st.integers(0, 2**32 - 1), causal=st.booleans(), n_new=st.integers(0, 3))
@settings(max_examples=examples(10))
def test_appended_keys_are_a_decode_on_the_cache_with_them_written_in(page_size, seed, causal, n_new):
    rng = np.random.default_rng(seed)
    n_max = 32
    q, k, v = cache_problem(rng, 3, 2, 1, 2, n_max, 4, 6)
    k_new, v_new = rng.standard_normal((3, 1, n_new, 4)), rng.standard_normal((3, 1, n_new, 6))
    lengths = np.array([0, rng.integers(0, n_max - n_new + 1), n_max - n_new], dtype=np.int32)
    want_o, want_lse = reference.decode(q, write_in(k, lengths, k_new), write_in(v, lengths, v_new),
                                        cache_seqlens=lengths + n_new, causal=causal)
    if page_size is None:
        caches, table = (k, v), None
    else:
        (k_pages, table), (v_pages, _) = (paged(c, lengths, page_size, seed, lengths + n_new) for c in (k, v))
        caches = (k_pages, v_pages)  # the rows k_new goes to are NaN before the append
    inputs = (q, *caches, lengths, k_new, v_new)
    copies = [x.copy() for x in inputs]
    o, lse = reference.decode(q, *caches, cache_seqlens=lengths, block_table=table, k_new=k_new, v_new=v_new,
                              causal=causal)
    np.testing.assert_allclose(o, want_o, **TIGHT)
    np.testing.assert_allclose(lse, want_lse, **TIGHT)
    for x, c in zip(inputs, copies):  # the oracle writes nothing (the kernel writes k_new in place)
        np.testing.assert_array_equal(x, c)


# --------------------------------------------------------------------------- head dims


@pytest.mark.parametrize("dim, v_dim", [(256, 192), (192, 128), (3, 256), (256, 256)])
def test_v_has_its_own_head_dim_up_to_256(dim, v_dim):
    """Against softmax(scale q k^T) v written out; and o, dq, dk, dv split over v's columns
    (o of [v1 v2] is [o(v1) o(v2)]; the gradients of a sum of losses add)."""
    rng = np.random.default_rng(dim + v_dim)
    q, k, v = cache_problem(rng, 1, 2, 1, 3, 5, dim, v_dim)
    do = rng.standard_normal((1, 2, 3, v_dim))
    o, lse = reference.attention(q, k, v, causal=True)
    s = np.einsum("bhid,bhjd->bhij", q, np.broadcast_to(k, (1, 2, 5, dim))) / np.sqrt(dim)
    s = np.where(np.arange(5)[None, :] <= np.arange(3)[:, None] + 2, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(o, (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-12)
    cut = v_dim // 2
    halves = [reference.attention(q, k, part, causal=True)[0] for part in (v[..., :cut], v[..., cut:])]
    np.testing.assert_allclose(o, np.concatenate(halves, axis=-1), **TIGHT)
    dq, dk, dv = reference.attention_backward(do, q, k, v, causal=True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    parts = [reference.attention_backward(do[..., s], q, k, v[..., s], causal=True)
             for s in (slice(None, cut), slice(cut, None))]
    np.testing.assert_allclose(dq, parts[0][0] + parts[1][0], **TIGHT)
    np.testing.assert_allclose(dk, parts[0][1] + parts[1][1], **TIGHT)
    np.testing.assert_allclose(dv, np.concatenate([parts[0][2], parts[1][2]], axis=-1), **TIGHT)


# --------------------------------------------------------------------------- errors

RNG = np.random.default_rng(3)
VQ, VK, VV = RNG.standard_normal((4, 2, 3)), RNG.standard_normal((5, 1, 3)), RNG.standard_normal((5, 1, 2))
CU_Q, CU_K = np.array([0, 1, 4], np.int32), np.array([0, 5, 5], np.int32)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((VQ[None], VK, VV, CU_Q, CU_K, 3, 5), ValueError, "q must be 3-D"),
        ((VQ, VK[..., :2], VV, CU_Q, CU_K, 3, 5), ValueError, "k must have q's head_dim"),
        ((VQ, VK, VV[:4], CU_Q, CU_K, 3, 5), ValueError, "v must have k's total_k"),
        ((VQ[:, :1], np.concatenate([VK, VK], 1), VV, CU_Q, CU_K, 3, 5), ValueError, "v must have k's 2 kv heads"),
        ((VQ, VK, VV, CU_Q[1:], CU_K, 3, 5), ValueError, "cu_seqlens_q must start at 0"),
        ((VQ, VK, VV, CU_Q, np.array([0, 5, 4, 5]), 3, 5), ValueError, "cu_seqlens_k must start at 0, never decrease"),
        ((VQ, VK, VV, CU_Q, np.array([0, 4], np.int32), 3, 5), ValueError, "end at k's total_k = 5"),
        ((VQ, VK, VV, CU_Q, np.array([0, 0, 5, 5]), 3, 5), ValueError, "cu_seqlens_k must have cu_seqlens_q's length"),
        ((VQ, VK, VV, CU_Q.astype(float), CU_K, 3, 5), TypeError, "cu_seqlens_q must hold integers"),
        ((VQ, VK, VV, CU_Q[None], CU_K, 3, 5), ValueError, "cu_seqlens_q must be 1-D"),
        ((VQ, VK, VV, CU_Q, CU_K, 2, 5), ValueError, "max_seqlen_q = 2 is below the longest"),
        ((VQ, VK, VV, CU_Q, CU_K, 3, 4), ValueError, "max_seqlen_k = 4 is below the longest"),
        ((VQ, VK, VV, CU_Q, CU_K, True, 5), TypeError, "max_seqlen_q must be an int"),
        ((VQ, VK, VV, CU_Q, CU_K, 3.0, 5), TypeError, "max_seqlen_q must be an int"),
    ],
)
def test_varlen_errors_name_the_argument(args, error, match):
    with pytest.raises(error, match=match):
        reference.attention_varlen(*args)


def test_varlen_accepts_larger_maxima_and_checks_its_masks_once():
    o, _ = reference.attention_varlen(VQ, VK, VV, CU_Q, CU_K, 9, 9)
    np.testing.assert_array_equal(o, reference.attention_varlen(VQ, VK, VV, CU_Q, CU_K, 3, 5)[0])
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        reference.attention_varlen(VQ, VK, VV, CU_Q, CU_K, 3, 5, alibi_slopes=np.ones(3))
    with pytest.raises(ValueError, match="window"):  # checked even for an empty batch
        reference.attention_varlen(VQ[:0], VK[:0], VV[:0], [0], [0], 0, 0, window_size=(-2, 0))


def test_varlen_backward_checks_do_o_and_lse():
    o, lse = reference.attention_varlen(VQ, VK, VV, CU_Q, CU_K, 3, 5)
    for bad, name in ((dict(do=o[:, :, :1]), "do"), (dict(o=o[:3]), "o"), (dict(lse=lse.T), "lse")):
        args = {"do": o, "o": o, "lse": lse, **bad}
        with pytest.raises(ValueError, match=f"{name} must have shape"):
            reference.attention_backward_varlen(args["do"], VQ, VK, VV, args["o"], args["lse"], CU_Q, CU_K, 3, 5)


DQ, DK, DV = RNG.standard_normal((2, 2, 1, 4)), RNG.standard_normal((2, 1, 32, 4)), RNG.standard_normal((2, 1, 32, 3))
PAGES_K, PAGES_V = RNG.standard_normal((5, 16, 1, 4)), RNG.standard_normal((5, 16, 1, 3))
NEW_K, NEW_V = RNG.standard_normal((2, 1, 2, 4)), RNG.standard_normal((2, 1, 2, 3))


@pytest.mark.parametrize(
    "caches, kwargs, error, match",
    [
        ((DK, DV), dict(k_new=NEW_K), ValueError, "v_new is missing"),
        ((DK, DV), dict(k_new=NEW_K, v_new=NEW_V[..., :1, :]), ValueError, "v_new must have k_new's Nnew"),
        ((DK, DV), dict(k_new=NEW_K[..., :3], v_new=NEW_V), ValueError, "k_new must have shape"),
        ((DK, DV), dict(k_new=NEW_K, v_new=NEW_V), ValueError, r"past k_cache's Nmax = 32 \(cache_seqlens=None"),
        ((DK, DV), dict(cache_seqlens=[3, 31], k_new=NEW_K, v_new=NEW_V), ValueError, r"cache_seqlens\[1\] \+ Nnew"),
        ((DK, DV), dict(cache_seqlens=[3]), ValueError, r"cache_seqlens must have shape \(2,\)"),
        ((DK, DV), dict(cache_seqlens=[3.0, 1.0]), TypeError, "cache_seqlens must hold integers"),
        ((DK, DV[:, :, :4]), {}, ValueError, "v_cache must have the shape of k_cache"),
        ((DK[..., :3], DV), {}, ValueError, "k_cache must have q's head_dim"),
        ((DK[:1], DV[:1]), {}, ValueError, "k_cache must have q's batch size"),
        ((PAGES_K, PAGES_V), dict(block_table=[[0, 1]]), ValueError, "block_table must have shape"),
        ((PAGES_K, PAGES_V), dict(block_table=[[0, 5], [1, 2]]), ValueError, r"block_table\[0, 1\] = 5 is not a page"),
        ((PAGES_K, PAGES_V), dict(block_table=[[0, 4], [-1, 2]], cache_seqlens=[20, 3]), ValueError,
         r"block_table\[1, 0\] = -1 is not a page"),
        ((PAGES_K, PAGES_V), dict(block_table=[[0, 1], [2, 3]], cache_seqlens=[20, 33]), ValueError,
         r"past block_table's max_blocks \* page_size = 32"),
        ((PAGES_K, PAGES_V), dict(block_table=[[0, 1.5], [2, 3]]), TypeError, "block_table must hold integers"),
        # sequence 1 appends into page 0 rows 5, 6, which sequence 0 reads
        ((PAGES_K, PAGES_V), dict(block_table=[[0, 1], [0, 3]], cache_seqlens=[20, 5], k_new=NEW_K, v_new=NEW_V),
         ValueError, "block_table: an appended key"),
    ],
)
def test_decode_errors_name_the_argument(caches, kwargs, error, match):
    with pytest.raises(error, match=match):
        reference.decode(DQ, *caches, **kwargs)


def test_decode_pages_may_be_shared_for_reading_and_unused_entries_are_not_read():
    """Two sequences reading one page (a shared prefix) is no conflict; entries past a
    sequence's pages are never checked."""
    table = np.array([[0, 1], [0, -7]], np.int32)
    o, _ = reference.decode(DQ, PAGES_K, PAGES_V, block_table=table, cache_seqlens=[20, 16])
    want, _ = reference.decode(DQ, PAGES_K[[0, 1]].reshape(1, 32, 1, 4).transpose(0, 2, 1, 3).repeat(2, 0),
                               PAGES_V[[0, 1]].reshape(1, 32, 1, 3).transpose(0, 2, 1, 3).repeat(2, 0),
                               cache_seqlens=[20, 16])
    np.testing.assert_allclose(o, want, **TIGHT)
