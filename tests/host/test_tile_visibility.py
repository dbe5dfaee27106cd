"""``numba_flash.block_mask`` (API.md 2c): the tile table of a mask against the mask itself,
entry by entry (Hypothesis over shapes, tiles and random masks), its walk lists, and errors."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import tile_visibility as bm
from numba_flash import reference
from numba_flash.masking import MaskSpec


def brute_kinds(dense, block_m, block_n):
    """The kinds from a dense (B, H, Nq, Nk) mask with Python loops: hidden when no entry of the
    tile is visible, full when every entry inside (Nq, Nk) is."""
    b, h, n_q, n_k = dense.shape
    n_qt, n_kt = -(-n_q // block_m), -(-n_k // block_n)
    out = np.zeros((b, h, n_qt, n_kt), np.int8)
    for i in range(b):
        for j in range(h):
            for t in range(n_qt):
                for u in range(n_kt):
                    tile = dense[i, j, t * block_m:(t + 1) * block_m, u * block_n:(u + 1) * block_n]
                    out[i, j, t, u] = bm.FULL if tile.all() else bm.PARTIAL if tile.any() else bm.HIDDEN
    return out


@st.composite
def masks(draw):
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n_q, n_k = draw(st.integers(0, 23)), draw(st.integers(0, 23))
    block_m, block_n = draw(st.sampled_from([1, 2, 4, 8, 16])), draw(st.sampled_from([1, 3, 4, 8]))
    density = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
    seed = draw(st.integers(0, 2**16))
    table = np.random.default_rng(seed).random((b, h, n_q, n_k)) < density
    window = (draw(st.integers(-1, 6)), draw(st.integers(-1, 6)))
    causal = draw(st.booleans())
    return table, block_m, block_n, window, causal


@settings(max_examples=examples(60), deadline=None)
@given(masks())
def test_kinds_are_the_masks_tile_by_tile(case):
    """A random table as mask_mod (through mod_args), with a window and causal on top: each
    tile's kind is what its entries say, and the lists of both walks hold exactly those tiles."""
    table, block_m, block_n, window, causal = case
    b, h, n_q, n_k = table.shape
    got = bm.block_mask(lambda bi, hi, qi, ki, t: t[bi, hi, qi, ki], b, h, n_q, n_k, block_m=block_m, block_n=block_n,
                        causal=causal, window_size=window, mod_args=(table,))
    dense = table & MaskSpec.of(causal, window).matrix(n_q, n_k)[None, None]
    np.testing.assert_array_equal(got.kinds, brute_kinds(dense, block_m, block_n))
    assert got.shape == (b, h, n_q, n_k)
    assert not (dense & ~got.to_dense()).any()  # no visible entry in a skipped tile
    for kind, counts, indices in ((bm.PARTIAL, got.kv_num_blocks, got.kv_indices),
                                  (bm.FULL, got.full_kv_num_blocks, got.full_kv_indices)):
        for i, j, t in np.ndindex(*counts.shape):
            listed = indices[i, j, t, :counts[i, j, t]].tolist()
            assert listed == np.flatnonzero(got.kinds[i, j, t] == kind).tolist()
            assert not indices[i, j, t, counts[i, j, t]:].any()
    for kind, counts, indices in ((bm.PARTIAL, got.q_num_blocks, got.q_indices),
                                  (bm.FULL, got.full_q_num_blocks, got.full_q_indices)):
        for i, j, u in np.ndindex(*counts.shape):
            assert indices[i, j, u, :counts[i, j, u]].tolist() == np.flatnonzero(got.kinds[i, j, :, u] == kind).tolist()


def test_the_built_in_masks_equal_their_mask_mods():
    """causal and a sliding window give the table of the same predicate as a mask_mod."""
    n_q, n_k = 77, 130
    for causal, window, mod in [
        (True, (-1, -1), lambda b, h, q, k: k <= q + (n_k - n_q)),
        (False, (16, 0), lambda b, h, q, k: (k <= q + (n_k - n_q)) & (k >= q + (n_k - n_q) - 16)),
        (False, (5, 9), lambda b, h, q, k: (k <= q + (n_k - n_q) + 9) & (k >= q + (n_k - n_q) - 5)),
    ]:
        built_in = bm.block_mask(None, None, None, n_q, n_k, block_m=16, block_n=32, causal=causal, window_size=window)
        as_mod = bm.block_mask(mod, 1, 1, n_q, n_k, block_m=16, block_n=32)
        np.testing.assert_array_equal(built_in.kinds, as_mod.kinds)


