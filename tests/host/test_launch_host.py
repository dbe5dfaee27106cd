"""The direct launcher's host-side bookkeeping (``numba_flash.launch``), with the GPU faked:
cuda.core's own stream per handle, kernels compiled and opted in once per (kernel, device),
arrays on a second GPU launched there; and numba's launch with dynamic shared memory (runs in
the simulator). The same paths on a real GPU: ``tests/gpu/test_gpu_host.py``."""

from __future__ import annotations

import types

import numpy as np
import pytest

from numba_flash import launch as L
from numba_flash._cuda import cuda, float32
from numba_flash._world import simulated


class _FakeCufunc:
    def __init__(self, device):
        self.kernel = f"kernel@{device}"
        self.handle = f"handle@{device}"


class _FakeDispatcher:
    """Counts compiles; its overload's cufunc is 'loaded' on numba's current (fake) device."""

    def __init__(self, current):
        self.compiles = []
        self.current = current

    def compile(self, sig):
        self.compiles.append(sig)
        current = self.current
        library = types.SimpleNamespace(get_cufunc=lambda: _FakeCufunc(current[0]))
        return types.SimpleNamespace(_codelibrary=library)


@pytest.fixture
def fake_gpu(monkeypatch):
    """cuda.core's launch and Stream, numba's device switch and the driver's attribute call,
    all recorded instead of run."""
    import cuda.core
    from numba.cuda.cudadrv import driver as numba_driver

    current = [0]
    record = types.SimpleNamespace(launches=[], streams=[], attributes=[], lookups=0)

    class Switch:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            self.previous, current[0] = current[0], self.device

        def __exit__(self, *exc):
            current[0] = self.previous

    def from_handle(handle):
        record.streams.append(handle)
        return ("core stream", handle)

    def lookup():
        record.lookups += 1
        return current[0]

    monkeypatch.setattr(cuda.core, "launch", lambda stream, config, kernel, *params: record.launches.append((stream, kernel, params)))
    monkeypatch.setattr(cuda.core, "Stream", types.SimpleNamespace(from_handle=from_handle))
    monkeypatch.setattr(cuda.core, "LaunchConfig", lambda **kw: kw)
    monkeypatch.setattr(L, "_on_numba_device", Switch)
    monkeypatch.setattr(L, "_current_device_id", lookup)
    monkeypatch.setattr(numba_driver, "driver", types.SimpleNamespace(
        cuKernelSetAttribute=lambda attr, nbytes, handle, device: record.attributes.append((nbytes, handle, device))),
        raising=False)
    attribute = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="max dynamic smem")
    monkeypatch.setattr(numba_driver, "binding", types.SimpleNamespace(CUfunction_attribute=attribute), raising=False)
    monkeypatch.setattr(L, "_KERNELS", {})
    L.core_stream.cache_clear()
    L._config.cache_clear()
    yield record, _FakeDispatcher(current)
    L.core_stream.cache_clear()
    L._config.cache_clear()


def _args():
    a = L.DeviceArray(4096, (1, 1, 2, 4), (32, 32, 16, 4), "float32", 4, 8, True)
    return [a, np.float32(0.5)]


def test_launch_hands_cuda_core_its_own_stream_made_once_per_handle(fake_gpu):
    """Not numba's stream object through ``__cuda_stream__`` (deprecated by cuda.core): a
    ``cuda.core.Stream`` from the handle, made once per (device, handle)."""
    record, dispatcher = fake_gpu
    for _ in range(3):
        L.launch(dispatcher, (1,), (32,), 1234, _args(), device_id=0)
    L.launch(dispatcher, (1,), (32,), 0, _args(), device_id=0)
    assert [stream for stream, _, _ in record.launches] == [("core stream", 1234)] * 3 + [("core stream", 0)]
    assert record.streams == [1234, 0]


