"""``numba_flash.decode``: a few queries against a KV cache (API.md section 2b).

Decoding is the FA-2 forward kernel in two changed roles, both arguments of the same kernel
(``kernels.fa2`` / ``kernels.tc_fa2``):

- **GQA packing.** The ``group = H / Hkv`` query heads that share a KV head become rows of one
  problem: ``q (B, H, Nq, D)`` is viewed as ``(B, Hkv, Nq * group, D)`` with row
  ``position * group + head`` (a view when ``Nq = 1``, a small copy otherwise), so one block
  loads each K/V tile once for all of them. The kernel maps a row back to its query position
  (``rows_per_query = group``) for the causal mask (``kernels.mask.packed_last_visible_key``).
- **Ragged caches.** ``cache_seqlens[b]`` is the number of valid keys of sequence ``b``: the
  kernel reads it as that batch's key count, so keys at or past it are never loaded, and the
  causal mask aligns the queries to the end of the valid keys (bottom-right).

Few query rows make few blocks (B * Hkv Q tiles: 8 for B1 Hkv8), so the keys are split
(``split_kv``; ``num_splits=None``: the heuristic fills the GPU) and the partials merged by
``kernels.combine``. float16 and bfloat16 run on tensor cores, float32 on CUDA cores.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from numba_flash import api, paging, plans, tile_cache
from numba_flash.tile_table import decode_pipeline, decode_tiles
from numba_flash.alibi import check_slopes
from numba_flash.user_mods import none_given
from numba_flash.arrays import (ArrayContext, array_signature, as_cupy_view, dtype_name, from_host, is_contiguous,
                                kind_of, pointer_reader, to_host)
from numba_flash.problem import describe
from numba_flash.split_kv import check_num_splits


def decode(q, k_cache, v_cache, *, cache_seqlens=None, causal=False, scale=None, num_splits=None, return_lse=False,
           block_table=None, k_new=None, v_new=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
           mask_mod=None, score_mod=None, mod_args=()):
    """Attention of ``Nq`` new queries per sequence to a KV cache.

    ``q``: ``(B, H, Nq, D)``, small ``Nq``; ``k_cache``, ``v_cache``: ``(B, Hkv, Nmax, D)``,
    ``H % Hkv == 0``. ``cache_seqlens``: int32 ``(B,)`` valid lengths (default: all ``Nmax``;
    values are clamped to ``[0, Nmax]``; any integer array-like is accepted and converted to
    int32 in the inputs' library); keys at positions ``>= cache_seqlens[b]`` are never read,
    and a sequence of length 0 gives ``o = 0``, ``lse = -inf``. ``causal=True``: query ``i`` of
    ``Nq`` sees keys ``j <= cache_seqlens[b] - Nq + i``; ``window_size=(left, right)``: a sliding
    window aligned the same way (query ``i`` sees ``cache_seqlens[b] - Nq + i - left <= j <=
    cache_seqlens[b] - Nq + i + right``; -1: unbounded; with ``causal`` the intersection; the
    pages of K/V before the window are never read); ``softcap``, ``alibi_slopes`` (per query head; the bias's distance is measured from each query's
    position ``cache_seqlens[b] - Nq + i``), ``mask_mod``, ``score_mod``, ``mod_args`` (``q_idx``
    the query's index in ``0 .. Nq - 1``, ``kv_idx`` the key's position in the cache, ``h`` the query
    head): as in :func:`numba_flash.attention`. ``num_splits``: as in
    :func:`numba_flash.attention` (``None``: heuristic). float16, bfloat16, float32; arrays as
    :func:`numba_flash.attention` takes them. Returns ``o`` (q's shape and dtype), or
    ``(o, lse)`` with ``return_lse=True`` (``lse`` float32 ``(B, H, Nq)``, natural log).

    ``block_table``: ``(B, max_blocks)`` int32; the caches are then paged, ``(num_blocks,
    page_size, Hkv, D)`` (FlashAttention's layout, ``page_size`` a multiple of 16), and sequence
    ``b``'s key ``j`` lives in page ``block_table[b, j // page_size]``, row ``j % page_size``
    (``numba_flash.paging``; the kernels read the pages in place). ``cache_seqlens`` defaults to
    ``max_blocks * page_size``; a page a sequence uses outside ``[0, num_blocks)``, a length past
    the table, or an appended key written onto a row another key uses raise ``ValueError``
    before anything is written or launched (a table or lengths on the GPU: one synchronising
    copy to the host). Or a ``numba_flash.page_table(...)`` (``paging.PageTable``), checked once
    for every layer of a decode step: nothing is read back, and ``cache_seqlens`` is ``None``.

    ``k_new``, ``v_new``: ``(B, Hkv, Nnew, D)``, the caches' dtype and library: appended before
    attending -- written into ``k_cache``, ``v_cache`` in place at positions ``cache_seqlens[b] ..
    cache_seqlens[b] + Nnew - 1`` -- and attended with them (the lengths are ``cache_seqlens +
    Nnew``; ``causal`` aligns the queries to the end of them). ``cache_seqlens`` is read, not
    advanced: the caller advances it. Raises before any write when a sequence would run past
    ``Nmax`` (``cache_seqlens`` is then required). (The writes are one copy per sequence, apart
    from the attention kernel; FlashAttention fuses them.)
    """
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool; got {type(return_lse).__name__}")
    paged = None
    if block_table is not None:  # a paged cache: checked (every page it uses), appended to after every check
        paged = paging.paged_cache(q, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new)
    elif k_new is not None or v_new is not None:
        cache_seqlens = _append(k_cache, v_cache, k_new, v_new, cache_seqlens)
    key = None
    if alibi_slopes is None and none_given(mask_mod, score_mod, mod_args):  # (per-call arrays: not planned)
        if paged is None:
            key = _decode_key(q, k_cache, v_cache, cache_seqlens, causal, scale, num_splits, window_size, softcap)
        else:  # (the table's signature and page size too; its contents were checked above)
            key = _decode_key(q, k_cache, v_cache, paged.lengths, causal, scale, num_splits, window_size, softcap)
            table_key = array_signature(paged.table.table) if key is not None else None
            key = None if table_key is None else ("paged", key, table_key)
    plan = _DECODE_PLANS.get(key)
    caches = k_cache, v_cache  # (the caller's: a paged plan reads their pointers)
    if plan is None:  # a signature not seen before (or not plannable): every check
        if paged is not None:  # the checks below read the shapes a contiguous cache would have
            k_cache, v_cache = paged.shapes()
        q, k_cache, v_cache = (as_cupy_view(x, name) for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")))
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
            raise ValueError(f"q's heads ({H}) must be a multiple of k_cache's heads ({Hkv})")
        group = H // Hkv
        rows = Nq * group
        block_m, block_n = decode_tiles(dtype_name(q, kind), rows, D)
        # Every check of attention (shapes, dtypes, scale, tiles), on the packed problem.
        packed = _pack(q, kind, group)
        if isinstance(mod_args, (tuple, list)):
            mod_args = tuple(as_cupy_view(a, f"mod_args[{i}]") for i, a in enumerate(mod_args))
        call = api.configure(describe(packed, k_cache, v_cache, causal=causal, scale=scale, algorithm="fa2",
                                      names=("q", "k_cache", "v_cache"), window_size=window_size,
                                      softcap=softcap, mask_mod=mask_mod, score_mod=score_mod, mod_args=mod_args),
                             block_m, block_n)
        if alibi_slopes is not None:  # per query head: checked against q's heads, not the packed rows' KV heads
            alibi_slopes = as_cupy_view(alibi_slopes, "alibi_slopes")
            check_slopes(alibi_slopes, kind, B, H, call.problem.device_id)
            call = replace(call, problem=replace(call.problem, alibi_slopes=alibi_slopes, alibi=True))
        kv_stages, key_warps = decode_pipeline(block_m, block_n) if call.regime != "ieee" else (1, 1)
        call = replace(call, kv_stages=kv_stages, key_warps=key_warps, num_splits=check_num_splits(num_splits, "fa2"))
        ctx = ArrayContext(kind, q)
        if paged is not None:
            call = replace(call, page_size=paged.page_size)
            with ctx.on_device():
                paged.append()
                if key is not None:
                    plan = _plan_decode(ctx, call, q, packed, paged.k, paged.v, paged.lengths, group, None)
                if plan is None:
                    o, lse = _decode_unplanned(ctx, call, packed, paged.k, paged.v, paged.lengths, group, Nq)
                    return (o, lse) if return_lse else o
            _DECODE_PLANS.put(key, plan)
            return _launch_paged(plan, q, caches, paged, return_lse)
        with ctx.on_device():
            seqlens = _check_seqlens(cache_seqlens, B, kind, ctx)
            if key is not None and seqlens is cache_seqlens:  # lengths used as given: plannable
                tile_entries = tile_cache.load() if call.regime == "ieee" else None  # float32: tuned tiles
                plan = _plan_decode(ctx, call, q, packed, k_cache, v_cache, seqlens, group, tile_entries)
            if plan is None:
                o, lse = _decode_unplanned(ctx, call, packed, k_cache, v_cache, seqlens, group, Nq)
                return (o, lse) if return_lse else o
        _DECODE_PLANS.put(key, plan)
    if paged is not None:
        with plan.on_device():
            paged.append()
        return _launch_paged(plan, q, caches, paged, return_lse)
    arrays = (q, k_cache, v_cache) if cache_seqlens is None else (q, k_cache, v_cache, cache_seqlens)
    with plan.on_device():
        o, lse = plan.allocate()
        if not plan.launch((*arrays[:3], o, lse, *arrays[3:])):  # q, k or v not 16-byte aligned: copies
            _run_unaligned(plan.call, q, k_cache, v_cache, cache_seqlens, o, lse)
    return (o, lse) if return_lse else o


_DECODE_PLANS = plans.PlanCache()  # decode's plans by signature (_decode_key)


def _launch_paged(plan, q, caches, paged, return_lse):
    """A planned paged decode: q, the caches (their pointers are their pages views'), o, lse,
    the lengths and the block table; a misaligned input: the unplanned path, which copies."""
    with plan.on_device():
        o, lse = plan.allocate()
        if not plan.launch((q, *caches, o, lse, paged.lengths, paged.table.table)):
            call = plan.call
            group = int(q.shape[1]) // int(caches[0].shape[2])
            kind = call.kind
            o_packed, lse_packed = _pack(o, kind, group), _pack(lse[..., None], kind, group)[..., 0]
            api.run(ArrayContext(kind, q), call, _pack(q, kind, group), paged.k, paged.v, o_packed, lse_packed, None,
                    paged.lengths, rows_per_query=group)
    return (o, lse) if return_lse else o


def _append(k_cache, v_cache, k_new, v_new, cache_seqlens):
    """Write ``k_new``, ``v_new`` into the caches at each sequence's length (every check first,
    nothing written when one fails); the lengths after, int32 ``(B,)`` in the caches' library."""
    arrays = {name: as_cupy_view(x, name) for name, x in (("k_cache", k_cache), ("v_cache", v_cache))}
    kind = kind_of(arrays["k_cache"])
    for name, x in arrays.items():
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D (batch, kv_heads, seq, head_dim); got shape {tuple(x.shape)}")
    if kind_of(arrays["v_cache"]) != kind:
        raise TypeError(f"v_cache must be an array of k_cache's library ({kind})")
    c = arrays["k_cache"]
    v = arrays["v_cache"]
    if tuple(v.shape) != tuple(c.shape) or dtype_name(v, kind) != dtype_name(c, kind):
        raise ValueError(f"k_cache and v_cache must have the same shape and dtype; got {tuple(c.shape)} "
                         f"{dtype_name(c, kind)} and {tuple(v.shape)} {dtype_name(v, kind)}")
    arrays["k_new"], arrays["v_new"] = paging.new_keys(k_new, v_new, kind, int(c.shape[0]), int(c.shape[1]),
                                                       int(c.shape[3]), dtype_name(c, kind))
    n_new = int(arrays["k_new"].shape[2])
    batch, n_max = int(arrays["k_cache"].shape[0]), int(arrays["k_cache"].shape[2])
    if cache_seqlens is None:
        raise ValueError("k_new needs cache_seqlens: without it every sequence fills the cache, and nothing fits after")
    ctx = ArrayContext(kind, arrays["k_cache"])
    with ctx.on_device():
        lengths = _check_seqlens(cache_seqlens, batch, kind, ctx)  # (decode's own checks and conversion)
    host = np.asarray(lengths if kind == "numpy" else to_host(lengths, kind))
    start = np.clip(host.astype(np.int64), 0, n_max)  # (decode clamps lengths to [0, Nmax])
    over = np.flatnonzero(start + n_new > n_max)
    if over.size:
        b = int(over[0])
        raise ValueError(f"cache_seqlens[{b}] = {int(start[b])} plus Nnew = {n_new} runs past the cache's "
                         f"Nmax = {n_max}")
    if n_new:
        with ctx.on_device():
            for b, at in enumerate(start.tolist()):  # sequence b's new keys after its cached ones
                arrays["k_cache"][b, :, at : at + n_new] = arrays["k_new"][b]
                arrays["v_cache"][b, :, at : at + n_new] = arrays["v_new"][b]
    after = np.ascontiguousarray((start + n_new).astype(np.int32))
    return after if kind == "numpy" else from_host(after, kind, ctx)


def _decode_key(q, k_cache, v_cache, cache_seqlens, causal, scale, num_splits, window_size, softcap):
    """The signature of a decode call (``numba_flash.plans``); ``None`` when it has none
    (NumPy, CAI or DLPack objects, lengths given as a list)."""
    try:
        arrays = tuple(array_signature(x) for x in (q, k_cache, v_cache, cache_seqlens) if x is not None)
    except (AttributeError, RuntimeError):  # not an array of a known library: the checks say so
        return None
    window = plans.pair_key(window_size)
    if None in arrays or window is None:
        return None
    return (arrays, cache_seqlens is None, plans.value_key(causal), plans.value_key(scale),
            plans.value_key(num_splits), window, plans.value_key(softcap))


def _plan_decode(ctx, call: api.LaunchConfig, q, packed, k_cache, v_cache, seqlens, group: int, tile_entries):
    """The plan of a checked decode call: its arrays q, k_cache, v_cache, o, lse (and
    seqlens) in that order, o and lse allocated in the caller's shapes. ``None`` when the
    unplanned path runs it: NumPy, the simulator, an empty problem, packed rows that are a
    copy of q (``Nq > 1`` with grouped heads), or what ``api.plan_run`` leaves to it."""
    B, Hkv, rows, D = call.q_shape
    H, Nq = Hkv * group, rows // group
    if not ctx.direct_launch or B * rows == 0 or call.n_k == 0 or (Nq > 1 and group > 1):
        return None
    # Nq = 1 or group = 1: the packed rows are a view of q at its address, and a C-contiguous
    # (B, H, Nq, D) result is a C-contiguous (B, Hkv, rows, D) one: the kernel writes the
    # caller's shapes.
    pointer = pointer_reader(ctx.kind)
    if pointer(packed) != pointer(q):
        return None
    paged = type(k_cache) is tuple  # (pages, block_table) each (kernels.paged): the table is array 6
    builder = plans.PlanBuilder(ctx, call, 7 if paged else 5 if seqlens is None else 6)
    if paged:
        table = builder.caller_array(6, k_cache[1])
        k_arg, v_arg = (builder.caller_array(1, k_cache[0]), table), (builder.caller_array(2, v_cache[0]), table)
    else:
        k_arg, v_arg = builder.caller_array(1, k_cache), builder.caller_array(2, v_cache)
    arrays = [builder.caller_array(0, packed), k_arg, v_arg,
              builder.result_array(3, (B, Hkv, rows, D), call.dtype),
              builder.result_array(4, (B, Hkv, rows), "float32"),
              None if seqlens is None else builder.caller_array(5, seqlens)]
    if not api.plan_run(builder, call, *arrays, rows_per_query=group):
        return None
    return builder.plan((((B, H, Nq, D), call.dtype), ((B, H, Nq), "float32")), tile_entries)


def _decode_unplanned(ctx, call: api.LaunchConfig, packed, k_cache, v_cache, seqlens, group: int, n_q: int):
    """A checked decode call without a plan: packed results, ``api.run``, unpacked views."""
    B, Hkv, rows, D = call.q_shape
    kind = call.kind
    o_packed = ctx.empty((B, Hkv, rows, D), call.dtype)
    lse_packed = ctx.empty((B, Hkv, rows), "float32")
    if B * rows:
        if call.n_k == 0:
            o_packed[...] = 0
            lse_packed[...] = -np.inf
        else:
            api.run(ctx, call, packed, k_cache, v_cache, o_packed, lse_packed, None, seqlens, rows_per_query=group)
    return _unpack(o_packed, kind, group, n_q), _unpack(lse_packed[..., None], kind, group, n_q)[..., 0]


def _run_unaligned(call: api.LaunchConfig, q, k_cache, v_cache, seqlens, o, lse) -> None:
    """A planned call whose inputs ``cp.async`` cannot read in place: ``api.run`` (which copies)
    on packed views of q and of the plan's results."""
    kind = call.kind
    group = int(q.shape[1]) // int(k_cache.shape[1])
    o_packed, lse_packed = _pack(o, kind, group), _pack(lse[..., None], kind, group)[..., 0]
    api.run(ArrayContext(kind, q), call, _pack(q, kind, group), k_cache, v_cache, o_packed, lse_packed, None, seqlens,
            rows_per_query=group)


def _check_seqlens(cache_seqlens, batch: int, kind: str, ctx):
    """``cache_seqlens`` as an int32 ``(B,)`` array of the inputs' library (``None``: none)."""
    if cache_seqlens is None:
        return None
    if isinstance(cache_seqlens, (list, tuple)):
        lengths, lengths_kind = cache_seqlens, "list"
    else:
        lengths = as_cupy_view(cache_seqlens, "cache_seqlens")
        lengths_kind = kind_of(lengths)
    if tuple(np.shape(lengths) if lengths_kind == "list" else lengths.shape) != (batch,):
        raise ValueError(f"cache_seqlens must have shape ({batch},); got {tuple(np.shape(lengths))}")
    if lengths_kind != kind or dtype_name(lengths, kind) != "int32" or not is_contiguous(lengths, kind):
        host = lengths if lengths_kind in ("list", "numpy") else to_host(lengths, lengths_kind)
        host = np.asarray(host)
        if host.size and not np.issubdtype(host.dtype, np.integer):
            raise TypeError(f"cache_seqlens must hold integers; got {host.dtype}")
        host = np.ascontiguousarray(np.clip(host, 0, np.iinfo(np.int32).max).astype(np.int32))
        lengths = from_host(host, kind, ctx)
    return lengths


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
