"""Checks of scalar arguments that several host modules take, with one wording for their errors."""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np

__all__ = ["integer_array", "paged_cache", "sequence_bounds", "softcap_value", "whole_number"]


def whole_number(value, name: str, minimum: int | None = 0) -> int:
    """``value`` as a Python int (any integer type; not a bool): ``TypeError`` naming ``name``
    otherwise, and ``ValueError`` when it is below ``minimum`` (``None``: no bound)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def softcap_value(softcap) -> float:
    """``softcap`` (API.md 2c) as a float: ``TypeError`` unless a real number, ``ValueError``
    unless finite and >= 0 (0: off)."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
    value = float(softcap)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {value}")
    return value


def integer_array(x, name: str) -> np.ndarray:
    """An integer array-like on the host as an int64 NumPy array (``TypeError`` naming ``name``
    otherwise; an empty float array counts as integers)."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise TypeError(f"{name} must hold integers (int32), got dtype {arr.dtype}")
    return arr.astype(np.int64)


def sequence_bounds(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q: int, total_k: int):
    """A packed batch's prefix sums (API.md 2d; host array-likes) checked, as two lists of ``B +
    1`` ints: each starts at 0, never decreases and ends at its total; the maxima are at least
    the longest lengths (``TypeError`` / ``ValueError`` naming the argument)."""
    bounds = []
    for name, cu, max_name, max_len, total, rows in (
        ("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q, total_q, "q's total_q"),
        ("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k, total_k, "k's total_k"),
    ):
        cu = integer_array(cu, name)
        if cu.ndim != 1 or cu.size < 1:
            raise ValueError(f"{name} must be 1-D of length B + 1 >= 1 (prefix sums), got shape {cu.shape}")
        if cu[0] != 0 or cu[-1] != total or np.any(np.diff(cu) < 0):
            raise ValueError(
                f"{name} must start at 0, never decrease and end at {rows} = {total}; got {cu.tolist()}"
            )
        longest = int(np.diff(cu).max(initial=0))
        max_len = whole_number(max_len, max_name)
        if max_len < longest:
            raise ValueError(f"{max_name} = {max_len} is below the longest sequence in {name} ({longest})")
        bounds.append(cu.tolist())
    cu_q, cu_k = bounds
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_k must have cu_seqlens_q's length B + 1 = {len(cu_q)}, got {len(cu_k)}"
        )
    return cu_q, cu_k


def paged_cache(table: np.ndarray, cached: np.ndarray, n_new: int, page_size: int, num_blocks: int,
                given_lengths: bool = True) -> np.ndarray:
    """A paged cache's block table checked against the keys each sequence holds (API.md 2e), on
    the host: ``table`` ``(B, max_blocks)`` and ``cached`` ``(B,)`` (valid cached keys, >= 0) as
    int64 NumPy arrays, ``n_new`` keys appended to each sequence. Returns the keys each sequence
    then holds, ``cached + n_new``. ``ValueError`` naming the argument for: a sequence past the
    table's ``max_blocks * page_size`` keys; a page it uses (its first ``ceil(keys /
    page_size)`` entries) outside ``[0, num_blocks)``; an appended key written to a page row that
    another key (of this sequence or another) also uses, where the in-place append would change
    what is read. ``given_lengths``: ``cache_seqlens`` was given (else the cache counts as full).
    The entries past a sequence's pages are never read (they may hold anything, e.g. -1)."""
    batch, max_blocks = table.shape
    capacity = max_blocks * page_size
    total = cached + n_new
    over = np.flatnonzero(total > capacity)
    if over.size:
        b = int(over[0])
        hint = "" if given_lengths else " (cache_seqlens=None: the cache is full)"
        raise ValueError(f"cache_seqlens[{b}] + Nnew = {cached[b]} + {n_new} is past block_table's max_blocks * "
                         f"page_size = {capacity}{hint}")
    n_pages = -(-total // page_size)
    used = np.arange(max_blocks)[None, :] < n_pages[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_table[{b}, {j}] = {table[b, j]} is not a page of k_cache (num_blocks = {num_blocks}); "
                         f"sequence {b} uses its first {n_pages[b]} entries")
    if n_new and batch:
        # The rows written, and every row in use on a page they are on: a row twice, one written, clashes.
        positions = cached[:, None] + np.arange(n_new)[None, :]
        written_pages = np.take_along_axis(table, positions // page_size, axis=1)
        seqs, entries = np.nonzero(used & np.isin(table, written_pages))
        keys = entries[:, None] * page_size + np.arange(page_size)[None, :]  # the keys on those pages
        live = keys < total[seqs][:, None]
        slots = (table[seqs, entries][:, None] * page_size + np.arange(page_size)[None, :])[live]
        written = (keys >= cached[seqs][:, None])[live]
        shared, counts = np.unique(slots, return_counts=True)
        clash = np.intersect1d(shared[counts > 1], slots[written])
        if clash.size:
            page, row = divmod(int(clash[0]), page_size)
            raise ValueError(f"block_table: an appended key (k_new) is written to page {page} row {row}, which "
                             "another key also uses; the in-place append would change what is read")
    return total
