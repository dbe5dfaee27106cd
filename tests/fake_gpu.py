"""A fake GPU for the host path: CuPy and torch CUDA stand-ins whose arrays are pointers and
layouts only, and a cuda.core that records launches instead of running them.

With :func:`install`, ``numba_flash.attention`` and ``numba_flash.decode`` take their GPU path
(``ArrayContext.direct_launch``) on a machine without a GPU, up to the launch: every check,
plan, allocation and packed parameter list, no kernel. The kernels stay the simulator's (the
fake never runs one), so this tests and times host work only (``tests/host/test_host_path.py``).

The array libraries are modules put into ``sys.modules`` as ``cupy`` and ``torch``; arrays
compute their views (reshape, transpose, permute, indexing) on a NumPy layout over no memory,
so strides and pointer offsets follow NumPy's rules (CuPy's; torch's can differ in the stride
of a dimension of size 1, which no kernel reads).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import sys
import types

import numpy as np

_ADDRESSES = itertools.count(1 << 32, 1 << 20)  # a fresh 1 MiB-aligned block per allocation


def _layout(shape, strides, itemsize):
    """A NumPy array with this shape and these strides over no real memory (never read)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.dtype(f"V{itemsize}")), shape, strides)


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


_VIEWS: dict = {}  # (shape, strides, itemsize, operation) -> (shape, strides, byte offset) or None


def _view(shape, strides, itemsize, operation, argument):
    """A view's (shape, strides, byte offset) by NumPy's rules, or ``None`` when NumPy would have
    to copy. ``operation``: "reshape", "transpose" or "getitem". Memoised: the libraries compute
    a view in C, so that a view costs the fake about what it costs them."""
    key = (shape, strides, itemsize, operation, repr(argument))
    if key in _VIEWS:
        return _VIEWS[key]
    layout = _layout(shape, strides, itemsize)
    try:
        if operation == "reshape":
            view = np.reshape(layout, argument, copy=False)
        elif operation == "transpose":
            view = layout.transpose(*argument)
        else:
            view = layout[argument]
    except ValueError:
        _VIEWS[key] = None
        return None
    offset = view.__array_interface__["data"][0] - layout.__array_interface__["data"][0]
    _VIEWS[key] = result = tuple(view.shape), tuple(view.strides), offset
    return result


def _copied_shape(shape, operation, argument):
    """The shape of a view NumPy could not make (the library copies)."""
    assert operation == "reshape", operation
    return tuple(np.empty(shape, np.uint8).reshape(argument).shape)


class _Flags:
    def __init__(self, c_contiguous):
        self.c_contiguous = c_contiguous


def _is_c_contiguous(shape, strides, itemsize):
    expected = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


# ------------------------------------------------------------------------------------------
# CuPy
# ------------------------------------------------------------------------------------------


