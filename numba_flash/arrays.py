"""The caller's array library: recognise it, hand its arrays to numba, answer in kind.

Kinds:
- ``numpy``: runs in Numba's CUDA simulator when there is no GPU; with a GPU it is
  copied to the device and the result copied back.
- ``cupy``: runs in place on the GPU (no copy), on CuPy's current stream.
- ``torch``: CUDA tensors, in place, through ``__cuda_array_interface__``, on
  PyTorch's current stream.
- ``cai``: any other object exposing ``__cuda_array_interface__``; ``dlpack``: any
  other object exposing ``__dlpack__``. Both are viewed as CuPy arrays (no copy) before
  anything else (:func:`as_cupy_view`), so results come back as CuPy arrays.

Library modules are only imported when the caller already uses them.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass

import numpy as np
from numba_flash._cuda import cuda

from numba_flash._world import simulated


_KIND_OF_TYPE: dict = {}  # array types whose kind is a property of the type (NumPy, CuPy)


def kind_of(x, name: str | None = None) -> str:
    """The array kind of ``x``; ``TypeError`` for anything the kernels cannot read, naming the
    argument ``name`` when given (as the public signature spells it)."""
    kind = _KIND_OF_TYPE.get(type(x))
    if kind is not None:
        return kind
    module = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        _KIND_OF_TYPE[type(x)] = "numpy"
        return "numpy"
    if module == "cupy":
        _KIND_OF_TYPE[type(x)] = "cupy"
        return "cupy"
    if module == "torch":
        if not getattr(x, "is_cuda", False):
            raise TypeError(
                f"{name or 'a PyTorch tensor'} must be on a CUDA device; for a CPU tensor pass "
                "tensor.numpy() (it runs in the simulator or is copied to the GPU)"
            )
        return "torch"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    if hasattr(x, "__dlpack__"):
        return "dlpack"
    raise TypeError(
        f"{name + ' must be' if name else 'expected'} a NumPy array, a CuPy array, a PyTorch CUDA tensor, or an "
        f"object with __cuda_array_interface__ or __dlpack__; got {type(x).__module__}.{type(x).__name__}"
    )


_LIBRARY_OF_TYPE: dict = {}  # type -> the top-level module that defines it ("cupy", "torch", ...)


def array_signature(x):
    """What a call's checks read of a CuPy array or torch tensor, as a hashable tuple: its
    type, shape, strides, dtype and device (the part of a plan key an array gives,
    ``numba_flash.plans``); ``None`` for any other object (NumPy, CAI or DLPack objects:
    never planned). A torch tensor on the CPU has a signature; its device tells it apart."""
    library = _LIBRARY_OF_TYPE.get(type(x))
    if library is None:
        library = _LIBRARY_OF_TYPE[type(x)] = type(x).__module__.split(".")[0]
    if library == "cupy":
        return type(x), x.shape, x.strides, x.dtype, x.device.id
    if library == "torch":
        return type(x), x.shape, x.stride(), x.dtype, x.device
    return None


def pointer_reader(kind: str):
    """A function from an array of ``kind`` ("cupy" or "torch") to its data pointer (a C-level
    getter: a plan reads every array's pointer on every call)."""
    return operator.methodcaller("data_ptr") if kind == "torch" else operator.attrgetter("data.ptr")


def as_cupy_view(x, name: str | None = None):
    """A CuPy view of a ``cai`` or ``dlpack`` object (no copy); any other array as it is
    (``TypeError`` naming the argument ``name`` for what is not an array, :func:`kind_of`)."""
    kind = kind_of(x, name)
    if kind not in ("cai", "dlpack"):
        return x
    import cupy

    return cupy.asarray(x) if kind == "cai" else cupy.from_dlpack(x)


def check_like(x, name, shape, dtype, kind) -> None:
    """``x`` must be an array of the inputs' library, of this shape and dtype (``TypeError`` /
    ``ValueError`` naming it)."""
    if kind_of(x, name) != kind:
        raise TypeError(f"{name} must be an array of the inputs' library ({kind})")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}; got {tuple(x.shape)}")
    if dtype_name(x, kind) != dtype:
        raise TypeError(f"{name} must be {dtype}; got {dtype_name(x, kind)}")


def check_no_overlap(kind, q, k, v, out, lse_out) -> None:
    """Result buffers must not share memory with an input or with each other: the kernels
    read their inputs tile by tile while writing results (FA-1 even uses ``out`` as its
    running O), so an aliased buffer would be read after it was overwritten."""
    buffers = [(name, x) for name, x in (("out", out), ("lse_out", lse_out)) if x is not None]
    for i, (name, buf) in enumerate(buffers):
        for other, x in [("q", q), ("k", k), ("v", v), *buffers[:i]]:
            if may_overlap(buf, x, kind):
                raise ValueError(f"{name} must not share memory with {other}; pass a separate buffer")


