"""The simulator's fast paths (``numba_flash.simulator``): same semantics as numba's block
scheduler and device calls, without the polling; the cost model and the slow-call warning."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
from helpers import random_qkv

from numba_flash._cuda import cuda, float32, int32
from numba_flash._world import simulated
from numba_flash.kernels import tile_ops as tile_ops_module

pytestmark = pytest.mark.skipif(not simulated(), reason="the simulator's own machinery (a GPU runs kernels natively)")

N = 64


@cuda.jit(device=True)
def _lane():
    return cuda.threadIdx.x  # `cuda` must be the simulator's module inside a launch


@cuda.jit
def _reverse_many_times(x, rounds):
    """Reverse x through shared memory ``rounds`` times: two barriers per round."""
    buf = cuda.shared.array(N, float32)
    i = _lane()
    for _ in range(rounds):
        buf[i] = x[i]
        cuda.syncthreads()
        x[i] = buf[N - 1 - i]
        cuda.syncthreads()


@cuda.jit
def _early_exit(out):
    """Half the threads return before the barrier; the rest must still get through it."""
    buf = cuda.shared.array(N, int32)
    i = cuda.threadIdx.x
    if i >= N // 2:
        return
    buf[i] = i
    cuda.syncthreads()
    out[i] = buf[N // 2 - 1 - i]


@cuda.jit
def _count(out):
    out[cuda.threadIdx.x] = cuda.syncthreads_count(cuda.threadIdx.x % 3 == 0)


@cuda.jit
def _fails(out):
    i = cuda.threadIdx.x
    cuda.syncthreads()
    if i == 5:
        raise ValueError("thread five fails")
    cuda.syncthreads()
    out[i] = i


def _run(fn, timeout=120):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not finish."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the simulated launch deadlocked"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_fast_paths_are_installed():
    from numba_flash import simulator

    assert simulator.fast()


def test_barriers_and_shared_memory():
    x = np.arange(N, dtype=np.float32)
    _run(lambda: _reverse_many_times[1, N](x, 3))
    assert np.array_equal(x, np.arange(N, dtype=np.float32)[::-1])


def test_a_launch_does_not_poll(monkeypatch):
    """numba's scheduler polls every thread (``is_alive``) in a loop until all are blocked or
    done: thousands of polls for a few barriers, each a GIL hand-over. The fast one waits."""
    polls = []
    original = threading.Thread.is_alive

    def counting(self):
        polls.append(1)
        return original(self)

    monkeypatch.setattr(threading.Thread, "is_alive", counting)
    x = np.arange(N, dtype=np.float32)
    _run(lambda: _reverse_many_times[2, N](x, 10))  # 2 blocks x 20 barriers x 64 threads
    monkeypatch.setattr(threading.Thread, "is_alive", original)
    assert len(polls) < 10, f"{len(polls)} polls of thread liveness during one launch"


def test_threads_that_return_do_not_hold_the_barrier():
    out = np.full(N // 2, -1, dtype=np.int32)
    _run(lambda: _early_exit[1, N](out))
    assert np.array_equal(out, np.arange(N // 2)[::-1])


def test_syncthreads_count():
    out = np.zeros(N, dtype=np.int32)
    _run(lambda: _count[1, N](out))
    assert (out == len(range(0, N, 3))).all()


def test_an_error_in_one_thread_is_raised_and_releases_the_others():
    out = np.zeros(N, dtype=np.int32)
    with pytest.raises(ValueError, match=r"tid=\[5, 0, 0\].*thread five fails"):
        _run(lambda: _fails[1, N](out))
    x = np.arange(N, dtype=np.float32)  # and the simulator still works afterwards
    _run(lambda: _reverse_many_times[1, N](x, 1))
    assert x[0] == N - 1


def test_device_function_modules_get_their_real_cuda_back():
    """Inside a launch a device function's module sees the simulator's ``cuda``; after it, the
    real one again (the swap is made once per launch, and undone)."""
    from numba_flash.api import attention

    q, k, v = random_qkv(np.random.default_rng(0), 1, 1, 1, 3, 4, 4, "float32")
    attention(q, k, v, precision="ieee", block_m=4, block_n=4)
    assert tile_ops_module.cuda is cuda


def test_cost_model_grows_with_the_problem():
    from numba_flash.simulator import estimate_seconds

    small = estimate_seconds("fa2", 1, 1, 64, 64, 64, 64, 32)
    assert 0.2 < small < 20
    assert estimate_seconds("fa2", 1, 1, 128, 128, 64, 64, 32) > 3 * small  # ~4x the work
    assert estimate_seconds("fa2", 2, 1, 64, 64, 64, 64, 32) > 1.8 * small
    assert estimate_seconds("fa2", 1, 1, 128, 128, 64, 64, 32, causal=True) < estimate_seconds("fa2", 1, 1, 128, 128, 64, 64, 32)


def test_a_call_that_takes_minutes_is_announced_before_it_runs(monkeypatch):
    """The warning comes before the launch (here the launch is stubbed out), points at the
    caller's line, and names the expected duration."""
    import numba_flash.api as api
    from numba_flash.simulator import SimulatorSlowWarning

    launched = []
    monkeypatch.setattr(api, "_launch", lambda *a, **k: launched.append(1))
    q = np.zeros((1, 4, 1024, 64), np.float32)
    with pytest.warns(SimulatorSlowWarning, match=r"about [\d.]+ (minutes|hours)") as record:
        api.attention(q, q, q, precision="ieee")
    assert launched and record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", SimulatorSlowWarning)
        api.attention(q[:, :1, :32], q[:, :1, :32], q[:, :1, :32], precision="ieee")  # seconds: no warning


def test_a_backward_that_takes_minutes_is_announced_before_it_runs(monkeypatch):
    """As the forward's: before the kernels (stubbed out here), at the caller's line, with the
    backward's own estimate; a small backward runs without a word."""
    import numba_flash.backward as backward
    from numba_flash.simulator import SimulatorSlowWarning

    ran = []
    monkeypatch.setattr(backward, "_run_tc", lambda *a, **k: ran.append(1))
    q = np.zeros((1, 4, 1024, 64), np.float16)
    lse = np.zeros((1, 4, 1024), np.float32)
    with pytest.warns(SimulatorSlowWarning, match=r"backward .* about [\d.]+ (minutes|hours)") as record:
        backward.attention_backward(q, q, q, q, q, lse)
    assert ran and record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", SimulatorSlowWarning)
        small = (slice(None), slice(0, 1), slice(0, 16))
        backward.attention_backward(q[small], q[small], q[small], q[small], q[small], lse[small])
    assert len(ran) == 2
