"""Counted global-memory traffic of simulated kernel launches (Numba's CUDA simulator only).

:func:`count_traffic` is a context manager: while it is open, every kernel launched in the
simulator gets its array arguments as counting wrappers, and every element a CUDA thread
reads or writes through them (or through any view of them, such as ``q[b, h]``) is recorded
against the kernel parameter it came from, with the thread's block, warp and barrier epoch.

What is counted, and how it relates to bytes moved:

- ``x[i, j]`` that yields one element is one element read; ``x[i, j] = v`` one element
  written (a slice assignment: each element of the slice). Taking a view (``q[b, h]``)
  moves nothing and is not counted.
- ``reads(name)`` / ``writes(name)``: *requests* -- distinct elements per (block, warp,
  barrier epoch, source line, execution of that line), the epoch being the number of
  ``syncthreads`` the thread has passed. On a GPU the threads of a warp that load one address
  in the same instruction make one request (a broadcast), so FA-1's threads of one row all
  reading ``l_i`` count once, as the traffic model counts them; a thread loading an element
  again (another line, or the line again) counts again. ``raw_reads`` / ``raw_writes``
  count every thread's access.
- ``read_trace(block, units)``: the tiles a block read, in order (by barrier epoch): the
  loop nest it ran, e.g. the K/V tile order it walked.

Only the simulator runs Python kernels; this module patches its internals for the duration
of the ``with`` block (``FakeCUDAKernel.__call__``, ``FakeCUDAModule.syncthreads``) and
restores them on exit. It is written against numba-cuda 0.30's simulator.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

WARP = 32


@dataclass
class LaunchTraffic:
    """What one simulated launch read and wrote, per array parameter of the kernel."""

    kernel: str
    grid: tuple
    block: tuple
    params: list  # the kernel's parameter names, in order
    arrays: dict = field(default_factory=dict)  # name -> (shape, itemsize)
    # (name, op) -> {(block, warp, epoch, site, instance, flat)}: see ``record``
    _requests: dict = field(default_factory=lambda: defaultdict(set))
    _raw: Counter = field(default_factory=Counter)  # (name, op) -> element accesses
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, name: str, op: str, flats, site) -> None:
        """One access by the current simulated thread at kernel source ``site`` (code, line).

        A request is identified by (block, warp, barrier epoch, site, instance, element), the
        instance being how many times this thread has executed ``site`` in this epoch: the
        threads of a warp executing the same load of the same element (a broadcast) make one
        request; one thread loading an element twice (another line, or another iteration)
        makes two."""
        thread = threading.current_thread()
        block = getattr(thread, "blockIdx", None)
        block = (block.x, block.y, block.z) if block is not None else None
        warp = getattr(thread, "thread_id", 0) // WARP
        epoch = getattr(thread, "_nf_epoch", 0)
        sites = thread.__dict__.setdefault("_nf_sites", {})  # reset at every barrier
        instance = sites.get(site, 0)
        sites[site] = instance + 1
        with self._lock:
            requests = self._requests[(name, op)]
            for flat in flats:
                requests.add((block, warp, epoch, site, instance, int(flat)))
            self._raw[(name, op)] += len(flats)

    # ---- element counts -------------------------------------------------------------------
    def reads(self, name: str) -> int:
        return len(self._requests.get((name, "r"), ()))

    def writes(self, name: str) -> int:
        return len(self._requests.get((name, "w"), ()))

    def raw_reads(self, name: str) -> int:
        return self._raw[(name, "r")]

    def raw_writes(self, name: str) -> int:
        return self._raw[(name, "w")]

    def read_bytes(self, name: str) -> int:
        return self.reads(name) * self.arrays[name][1] if name in self.arrays else 0

    def write_bytes(self, name: str) -> int:
        return self.writes(name) * self.arrays[name][1] if name in self.arrays else 0

    def bytes(self, name: str) -> int:
        return self.read_bytes(name) + self.write_bytes(name)

    # ---- where and when -------------------------------------------------------------------
    def touched(self, name: str, op: str = "r") -> list:
        """The (block, warp, epoch, multi-index) of every counted request."""
        shape = self.arrays[name][0]
        return [(blk, w, e, np.unravel_index(f, shape)) for blk, w, e, _, _, f in self._requests.get((name, op), ())]

    def blocks(self, name: str, op: str = "r") -> list:
        return sorted({r[0] for r in self._requests.get((name, op), ())})

    def read_trace(self, block, units: dict) -> list:
        """The tiles ``block`` read, in the order it read them: ``(name, b, h, tile)`` per
        tile and barrier epoch, ``tile`` being row // ``units[name]`` of a (B, H, N, D)
        argument ``name``. Epochs order the trace (the simulator runs a block's threads
        concurrently, but whatever is read after a barrier is later); reads of one epoch are
        listed in ``units`` order, then by tile. A tile loaded once is one entry; a loop nest
        is a sequence of them (FA-1: K_0 Q_0 Q_1 .. K_1 Q_0 Q_1 ..; FA-2: Q_i K_0 K_1 ..)."""
        names = list(units)
        by_epoch = defaultdict(set)
        for name, unit in units.items():
            shape = self.arrays[name][0]
            for blk, _, epoch, _, _, flat in self._requests.get((name, "r"), ()):
                if blk == block:
                    b, h, row = (int(x) for x in np.unravel_index(flat, shape)[:3])
                    by_epoch[epoch].add((name, b, h, row // unit))
        return [tag for epoch in sorted(by_epoch)
                for tag in sorted(by_epoch[epoch], key=lambda t: (names.index(t[0]), t[1:]))]


def _site():
    """(code, line) of the kernel or device-function source making the current access."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in _WRAPPER_FILES:
        frame = frame.f_back
    return None if frame is None else (frame.f_code, frame.f_lineno)


