"""Memoised launch plans: the GPU path of a call whose signature was seen before.

What a call of ``attention`` or ``decode`` on CuPy arrays or torch CUDA tensors works out
before it launches -- every check of its arguments, the tiles, the kernel specification, the
grid, the split count, the compiled kernel and numba's kernel ABI of every argument but the
data pointers -- depends on the call's *signature*: the arrays' types, shapes, strides,
dtypes and devices (``arrays.array_signature``) and the other arguments' types and values
(:func:`value_key`). Not on the arrays' data or addresses. A :class:`CallPlan` keeps that
outcome under the signature, and a later call with the same key only:

- runs the checks that depend on addresses: results that share memory with an input
  (``out``, ``lse_out``), and the 16-byte alignment ``cp.async`` needs of the tensor-core
  inputs (a misaligned call takes the unplanned path, which copies into aligned buffers);
- allocates its results and scratch arrays (split-KV partials, FA-1's O, l, m);
- writes the arrays' pointers into the packed parameters and launches on the caller's current
  stream, with the arrays' device current.

A signature whose checks fail is never stored, so a bad call raises on every call. A plan
goes stale only when the tiles it took from the autotune cache change (``numba-flash
autotune`` saves new ones; :meth:`PlanCache.get` compares the cache's entries with those the
plan was made with); the rest of what it holds (compiled kernels, SM counts, the simulator
switch) is fixed for the process. :func:`clear` forgets every plan (tests that change the
launch path).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import numpy as np

from numba_flash import tile_cache
from numba_flash.arrays import pointer_reader
from numba_flash.launch import DeviceArray, PointerSlot, core_stream, device_array, prepare_launch
from numba_flash.tensor_cores import CP_ASYNC_ALIGNMENT

MAX_PLANS = 256  # per cache; the oldest plan is dropped first (a long run of distinct shapes)

_CACHES: list = []
_SAME_DEVICE = contextlib.nullcontext()  # reusable: enters and leaves doing nothing


class PlanCache:
    """Plans by key, at most :data:`MAX_PLANS` (the oldest dropped first)."""

    def __init__(self):
        self._plans: dict = {}
        _CACHES.append(self)

    def get(self, key):
        """The plan stored under ``key``, or ``None`` (also for ``key`` ``None``, an unhashable
        key, and a plan whose tuned tiles were replaced since it was made)."""
        try:
            plan = self._plans.get(key)
        except TypeError:  # an unhashable argument: the unplanned checks say what is wrong with it
            return None
        if plan is not None and plan.tile_entries is not None and plan.tile_entries is not tile_cache.load():
            return None
        return plan

    def put(self, key, plan) -> None:
        try:
            if key not in self._plans and len(self._plans) >= MAX_PLANS:
                self._plans.pop(next(iter(self._plans), None), None)  # (another thread may have)
            self._plans[key] = plan
        except TypeError:  # an unhashable argument that passed the checks: that call stays unplanned
            pass

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()


def clear() -> None:
    """Forget every plan of every cache."""
    for cache in _CACHES:
        cache.clear()


def value_key(x) -> tuple:
    """A non-array argument as part of a plan key: its type and value (``True`` and ``1``, which
    compare equal, pass different checks), and for a float zero its sign (``scale=-0.0`` and
    ``0.0`` give scores of different signs)."""
    if isinstance(x, (float, np.floating)):
        return type(x), x, math.copysign(1.0, x)
    return type(x), x


def pair_key(x) -> tuple | None:
    """A pair argument (``window_size``) as part of a plan key; ``None`` when it is not a tuple
    or list of two hashable values (the call's checks then say what is wrong)."""
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        return None
    key = (type(x),) + tuple(value_key(e) for e in x)
    try:
        hash(key)
    except TypeError:
        return None
    return key


class CallPlan(NamedTuple):
    """What a call of one signature launches (built by :class:`PlanBuilder`).

    The call's arrays are numbered: those of the caller, in the order :meth:`launch` takes
    them (q, k, v, o, lse, and decode's seqlens), then the scratch arrays the plan allocates
    per call. Valid for arrays of the signature it was made for."""

    call: object  # the checked call (``api.LaunchConfig``): the unplanned path's input
    results: tuple  # allocators of o and lse, in the caller's shapes
    scratch: tuple  # allocators of the scratch arrays, in their numbering
    launches: tuple  # launch.PreparedLaunch, in order
    aligned: tuple  # numbers of the arrays whose pointers cp.async needs 16-byte aligned
    constants: tuple  # arrays whose pointers the launches hold (placeholders): kept alive here
    pointer: object  # array -> data pointer (arrays.pointer_reader)
    stream_ptr: object  # () -> the caller's current stream handle
    device_id: int
    device_switch: object  # () -> a context making the arrays' device current; None: one GPU
    tile_entries: object  # the autotune cache's entries the tiles came from (None: not from there)

    def on_device(self):
        """The context for a call: the arrays' device current (``ArrayContext.on_device``)."""
        return _SAME_DEVICE if self.device_switch is None else self.device_switch()

    def allocate(self, out=None, lse_out=None) -> tuple:
        """``(o, lse)``: the caller's buffers, or new ones (inside :meth:`on_device`)."""
        return (self.results[0]() if out is None else out, self.results[1]() if lse_out is None else lse_out)

    def launch(self, arrays) -> bool:
        """Launch on the caller's ``arrays`` (in their numbering) and new scratch arrays, on the
        current stream; ``False``, with nothing launched, when an input that ``cp.async`` reads
        is not 16-byte aligned."""
        read = self.pointer
        pointers = [read(x) for x in arrays]
        for i in self.aligned:
            if pointers[i] % CP_ASYNC_ALIGNMENT:
                return False
        scratch = [allocate() for allocate in self.scratch]  # alive until every launch is queued
        pointers += [read(x) for x in scratch]
        stream = core_stream(self.stream_ptr(), self.device_id)
        for prepared in self.launches:
            prepared(stream, pointers)
        return True


class PlanBuilder:
    """Collects a :class:`CallPlan` for a call of ``caller_arrays`` arrays of the caller's
    (numbered first), under the array context ``ctx`` of its first call (kind, device)."""

    def __init__(self, ctx, call, caller_arrays: int):
        self.ctx, self.call = ctx, call
        self.count = caller_arrays
        self.scratch, self.launches, self.aligned, self.constants = [], [], [], []

    def caller_array(self, index: int, x, kind=None) -> DeviceArray:
        """Caller's array ``index`` as its launches see it: ``x`` is this call's (or a view of
        it at the same address, as decode's packed rows), described with its pointer open."""
        return device_array(x, kind or self.ctx.kind)._replace(ptr=PointerSlot(index))

    def result_array(self, index: int, shape, dtype: str) -> DeviceArray:
        """Caller's array ``index`` when the plan allocates it: C-contiguous of ``shape``."""
        return contiguous_array(PointerSlot(index), shape, dtype)

    def scratch_array(self, shape, dtype: str) -> DeviceArray:
        """A C-contiguous array the plan allocates per call (numbered after the caller's)."""
        self.scratch.append(self.ctx.allocator(shape, dtype))
        self.count += 1
        return contiguous_array(PointerSlot(self.count - 1), shape, dtype)

    def constant(self, x, kind: str) -> DeviceArray:
        """An array the same for every call (a placeholder), with its pointer."""
        self.constants.append(x)
        return device_array(x, kind)

    def require_aligned(self, *indices: int) -> None:
        self.aligned.extend(indices)

    def add_launch(self, dispatcher, grid, block, args, shared_mem_bytes: int = 0) -> None:
        self.launches.append(prepare_launch(dispatcher, grid, block, args, shared_mem_bytes, self.ctx.device_id))

    def plan(self, result_shapes, tile_entries=None) -> CallPlan:
        """The plan; ``result_shapes``: ((shape, dtype) of o, of lse) as the caller gets them."""
        ctx = self.ctx
        return CallPlan(self.call, tuple(ctx.allocator(shape, dtype) for shape, dtype in result_shapes),
                        tuple(self.scratch), tuple(self.launches), tuple(self.aligned), tuple(self.constants),
                        pointer_reader(ctx.kind), ctx.stream_ptr_reader(), ctx.device_id, ctx.device_switch(),
                        tile_entries)


ITEMSIZE = {"float16": 2, "bfloat16": 2, "uint16": 2, "float32": 4, "int32": 4}


def contiguous_array(ptr, shape, dtype: str) -> DeviceArray:
    """The ``DeviceArray`` of a C-contiguous array (as ``cupy.empty`` and ``torch.empty`` make)."""
    item = ITEMSIZE[dtype]
    strides, step = [], item
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return DeviceArray(ptr, tuple(shape), tuple(reversed(strides)), dtype, item, math.prod(shape), True)
