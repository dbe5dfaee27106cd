"""``numba_flash.decode``: a few queries against a KV cache (API.md section 2b).

Decoding is the FA-2 forward kernel in two changed roles, both arguments of the same kernel
(``kernels.fa2`` / ``kernels.tc_fa2``):

- **GQA packing.** The ``group = H / Hkv`` query heads that share a KV head become rows of one
  problem: ``q (B, H, Nq, D)`` is viewed as ``(B, Hkv, Nq * group, D)`` with row
  ``position * group + head`` (a view when ``Nq = 1``, a small copy otherwise), so one block
  loads each K/V tile once for all of them. The kernel maps a row back to its query position
  (``rows_per_query = group``) for the causal mask (``row_state.packed_last_visible_key``).
- **Ragged caches.** ``cache_seqlens[b]`` is the number of valid keys of sequence ``b``: the
  kernel reads it as that batch's key count, so keys at or past it are never loaded, and the
  causal mask aligns the queries to the end of the valid keys (bottom-right).

Few query rows make few blocks (B * Hkv Q tiles: 8 for B1 Hkv8), so the keys are split
(``split_kv``; ``num_splits=None``: the heuristic fills the GPU) and the partials merged by
``kernels.combine``. float16 and bfloat16 run on tensor cores, float32 on CUDA cores.
"""

from __future__ import annotations

import numpy as np

from numba_flash.arrays import ArrayContext, as_cupy_view, dtype_name, kind_of

DECODE_BLOCK_N = 64  # K/V rows per tile: 16 KiB of K (and of V) per tile at D = 128, 16-bit


def decode(q, k_cache, v_cache, *, cache_seqlens=None, causal=False, scale=None, num_splits=None, return_lse=False):
    """Attention of ``Nq`` new queries per sequence to a KV cache.

    ``q``: ``(B, H, Nq, D)``, small ``Nq``; ``k_cache``, ``v_cache``: ``(B, Hkv, Nmax, D)``,
    ``H % Hkv == 0``. ``cache_seqlens``: int32 ``(B,)`` valid lengths (default: all ``Nmax``;
    values are clamped to ``[0, Nmax]``; any integer array-like is accepted and converted to
    int32 in the inputs' library); keys at positions ``>= cache_seqlens[b]`` are never read,
    and a sequence of length 0 gives ``o = 0``, ``lse = -inf``. ``causal=True``: query ``i`` of
    ``Nq`` sees keys ``j <= cache_seqlens[b] - Nq + i``. ``num_splits``: as in
    :func:`numba_flash.attention` (``None``: heuristic). float16, bfloat16, float32; arrays as
    :func:`numba_flash.attention` takes them. Returns ``o`` (q's shape and dtype), or
    ``(o, lse)`` with ``return_lse=True`` (``lse`` float32 ``(B, H, Nq)``, natural log).
    """
    from numba_flash import api
    from numba_flash.split_kv import check_num_splits

    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool; got {type(return_lse).__name__}")
    q, k_cache, v_cache = (as_cupy_view(x) for x in (q, k_cache, v_cache))
    kinds = {kind_of(x) for x in (q, k_cache, v_cache)}
    if len(kinds) != 1:
        raise TypeError("q, k_cache and v_cache must be arrays of one library")
    kind = kinds.pop()
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim); got shape {tuple(x.shape)}")
    B, H, Nq, D = (int(n) for n in q.shape)
    Hkv = int(k_cache.shape[1])
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q's heads ({H}) must be a multiple of the cache's heads ({Hkv})")
    group = H // Hkv
    rows = Nq * group
    block_m, block_n = _decode_tiles(dtype_name(q, kind), rows, D)
    # Every check of attention (shapes, dtypes, scale, tiles), on the packed problem.
    packed = _pack(q, kind, group)
    call = api._validate(packed, k_cache, v_cache, causal, scale, "fa2", block_m, block_n)
    call["num_splits"] = check_num_splits(num_splits, "fa2")
    ctx = ArrayContext(kind, q)
    with ctx.on_device():
        seqlens = _check_seqlens(cache_seqlens, B, kind, ctx)
        o_packed = ctx.empty((B, Hkv, rows, D), call["dtype"])
        lse_packed = ctx.empty((B, Hkv, rows), "float32")
        if B * rows:
            if call["n_k"] == 0:
                o_packed[...] = 0
                lse_packed[...] = -np.inf
            else:
                api.run(ctx, call, packed, k_cache, v_cache, o_packed, lse_packed, None, seqlens, rows_per_query=group)
        o, lse = _unpack(o_packed, kind, group, Nq), _unpack(lse_packed[..., None], kind, group, Nq)[..., 0]
    return (o, lse) if return_lse else o


