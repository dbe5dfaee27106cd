"""Realistic shapes on a real GPU (``pytest -m gpu``; skipped in the simulator).

float32 is judged by relative error against a float64 reference computed on the device;
float16 by FlashAttention's rule: error against float64 at most twice that of a plain
float16 implementation (cuBLAS float16 matmuls, float16 softmax).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

SHAPES = [  # (B, H, Hkv, Nq, Nk, D)
    (1, 4, 4, 8192, 8192, 64),
    (2, 4, 2, 4096, 4096, 128),
    (2, 8, 1, 2048, 2048, 32),
    (1, 4, 4, 1000, 3001, 64),
    (1, 2, 2, 3001, 1000, 40),
]


def _cupy():
    import cupy

    return cupy


def _reference64(q, k, v, causal):
    from numba_flash.baselines import cupy_attention

    cp = _cupy()
    return cupy_attention(*(x.astype(cp.float64) for x in (q, k, v)), causal=causal)


def _plain_fp16(q, k, v, causal):
    cp = _cupy()
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    g = H // k.shape[1]
    k, v = cp.repeat(k, g, axis=1), cp.repeat(v, g, axis=1)
    s = cp.matmul(q, k.swapaxes(-1, -2)) * cp.float16(1 / math.sqrt(D))
    if causal:
        i, j = cp.arange(Nq)[:, None], cp.arange(Nk)[None, :]
        s = cp.where(j <= i + (Nk - Nq), s, cp.float16(-cp.inf))
    m = s.max(axis=-1, keepdims=True)
    p = cp.exp(s - cp.where(cp.isfinite(m), m, 0)).astype(cp.float16)
    l = p.sum(axis=-1, keepdims=True, dtype=cp.float32)
    p = (p / cp.where(l > 0, l, 1).astype(cp.float16)).astype(cp.float16)  # masked rows: 0
    return cp.matmul(p, v)


def _random(shape_qkv, dtype, seed):
    cp = _cupy()
    B, H, Hkv, Nq, Nk, D = shape_qkv
    rs = cp.random.default_rng(seed)
    return tuple(
        rs.standard_normal(s, dtype=cp.float32).astype(dtype)
        for s in ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D))
    )


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize(
    "dtype, precision",
    # the defaults (float32: CUDA cores, float16: tensor cores), then the other regime of each
    [("float32", None), ("float16", None), ("float32", "tf32x3"), ("float16", "ieee")],
    ids=["float32", "float16-tc", "float32-tf32x3", "float16-ieee"],
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}/{}Nq{}Nk{}D{}".format(*s))
def test_large_shapes(shape, causal, dtype, precision, algorithm):
    cp = _cupy()
    from numba_flash.api import forward

    if algorithm == "fa1" and shape[3] * shape[4] > 4096 * 4096:
        pytest.skip("FA-1 at N=8192 is covered by the compare run (one block per head: slow)")
    q, k, v = _random(shape, dtype, seed=hash((shape, causal, dtype)) % 2**31)
    B, H, Nq, D = q.shape
    o = cp.full((B, H, Nq, D), cp.nan, dtype=dtype)
    lse = cp.full((B, H, Nq), cp.nan, dtype=cp.float32)
    forward(q, k, v, causal=causal, algorithm=algorithm, out=o, lse_out=lse, precision=precision)
    ref = _reference64(q, k, v, causal)
    assert not cp.isnan(o).any(), "unwritten or NaN output"
    err = float(cp.abs(o.astype(cp.float64) - ref).max())
    if dtype == "float16":
        base = float(cp.abs(_plain_fp16(q, k, v, causal).astype(cp.float64) - ref).max())
        assert err <= 2 * base, f"float16 error {err:.3g} > 2 x plain float16 error {base:.3g}"
    else:
        rel = float(cp.linalg.norm(o.astype(cp.float64) - ref) / cp.linalg.norm(ref))
        assert rel < 1e-5, rel
    # the logsumexp, on one head (the full float64 S of every head is large)
    s = cp.matmul(q[0, 0].astype(cp.float64), k[0, 0].astype(cp.float64).T) / math.sqrt(D)
    if causal:
        i, j = cp.arange(Nq)[:, None], cp.arange(k.shape[2])[None, :]
        s = cp.where(j <= i + (k.shape[2] - Nq), s, -cp.inf)
    m = s.max(axis=1)
    ref_lse = m + cp.log(cp.exp(s - cp.where(cp.isfinite(m), m, 0)[:, None]).sum(axis=1))
    got = lse[0, 0].astype(cp.float64)
    assert bool((cp.isneginf(got) == cp.isneginf(ref_lse)).all())
    fin = cp.isfinite(ref_lse)
    assert float(cp.abs(got[fin] - ref_lse[fin]).max()) < 1e-3


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
def test_deterministic_on_gpu(algorithm):
    cp = _cupy()
    from numba_flash import attention

    q, k, v = _random((2, 4, 2, 2048, 2048, 64), "float32", seed=1)
    a = attention(q, k, v, causal=True, algorithm=algorithm)
    b = attention(q, k, v, causal=True, algorithm=algorithm)
    assert bool((a == b).all())


def test_agrees_with_torch_sdpa():
    torch = pytest.importorskip("torch")
    from numba_flash import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 2048, 64, device="cuda", generator=g) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    for algorithm in ("fa1", "fa2"):
        o = attention(q, k, v, causal=True, algorithm=algorithm)
        assert isinstance(o, torch.Tensor) and o.device == q.device and o.dtype == q.dtype
        rel = ((o.double() - ref).norm() / ref.norm()).item()
        assert rel < 1e-5, (algorithm, rel)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(attention(q, k, v, causal=True), sdpa, atol=2e-3)


def test_torch_strided_view_and_gqa():
    torch = pytest.importorskip("torch")
    from numba_flash import attention

    buf_q = torch.randn(1, 1024, 8, 64, device="cuda")  # (B, N, H, D)
    buf_kv = torch.randn(2, 1, 1024, 2, 64, device="cuda")
    q = buf_q.transpose(1, 2)
    k, v = (buf_kv[i].transpose(1, 2) for i in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    o = attention(q, k, v)
    assert ((o.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_numpy_in_numpy_out_on_gpu():
    from numba_flash import attention, reference

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 300, 64)).astype(np.float32) for _ in range(3))
    o, lse = attention(q, k, v, return_lse=True)
    assert isinstance(o, np.ndarray) and isinstance(lse, np.ndarray)
    ref_o, ref_lse = reference.attention(q, k, v)
    assert np.linalg.norm(o - ref_o) / np.linalg.norm(ref_o) < 1e-5
    assert np.allclose(lse, ref_lse, atol=1e-4)


def test_runs_on_the_current_cupy_stream():
    cp = _cupy()
    from numba_flash import attention

    q, k, v = _random((1, 4, 4, 2048, 2048, 64), "float32", seed=2)
    ref = attention(q, k, v)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        o = attention(q, k, v)
        o2 = o * 1  # queued behind the kernel on the same stream
    stream.synchronize()
    assert bool((o2 == ref).all())


def test_kv_order_on_gpu():
    cp = _cupy()
    from numba_flash.api import forward

    q, k, v = _random((1, 2, 2, 1024, 1000, 64), "float32", seed=3)
    n_tiles = -(-1000 // 32)
    order = np.random.default_rng(0).permutation(n_tiles)
    for algorithm in ("fa1", "fa2"):
        a, _ = forward(q, k, v, algorithm=algorithm, block_n=32, causal=True)
        b, _ = forward(q, k, v, algorithm=algorithm, block_n=32, causal=True, kv_tile_order=order)
        assert float(cp.abs(a - b).max()) < 1e-5


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("strided", [False, True])
def test_direct_launch_matches_numba_dispatch(algorithm, strided, monkeypatch):
    """The direct launcher (``numba_flash.launch``) packs numba's kernel ABI itself: its
    results must be bitwise those of numba's own launch of the same kernel (contiguous
    inputs: layout C; strided: layout A)."""
    cp = _cupy()
    from numba_flash import plans
    from numba_flash.api import forward
    from numba_flash.arrays import ArrayContext

    q, k, v = _random((2, 4, 2, 777, 1031, 64), "float32", seed=4)
    if strided:  # (B, N, H, D) buffers seen as (B, H, N, D)
        q, k, v = (cp.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v))
        assert not q.flags.c_contiguous
    o1, l1 = forward(q, k, v, causal=True, algorithm=algorithm)
    monkeypatch.setattr(ArrayContext, "direct_launch", property(lambda self: False))
    plans.clear()  # the first call's plan launches directly
    o2, l2 = forward(q, k, v, causal=True, algorithm=algorithm)
    assert bool((o1 == o2).all()) and bool((l1 == l2).all())
    ref = _reference64(q, k, v, True)
    assert float(cp.linalg.norm(o1.astype(cp.float64) - ref) / cp.linalg.norm(ref)) < 1e-5


def test_cuda_array_interface_objects_come_back_as_cupy():
    cp = _cupy()
    from numba_flash import attention

    class Bare:  # nothing but the interface: no shape, no dtype attributes
        def __init__(self, x):
            self.__cuda_array_interface__ = x.__cuda_array_interface__
            self.keep = x

    q, k, v = _random((1, 2, 2, 300, 300, 64), "float32", seed=6)
    o = attention(Bare(q), Bare(k), Bare(v))
    assert isinstance(o, cp.ndarray) and bool((o == attention(q, k, v)).all())


# (head_dim, block_m, block_n): blocks smaller than a warp, one key per tile, padded head
# dims (24 -> 32, 100 -> 128), one row per thread, the D = 128 default, wide K/V tiles.
LAYOUTS = [(24, 1, 1), (64, 2, 4), (100, 8, 2), (128, 16, 16), (32, 32, 64), (24, 128, 8)]


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("head_dim, block_m, block_n", LAYOUTS, ids=lambda t: str(t))
def test_every_tile_layout_on_gpu(head_dim, block_m, block_n, algorithm):
    """Non-default tiles change the thread layout (rows per thread, threads per row, blocks
    smaller than a warp, padded head dims): each must still be exact on the GPU. Causal,
    Nq < Nk: unmasked, diagonal and tail tiles all occur."""
    cp = _cupy()
    from numba_flash.api import forward

    q, k, v = _random((1, 4, 2, 203, 301, head_dim), "float32", seed=5)
    o = cp.full(q.shape, cp.nan, dtype=cp.float32)
    forward(q, k, v, causal=True, algorithm=algorithm, block_m=block_m, block_n=block_n, out=o)
    ref = _reference64(q, k, v, True)
    rel = float(cp.linalg.norm(o.astype(cp.float64) - ref) / cp.linalg.norm(ref))
    assert rel < 1e-5, rel


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tiles", [(128, 32), (128, 64), (256, 32), (64, 64)], ids=lambda t: "{}x{}".format(*t))
def test_cuda_core_tiles_in_dynamic_shared_memory(tiles, causal, algorithm):
    """Tiles above 48 KiB (the kernel opted in to dynamic shared memory), twice: the first call
    launches directly, the second may go through the call's plan (``numba_flash.plans``)."""
    cp = _cupy()
    from numba_flash import attention

    q, k, v = _random((1, 4, 2, 3001, 2999, 64), "float32", seed=7)
    ref = _reference64(q, k, v, causal)
    for _ in range(2):
        o = attention(q, k, v, causal=causal, algorithm=algorithm, block_m=tiles[0], block_n=tiles[1])
        rel = float(cp.linalg.norm(o.astype(cp.float64) - ref) / cp.linalg.norm(ref))
        assert rel < 1e-5, rel


