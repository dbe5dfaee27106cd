"""fa3's plans with the GPU faked (``tests/fake_gpu.py``): ``attention(..., algorithm="fa3")`` on
CuPy arrays or torch tensors is checked once per signature and then only launched, each call's
tensor maps looked up by its arrays' pointers; the launch is the unplanned path's, parameter for
parameter; what depends on addresses (TMA's 16-byte alignment, results sharing memory with an
input) is checked on every call; fp8's plan launches the V^T pass into a new buffer, then the
kernel on that buffer's map; ALiBi's plan launches on each call's slopes, made anew in the kernel's
units; and the calls a plan does not cover (descales, the research knobs, outputs the kernel cannot
write in place) keep the unplanned path. The same on a real GPU:
``tests/gpu/test_gpu_fa3.py``."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

import fake_gpu
import numba_flash
# fa3's lazily imported modules, imported before the fake GPU is installed: a module first imported
# under the fake would keep its GPU world after it (the fake restores only what it patched)
import numba_flash.block_sparse  # noqa: F401
import numba_flash.kernels.fa3  # noqa: F401
import numba_flash.simulator  # noqa: F401
import numba_flash.split_kv  # noqa: F401
import numba_flash.tensor_cores  # noqa: F401
from numba_flash import alibi, fa3, plans
from numba_flash.api import forward

C, T = fake_gpu.cupy_array, fake_gpu.torch_tensor


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """The fake GPU as a Hopper, fa3's tensor maps as placeholder words; counts the checks."""
    record = fake_gpu.installed(monkeypatch, tmp_path)
    fa3._MAPS.clear()
    monkeypatch.setattr(fa3, "_encoded", lambda x, rows, dtype, row_bytes=128: np.zeros(16, np.uint64))
    from numba_flash._cuda import cuda

    monkeypatch.setattr(fa3, "_device_words", lambda words, stream, device_id: (cuda.to_device(words), words, None))
    monkeypatch.setattr(fa3, "_capturing", lambda stream_ptr: False)
    monkeypatch.setattr(fa3, "require_fa3_device", lambda device_id: None)
    one = C((1,), "float32")  # fp8's cached descale of 1 (a 16-bit call's unread stand-in)
    monkeypatch.setattr(fa3.fp8_inputs, "_one", lambda device_id: one)
    no_slopes = {"cupy": C((1, 1), "float32"), "torch": T((1, 1), "float32")}  # (alibi.no_slopes: made once)
    monkeypatch.setattr(alibi, "no_slopes", lambda kind, device_id=None: no_slopes[kind])
    made = {}  # ALiBi's slopes in the kernel's units (alibi.kernel_slopes: a device op), one array per input

    def kernel_slopes(slopes, batch, kind):
        if id(slopes) not in made:
            made[id(slopes)] = (slopes, (C if kind == "cupy" else T)((batch, slopes.shape[-1]), "float32"))
        return made[id(slopes)][1]

    monkeypatch.setattr(alibi, "kernel_slopes", kernel_slopes)
    record.slopes_made = made
    record.checks = 0
    monkeypatch.setattr(fa3, "describe", fake_gpu.counting(record, "checks", fa3.describe))
    yield record
    plans.clear()
    fa3._MAPS.clear()
    fake_gpu.clear_host_caches()
    from numba_flash.kernels.fa3 import fa3_kernel

    fa3_kernel.cache_clear()  # (made with the fake's world: the simulator's tests make their own)


_qkv = fake_gpu.qkv


