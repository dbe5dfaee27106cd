"""The device's statement of the mask (``kernels.mask``) agrees with the host's (``masking``).

The kernels ask the mask in two directions (the keys ``[first, last]`` a row of S sees, the
queries ``[first, last]`` a row of S^T is seen by) and at tile granularity (which K/V tiles a Q
tile walks, which Q tiles an S^T walk visits, which tiles need the elementwise test); each answer
is checked here against the host's ``MaskSpec.visible``, itself checked against the brute-force
definition in ``test_masking``, for random windows ``(left, right)`` (causal is ``(-1, 0)``).
The device functions run as plain Python in the simulator.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import examples

from numba_flash.kernels import mask
from numba_flash.masking import MaskSpec

sides = st.one_of(st.just(-1), st.integers(0, 12))
shapes = st.tuples(st.integers(1, 24), st.integers(0, 24), sides, sides, st.sampled_from([1, 2, 4, 8, 16]),
                   st.sampled_from([1, 2, 4, 8, 16]))


@settings(max_examples=examples(150), deadline=None)
@given(shapes)
def test_device_rule_is_the_host_rule(shape):
    n_q, n_k, left, right, block_m, block_n = shape
    host, window = MaskSpec(left, right), (left, right)
    for row in range(n_q):
        first = mask.first_visible_key(row, n_q, n_k, window)
        last = mask.last_visible_key(row, n_q, n_k, window)
        for key in range(n_k + 3):  # keys past Nk too: never visible
            seen = key < n_k and bool(host.visible(row, key, n_q, n_k))
            # rows of S: hidden outside the row's [first, last]
            assert (not mask.key_hidden(key, first, last, window)) == seen, (row, key)
            # rows of S^T: hidden outside the key's [first, last] queries
            first_q = mask.first_visible_query(key, n_q, n_k, window)
            last_q = mask.last_visible_query(key, n_q, n_k, window)
            assert (not mask.query_hidden(row, first_q, last_q, window)) == seen, (row, key)


def visible_in(host, rows, keys, n_q, n_k) -> bool:
    return any(host.visible(r, c, n_q, n_k) for r in rows for c in keys if c < n_k)


@settings(max_examples=examples(150), deadline=None)
@given(shapes)
def test_tile_questions_match_the_visible_entries(shape):
    n_q, n_k, left, right, block_m, block_n = shape
    host, window = MaskSpec(left, right), (left, right)
    n_kv_tiles = -(-n_k // block_n)
    for row0 in range(0, n_q, block_m):
        rows = range(row0, min(row0 + block_m, n_q))
        visible_tiles = [j for j in range(n_kv_tiles)
                         if visible_in(host, rows, range(j * block_n, (j + 1) * block_n), n_q, n_k)]
        first_key = mask.first_visible_key(rows[0], n_q, n_k, window)
        last_key = mask.last_visible_key(rows[-1], n_q, n_k, window)
        tile0, count = mask.kv_tile_range(first_key, last_key, n_kv_tiles, block_n, window)
        # the walk is exactly the tiles from the first with a visible entry to the last
        # (the window's keys of consecutive rows form one range: no hidden tile in between)
        assert list(range(tile0, tile0 + count)) == visible_tiles, (row0, tile0, count)
        for j in range(n_kv_tiles):
            col0 = j * block_n
            assert mask.tile_hidden(col0, block_n, first_key, last_key, window) == (j not in visible_tiles)
        # a tile needs the elementwise mask iff some entry of it (a key < Nk or the tail) is hidden
        first_row_last_key = mask.last_visible_key(rows[0], n_q, n_k, window)
        last_row_first_key = mask.first_visible_key(rows[-1], n_q, n_k, window)
        for j in visible_tiles:
            col0 = j * block_n
            any_hidden = any(c >= n_k or not host.visible(r, c, n_q, n_k) for r in rows for c in range(col0, col0 + block_n))
            needs = mask.tile_needs_mask(col0, block_n, first_row_last_key, last_row_first_key, window)
            assert needs or not any_hidden, (row0, col0)
    n_q_tiles = -(-n_q // block_m)
    for j in range(n_kv_tiles):
        col0 = j * block_n
        keys = range(col0, min(n_k, col0 + block_n))
        first_tile = mask.first_q_tile(col0, n_q, n_k, block_m, window)
        end_tile = mask.q_tiles_end(keys[-1], n_q, n_k, block_m, n_q_tiles, window)
        seen_by = [i for i in range(n_q_tiles) if visible_in(host, range(i * block_m, min(n_q, (i + 1) * block_m)), keys, n_q, n_k)]
        # the S^T walk [first_tile, end_tile) covers every Q tile that sees the K/V tile
        assert all(first_tile <= i < end_tile for i in seen_by), (j, first_tile, end_tile, seen_by)
        if seen_by:  # and starts at the first of them (the causal walks' count depends on it)
            assert first_tile == seen_by[0]


def test_packed_rows_share_their_query_position():
    """Decoding packs ``group`` query heads per position: rows p * group .. p * group + group - 1
    all see exactly what query position p sees (the host's rule, unpacked)."""
    n_q, n_k, group = 3, 10, 4
    for window in ((-1, 0), (2, 0), (1, -1), (0, 3)):
        host = MaskSpec(*window)
        for row in range(n_q * group):
            seen = [key for key in range(n_k) if host.visible(row // group, key, n_q, n_k)]
            first = mask.packed_first_visible_key(row, group, n_q * group, n_k, window)
            last = mask.packed_last_visible_key(row, group, n_q * group, n_k, window)
            assert [key for key in range(n_k) if not mask.key_hidden(key, first, last, window)] == seen, (window, row)


def test_a_row_that_sees_nothing_walks_nothing():
    """Nq > Nk with the causal mask: the first Nq - Nk rows see no key (o = 0, lse = -inf)."""
    n_q, n_k = 10, 4
    last = mask.last_visible_key(0, n_q, n_k, mask.CAUSAL)
    assert last < 0
    assert mask.kv_tiles_seen(last, 1, 16) == 0
    assert mask.kv_tile_range(0, last, 1, 16, (3, 0))[1] == 0


def test_window_of_takes_the_public_flag_or_a_pair():
    assert mask.window_of(True) == (-1, 0) and mask.window_of(False) == (-1, -1)
    assert mask.window_of((4, 0)) == (4, 0) and mask.window_of([2, -1]) == (2, -1)
    with pytest.raises(ValueError, match="-1"):
        mask.window_of((-2, 0))
