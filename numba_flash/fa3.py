"""``attention(..., algorithm="fa3")``: FlashAttention-3's forward on Hopper (host side).

The kernel is ``kernels.fa3`` (warp-specialized: a TMA producer warpgroup, ``wgmma`` consumer
warpgroups); this module checks a call, picks its tiles, describes q, k and v to the Tensor Memory
Accelerator (:func:`tensor_map`: one ``CUtensorMap`` per array and box height, kept per pointer,
shape and strides, so a loop over the same buffers encodes them once) and launches on the caller's
stream. API.md section 2f: float16 and bfloat16, compute capability 9.0 or the simulator; anything
else raises ``ValueError`` naming the GPU and the algorithms it can run.

What ``fa3`` takes today: causal, ``window_size``, ``softcap``, ``alibi_slopes``, ``mask_mod`` /
``score_mod`` / ``mod_args`` (a ``mask_mod`` walks its block mask: the caller's ``block_mask`` or
one derived at the kernel's tiles, ``numba_flash.block_sparse``), GQA/MQA, any lengths, head dims 1
to 256 (the kernels are built for 64, 128 and 256; the TMA boxes read zeros past D),
``return_lse``, ``out`` / ``lse_out``, ``block_m`` / ``block_n``; float8_e4m3fn inputs with
``q_descale`` / ``k_descale`` / ``v_descale`` (bfloat16 out; ``numba_flash.fp8``: kernels at D 128
and 256); ``num_splits`` (split-KV: float32 partials merged by ``kernels.combine``; ``None``: the
``split_kv`` heuristic for the kernel's grid, which splits only a grid that leaves SMs idle). Not
yet: ``precision``, ``variant``, ``kv_tile_order`` -- each raises a ``ValueError`` that says so.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import threading
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from numba_flash import alibi
from numba_flash import fp8 as fp8_inputs
from numba_flash import plans
from numba_flash._world import simulated
from numba_flash.arrays import (ArrayContext, array_signature, as_cupy_view, check_like, check_no_overlap, device_id_of,
                                pointer_reader, zero_padded)
from numba_flash.launch import core_stream
from numba_flash.user_mods import none_given
from numba_flash.problem import FP8_DTYPE, describe
from numba_flash.tile_table import fa3_tiles

ALGORITHM = "fa3"
HOPPER = (9, 0)
KERNEL_HEAD_DIMS = (64, 128, 256)
FP8_KERNEL_HEAD_DIMS = (128, 256)  # e4m3 rows of 128 bytes
TMA_ALIGNMENT = 16  # bytes: a tensor's base and every stride but the innermost (which is one element)
KERNEL_KIND = {"float16": "f16", "bfloat16": "bf16", FP8_DTYPE: "e4m3"}
# FlashAttention-4's conditional rescaling (kernels.fa3 ``rescale_threshold``), by fp8: the default
# threshold in log2 units (0: every tile rescales O, as FA-2 and FA-3 write it)
RESCALE_THRESHOLD = {False: 8.0, True: 4.0}


def kernel_head_dim(head_dim: int, fp8: bool = False) -> int:
    """The head dim the kernel is built for: the next of 64, 128, 256 (fp8: 128, 256; TMA
    zero-fills the rest)."""
    for d in FP8_KERNEL_HEAD_DIMS if fp8 else KERNEL_HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"fa3 takes head dims up to 256; got {head_dim}")


def registers(block_m: int) -> tuple[int, int]:
    """setmaxnreg's (producer, consumer) registers per thread for ``block_m / 64`` consumer
    warpgroups: the 64K-register file shared out (FA-3: 24 / 240 with two consumers)."""
    consumers = block_m // 64
    if consumers == 1:
        return 40, 232
    if consumers == 2:
        return 24, 240
    return 32, 160


def require_fa3_device(device_id) -> None:
    """ValueError unless the GPU of ``device_id`` (``None``: the current one) is a Hopper (9.0)."""
    if simulated():
        return
    from numba_flash._cuda import cuda

    device = cuda.get_current_device() if device_id is None else cuda.gpus[device_id]
    cc = tuple(device.compute_capability)
    if cc != HOPPER:
        name = device.name.decode() if isinstance(device.name, bytes) else device.name
        raise ValueError(f"algorithm='fa3' needs a Hopper GPU (compute capability 9.0: wgmma, TMA); "
                         f"{name} is {cc[0]}.{cc[1]}: use algorithm='fa2' or 'fa1'")


def _unsupported(precision, variant, kv_tile_order) -> None:
    given = [name for name, off in (("variant", variant is None), ("kv_tile_order", kv_tile_order is None)) if not off]
    if precision is not None:
        given.append(f"precision={precision!r}")
    if given:
        raise ValueError(f"algorithm='fa3' does not take {', '.join(given)} yet; use algorithm='fa2' for them")


# ------------------------------------------------------------------------------------------
# Tensor maps
# ------------------------------------------------------------------------------------------

_MAPS: collections.OrderedDict = collections.OrderedDict()  # (device, ptr, shape, strides, dtype, rows) -> device map
_MAPS_KEPT = 256


def forget_tensor_maps() -> None:
    """Drop the kept tensor maps (not those a CUDA graph capture used): the next call on any array
    makes its maps anew (``scripts/fa3_bench.py --host`` times that: new pointers' host cost)."""
    with _LOCK:
        _MAPS.clear()


def tma_ready(x) -> bool:
    """Can TMA read ``x`` (a ``launch.DeviceArray``, 4-D, 16- or 8-bit) where it is: the innermost stride
    one element, the others and the base 16-byte multiples."""
    if x.strides[3] != x.itemsize and x.shape[3] > 1:
        return False
    if x.ptr % TMA_ALIGNMENT or (x.shape[3] * x.itemsize) % TMA_ALIGNMENT:
        return False
    return all(s % TMA_ALIGNMENT == 0 and s > 0 for s, n in zip(x.strides[:3], x.shape[:3]) if n > 1)


class MapStream(NamedTuple):
    """The stream a launch's new tensor maps are copied on (its handle) and whether it is being
    captured into a CUDA graph: asked of the driver once a launch (:func:`map_stream`), not per map."""

    ptr: int
    capturing: bool


def map_stream(stream_ptr: int) -> MapStream:
    return MapStream(stream_ptr, _capturing(stream_ptr))


def tensor_map(x, rows: int, dtype: str, device_id: int, row_bytes: int, stream: MapStream):
    """The ``CUtensorMap`` (16 uint64 words in device memory, a numba device array) that lets TMA
    copy ``rows x row_bytes``-byte boxes (128 bytes: 64 16-bit or 128 8-bit elements; fp8's V^T
    also 64 or 32) of the (B, H, N, D) array ``x`` (a ``launch.DeviceArray``; ``dtype`` its element
    type's name) with the swizzle of that row (``kernels.hopper.swizzle``), zeros past its ends;
    made once per pointer, shape, strides and box, its words copied on the launch's ``stream``
    (:func:`_kept_entry`)."""
    return _map_entry(x, rows, dtype, device_id, row_bytes, stream).words


def tensor_map_address(x, rows: int, dtype: str, device_id: int, row_bytes: int, stream: MapStream) -> int:
    """The device address of :func:`tensor_map`'s words (a plan's launch takes it as a pointer)."""
    return _map_entry(x, rows, dtype, device_id, row_bytes, stream).address


def _map_entry(x, rows: int, dtype: str, device_id: int, row_bytes: int, stream: MapStream):
    return _kept_entry((device_id, x.ptr, x.shape, x.strides, dtype, rows, row_bytes),
                       lambda: _encoded(x, rows, dtype, row_bytes), stream)


def sequence_maps(x, rows: int, dtype: str, device_id: int, bounds, stream: MapStream) -> object:
    """A packed batch's maps (API.md 2d): ``(B, 16)`` words in device memory, row ``b`` the map of
    sequence ``b``'s rows ``bounds[b] .. bounds[b + 1]`` of the ``(1, H, total, D)`` view ``x``
    alone, so that TMA reads zeros past that sequence's end (not the next sequence's rows); made
    once per pointer, shape, strides, box and bounds."""
    bounds = np.asarray(bounds, np.int64)
    key = (device_id, x.ptr, x.shape, x.strides, dtype, rows, bounds.tobytes())

    def make():
        row_bytes = x.strides[2]
        return np.stack([_encoded(x._replace(ptr=x.ptr + int(a) * row_bytes, shape=(1, x.shape[1], max(1, int(b - a)),
                                                                                     x.shape[3])), rows, dtype)
                         for a, b in zip(bounds[:-1], bounds[1:])])

    return _kept_entry(key, make, stream).words


class _KeptWords:
    """A kept map's device words, their address, and while their copy may be in flight the pinned
    host words it reads and the event recorded after it."""

    __slots__ = ("words", "address", "host", "copied")

    def __init__(self, words, address, host, copied):
        self.words, self.address, self.host, self.copied = words, address, host, copied


_LOCK = threading.Lock()  # the kept maps and the chunks their words are cut from (host threads may share them)
_CAPTURED: dict = {}  # maps a CUDA graph capture used: kept for the process (a graph may replay any time)


def _kept_entry(key, make, stream: MapStream) -> _KeptWords:
    """The device words of ``make()`` (NumPy uint64), made once per ``key`` and kept (the least
    recently used dropped first). A new entry's words are copied from pinned memory on ``stream``
    (the launch's, which the copy precedes in order) without waiting: no drain of the
    GPU (a copy synchronized on a stream of its own stopped the whole device per new pointer:
    ~0.15 ms a map on the H200). A launch on any stream while the copy may be in flight waits for
    its event (on the copy's own stream, a no-op), until the event has completed.

    While ``stream`` is being captured into a CUDA graph nothing of this is captured: a new map
    is copied and waited for outside the graph, a pending copy is waited for, and every map the
    capture uses is kept for the process's life (:data:`_CAPTURED`), never dropped under a graph."""
    with _LOCK:
        hit = _CAPTURED.get(key)
        if hit is None:
            hit = _MAPS.get(key)
            if hit is not None:
                _MAPS.move_to_end(key)
        if hit is not None:
            if hit.copied is not None:
                _settle(hit, stream)
            if stream.capturing and key not in _CAPTURED:
                _CAPTURED[key] = _MAPS.pop(key)
            return hit
        from numba_flash.launch import device_array

        words, host, copied = _device_words(make(), stream, key[0])  # (key[0]: the device)
        entry = _KeptWords(words, device_array(words, "numba").ptr, host, copied)
        if stream.capturing:
            _CAPTURED[key] = entry
        else:
            _MAPS[key] = entry
            if len(_MAPS) > _MAPS_KEPT:
                _MAPS.popitem(last=False)
        return entry


_MAP_CHUNK_WORDS = 64 * 16  # words of device and pinned memory allocated at once for new maps (64 maps)
_CHUNKS: dict = {}  # device id -> (device words, pinned host words, words used)


def _device_words(words: np.ndarray, stream: MapStream, device_id: int):
    """``(device copy, pinned host words, event after the copy)``: ``words`` queued for the device
    on ``stream`` (handle 0: the legacy default stream) by the driver's copy (numba's
    ``to_device`` on a stream costs ~80 us of host time more). Both copies are slices of chunks of
    :data:`_MAP_CHUNK_WORDS` words allocated together (an allocation costs ~30 us, pinned or not), a
    slot never reused: a chunk is freed with the last entry that holds a slice of it, as a lone
    allocation was. ``stream.capturing`` (being captured into a graph): allocated and
    copied outside the capture, on a stream of this module's, and waited for (``(..., None, None)``)."""
    from cuda.bindings import driver

    from numba_flash._cuda import cuda

    with _relaxed_capture() if stream.capturing else contextlib.nullcontext(), cuda.gpus[device_id]:
        n = words.size
        device, host, used = _CHUNKS.get(device_id, (None, None, _MAP_CHUNK_WORDS))
        if used + n > _MAP_CHUNK_WORDS:
            size = max(n, _MAP_CHUNK_WORDS)
            device, host, used = cuda.device_array(size, np.uint64), cuda.pinned_array(size, np.uint64), 0
        _CHUNKS[device_id] = (device, host, used + n)
        device, host = device[used:used + n], host[used:used + n]
        host[...] = words.reshape(-1)
        copy_on = _private_stream(device_id) if stream.capturing else stream.ptr
        _checked(driver.cuMemcpyHtoDAsync(device.device_ctypes_pointer.value, host.ctypes.data, host.nbytes, copy_on),
                 "cuMemcpyHtoDAsync")
        if stream.capturing:
            _checked(driver.cuStreamSynchronize(copy_on), "cuStreamSynchronize")
            return device.reshape(words.shape), None, None
        copied = cuda.event(timing=False)
        copied.record(_numba_stream(stream.ptr))
    return device.reshape(words.shape), host, copied


def _checked(result, call: str):
    """The values a ``cuda.bindings.driver`` call returned after its error code, or a RuntimeError
    naming ``call`` (the tensor maps' driver calls)."""
    from cuda.bindings import driver

    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"fa3: {call} failed for a tensor map ({err})")
    return result[1:]