CALLS = {  # name: (array maker, q shape, k/v shape, dtype, keyword arguments)
    "cupy float16": (C, (1, 2, 256, 128), (1, 2, 256, 128), "float16", {}),
    "torch bfloat16 causal GQA": (T, (2, 8, 300, 128), (2, 2, 500, 128), "bfloat16", dict(causal=True)),
    "torch float16 D64 window softcap": (T, (1, 4, 200, 64), (1, 4, 700, 64), "float16",
                                         dict(window_size=(100, 0), softcap=30.0)),
    "cupy float16 D40 (padded in the kernel)": (C, (1, 2, 100, 40), (1, 2, 100, 40), "float16", {}),
    "torch float16 ALiBi (H,) causal": (T, (2, 4, 256, 128), (2, 4, 256, 128), "float16",
                                        dict(causal=True, alibi_slopes=T((4,), "float32"))),
    "torch float8 causal GQA (V^T pass, then the kernel)": (T, (2, 8, 300, 128), (2, 2, 500, 128), "float8_e4m3fn",
                                                            dict(causal=True)),
    "torch float8 ALiBi (B, H)": (T, (2, 4, 300, 128), (2, 4, 500, 128), "float8_e4m3fn",
                                  dict(alibi_slopes=T((2, 4), "float32"))),
}
LAUNCHES = {name: 2 if dtype == "float8_e4m3fn" else 1 for name, (_, _, _, dtype, _) in CALLS.items()}


def _call(name, offset=0, **extra):
    make, shape_q, shape_kv, dtype, options = CALLS[name]
    q, k, v = _qkv(make, shape_q, shape_kv, dtype, offset)
    return numba_flash.attention(q, k, v, algorithm="fa3", return_lse=True, **options, **extra)


@pytest.mark.parametrize("name", CALLS)
def test_a_signature_is_checked_once_then_launched(gpu, name):
    _call(name)
    per_call = LAUNCHES[name]
    assert gpu.checks == 1 and len(gpu.launches) == per_call
    for _ in range(3):
        _call(name)
    assert gpu.checks == 1 and len(gpu.launches) == 4 * per_call
    first, last = gpu.launches[per_call - 1][2], gpu.launches[-1][2]
    assert first != last and len(first) == len(last)  # new arrays, new pointers, new maps


@pytest.mark.parametrize("name", CALLS)
def test_planned_launch_is_the_unplanned_one(gpu, monkeypatch, name):
    make, shape_q, shape_kv, dtype, options = CALLS[name]
    q, k, v = _qkv(make, shape_q, shape_kv, dtype)

    def call():
        return numba_flash.attention(q, k, v, algorithm="fa3", return_lse=True, **options)

    planned = [fake_gpu.launches(gpu, call) for _ in range(2)]
    assert gpu.checks == 1
    monkeypatch.setattr(fa3, "_plan_key", lambda *args: None)
    plans.clear()
    unplanned = fake_gpu.launches(gpu, call)
    assert planned[0] == planned[1] == unplanned
    assert gpu.checks == 2


def test_each_pointer_gets_its_own_tensor_map(gpu):
    """Each launch's map slots hold the maps encoded for that call's q, k, v and O (the maps are
    kept by pointer: a plan that launched with the first call's maps would show here)."""
    make, shape_q, shape_kv, dtype, _ = CALLS["cupy float16"]
    for _ in range(3):
        q, k, v = _qkv(make, shape_q, shape_kv, dtype)
        o, lse = numba_flash.attention(q, k, v, algorithm="fa3", return_lse=True)
        params = gpu.launches[-1][2]
        pointer_of_map = {entry.address: key[1] for key, entry in fa3._MAPS.items()}
        launched = sorted(pointer_of_map[p] for p in params if isinstance(p, int) and p in pointer_of_map)
        assert launched == sorted(x.data.ptr for x in (q, k, v, o))
    assert gpu.checks == 1