def test_document_masking_from_sequence_ids():
    """The gallery's document mask: queries see keys of their own document; 3 documents of 100
    rows in 64-row tiles: diagonal blocks full, document borders partial, the rest hidden."""
    doc = np.repeat(np.arange(3), 100)
    got = bm.block_mask(lambda b, h, q, k, d: d[q] == d[k], None, None, 300, 300, block_m=64, block_n=64,
                        mod_args=(doc,))
    dense = (doc[:, None] == doc[None, :])[None, None]
    np.testing.assert_array_equal(got.kinds, brute_kinds(dense, 64, 64))
    assert got.kinds[0, 0, 0, 0] == bm.FULL and got.kinds[0, 0, 0, 4] == bm.HIDDEN
    assert 0.3 < got.sparsity() < 0.5
    # the reference with the block mask's entries outside the mask hidden is the same function
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 300, 8)) for _ in range(3))
    o, _ = reference.attention(q, k, v, mask_mod=lambda b, h, qi, ki, d: d[qi] == d[ki], mod_args=(doc,))
    o_tiles, _ = reference.attention(q, k, v, mask_mod=lambda b, h, qi, ki, d, t: (d[qi] == d[ki]) & t[qi, ki],
                                     mod_args=(doc, got.to_dense()[0, 0]))
    np.testing.assert_allclose(o_tiles, o, rtol=0, atol=0)


def test_memoised_without_mod_args_and_afresh_with_them():
    def mod(b, h, q, k):
        return k <= q

    first = bm.block_mask(mod, None, None, 40, 40, block_m=8, block_n=8)
    assert bm.block_mask(mod, None, None, 40, 40, block_m=8, block_n=8) is first
    table = np.ones((40, 40), bool)
    with_args = bm.block_mask(lambda b, h, q, k, t: t[q, k], None, None, 40, 40, block_m=8, block_n=8, mod_args=(table,))
    assert (with_args.kinds == bm.FULL).all()
    table[:] = False  # the caller's array changed: a new call sees it
    again = bm.block_mask(lambda b, h, q, k, t: t[q, k], None, None, 40, 40, block_m=8, block_n=8, mod_args=(table,))
    assert (again.kinds == bm.HIDDEN).all()
    assert "sparsity=100.0%" in repr(again)


