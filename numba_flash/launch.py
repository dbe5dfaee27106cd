"""Launch a compiled kernel on device arrays without numba's per-call dispatch.

``kernel[grid, block, stream](*args)`` types every argument, resolves the overload, wraps
each foreign array as a numba device array (``from_cuda_array_interface``) and packs it:
for the arrays of an attention kernel (seven arguments for FA-2, ten for FA-1) that was
0.3-0.4 ms of host time per call on the H200 machine, far more than a small problem's
kernel. For arrays whose pointer, shape
and strides are at hand (CuPy, PyTorch CUDA tensors, numba device arrays), this module
does the packing itself:

- it compiles, once, an overload for those arrays (dtype, ndim, and layout ``C`` when
  C-contiguous, else ``A``, valid for any strides, where numba itself might type an
  F-contiguous array ``F``; ``dispatcher.compile`` caches it in ``dispatcher.overloads``);
- it passes each array in numba's kernel ABI for arrays -- meminfo, parent, size,
  itemsize, data pointer, shape..., strides in bytes... -- exactly as numba's
  ``_Kernel._prepare_args`` does, and a float32 (int32) scalar as a C float (int);
- it calls ``cuda.core.launch`` with the kernel numba loaded, on the caller's stream.

Only the GPU uses it; the simulator (and NumPy inputs) go through numba's own launch
(:func:`numba_launch` adds dynamic shared memory to it).

Per device, looked up once: compiled kernels are cached per (dispatcher, argument types,
device id), loaded into that device's context and opted in to their dynamic shared memory
there; the device id comes from the caller's arrays (``arrays.device_id_of``), so the hot path
asks the driver nothing. The stream is cuda.core's own ``Stream`` for the caller's handle,
made once per (device, handle): handing cuda.core a foreign stream object through the
``__cuda_stream__`` protocol is deprecated there. The caller makes the arrays' device
current for the launch (``ArrayContext.on_device``).

Packed once, launched many times: :func:`prepare_launch` does all of the above for arguments
whose pointers may still be open (:class:`PointerSlot`), and returns a :class:`PreparedLaunch`
that writes a call's pointers into the packed parameters and launches. :func:`launch` is a
prepared launch used once; ``numba_flash.plans`` keeps them for calls of one signature.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import numpy as np

from numba_flash._world import simulated
from numba_flash.arch import STATIC_SMEM_LIMIT
from numba_flash.arrays import dtype_name


class PointerSlot(NamedTuple):
    """The data pointer of a prepared launch's array argument that is only known per call:
    entry ``index`` of the pointers a :class:`PreparedLaunch` is called with."""

    index: int


class DeviceArray(NamedTuple):
    """What a kernel needs to know about a device array."""

    ptr: int  # or a PointerSlot (prepare_launch)
    shape: tuple
    strides: tuple  # in bytes
    dtype: str  # "float32", "float16", "int32"
    itemsize: int
    size: int
    c_contiguous: bool

    def abi_fields(self) -> list:
        """numba's kernel arguments for one array (``_Kernel._prepare_args``); the data pointer
        is field :data:`POINTER_FIELD`."""
        return [0, 0, self.size, self.itemsize, self.ptr, *self.shape, *self.strides]


POINTER_FIELD = 4  # meminfo, parent, nitems, itemsize, data, shape..., strides...


def device_array(x, kind: str) -> DeviceArray:
    """Pointer, shape, strides and dtype of a CuPy array, a torch CUDA tensor or a numba
    device array (``kind`` "cupy", "torch" or "numba")."""
    dtype = dtype_name(x, kind)
    if kind == "cupy":
        return DeviceArray(x.data.ptr, x.shape, x.strides, dtype, x.itemsize, x.size, x.flags.c_contiguous)
    if kind == "torch":
        item = x.element_size()
        strides = tuple(s * item for s in x.stride())
        return DeviceArray(x.data_ptr(), tuple(x.shape), strides, dtype, item, x.numel(), x.is_contiguous())
    ptr = x.device_ctypes_pointer.value or 0
    return DeviceArray(ptr, tuple(x.shape), tuple(x.strides), dtype, x.dtype.itemsize, x.size, x.is_c_contiguous())


@functools.lru_cache(maxsize=None)
def _numba_array_type(dtype: str, ndim: int, c_contiguous: bool):
    from numba.cuda import types

    return types.Array(getattr(types, dtype), ndim, "C" if c_contiguous else "A")


def _signature(args) -> tuple:
    """numba's types of a direct launch's arguments, as ``numba.typeof`` gives them (a tuple of
    one array type: ``UniTuple``; else ``Tuple``, ``Tuple(())`` when empty)."""
    from numba.cuda import types

    sig = []
    for a in args:
        if isinstance(a, DeviceArray):
            sig.append(_numba_array_type(a.dtype, len(a.shape), a.c_contiguous))
        elif isinstance(a, np.float32):
            sig.append(types.float32)
        elif isinstance(a, np.int32):
            sig.append(types.int32)
        elif isinstance(a, tuple):
            inner = _signature(a)
            same = len(inner) > 0 and all(t == inner[0] for t in inner)
            sig.append(types.UniTuple(inner[0], len(inner)) if same else types.Tuple(inner))
        else:
            raise TypeError(f"no direct launch for an argument of type {type(a).__name__}")
    return tuple(sig)


def _argument_key(a):
    """What a compiled specialisation depends on in one direct-launch argument."""
    if isinstance(a, DeviceArray):
        return (a.dtype, len(a.shape), a.c_contiguous)
    if isinstance(a, tuple):
        return ("tuple", *(_argument_key(x) for x in a))
    return type(a)


_KERNELS: dict = {}  # (dispatcher id, device id, argument kinds) -> (dispatcher, cuda.core kernel, smem allowed, numba function)


def _current_device_id() -> int:
    """numba's current device (a driver call: only for callers that do not say which device)."""
    from numba_flash._cuda import cuda

    return cuda.get_current_device().id


