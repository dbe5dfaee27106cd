"""Block-sparse walks (issue 24, API.md 2c ``block_mask``): with a ``mask_mod`` the forward visits
only the tiles its block mask lists, and evaluates ``mask_mod`` only on the partial ones.

Each test can tell a walk that skips from one that does not: NaN in the keys and values of
hidden tiles (a walk that loaded them would spread the NaN: P~ = 0 times NaN), a block mask that
calls a tile full where ``mask_mod`` hides entries (a walk that still evaluated the mod would hide
them), a mask whose arrays change between calls (a stale derived mask gives the old answer).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import examples, random_qkv, run_poisoned, to_numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash import api, reference
from numba_flash._world import simulated
from numba_flash.block_sparse import retile, walk_lists
from numba_flash.masking import MaskSpec
from numba_flash.tile_visibility import FULL, HIDDEN, PARTIAL, BlockMask

N_Q, N_K = 40, 72


def same_document(b, h, q_idx, kv_idx, q_doc, kv_doc):
    return q_doc[q_idx] == kv_doc[kv_idx]


def other_documents(b, h, q_idx, kv_idx, q_doc, kv_doc):
    return q_doc[q_idx] != kv_doc[kv_idx]


def _documents(n_q=N_Q, n_k=N_K):
    """Sequence ids of three documents over the keys (their bounds at 27 and 51: inside tiles of
    8 and 16), the queries the last keys'."""
    kv_doc = np.searchsorted([27, 51], np.arange(n_k), side="right").astype(np.int32)
    return kv_doc[n_k - n_q:].copy(), kv_doc


def _nan_in_hidden_tiles(k, v, q_doc, kv_doc, block_m, block_n, xp):
    """k, v with NaN in every key of every K/V tile that ``same_document`` hides from all Q tiles'
    rows (the keys no walk may read): how many such keys there are, and the new k, v."""
    bm = numba_flash.block_mask(same_document, None, None, N_Q, N_K, block_m=block_m, block_n=block_n,
                                mod_args=(q_doc, kv_doc))
    hidden_keys = np.zeros(N_K, bool)
    for j in range(bm.kinds.shape[3]):
        if np.all(bm.kinds[0, 0, :, j] == HIDDEN):
            hidden_keys[j * block_n : (j + 1) * block_n] = True
    k, v = to_numpy(k).copy(), to_numpy(v).copy()
    k[:, :, hidden_keys] = np.nan
    v[:, :, hidden_keys] = np.nan
    return int(hidden_keys.sum()), xp.asarray(k), xp.asarray(v)


CASES = [  # (algorithm, precision, dtype, tiles, tolerance)
    ("fa2", "ieee", "float32", (8, 8), 1e-5),
    ("fa1", "ieee", "float32", (8, 8), 1e-5),
    ("fa2", None, "float16", (16, 16), 2e-3),
    ("fa1", None, "float16", (16, 16), 2e-3),
]


@pytest.mark.parametrize("algorithm, precision, dtype, tiles, tol", CASES)
def test_hidden_tiles_are_never_read(algorithm, precision, dtype, tiles, tol, xp, rng):
    """NaN in the keys and values of tiles no query sees: the walk never loads them, so o is the
    reference's (computed from clean inputs), in both loop orders and regimes."""
    q_doc, kv_doc = _documents()  # (the queries are the last keys: the first document's keys, none's)
    q, k, v = random_qkv(rng, 1, 1, 1, N_Q, N_K, 16, dtype, xp)
    ref_o, _ = reference.attention(*(to_numpy(x) for x in (q, k, v)), mask_mod=same_document, mod_args=(q_doc, kv_doc))
    n_hidden, k, v = _nan_in_hidden_tiles(k, v, q_doc, kv_doc, *tiles, xp)
    assert n_hidden >= tiles[1]  # a whole K/V tile is hidden: the test can fail
    args = (xp.asarray(q_doc), xp.asarray(kv_doc))
    o, lse = run_poisoned(xp, q, k, v, algorithm=algorithm, precision=precision, mask_mod=same_document,
                          mod_args=args, block_m=tiles[0], block_n=tiles[1])
    assert np.abs(to_numpy(o).astype(np.float64) - ref_o).max() < tol