class FakeCupyArray:
    """A CuPy array on device 0: pointer, shape, strides (bytes) and dtype."""

    def __init__(self, shape, dtype=np.float32, strides=None, ptr=None, device_id=0, memptr=None):
        ptr = memptr.ptr if memptr is not None else ptr
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.shape = tuple(int(n) for n in shape)
        self.strides = _c_strides(self.shape, self.itemsize) if strides is None else tuple(strides)
        self.size = math.prod(self.shape)
        self.ndim = len(self.shape)
        self.flags = _Flags(_is_c_contiguous(self.shape, self.strides, self.itemsize))
        self.data = types.SimpleNamespace(ptr=next(_ADDRESSES) if ptr is None else ptr, device_id=device_id)
        self.device = types.SimpleNamespace(id=device_id)

    def _derived(self, operation, argument):
        view = _view(self.shape, self.strides, self.itemsize, operation, argument)
        if view is None:  # a copy, as CuPy makes for a reshape it cannot view
            return FakeCupyArray(_copied_shape(self.shape, operation, argument), self.dtype)
        shape, strides, offset = view
        return FakeCupyArray(shape, self.dtype, strides, self.data.ptr + offset, self.device.id)

    def reshape(self, *shape):
        return self._derived("reshape", shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)

    def transpose(self, *axes):
        return self._derived("transpose", axes)

    def swapaxes(self, a, b):
        axes = list(range(self.ndim))
        axes[a], axes[b] = axes[b], axes[a]
        return self._derived("transpose", tuple(axes))

    def __getitem__(self, index):
        return self._derived("getitem", index)

    def __setitem__(self, index, value):
        pass  # no memory: the fake records layouts, not data

    def view(self, dtype):
        """Same-size dtypes as they stand; another size, as CuPy does, through a last dimension of
        unit stride whose bytes the new size divides."""
        dtype = np.dtype(dtype)
        shape, strides = self.shape, self.strides
        if dtype.itemsize != self.itemsize:
            assert strides[-1] == self.itemsize and shape[-1] * self.itemsize % dtype.itemsize == 0, \
                "the fake views another size only through a contiguous last dimension"
            shape = shape[:-1] + (shape[-1] * self.itemsize // dtype.itemsize,)
            strides = strides[:-1] + (dtype.itemsize,)
        return FakeCupyArray(shape, dtype, strides, self.data.ptr, self.device.id)

    def astype(self, dtype, copy=True):
        return FakeCupyArray(self.shape, dtype)


FakeCupyArray.__module__ = "cupy"  # arrays.kind_of reads the library from the type's module


class _Stream:
    def __init__(self, ptr):
        self.ptr = ptr


def _cupy_module():
    cupy = types.ModuleType("cupy")
    cupy.ndarray = FakeCupyArray
    cupy.empty = lambda shape, dtype=np.float32: FakeCupyArray(shape if isinstance(shape, tuple) else (shape,), dtype)
    cupy.zeros = cupy.empty
    cupy.ascontiguousarray = lambda x: x if x.flags.c_contiguous else FakeCupyArray(x.shape, x.dtype)
    cupy.asarray = lambda x: x if isinstance(x, FakeCupyArray) else FakeCupyArray(np.shape(x), np.asarray(x).dtype)
    cupy.lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(
        as_strided=lambda x, shape, strides: FakeCupyArray(shape, x.dtype, strides, x.data.ptr, x.device.id)))
    stream = _Stream(0)
    cupy.cuda = types.SimpleNamespace(
        get_current_stream=lambda: stream,
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0),
        Device=lambda device_id=0: contextlib.nullcontext(),
        Stream=types.SimpleNamespace(from_external=lambda handle: contextlib.nullcontext()),
        UnownedMemory=lambda ptr, size, owner, device_id: types.SimpleNamespace(ptr=ptr),
        MemoryPointer=lambda memory, offset: types.SimpleNamespace(ptr=memory.ptr + offset),
    )
    return cupy


# ------------------------------------------------------------------------------------------
# torch
# ------------------------------------------------------------------------------------------


class FakeTorchDtype:
    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __repr__(self):
        return f"torch.{self.name}"

    __str__ = __repr__


_TORCH_DTYPES = {name: FakeTorchDtype(name, size) for name, size in
                 (("float16", 2), ("bfloat16", 2), ("float32", 4), ("int32", 4), ("uint16", 2),
                  ("float8_e4m3fn", 1), ("uint8", 1))}


class FakeDevice:
    def __init__(self, type_, index):
        self.type, self.index = type_, index

    def __eq__(self, other):
        return isinstance(other, FakeDevice) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self):
        return hash((self.type, self.index))


