"""Which keys a query row sees: the visibility rule of every kernel, stated once (device side).

The rule (API.md section 2; FlashAttention >= 2.1, bottom-right aligned): query ``i`` sees key
``j`` iff ``j < Nk`` and, with ``causal=True``, ``j <= i + (Nk - Nq)``. In FlashAttention's window
form ``(left, right)`` that is ``left = -1`` (unbounded) and ``right = 0`` (causal) or ``-1``
(none); the host twin, with the whole window form, is ``numba_flash.masking``. A row that sees no
key gets ``o = 0`` and ``lse = -inf`` (``softmax``), never NaN.

Everything a kernel asks about the mask is answered here, in the two directions it asks:

- rows of S (the forward, the backward's dQ kernel): :func:`last_visible_key` of a query row;
  a key is hidden iff :func:`key_hidden` (past that bound);
- rows of S^T (the backward's dK/dV kernels, one key per row): :func:`first_visible_query` of a
  key; a query is hidden iff :func:`query_hidden` (before that bound) -- the same rule, solved
  for the other index;
- whole tiles: :func:`tile_needs_mask` (does any entry of a K/V tile need the elementwise test:
  only diagonal and tail tiles do), :func:`kv_tiles_seen` (how many K/V tiles a Q tile walks
  before every key is hidden), :func:`first_q_tile` (the first Q tile that sees a K/V tile);
- one routine applies it to a thread's tile of scores, whatever the engine's register layout:
  :func:`tile_masker` (each engine says which key and which row an entry of its tile holds).

Adding a mask (a window, a user ``mask_mod``) changes these functions and ``masking``, and no
loop nest: the loops only ask the questions above.
"""

from __future__ import annotations

import functools

from numba_flash._cuda import float32

from numba_flash.kernels.jit import NEG_INF, device_jit

NEVER = 1 << 30  # first visible query of a key that no query sees (past Nk): after every row


@device_jit
def diagonal(n_q, n_k):
    """The key on query 0's diagonal: ``Nk - Nq`` (bottom-right alignment; query ``i``'s is
    ``i + diagonal``). Every bound below is this offset, solved for a row or a key."""
    return n_k - n_q


@device_jit
def last_visible_key(row, n_q, n_k, causal):
    """Index of the last key query ``row`` may see: ``row + (Nk - Nq)`` with the causal mask
    (bottom-right aligned), else ``Nk - 1``; negative when the row sees no key."""
    if causal:
        return min(n_k - 1, row + diagonal(n_q, n_k))
    return n_k - 1


@device_jit
def packed_last_visible_key(row, rows_per_query, n_rows, n_k, causal):
    """:func:`last_visible_key` of kernel row ``row`` when each query position owns
    ``rows_per_query`` consecutive rows (decoding packs the query heads of one KV head that
    way: row = position * group + head); ``n_rows`` rows in all. 1: one row per query."""
    return last_visible_key(row // rows_per_query, n_rows // rows_per_query, n_k, causal)


@device_jit
def first_visible_query(key, n_q, n_k, causal):
    """The first query that sees ``key`` (the rule solved for the query: ``i >= j - (Nk - Nq)``
    with the causal mask, else 0); :data:`NEVER` for a key past ``Nk``."""
    first = 0
    if causal:
        first = key - diagonal(n_q, n_k)
    if key >= n_k:
        first = NEVER
    return first


@device_jit
def key_hidden(key, last_key):
    """Is ``key`` hidden from the row whose last visible key is ``last_key``?"""
    return key > last_key


@device_jit
def query_hidden(query, first_query):
    """Is ``query`` hidden from the key whose first visible query is ``first_query``?"""
    return query < first_query


@device_jit
def tile_needs_mask(col0, block_n, first_row_last_key):
    """Does any key of the ``block_n``-key tile at ``col0`` lie past some row's last visible key?
    (``first_row_last_key``: the tile's first row's, the smallest. Block-uniform: only diagonal
    and tail tiles pay for the elementwise mask.)"""
    return col0 + block_n - 1 > first_row_last_key


@device_jit
def kv_tiles_seen(last_key, n_kv_tiles, block_n):
    """The K/V tiles ``[0, n)`` a Q tile walks: up to the one holding ``last_key`` (its last
    row's last visible key; FA-2 section 3.1.1 skips the rest), 0 when no key is visible."""
    if last_key >= 0:
        return min(n_kv_tiles, last_key // block_n + 1)
    return 0


@device_jit
def first_q_tile(col0, n_q, n_k, block_m, causal):
    """The first Q tile with a row that sees key ``col0`` (the S^T walks start there)."""
    if causal:
        return max(0, col0 - diagonal(n_q, n_k)) // block_m  # (col0 < Nk: first_visible_query's)
    return 0


@functools.lru_cache(maxsize=None)
def tile_masker(n_i: int, n_j: int, key_of, row_of):
    """The masking routine of an engine's register tile ``s`` (``n_i x n_j`` entries per thread):
    entry ``(i, j)`` holds key ``col0 + key_of(i, j)`` of the row whose last visible key is
    ``last_keys[row_of(i, j)]`` (from :func:`row_bounds`); hidden entries become ``-inf``.
    ``key_of`` and ``row_of`` are the engine's device functions: the layout is the engine's, the
    rule is this module's."""

    @device_jit
    def mask_tile(s, col0, last_keys):
        for i in range(n_i):
            for j in range(n_j):
                if key_hidden(col0 + key_of(i, j), last_keys[row_of(i, j)]):
                    s[i, j] = float32(NEG_INF)

    return mask_tile


@functools.lru_cache(maxsize=None)
def row_bounds(rows: int, thread_row):
    """``row_last_keys(row0, n_q, n_k, causal, last_keys, rows_per_query)``: the last visible key
    of each of a thread's ``rows`` rows (tile row ``thread_row(i)`` from ``row0``)."""

    @device_jit
    def row_last_keys(row0, n_q, n_k, causal, last_keys, rows_per_query):
        for i in range(rows):
            last_keys[i] = packed_last_visible_key(row0 + thread_row(i), rows_per_query, n_q, n_k, causal)

    return row_last_keys
