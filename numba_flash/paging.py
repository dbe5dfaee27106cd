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
from numba_flash.arrays import ArrayContext, as_cupy_view, dtype_name, from_host, is_contiguous, kind_of, to_host

PAGE_MULTIPLE = 16  # page sizes the kernels take: multiples of this many keys (API.md 2e)


@dataclass(frozen=True)
class PagedCache:
    """A checked paged cache as one decode call's kernels take it."""

    k: tuple  # (pages, block_table): pages (num_blocks, Hkv, page_size, D), a view of k_cache
    v: tuple
    lengths: object  # int32 (B,) keys per sequence (appended ones counted), of the inputs' library
    page_size: int
    k_shape: object  # (B, Hkv, max_blocks * page_size, D) views that read nothing: the shapes the
    v_shape: object  # attention checks (``problem.describe``) see
    appends: tuple = ()  # the arguments of ``_append`` when k_new / v_new are given

    def append(self) -> None:
        """Write ``k_new``, ``v_new`` into their pages (once every check of the call has passed)."""
        if self.appends:
            _append(*self.appends)


def paged_cache(q, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new) -> PagedCache:
    """``decode``'s paged arguments checked (``TypeError`` / ``ValueError`` naming the argument)
    and the kernels' views; ``k_new`` / ``v_new`` are written by :meth:`PagedCache.append`."""
    arrays = {name: as_cupy_view(x, name) for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))}
    kind = kind_of(arrays["q"])
    for name in ("k_cache", "v_cache"):
        if kind_of(arrays[name]) != kind:
            raise TypeError(f"{name} must be an array of q's library ({kind})")
    # the table: an array of q's library, or on the host (a NumPy array or a list: copied once, it is read anyway)
    table = np.asarray(block_table) if isinstance(block_table, (list, tuple)) else as_cupy_view(block_table,
                                                                                               "block_table")
    table_kind = kind_of(table)
    if table_kind not in (kind, "numpy"):
        raise TypeError(f"block_table must be an array of q's library ({kind}) or a NumPy array; got {table_kind}")
    arrays["block_table"] = table
    k_cache, v_cache, table = arrays["k_cache"], arrays["v_cache"], arrays["block_table"]
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D (num_blocks, page_size, kv_heads, head_dim) with a block_table; "
                             f"got shape {tuple(x.shape)}")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must have the same shape; got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    num_blocks, page_size, kv_heads, head_dim = (int(n) for n in k_cache.shape)
    if page_size < PAGE_MULTIPLE or page_size % PAGE_MULTIPLE:
        raise ValueError(f"page_size (axis 1 of k_cache) must be a positive multiple of {PAGE_MULTIPLE}; "
                         f"got {page_size}")
    if len(arrays["q"].shape) != 4:
        raise ValueError(f"q must be 4-D (batch, heads, seq, head_dim); got shape {tuple(arrays['q'].shape)}")
    batch = int(arrays["q"].shape[0])
    if len(table.shape) != 2 or int(table.shape[0]) != batch:
        raise ValueError(f"block_table must have shape (B, max_blocks) with q's batch B = {batch}; got "
                         f"{tuple(table.shape)}")
    if not dtype_name(table, table_kind).startswith(("int", "uint")):
        raise TypeError(f"block_table must hold integers (int32); got {dtype_name(table, table_kind)}")
    max_blocks = int(table.shape[1])
    new = _new_keys(k_new, v_new, kind, batch, kv_heads, head_dim, dtype_name(k_cache, kind))
    n_new = 0 if new is None else int(new[0].shape[2])

    ctx = ArrayContext(kind, k_cache)
    host_table = checks.integer_array(_host(table, table_kind), "block_table")
    if cache_seqlens is None:
        cached = np.full(batch, max_blocks * page_size, dtype=np.int64)
    else:
        lengths = cache_seqlens if isinstance(cache_seqlens, (list, tuple)) else as_cupy_view(cache_seqlens,
                                                                                             "cache_seqlens")
        lengths_kind = "list" if isinstance(lengths, (list, tuple)) else kind_of(lengths)
        host = checks.integer_array(lengths if lengths_kind in ("list", "numpy") else to_host(lengths, lengths_kind),
                                    "cache_seqlens")
        if host.shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape ({batch},); got {host.shape}")
        cached = np.maximum(host, 0)  # (decode's contiguous caches clamp the same way)
    total = checks.paged_cache(host_table, cached, n_new, page_size, num_blocks, cache_seqlens is not None)

    with ctx.on_device():
        if not (table_kind == kind and dtype_name(table, kind) == "int32" and is_contiguous(table, kind)):
            table = from_host(np.ascontiguousarray(host_table.astype(np.int32)), kind, ctx)
        lengths = from_host(np.ascontiguousarray(total.astype(np.int32)), kind, ctx)
    k_pages, v_pages = k_cache.swapaxes(1, 2), v_cache.swapaxes(1, 2)
    logical = (batch, kv_heads, max_blocks * page_size, head_dim)
    appends = (k_cache, v_cache, *new, host_table, cached, page_size, kind, ctx) if n_new else ()
    return PagedCache((k_pages, table), (v_pages, table), lengths, page_size,
                      _shape_only(k_cache, logical, kind), _shape_only(v_cache, logical, kind), appends)