class FakeTensor:
    """A torch CUDA tensor: pointer, sizes, strides (elements) and dtype."""

    def __init__(self, shape, dtype, stride=None, ptr=None, device=None):
        self.dtype = dtype
        self._item = dtype.itemsize
        self.shape = tuple(int(n) for n in shape)
        self._stride = (tuple(s // self._item for s in _c_strides(self.shape, self._item)) if stride is None
                        else tuple(stride))
        self._ptr = next(_ADDRESSES) if ptr is None else ptr
        self._numel = math.prod(self.shape)
        self._contiguous = _is_c_contiguous(self.shape, [s * self._item for s in self._stride], self._item)
        self.device = FakeDevice("cuda", 0) if device is None else device
        self.is_cuda = self.device.type == "cuda"

    def stride(self):
        return self._stride

    def element_size(self):
        return self._item

    def data_ptr(self):
        return self._ptr

    def numel(self):
        return self._numel

    def is_contiguous(self):
        return self._contiguous

    def detach(self):
        return self

    def _derived(self, operation, argument):
        view = _view(self.shape, tuple(s * self._item for s in self._stride), self._item, operation, argument)
        if view is None:  # a copy, as torch's reshape makes when it cannot view
            return FakeTensor(_copied_shape(self.shape, operation, argument), self.dtype, device=self.device)
        shape, strides, offset = view
        return FakeTensor(shape, self.dtype, tuple(s // self._item for s in strides), self._ptr + offset, self.device)

    def reshape(self, *shape):
        return self._derived("reshape", shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)

    def permute(self, *dims):
        return self._derived("transpose", dims)

    def __getitem__(self, index):
        return self._derived("getitem", index)

    def __setitem__(self, index, value):
        pass

    def float(self):
        return FakeTensor(self.shape, _TORCH_DTYPES["float32"], device=self.device)

    def to(self, dtype):
        return FakeTensor(self.shape, dtype, device=self.device)


FakeTensor.__module__ = "torch"


def _torch_module():
    torch = types.ModuleType("torch")
    torch.Tensor = FakeTensor
    for name, dtype in _TORCH_DTYPES.items():
        setattr(torch, name, dtype)

    def empty(shape, dtype=None, device=None):
        return FakeTensor(shape, dtype, device=device)

    torch.empty = empty
    torch.from_numpy = lambda x: types.SimpleNamespace(
        to=lambda device: FakeTensor(x.shape, _TORCH_DTYPES[x.dtype.name], device=device))
    stream = types.SimpleNamespace(cuda_stream=0)
    torch.cuda = types.SimpleNamespace(
        current_stream=lambda device=None: stream,
        device_count=lambda: 1,
        device=lambda index: contextlib.nullcontext(),
    )
    torch._C = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda index: 0)
    return torch


def torch_tensor(shape, dtype_name, stride=None, offset=0):
    """A fake torch CUDA tensor of ``dtype_name`` ("float16", ...), ``offset`` bytes into a block."""
    t = FakeTensor(shape, _TORCH_DTYPES[dtype_name], stride)
    t._ptr += offset
    return t


def installed(monkeypatch, cache_dir):
    """:func:`install` through pytest's ``monkeypatch`` (undone after the test), with the caches
    under ``cache_dir`` and no launch plans yet; returns the :class:`LaunchRecord`."""
    from numba_flash import plans

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_dir))
    record = install(monkeypatch.setattr, monkeypatch.setitem)
    plans.clear()
    return record


def qkv(make, shape_q, shape_kv, dtype, offset=0):
    """q of ``shape_q``, k and v of ``shape_kv``, made by ``make`` (:func:`cupy_array` or
    :func:`torch_tensor`), each ``offset`` bytes into its block."""
    return tuple(make(shape, dtype, offset=offset) for shape in (shape_q, shape_kv, shape_kv))


def counting(record, field: str, original):
    """``original`` that adds one to ``record.<field>`` per call (how often the host path checks or plans)."""

    def wrapper(*args, **kwargs):
        setattr(record, field, getattr(record, field) + 1)
        return original(*args, **kwargs)

    return wrapper


def cupy_array(shape, dtype, strides=None, offset=0):
    """A fake CuPy array, ``offset`` bytes into a fresh block."""
    a = FakeCupyArray(shape, dtype, strides)
    a.data.ptr += offset
    return a


# ------------------------------------------------------------------------------------------
# numba device arrays, kernels, cuda.core
# ------------------------------------------------------------------------------------------


class FakeNumbaDeviceArray:
    """What ``cuda.to_device`` gives on a GPU, as far as ``launch.device_array`` reads it."""

    def __init__(self, host):
        self.shape, self.strides, self.dtype, self.size = host.shape, host.strides, host.dtype, host.size
        self.device_ctypes_pointer = types.SimpleNamespace(value=next(_ADDRESSES))

    def is_c_contiguous(self):
        return True