def test_alibi_plan_launches_on_each_calls_slopes(gpu):
    """An ALiBi call is planned with its slopes' signature; each call's slopes are made anew in the
    kernel's units (``alibi.kernel_slopes``) and the launch reads that array, not the first call's."""
    make, shape_q, shape_kv, dtype, options = CALLS["torch float16 ALiBi (H,) causal"]
    q, k, v = _qkv(make, shape_q, shape_kv, dtype)
    launched = []
    for _ in range(3):
        slopes = T((4,), "float32")
        numba_flash.attention(q, k, v, algorithm="fa3", causal=True, alibi_slopes=slopes)
        made = gpu.slopes_made[id(slopes)][1]
        assert made.shape == (2, 4)  # (B, H): the (H,) slopes for each sequence
        assert made.data_ptr() in gpu.launches[-1][2]
        launched.append(made.data_ptr())
    assert gpu.checks == 1 and len(gpu.launches) == 3 and len(set(launched)) == 3
    numba_flash.attention(q, k, v, algorithm="fa3", causal=True, alibi_slopes=T((2, 4), "float32"))
    assert gpu.checks == 2  # (B, H) slopes: another signature, checked


def test_fp8_plan_transposes_each_calls_values_into_the_buffer_it_maps(gpu):
    """fp8's plan: each call's V^T pass reads that call's v and writes a buffer, and the kernel's
    V map (boxes of D rows) is that buffer's; q's and k's maps are that call's q's and k's."""
    make, shape_q, shape_kv, dtype, options = CALLS["torch float8 causal GQA (V^T pass, then the kernel)"]
    for _ in range(3):
        q, k, v = _qkv(make, shape_q, shape_kv, dtype)
        numba_flash.attention(q, k, v, algorithm="fa3", **options)
        transposed, kernel = gpu.launches[-2][2], gpu.launches[-1][2]
        maps = {entry.address: key for key, entry in fa3._MAPS.items()}
        mapped = [maps[p] for p in kernel if isinstance(p, int) and p in maps]
        (values,) = [key for key in mapped if key[5] == shape_kv[3]]  # (device, ptr, shape, strides, dtype, rows, ..)
        assert values[1] in transposed and v.data_ptr() in transposed and values[1] != v.data_ptr()
        assert values[2] == (shape_kv[0], shape_kv[1], shape_kv[3], 512)  # (B, Hkv, D, Nk rounded up to 32)
        assert {key[1] for key in mapped} == {q.data_ptr(), k.data_ptr(), values[1]}
    assert gpu.checks == 1


def test_unaligned_inputs_take_the_unplanned_path_every_time(gpu):
    _call("cupy float16")
    for _ in range(2):
        _call("cupy float16", offset=2)  # 2 bytes into a block: TMA cannot read it where it is
    assert gpu.checks == 3
    _call("cupy float16")
    assert gpu.checks == 3  # an aligned call: the plan again


def test_results_that_overlap_an_input_are_refused_on_every_call(gpu):
    make, shape_q, shape_kv, dtype, _ = CALLS["cupy float16"]
    q, k, v = _qkv(make, shape_q, shape_kv, dtype)
    lse = C(shape_q[:3], "float32")
    for _ in range(2):
        forward(q, k, v, algorithm="fa3", out=C(shape_q, dtype), lse_out=lse)  # planned
    assert gpu.checks == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="out must not share memory with q"):
            forward(q, k, v, algorithm="fa3", out=q, lse_out=lse)


def test_a_bad_call_raises_every_time(gpu):
    make, shape_q, shape_kv, dtype, _ = CALLS["cupy float16"]
    q, k, v = _qkv(make, shape_q, shape_kv, dtype)
    for _ in range(2):
        with pytest.raises(ValueError, match="out must have shape"):
            forward(q, k, v, algorithm="fa3", out=C((1, 2, 255, 128), dtype))
    assert len(gpu.launches) == 0


@pytest.mark.parametrize("bad", [False, 0.0, np.float64(0)], ids=repr)
def test_a_bad_knob_raises_after_a_plan_too(gpu, bad):
    """A value the unplanned path refuses (``poly_exp2`` is an int) is refused with a plan in place."""
    make, shape_q, shape_kv, dtype, _ = CALLS["cupy float16"]
    fa3.forward(*_qkv(make, shape_q, shape_kv, dtype))
    for _ in range(2):
        with pytest.raises(ValueError, match="poly_exp2"):
            fa3.forward(*_qkv(make, shape_q, shape_kv, dtype), poly_exp2=bad)


