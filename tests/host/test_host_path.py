"""The GPU path's host work with the GPU faked (``tests/fake_gpu.py``): a call on CuPy arrays or
torch CUDA tensors is checked and planned once per signature (``numba_flash.plans``) and only
launched after; what depends on pointers is checked on every call; a bad call raises every
time; and a planned call launches exactly what the unplanned path launches. The same paths on
a real GPU: ``tests/gpu/``."""

from __future__ import annotations

import json

import numpy as np
import pytest

import fake_gpu
import numba_flash
from numba_flash import api, decoding, plans, tile_cache
from numba_flash.api import forward

C, T = fake_gpu.cupy_array, fake_gpu.torch_tensor


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """The fake GPU, no plans yet, no autotuned tiles; counts the checks and the planning."""
    record = fake_gpu.installed(monkeypatch, tmp_path)
    record.validations = record.plannings = 0
    monkeypatch.setattr(api, "configure", fake_gpu.counting(record, "validations", api.configure))
    monkeypatch.setattr(plans.PlanBuilder, "plan", fake_gpu.counting(record, "plannings", plans.PlanBuilder.plan))
    yield record
    plans.clear()  # plans made with the fake's kernels and allocators
    fake_gpu.clear_host_caches()
    tile_cache.load.cache_clear()


_qkv = fake_gpu.qkv


CALLS = {  # name: a function of a fresh set of inputs per call
    "cupy float32 fa2": lambda: forward(*_qkv(C, (1, 2, 128, 64), (1, 2, 128, 64), "float32")),
    "cupy float16 fa1 causal": lambda: forward(*_qkv(C, (1, 2, 100, 40), (1, 1, 300, 40), "float16"), causal=True,
                                               algorithm="fa1", precision="ieee"),
    "torch float16 tensor cores, split": lambda: forward(*_qkv(T, (1, 2, 64, 64), (1, 2, 2048, 64), "float16"),
                                                         num_splits=3),
    "torch bfloat16 tensor cores, heuristic split": lambda: forward(*_qkv(T, (1, 1, 16, 128), (1, 1, 8192, 128),
                                                                          "bfloat16")),
    "decode torch float16, lengths": lambda: numba_flash.decode(
        *_qkv(T, (1, 32, 1, 128), (1, 8, 131072, 128), "float16"), cache_seqlens=T((1,), "int32"), return_lse=True),
    "decode cupy float32": lambda: numba_flash.decode(*_qkv(C, (2, 8, 1, 64), (2, 2, 1000, 64), "float32"),
                                                      return_lse=True),
}


@pytest.mark.parametrize("name", CALLS)
def test_a_signature_is_checked_and_planned_once(gpu, name):
    """The first call validates and plans; later calls with new arrays of the same signature
    only launch (new pointers each time)."""
    call = CALLS[name]
    call()
    assert gpu.validations == 1 and gpu.plannings == 1
    per_call = len(gpu.launches)
    for _ in range(3):
        call()
    assert gpu.validations == 1 and gpu.plannings == 1
    assert len(gpu.launches) == 4 * per_call
    first, last = gpu.launches[0][2], gpu.launches[-per_call][2]
    assert first != last and len(first) == len(last)  # the pointers of each call's arrays


def test_another_signature_is_planned_again(gpu):
    """Shape, dtype, strides, causal, scale (value and type), tiles, results given, device:
    each a plan of its own; the same signature again: none."""
    q, k, v = _qkv(C, (1, 2, 64, 64), (1, 2, 64, 64), "float32")
    variants = [
        lambda: forward(q, k, v),
        lambda: forward(*_qkv(C, (1, 2, 64, 64), (1, 2, 96, 64), "float32")),  # shape
        lambda: forward(*_qkv(C, (1, 2, 64, 64), (1, 2, 64, 64), "float16")),  # dtype
        lambda: forward(q.transpose(0, 2, 1, 3).transpose(0, 2, 1, 3), k, v[:, :, ::-1][:, :, ::-1]),  # same layout
        lambda: forward(C((1, 64, 2, 64), "float32").transpose(0, 2, 1, 3), k, v),  # strides
        lambda: forward(q, k, v, causal=True),
        lambda: forward(q, k, v, scale=0.5),
        lambda: forward(q, k, v, scale=np.float32(0.5)),  # another type, same value
        lambda: forward(q, k, v, block_m=32, block_n=16),
        lambda: forward(q, k, v, out=C((1, 2, 64, 64), "float32")),
        lambda: forward(q, k, v, precision="tf32"),
    ]
    plannings = []
    for variant in variants:
        variant()
        plannings.append(gpu.plannings)
    assert plannings == [1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10]  # the 4th: views of the same layout
    forward(q, k, v, scale=0.5)
    forward(q, k, v, scale=-0.0)
    forward(q, k, v, scale=0.0)  # equal to -0.0, and a key of its own (the sign of the scores)
    assert gpu.plannings == 12


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_unaligned_inputs_take_the_copying_path_on_every_call(gpu, dtype):
    """cp.async reads 16-byte aligned rows: a pointer 8 bytes off (same signature) launches on
    padded copies, whatever the calls before it were; the next aligned call is in place."""
    aligned = _qkv(T, (1, 2, 64, 64), (1, 2, 64, 64), dtype)
    shifted = _qkv(T, (1, 2, 64, 64), (1, 2, 64, 64), dtype, offset=8)
    for inputs, in_place in ((aligned, True), (shifted, False), (aligned, True), (shifted, False)):
        gpu.launches.clear()
        forward(*inputs)
        (_, _, params), = gpu.launches
        q_pointer = params[4]  # the first argument's data pointer (launch.POINTER_FIELD)
        assert (q_pointer == inputs[0].data_ptr()) == in_place
    assert gpu.plannings == 1


