"""``numba_flash.attention_backward`` on a real GPU (``pytest -m gpu``; skipped in the simulator):
larger shapes than the simulator reaches, every loop order, both regimes (float16 and bfloat16 on
tensor cores by default, and on CUDA cores through ``gradients(precision="ieee")``), against
float64 autograd through a PyTorch implementation of attention (GQA by repetition, bottom-right
causal)."""

from __future__ import annotations


import pytest
from helpers import torch_attention

pytestmark = pytest.mark.gpu


def _grads64(do, q, k, v, causal):
    pytest.importorskip("torch")
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    torch_attention(q, k, v, causal).backward(do.double())
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("variant", [("fa2", False), ("fa2", True), ("fa1", False)])
@pytest.mark.parametrize("dtype, precision", [("float32", "ieee"), ("float16", None), ("bfloat16", None),
                                              ("float16", "ieee"), ("bfloat16", "ieee")])
# D = 64: 64 x 64 tiles (128 threads); D = 128: 32 x 32 (64 threads, dQ in two halves, copies in
# two passes); D = 40 and 100: padded head dims (40 -> 64, 100 -> 128); Nq > Nk causal: rows
# that see no key.
@pytest.mark.parametrize("shape, causal", [((2, 4, 2, 700, 900, 64), True), ((1, 2, 2, 513, 257, 128), False),
                                           ((1, 4, 2, 301, 517, 40), True), ((1, 4, 1, 333, 130, 100), True)])
def test_backward_large(variant, dtype, precision, shape, causal):
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import gradients

    algorithm, deterministic = variant
    B, H, Hkv, Nq, Nk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(11)
    dt = getattr(torch, dtype)
    q = torch.randn(B, H, Nq, D, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", generator=gen).to(dt) for _ in range(2))
    o, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True, precision="ieee")
    do = torch.randn(o.shape, device="cuda", generator=gen).to(dt)
    def run():
        return gradients(do, q, k, v, o, lse, causal=causal, algorithm=algorithm, deterministic=deterministic,
                         precision=precision)

    grads = run()
    refs = _grads64(do, q, k, v, causal)
    tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert got.dtype == dt and not torch.isnan(got).any(), name
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert err < tol, (name, err)
    if deterministic or algorithm == "fa1":
        again = run()
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