@pytest.mark.parametrize("extra", [dict(stages=3), dict(overlap=False), dict(rescale_threshold=0.0),
                                   dict(pingpong=False), dict(pingpong=True), dict(poly_exp2=2)], ids=str)
def test_calls_a_plan_does_not_cover_are_checked_every_time(gpu, extra):
    """The research knobs keep the unplanned path (as do user mods, packed batches, float8
    descales and split-KV's two launches, which the plan's conditions name)."""
    make, shape_q, shape_kv, dtype, _ = CALLS["cupy float16"]
    for _ in range(2):
        fa3.forward(*_qkv(make, shape_q, shape_kv, dtype), **extra)
    assert gpu.checks == 2 and len(fa3._PLANS) == 0


class _Copy:
    """A map copy's event: in flight until ``done``; records the streams made to wait for it."""

    def __init__(self):
        self.done, self.waits = False, []

    def query(self):
        return self.done

    def wait(self, stream):
        self.waits.append(stream)

    def synchronize(self):
        self.done = self.synchronized = True


@pytest.fixture
def kept(monkeypatch):
    """fa3's kept maps with the device faked: each new map's copy a :class:`_Copy`, streams named
    ("stream", handle), and which streams are being captured set by the test."""
    copies, captured_streams = [], set()

    def device_words(words, stream, device_id):
        copies.append(None if stream.capturing else _Copy())
        return words, words, copies[-1]

    monkeypatch.setattr(fa3, "_device_words", device_words)
    monkeypatch.setattr(fa3, "_numba_stream", lambda stream_ptr: ("stream", stream_ptr))
    monkeypatch.setattr(fa3, "_capturing", lambda stream_ptr: stream_ptr in captured_streams)
    monkeypatch.setattr("numba_flash.launch.device_array", lambda x, kind: types.SimpleNamespace(ptr=4096))
    monkeypatch.setattr(fa3, "_MAPS", type(fa3._MAPS)())
    monkeypatch.setattr(fa3, "_CAPTURED", {})
    monkeypatch.setattr(fa3, "_relaxed_capture", contextlib.nullcontext)
    return copies, captured_streams


def _words():
    return np.arange(16, dtype=np.uint64)


KEY, BEFORE, DURING = (0, "key"), (0, "before"), (0, "during")  # (device 0, ...)


def test_a_kept_map_is_waited_for_while_its_copy_is_in_flight(kept):
    """fa3._kept_entry queues a new map's copy on the launch's stream without synchronizing; a
    later launch on any stream waits for the copy's event while it is in flight (handles are not
    compared: two can name one stream), and once it has completed nobody waits and the pinned
    words are let go."""
    copies, _ = kept
    first = fa3._kept_entry(KEY, _words, fa3.map_stream(5))
    assert len(copies) == 1 and first.copied is copies[0] and first.host is not None
    assert fa3._kept_entry(KEY, _words, fa3.map_stream(5)) is first and fa3._kept_entry(KEY, _words, fa3.map_stream(7)) is first
    assert copies[0].waits == [("stream", 5), ("stream", 7)]
    copies[0].done = True
    fa3._kept_entry(KEY, _words, fa3.map_stream(9))
    assert copies[0].waits == [("stream", 5), ("stream", 7)] and first.copied is None and first.host is None
    assert len(copies) == 1


