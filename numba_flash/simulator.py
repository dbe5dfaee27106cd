"""Numba's CUDA simulator, made fast enough to wait for; and what a simulated launch costs.

The simulator runs every CUDA thread of a block as a Python thread. Profiling a launch of
the attention kernels (``numba-flash compare --seq 128 --head-dim 64``: ~4 minutes; one
FA-2 call on (1, 1, 128, 64): ~23 s, FA-1 ~80 s) showed where the time goes, and it is not
the kernels' arithmetic:

1. **The block scheduler busy-polls.** ``BlockManager.run`` loops over every thread of the
   block (``is_alive``, ``syncthreads_blocked``) until all are blocked in ``syncthreads`` or
   done, holding the GIL against the threads doing the work: about half the CPU time, and
   each barrier costs milliseconds per thread (a GIL hand-over at every switch interval).
   Smaller blocks do not help: more blocks bring more barriers. Here a block's threads meet
   at a condition-variable barrier instead, and the launching thread just waits for them.
2. **Every device-function call swaps module globals.** Each call of a ``@cuda.jit(device=True)``
   function enters ``swapped_cuda_module`` (a generator context manager, two lock round trips,
   an import, and a scan of the module's globals whenever no other thread is inside the same
   module), so that ``cuda`` means the simulator's module inside it. The kernels call small
   device functions per element (index helpers, row reductions): ~60% of the remaining work.
   Here the swap is made once per module per launch and undone when the launch ends.

Both are replacements of simulator internals, not of kernel code: the kernels run the same
source with the same semantics (a barrier releases when every thread that has not exited has
arrived; an exception in one thread aborts the block and is re-raised; each CUDA thread is a
fresh Python thread, so thread-locals start empty in every block). They apply to numba-cuda
0.30 (``setup.cfg`` pins it), are installed when the simulator is chosen (``_cuda``), and
``NUMBA_FLASH_FAST_SIMULATOR=0`` keeps the stock simulator. Measured on a 2-core machine:
FA-2 (1, 1, 128, 64) 23 s -> 8 s, FA-1 82 s -> 9 s, tensor-core FA-2 (1, 1, 64, 64)
float16 11 s -> 2 s.

Simulator-friendly tiles were measured too, and are not a lever: with numba's scheduler, fewer
threads per block meant more blocks and more barriers (FA-2 on (1, 1, 128, 64): 23 s at the
default 64 x 32 / 128 threads, 62 s at 16 x 16 / 32 threads, 111 s at 4 x 4 / 4 threads); with
the fast paths every tile shape tried from 4 x 64 to 64 x 32 takes 7-14 s (8 x 8: 21 s), the
work of the tile loops themselves. So the defaults stay those tuned on the GPU.

:func:`estimate_seconds` is a cost model of a simulated attention call (shared-memory reads
and multiply-adds of the tile loops, which dominate once the scheduler is fixed), calibrated
on that machine; ``api`` warns (:class:`SimulatorSlowWarning`) before a call it expects to
take over a minute. :func:`estimate_backward_seconds` is the backward's (per tile pair and
multiply-add, per regime), which ``numba-flash compare --backward`` adds to its estimate.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

_ENV = "NUMBA_FLASH_FAST_SIMULATOR"
_SUPPORTED = ("0.30.",)  # numba-cuda versions whose simulator internals this was written against
_installed = False


class SimulatorSlowWarning(UserWarning):
    """A simulated launch is expected to take minutes (there is no GPU)."""


# --------------------------------------------------------------------------------------------
# The block scheduler: a barrier instead of polling
# --------------------------------------------------------------------------------------------


class BlockBarrier:
    """``__syncthreads()`` for the Python threads of one simulated block.

    Releases when every thread that is still running has arrived (a thread that has returned
    no longer counts, as on the GPU); :meth:`abort` wakes everyone with an error so that an
    exception in one thread does not leave the others waiting forever.
    """

    def __init__(self, threads: int):
        self._cv = threading.Condition(threading.Lock())
        self._live = threads
        self._arrived = 0
        self._generation = 0
        self.aborted = False
        self.barriers = 0  # barriers completed (a statistic for tests and the cost model)

    def wait(self) -> None:
        with self._cv:
            if self.aborted:
                raise RuntimeError("abort flag set on syncthreads call")
            generation = self._generation
            self._arrived += 1
            if self._arrived >= self._live:
                self._release()
                return
            while generation == self._generation and not self.aborted:
                self._cv.wait()
            if self.aborted and generation == self._generation:
                raise RuntimeError("abort flag set on syncthreads clear")

    def leave(self) -> None:
        """A thread has finished: the others no longer wait for it."""
        with self._cv:
            self._live -= 1
            if self._live > 0 and self._arrived >= self._live:
                self._release()

    def abort(self) -> None:
        with self._cv:
            self.aborted = True
            self._cv.notify_all()

    def _release(self) -> None:
        self._arrived = 0
        self._generation += 1
        self.barriers += 1
        self._cv.notify_all()


def _run_block(self, grid_point, *args):
    """``BlockManager.run`` without polling: start the block's threads, let them meet at a
    :class:`BlockBarrier`, wait for all of them, re-raise the first error."""
    import numpy as np
    from numba.cuda.simulator.kernel import BlockThread

    points = list(np.ndindex(*self._block_dim))
    barrier = BlockBarrier(len(points))

    def target():
        try:
            self._f(*args)
        except BaseException:
            barrier.abort()
            raise
        finally:
            barrier.leave()

    threads = []
    for block_point in points:
        thread = BlockThread(target, self, grid_point, block_point, self._debug)
        thread.syncthreads = barrier.wait  # syncthreads_count/_and/_or call it too
        threads.append(thread)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [t.exception for t in threads if t.exception]
    if errors:
        first = next((e for e in errors if "abort flag set" not in str(e[0])), errors[0])
        raise first[0].with_traceback(first[1])


# --------------------------------------------------------------------------------------------
# Device-function calls: swap the module's globals once per launch, not once per call
# --------------------------------------------------------------------------------------------

_swapped: dict = {}  # id(module globals) -> (kernel context, entered swapped_cuda_module)
_swap_lock = threading.Lock()


def _make_call(original_call):
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator.kernelapi import swapped_cuda_module

    def __call__(self, *args):
        context = sim_kernel._kernel_context
        if context is not None:  # a device function called from a running kernel
            key = id(self.fn.__globals__)
            entry = _swapped.get(key)
            if entry is None or entry[0] is not context:
                with _swap_lock:
                    entry = _swapped.get(key)
                    if entry is None or entry[0] is not context:
                        manager = swapped_cuda_module(self.fn, context)
                        manager.__enter__()  # numba's own refcounted swap, left entered
                        _swapped[key] = (context, manager)
            return self.fn(*args)
        if self._device:  # a device function called from host code: as numba does it
            return original_call(self, *args)
        try:  # a kernel launch
            return original_call(self, *args)
        finally:  # the launch is over: give every module its real `cuda` back
            with _swap_lock:
                entries = list(_swapped.values())
                _swapped.clear()
            for _, manager in entries:
                manager.__exit__(None, None, None)

    __call__.__numba_flash_fast__ = True
    return __call__


def install() -> bool:
    """Make the simulator fast (see the module docstring). Idempotent; returns whether the
    fast paths are active. Does nothing outside the simulator, on a numba-cuda whose
    internals differ from those it was written against, or with
    ``NUMBA_FLASH_FAST_SIMULATOR=0``."""
    global _installed
    if _installed:
        return True
    if os.environ.get(_ENV, "1") == "0":
        return False
    from numba import config

    if not config.ENABLE_CUDASIM:
        return False
    try:
        from importlib import metadata

        version = metadata.version("numba-cuda")
        from numba.cuda.simulator import kernel as sim_kernel
        from numba.cuda.simulator import kernelapi
    except Exception:  # noqa: BLE001 -- no simulator to speed up
        return False
    needed = (hasattr(sim_kernel, name) for name in ("BlockManager", "BlockThread", "FakeCUDAKernel", "_kernel_context"))
    if not version.startswith(_SUPPORTED) or not all(needed) or not hasattr(kernelapi, "swapped_cuda_module"):
        return False
    sim_kernel.BlockManager.run = _run_block
    sim_kernel.FakeCUDAKernel.__call__ = _make_call(sim_kernel.FakeCUDAKernel.__call__)
    _installed = True
    return True


def fast() -> bool:
    """Are the fast paths installed?"""
    return _installed


# --------------------------------------------------------------------------------------------
# What a simulated attention call costs
# --------------------------------------------------------------------------------------------

# Seconds per unit, fitted to FA-1/FA-2 runs on a 2-core x86 machine (2026-11-30, fast paths
# installed): a shared-memory multiply-add of the score or P~V loops, an element copied from
# global to shared memory, a simulated thread started.
SECONDS_PER_MAC = 3.7e-6
SECONDS_PER_LOAD = 5e-6
SECONDS_PER_THREAD = 1.6e-4
SLOW_FACTOR_STOCK = 3.0  # the stock simulator (no fast paths): ~2-8x slower; a middle figure
TENSOR_CORE_FACTOR = 0.7  # the tensor-core kernels' simulated products (NumPy per fragment)
SLOW_SECONDS = 60.0  # api warns before a simulated call expected to take longer

# The backward (``attention_backward``: kernels.bwd on CUDA cores, kernels.tc_bwd on tensor
# cores), by regime: seconds per visited (Q tile, K/V tile) pair (its barriers, fragment loads and
# atomics) and per multiply-add of its five products (S, dP, dV, dK, dQ), at the simulator's
# backward tiles (8 x 8 on CUDA cores, 16 x 16 on tensor cores). Fitted to FA-1/FA-2 backward runs
# (B1 H1-2 N32-64, D 16 and 64) on the 2-core x86 machine of the forward's constants (2026-12-01,
# fast paths installed) while another process kept it busy, divided by 1.15: the forward's
# slowdown in those runs against its idle timing on that machine (README: compare --seq 128
# --head-dim 64), so that, like the forward's, the figures are an idle machine's (a busy one
# takes longer).
BACKWARD_PRODUCTS = 5
BACKWARD_SECONDS_PER_PAIR = {"ieee": 0.054, "f16": 0.024, "bf16": 0.024, "tf32x3": 0.009}
BACKWARD_SECONDS_PER_MAC = {"ieee": 4.8e-6, "f16": 3.6e-6, "bf16": 3.6e-6, "tf32x3": 1.5e-5}


def warn_if_slow(what: str, seconds: float) -> None:
    """:class:`SimulatorSlowWarning` before a simulated call of ``seconds`` (``what``: the call and
    its shapes) when that is :data:`SLOW_SECONDS` or more, pointed at the first frame outside
    numba_flash (the caller's line)."""
    if seconds < SLOW_SECONDS:
        return
    import sys

    level, frame = 1, sys._getframe(0)  # (level 1: this frame, as warnings counts)
    while frame is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] == "numba_flash":
        frame, level = frame.f_back, level + 1
    warnings.warn(SimulatorSlowWarning(
        f"no GPU: this {what} runs in Numba's CUDA simulator and will take about {format_seconds(seconds)}; "
        "problems of a few dozen rows take seconds there"), stacklevel=level)