def device_id_of(x, kind: str):
    """The GPU a CuPy array or torch tensor lives on, read from the array (no driver call);
    ``None`` for NumPy arrays (they run on numba's current device, or in the simulator)."""
    if kind == "cupy":
        return x.device.id
    if kind == "torch":
        return x.device.index
    return None


def byte_extent(ptr: int, shape, strides, itemsize: int) -> tuple[int, int]:
    """The half-open byte range ``[lo, hi)`` that an array with this data pointer, shape and
    strides (in bytes, any sign) can touch; empty (``lo == hi``) for an array with no elements."""
    if any(n == 0 for n in shape):
        return ptr, ptr
    lo = ptr + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    hi = ptr + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) + itemsize
    return lo, hi


def extents_overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Do two byte ranges ``[lo, hi)`` share a byte? (Empty ranges share none.)"""
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def _device_extent(x, kind: str) -> tuple[int, int]:
    if kind == "torch":
        item = x.element_size()
        return byte_extent(x.data_ptr(), tuple(x.shape), tuple(s * item for s in x.stride()), item)
    return byte_extent(x.data.ptr, x.shape, x.strides, x.itemsize)  # CuPy


def may_overlap(a, b, kind: str) -> bool:
    """Can writing ``a`` change ``b``? NumPy: exactly (``np.shares_memory``, bounded work;
    too hard to decide counts as overlapping); CuPy and torch: their byte ranges intersect
    (conservative for interleaved strided views, exact for separate buffers)."""
    if kind == "numpy":
        if not np.may_share_memory(a, b):
            return False
        try:
            return bool(np.shares_memory(a, b, max_work=10**6))
        except getattr(np, "exceptions", np).TooHardError:  # np.exceptions: NumPy >= 1.25
            return True
    return extents_overlap(_device_extent(a, kind), _device_extent(b, kind))


_NAMES: dict = {}  # dtype object -> "float32", ... (numpy's dtype.name is slow to compute)


def each(convert, x):
    """``convert(x)``, or for a tuple of arrays (a paged cache's ``(pages, block_table)``, a
    kernel argument of ``kernels.paged``) the tuple of each member converted."""
    return tuple(convert(a) for a in x) if type(x) is tuple else convert(x)  # (not a NamedTuple: a DeviceArray is one)


def is_contiguous(x, kind: str) -> bool:
    """Is ``x`` (an array of ``kind``) C-contiguous?"""
    return x.is_contiguous() if kind == "torch" else x.flags.c_contiguous


def host_values(x, name: str):
    """An integer argument (prefix sums, cache lengths, a block table) on the host: lists, tuples
    and NumPy arrays as they are, a CPU torch tensor as NumPy, CuPy and CUDA torch arrays copied
    (synchronising)."""
    if isinstance(x, (list, tuple, np.ndarray)):
        return x
    if type(x).__module__.startswith("torch") and not x.is_cuda:  # a CPU tensor: on the host already
        return x.numpy()
    x = as_cupy_view(x, name)
    x_kind = kind_of(x, name)
    return to_host(x, x_kind) if x_kind in ("cupy", "torch") else np.asarray(x)


def zero_padded(x, width: int):
    """A C-contiguous copy of a NumPy or CuPy array with its last axis zero-padded to ``width``
    (on the current device: the caller's ``on_device``)."""
    if isinstance(x, np.ndarray):
        xp = np
    else:
        import cupy as xp
    out = xp.zeros((*x.shape[:-1], width), dtype=x.dtype)
    out[..., : x.shape[-1]] = x
    return out


def to_host(x, kind: str) -> np.ndarray:
    """A device array of ``kind`` (CuPy or torch) copied to a NumPy array (synchronising)."""
    return x.cpu().numpy() if kind == "torch" else x.get()


def from_host(x: np.ndarray, kind: str, ctx):
    """A NumPy array as an array of ``kind`` on ``ctx``'s device (itself for NumPy)."""
    if kind == "numpy":
        return x
    if kind == "torch":
        import torch

        return torch.from_numpy(x).to(ctx.template.device)
    import cupy

    return cupy.asarray(x)


def dtype_name(x, kind: str) -> str:
    """'float16', 'float32', ... for any supported kind."""
    dt = x.dtype
    name = _NAMES.get(dt)
    if name is None:
        name = _NAMES[dt] = str(dt).rsplit(".", 1)[-1] if kind == "torch" else np.dtype(dt).name
    return name


@dataclass
class ArrayContext:
    """How one call moves arrays between the caller's library and numba."""

    kind: str
    template: object  # an input of the caller's kind (device and library of the result)

    @property
    def on_host(self) -> bool:
        return self.kind == "numpy"

    @property
    def device_id(self):
        """The GPU the caller's arrays live on (``None`` for NumPy), read from the arrays."""
        return device_id_of(self.template, self.kind)

    def on_device(self):
        """A context in which the arrays' GPU is the current device, so that results are
        allocated and kernels launched there (CuPy and torch arrays on a second GPU). With
        one GPU in the process it does nothing (no runtime call on the hot path)."""
        switch = self.device_switch()
        return contextlib.nullcontext() if switch is None else switch()

    def device_switch(self):
        """A function that returns :meth:`on_device`'s context, or ``None`` when it would do
        nothing (NumPy, the simulator, one GPU in the process): the same for every call on
        arrays of this kind and device."""
        if self.kind not in ("cupy", "torch") or simulated() or gpu_count(self.kind) < 2:
            return None
        if self.kind == "cupy":
            import cupy

            return functools.partial(cupy.cuda.Device, self.device_id)
        import torch

        return functools.partial(torch.cuda.device, self.device_id)

    def to_kernel(self, x):
        """An input the kernel can read: the object itself, a numba view, or a device copy.

        Used for NumPy inputs and in the simulator; CuPy and torch arrays on a GPU are
        launched directly (``direct_launch``), and reach this when a test turns that off to
        compare the two launch paths, and for kernels with a user's mods (their ``mod_args``
        tuple goes through numba's dispatcher)."""
        if self.kind == "numpy":
            # A device copy in both worlds (the simulator's too): the kernel never holds the
            # caller's buffer, so a read-only or strided input works and is never written.
            return cuda.to_device(np.ascontiguousarray(x))
        if self.kind == "torch":
            x = x.detach()  # a tensor that requires grad refuses __cuda_array_interface__
        return cuda.from_cuda_array_interface(x.__cuda_array_interface__, owner=x, sync=False)

    def out_to_kernel(self, x):
        """An output the kernel can write: ``x`` itself, or device memory to copy back."""
        if self.kind == "numpy":
            # The simulator writes a NumPy argument back into it after the launch.
            return x if simulated() else cuda.device_array(x.shape, dtype=x.dtype)
        return self.to_kernel(x)

    def empty(self, shape, dtype_name_: str):
        """An uninitialised result array of the caller's library."""
        return self.allocator(shape, dtype_name_)()

    def allocator(self, shape, dtype_name_: str):
        """A function of no arguments that returns a new :meth:`empty` array of this shape and
        dtype (the library's allocation bound to its arguments once: a plan allocates per call).
        CuPy allocates on the current device; torch on the inputs' device."""
        if self.kind == "numpy":
            if dtype_name_ == "bfloat16":  # NumPy's bfloat16 comes from ml_dtypes
                import ml_dtypes

                return functools.partial(np.empty, shape, dtype=ml_dtypes.bfloat16)
            return functools.partial(np.empty, shape, dtype=dtype_name_)
        if self.kind == "torch":
            import torch

            return functools.partial(torch.empty, shape, dtype=getattr(torch, dtype_name_), device=self.template.device)
        import cupy

        return functools.partial(cupy.empty, shape, dtype=np.dtype(dtype_name_))

    @property
    def direct_launch(self) -> bool:
        """Can the kernel be launched on this kind's own pointers (``numba_flash.launch``)?"""
        return self.kind in ("cupy", "torch") and not simulated()

    def stream_ptr(self) -> int:
        """The caller's current stream handle (0: the default stream); asked once per call
        (a context lives for one call)."""
        ptr = self.__dict__.get("_stream_ptr")
        if ptr is None:
            ptr = self.__dict__["_stream_ptr"] = self.stream_ptr_reader()()
        return ptr

    def stream_ptr_reader(self):
        """A function of no arguments that returns the library's current stream handle for the
        inputs' device (0: the default stream), the same function for every call of this kind
        and device. torch: its raw-handle getter (what Triton launches on), not
        ``torch.cuda.current_stream``, which makes a Stream object per call (~10 us)."""
        if self.kind == "torch":
            import torch

            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            device = self.template.device
            if raw is not None:
                return functools.partial(raw, device.index)
            return lambda: torch.cuda.current_stream(device).cuda_stream
        if self.kind == "cupy":
            return _cupy_stream_ptr
        return _default_stream_ptr

    def stream(self):
        """The caller's current stream as a numba stream (``None`` in the simulator)."""
        return None if simulated() else numba_stream(self.stream_ptr())


def _cupy_stream_ptr() -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


def _default_stream_ptr() -> int:
    return 0


@functools.lru_cache(maxsize=None)
def gpu_count(kind: str) -> int:
    """GPUs visible to the array library ``kind`` (asked once per process)."""
    if kind == "torch":
        import torch

        return torch.cuda.device_count()
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


@functools.lru_cache(maxsize=64)
def numba_stream(ptr: int):
    """numba's stream object for a raw stream handle (0: the default stream)."""
    return cuda.external_stream(ptr) if ptr else cuda.default_stream()


class _StreamHandle:
    """A raw stream handle as an object of the CUDA stream protocol."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


@functools.lru_cache(maxsize=64)
def cupy_stream(ptr: int):
    """A CuPy stream for a foreign handle (CuPy 14 deprecates ``ExternalStream`` for
    ``Stream.from_external``; older CuPy has only the former)."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr)