def test_maps_a_graph_capture_uses_are_made_outside_it_and_never_dropped(kept, monkeypatch):
    """While the launch's stream is being captured, a new map is copied outside the capture and
    kept for good, and a kept map the capture uses is no longer the LRU's to drop."""
    copies, captured_streams = kept
    monkeypatch.setattr(fa3, "_MAPS_KEPT", 2)
    before = fa3._kept_entry(BEFORE, _words, fa3.map_stream(5))
    captured_streams.add(5)
    during = fa3._kept_entry(DURING, _words, fa3.map_stream(5))
    assert copies[-1] is None and during.copied is None  # (made outside the capture and waited for)
    assert fa3._kept_entry(BEFORE, _words, fa3.map_stream(5)) is before  # used by the capture: kept for good
    assert getattr(copies[0], "synchronized", False) and copies[0].waits == []  # its copy waited for on the host
    assert set(fa3._CAPTURED) == {BEFORE, DURING}
    captured_streams.clear()
    for n in range(4):  # the LRU fills and drops what it holds
        fa3._kept_entry((0, n), _words, fa3.map_stream(5))
    assert fa3._kept_entry(BEFORE, _words, fa3.map_stream(5)) is before and fa3._kept_entry(DURING, _words, fa3.map_stream(5)) is during
    assert list(fa3._MAPS) == [(0, 2), (0, 3)]