COUNTING = pytest.mark.skipif(not simulated(), reason="counts a mod's calls as Python (the simulator runs mods so)")


def _partial_entries(kinds, tiles) -> int:
    """Real (query, key) entries of the partial tiles of one (batch, head) of ``kinds``."""
    entries = 0
    for i, j in zip(*np.nonzero(kinds == PARTIAL)):
        entries += (min(N_Q, (i + 1) * tiles[0]) - i * tiles[0]) * (min(N_K, (j + 1) * tiles[1]) - j * tiles[1])
    return entries


def _counted_documents(calls):
    def counted(b, h, q_idx, kv_idx, q_doc, kv_doc):
        calls.append(1)
        return q_doc[q_idx] == kv_doc[kv_idx]

    return counted


@COUNTING
@pytest.mark.parametrize("algorithm, precision, dtype, tiles, tol", CASES)
def test_mask_mod_runs_on_partial_tiles_only(algorithm, precision, dtype, tiles, tol, rng):
    """The simulator runs a mod as Python, so its calls can be counted: with a block mask the
    kernels call ``mask_mod`` once per real (query, key) entry of each partial tile and head, and
    never on hidden or full tiles (a walk of every tile would call it on all N_Q x N_K entries)."""
    q, k, v = random_qkv(rng, 1, 1, 1, N_Q, N_K, 16, dtype)
    q_doc, kv_doc = _documents()
    calls = []
    counted = _counted_documents(calls)
    bm = numba_flash.block_mask(counted, None, None, N_Q, N_K, block_m=tiles[0], block_n=tiles[1],
                                mod_args=(q_doc, kv_doc))
    partial = _partial_entries(bm.kinds[0, 0], tiles)
    assert 0 < partial < N_Q * N_K
    calls.clear()
    o = numba_flash.attention(q, k, v, algorithm=algorithm, precision=precision, block_m=tiles[0], block_n=tiles[1],
                              mask_mod=counted, mod_args=(q_doc, kv_doc), block_mask=bm)
    assert len(calls) == partial
    ref_o, _ = reference.attention(q, k, v, mask_mod=same_document, mod_args=(q_doc, kv_doc))
    assert np.abs(o.astype(np.float64) - ref_o).max() < tol