def _assigned(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def kernel_name(kernel) -> str:
    """A simulator kernel by its function and specialisation (the constants it closes over)."""
    # (a cell a specialisation never assigns, e.g. the other engine's sizes in kernels.forward, is empty)
    cells = [c.cell_contents for c in kernel.fn.__closure__ or () if _assigned(c)]
    constants = [getattr(c, "__name__", c) if not isinstance(c, (bool, int, float, str)) else c for c in cells]
    return f"{kernel.fn.__qualname__}{constants}"


class _AnyDevice:
    """``cuda.gpus[i]`` for any ``i``: a context that does nothing."""

    def __getitem__(self, device_id):
        return contextlib.nullcontext()


class LaunchRecord:
    """What the fake GPU saw: kernels compiled, launches (kernel, grid, block, shared bytes,
    parameters), shared-memory opt-ins."""

    def __init__(self):
        self.compiles, self.launches, self.opt_ins = [], [], []


def install(setattr_, setitem):
    """Fake the GPU layer for the host path. ``setattr_(obj, name, value, raising=True)`` and
    ``setitem(mapping, key, value)`` make the changes (pytest's ``monkeypatch.setattr`` and
    ``setitem`` undo them). Returns the :class:`LaunchRecord`."""
    import cuda.core
    from numba.cuda.cudadrv import driver as numba_driver
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    import numba_flash._world as world
    from numba_flash import api, arrays, compile_cache, decoding, launch, split_kv, tensor_cores  # noqa: F401 (loaded to patch)
    from numba_flash._cuda import cuda as numba_cuda

    record = LaunchRecord()
    setitem(sys.modules, "cupy", _cupy_module())
    setitem(sys.modules, "torch", _torch_module())

    # The host modules take the GPU path; the kernels (built with their simulator options) do not.
    original = world.simulated
    for name, module in list(sys.modules.items()):
        if name.startswith("numba_flash") and not name.startswith("numba_flash.kernels") and \
                getattr(module, "simulated", None) is original:
            setattr_(module, "simulated", lambda: False)

    setattr_(numba_cuda, "to_device", lambda x, stream=None: FakeNumbaDeviceArray(np.asarray(x)))
    setattr_(numba_cuda, "stream", lambda: types.SimpleNamespace(synchronize=lambda: None))
    setattr_(numba_cuda, "gpus", _AnyDevice())

    def compile_(kernel, signature):
        record.compiles.append((kernel, signature))
        name = (kernel_name(kernel), tuple(str(t) for t in signature))
        cufunc = types.SimpleNamespace(kernel=name, handle=("handle", name))
        library = types.SimpleNamespace(get_cufunc=lambda: cufunc, get_cubin=lambda: b"", _setup_functions=[],
                                        _entry_name=name[0])
        return types.SimpleNamespace(_codelibrary=library)

    setattr_(FakeCUDAKernel, "compile", compile_, raising=False)
    setattr_(launch, "_on_numba_device", lambda device_id: contextlib.nullcontext())
    # No persistent compilation cache here (tests/host/test_compile_cache.py tests it): nothing
    # read from or written to the user's cache folder.
    setattr_(launch, "_compute_capability", lambda device_id: (9, 0))
    setattr_(compile_cache, "lookup", lambda identity, signature, cc: None)
    setattr_(compile_cache, "store", lambda *args: False)
    setattr_(numba_driver, "driver", types.SimpleNamespace(
        cuKernelSetAttribute=lambda attr, nbytes, handle, device: record.opt_ins.append((nbytes, handle, device))),
        raising=False)
    attribute = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="max dynamic smem")
    setattr_(numba_driver, "binding", types.SimpleNamespace(CUfunction_attribute=attribute), raising=False)

    def core_launch(stream, config, kernel, *params):
        record.launches.append((kernel, config, params))

    setattr_(cuda.core, "launch", core_launch)
    setattr_(cuda.core, "Stream", types.SimpleNamespace(from_handle=lambda handle: ("core stream", handle)))
    setattr_(cuda.core, "LaunchConfig", lambda **kw: kw)
    setattr_(split_kv, "multiprocessors", lambda device_id: 132)  # an H200
    setattr_(launch, "_KERNELS", {})
    clear_host_caches()
    return record


def clear_host_caches() -> None:
    """Forget what the host modules memoised (streams, placeholders, specs, device counts): made
    in another world, or with another fake."""
    for name, module in list(sys.modules.items()):
        if name.startswith("numba_flash") and not name.startswith("numba_flash.kernels"):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", None) == name:
                    value.cache_clear()


def launches(record, call):
    """``call``'s launches: kernel, configuration and parameters, pointers numbered by first
    appearance (the results' first), and its results' layouts."""
    record.launches.clear()
    results = call()
    numbering = {}
    for r in results:
        numbering.setdefault(r.data_ptr() if hasattr(r, "data_ptr") else r.data.ptr, len(numbering))
    out = []
    for kernel, config, params in record.launches:
        out.append((kernel, config, [
            (type(p).__name__, p.value) if isinstance(p, (ctypes.c_float, ctypes.c_int32))
            else f"ptr{numbering.setdefault(p, len(numbering))}" if isinstance(p, int) and p >= 1 << 32 else p
            for p in params]))
    layouts = [(r.shape, r.stride() if hasattr(r, "stride") else r.strides, str(r.dtype)) for r in results]
    return out, layouts
