"""``decode``'s paged KV caches on the host (API.md section 2e): checks, appends, the kernels' views.

A paged cache is ``k_cache``, ``v_cache`` ``(num_blocks, page_size, Hkv, D)`` (FlashAttention's
layout, ``page_size`` a multiple of 16) and ``block_table`` ``(B, max_blocks)`` int32: sequence
``b``'s key ``j`` lives in page ``block_table[b, j // page_size]``, row ``j % page_size``. The
kernels read it in place (``kernels.paged``): each of ``k`` and ``v`` is passed as the pair
``(pages, block_table)``, ``pages`` the cache with its page-row and head axes swapped (a view).

Before anything is written or launched, every page a sequence uses is checked against the cache
(``checks.paged_cache``, shared with the float64 oracle): a table or lengths on the GPU cost one
synchronising copy to the host per call (FlashAttention checks neither; API.md asks for the
error before the launch). Appended keys (``k_new``, ``v_new``) are then written into their pages
in place, one scatter per cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numba_flash import checks
from numba_flash.arrays import (ArrayContext, as_cupy_view, device_id_of, dtype_name, from_host, host_values,
                                is_contiguous, kind_of)

PAGE_MULTIPLE = 16  # page sizes the kernels take: multiples of this many keys (API.md 2e)


@dataclass(frozen=True, eq=False)
class PageTable:
    """A block table checked against a paged cache and its sequences' lengths (API.md 2e), on the
    cache's device: what :func:`page_table` returns and ``decode(..., block_table=)`` takes in
    place of the table, reading nothing back (the checks were made once). A decode step calls
    every layer with one table: check it once, pass it to each layer's ``decode`` (as
    flashinfer's ``plan`` / ``run``). Valid for any cache of the same ``num_blocks`` and
    ``page_size`` (each layer's), a ``decode`` with ``n_new`` appended keys and no
    ``cache_seqlens`` (they are here)."""

    table: object  # int32 (B, max_blocks), C-contiguous, of the cache's library and device
    lengths: object  # int32 (B,): keys per sequence, the n_new appended ones counted
    page_size: int
    num_blocks: int
    n_new: int
    kind: str
    device_id: object  # the caches' GPU (arrays.device_id_of; None for NumPy)
    scatter: tuple  # (pages, rows), int64 (B * n_new,) on the device: where each appended key goes; ()

    @property
    def batch(self) -> int:
        return int(self.table.shape[0])


def page_table(k_cache, block_table, cache_seqlens=None, *, n_new: int = 0) -> PageTable:
    """``block_table`` ``(B, max_blocks)`` (an integer array of ``k_cache``'s library, or on the
    host) and ``cache_seqlens`` ``(B,)`` (``None``: every sequence holds ``max_blocks *
    page_size`` keys) checked against the paged ``k_cache`` ``(num_blocks, page_size, Hkv, D)``
    for a decode that appends ``n_new`` keys to each sequence (``checks.paged_cache``: every page
    a sequence uses is in the cache, no sequence runs past its table, no appended key lands on a
    row another key uses). ``ValueError`` / ``TypeError`` naming the argument. Reads the table and
    lengths once (one synchronising copy each when they are on the GPU)."""
    return _page_table(k_cache, block_table, cache_seqlens, checks.whole_number(n_new, "n_new"), None)


def _page_table(k_cache, block_table, cache_seqlens, n_new: int, batch) -> PageTable:
    """:func:`page_table`; ``batch``: q's (a table of another batch is named as such), or None."""
    k_cache = as_cupy_view(k_cache, "k_cache")
    kind = kind_of(k_cache)
    num_blocks, page_size = _paged_shape(k_cache, "k_cache")
    # the table: an array of the cache's library, or on the host (a NumPy array or a list: it is read anyway)
    table = np.asarray(block_table) if isinstance(block_table, (list, tuple)) else as_cupy_view(block_table,
                                                                                               "block_table")
    table_kind = kind_of(table)
    if table_kind not in (kind, "numpy"):
        raise TypeError(f"block_table must be an array of the caches' library ({kind}) or a NumPy array; got "
                        f"{table_kind}")
    if len(table.shape) != 2 or (batch is not None and int(table.shape[0]) != batch):
        whose = "" if batch is None else f" with q's batch B = {batch}"
        raise ValueError(f"block_table must have shape (B, max_blocks){whose}; got {tuple(table.shape)}")
    if not dtype_name(table, table_kind).startswith(("int", "uint")):
        raise TypeError(f"block_table must hold integers (int32); got {dtype_name(table, table_kind)}")
    batch, max_blocks = (int(n) for n in table.shape)
    host_table = checks.integer_array(host_values(table, "block_table"), "block_table")
    if cache_seqlens is None:
        cached = np.full(batch, max_blocks * page_size, dtype=np.int64)
    else:
        host = checks.integer_array(host_values(cache_seqlens, "cache_seqlens"), "cache_seqlens")
        if host.shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape ({batch},); got {host.shape}")
        cached = np.maximum(host, 0)  # (decode's contiguous caches clamp the same way)
    total = checks.paged_cache(host_table, cached, n_new, page_size, num_blocks, cache_seqlens is not None)

    ctx = ArrayContext(kind, k_cache)
    with ctx.on_device():
        if not (table_kind == kind and dtype_name(table, kind) == "int32" and is_contiguous(table, kind)):
            table = from_host(np.ascontiguousarray(host_table.astype(np.int32)), kind, ctx)
        lengths = from_host(np.ascontiguousarray(total.astype(np.int32)), kind, ctx)
        scatter = ()
        if n_new and batch:  # sequence b's new key t: key j = cached[b] + t, page table[b, j // P], row j % P
            keys = cached[:, None] + np.arange(n_new)[None, :]
            pages = np.take_along_axis(host_table, keys // page_size, axis=1).reshape(-1)
            scatter = tuple(from_host(np.ascontiguousarray(x.astype(np.int64)), kind, ctx)
                            for x in (pages, (keys % page_size).reshape(-1)))
    return PageTable(table, lengths, page_size, num_blocks, n_new, kind, device_id_of(k_cache, kind), scatter)


@dataclass(frozen=True)
class PagedCache:
    """A checked paged cache as one decode call's kernels take it (the views made when asked: a
    planned call reads only the caches' pointers)."""

    k_cache: object  # (num_blocks, page_size, Hkv, D), as the caller gave them (CuPy views of CAI / DLPack)
    v_cache: object
    table: PageTable
    kind: str
    new: tuple = ()  # (k_new, v_new) when keys are appended

    page_size = property(lambda self: self.table.page_size)
    lengths = property(lambda self: self.table.lengths)

    @property
    def k(self) -> tuple:
        """``(pages, block_table)``: pages ``(num_blocks, Hkv, page_size, D)``, a view of k_cache."""
        return self.k_cache.swapaxes(1, 2), self.table.table

    @property
    def v(self) -> tuple:
        return self.v_cache.swapaxes(1, 2), self.table.table

    def shapes(self) -> tuple:
        """``(B, Hkv, max_blocks * page_size, D)`` views of the caches that read nothing: the
        shapes the attention checks (``problem.describe``) see."""
        _, _, kv_heads, head_dim = (int(n) for n in self.k_cache.shape)
        logical = (self.table.batch, kv_heads, int(self.table.table.shape[1]) * self.page_size, head_dim)
        return _shape_only(self.k_cache, logical, self.kind), _shape_only(self.v_cache, logical, self.kind)

    def append(self) -> None:
        """Write ``k_new``, ``v_new`` into their pages (once every check of the call has passed):
        one scatter per cache (the page table has checked that no written row is read as another key)."""
        if not self.new:
            return
        k_new, v_new = self.new
        pages, rows = self.table.scatter
        batch, kv_heads, n_new, head_dim = (int(n) for n in k_new.shape)
        for cache, new in ((self.k_cache, k_new), (self.v_cache, v_new)):
            # (B, Hkv, Nnew, D) -> (B * Nnew, Hkv, D): sequence b's key t at b * Nnew + t
            cache[pages, rows] = new.swapaxes(1, 2).reshape(batch * n_new, kv_heads, head_dim)


def paged_cache(q, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new) -> PagedCache:
    """``decode``'s paged arguments checked (``TypeError`` / ``ValueError`` naming the argument)
    and the kernels' views; ``k_new`` / ``v_new`` are written by :meth:`PagedCache.append`.
    ``block_table``: an array (checked here: :func:`page_table`) or a :class:`PageTable`."""
    arrays = {name: as_cupy_view(x, name) for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))}
    kind = kind_of(arrays["q"])
    for name in ("k_cache", "v_cache"):
        if kind_of(arrays[name]) != kind:
            raise TypeError(f"{name} must be an array of q's library ({kind})")
    k_cache, v_cache = arrays["k_cache"], arrays["v_cache"]
    num_blocks, page_size = _paged_shape(k_cache, "k_cache")
    _paged_shape(v_cache, "v_cache")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must have the same shape; got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    kv_heads, head_dim = (int(n) for n in k_cache.shape[2:])
    if len(arrays["q"].shape) != 4:
        raise ValueError(f"q must be 4-D (batch, heads, seq, head_dim); got shape {tuple(arrays['q'].shape)}")
    batch = int(arrays["q"].shape[0])
    new = new_keys(k_new, v_new, kind, batch, kv_heads, head_dim, dtype_name(k_cache, kind))
    n_new = 0 if new is None else int(new[0].shape[2])
    if isinstance(block_table, PageTable):
        table = block_table
        if cache_seqlens is not None:
            raise ValueError("cache_seqlens must be None with a PageTable: its lengths were checked with it")
        made = {"page_size": table.page_size, "num_blocks": table.num_blocks, "batch": table.batch,
                "n_new": table.n_new, "library": table.kind, "device": table.device_id}
        want = {"page_size": page_size, "num_blocks": num_blocks, "batch": batch, "n_new": n_new, "library": kind,
                "device": device_id_of(k_cache, kind)}
        for what, value in made.items():
            if value != want[what]:
                raise ValueError(f"block_table: a PageTable made for {what} {value}, used with {want[what]} "
                                 "(page_table checks a table for one cache shape, batch, count of appended keys "
                                 "and device)")
    else:
        table = _page_table(k_cache, block_table, cache_seqlens, n_new, batch)
    return PagedCache(k_cache, v_cache, table, kind, new if n_new else ())


