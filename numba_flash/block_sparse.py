"""A ``mask_mod``'s block mask as the forward kernels walk it (API.md 2c, issue 24).

With a ``mask_mod`` the forward's walks visit only the tiles the mask leaves a visible entry in,
and apply ``mask_mod`` entry by entry only on the *partial* ones (``kernels.block_info``'s tile
lists; ``kernels.forward``). The tile kinds (``numba_flash.tile_visibility``: hidden, partial,
full) come from

- the caller's ``block_mask`` (``numba_flash.block_mask(mask_mod, ...)``), checked here against
  the call (:func:`check_block_mask`) and carried over to the kernel's tiles when they differ
  (:func:`retile`: a kernel tile is hidden or full only when every block-mask tile it overlaps
  is; otherwise partial -- exact for nested tiles, never wrong);
- or, without one, ``mask_mod`` itself, reduced on the device at the kernel's tiles
  (``kernels.block_kinds``), once per function, shape, tiles and ``mod_args`` *contents*: the
  derived masks are kept (:data:`DERIVED_KEPT` of them) under a digest of the arrays' bytes,
  so a call whose arrays changed derives afresh and one whose arrays did not reuses it (the
  digest copies ``mod_args`` to the host at every call: pass ``block_mask`` to skip it).

The lists (:func:`walk_lists`): for each Q tile of each (batch, head) its K/V tiles (``over="q"``:
FA-2's walk, and an FA-1 block of one Q tile), or for each K/V tile its Q tiles (``over="kv"``:
FA-1's block of every Q tile), ascending, as ``tile * 2 + partial``.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from numba_flash.masking import MaskSpec

__all__ = ["check_block_mask", "retile", "walk_lists", "kernel_lists", "DERIVED_KEPT"]

HIDDEN, PARTIAL, FULL = 0, 1, 2  # (numba_flash.tile_visibility's kinds)
DERIVED_KEPT = 8  # derived block masks kept (each a few int32 lists of the tile grid, on its device)


def _function(fn):
    return getattr(fn, "py_func", fn)  # a numba device function: its Python function


def check_block_mask(block_mask, mask_mod, mask: MaskSpec, batch: int, heads: int, n_q: int, n_k: int) -> None:
    """``TypeError`` / ``ValueError`` unless ``block_mask`` is a ``BlockMask`` this call may walk:
    made for its ``(Nq, Nk)`` and its batch and heads (or 1 of them), from the call's own
    ``mask_mod`` (a block mask says which tiles ``mask_mod`` needs not be evaluated on: one made
    from another function, or from none, would skip entries the call's hides), and with no
    built-in mask (``causal``, ``window_size``) but the call's own."""
    from numba_flash.tile_visibility import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a numba_flash.BlockMask (numba_flash.block_mask(...)); "
                        f"got {type(block_mask).__name__}")
    b, h, bm_q, bm_k = block_mask.shape
    tiles = (-(-bm_q // block_mask.block_m), -(-bm_k // block_mask.block_n))
    if tuple(block_mask.kinds.shape[2:]) != tiles:
        raise ValueError(f"block_mask's kinds have {tuple(block_mask.kinds.shape[2:])} tiles; Nq={bm_q}, Nk={bm_k} in "
                         f"{block_mask.block_m} x {block_mask.block_n} tiles make {tiles}")
    if (bm_q, bm_k) != (n_q, n_k):
        raise ValueError(f"block_mask was made for Nq={bm_q}, Nk={bm_k}; the call has Nq={n_q}, Nk={n_k}")
    if b not in (1, batch) or h not in (1, heads):
        raise ValueError(f"block_mask was made for B={b}, H={h}; the call has B={batch}, H={heads} "
                         "(1 stands for a mask that does not depend on it)")
    if mask_mod is None:
        raise ValueError("block_mask tells the kernels where mask_mod needs no evaluating: pass the mask_mod "
                         "it was made from (mask_mod=...)")
    if block_mask.mask_mod is None or _function(block_mask.mask_mod) is not _function(mask_mod):
        made = getattr(block_mask.mask_mod, "__name__", block_mask.mask_mod)
        raise ValueError(f"block_mask was made from mask_mod={made!r}, not from this call's "
                         f"{getattr(mask_mod, '__name__', mask_mod)!r}")
    if not block_mask.builtins.is_full and block_mask.builtins != mask:
        raise ValueError(f"block_mask was made with the built-in mask window {block_mask.builtins.window} "
                         f"(causal / window_size); the call's is {mask.window}")


def retile(kinds: np.ndarray, tiles: tuple[int, int], lengths: tuple[int, int], to: tuple[int, int]) -> np.ndarray:
    """The kinds (B, H, Q tiles, K/V tiles) of ``tiles = (block_m, block_n)`` carried over to
    ``to``: a tile of ``to`` is hidden (full) when every tile of ``tiles`` it overlaps is, else
    partial. ``lengths``: ``(Nq, Nk)``."""
    if tuple(tiles) == tuple(to):
        return kinds
    lo, hi = np.asarray(kinds), np.asarray(kinds)  # min and max kinds over the overlapped tiles
    for axis, size, new, n in ((2, tiles[0], to[0], lengths[0]), (3, tiles[1], to[1], lengths[1])):
        starts = np.arange(0, n, new)
        first, last = starts // size, (np.minimum(starts + new, n) - 1) // size
        lo = np.stack([lo.take(range(f, l + 1), axis=axis).min(axis=axis) for f, l in zip(first, last)], axis=axis)
        hi = np.stack([hi.take(range(f, l + 1), axis=axis).max(axis=axis) for f, l in zip(first, last)], axis=axis)
    return np.where(lo == FULL, FULL, np.where(hi == HIDDEN, HIDDEN, PARTIAL)).astype(np.int8)


def walk_lists(kinds, over: str, xp=np):
    """``(counts, listed)`` int32 of ``xp`` (NumPy or CuPy; ``kinds`` of the same): per tile of
    the walk's outer loop (``over="q"``: Q tiles, else K/V tiles) the tiles of the other kind
    with a visible entry, ascending, as ``tile * 2 + partial``, padded with 0."""
    if over not in ("q", "kv"):
        raise ValueError(f"over must be 'q' or 'kv'; got {over!r}")
    k = kinds if over == "q" else kinds.swapaxes(2, 3)
    visited = k != HIDDEN
    counts = visited.sum(axis=-1, dtype=xp.int32)
    position = xp.cumsum(visited, axis=-1, dtype=xp.int32) - 1
    index = xp.arange(k.shape[-1], dtype=xp.int32)
    entries = index * 2 + (k == PARTIAL).astype(xp.int32)
    listed = xp.zeros(k.shape, dtype=xp.int32)
    where = xp.nonzero(visited)
    listed[where[:-1] + (position[where],)] = entries[where]
    return xp.ascontiguousarray(counts), listed


# ------------------------------------------------------------------------- the kernels' lists


def _walk_over(call) -> str:
    """The orientation of a forward call's walk: ``"kv"`` for FA-1's block of every Q tile."""
    from numba_flash.kernels.forward import FA1, FA2

    variant = call.variant or (FA1 if call.algorithm == "fa1" else FA2)
    return "kv" if variant.loop_order == "kv_outer" and variant.grid == "heads" else "q"


def kernel_lists(ctx, call) -> list:
    """The two tile-list arguments of a block-sparse forward launch of ``call``, as the kernel
    takes them (numba views of CuPy arrays on the call's device; NumPy in the simulator): the
    caller's block mask carried to the kernel's tiles, or ``mask_mod``'s derived on the device."""
    return lists_at(ctx, call.problem, (call.block_m, call.block_n), _walk_over(call))


def lists_at(ctx, problem, tiles: tuple, over: str) -> list:
    """:func:`kernel_lists` of ``problem`` at a kernel's ``tiles`` for the walk ``over`` (``"q"``:
    each Q tile's K/V tiles; ``"kv"``: each K/V tile's Q tiles): the forward's, the backward's
    dK/dV walk (``"kv"``) and its dQ walk (``"q"``)."""
    host = ctx.kind == "numpy"
    with _on_stream(ctx):
        if problem.mask_table is not None:
            bm = problem.mask_table
            key = ("kernel_lists", tiles, over, _device_key(ctx))
            if key not in bm._made:
                kinds = retile(bm.kinds, (bm.block_m, bm.block_n), bm.seq_lengths, tiles)
                bm._made[key] = _made_once(_kernel_views(walk_lists(kinds, over) if host else
                                                         walk_lists(_cupy().asarray(kinds), over, _cupy()), host), ctx)
            lists = bm._made[key]
        else:
            lists = _derived(ctx, problem, tiles, over)
    return list(lists)


def _device_key(ctx):
    """The device the kernels' lists live on: the inputs' (CuPy, torch), or numba's current one
    (NumPy inputs copied to a GPU); ``None`` in the simulator."""
    from numba_flash._cuda import cuda
    from numba_flash._world import simulated

    if simulated():
        return None
    return ctx.device_id if ctx.kind != "numpy" else cuda.get_current_device().id


def _made_once(lists, ctx):
    """``lists``, once the call's stream has finished making them: they are kept, and a later
    call on another stream reads them with nothing else ordering the two streams (rare: once per
    mask, tiles and walk)."""
    if ctx.kind != "numpy":
        _cupy().cuda.get_current_stream().synchronize()  # (under _on_stream: the call's stream)
    return lists


def _kernel_views(lists, host: bool) -> tuple:
    """The lists as a kernel takes them, made once: NumPy in the simulator, a device copy of
    NumPy on a GPU, numba views of CuPy arrays (which keep them alive)."""
    from numba_flash._cuda import cuda
    from numba_flash._world import simulated

    if host:
        return tuple(a if simulated() else cuda.to_device(a) for a in lists)
    return tuple(cuda.as_cuda_array(a, sync=False) for a in lists)  # (the call's stream made them)


def _cupy():
    import cupy

    return cupy


def _on_stream(ctx):
    """CuPy's work for a call on the caller's stream, on its device (NumPy: nothing)."""
    import contextlib

    if ctx.kind == "numpy":
        return contextlib.nullcontext()
    from numba_flash.arrays import cupy_stream

    stack = contextlib.ExitStack()
    stack.enter_context(_cupy().cuda.Device(ctx.device_id))
    if ctx.kind == "torch":
        stack.enter_context(cupy_stream(ctx.stream_ptr()))
    return stack


_DERIVED: collections.OrderedDict = collections.OrderedDict()


def _digest(ctx, arrays) -> tuple:
    """What a derived block mask depends on in ``mod_args``: each array's dtype, shape and a hash
    of its bytes (copied to the host)."""
    out = []
    for a in arrays:
        if ctx.kind == "torch":
            host = a.detach().contiguous().cpu().numpy()
        elif ctx.kind == "cupy":
            host = _cupy().asnumpy(a)
        else:
            host = np.ascontiguousarray(a)
        out.append((str(host.dtype), host.shape, hashlib.blake2b(host.tobytes(), digest_size=16).hexdigest()))
    return tuple(out)


def _derived(ctx, problem, tiles, over):
    """``mask_mod``'s lists at ``tiles`` for the walk ``over``, derived on the device (kept)."""
    key = (_function(problem.mask_mod), problem.n_mod_args, problem.batch, problem.heads, problem.n_q, problem.n_k,
           tiles, ctx.kind == "numpy", _device_key(ctx), _digest(ctx, problem.mod_args))
    entry = _DERIVED.get(key)
    if entry is None:
        entry = {"kinds": _derive_kinds(ctx, problem, tiles)}
        _DERIVED[key] = entry
        while len(_DERIVED) > DERIVED_KEPT:
            _DERIVED.popitem(last=False)
    _DERIVED.move_to_end(key)
    if over not in entry:
        host = ctx.kind == "numpy"
        entry[over] = _made_once(_kernel_views(walk_lists(entry["kinds"], over, np if host else _cupy()), host), ctx)
    return entry[over]


def _derive_kinds(ctx, problem, tiles):
    """The int8 kinds ``(B, H, Q tiles, K/V tiles)`` of ``mask_mod`` alone at ``tiles``
    (``kernels.block_kinds``; on the call's device, NumPy on the host)."""
    from numba_flash._cuda import cuda
    from numba_flash._world import simulated
    from numba_flash.kernels.block_kinds import block_kinds_kernel
    from numba_flash.kernels.score_mods import UserMods
    from numba_flash.launch import numba_launch
    from numba_flash.user_mods import compiling

    bm, bn = tiles
    shape = (problem.batch, problem.heads, -(-problem.n_q // bm), -(-problem.n_k // bn))
    user = UserMods(problem.mask_mod, None, problem.n_mod_args)
    threads = 32 if simulated() else 128
    kernel = block_kinds_kernel(user, bm, bn, threads)
    grid = int(np.prod(shape))
    if ctx.kind == "numpy":
        kinds = np.zeros(shape, np.int8)
        if grid:
            with compiling(user):
                if simulated():
                    args = tuple(np.array(a, order="C") for a in problem.mod_args)
                    numba_launch(kernel, (grid,), threads, None, [kinds, np.int32(problem.n_q), np.int32(problem.n_k), args])
                else:
                    out = cuda.to_device(kinds)
                    args = tuple(cuda.to_device(np.ascontiguousarray(a)) for a in problem.mod_args)
                    numba_launch(kernel, (grid,), threads, None, [out, np.int32(problem.n_q), np.int32(problem.n_k), args])
                    out.copy_to_host(kinds)
        return kinds
    kinds = _cupy().zeros(shape, np.int8)  # (on the caller's device and stream: kernel_lists)
    if grid:
        args = tuple(cuda.as_cuda_array(a.detach() if ctx.kind == "torch" else a, sync=False) for a in problem.mod_args)
        with compiling(user):
            numba_launch(kernel, (grid,), threads, ctx.stream(), [cuda.as_cuda_array(kinds, sync=False), np.int32(problem.n_q),
                                                                   np.int32(problem.n_k), args])
    return kinds