def _decode_tiles(dtype: str, rows: int, head_dim: int):
    """(block_m, block_n) of a decode call: the fewest 16-row warps that hold the packed rows
    (at most 4), and K/V tiles of 64 rows; float32 (CUDA cores): the defaults."""
    from numba_flash._world import simulated

    if dtype == "float32":
        return None, None
    if simulated():
        return 16, 16
    block_m = 16
    while block_m < min(rows, 64):
        block_m *= 2
    return block_m, DECODE_BLOCK_N


def _check_seqlens(cache_seqlens, batch: int, kind: str, ctx):
    """``cache_seqlens`` as an int32 ``(B,)`` array of the inputs' library (``None``: none)."""
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, (list, tuple)):
        lengths, lengths_kind = cache_seqlens, "list"
    else:
        lengths = as_cupy_view(cache_seqlens)
        lengths_kind = kind_of(lengths)
    if tuple(np.shape(lengths) if lengths_kind == "list" else lengths.shape) != (batch,):
        raise ValueError(f"cache_seqlens must have shape ({batch},); got {tuple(np.shape(lengths))}")
    if lengths_kind != kind or dtype_name(lengths, kind) != "int32" or not _contiguous(lengths, kind):
        host = lengths if lengths_kind in ("list", "numpy") else _to_host(lengths, lengths_kind)
        host = np.asarray(host)
        if host.size and not np.issubdtype(host.dtype, np.integer):
            raise TypeError(f"cache_seqlens must hold integers; got {host.dtype}")
        host = np.ascontiguousarray(np.clip(host, 0, np.iinfo(np.int32).max).astype(np.int32))
        lengths = _from_host(host, kind, ctx)
    return lengths


def _contiguous(x, kind):
    return x.is_contiguous() if kind == "torch" else x.flags.c_contiguous


def _to_host(x, kind):
    return x.cpu().numpy() if kind == "torch" else x.get()


def _from_host(x, kind, ctx):
    if kind == "numpy":
        return x
    if kind == "torch":
        import torch

        return torch.from_numpy(x).to(ctx.template.device)
    import cupy

    return cupy.asarray(x)


def _pack(q, kind: str, group: int):
    """``q (B, H, Nq, D)`` as ``(B, Hkv, Nq * group, D)``, row ``position * group + head``."""
    B, H, Nq, D = (int(n) for n in q.shape)
    if group == 1:
        return q
    grouped = q.reshape(B, H // group, group, Nq, D)
    if kind == "torch":
        return grouped.permute(0, 1, 3, 2, 4).reshape(B, H // group, Nq * group, D)
    return grouped.transpose(0, 1, 3, 2, 4).reshape(B, H // group, Nq * group, D)


def _unpack(x, kind: str, group: int, n_q: int):
    """The inverse of :func:`_pack` for a result ``(B, Hkv, Nq * group, X)``."""
    B, Hkv, _, X = (int(n) for n in x.shape)
    if group == 1:
        return x
    split = x.reshape(B, Hkv, n_q, group, X)
    if kind == "torch":
        return split.permute(0, 1, 3, 2, 4).reshape(B, Hkv * group, n_q, X)
    return split.transpose(0, 1, 3, 2, 4).reshape(B, Hkv * group, n_q, X)