def test_a_decode_with_unaligned_queries_copies(gpu):
    k, v = (T((1, 2, 4096, 128), "float16") for _ in range(2))
    for offset in (0, 8, 0):
        gpu.launches.clear()
        q = T((1, 8, 1, 128), "float16", offset=offset)
        o, lse = numba_flash.decode(q, k, v, return_lse=True)
        assert (gpu.launches[0][2][4] == q.data_ptr()) == (offset == 0)
        assert o.shape == (1, 8, 1, 128) and lse.shape == (1, 8, 1)
    assert gpu.plannings == 1


def test_bad_calls_raise_every_time(gpu):
    """A failing signature is never stored: the same error on every call, also after a good
    call of a near signature (``True`` and ``1`` are equal keys but not equal to the checks)."""
    q, k, v = _qkv(C, (1, 2, 64, 64), (1, 2, 64, 64), "float32")
    forward(q, k, v, causal=True, scale=1)
    bad = [
        (lambda: forward(*_qkv(C, (1, 2, 64, 64), (1, 2, 64, 64), "int32")), TypeError, "float16, bfloat16 or float32"),
        (lambda: forward(q, k[:, :1], v), ValueError, "same shape"),
        (lambda: forward(q, k, v, causal=1, scale=1), TypeError, "causal must be a bool"),
        (lambda: forward(q, k, v, causal=True, scale=True), TypeError, "scale must be a real number"),
        (lambda: forward(q, k, v, scale=float("nan")), ValueError, "scale must be finite"),
        (lambda: forward(q, k, v, scale=[1.0]), TypeError, "scale must be a real number"),
        (lambda: forward(q, k, v, block_m=48), ValueError, "block_m=48 is not supported"),
        (lambda: forward(q, k, v, num_splits=3, algorithm="fa1"), ValueError, "num_splits > 1"),
        (lambda: numba_flash.decode(q, k[:, :1], v), ValueError, "must have the same shape"),
        (lambda: numba_flash.decode(T((1, 2, 1, 64), "float16"), C((1, 2, 64, 64), "float16"),
                                    C((1, 2, 64, 64), "float16")), TypeError, "one library"),
    ]
    for call, error, message in bad:
        for _ in range(2):
            with pytest.raises(error, match=message):
                call()
    assert gpu.plannings == 1


def test_results_that_overlap_an_input_are_refused_on_every_call(gpu):
    """Overlap depends on pointers: checked per call, with the plan of a good call in place."""
    q, k, v = _qkv(T, (1, 2, 64, 64), (1, 2, 64, 64), "float16")
    lse = T((1, 2, 64), "float32")
    forward(q, k, v, out=T((1, 2, 64, 64), "float16"), lse_out=lse)
    for _ in range(2):
        with pytest.raises(ValueError, match="out must not share memory with k"):
            forward(q, k, v, out=k, lse_out=lse)
        inside_v = T((1, 2, 64), "float32")
        inside_v._ptr = v.data_ptr() + 512
        with pytest.raises(ValueError, match="lse_out must not share memory with v"):
            forward(q, k, v, out=T((1, 2, 64, 64), "float16"), lse_out=inside_v)
    assert gpu.plannings == 1 and gpu.validations == 1