EIGHT_ROWS_CHILD = """
import cupy as cp
from numba_flash import attention
from numba_flash.baselines import cupy_attention
from numba_flash.specs import kernel_spec
rs = cp.random.default_rng(3)
q, k, v = (rs.standard_normal((1, 4, 3001, 64), dtype=cp.float32) for _ in range(3))
for algorithm in ("fa1", "fa2"):
    for bm, bn in ((64, 32), (128, 32), (128, 64)):
        assert kernel_spec(algorithm, 64, "float32", bm, bn, True).rows_per_thread == 8
        for causal in (False, True):
            ref = cupy_attention(*(x.astype(cp.float64) for x in (q, k, v)), causal=causal)
            o = attention(q, k, v, causal=causal, algorithm=algorithm, block_m=bm, block_n=bn)
            rel = float(cp.linalg.norm(o.astype(cp.float64) - ref) / cp.linalg.norm(ref))
            assert rel < 1e-5, (algorithm, bm, bn, causal, rel)
print("ok")
"""


@pytest.mark.parametrize("maxreg", ["", "168"], ids=["uncapped", "cap168"])
def test_eight_rows_per_thread_on_gpu(maxreg):
    """NUMBA_FLASH_FFMA_ROWS_PER_THREAD=8 (read once per process: a child process)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_FLASH_FFMA_ROWS_PER_THREAD="8", NUMBA_FLASH_FFMA_MAXREG=maxreg)
    done = subprocess.run([sys.executable, "-c", EIGHT_ROWS_CHILD], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