_WRAPPER_FILES: set = set()  # source files of the array wrappers between a kernel and _site


def _counting_array_type():
    from numba.cuda.simulator.cudadrv import devicearray
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    _WRAPPER_FILES.update({__file__, devicearray.__file__})

    class CountedArray(FakeCUDAArray):
        """A simulator device array whose element reads and writes are recorded; views of it
        (``x[b, h]``) are CountedArrays of the same root, so their accesses count too."""

        def __init__(self, ary, stream, launch, name, root_addr, itemsize):
            super().__init__(ary, stream)
            self._nf = (launch, name, root_addr, itemsize)

        def _flats(self, idx):
            """Root flat indices of the elements ``idx`` selects."""
            launch, name, root_addr, itemsize = self._nf
            sel = self._ary[idx]
            if isinstance(sel, np.ndarray):
                start = sel.__array_interface__["data"][0]
                offsets = np.zeros(sel.shape, dtype=np.int64) + (start - root_addr)
                for axis, stride in enumerate(sel.strides):
                    shape = [1] * sel.ndim
                    shape[axis] = sel.shape[axis]
                    offsets = offsets + (np.arange(sel.shape[axis]) * stride).reshape(shape)
                return (offsets.ravel() // itemsize).tolist()
            key = idx if isinstance(idx, tuple) else (idx,)
            if len(key) != self._ary.ndim or not all(isinstance(i, (int, np.integer)) for i in key):
                raise TypeError(f"counted array {name}: unsupported index {idx!r}")
            start = self._ary.__array_interface__["data"][0]
            offset = start - root_addr
            for i, n, stride in zip(key, self._ary.shape, self._ary.strides):
                i = int(i)
                offset += (i + n if i < 0 else i) * stride
            return [offset // itemsize]

        def __getitem__(self, idx):
            launch, name, root_addr, itemsize = self._nf
            ret = self._ary.__getitem__(idx)
            if type(ret) in (np.ndarray, np.void) or isinstance(ret, np.ndarray):
                return CountedArray(ret, self.stream, launch, name, root_addr, itemsize)  # a view
            launch.record(name, "r", self._flats(idx), _site())
            return ret

        def __setitem__(self, idx, val):
            launch, name, _, _ = self._nf
            launch.record(name, "w", self._flats(idx), _site())
            return self._ary.__setitem__(idx, val)

    return CountedArray


class TrafficLog:
    """The launches recorded inside one :func:`count_traffic` block, in launch order."""

    def __init__(self):
        self.launches: list[LaunchTraffic] = []

    def only(self) -> LaunchTraffic:
        if len(self.launches) != 1:
            raise AssertionError(f"expected one kernel launch, got {[x.kernel for x in self.launches]}")
        return self.launches[0]


@contextlib.contextmanager
def count_traffic():
    """Record the global-memory element traffic of every simulated launch in the block.

    Yields a :class:`TrafficLog`. Raises ``RuntimeError`` outside the simulator."""
    from numba import config

    if not config.ENABLE_CUDASIM:
        raise RuntimeError("count_traffic needs Numba's CUDA simulator (kernels must run as Python)")
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi
    from numba.cuda.simulator.args import ArgHint
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    CountedArray = _counting_array_type()
    log = TrafficLog()
    original_call = sim_kernel.FakeCUDAKernel.__call__
    original_sync = kernelapi.FakeCUDAModule.syncthreads

    class Counted(ArgHint):
        """A kernel argument handed to the simulator as a CountedArray: a NumPy argument is
        copied in and written back (the simulator's InOut), a simulator device array is used
        in place."""

        def __init__(self, value, launch, name):
            super().__init__(value)
            self.launch, self.name = launch, name

        def to_device(self, retr, stream=0):
            value = self.value
            if isinstance(value, FakeCUDAArray):
                ary = value._ary
            else:
                host = value
                ary = np.array(host, copy=True, order="C")
                retr.append(lambda: np.copyto(host, ary))
            root_addr = ary.__array_interface__["data"][0]
            self.launch.arrays[self.name] = (ary.shape, ary.itemsize)
            return CountedArray(ary, stream, self.launch, self.name, root_addr, ary.itemsize)

    def counting_call(self, *args):
        if self._device or sim_kernel._kernel_context is not None:
            return original_call(self, *args)
        params = list(inspect.signature(self.fn).parameters)
        launch = LaunchTraffic(getattr(self.fn, "__name__", "?"), tuple(self.grid_dim), tuple(self.block_dim), params)
        log.launches.append(launch)
        wrapped = []
        for name, arg in zip(params, args):
            if (isinstance(arg, np.ndarray) and arg.ndim > 0) or isinstance(arg, FakeCUDAArray):
                arg = Counted(arg, launch, name)
            wrapped.append(arg)
        return original_call(self, *wrapped)

    def counting_sync(self):
        thread = threading.current_thread()
        thread._nf_epoch = getattr(thread, "_nf_epoch", 0) + 1
        thread._nf_sites = {}
        return original_sync(self)

    sim_kernel.FakeCUDAKernel.__call__ = counting_call
    kernelapi.FakeCUDAModule.syncthreads = counting_sync
    try:
        yield log
    finally:
        sim_kernel.FakeCUDAKernel.__call__ = original_call
        kernelapi.FakeCUDAModule.syncthreads = original_sync