def test_new_autotuned_tiles_replan(gpu, monkeypatch):
    """Default CUDA-core tiles come from the autotune cache: a plan made before
    ``numba-flash autotune`` saved new ones is not used after."""
    monkeypatch.setattr(tile_cache, "gpu_name", lambda device_id: "Fake H200")
    q, k, v = _qkv(C, (1, 2, 128, 64), (1, 2, 128, 64), "float32")
    forward(q, k, v)
    assert gpu.launches[0][1]["block"] == (128,)  # 64 x 32 tiles
    path = tile_cache.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({tile_cache.key("Fake H200", "fa2", 64, "float32", False): {"tiles": [32, 16]}}))
    tile_cache.load.cache_clear()  # what tile_cache.save does
    gpu.launches.clear()
    forward(q, k, v)
    assert gpu.plannings == 2 and gpu.launches[0][1]["block"] == (64,)  # 32 x 16 tiles
    forward(q, k, v, block_m=64, block_n=32)
    tile_cache.load.cache_clear()
    forward(q, k, v, block_m=64, block_n=32)  # tiles given: the cache is not asked
    assert gpu.plannings == 3


PROBLEMS = {
    "cupy float32 fa2 heuristic split": (C, (1, 1, 16, 64), (1, 1, 8192, 64), "float32", {}),
    "cupy float32 fa1, results given": (C, (2, 2, 33, 40), (2, 1, 70, 40), "float32", dict(algorithm="fa1", out=True)),
    "cupy float16 CUDA cores split": (C, (1, 2, 50, 64), (1, 2, 900, 64), "float16",
                                      dict(precision="ieee", num_splits=3)),
    "cupy float32 tf32 causal": (C, (1, 2, 64, 64), (1, 2, 64, 64), "float32", dict(precision="tf32", causal=True)),
    "torch float16 split": (T, (1, 2, 64, 64), (1, 2, 2048, 64), "float16", dict(num_splits=4)),
    "torch bfloat16 split": (T, (1, 2, 64, 64), (1, 2, 2048, 64), "bfloat16", dict(num_splits=2)),
    "torch float16 head dim 40 (padded: unplanned)": (T, (1, 2, 64, 40), (1, 2, 64, 40), "float16", {}),
}


@pytest.mark.parametrize("name", PROBLEMS)
def test_planned_launches_are_the_unplanned_ones(gpu, monkeypatch, name):
    """The first call (planned), a later one (a plan's hit) and the unplanned path launch the
    same kernels, configurations and parameters, and give results of the same layout."""
    make, shape_q, shape_kv, dtype, options = PROBLEMS[name]
    options = dict(options)
    q, k, v = _qkv(make, shape_q, shape_kv, dtype)
    if options.pop("out", False):
        options.update(out=make(shape_q, dtype), lse_out=make(shape_q[:3], "float32"))
    planned = [fake_gpu.launches(gpu, lambda: forward(q, k, v, **options)) for _ in range(2)]
    monkeypatch.setattr(api, "_plan_forward", lambda *args: None)
    plans.clear()
    unplanned = fake_gpu.launches(gpu, lambda: forward(q, k, v, **options))
    assert planned[0] == planned[1] == unplanned


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (4, 4)])
@pytest.mark.parametrize("lengths", [False, True])
def test_planned_decode_launches_are_the_unplanned_ones(gpu, monkeypatch, dtype, heads, kv_heads, lengths):
    """The same for ``decode`` (one query row: the packed rows are q's memory, and the results
    are allocated in the caller's shapes)."""
    q, k, v = _qkv(T, (2, heads, 1, 128), (2, kv_heads, 4096, 128), dtype)
    seqlens = T((2,), "int32") if lengths else None
    planned = [fake_gpu.launches(gpu, lambda: numba_flash.decode(q, k, v, cache_seqlens=seqlens, return_lse=True))
               for _ in range(2)]
    monkeypatch.setattr(decoding, "_plan_decode", lambda *args: None)
    plans.clear()
    unplanned = fake_gpu.launches(gpu, lambda: numba_flash.decode(q, k, v, cache_seqlens=seqlens, return_lse=True))
    assert planned[0] == planned[1] == unplanned
    assert gpu.plannings == 1


def test_arrays_on_a_second_gpu_are_planned_and_launched_there(gpu, monkeypatch):
    """Two GPUs: each call makes the arrays' device current around its allocation and launch."""
    import sys

    from numba_flash import arrays

    entered = []

    class Device:
        def __init__(self, device_id):
            self.device_id = device_id

        def __enter__(self):
            entered.append(self.device_id)

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(sys.modules["cupy"].cuda, "Device", Device)
    monkeypatch.setattr(arrays, "gpu_count", lambda kind: 2)
    q, k, v = (fake_gpu.FakeCupyArray((1, 2, 64, 64), "float32", device_id=1) for _ in range(3))
    for _ in range(3):
        forward(q, k, v)
    assert entered == [1, 1, 1] and gpu.plannings == 1
    assert {prepared.device_id for cache in plans._CACHES for plan in cache._plans.values()
            for prepared in plan.launches} == {1}
