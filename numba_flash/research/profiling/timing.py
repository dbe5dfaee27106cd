"""Timing on the GPU: CUDA events around each call, after warm-up, median of many runs
(calls queued back to back by default, as Triton's ``do_bench``; :func:`median_ms`).

Compilation never lands in a measurement: the warm-up calls compile. FLOPs follow the
FlashAttention convention: 4 * B * H * Nq * Nk * D for the forward pass, halved for
causal (two matmuls of 2 * Nq * Nk * D each).
"""

from __future__ import annotations

import statistics


def attention_flops(batch: int, heads: int, n_q: int, n_k: int, head_dim: int, causal: bool) -> float:
    """Forward-pass FLOPs by the FlashAttention/Triton benchmark convention."""
    flops = 4.0 * batch * heads * n_q * n_k * head_dim
    return flops / 2 if causal else flops


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def median_ms(fn, *, warmup: int = 3, repeats: int = 20, back_to_back: bool = True) -> float:
    """Median milliseconds of ``fn()`` on the current CuPy stream, timed by CUDA events.

    ``back_to_back`` (default): the timed calls are queued one after another, an event pair
    around each and one synchronisation at the end, as Triton's ``do_bench`` does. A call's
    host work (Python, argument packing) then overlaps the previous call's kernel, so the
    figure is the GPU's time -- unless the host cannot keep up, and then the host's time shows
    in it: it is the throughput of a loop of calls. ``back_to_back=False``: synchronise after
    every call, so each timed interval also holds the host work of an isolated call (its
    latency). Peers are timed by the same function in the same mode.
    """
    import cupy

    for _ in range(warmup):
        fn()
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
    if back_to_back:
        fn()  # untimed: the first timed call finds the queue busy, as every later one does
    for start, stop in events:
        start.record(stream)
        fn()
        stop.record(stream)
        if not back_to_back:
            stop.synchronize()
    stream.synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(start, stop) for start, stop in events)
