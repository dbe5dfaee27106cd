"""Which keys a query row sees: the visibility rule of every kernel, stated once (device side).

The rule (API.md section 2c; FlashAttention's ``window_size``, bottom-right aligned): with the
diagonal offset ``Nk - Nq``, query ``i`` sees key ``j < Nk`` iff::

    i + (Nk - Nq) - left  <=  j  <=  i + (Nk - Nq) + right

``window = (left, right)``, ``-1`` unbounded on that side: ``(-1, -1)`` is no mask, ``(-1, 0)``
the causal mask (``causal=True``). The window is a compile-time constant of every kernel (a
tuple captured by the loop nest; :func:`window_of` makes it), so a side that is unbounded costs
no instruction: every test of it below is folded away. The host twin is ``numba_flash.masking``.
A row that sees no key gets ``o = 0`` and ``lse = -inf`` (``softmax``), never NaN.

Everything a kernel asks about the mask is answered here, in the two directions it asks:

- rows of S (the forward, the backward's dQ kernel): the keys ``[first, last]`` a query row sees,
  :func:`first_visible_key` / :func:`last_visible_key`; a key is hidden iff :func:`key_hidden`;
- rows of S^T (the backward's dK/dV kernels, one key per row): the queries ``[first, last]`` that
  see a key, :func:`first_visible_query` / :func:`last_visible_query`; a query is hidden iff
  :func:`query_hidden` -- the same rule, solved for the other index;
- whole tiles: :func:`tile_needs_mask` (does any entry of a tile need the elementwise test: only
  the tiles a window's edge or the tail crosses do), :func:`first_kv_tile` / :func:`kv_tiles_seen`
  (the K/V tiles ``[first, end)`` a Q tile walks: the rest are hidden from every row of it),
  :func:`first_q_tile` / :func:`q_tiles_end` (the Q tiles that see a K/V tile);
- one routine applies it to a thread's tile of scores, whatever the engine's register layout:
  :func:`tile_masker` (each engine says which key and which row an entry of its tile holds), with
  the per-row bounds from :func:`row_bounds`.

Adding a mask changes these functions and ``masking``, and no loop nest: the loops only ask the
questions above.
"""

from __future__ import annotations

import functools

from numba_flash._cuda import float32

from numba_flash.kernels.jit import NEG_INF, device_jit

NEVER = 1 << 30  # first visible query of a key that no query sees (past Nk): after every row
NO_MASK, CAUSAL = (-1, -1), (-1, 0)


def window_of(mask) -> tuple[int, int]:
    """Host: the compile-time window of a kernel factory's ``mask`` argument: a bool (the
    public ``causal``: ``(-1, 0)`` or ``(-1, -1)``) or a ``(left, right)`` pair of ints >= -1."""
    if isinstance(mask, bool) or type(mask).__name__ == "bool_":
        return CAUSAL if mask else NO_MASK
    left, right = (int(x) for x in mask)
    if left < -1 or right < -1:
        raise ValueError(f"a window's sides are -1 (unbounded) or >= 0; got {(left, right)}")
    return (left, right)


@device_jit
def diagonal(n_q, n_k):
    """The key on query 0's diagonal: ``Nk - Nq`` (bottom-right alignment; query ``i``'s is
    ``i + diagonal``). Every bound below is this offset, solved for a row or a key."""
    return n_k - n_q


@device_jit
def last_visible_key(row, n_q, n_k, window):
    """Index of the last key query ``row`` may see: ``row + (Nk - Nq) + right`` (at most
    ``Nk - 1``); negative when the row sees no key."""
    if window[1] >= 0:
        return min(n_k - 1, row + diagonal(n_q, n_k) + window[1])
    return n_k - 1


@device_jit
def first_visible_key(row, n_q, n_k, window):
    """Index of the first key query ``row`` may see: ``row + (Nk - Nq) - left`` (at least 0)."""
    if window[0] >= 0:
        return max(0, row + diagonal(n_q, n_k) - window[0])
    return 0