def _numba_stream(stream_ptr: int):
    from numba_flash._cuda import cuda

    return cuda.legacy_default_stream() if stream_ptr == 0 else cuda.external_stream(stream_ptr)


@functools.lru_cache(maxsize=None)
def _private_stream(device_id: int) -> int:
    """A non-blocking stream of this module's on ``device_id`` (a capture's maps are copied on it:
    no implicit join with the capturing stream)."""
    from cuda.bindings import driver

    (stream,) = _checked(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    return int(stream)


def _capturing(stream_ptr: int) -> bool:
    """Is ``stream_ptr`` being captured into a CUDA graph?"""
    from cuda.bindings import driver

    (status,) = _checked(driver.cuStreamIsCapturing(stream_ptr), "cuStreamIsCapturing")
    return status == driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE


@contextlib.contextmanager
def _relaxed_capture():
    """This thread's capture mode relaxed (a capture in global mode forbids allocations and
    synchronization anywhere in the process), restored after."""
    from cuda.bindings import driver

    relaxed = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    (mode,) = _checked(driver.cuThreadExchangeStreamCaptureMode(relaxed), "cuThreadExchangeStreamCaptureMode")
    try:
        yield
    finally:
        _checked(driver.cuThreadExchangeStreamCaptureMode(mode), "cuThreadExchangeStreamCaptureMode")


def _settle(entry: _KeptWords, stream: MapStream) -> None:
    """A hit whose copy may be in flight: once its event has completed, the event and the pinned
    words are dropped; until then the launch's stream waits for it (stream handles are not
    compared: two handles can name one stream). While ``stream`` is being captured the event is
    waited for on the host instead (outside the capture)."""
    if stream.capturing:
        with _relaxed_capture():
            entry.copied.synchronize()
    elif not entry.copied.query():
        entry.copied.wait(_numba_stream(stream.ptr))
        return
    entry.copied = entry.host = None


def _encoded(x, rows: int, dtype: str, row_bytes: int = 128) -> np.ndarray:
    """``cuTensorMapEncodeTiled`` of :func:`tensor_map`'s map of ``x``, as 16 uint64 words."""
    from cuda.bindings import driver

    B, H, N, D = x.shape
    strides = list(x.strides[:3][::-1])  # bytes: n, h, b
    dims = [D, N, H, B]
    for i, n in enumerate(dims[1:]):  # a dimension of one: any valid stride (never stepped)
        if n == 1:
            strides[i] = max(TMA_ALIGNMENT, -(-D * x.itemsize // TMA_ALIGNMENT) * TMA_ALIGNMENT)
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    data_type = {"float16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                 "bfloat16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                 FP8_DTYPE: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8}[dtype]
    err, tmap = driver.cuTensorMapEncodeTiled(
        data_type, 4, int(x.ptr), [u64(d) for d in dims], [u64(s) for s in strides],
        [u32(row_bytes // x.itemsize), u32(rows), u32(1), u32(1)], [u32(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{row_bytes}B"),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for shape {x.shape}, strides {x.strides}")
    return np.array([int(w) for w in tmap.opaque], dtype=np.uint64)


# ------------------------------------------------------------------------------------------
# The call
# ------------------------------------------------------------------------------------------


def forward(q, k, v, *, causal=False, scale=None, block_m=None, block_n=None, precision=None, num_splits=None,
            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, mask_mod=None, score_mod=None, mod_args=(),
            block_mask=None, out=None, lse_out=None, variant=None, kv_tile_order=None, stages=None, overlap=True,
            pingpong=None, reallocate=True, poly_exp2=0, rescale_threshold=None, tma_store=True, q_descale=None,
            k_descale=None, v_descale=None, packed=None):
    """``api.forward`` for ``algorithm="fa3"``: returns ``(o, lse)``. Research knobs (the v2 -> v3
    ablation): ``stages`` (K/V slots), ``overlap`` (FA-3 section 3.2's intra-warpgroup pipelining),
    ``pingpong`` (section 3.1's inter-warpgroup turns; ``None``: :func:`takes_turns`'s rule, turns for
    two consumer warpgroups only), ``reallocate`` (setmaxnreg), ``poly_exp2``
    (eighths of the exponentials computed on the FMA units, ``kernels.poly_exp2``: FA-4's emulation,
    slower on the H200 at every share), ``rescale_threshold`` (log2 units, 0 to 8: FlashAttention-4's
    conditional rescaling, a row's max moves only when a tile exceeds it by more than this, so most
    tiles leave O unscaled; 0: the papers' every-tile rescale; ``None``: ``RESCALE_THRESHOLD``),
    ``tma_store`` (O through shared memory and a TMA store, FA-3's epilogue, where
    :func:`stores_o_by_tma` allows it; ``False``: every thread stores its pairs of O).
    float8_e4m3fn
    inputs: ``q_descale`` / ``k_descale`` / ``v_descale`` (``numba_flash.fp8.descales``), bfloat16 out.
    ``packed``: a ``varlen.PackedBatch`` (``attention_varlen``): q, k, v, ``out`` and ``lse_out`` are
    its ``(1, H, total, ...)`` views (both given), ``alibi_slopes`` ``(H,)`` or a row per sequence."""
    _unsupported(precision, variant, kv_tile_order)
    key = None
    if (block_mask is None and packed is None and none_given(mask_mod, score_mod, mod_args)
            and q_descale is None and k_descale is None and v_descale is None and stages is None
            and all(x is True for x in (overlap, reallocate, tma_store)) and pingpong is None
            and type(poly_exp2) is int and poly_exp2 == 0 and rescale_threshold is None):  # the call of attention(..., algorithm="fa3"): a plan's signature
        key = _plan_key(q, k, v, out, lse_out, causal, scale, block_m, block_n, num_splits, window_size, softcap,
                        alibi_slopes)
    plan = _PLANS.get(key)
    if plan is not None:
        done = plan(q, k, v, out, lse_out, alibi_slopes)
        if done is not None:
            return done
    from numba_flash.split_kv import check_num_splits

    num_splits = check_num_splits(num_splits, ALGORITHM)
    if packed is not None and num_splits not in (None, 1):
        raise ValueError("algorithm='fa3' runs a packed batch unsplit: num_splits must be None or 1")
    q, k, v = (as_cupy_view(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    out, lse_out = (None if x is None else as_cupy_view(x, name) for x, name in ((out, "out"), (lse_out, "lse_out")))
    if alibi_slopes is not None:
        alibi_slopes = as_cupy_view(alibi_slopes, "alibi_slopes")
    if isinstance(mod_args, (tuple, list)):
        mod_args = tuple(as_cupy_view(a, f"mod_args[{i}]") for i, a in enumerate(mod_args))
    # (every mod checked as for fa2; a mask_mod walks its block mask, block_sparse)
    p = describe(q, k, v, causal=causal, scale=scale, algorithm="fa2", window_size=window_size, softcap=softcap,
                 alibi_slopes=None if packed is not None else alibi_slopes, mask_mod=mask_mod, score_mod=score_mod,
                 mod_args=mod_args, block_mask=block_mask, block_sparse=True, fp8=True)
    if packed is not None:
        if p.dtype == FP8_DTYPE or p.user_mods is not None:
            raise ValueError("algorithm='fa3' on a packed batch takes 16-bit inputs and the built-in masks and mods "
                             "(float8 and mask_mod / score_mod: rectangular batches)")
        if alibi_slopes is not None:  # (H,) or a row per sequence, checked against the sequences
            p = replace(p, alibi_slopes=packed.slopes(alibi_slopes, p), alibi=True)
    if p.dtype not in KERNEL_KIND:
        raise TypeError(f"algorithm='fa3' runs float16, bfloat16 and float8_e4m3fn inputs; got {p.dtype} "
                        f"(use 'fa2' for float32)")
    fp8 = p.dtype == FP8_DTYPE
    if not fp8 and not (q_descale is None and k_descale is None and v_descale is None):
        raise ValueError(f"q_descale, k_descale and v_descale are for float8_e4m3fn inputs; got {p.dtype} inputs")
    if not p.scale > 0:
        raise ValueError(f"algorithm='fa3' needs scale > 0; got {p.scale}")
    D = kernel_head_dim(p.head_dim, fp8)
    dm, dn, ds = fa3_tiles(D, fp8)
    bm = dm if block_m is None else block_m
    bn = dn if block_n is None else block_n
    st = ds if stages is None else stages
    from numba_flash.kernels.fa3 import check_fa3_tiles

    for name, value in (("block_m", bm), ("block_n", bn), ("stages", st)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"fa3: {name} must be an int; got {value!r}")
    check_fa3_tiles(D, int(bm), int(bn), int(st), KERNEL_KIND[p.dtype])
    if isinstance(poly_exp2, bool) or not isinstance(poly_exp2, (int, np.integer)) or not 0 <= poly_exp2 <= 8:
        raise ValueError(f"fa3: poly_exp2 counts eighths of the exponentials, an int from 0 to 8; got {poly_exp2!r}")
    threshold = RESCALE_THRESHOLD[fp8] if rescale_threshold is None else rescale_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.integer, np.floating)) \
            or not 0 <= threshold <= 8:
        raise ValueError(f"fa3: rescale_threshold is in log2 units, a number from 0 to 8; got {rescale_threshold!r}")
    ctx = ArrayContext(p.kind, q)
    B, H, Nq, Dq = p.q_shape
    out_dtype = "bfloat16" if fp8 else p.dtype
    _check_result(out, "out", (B, H, Nq, Dq), out_dtype, p)
    _check_result(lse_out, "lse_out", (B, H, Nq), "float32", p)
    if out is not None or lse_out is not None:
        check_no_overlap(p.kind, q, k, v, out, lse_out)
    with ctx.on_device(), _caller_stream(ctx):  # CuPy's work of this call (copies, V^T, descales) on the caller's stream
        require_fa3_device(ctx.device_id)
        o = out if out is not None else ctx.empty((B, H, Nq, Dq), out_dtype)
        # checked before the early returns: bad descales raise on any shape (16-bit: ones, unread);
        # the buffers made for them (owners) live until the launch is queued
        scales, owners = fp8_inputs.descales(q_descale, k_descale, v_descale, B, p.kv_heads, ctx.kind, ctx.device_id)
        lse = lse_out if lse_out is not None else ctx.empty((B, H, Nq), "float32")
        if B * H * Nq == 0:
            return o, lse
        if p.n_k == 0:
            o[...] = 0
            lse[...] = -math.inf
            return o, lse
        schedule = (bool(overlap), takes_turns(int(bm), pingpong), bool(reallocate), int(poly_exp2), float(threshold))
        splits = 1 if packed is not None else _splits(num_splits, p, D, int(bm), int(bn), int(st), ctx.device_id)
        _check_grid(p, splits, packed, fp8)
        if splits == 1:
            recipe = [] if key is not None and plan is None else None
            _launch(ctx, p, q, k, v, o, lse, D, int(bm), int(bn), int(st), schedule, scales, packed,
                    tma_store=bool(tma_store), recipe=recipe)
            if recipe:  # a plan for later calls of this signature (Fa3Plan), holding the descales' buffers
                _PLANS.put(key, _planned(ctx, p, out_dtype, recipe[0], owners))
        else:
            _split_launch(ctx, p, q, k, v, o, lse, D, int(bm), int(bn), int(st), schedule, scales, splits)
        del owners
    return o, lse


def _check_grid(p, splits: int, packed, fp8: bool) -> None:
    """ValueError where a launch would exceed CUDA's 65535 blocks along a grid's z: fa3's holds the
    batch x splits (or a packed batch's sequences), fp8's V^T pass the batch x K/V heads."""
    from numba_flash.arch import MAX_GRID_YZ

    B = p.q_shape[0]
    blocks = packed.sequences if packed is not None else B * splits
    if blocks > MAX_GRID_YZ:
        what = f"a packed batch's {blocks} sequences" if packed is not None else f"the batch x num_splits ({B} x {splits})"
        raise ValueError(f"algorithm='fa3' launches {what} along its grid's z, at most {MAX_GRID_YZ}: call it on "
                         f"parts of the batch, or use algorithm='fa2' (a 1-D grid)")
    if fp8 and B * p.kv_heads > MAX_GRID_YZ:
        raise ValueError(f"algorithm='fa3' on float8 transposes V over a grid whose z is the batch x K/V heads "
                         f"({B} x {p.kv_heads}), at most {MAX_GRID_YZ}: call it on parts of the batch")


def _check_result(buf, name: str, shape, dtype: str, p) -> None:
    """A caller's result buffer for fa3: the inputs' library and GPU, this shape and dtype, writeable,
    and its elements distinct (a strided view is written where it is, by TMA or by the threads; one
    whose strides make elements share memory would be written over itself)."""
    if buf is None:
        return
    check_like(buf, name, shape, dtype, p.kind)  # (library, shape, dtype: as fa1 / fa2 check theirs)
    if p.kind in ("cupy", "torch") and device_id_of(buf, p.kind) != p.device_id:
        raise ValueError(f"{name} must be on the inputs' GPU ({p.device_id}); got {device_id_of(buf, p.kind)}")
    if p.kind == "numpy" and not (buf.dtype.isnative and buf.flags.writeable):
        raise ValueError(f"{name} must be writeable and in the machine's byte order")
    strides = buf.stride() if p.kind == "torch" else tuple(s // buf.itemsize for s in buf.strides)
    if _self_overlapping(tuple(buf.shape), strides):
        raise ValueError(f"{name}'s strides {tuple(strides)} make some of its elements share memory")


def _self_overlapping(shape, strides) -> bool:
    """Whether two elements of an array of ``shape`` and element ``strides`` share an address: with
    the dimensions of more than one element sorted by stride, each must step past the extent of the
    ones before it."""
    extent = 1
    for stride, n in sorted((abs(s), n) for s, n in zip(strides, shape) if n > 1):
        if stride < extent:
            return True
        extent = stride * (n - 1) + extent
    return False


def _splits(num_splits, p, D: int, bm: int, bn: int, stages: int, device_id) -> int:
    """The call's K/V splits: the caller's, or (``None``) ``split_kv``'s heuristic for this grid --
    one Q tile per block, the blocks an SM holds by shared memory, the Q tile's K/V tiles."""
    if num_splits is not None:
        return num_splits
    if simulated():
        return 1
    from numba_flash.kernels.fa3 import Fa3Layout, WARPGROUP
    from numba_flash.kernels.hopper import element_bytes
    from numba_flash.split_kv import multiprocessors, num_splits_heuristic, resident_blocks

    B, H, Nq, _ = p.q_shape
    smem = Fa3Layout(D, bm, bn, stages, element_bytes(KERNEL_KIND[p.dtype])).smem_bytes
    return num_splits_heuristic(-(-Nq // bm) * B * H, multiprocessors(device_id),
                                resident_blocks(WARPGROUP * (bm // 64 + 1), smem), -(-p.n_k // bn))


def _split_launch(ctx, p, q, k, v, o, lse, D, bm, bn, stages, schedule, scales, splits) -> None:
    """Split-KV (API.md 2b): the kernel writes ``splits`` float32 partials of every row
    (``kernels.fa3``'s ``split``), ``kernels.combine`` merges them into ``o`` and ``lse``."""
    from numba_flash.simulator import quiet_kernels
    from numba_flash.split_kv import combine

    B, H, Nq, Dq = p.q_shape
    o_parts = ctx.empty((splits * B, H, Nq, D), "float32")
    lse_parts = ctx.empty((splits * B, H, Nq), "float32")
    _launch(ctx, p, q, k, v, o_parts, lse_parts, D, bm, bn, stages, schedule, scales, splits=splits)
    bf16 = str(o.dtype).rsplit(".", 1)[-1] == "bfloat16"
    target = ctx.empty((B, H, Nq, Dq), "float32") if bf16 and ctx.on_host else o
    with quiet_kernels():
        combine(ctx, o_parts, lse_parts, target, lse, bits="bf16" if bf16 and target is o else None)
    if target is not o:
        o[...] = target


def _caller_stream(ctx):
    """torch inputs: CuPy's current stream set to torch's for the call (``arrays.cupy_stream``), so
    a padded copy, V^T and the descale buffers are ordered with the caller's work and the kernel;
    CuPy's is the caller's already; NumPy and the simulator have none."""
    if ctx.kind != "torch" or simulated():
        return contextlib.nullcontext()
    from numba_flash.arrays import cupy_stream

    return cupy_stream(ctx.stream_ptr())


def _kernel_view(x, kind: str, fp8: bool = False):
    """A 16-bit array as the kernel's uint16 bit patterns, an e4m3 one as uint8 (torch: a CuPy view)."""
    from numba_flash.tensor_cores import bits_view

    if fp8:
        return fp8_inputs.byte_view(x, kind)
    if kind == "numpy":
        x = x.astype(x.dtype.newbyteorder("="), copy=False)
    return bits_view(x, kind, True)


def _tma_copy(x):
    """An input TMA cannot read where it is, copied: C-contiguous, the head dim zero-padded to
    16-byte rows."""
    per_row = TMA_ALIGNMENT // x.itemsize
    return zero_padded(x, -(-x.shape[3] // per_row) * per_row)


def takes_turns(block_m: int, pingpong=None) -> bool:
    """Whether the consumer warpgroups take turns at the tensor cores (FA-3 section 3.1's ping-pong):
    ``pingpong`` where given, else (``None``) FA-3's own rule, turns for two consumer warpgroups
    (128-row tiles) only. With three (192-row tiles: D = 64, fp8 at D = 128) the turns measured
    1-2% slower at D = 64 on the H200, in 8 of 8 alternating pairs, and 1-4% with the soft cap;
    fp8's 192 x 96 was even (results 16m)."""
    return bool(pingpong) if pingpong is not None else block_m == 128


def kernel_for(p, head_dim: int, block_m: int, block_n: int, stages: int, overlap=True, pingpong=None,
               reallocate=True, poly_exp2=0, rescale_threshold=None, varlen=False, split=False, tma_store=False):
    """The compiled-on-demand FA-3 kernel of checked problem ``p`` (``problem.Problem``) at the
    kernel's ``head_dim`` and these tiles and schedule switches (``pingpong``: :func:`takes_turns`;
    ``varlen``: a packed batch's; ``split``: split-KV's partials; ``tma_store``: O written by TMA,
    :func:`stores_o_by_tma`)."""
    from numba_flash.kernels.fa3 import fa3_kernel

    if rescale_threshold is None:
        rescale_threshold = RESCALE_THRESHOLD[p.dtype == FP8_DTYPE]
    return fa3_kernel(head_dim, block_m, block_n, stages, p.window, KERNEL_KIND[p.dtype], overlap,
                      takes_turns(block_m, pingpong),
                      registers(block_m) if reallocate else None, p.softcap > 0, p.alibi, p.user_mods, bool(varlen),
                      int(poly_exp2), bool(split), float(rescale_threshold), bool(tma_store))


def stores_o_by_tma(ko, kind: str, fp8: bool, splits: int) -> bool:
    """Whether the kernel writes O through shared memory and TMA (FA-3's epilogue, ``kernels.fa3``
    ``tma_store``) into ``ko``, the output's 16-bit view: for 16-bit inputs, unsplit, and an
    output TMA can write where it is (NumPy and the simulator: a C-contiguous copy, so rows of a
    multiple of 16 bytes; ``kind`` "numpy", "cupy" or "torch": ``ko``'s library). Otherwise every
    thread stores its pairs of O."""
    if fp8 or splits > 1:
        return False
    if kind == "numpy" or simulated():
        return ko.shape[3] * ko.itemsize % TMA_ALIGNMENT == 0
    from numba_flash.launch import device_array

    return tma_ready(device_array(ko, kind))


@functools.lru_cache(maxsize=None)
def _no_bounds(device_id):
    """The ``seqlens`` argument of a rectangular call (never read): int32 zeros on the device."""
    from numba_flash._cuda import cuda

    with cuda.gpus[device_id]:
        return cuda.to_device(np.zeros((2, 1), np.int32))


def _launch(ctx, p, q, k, v, o, lse, D, bm, bn, stages, schedule, scales, packed=None, splits=1,
            tma_store=False, recipe=None) -> None:
    """One launch of the kernel into ``o`` / ``lse`` (``splits > 1``: the float32 partials
    ``(splits * B, H, Nq, D)`` and ``(splits * B, H, Nq)``, written as they stand). ``recipe``: a
    list that gets, where a plan can repeat this launch with new pointers (no user mods, rectangular,
    q, k and v read by TMA where they are, O written in place; fp8: V^T's pass read from V where it
    is; ALiBi's slopes, in the kernel's units, made anew for each call), a :class:`Fa3Recipe`."""
    from numba_flash.block_sparse import lists_at
    from numba_flash.kernels.fa3 import value_row_bytes
    from numba_flash.kernels.jit import LOG2E
    from numba_flash.launch import device_array, launch, numba_launch
    from numba_flash.tensor_cores import bits_view
    from numba_flash.user_mods import compiling

    fp8 = p.dtype == FP8_DTYPE
    user = p.user_mods
    ko = None if splits > 1 else _kernel_view(o, ctx.kind)
    by_tma = tma_store and ko is not None and stores_o_by_tma(ko, "numpy" if ctx.kind == "numpy" else "cupy", fp8,
                                                               splits)
    kernel = kernel_for(p, D, bm, bn, stages, *schedule, varlen=packed is not None, split=splits > 1, tma_store=by_tma)
    B, H, Nq, Dq = p.q_shape
    grid = (-(-Nq // bm), H, B * splits) if packed is None else (-(-packed.max_seqlen_q // bm), H, packed.sequences)
    if grid[0] == 0:
        return
    block = (kernel.fa3_threads,)
    scalars = [np.float32(p.scale * LOG2E), np.int32(Nq), np.int32(p.n_k), np.int32(p.group)]
    # the score mods' arguments (kernels.fa3: softcap_log2, alibi[, mod_args[, walk_counts, walk_lists]])
    slopes = alibi.slopes_argument(p, ctx.kind)
    mods = [np.float32(p.softcap * LOG2E)]
    mod_arrays = [] if user is None else [tuple(p.mod_args)]
    lists = [] if user is None or not user.block_sparse else lists_at(ctx, p, (bm, bn), "q")
    kq, kk, kv = (_kernel_view(x, ctx.kind, fp8) for x in (q, k, v))
    if fp8 and ctx.kind == "numpy":  # V^T, its keys in P's register order (numba_flash.fp8)
        kv = fp8_inputs.transposed_values(kv)
    if splits > 1:  # float32 partials, all D columns, written in place
        ko = wide = pairs = bits_view(o, ctx.kind, False)
    elif by_tma:  # TMA writes the caller's columns and rows, in place
        wide = pairs = ko
    else:
        pairs = _pairs_view(ko, D)  # the kernel writes O as 32-bit pairs, all D columns
        wide = pairs if pairs is not None else _pairs_view(_empty_like(ko, (B, H, Nq, D)), D)
    klse = bits_view(lse, ctx.kind, False)
    if simulated():  # the twins read the arrays themselves; the tensor maps are unused words
        maps = [np.zeros(16 if packed is None else (packed.sequences, 16), np.uint64) for _ in range(4)]
        written = [np.ascontiguousarray(x) for x in (wide, klse)]  # (the simulator's arguments are whole buffers)
        with compiling(user):
            numba_launch(kernel, grid, block, None, [*(np.ascontiguousarray(x) for x in (kq, kk, kv)), *written, *maps,
                                                     *scalars, *scales, *mods, np.ascontiguousarray(slopes),
                                                     np.zeros((2, 1), np.int32) if packed is None else packed.bounds,
                                                     *(tuple(np.ascontiguousarray(a) for a in arrays)
                                                       for arrays in mod_arrays), *lists], kernel.fa3_smem)
        for x, y in zip((wide, klse), written):
            if x is not y:
                x[...] = y
        _narrow(ko, wide, pairs, Dq)
        return
    from numba_flash._cuda import cuda

    per_row = TMA_ALIGNMENT // kq.itemsize
    device_id = ctx.device_id if ctx.device_id is not None else cuda.get_current_device().id
    if ctx.kind == "numpy":  # device copies there and back
        inputs = [cuda.to_device(np.ascontiguousarray(x) if x.shape[3] % per_row == 0 else _tma_copy(x))
                  for x in (kq, kk, kv)]
        outputs = [cuda.device_array(wide.shape, wide.dtype), cuda.device_array(klse.shape, np.float32)]
        arrays = [device_array(x, "numba") for x in (*inputs, *outputs)]
        extra = [device_array(x, "numba") for x in scales]  # (scales holds the device copies)
        copies = [cuda.to_device(np.ascontiguousarray(slopes)),  # (alive until the results are copied back)
                  _no_bounds(device_id) if packed is None else cuda.to_device(packed.bounds),
                  *(tuple(cuda.to_device(np.ascontiguousarray(a)) for a in arrays_) for arrays_ in mod_arrays)]
        mod_tail = [device_array(copies[0], "numba"), device_array(copies[1], "numba"),
                    *(tuple(device_array(x, "numba") for x in arrays_) for arrays_ in copies[2:])]
        stream_ptr = 0
    else:
        stream_ptr = ctx.stream_ptr()
        value_pass = [] if recipe is not None else None
        if fp8:  # V^T in one pass on the caller's stream (kernels.value_transpose)
            kv = fp8_inputs.transposed_values(kv, stream_ptr, device_id, value_pass)
        inputs = [x if tma_ready(device_array(x, "cupy")) else _tma_copy(x) for x in (kq, kk, kv)]
        arrays = [device_array(x, "cupy") for x in (*inputs, wide, klse)]
        extra = scales
        bounds = (device_array(_no_bounds(device_id), "numba") if packed is None
                  else device_array(packed.bounds, ctx.kind))
        mod_tail = [device_array(slopes, ctx.kind), bounds] + [tuple(device_array(a, ctx.kind) for a in arrays_)
                                                                for arrays_ in mod_arrays]
    # the four maps' boxes: (the array they describe, box rows, row bytes): q's, k's, v's (fp8: V^T's, boxes
    # of D rows), and O's, a consumer warpgroup's 64 rows (without the TMA store q's stands in, unread)
    boxes = ((0, bm, 128), (1, bn, 128), (2, D, value_row_bytes(bn)) if fp8 else (2, bn, 128),
             (3, 64, 128) if by_tma else (0, bm, 128))
    on = map_stream(stream_ptr)  # (whether it is being captured: asked once for the four maps)
    if packed is None:
        maps = [tensor_map(arrays[at], rows, p.dtype, device_id, row_bytes, on) for at, rows, row_bytes in boxes]
    else:  # a map per sequence (its rows alone: zeros past its end; O's: nothing written past it)
        cu_q, cu_k = packed.host_bounds
        maps = [sequence_maps(arrays[at], rows, p.dtype, device_id, cu_k if at in (1, 2) else cu_q, on)
                for at, rows, _ in boxes]
    args = (arrays + [device_array(m, "numba") for m in maps] + scalars + list(extra) + mods + mod_tail
            + [device_array(x, "numba") for x in lists])
    if (recipe is not None and ctx.kind != "numpy" and packed is None and user is None
            and pairs is not None and all(x is y for x, y in zip(inputs, (kq, kk, kv)))
            and (not fp8 or value_pass)):  # (O written in place; fp8: V^T read from V where it lies)
        from numba_flash.launch import PointerSlot, prepare_launch

        slotted = [a._replace(ptr=PointerSlot(i)) for i, a in enumerate(args[:9])] + args[9:]
        if p.alibi:  # the kernel's slopes (alibi.kernel_slopes of each call's): pointer slot 9
            at = len(arrays) + len(maps) + len(scalars) + len(extra) + len(mods)  # (mod_tail's first)
            slotted[at] = args[at]._replace(ptr=PointerSlot(9))
        maps_made = tuple((at, arrays[at], rows, row_bytes) for at, rows, row_bytes in boxes)  # (pointer slot at)
        values = None if not fp8 else (value_pass[0], ctx.allocator(tuple(kv.shape), "uint8"))
        recipe.append(Fa3Recipe(prepare_launch(kernel, grid, block, slotted, kernel.fa3_smem, device_id), maps_made,
                                (slopes, _no_bounds(device_id)), values,  # (placeholders the launch points at, kept)
                                p.batch if p.alibi else None))
    with compiling(user):
        launch(kernel, grid, block, stream_ptr, args, kernel.fa3_smem, device_id)
    if ctx.kind == "numpy":
        wide[...] = outputs[0].copy_to_host()
        klse[...] = outputs[1].copy_to_host()
    _narrow(ko, wide, pairs, Dq)


# ------------------------------------------------------------------------------------------
# Plans: a signature's checks and launch kept, its calls only launched
# ------------------------------------------------------------------------------------------

_PLANS = plans.PlanCache()  # fa3's plans by signature (_plan_key)


def _plan_key(q, k, v, out, lse_out, causal, scale, block_m, block_n, num_splits, window_size, softcap,
              alibi_slopes=None):
    """The signature of a call (``numba_flash.plans``, as ``api``'s forward keys fa2): everything its
    checks and launch depend on but pointers; ``None`` when it has none (NumPy, CAI or DLPack objects)."""
    try:
        arrays = tuple(array_signature(x) for x in (q, k, v, out, lse_out) if x is not None)
        if alibi_slopes is not None:
            arrays += ("alibi_slopes", array_signature(alibi_slopes))
    except (AttributeError, RuntimeError):
        return None
    window = plans.pair_key(window_size)
    if None in arrays or window is None:
        return None
    return (arrays, out is None, lse_out is None, plans.value_key(causal), plans.value_key(scale),
            plans.value_key(block_m), plans.value_key(block_n), plans.value_key(num_splits), window,
            plans.value_key(softcap))


class Fa3Recipe(NamedTuple):
    """What :func:`_launch` leaves for a plan: the kernel's launch prepared with pointer slots (q,
    k, v -- fp8: V^T --, o, lse, then four tensor maps, then ALiBi's slopes), the maps as ``(pointer
    slot, array, box rows, row bytes)``, the device arrays the launch points at (kept alive), for fp8
    the V^T pass (``(its launch prepared with V's and V^T's pointer slots, V^T's allocator)``) or
    ``None``, and with ALiBi the batch its slopes are made for (``alibi.kernel_slopes``) or ``None``."""

    prepared: object
    maps: tuple
    constants: tuple
    values: tuple | None
    slopes_batch: int | None = None


class Fa3Plan:
    """A call of one signature, launched (the fa2 plans' idea, ``numba_flash.plans``; fa3's own
    because its launch takes tensor maps, which depend on the pointers): per call the checks that
    depend on addresses (results sharing memory with an input; the 16-byte alignment TMA needs: a
    misaligned call takes the unplanned path), the results allocated, fp8's V^T made (its pass
    launched into a new buffer), each array's tensor map looked up by its pointer (encoded once per
    pointer, :func:`tensor_map_address`), and the launches of the prepared parameters on the
    caller's current stream."""

    tile_entries = None  # (fa3's tiles are not autotuned: a plan never goes stale)

    def __init__(self, recipe: Fa3Recipe, results, owners, kind, pointer, stream_ptr, switch, dtype):
        self.recipe, self.results, self.owners = recipe, results, owners
        self.kind, self.pointer, self.stream_ptr, self.device_id = kind, pointer, stream_ptr, recipe.prepared.device_id
        self.switch, self.dtype = switch, dtype

    def __call__(self, q, k, v, out, lse_out, alibi_slopes=None):
        """``(o, lse)``, or ``None`` (nothing launched) where an array is not 16-byte aligned."""
        if out is not None or lse_out is not None:
            check_no_overlap(self.kind, q, k, v, out, lse_out)
        with contextlib.nullcontext() if self.switch is None else self.switch():
            o = self.results[0]() if out is None else out
            lse = self.results[1]() if lse_out is None else lse_out
            read = self.pointer
            pointers = [read(q), read(k), read(v), read(o), read(lse)]
            if any(ptr % TMA_ALIGNMENT for ptr in pointers[:4]):
                return None
            stream_ptr = self.stream_ptr()
            stream = core_stream(stream_ptr, self.device_id)
            values = self.recipe.values
            if values is not None:  # fp8: V^T into a new buffer, kept until the kernel is queued
                transpose, allocate = values
                vt = allocate()
                transpose(stream, (pointers[2], read(vt)))
                pointers[2] = read(vt)
            on = map_stream(stream_ptr)
            for slot, template, rows, row_bytes in self.recipe.maps:
                pointers.append(tensor_map_address(template._replace(ptr=pointers[slot]), rows, self.dtype,
                                                   self.device_id, row_bytes, on))
            if self.recipe.slopes_batch is not None:  # this call's slopes in the kernel's units (alive until queued)
                slopes = alibi.kernel_slopes(alibi_slopes, self.recipe.slopes_batch, self.kind)
                pointers.append(read(slopes))
            self.recipe.prepared(stream, pointers)
        return o, lse


def _planned(ctx, p, out_dtype: str, recipe: Fa3Recipe, owners) -> Fa3Plan:
    B, H, Nq, Dq = p.q_shape
    results = (ctx.allocator((B, H, Nq, Dq), out_dtype), ctx.allocator((B, H, Nq), "float32"))
    return Fa3Plan(recipe, results, tuple(owners), ctx.kind, pointer_reader(ctx.kind), ctx.stream_ptr_reader(),
                   ctx.device_switch(), p.dtype)


def _pairs_view(x, width: int):
    """``x`` (B, H, N, width) uint16 as (B, H, N, width / 2) uint32 pairs, or ``None`` when it is not
    that wide or its rows cannot be seen as 32-bit words (strides, alignment)."""
    if x.shape[3] != width or (x.strides[3] != 2 and width > 1):
        return None
    ptr = x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr
    if ptr % 4 or any(s % 4 for s in x.strides[:3]):
        return None
    try:
        return x.view(np.uint32)
    except (ValueError, TypeError):
        return None


def _empty_like(x, shape):
    if isinstance(x, np.ndarray):
        return np.empty(shape, np.uint16)
    import cupy

    return cupy.empty(shape, np.uint16)


def _narrow(ko, wide, pairs, width: int) -> None:
    """The output's first ``width`` columns from the kernel's padded pairs (nothing when the kernel
    wrote the caller's buffer itself)."""
    if pairs is None:
        ko[...] = wide.view(np.uint16)[..., :width]