def opt_in_shared_memory(cufunc, nbytes: int, device_id: int | None = None) -> None:
    """Let a compiled kernel launch with ``nbytes`` of dynamic shared memory on ``device_id``
    (above 48 KiB a kernel must opt in: ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``;
    numba-cuda has no API for it, so this sets it through the driver binding numba itself uses)."""
    if nbytes <= STATIC_SMEM_LIMIT:
        return
    from numba.cuda.cudadrv.driver import binding, driver

    device_id = _current_device_id() if device_id is None else device_id
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, nbytes, cufunc.handle, device_id)


def _on_numba_device(device_id: int):
    """numba's context manager that makes ``device_id`` current (used when compiling and
    loading a kernel for a device: once per kernel and device)."""
    from numba_flash._cuda import cuda

    return cuda.gpus[device_id]


@functools.lru_cache(maxsize=None)
def _compute_capability(device_id: int) -> tuple:
    from numba_flash._cuda import cuda

    return tuple(cuda.gpus[device_id].compute_capability)


def load_cubin(entry_name: str, cubin: bytes):
    """The kernel ``entry_name`` of ``cubin``, loaded into numba's current context as numba
    loads the kernels it compiles (``module.get_function``: ``.kernel``, ``.handle``)."""
    from cuda.core import ObjectCode
    from numba.cuda.cudadrv import devices

    module = devices.get_context().create_module_image(ObjectCode.from_cubin(cubin))
    return module.get_function(entry_name)


def _load_or_compile(dispatcher, signature: tuple, device_id: int):
    """numba's loaded kernel (``module.get_function``: ``.kernel``, ``.handle``) of ``dispatcher``
    for ``signature`` in the current context: from the persistent compilation cache when a
    process compiled it before (``numba_flash.compile_cache``), else compiled by numba and
    stored there. Kernels without an identity (``kernels.jit.kernel_factory``) or with numba
    module setup functions are compiled and not stored."""
    from numba_flash import compile_cache
    from numba_flash.kernels.jit import kernel_identity

    identity = kernel_identity(dispatcher)
    text = ", ".join(str(t) for t in signature)
    if identity is not None:
        hit = compile_cache.lookup(identity, text, _compute_capability(device_id))
        if hit is not None:
            return load_cubin(*hit)
    overload = dispatcher.compile(signature)
    library = overload._codelibrary
    cufunc = library.get_cufunc()  # numba loads it into this device's context
    if identity is not None and not library._setup_functions:
        cubin = library.get_cubin()
        compile_cache.store(identity, text, _compute_capability(device_id), library._entry_name,
                            cubin if isinstance(cubin, (bytes, bytearray)) else bytes(cubin.code))
    return cufunc