# The tensor-core backward at other tiles than the default 64 x 128 (block_m queries x block_n
# keys): 64 x 64 (4 warps), 32 x 32 (2 warps), 128 x 64 (dQ: two 16-query groups per warp),
# 16 x 64 (dQ: four warps split a group's columns), D = 64 and 128, causal Nq != Nk, GQA.
@pytest.mark.parametrize("tiles", [(64, 64), (32, 32), (128, 64), (16, 64)])
@pytest.mark.parametrize("variant", [("fa2", False), ("fa2", True), ("fa1", False)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tensor_core_backward_tiles(tiles, variant, head_dim):
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import gradients
    from numba_flash.arch import SMEM_OPTIN_LIMIT
    from numba_flash.kernels.tc_bwd import tc_bwd_layout

    algorithm, deterministic = variant
    if tc_bwd_layout(algorithm, "f16", head_dim, *tiles).smem_bytes > SMEM_OPTIN_LIMIT:
        pytest.skip(f"{tiles} at D={head_dim}: {algorithm}'s tiles exceed a block's shared memory")
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, 4, 333, head_dim, device="cuda", generator=gen).half()
    k, v = (torch.randn(1, 2, 401, head_dim, device="cuda", generator=gen).half() for _ in range(2))
    o, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True, precision="ieee")
    do = torch.randn(o.shape, device="cuda", generator=gen).half()
    grads = gradients(do, q, k, v, o, lse, causal=True, algorithm=algorithm, deterministic=deterministic, tiles=tiles)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, _grads64(do, q, k, v, True)):
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert err < 2e-2, (name, tiles, err)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_tensor_core_backward_registers_and_no_local_memory(head_dim, tmp_path, monkeypatch):
    """The default tiles' kernels as the device's JIT compiled them: no local memory (offline
    ptxas 13.5 for sm_90 found none, docs/performance-log.md), and the blocks per SM the
    prediction assumes (one block of 8 warps for the K/V kernels)."""
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import attention_backward
    from numba_flash.backward import cuda_device_capability
    from numba_flash.kernels.tc_bwd import (
        dq_kernel_tiles, tc_bwd_dq_kernel, tc_bwd_kernel, tc_bwd_layout, vector_reductions,
    )
    from numba_flash.research.profiling.resources import compiled_resources
    from numba_flash.tile_table import backward_tc_tiles

    from numba_flash import compile_cache, launch

    # numba compiles them here (an empty compilation cache, nothing loaded before in this process):
    # a kernel loaded from the cache has no overload in its dispatcher to read the resources of.
    monkeypatch.setenv(compile_cache.CACHE_DIR_VAR, str(tmp_path))
    monkeypatch.setattr(launch, "_KERNELS", {})
    q, k, v = (torch.randn(1, 2, 300, head_dim, device="cuda").half() for _ in range(3))
    o, lse = numba_flash.attention(q, k, v, return_lse=True)
    do = torch.randn_like(o)
    for deterministic in (False, True):
        attention_backward(do, q, k, v, o, lse, deterministic=deterministic)
    attention_backward(do, q, k, v, o, lse, algorithm="fa1")
    torch.cuda.synchronize()
    bm, bn = backward_tc_tiles(head_dim)
    dm, dn = dq_kernel_tiles(bm, bn)
    red = vector_reductions(cuda_device_capability())  # (the memoised kernels: the arguments the backward passes)
    # Local bytes allowed: none, except FA-1 (a few bytes at some tiles offline; its grid is B x Hkv
    # anyway) and, at D = 128, the deterministic pair: the K/V kernel without dQ atomics (40 bytes)
    # and the dQ kernel (8 bytes), both at the 255-register cap as the H200's JIT compiles them
    # (driver ptxas, 2026-12-01; offline ptxas 13.5 found none).
    for kernel, layout, local_allowed in (
            (tc_bwd_kernel("fa2", "f16", head_dim, bm, bn, False, True, red), tc_bwd_layout("fa2", "f16", head_dim, bm, bn), 0),
            (tc_bwd_kernel("fa2", "f16", head_dim, bm, bn, False, False, red), tc_bwd_layout("fa2", "f16", head_dim, bm, bn),
             40 if head_dim == 128 else 0),
            (tc_bwd_kernel("fa1", "f16", head_dim, bm, bn, False, True, red), tc_bwd_layout("fa1", "f16", head_dim, bm, bn), None),
            (tc_bwd_dq_kernel("f16", head_dim, dm, dn, False), tc_bwd_layout("dq", "f16", head_dim, dm, dn),
             8 if head_dim == 128 else 0)):
        res = compiled_resources(kernel, layout.threads, layout.smem_bytes)
        print(layout.kernel, head_dim, res.as_dict())
        assert res.blocks_per_sm >= 1
        if local_allowed is not None:
            assert res.local_bytes <= local_allowed, (layout.kernel, res.as_dict())


# The float32 backward on split-precision tensor cores (kernels.tc_bwd kind "tf32x3", reached by
# gradients(precision="tf32x3"), and by attention_backward for float32 while
# backward.TF32X3_BACKWARD is on, the default). Written before a GPU had run it: the float32 bound (1e-4
# relative to float64) is the one the CUDA-core float32 backward meets; the long rows (N = 4096)
# check that the TF32 accumulation's truncation does not build up over many Q tiles (dK, dV) or
# K/V tiles (dQ): each tile's product is summed from zero and added in float32.
@pytest.mark.parametrize("variant", [("fa2", False), ("fa2", True), ("fa1", False)])
@pytest.mark.parametrize("shape, causal", [((2, 4, 2, 700, 900, 64), True), ((1, 2, 2, 513, 257, 128), False),
                                           ((1, 4, 2, 301, 517, 40), True), ((1, 4, 1, 333, 130, 100), True),
                                           ((1, 2, 1, 4096, 4096, 128), False), ((1, 2, 2, 4096, 4096, 64), True)])