def test_kernels_are_compiled_and_opted_in_once_per_device(fake_gpu):
    """Arrays on GPU 1 run GPU 1's copy of the kernel (loaded while GPU 1 was current), opted in
    to its dynamic shared memory on GPU 1; nothing is asked of the driver per call."""
    record, dispatcher = fake_gpu
    for device in (0, 1, 0, 1, 1):
        L.launch(dispatcher, (1,), (32,), 0, _args(), shared_mem_bytes=100 * 1024, device_id=device)
    assert len(dispatcher.compiles) == 2
    assert [kernel for _, kernel, _ in record.launches] == ["kernel@0", "kernel@1", "kernel@0", "kernel@1", "kernel@1"]
    assert record.attributes == [(100 * 1024, "handle@0", 0), (100 * 1024, "handle@1", 1)]
    assert record.lookups == 0


def test_small_dynamic_shared_memory_needs_no_opt_in(fake_gpu):
    record, dispatcher = fake_gpu
    L.launch(dispatcher, (1,), (32,), 0, _args(), shared_mem_bytes=48 * 1024, device_id=0)
    assert record.attributes == []


def test_without_a_device_id_the_current_device_is_asked(fake_gpu):
    record, dispatcher = fake_gpu
    L.launch(dispatcher, (1,), (32,), 0, _args())
    assert record.lookups == 1 and record.launches[0][1] == "kernel@0"


@cuda.jit
def _dynamic_sum(x, out):
    buf = cuda.shared.array(0, float32)  # dynamic: sized by the launch
    i = cuda.threadIdx.x
    buf[i] = x[i]
    cuda.syncthreads()
    if i == 0:
        total = float32(0)
        for j in range(cuda.blockDim.x):
            total += buf[j]
        out[0] = total


def test_numba_launch_passes_dynamic_shared_memory():
    if not simulated():
        pytest.skip("the GPU case is tests/gpu/test_gpu_host.py")
    x = np.arange(16, dtype=np.float32)
    out = np.zeros(1, np.float32)
    L.numba_launch(_dynamic_sum, (1,), (16,), None, (x, out), shared_mem_bytes=16 * 4)
    assert out[0] == x.sum()


def test_a_larger_opt_in_reuses_the_loaded_kernel(fake_gpu):
    """A second launch asking for more dynamic shared memory opts the kernel already loaded in
    further: nothing is compiled (or read from the compilation cache and loaded) again."""
    record, dispatcher = fake_gpu
    for nbytes in (60 * 1024, 100 * 1024, 80 * 1024):
        L.launch(dispatcher, (1,), (32,), 0, _args(), shared_mem_bytes=nbytes, device_id=0)
    assert len(dispatcher.compiles) == 1
    assert record.attributes == [(60 * 1024, "handle@0", 0), (100 * 1024, "handle@0", 0)]


def test_a_tuple_of_arrays_is_flattened_as_numba_does(fake_gpu):
    """A user's ``mod_args`` (a tuple of arrays) go the direct way too: typed as ``numba.typeof``
    types a tuple (``UniTuple`` of one array type, ``Tuple`` otherwise, ``Tuple(())`` empty), and
    packed member by member after the arguments before it, as numba's ``_prepare_args`` packs a
    tuple; a different tuple is another specialisation."""
    from numba import typeof

    record, dispatcher = fake_gpu
    ids = L.DeviceArray(8192, (5,), (4,), "int32", 4, 5, True)
    table = L.DeviceArray(16384, (2, 3), (12, 4), "float32", 4, 6, True)
    a, half = _args()
    L.launch(dispatcher, (1,), (32,), 0, [a, half, (ids, ids), (ids, table), ()], device_id=0)
    sig = dispatcher.compiles[-1]
    host = (np.zeros(5, np.int32), np.zeros((2, 3), np.float32))
    assert sig[2] == typeof((host[0], host[0])) and sig[3] == typeof(host) and sig[4] == typeof(())
    params = record.launches[-1][2]
    fields = a.abi_fields() + [half] + ids.abi_fields() * 2 + ids.abi_fields() + table.abi_fields()
    assert [p.value if hasattr(p, "value") else p for p in params] == fields
    L.launch(dispatcher, (1,), (32,), 0, [a, half, (ids,), (ids, table), ()], device_id=0)
    assert len(dispatcher.compiles) == 2