@device_jit
def packed_last_visible_key(row, rows_per_query, n_rows, n_k, window):
    """:func:`last_visible_key` of kernel row ``row`` when each query position owns
    ``rows_per_query`` consecutive rows (decoding packs the query heads of one KV head that
    way: row = position * group + head); ``n_rows`` rows in all. 1: one row per query."""
    return last_visible_key(row // rows_per_query, n_rows // rows_per_query, n_k, window)


@device_jit
def packed_query(row, rows_per_query, h):
    """(query position, query head) of kernel row ``row`` of kernel head ``h`` when each position
    owns ``rows_per_query`` consecutive rows, one per query head of KV head ``h`` (decoding's
    packing: row = position * group + head); with 1, ``(row, h)`` (no division)."""
    if rows_per_query == 1:
        return row, h
    pos = row // rows_per_query
    return pos, h * rows_per_query + (row - pos * rows_per_query)


@device_jit
def packed_first_visible_key(row, rows_per_query, n_rows, n_k, window):
    """:func:`first_visible_key` of kernel row ``row`` (rows packed as for
    :func:`packed_last_visible_key`)."""
    return first_visible_key(row // rows_per_query, n_rows // rows_per_query, n_k, window)


@device_jit
def first_visible_query(key, n_q, n_k, window):
    """The first query that sees ``key`` (the rule solved for the query: ``i >= j - (Nk - Nq) -
    right``, else 0); :data:`NEVER` for a key past ``Nk``."""
    first = 0
    if window[1] >= 0:
        first = key - diagonal(n_q, n_k) - window[1]
    if key >= n_k:
        first = NEVER
    return first


@device_jit
def last_visible_query(key, n_q, n_k, window):
    """The last query that sees ``key`` (``i <= j - (Nk - Nq) + left``; unbounded: :data:`NEVER`,
    after every row). Only meaningful with a left bound; the nests ask it only then."""
    if window[0] >= 0:
        return key - diagonal(n_q, n_k) + window[0]
    return NEVER


@device_jit
def past_last_key(key, last_key):
    """Is ``key`` past the row's last visible key (the right edge or ``Nk``)?"""
    return key > last_key


@device_jit
def key_hidden(key, first_key, last_key, window):
    """Is ``key`` hidden from the row that sees keys ``[first_key, last_key]``? (``first_key`` is
    read only with a left bound.)"""
    if window[0] >= 0:
        return past_last_key(key, last_key) or key < first_key
    return past_last_key(key, last_key)


@device_jit
def query_hidden(query, first_query, last_query, window):
    """Is ``query`` hidden from the key seen by queries ``[first_query, last_query]``?
    (``last_query`` is read only with a left bound.)"""
    if window[0] >= 0:
        return query < first_query or query > last_query
    return query < first_query


@device_jit
def tile_needs_mask(col0, block_n, first_row_last_key, last_row_first_key, window):
    """Does any key of the ``block_n``-key tile at ``col0`` lie outside some row's visible keys?
    ``first_row_last_key``: the tile's first row's last visible key (the smallest);
    ``last_row_first_key``: its last row's first visible key (the largest; read only with a left
    bound). Block-uniform: only the tiles a window edge or the tail crosses pay for the mask."""
    if window[0] >= 0:
        return col0 + block_n - 1 > first_row_last_key or col0 < last_row_first_key
    return col0 + block_n - 1 > first_row_last_key


@device_jit
def kv_tiles_seen(last_key, n_kv_tiles, block_n):
    """The end of the K/V tiles a Q tile walks: the one after the tile holding ``last_key`` (its
    last row's last visible key; FA-2 section 3.1.1 skips the rest), 0 when no key is visible."""
    if last_key >= 0:
        return min(n_kv_tiles, last_key // block_n + 1)
    return 0


@device_jit
def first_kv_tile(first_key, block_n, window):
    """The first K/V tile a Q tile walks: the one holding ``first_key`` (its first row's first
    visible key; a left bound hides the tiles before it from every row); 0 without one."""
    if window[0] >= 0:
        return first_key // block_n
    return 0


@device_jit
def kv_tile_range(first_key, last_key, n_kv_tiles, block_n, window):
    """(first, count): the K/V tiles a Q tile walks, from the one holding ``first_key`` (its first
    row's first visible key) to the one holding ``last_key`` (its last row's last); ``count`` is 0
    when the tile sees no key."""
    end = kv_tiles_seen(last_key, n_kv_tiles, block_n)
    if window[0] >= 0:
        first = first_kv_tile(first_key, block_n, window)
        return first, max(0, end - first)
    return 0, end


@device_jit
def tile_hidden(col0, block_n, first_key, last_key, window):
    """Is the ``block_n``-key tile at ``col0`` hidden from every row whose visible keys lie in
    ``[first_key, last_key]`` (a Q tile's: its first row's first, its last row's last)?"""
    if window[0] >= 0:
        return col0 > last_key or col0 + block_n - 1 < first_key
    return col0 > last_key


@device_jit
def first_q_tile(col0, n_q, n_k, block_m, window):
    """The first Q tile with a row that sees key ``col0`` (the S^T walks start there)."""
    if window[1] >= 0:
        return max(0, col0 - diagonal(n_q, n_k) - window[1]) // block_m  # (col0 < Nk: first_visible_query's)
    return 0


@device_jit
def q_tiles_end(last_col, n_q, n_k, block_m, n_q_tiles, window):
    """The end of the Q tiles that see some key up to ``last_col`` (a K/V tile's last key below
    Nk): the tile after the last query that sees it (a left bound); all ``n_q_tiles`` without one."""
    if window[0] >= 0:
        last = last_visible_query(last_col, n_q, n_k, window)
        if last < 0:
            return 0
        return min(n_q_tiles, last // block_m + 1)
    return n_q_tiles


@functools.lru_cache(maxsize=None)
def tile_masker(n_i: int, n_j: int, key_of, row_of):
    """The masking routine of an engine's register tile ``s`` (``n_i x n_j`` entries per thread):
    entry ``(i, j)`` holds key ``col0 + key_of(i, j)`` of the row that sees keys
    ``[first_keys[r], last_keys[r]]``, ``r = row_of(i, j)`` (from :func:`row_bounds`); hidden
    entries become ``-inf``. ``key_of`` and ``row_of`` are the engine's device functions: the
    layout is the engine's, the rule is this module's."""

    @device_jit
    def mask_tile(s, col0, first_keys, last_keys, window):
        for i in range(n_i):
            for j in range(n_j):
                r = row_of(i, j)
                if key_hidden(col0 + key_of(i, j), first_keys[r], last_keys[r], window):
                    s[i, j] = float32(NEG_INF)

    return mask_tile


@functools.lru_cache(maxsize=None)
def row_bounds(rows: int, thread_row):
    """``row_key_bounds(row0, n_q, n_k, window, first_keys, last_keys, rows_per_query)``: the
    first and last visible key of each of a thread's ``rows`` rows (tile row ``thread_row(i)``
    from ``row0``; ``first_keys`` is written only with a left bound)."""

    @device_jit
    def row_key_bounds(row0, n_q, n_k, window, first_keys, last_keys, rows_per_query):
        for i in range(rows):
            row = row0 + thread_row(i)
            last_keys[i] = packed_last_visible_key(row, rows_per_query, n_q, n_k, window)
            if window[0] >= 0:
                first_keys[i] = packed_first_visible_key(row, rows_per_query, n_q, n_k, window)

    return row_key_bounds