def test_full_tiles_skip_the_mask_mod(xp, rng):
    """A block mask that calls every tile full: the kernels trust it and never call mask_mod,
    so the result is the unmasked one (what a full tile means), not the masked one."""
    q, k, v = random_qkv(rng, 1, 1, 1, N_Q, N_K, 16, "float32", xp)
    q_doc, kv_doc = _documents()
    kinds = np.full((1, 1, -(-N_Q // 8), -(-N_K // 8)), FULL, np.int8)
    trusting = BlockMask(kinds, (N_Q, N_K), 8, 8, same_document, MaskSpec.of())
    args = (xp.asarray(q_doc), xp.asarray(kv_doc))
    host = [to_numpy(x) for x in (q, k, v)]
    for algorithm in ("fa2", "fa1"):
        o = numba_flash.attention(q, k, v, algorithm=algorithm, precision="ieee", block_m=8, block_n=8,
                                  mask_mod=same_document, mod_args=args, block_mask=trusting)
        assert np.abs(to_numpy(o) - reference.attention(*host)[0]).max() < 1e-5
        masked = reference.attention(*host, mask_mod=same_document, mod_args=(q_doc, kv_doc))[0]
        assert np.abs(to_numpy(o) - masked).max() > 0.1


@pytest.mark.parametrize("mask_tiles", [(8, 24), (32, 32)])
def test_a_given_block_mask_at_other_tiles(mask_tiles, xp, rng):
    """A block mask made at tiles other than the kernel's (finer, coarser, not nested) is carried
    over to the kernel's (``retile``): the result is the reference's, both loop orders, causal."""
    q, k, v = random_qkv(rng, 1, 2, 1, N_Q, N_K, 16, "float16", xp)
    q_doc, kv_doc = _documents()
    bm = numba_flash.block_mask(same_document, None, None, N_Q, N_K, block_m=mask_tiles[0], block_n=mask_tiles[1],
                                mod_args=(q_doc, kv_doc), causal=True)
    host = [to_numpy(x) for x in (q, k, v)]
    ref_o, _ = reference.attention(*host, mask_mod=same_document, mod_args=(q_doc, kv_doc), causal=True)
    for algorithm in ("fa2", "fa1"):
        o, _ = run_poisoned(xp, q, k, v, algorithm=algorithm, causal=True, block_m=16, block_n=16,
                            mask_mod=same_document, mod_args=(xp.asarray(q_doc), xp.asarray(kv_doc)), block_mask=bm)
        assert np.abs(to_numpy(o).astype(np.float64) - ref_o).max() < 2e-3


@COUNTING
@pytest.mark.parametrize("mask_tiles", [(8, 24), (32, 32)])
def test_a_carried_mask_is_what_the_kernels_walk(mask_tiles, rng):
    """A block mask at other tiles than the kernel's is walked as ``retile`` carries it: mask_mod
    is called on exactly the entries of the carried mask's partial tiles (a kernel ignoring the
    given mask would call it on its own derived mask's, or on every entry)."""
    q, k, v = random_qkv(rng, 1, 1, 1, N_Q, N_K, 16, "float32")
    q_doc, kv_doc = _documents()
    calls = []
    counted = _counted_documents(calls)
    bm = numba_flash.block_mask(counted, None, None, N_Q, N_K, block_m=mask_tiles[0], block_n=mask_tiles[1],
                                mod_args=(q_doc, kv_doc))
    carried = retile(bm.kinds, mask_tiles, (N_Q, N_K), (8, 8))
    own = numba_flash.block_mask(same_document, None, None, N_Q, N_K, block_m=8, block_n=8, mod_args=(q_doc, kv_doc))
    expected = _partial_entries(carried[0, 0], (8, 8))
    assert expected != _partial_entries(own.kinds[0, 0], (8, 8))  # the test can tell the two masks apart
    for algorithm in ("fa2", "fa1"):
        calls.clear()
        o = numba_flash.attention(q, k, v, algorithm=algorithm, precision="ieee", block_m=8, block_n=8, mask_mod=counted,
                                  mod_args=(q_doc, kv_doc), block_mask=bm)
        assert len(calls) == expected, algorithm
        ref_o, _ = reference.attention(q, k, v, mask_mod=same_document, mod_args=(q_doc, kv_doc))
        assert np.abs(o - ref_o).max() < 1e-5


@COUNTING
def test_variants_and_splits_walk_the_lists(rng):
    """The K/V-outer walk of one Q tile per block (FA-1's loop order on FA-2's grid), split_k's
    two warp groups, and split-KV over the listed tiles: each the reference's result, calling
    mask_mod on the partial tiles' entries only (counted, as in the simulator a mod is Python)."""
    xp = np
    q, k, v = random_qkv(rng, 1, 1, 1, N_Q, N_K, 16, "float32", xp)
    q_doc, kv_doc = _documents()
    calls = []
    counted = _counted_documents(calls)
    ref_o, _ = reference.attention(*(to_numpy(x) for x in (q, k, v)), mask_mod=same_document, mod_args=(q_doc, kv_doc))
    runs = [dict(variant=dict(loop_order="kv_outer", grid="heads_x_qtiles", rescale="every_step")),
            dict(variant=dict(loop_order="q_outer", grid="heads_x_qtiles", rescale="deferred", warp_partition="split_k"),
                 block_m=8, block_n=16),
            dict(num_splits=3)]
    for extra in runs:
        tiles = {} if "block_m" in extra else dict(block_m=8, block_n=8)
        bm_, bn_ = extra.get("block_m", 8), extra.get("block_n", 8)
        made = numba_flash.block_mask(counted, None, None, N_Q, N_K, block_m=bm_, block_n=bn_, mod_args=(q_doc, kv_doc))
        calls.clear()
        o, _ = api.forward(q, k, v, precision="ieee", mask_mod=counted, mod_args=(q_doc, kv_doc), block_mask=made,
                           **tiles, **extra)
        assert np.abs(to_numpy(o) - ref_o).max() < 1e-5, extra
        assert len(calls) == _partial_entries(made.kinds[0, 0], (bm_, bn_)), extra


def test_a_derived_mask_follows_its_arrays(xp, rng):
    """The derived block mask is kept per mod_args *contents*: the same arrays changed in place
    give the new mask's result (a mask kept by identity would give the old one)."""
    q, k, v = random_qkv(rng, 1, 1, 1, N_Q, N_K, 16, "float16", xp)
    q_doc, kv_doc = _documents()
    args = (xp.asarray(q_doc), xp.asarray(kv_doc))
    host = [to_numpy(x) for x in (q, k, v)]
    first = numba_flash.attention(q, k, v, mask_mod=other_documents, mod_args=args)
    ref = reference.attention(*host, mask_mod=other_documents, mod_args=(q_doc, kv_doc))[0]
    assert np.abs(to_numpy(first).astype(np.float64) - ref).max() < 2e-3
    args[1][...] = xp.asarray(np.zeros(N_K, np.int32))  # every key in document 0 now
    second = numba_flash.attention(q, k, v, mask_mod=other_documents, mod_args=args)
    ref2 = reference.attention(*host, mask_mod=other_documents, mod_args=(q_doc, np.zeros(N_K, np.int32)))[0]
    assert np.abs(ref2 - ref).max() > 0.1
    assert np.abs(to_numpy(second).astype(np.float64) - ref2).max() < 2e-3


@settings(max_examples=examples(3), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), density=st.floats(0.0, 1.0), block=st.sampled_from([(4, 8), (8, 4), (8, 8)]))
def test_a_random_mask_walked_by_blocks_is_the_elementwise_one(seed, density, block):
    """Hypothesis: a random mask_mod (a visibility table of random blocks, some all visible, some
    all hidden, some mixed) walked by its block mask gives bitwise the result of the same kernel
    walking every tile with the elementwise mask alone (``kv_tile_order``: no block mask), and
    the reference's."""
    rng = np.random.default_rng(seed)
    n_q, n_k = 13, 29
    q, k, v = random_qkv(rng, 1, 1, 1, n_q, n_k, 8, "float32")
    blocks = rng.choice(3, size=(-(-n_q // 4), -(-n_k // 4)), p=[(1 - density) / 2, density, (1 - density) / 2 + 0.0])
    mixed = rng.random((n_q, n_k)) < 0.5
    seen = np.where(blocks.repeat(4, 0).repeat(4, 1)[:n_q, :n_k] == 1, True,
                    np.where(blocks.repeat(4, 0).repeat(4, 1)[:n_q, :n_k] == 0, False, mixed))

    def table_mask(b, h, q_idx, kv_idx, seen):
        return seen[q_idx, kv_idx]

    bm, bn = block
    tiles = -(-n_k // bn)
    by_blocks = api.forward(q, k, v, precision="ieee", block_m=bm, block_n=bn, mask_mod=table_mask, mod_args=(seen,))
    every_tile = api.forward(q, k, v, precision="ieee", block_m=bm, block_n=bn, mask_mod=table_mask, mod_args=(seen,),
                             kv_tile_order=np.arange(tiles))
    np.testing.assert_array_equal(by_blocks[0], every_tile[0])
    np.testing.assert_array_equal(by_blocks[1], every_tile[1])
    ref_o, _ = reference.attention(q, k, v, mask_mod=table_mask, mod_args=(seen,))
    assert np.abs(by_blocks[0] - ref_o).max() < 1e-5


@settings(max_examples=examples(10), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n_q=st.integers(1, 40), n_k=st.integers(1, 40),
       tiles=st.tuples(st.integers(1, 12), st.integers(1, 12)), to=st.tuples(st.integers(1, 12), st.integers(1, 12)))
def test_retiling_never_hides_a_visible_entry(seed, n_q, n_k, tiles, to):
    """Hypothesis: a block mask carried to other tiles (``retile``) calls a tile hidden only when
    the mask hides each of its entries and full only when it shows each; nested tiles are exact
    (the kinds derived at the new tiles directly)."""
    rng = np.random.default_rng(seed)
    seen = rng.random((n_q, n_k)) < rng.random()

    def table_mask(b, h, q_idx, kv_idx, seen):
        return seen[q_idx, kv_idx]

    made = numba_flash.block_mask(table_mask, None, None, n_q, n_k, block_m=tiles[0], block_n=tiles[1], mod_args=(seen,))
    moved = retile(made.kinds, tiles, (n_q, n_k), to)
    truth = numba_flash.block_mask(table_mask, None, None, n_q, n_k, block_m=to[0], block_n=to[1], mod_args=(seen,)).kinds
    assert moved.shape == truth.shape
    assert not np.any((moved == HIDDEN) & (truth != HIDDEN))
    assert not np.any((moved == FULL) & (truth != FULL))
    if to[0] % tiles[0] == 0 and to[1] % tiles[1] == 0:  # coarser, nested: exact
        np.testing.assert_array_equal(moved, truth)


def test_walk_lists_are_flexattentions_with_a_partial_bit():
    """The kernels' lists: per row the visited tiles ascending, ``tile * 2 + partial``."""
    kinds = np.array([[[[FULL, HIDDEN, PARTIAL], [HIDDEN, HIDDEN, HIDDEN]]]], np.int8)
    counts, listed = walk_lists(kinds, "q")
    np.testing.assert_array_equal(counts, [[[2, 0]]])
    np.testing.assert_array_equal(listed[0, 0, 0, :2], [0 * 2 + 0, 2 * 2 + 1])
    counts, listed = walk_lists(kinds, "kv")
    np.testing.assert_array_equal(counts, [[[1, 0, 1]]])
    np.testing.assert_array_equal(listed[0, 0, 2, :1], [0 * 2 + 1])
    assert PARTIAL == 1


def test_block_mask_errors_name_the_mismatch(rng):
    q, k, v = random_qkv(rng, 1, 2, 1, N_Q, N_K, 8, "float32")
    q_doc, kv_doc = _documents()
    args = (q_doc, kv_doc)
    bm = numba_flash.block_mask(same_document, None, None, N_Q, N_K, block_m=8, block_n=8, mod_args=args)
    with pytest.raises(TypeError, match="BlockMask"):
        numba_flash.attention(q, k, v, mask_mod=same_document, mod_args=args, block_mask=np.zeros(3))
    with pytest.raises(ValueError, match="Nq=40, Nk=72"):
        numba_flash.attention(q[:, :, :5], k, v, mask_mod=same_document, mod_args=args, block_mask=bm)
    with pytest.raises(ValueError, match="pass the mask_mod"):
        numba_flash.attention(q, k, v, block_mask=bm)
    with pytest.raises(ValueError, match="made from mask_mod='same_document'"):
        numba_flash.attention(q, k, v, mask_mod=other_documents, mod_args=args, block_mask=bm)
    causal = numba_flash.block_mask(same_document, None, None, N_Q, N_K, block_m=8, block_n=8, mod_args=args,
                                    causal=True)
    with pytest.raises(ValueError, match="built-in mask"):
        numba_flash.attention(q, k, v, mask_mod=same_document, mod_args=args, block_mask=causal)
    three_heads = numba_flash.block_mask(same_document, 1, 3, N_Q, N_K, mod_args=args)
    with pytest.raises(ValueError, match="B=1, H=3"):
        numba_flash.attention(q, k, v, mask_mod=same_document, mod_args=args, block_mask=three_heads)


# ------------------------------------------------------------------------------- the backward


def _backward_tiles(precision, dtype):
    """(dK/dV kernel tiles, dQ kernel tiles) the backward runs at, for the counts."""
    from numba_flash import tile_table
    from numba_flash.kernels.tc_bwd import dq_kernel_tiles

    if precision == "ieee":
        block = tile_table.backward_block(16)
        return (block, block), (block, block)
    kind = {"float16": "f16", "bfloat16": "bf16"}.get(dtype, "tf32x3")
    tiles = tile_table.backward_tc_tiles(16, kind)
    return tiles, dq_kernel_tiles(*tiles, kind)


# (The walks are the loop nests' (kernels.backward), the same on either engine; each engine's
# P and dS read the pair's kind. FA-2 with atomics walks the dK/dV lists as the deterministic
# FA-2 does, in the same kernel, and FA-1 as FA-2 on one engine: the simulator's time goes to the
# deterministic FA-2 on both engines, which walks the dQ lists too, and FA-1 on tensor cores.)
BACKWARD_CASES = [("ieee", "float32", "fa2", True), (None, "float16", "fa2", True), (None, "float16", "fa1", False)]


@COUNTING
@pytest.mark.parametrize("precision, dtype, algorithm, deterministic", BACKWARD_CASES)
def test_the_backward_walks_the_lists(precision, dtype, algorithm, deterministic, rng):
    """The backward's dK/dV walk (each K/V tile's listed Q tiles, head by head: two query heads
    on one KV head) and its deterministic dQ walk (each Q tile's listed K/V tiles) call mask_mod
    on exactly the partial tiles' entries, with a causal mask beside it; the gradients are the
    reference's."""
    from numba_flash.backward import gradients
    from helpers import backward_problem, gradient_error

    do, q, k, v, _, _ = backward_problem(rng, 1, 2, 1, N_Q, N_K, 16, dtype, True)
    q_doc, kv_doc = _documents()
    calls = []
    counted = _counted_documents(calls)
    mods = dict(mask_mod=counted, mod_args=(q_doc, kv_doc), causal=True)
    kv_tiles, dq_tiles = _backward_tiles(precision, dtype)
    for tiles in dict.fromkeys((dq_tiles, kv_tiles)):  # (forwards at the backward's tiles derive mask_mod's
        # block masks there, kept per mask_mod, shape, tiles and mod_args: the backward walks them, deriving
        # nothing, so every counted call below is a walk's; a backward that derived afresh would add its own)
        o, lse = numba_flash.attention(q, k, v, return_lse=True, precision="ieee", block_m=tiles[0], block_n=tiles[1],
                                       **mods)
    run = dict(algorithm=algorithm, deterministic=deterministic, precision=precision, **mods)
    calls.clear()
    grads = gradients(do, q, k, v, o, lse, **run)
    expected = 0
    for tiles, walks in ((kv_tiles, True), (dq_tiles, deterministic and algorithm == "fa2")):
        if walks:  # the mod's partial tiles (its mask alone: the kernels derive that) which causal leaves a key in
            made = numba_flash.block_mask(same_document, None, None, N_Q, N_K, block_m=tiles[0], block_n=tiles[1],
                                          mod_args=(q_doc, kv_doc))
            causal = numba_flash.block_mask(None, None, None, N_Q, N_K, block_m=tiles[0], block_n=tiles[1], causal=True)
            visited = np.where(causal.kinds[0, 0] != HIDDEN, made.kinds[0, 0], HIDDEN)
            expected += 2 * _partial_entries(visited, tiles)  # (two query heads)
    assert 0 < len(calls) == expected
    host = [x.astype(np.float64) for x in (do, q, k, v)]
    refs = reference.attention_backward(*host, mask_mod=same_document, mod_args=(q_doc, kv_doc), causal=True)
    bound = 1e-4 if dtype == "float32" else 5e-3
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert gradient_error(got, ref, refs) < bound, name


@pytest.mark.parametrize("precision, dtype, algorithm, deterministic", BACKWARD_CASES[:2])
def test_the_backward_never_reads_hidden_tiles(precision, dtype, algorithm, deterministic, rng):
    """NaN in the keys and values no query sees: a walk that visited their tiles would carry it
    into dQ (dS = 0 times K = NaN); the block-sparse walks never load them."""
    from numba_flash.backward import gradients
    from helpers import backward_problem, gradient_error

    do, q, k, v, _, _ = backward_problem(rng, 1, 1, 1, N_Q, N_K, 16, dtype, False)
    q_doc, kv_doc = _documents()
    mods = dict(mask_mod=same_document, mod_args=(q_doc, kv_doc))
    host = [x.astype(np.float64) for x in (do, q, k, v)]
    refs = reference.attention_backward(*host, **mods)
    o, lse = numba_flash.attention(q, k, v, return_lse=True, precision="ieee", **mods)
    n_hidden, k, v = _nan_in_hidden_tiles(k, v, q_doc, kv_doc, 16, 16, np)  # (16 keys: a tile of every kernel here)
    assert n_hidden >= 16
    dq, dk, dv = gradients(do, q, k, v, o, lse, algorithm=algorithm, deterministic=deterministic, precision=precision,
                           **mods)
    bound = 1e-4 if dtype == "float32" else 5e-3
    assert gradient_error(dq, refs[0], refs) < bound
    seen = ~np.isnan(k[0, 0, :, 0])
    for got, ref in ((dk, refs[1]), (dv, refs[2])):
        assert np.all(got[:, :, ~seen] == 0)
        assert gradient_error(got[:, :, seen], ref[:, :, seen], refs) < bound
