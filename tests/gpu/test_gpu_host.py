"""The host path on a real GPU (``pytest -m gpu``; skipped in the simulator): concurrent calls
on their own streams, no deprecated stream passing, no per-call driver lookups, several GPUs,
result buffers that alias inputs refused, dynamic shared memory through numba's launch."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

PRECISIONS = [("float32", "ieee"), ("float16", None)]  # CUDA cores; tensor cores


def _cupy():
    import cupy

    return cupy


def _reference(q, k, v, causal):
    from numba_flash.baselines import cupy_attention

    cp = _cupy()
    return cupy_attention(*(x.astype(cp.float64) for x in (q, k, v)), causal=causal)


def _inputs(shape, dtype, seed):
    cp = _cupy()
    rs = cp.random.default_rng(seed)
    return tuple(rs.standard_normal(shape, dtype=cp.float32).astype(dtype) for _ in range(3))


def _rel(o, ref):
    cp = _cupy()
    return float(cp.linalg.norm(o.astype(cp.float64) - ref) / cp.linalg.norm(ref))


@pytest.mark.parametrize("dtype, precision", PRECISIONS, ids=["cuda-cores", "tensor-cores"])
def test_threads_each_on_their_own_stream(dtype, precision):
    """Eight Python threads, each with its own non-blocking CuPy stream and inputs, several calls
    each, both algorithms: every result is that thread's, computed on that thread's stream."""
    cp = _cupy()
    from numba_flash import attention

    problems = [_inputs((1, 4, 777, 64), dtype, seed) for seed in range(8)]
    refs = [_reference(*p, True) for p in problems]
    attention(*problems[0], causal=True, precision=precision)  # compile outside the race
    attention(*problems[0], causal=True, precision=precision, algorithm="fa1")
    cp.cuda.Device().synchronize()
    results, errors = {}, []
    barrier = threading.Barrier(len(problems))

    def work(i):
        try:
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                barrier.wait()
                outs = [attention(*problems[i], causal=True, precision=precision, algorithm=alg)
                        for alg in ("fa2", "fa1", "fa2")]
                done = [o * 1 for o in outs]  # queued behind the kernels on the same stream
            stream.synchronize()
            results[i] = done
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    tol = 1e-5 if dtype == "float32" else 5e-3
    for i, outs in results.items():
        for o in outs:
            assert _rel(o, refs[i]) < tol, (i, _rel(o, refs[i]))


@pytest.mark.parametrize("dtype, precision", PRECISIONS, ids=["cuda-cores", "tensor-cores"])
@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
def test_no_deprecation_warning_on_a_launch(algorithm, dtype, precision):
    """cuda.core deprecates foreign stream objects passed through ``__cuda_stream__``; every
    warning is an error here, on the default and on a non-default stream."""
    cp = _cupy()
    from numba_flash import attention

    q, k, v = _inputs((1, 2, 300, 64), dtype, 1)
    attention(q, k, v, algorithm=algorithm, precision=precision)  # compile first: numba may warn there
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention(q, k, v, algorithm=algorithm, precision=precision)
        with cp.cuda.Stream(non_blocking=True):
            attention(q, k, v, algorithm=algorithm, precision=precision)
    cp.cuda.Device().synchronize()


@pytest.mark.parametrize("dtype, precision", PRECISIONS, ids=["cuda-cores", "tensor-cores"])
def test_no_driver_device_lookup_per_call(dtype, precision, monkeypatch):
    """After the first call, a call asks the driver nothing about devices: numba's current
    device/context, cuda.core's Device, the driver's context queries and the tile cache's GPU
    name are all counted, and must stay at zero."""
    from numba.cuda.cudadrv import driver as numba_driver

    import cuda.core
    import numba.cuda

    from numba_flash import attention, launch, tile_cache

    q, k, v = _inputs((1, 2, 256, 64), dtype, 2)
    for alg in ("fa1", "fa2"):
        attention(q, k, v, algorithm=alg, precision=precision)
    calls = []

    def counted(name, original):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        return wrapper

    for name in ("get_current_device", "current_context"):
        monkeypatch.setattr(numba.cuda, name, counted(f"numba.cuda.{name}", getattr(numba.cuda, name)))
    for name in ("cuCtxGetCurrent", "cuCtxGetDevice", "cuDeviceGet", "cuGetProcAddress"):
        try:
            original = getattr(numba_driver.driver, name)
        except AttributeError:
            continue
        monkeypatch.setattr(numba_driver.driver, name, counted(f"driver.{name}", original), raising=False)
    monkeypatch.setattr(cuda.core, "Device", counted("cuda.core.Device", cuda.core.Device))
    monkeypatch.setattr(launch, "_current_device_id", counted("launch._current_device_id", launch._current_device_id))
    monkeypatch.setattr(tile_cache, "current_device_id", counted("tile_cache.current_device_id", tile_cache.current_device_id))
    for _ in range(5):
        for alg in ("fa1", "fa2"):
            attention(q, k, v, algorithm=alg, precision=precision)
    _cupy().cuda.Device().synchronize()
    assert not calls, sorted(set(calls))


def _gpus():
    return _cupy().cuda.runtime.getDeviceCount()


@pytest.mark.parametrize("dtype, precision", PRECISIONS, ids=["cuda-cores", "tensor-cores"])
@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
def test_arrays_on_the_second_gpu_run_there(algorithm, dtype, precision):
    """With GPU 0 current, arrays on GPU 1 run on GPU 1 and the result lives there; the kernel
    is compiled once per device (the launcher's cache has an entry for each)."""
    if _gpus() < 2:
        pytest.skip(f"needs two GPUs; this machine has {_gpus()}")
    cp = _cupy()
    from numba_flash import attention, launch

    with cp.cuda.Device(0):
        q0, k0, v0 = _inputs((1, 4, 500, 64), dtype, 3)
        o0 = attention(q0, k0, v0, causal=True, algorithm=algorithm, precision=precision)
    with cp.cuda.Device(1):
        q1, k1, v1 = (cp.asarray(cp.asnumpy(x)) for x in (q0, k0, v0))  # through the host: on GPU 1
        assert q1.device.id == 1
        ref1 = _reference(q1, k1, v1, True)
    with cp.cuda.Device(0):  # the current device is 0, the arrays are on 1
        o1 = attention(q1, k1, v1, causal=True, algorithm=algorithm, precision=precision)
        assert cp.cuda.runtime.getDevice() == 0  # and stays 0
    assert o1.device.id == 1
    with cp.cuda.Device(1):
        cp.cuda.Device().synchronize()
        tol = 1e-5 if dtype == "float32" else 5e-3
        assert _rel(o1, ref1) < tol
        assert np.array_equal(cp.asnumpy(o0), cp.asnumpy(o1))  # same kernel, same inputs: bitwise equal
    devices = {key[1] for key in launch._KERNELS}
    assert {0, 1} <= devices


def test_out_aliasing_an_input_is_refused_on_the_gpu():
    cp = _cupy()
    from numba_flash.api import forward

    buf = cp.random.standard_normal((3, 1, 2, 64, 32), dtype=cp.float32)
    q, k, v = buf[0], buf[1], buf[2]
    for target, out in (("q", q), ("k", k), ("v", v)):
        with pytest.raises(ValueError, match=f"out must not share memory with {target}"):
            forward(q, k, v, out=out, algorithm="fa1", precision="ieee")
    lse = cp.empty((1, 2, 64), cp.float32)
    with pytest.raises(ValueError, match="lse_out must not share memory with q"):
        forward(q, k, v, lse_out=q.reshape(-1)[: lse.size].reshape(lse.shape), precision="ieee")
    forward(q, k, v, out=cp.empty_like(q), lse_out=lse, precision="ieee")  # separate buffers: fine


def test_numba_launch_with_more_than_48_kib_of_dynamic_shared_memory():
    """numba's own launch with 200 KiB of dynamic shared memory (the kernel opted in first)."""
    from numba_flash._cuda import cuda, float32
    from numba_flash.launch import numba_launch

    @cuda.jit
    def fill(out, n):
        buf = cuda.shared.array(0, dtype=float32)
        for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            buf[i] = i
        cuda.syncthreads()
        s = float32(0)
        for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            s += buf[n - 1 - i]
        cuda.atomic.add(out, 0, s)

    n = (200 * 1024) // 4
    out = cuda.to_device(np.zeros(1, np.float32))
    numba_launch(fill, (1,), (256,), None, (out, n), shared_mem_bytes=n * 4)
    cuda.synchronize()
    assert float(out.copy_to_host()[0]) == pytest.approx(n * (n - 1) / 2, rel=1e-6)


def _planned_then_unplanned(monkeypatch, module, planner, call):
    """``call()`` planned (the first call makes the plan, the second uses it), then with no plan
    (``module.planner`` made to refuse): the three results."""
    from numba_flash import plans

    plans.clear()
    first, second = call(), call()
    monkeypatch.setattr(module, planner, lambda *args: None)
    plans.clear()
    return first, second, call()


@pytest.mark.parametrize("case", ["cupy float32 fa2", "cupy float32 fa1", "cupy float16 split", "torch float16 split",
                                  "torch bfloat16 split", "decode torch float16", "decode cupy float32"])
def test_planned_calls_are_bitwise_the_unplanned_ones(case, monkeypatch):
    """A call launched from its plan (``numba_flash.plans``: parameters packed once, pointers
    written per call) gives bitwise what the unplanned path gives, the plan's first call and
    a later one alike; lse too."""
    cp = _cupy()
    from numba_flash import api, decoding
    from numba_flash.api import forward

    if case.startswith("torch") or case.startswith("decode torch"):
        torch = pytest.importorskip("torch")
        dtype = torch.float16 if "float16" in case else torch.bfloat16
        gen = torch.Generator(device="cuda").manual_seed(7)

        def make(shape):
            return torch.randn(shape, device="cuda", generator=gen).to(dtype)
    else:
        dtype = "float16" if "float16" in case else "float32"

        def make(shape):
            return cp.random.default_rng(7).standard_normal(shape, dtype=cp.float32).astype(dtype)

    if case.startswith("decode"):
        q, k, v = make((2, 32, 1, 128)), make((2, 8, 20000, 128)), make((2, 8, 20000, 128))
        results = _planned_then_unplanned(monkeypatch, decoding, "_plan_decode",
                                          lambda: decoding.decode(q, k, v, return_lse=True))
    else:
        q, k, v = make((1, 4, 300, 64)), make((1, 2, 3000, 64)), make((1, 2, 3000, 64))
        options = dict(algorithm="fa1") if "fa1" in case else dict(num_splits=5) if "split" in case else {}
        results = _planned_then_unplanned(monkeypatch, api, "_plan_forward",
                                          lambda: forward(q, k, v, causal=True, **options))
    (o1, l1), (o2, l2), (o3, l3) = results
    for o, lse in ((o1, l1), (o2, l2)):
        assert bool((o == o3).all()) and bool((lse == l3).all())


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_no_warning_reaches_the_caller_from_any_public_call(dtype):
    """Forward (both algorithms, split-KV), backward (both algorithms, deterministic), decode and
    the split-KV combine on grids small enough that numba's dispatcher warned of
    under-utilisation ("Grid size 16 ..."): first calls included (compilation), every warning
    an error."""
    cp = _cupy()
    import numba_flash

    q, k, v = _inputs((1, 2, 40, 64), dtype, 3)
    do = cp.asarray(np.random.default_rng(4).standard_normal(q.shape).astype(dtype))
    kc, vc = _inputs((1, 1, 300, 64), dtype, 5)[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for algorithm in ("fa1", "fa2"):
            o, lse = numba_flash.attention(q, k, v, causal=True, algorithm=algorithm, return_lse=True)
            numba_flash.attention_backward(do, q, k, v, o, lse, causal=True, algorithm=algorithm)
        numba_flash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
        numba_flash.attention(q, k, v, num_splits=3)
        numba_flash.decode(q[:, :, :1], kc, vc, cache_seqlens=[77], num_splits=2)
        cp.cuda.Device().synchronize()


def test_second_process_compiles_nothing(tmp_path):
    """A fresh process runs forward, backward and decode: it compiles its kernels and stores
    them (``numba_flash.compile_cache``); a second fresh process with the same cache folder
    loads every one of them, compiles none, and computes the same bits
    (``scripts/first_call.py``, which also reports the two first-call times)."""
    import json
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "first_call.py"
    done = subprocess.run([sys.executable, str(script), "--json", "--cache-dir", str(tmp_path),
                           "--cases", "fwd_f16_causal", "bwd_f16_causal", "decode_f16"],
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    print(json.dumps(rows, indent=1))
    for cold, cached in zip(rows[::2], rows[1::2]):
        assert cold["stage"] == "cold" and cold["compiled"] >= 1 and cold["loaded"] == 0
        assert cached["compiled"] == 0 and cached["loaded"] == cold["compiled"]
        assert cached["checksum"] == cold["checksum"] and all(np.isfinite(cold["checksum"]))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_strided_cupy_views_on_decode_and_backward(dtype):
    """(B, N, H, D) buffers seen as (B, H, N, D) (not contiguous): decode with such a cache and
    the backward with such inputs and ``do`` match their contiguous copies."""
    cp = _cupy()
    import numba_flash

    def views(shape_bnhd, seed, n):
        rs = cp.random.default_rng(seed)
        return [rs.standard_normal(shape_bnhd, dtype=cp.float32).astype(dtype).transpose(0, 2, 1, 3) for _ in range(n)]

    q1 = views((2, 1, 8, 64), 1, 1)[0]
    kc, vc = views((2, 300, 2, 64), 2, 2)
    got = numba_flash.decode(q1, kc, vc, cache_seqlens=[300, 123], return_lse=True)
    want = numba_flash.decode(q1, cp.ascontiguousarray(kc), cp.ascontiguousarray(vc), cache_seqlens=[300, 123],
                              return_lse=True)
    for g, w in zip(got, want):
        assert _rel(g, w.astype(cp.float64)) < 1e-6
    q, k, v, do = views((1, 200, 4, 64), 3, 4)
    o, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    got = numba_flash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    want = numba_flash.attention_backward(*(cp.ascontiguousarray(x) for x in (do, q, k, v)), o, lse, causal=True,
                                          deterministic=True)
    for g, w in zip(got, want):
        assert _rel(g, w.astype(cp.float64)) < 1e-6


def test_warmup_stores_what_a_later_process_loads(tmp_path):
    """``numba-flash warmup`` in a fresh process compiles its cases' kernels into an empty cache
    folder; run again, it finds every one of them there (nothing new) and takes less time."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_FLASH_CACHE_DIR=str(tmp_path))
    argv = [sys.executable, "-m", "numba_flash", "warmup", "--dtype", "float16", "--head-dim", "64", "--causal", "on",
            "--backward", "--decode", "--json"]
    runs = []
    for _ in range(2):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout))
        print(done.stderr[-2000:])
    first, second = runs
    assert [r["case"] for r in first] == [r["case"] for r in second] and len(first) == 6
    assert all(r["new_kernels"] >= 1 for r in first[:1]) and sum(r["new_kernels"] for r in first) >= 6
    assert all(r["new_kernels"] == 0 for r in second)
    assert sum(r["seconds"] for r in second) < sum(r["seconds"] for r in first) / 3