def test_an_elementwise_mask_mod_and_one_returning_no_bool():
    """A mask_mod written for scalars (an ``if``) runs entry by entry; one returning what has no
    truth value (two values per entry) is refused, naming the entry."""
    def scalar_only(b, h, q, k):
        if k > q:  # truth value of an array: not vectorisable
            return False
        return True

    vector = bm.block_mask(lambda b, h, q, k: k <= q, None, None, 9, 9, block_m=4, block_n=4)
    np.testing.assert_array_equal(bm.block_mask(scalar_only, None, None, 9, 9, block_m=4, block_n=4).kinds, vector.kinds)
    with pytest.raises(TypeError, match=r"mask_mod must return a bool, got ndarray at \(b, h, q_idx, kv_idx\) = \(0, 0, 0, 0\)"):
        bm.block_mask(lambda b, h, q, k: np.array([1, 0]), None, None, 3, 3, block_m=2, block_n=2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(mask_mod=3), TypeError, "mask_mod must be a callable"),
    (dict(B=0), ValueError, "B must be >= 1"),
    (dict(H=2.0), TypeError, "H must be an int"),
    (dict(Nq=None), TypeError, "needs Nq and Nk"),
    (dict(block_m=0), ValueError, "block_m must be >= 1"),
    (dict(window_size=4), TypeError, "window_size must be a pair"),
    (dict(window_size=(-2, 0)), ValueError, "window left must be -1"),
    (dict(mod_args=[np.zeros(3)]), TypeError, "mod_args must be a tuple"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    args = dict(mask_mod=None, B=None, H=None, Nq=8, Nk=8)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        bm.block_mask(**args)


def test_empty_lengths():
    got = bm.block_mask(None, 2, 1, 0, 5, block_m=4, block_n=4, causal=True)
    assert got.kinds.shape == (2, 1, 0, 2) and got.sparsity() == 0.0 and got.to_dense().shape == (2, 1, 0, 5)
    assert bm.block_mask(None, None, None, 5, 0, block_m=4, block_n=4).kinds.shape == (1, 1, 2, 0)


# ------------------------------------------------------------------ block-sparse walks (tiled)

@settings(max_examples=examples(40), deadline=None)
@given(masks(), st.sampled_from(["fa1", "fa2"]), st.integers(1, 4))
def test_a_block_sparse_walk_is_the_elementwise_mask(case, algorithm, dim):
    """Both loop nests (``numba_flash.tiled``) walking only the tiles a random mask's block mask
    lists, masking only its partial tiles, give the float64 reference's attention with the
    mask applied entry by entry (including rows that see no key: o = 0, lse = -inf)."""
    from numba_flash import tiled

    table, block_m, block_n, window, causal = case
    b, h, n_q, n_k = table.shape
    rng = np.random.default_rng(dim)
    q = rng.standard_normal((b, h, n_q, dim))
    k, v = (rng.standard_normal((b, 1, n_k, dim)) for _ in range(2))

    def mod(bi, hi, qi, ki, t):
        return t[bi, hi, qi, ki]

    kw = dict(causal=causal, window_size=window, mask_mod=mod, mod_args=(table,))
    walk = tiled.fa1_tiled if algorithm == "fa1" else tiled.fa2_tiled
    table_of_tiles = bm.block_mask(mod, b, h, n_q, n_k, block_m=block_m, block_n=block_n, causal=causal,
                                   window_size=window, mod_args=(table,))
    o, lse = walk(q, k, v, block_m, block_n, block_mask=table_of_tiles, **kw)
    want_o, want_lse = reference.attention(q, k, v, **kw)
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-12, atol=1e-12)


def test_hidden_tiles_are_never_computed_and_a_wrong_table_shows(monkeypatch):
    """FA-2's walk under a causal block mask makes one online update per listed tile (none for
    hidden ones); a table that calls a partial tile full skips its mask, and the result moves --
    the property above can fail."""
    from numba_flash import online, tiled

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, 64, 4)) for _ in range(3))
    causal_tiles = bm.block_mask(None, None, None, 64, 64, block_m=16, block_n=16, causal=True)
    calls = []
    real_update = online.update
    monkeypatch.setattr(tiled, "update", lambda *a: calls.append(1) or real_update(*a))
    o, _ = tiled.fa2_tiled(q, k, v, 16, 16, causal=True, block_mask=causal_tiles)
    assert len(calls) == int((causal_tiles.kinds != bm.HIDDEN).sum()) == 10  # 4 diagonal + 6 below
    np.testing.assert_allclose(o, reference.attention(q, k, v, causal=True)[0], rtol=1e-12, atol=1e-12)
    wrong = bm.BlockMask(np.where(causal_tiles.kinds == bm.PARTIAL, bm.FULL, causal_tiles.kinds).astype(np.int8),
                         (64, 64), 16, 16)
    o_wrong, _ = tiled.fa2_tiled(q, k, v, 16, 16, causal=True, block_mask=wrong)
    assert np.abs(o_wrong - o).max() > 1e-3
    with pytest.raises(ValueError, match="block_mask is for"):
        tiled.fa1_tiled(q, k, v, 16, 32, causal=True, block_mask=causal_tiles)


def test_walk_names_its_lists():
    got = bm.block_mask(None, None, None, 40, 40, block_m=8, block_n=8, causal=True)
    counts, indices = got.walk("kv", full=True)
    np.testing.assert_array_equal(counts, got.full_q_num_blocks)
    np.testing.assert_array_equal(indices, got.full_q_indices)
    assert counts[0, 0].tolist() == [4, 3, 2, 1, 0]  # K/V tile u is full for the Q tiles below it
    with pytest.raises(ValueError, match="over must be"):
        got.walk("rows")