def test_tf32x3_backward(variant, shape, causal):
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import gradients

    algorithm, deterministic = variant
    B, H, Hkv, Nq, Nk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(13)
    q = torch.randn(B, H, Nq, D, device="cuda", generator=gen)
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", generator=gen) for _ in range(2))
    o, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True, precision="ieee")
    do = torch.randn(o.shape, device="cuda", generator=gen)

    def run():
        return gradients(do, q, k, v, o, lse, causal=causal, algorithm=algorithm, deterministic=deterministic,
                         precision="tf32x3")

    grads = run()
    for name, got, ref in zip(("dq", "dk", "dv"), grads, _grads64(do, q, k, v, causal)):
        assert got.dtype == torch.float32 and not torch.isnan(got).any(), name
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-4, (name, err)
    if deterministic or algorithm == "fa1":
        again = run()
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.parametrize("tiles", [(16, 128), (32, 64), (32, 32), (64, 64)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tf32x3_backward_tiles(tiles, head_dim):
    """Other tiles than tile_table.TC_BACKWARD_TILES' (the sweep of the next GPU session), every order."""
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import gradients
    from numba_flash.arch import SMEM_OPTIN_LIMIT
    from numba_flash.kernels.tc_bwd import tc_bwd_layout

    gen = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(1, 4, 333, head_dim, device="cuda", generator=gen)
    k, v = (torch.randn(1, 2, 401, head_dim, device="cuda", generator=gen) for _ in range(2))
    o, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True, precision="ieee")
    do = torch.randn(o.shape, device="cuda", generator=gen)
    refs = _grads64(do, q, k, v, True)
    for algorithm, deterministic in (("fa2", False), ("fa2", True), ("fa1", False)):
        if tc_bwd_layout(algorithm, "tf32x3", head_dim, *tiles).smem_bytes > SMEM_OPTIN_LIMIT:
            continue
        grads = gradients(do, q, k, v, o, lse, causal=True, algorithm=algorithm, deterministic=deterministic,
                          precision="tf32x3", tiles=tiles)
        for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
            err = float((got.double() - ref).abs().max() / ref.abs().max())
            assert err < 1e-4, (name, tiles, algorithm, err)


def test_tf32x3_backward_switch_and_resources():
    """TF32X3_BACKWARD routes attention_backward's float32 to tf32x3; the resources of the
    default tiles' kernels as the device's JIT compiled them (printed: offline ptxas found a few
    bytes of spills, docs/performance-log.md "Backward in tf32x3")."""
    torch = pytest.importorskip("torch")
    from unittest import mock

    import numba_flash
    from numba_flash import backward
    from numba_flash.kernels.tc_bwd import tc_bwd_kernel, tc_bwd_layout
    from numba_flash.research.profiling.resources import compiled_resources
    from numba_flash.tile_table import backward_tc_tiles

    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda") for _ in range(3))
    o, lse = numba_flash.attention(q, k, v, return_lse=True)
    do = torch.randn_like(o)
    with mock.patch.object(backward, "TF32X3_BACKWARD", True):
        tc = backward.attention_backward(do, q, k, v, o, lse)
    ieee = backward.attention_backward(do, q, k, v, o, lse)
    for a, b in zip(tc, ieee):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-4
    torch.cuda.synchronize()
    for d in (64, 128):
        bm, bn = backward_tc_tiles(d, "tf32x3")
        for order, dq in (("fa2", True), ("fa2", False), ("fa1", True)):
            kernel = tc_bwd_kernel(order, "tf32x3", d, bm, bn, False, dq, True)  # attention_backward's key on sm_90
            if not kernel.overloads:
                continue
            layout = tc_bwd_layout(order, "tf32x3", d, bm, bn)
            res = compiled_resources(kernel, layout.threads, layout.smem_bytes)
            print(order, dq, d, (bm, bn), res.as_dict())
            assert res.blocks_per_sm >= 1