def compiled_kernel(dispatcher, args, shared_mem_bytes: int = 0, device_id: int | None = None):
    """The cuda.core kernel of ``dispatcher`` specialised for ``args`` and loaded on
    ``device_id`` (``None``: numba's current device), allowed ``shared_mem_bytes`` of dynamic
    shared memory; compiled, loaded and opted in once per (kernel, device)."""
    if device_id is None:
        device_id = _current_device_id()
    key = (id(dispatcher), device_id, *(_argument_key(a) for a in args))
    hit = _KERNELS.get(key)
    if hit is None or hit[0] is not dispatcher or hit[2] < shared_mem_bytes:
        with _on_numba_device(device_id):
            if hit is not None and hit[0] is dispatcher:  # loaded already: only a larger opt-in
                cufunc = hit[3]
            else:
                cufunc = _load_or_compile(dispatcher, _signature(args), device_id)
            opt_in_shared_memory(cufunc, shared_mem_bytes, device_id)
        allowed = max(shared_mem_bytes, 0 if hit is None or hit[0] is not dispatcher else hit[2])
        hit = _KERNELS[key] = (dispatcher, cufunc.kernel, allowed, cufunc)
    return hit[1]


def loaded_function(dispatcher, device_id: int | None = None):
    """numba's loaded function (``.attrs``: registers, shared and local bytes; ``.handle``) of
    the specialisation of ``dispatcher`` this process launched last on ``device_id`` (``None``:
    any device), compiled here or loaded from the compilation cache; ``None`` when it launched
    none. For the resource reports of a kernel whose dispatcher compiled nothing (its
    ``overloads`` are empty when the cache had it)."""
    found = None
    for key, hit in _KERNELS.items():
        if hit[0] is dispatcher and (device_id is None or key[1] == device_id):
            found = hit[3]
    return found


@functools.lru_cache(maxsize=256)
def _config(grid, block, shared_mem_bytes=0):
    from cuda.core import LaunchConfig

    return LaunchConfig(grid=grid, block=block, shmem_size=shared_mem_bytes)


@functools.lru_cache(maxsize=None)
def _cuda_core():
    """The ``cuda.core`` module (imported on the first launch; its ``launch`` is looked up per
    launch, so that a test can replace it)."""
    import cuda.core

    return cuda.core


@functools.lru_cache(maxsize=128)
def core_stream(stream_ptr: int, device_id: int):
    """cuda.core's own ``Stream`` for a raw stream handle (0: the legacy default stream), made
    once per (device, handle). Not the caller's object through ``__cuda_stream__``: cuda.core
    deprecates that. The handle is borrowed: the caller's stream must outlive its use, as it
    must for any launch on it."""
    from cuda.core import Stream

    return Stream.from_handle(int(stream_ptr))


class PreparedLaunch(NamedTuple):
    """One kernel launch with its parameters packed: the cuda.core kernel (compiled, loaded on
    ``device_id`` and opted in to its shared memory), its launch configuration, and numba's
    kernel ABI of every argument, with 0 where a :class:`PointerSlot` was.

    Calling it writes ``pointers[slot.index]`` into each such place and launches. Valid for
    arrays of the shapes, strides and dtypes it was prepared with (only pointers change);
    a caller that keeps it (``numba_flash.plans``) keys it by them."""

    kernel: object
    config: object
    params: tuple
    pointer_slots: tuple  # (index into params, index into the pointers of a call), ...
    device_id: int

    def __call__(self, stream, pointers=()) -> None:
        """Launch on ``stream`` (a ``cuda.core.Stream``: :func:`core_stream`) with the call's
        ``pointers``."""
        params = list(self.params)
        for at, which in self.pointer_slots:
            params[at] = pointers[which]
        _cuda_core().launch(stream, self.config, self.kernel, *params)