def _new_keys(k_new, v_new, kind: str, batch: int, kv_heads: int, head_dim: int, dtype: str):
    """``(k_new, v_new)`` checked against the cache, or ``None`` without them."""
    if k_new is None and v_new is None:
        return None
    if k_new is None or v_new is None:
        raise ValueError("k_new and v_new go together: give both or neither")
    new = tuple(as_cupy_view(x, name) for x, name in ((k_new, "k_new"), (v_new, "v_new")))
    n_new = int(new[0].shape[2]) if len(new[0].shape) == 4 else -1
    for name, x in zip(("k_new", "v_new"), new):
        if kind_of(x) != kind:
            raise TypeError(f"{name} must be an array of the caches' library ({kind})")
        want = (batch, kv_heads, n_new, head_dim)
        if tuple(int(n) for n in x.shape) != want or n_new < 0:
            raise ValueError(f"{name} must have shape (B, Hkv, Nnew, D) = {want} (the caches' heads and head dim, "
                             f"q's batch, k_new's Nnew); got {tuple(x.shape)}")
        if dtype_name(x, kind) != dtype:
            raise TypeError(f"{name} must have the caches' dtype {dtype}; got {dtype_name(x, kind)}")
    return new


def _append(k_cache, v_cache, k_new, v_new, table: np.ndarray, cached: np.ndarray, page_size: int, kind: str, ctx):
    """Sequence ``b``'s new keys ``t`` into page ``table[b, j // page_size]``, row ``j %
    page_size``, ``j = cached[b] + t``: one scatter per cache (``checks.paged_cache`` has
    checked every page and that no written row is read as another key)."""
    batch, kv_heads, n_new, head_dim = (int(n) for n in k_new.shape)
    keys = cached[:, None] + np.arange(n_new)[None, :]  # (B, Nnew)
    pages = np.take_along_axis(table, keys // page_size, axis=1).reshape(-1)
    rows = (keys % page_size).reshape(-1)
    with ctx.on_device():
        pages, rows = (from_host(np.ascontiguousarray(x.astype(np.int64)), kind, ctx) for x in (pages, rows))
        for cache, new in ((k_cache, k_new), (v_cache, v_new)):
            # (B, Hkv, Nnew, D) -> (B * Nnew, Hkv, D): sequence b's key t at b * Nnew + t
            cache[pages, rows] = new.swapaxes(1, 2).reshape(batch * n_new, kv_heads, head_dim)


def _host(x, kind: str) -> np.ndarray:
    return np.asarray(x) if kind == "numpy" else to_host(x, kind)


def _shape_only(x, shape: tuple, kind: str):
    """A view of ``x`` with ``shape`` and zero strides where ``x`` has no such extent: an array of
    ``x``'s library, dtype and device for checks that read shapes (never its elements)."""
    if kind == "torch":
        return x.as_strided(shape, (0, 0, 0, 0))
    if kind == "numpy":
        return np.lib.stride_tricks.as_strided(x, shape, (0, 0, 0, 0), writeable=False)
    import cupy

    return cupy.lib.stride_tricks.as_strided(x, shape, (0, 0, 0, 0))
