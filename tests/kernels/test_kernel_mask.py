"""The device's statement of the mask (``kernels.mask``) agrees with the host's (``masking``).

The kernels ask the mask in two directions (the last key a row of S sees, the first query a row
of S^T is seen by) and at tile granularity (which K/V tiles a Q tile walks, which Q tile an S^T
walk starts at); each answer is checked here against the host's ``MaskSpec.visible``, which is
itself checked against the brute-force definition in ``test_masking``. The device functions run
as plain Python in the simulator.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import examples

from numba_flash.kernels import mask
from numba_flash.masking import mask_spec

shapes = st.tuples(st.integers(1, 24), st.integers(0, 24), st.booleans(), st.sampled_from([1, 2, 4, 8, 16]),
                   st.sampled_from([1, 2, 4, 8, 16]))


@settings(max_examples=examples(150), deadline=None)
@given(shapes)
def test_device_rule_is_the_host_rule(shape):
    n_q, n_k, causal, block_m, block_n = shape
    host = mask_spec(causal)
    for row in range(n_q):
        last = mask.last_visible_key(row, n_q, n_k, causal)
        for key in range(n_k + 3):  # keys past Nk too: never visible
            seen = key < n_k and bool(host.visible(row, key, n_q, n_k))
            # rows of S: hidden past the row's last visible key
            assert (not mask.key_hidden(key, last)) == seen, (row, key)
            # rows of S^T: hidden before the key's first visible query
            first = mask.first_visible_query(key, n_q, n_k, causal)
            assert (not mask.query_hidden(row, first)) == seen, (row, key)


@settings(max_examples=examples(150), deadline=None)
@given(shapes)
def test_tile_questions_match_the_visible_entries(shape):
    n_q, n_k, causal, block_m, block_n = shape
    host = mask_spec(causal)
    n_kv_tiles = -(-n_k // block_n)
    for row0 in range(0, n_q, block_m):
        rows = range(row0, min(row0 + block_m, n_q))
        visible_tiles = [j for j in range(n_kv_tiles)
                         if any(host.visible(r, c, n_q, n_k) for r in rows for c in range(j * block_n, min(n_k, (j + 1) * block_n)))]
        walked = mask.kv_tiles_seen(mask.last_visible_key(rows[-1], n_q, n_k, causal), n_kv_tiles, block_n)
        # the walk covers every tile with a visible entry, and ends at the last such tile
        assert walked == (visible_tiles[-1] + 1 if visible_tiles else 0)
        # a tile needs the elementwise mask iff some entry of it (a key < Nk or the tail) is hidden
        for j in range(walked):
            col0 = j * block_n
            any_hidden = any(not host.visible(r, c, n_q, n_k) or c >= n_k
                             for r in rows for c in range(col0, col0 + block_n))
            needs = mask.tile_needs_mask(col0, block_n, mask.last_visible_key(row0, n_q, n_k, causal))
            assert needs or not any_hidden, (row0, col0)
    n_q_tiles = -(-n_q // block_m)
    for j in range(n_kv_tiles):
        col0 = j * block_n
        keys = range(col0, min(n_k, col0 + block_n))
        first_tile = mask.first_q_tile(col0, n_q, n_k, block_m, causal)
        seen_by = [i for i in range(n_q_tiles)
                   if any(host.visible(r, c, n_q, n_k) for r in range(i * block_m, min(n_q, (i + 1) * block_m)) for c in keys)]
        # the S^T walk starts at or before the first Q tile that sees the K/V tile, and skips none that do
        if seen_by:
            assert first_tile <= seen_by[0]
        assert all(i >= first_tile for i in seen_by)


def test_packed_rows_share_their_query_position():
    """Decoding packs ``group`` query heads per position: rows p * group .. p * group + group - 1
    all see what query position p sees."""
    n_q, n_k, group = 3, 10, 4
    for row in range(n_q * group):
        assert mask.packed_last_visible_key(row, group, n_q * group, n_k, True) == \
            mask.last_visible_key(row // group, n_q, n_k, True)


def test_a_row_that_sees_nothing_walks_nothing():
    """Nq > Nk with the causal mask: the first Nq - Nk rows see no key (o = 0, lse = -inf)."""
    n_q, n_k = 10, 4
    last = mask.last_visible_key(0, n_q, n_k, True)
    assert last < 0
    assert mask.kv_tiles_seen(last, 1, 16) == 0