def test_a_failed_driver_call_for_a_map_names_the_call():
    driver = pytest.importorskip("cuda.bindings.driver")
    assert fa3._checked((driver.CUresult.CUDA_SUCCESS, 7), "cuStreamIsCapturing") == (7,)
    with pytest.raises(RuntimeError, match="cuMemcpyHtoDAsync failed"):
        fa3._checked((driver.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemcpyHtoDAsync")


def test_an_output_written_in_place_without_the_tma_store_is_planned(gpu, monkeypatch):
    """An ``out`` whose rows TMA cannot write (264-byte rows: not a 16-byte multiple) but the threads
    can, as 32-bit pairs: planned (checked once), each launch the unplanned path's."""
    make, shape_q, shape_kv, dtype, _ = CALLS["cupy float16"]
    q, k, v = _qkv(make, shape_q, shape_kv, dtype)
    out = C(shape_q[:3] + (132,), dtype)[..., :128]
    assert not fa3.stores_o_by_tma(out, "cupy", False, 1)

    def call():
        return forward(q, k, v, algorithm="fa3", out=out)

    planned = [fake_gpu.launches(gpu, call) for _ in range(2)]
    assert gpu.checks == 1 and len(fa3._PLANS) == 1
    monkeypatch.setattr(fa3, "_plan_key", lambda *args: None)
    plans.clear()
    assert planned[0] == planned[1] == fake_gpu.launches(gpu, call)


class _FakeDeviceWords:
    """A device array of uint64 words at a fake address: slices and reshapes keep the address arithmetic."""

    def __init__(self, size, address):
        self.size, self.address = size, address
        self.device_ctypes_pointer = types.SimpleNamespace(value=address)

    def __getitem__(self, index):
        return _FakeDeviceWords(index.stop - index.start, self.address + 8 * index.start)

    def reshape(self, shape):
        return self


def test_new_maps_are_cut_from_chunks_and_copied_on_the_launch_stream(monkeypatch):
    """``fa3._device_words``: 64 maps share a device chunk and a pinned one (one allocation each), the
    65th starts the next chunk, a map of more words than a chunk gets one of its own; each copy
    goes from its pinned slot to its device slot on the launch's stream, an event recorded after."""
    driver = pytest.importorskip("cuda.bindings.driver")
    import numba_flash._cuda

    allocated, copies, recorded = [], [], []

    def device_array(size, dtype):
        allocated.append(size)
        return _FakeDeviceWords(size, 1 << (20 * len(allocated)))  # chunks at 2^20, 2^40, ..

    event = types.SimpleNamespace(record=recorded.append)
    fake = types.SimpleNamespace(device_array=device_array, pinned_array=lambda size, dtype: np.zeros(size, dtype),
                                 event=lambda timing: event, gpus={0: contextlib.nullcontext()})
    monkeypatch.setattr(numba_flash._cuda, "cuda", fake)
    monkeypatch.setattr(fa3, "_CHUNKS", {})
    monkeypatch.setattr(fa3, "_numba_stream", lambda stream_ptr: ("stream", stream_ptr))
    monkeypatch.setattr(driver, "cuMemcpyHtoDAsync", lambda dst, src, nbytes, stream: (
        copies.append((dst, nbytes, stream)) or (driver.CUresult.CUDA_SUCCESS,)))
    kept = []
    for n in range(65):
        words = np.full(16, n, np.uint64)
        device, host, copied = fa3._device_words(words, fa3.MapStream(7, False), 0)
        kept.append(host)
        assert np.array_equal(host, words) and copied is event
        assert copies[-1] == (device.address, 128, 7) and recorded[-1] == ("stream", 7)
    assert allocated == [64 * 16, 64 * 16]  # one device chunk for the first 64 maps, the next for the 65th
    assert [c[0] for c in copies[:64]] == [(1 << 20) + 128 * i for i in range(64)] and copies[64][0] == 1 << 40
    big = np.ones((70, 16), np.uint64)  # a packed batch's 70 maps: more than a chunk
    device, host, _ = fa3._device_words(big, fa3.MapStream(7, False), 0)
    assert allocated[-1] == 70 * 16 and copies[-1][1] == 70 * 128 and np.array_equal(host, big.reshape(-1))


def test_fp8_values_the_v_transpose_pass_cannot_read_in_place_keep_the_unplanned_path(gpu):
    """fp8 with a (B, N, Hkv, D) buffer seen as (B, Hkv, N, D) for v: the V^T pass reads a contiguous
    copy, which a plan could not repeat from v's pointer: every call is checked (and q, k as they are)."""
    make, shape_q, shape_kv, dtype, options = CALLS["torch float8 causal GQA (V^T pass, then the kernel)"]
    q, k, _ = _qkv(make, shape_q, shape_kv, dtype)
    B, Hkv, N, D = shape_kv
    v = make((B, N, Hkv, D), dtype).permute(0, 2, 1, 3)
    for _ in range(2):
        numba_flash.attention(q, k, v, algorithm="fa3", **options)
    assert gpu.checks == 2 and len(fa3._PLANS) == 0


def test_consumer_warpgroups_take_turns_by_default_only_in_pairs(monkeypatch):
    """FA-3's rule (fa3.takes_turns): ping-pong for two consumer warpgroups (128-row tiles), not for
    three (192 rows) nor one (64); an explicit ``pingpong`` wins. The kernel a call compiles gets it."""
    assert [fa3.takes_turns(bm) for bm in (64, 128, 192)] == [False, True, False]
    assert fa3.takes_turns(192, True) and not fa3.takes_turns(128, False)
    import numba_flash.kernels.fa3 as kernels_fa3

    seen = []
    monkeypatch.setattr(kernels_fa3, "fa3_kernel", lambda *args, **kw: seen.append(args[7]))
    p = types.SimpleNamespace(dtype="float16", window=(-1, -1), softcap=0.0, alibi=False, user_mods=None)
    for bm, pingpong in ((128, None), (192, None), (192, True), (128, False)):
        fa3.kernel_for(p, 64, bm, 64, 2, True, pingpong)
    assert seen == [True, False, True, False]


@pytest.mark.parametrize("name, rows, turns", [("torch float16 D64 window softcap", 192, False),
                                               ("cupy float16", 128, True)])
def test_calls_compile_the_turns_of_their_tiles_and_plans_replay_them(gpu, monkeypatch, name, rows, turns):
    """A default call's kernel takes turns by its tiles (``fa3.takes_turns``: D64's 192 rows none, D128's
    128 rows two warpgroups in turns), and the planned call after it launches that kernel again."""
    compiled = []
    kernel_for = fa3.kernel_for

    def spy(p, head_dim, block_m, block_n, stages, overlap=True, pingpong=None, *rest, **kw):
        compiled.append((block_m, pingpong))
        return kernel_for(p, head_dim, block_m, block_n, stages, overlap, pingpong, *rest, **kw)

    monkeypatch.setattr(fa3, "kernel_for", spy)
    _call(name)
    _call(name)
    assert compiled == [(rows, turns)]  # the second call: the plan, no kernel looked up again
    assert gpu.checks == 1 and len(gpu.launches) == 2 and gpu.launches[0][0] is gpu.launches[1][0]