def prepare_launch(dispatcher, grid, block, args, shared_mem_bytes: int = 0,
                   device_id: int | None = None) -> PreparedLaunch:
    """``dispatcher[grid, block, stream, shared_mem_bytes](*args)`` packed for launches to come,
    for ``DeviceArray`` (whose ``ptr`` may be a :class:`PointerSlot`), float32 and int32
    arguments.

    ``shared_mem_bytes``: dynamic shared memory per block (above 48 KiB the kernel is opted in,
    once per kernel and device). ``device_id``: the GPU the arrays live on, which must be the
    current device when the launch is called (``None``: numba's current device, asked of the
    driver: pass it)."""
    if device_id is None:
        device_id = _current_device_id()
    kernel = compiled_kernel(dispatcher, args, shared_mem_bytes, device_id)
    params, slots = [], []
    _pack(args, params, slots)
    return PreparedLaunch(kernel, _config(grid, block, shared_mem_bytes), tuple(params), tuple(slots), device_id)


def _pack(args, params: list, slots: list) -> None:
    """numba's kernel ABI of ``args`` appended to ``params`` (a tuple's members in order, as
    numba's ``_Kernel._prepare_args`` flattens them), pointer slots to ``slots``."""
    for a in args:
        if isinstance(a, DeviceArray):
            fields = a.abi_fields()
            if isinstance(a.ptr, PointerSlot):
                slots.append((len(params) + POINTER_FIELD, a.ptr.index))
                fields[POINTER_FIELD] = 0
            params.extend(fields)
        elif isinstance(a, tuple):
            _pack(a, params, slots)
        elif isinstance(a, np.int32):
            params.append(ctypes.c_int32(a))
        else:
            params.append(ctypes.c_float(a))


def launch(dispatcher, grid, block, stream_ptr: int, args, shared_mem_bytes: int = 0,
           device_id: int | None = None) -> None:
    """``dispatcher[grid, block, stream, shared_mem_bytes](*args)`` for ``DeviceArray``,
    float32 and int32 arguments, on the stream with handle ``stream_ptr`` (a
    :func:`prepare_launch` used once: every pointer given)."""
    prepared = prepare_launch(dispatcher, grid, block, args, shared_mem_bytes, device_id)
    prepared(core_stream(stream_ptr, prepared.device_id))


_OPTED_IN: dict = {}  # (dispatcher id, signature, device id) -> dynamic shared bytes allowed


def numba_launch(dispatcher, grid, block, stream, args, shared_mem_bytes: int = 0) -> None:
    """numba's own launch, ``dispatcher[grid, block, stream, shared_mem_bytes](*args)``, with
    dynamic shared memory: above 48 KiB the overload for ``args`` is opted in first (once per
    kernel, signature and device). ``stream``: a numba stream or ``None`` (the default stream).
    Works in the simulator too (no opt-in there: ``cuda.shared.array(0, dtype)`` gets the size).

    On a GPU, arguments that are all numba device arrays and float32 / int32 scalars go through
    :func:`launch` instead (the compilation cache, no dispatcher, so none of its warnings reach
    the caller); host arrays still go through numba's dispatcher, which copies them."""
    if not simulated():
        direct = _direct_arguments(args)
        if direct is not None:
            launch(dispatcher, grid if isinstance(grid, tuple) else (grid,), block if isinstance(block, tuple) else (block,),
                   0 if stream is None else int(stream.handle), direct, shared_mem_bytes)
            return
    if shared_mem_bytes > STATIC_SMEM_LIMIT and not simulated():
        from numba import typeof

        sig = tuple(typeof(a) for a in args)
        device_id = _current_device_id()
        key = (id(dispatcher), sig, device_id)
        if _OPTED_IN.get(key, 0) < shared_mem_bytes:
            overload = dispatcher.compile(sig)
            opt_in_shared_memory(overload._codelibrary.get_cufunc(), shared_mem_bytes, device_id)
            _OPTED_IN[key] = shared_mem_bytes
    dispatcher[grid, block, 0 if stream is None else stream, shared_mem_bytes](*args)


def _direct_arguments(args) -> list | None:
    """``args`` as :func:`launch` takes them (numba device arrays as ``DeviceArray``; a tuple of
    them, a user's ``mod_args``, as a tuple of those), or ``None`` when one of them is something
    else (a host array, a Python number)."""
    out = []
    for a in args:
        if isinstance(a, (np.float32, np.int32, DeviceArray)):
            out.append(a)
        elif hasattr(a, "device_ctypes_pointer") and hasattr(a, "is_c_contiguous"):
            out.append(device_array(a, "numba"))
        elif isinstance(a, tuple):
            inner = _direct_arguments(a)
            if inner is None:
                return None
            out.append(tuple(inner))
        else:
            return None
    return out