def _paged_shape(cache, name: str) -> tuple:
    """(num_blocks, page_size) of a paged cache, checked: 4-D, page_size a multiple of 16."""
    if len(cache.shape) != 4:
        raise ValueError(f"{name} must be 4-D (num_blocks, page_size, kv_heads, head_dim) with a block_table; "
                         f"got shape {tuple(cache.shape)}")
    num_blocks, page_size = int(cache.shape[0]), int(cache.shape[1])
    if page_size < PAGE_MULTIPLE or page_size % PAGE_MULTIPLE:
        raise ValueError(f"page_size (axis 1 of {name}) must be a positive multiple of {PAGE_MULTIPLE}; "
                         f"got {page_size}")
    return num_blocks, page_size


def new_keys(k_new, v_new, kind: str, batch: int, kv_heads: int, head_dim: int, dtype: str):
    """``decode``'s appended keys ``(k_new, v_new)`` checked against the caches (either layout:
    ``batch``, ``kv_heads``, ``head_dim`` and ``dtype`` are theirs), as CuPy views where they are
    CAI or DLPack objects; ``None`` without them."""
    if k_new is None and v_new is None:
        return None
    if k_new is None or v_new is None:
        raise ValueError("k_new and v_new go together: give both or neither")
    new = tuple(as_cupy_view(x, name) for x, name in ((k_new, "k_new"), (v_new, "v_new")))
    n_new = int(new[0].shape[2]) if len(new[0].shape) == 4 else -1
    for name, cache, x in (("k_new", "k_cache", new[0]), ("v_new", "v_cache", new[1])):
        if kind_of(x) != kind:
            raise TypeError(f"{name} must be an array of the caches' library ({kind})")
        want = (batch, kv_heads, n_new, head_dim)
        if tuple(int(n) for n in x.shape) != want or n_new < 0:
            raise ValueError(f"{name} must have shape {want} (B, Hkv, Nnew, D: the caches' batch, heads and head "
                             f"dim, and k_new's Nnew); got {tuple(x.shape)}")
        if dtype_name(x, kind) != dtype:
            raise TypeError(f"{name} must have {cache}'s dtype {dtype}; got {dtype_name(x, kind)}")
    return new


def _shape_only(x, shape: tuple, kind: str):
    """A view of ``x`` with ``shape`` and zero strides where ``x`` has no such extent: an array of
    ``x``'s library, dtype and device for checks that read shapes (never its elements)."""
    if kind == "torch":
        return x.as_strided(shape, (0, 0, 0, 0))
    if kind == "numpy":
        return np.lib.stride_tricks.as_strided(x, shape, (0, 0, 0, 0), writeable=False)
    import cupy

    return cupy.lib.stride_tricks.as_strided(x, shape, (0, 0, 0, 0))