def format_seconds(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / 3600:.1f} hours"


def estimate_seconds(algorithm: str, batch: int, heads: int, n_q: int, n_k: int, head_dim: int,
                     block_m: int, block_n: int, causal: bool = False, threads: int | None = None,
                     padded_dim: int | None = None, tensor_cores: bool = False) -> float:
    """Rough wall time of one simulated call (factor-of-two accuracy: it decides whether to warn).

    Work counted: the score and P~V multiply-adds over the padded tiles (halved under the
    causal mask), the K/V tiles each FA-2 block loads (FA-1: the Q, O, l, m round trips per
    K/V tile), and the threads started (one Python thread per CUDA thread per block).
    """
    bh = batch * heads
    dp = padded_dim or head_dim
    q_tiles, kv_tiles = -(-n_q // block_m), -(-n_k // block_n)
    pairs = q_tiles * kv_tiles * (0.5 if causal and q_tiles > 1 else 1.0)
    macs = bh * pairs * block_m * block_n * dp * 2
    if algorithm == "fa1":  # K_j, V_j once; Q_i in and O_i out and back per (K/V tile, Q tile)
        loads = bh * (n_k * dp * 2 + kv_tiles * n_q * dp * 3)
        blocks = bh
    else:  # Q_i once per block, every K_j and V_j per block
        loads = bh * (n_q * dp + q_tiles * n_k * dp * 2)
        blocks = bh * q_tiles
    threads = threads or max(1, block_m // 4) * min(8, block_n)
    seconds = macs * SECONDS_PER_MAC + loads * SECONDS_PER_LOAD + blocks * threads * SECONDS_PER_THREAD
    if tensor_cores:
        seconds *= TENSOR_CORE_FACTOR
    return seconds if fast() else seconds * SLOW_FACTOR_STOCK


def estimate_backward_seconds(regime: str, batch: int, heads: int, n_q: int, n_k: int, head_dim: int,
                              block_m: int, block_n: int, causal: bool = False) -> float:
    """Rough wall time of one simulated ``attention_backward`` call (factor-of-two accuracy, as
    :func:`estimate_seconds`): ``regime`` ``"ieee"`` or a tensor-core kind, ``head_dim`` the
    kernel's (padded), ``block_m`` x ``block_n`` its tiles. Work counted: every (Q tile, K/V
    tile) pair of every query head (halved under the causal mask) at its per-pair cost and its
    five products' multiply-adds."""
    q_tiles, kv_tiles = -(-n_q // block_m), -(-n_k // block_n)
    pairs = batch * heads * q_tiles * kv_tiles * (0.5 if causal and q_tiles > 1 else 1.0)
    per_pair = BACKWARD_SECONDS_PER_PAIR[regime] + BACKWARD_PRODUCTS * block_m * block_n * head_dim * BACKWARD_SECONDS_PER_MAC[regime]
    seconds = pairs * per_pair
    return seconds if fast() else seconds * SLOW_FACTOR_STOCK


@contextlib.contextmanager
def quiet_kernels():
    """In the simulator the kernels run as Python, so NumPy's RuntimeWarnings about their
    documented handling of inf and NaN (``inf - inf`` in a masked or NaN row, which the
    kernels turn into the right result) would reach the user quoting kernel source lines.
    Silenced for the launch only, in the simulator only (on a GPU no Python runs there).
    A warnings filter, not ``np.errstate``: the simulator's threads do not inherit the
    caller's NumPy error state."""
    from numba_flash._world import simulated

    if not simulated():
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
