"""Timing on the GPU: CUDA events around the call, after warm-up, median of many runs.

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


def median_ms(fn, *, warmup: int = 3, repeats: int = 20) -> float:
    """Median milliseconds of ``fn()`` on the current CuPy stream, timed by CUDA events."""
    import cupy

    for _ in range(warmup):
        fn()
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)
