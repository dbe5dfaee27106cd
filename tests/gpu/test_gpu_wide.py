"""Head dims above 128 on a real GPU (``pytest -m gpu``; issue 25): every path at D = 256 (and a
padded D = 200 or 160) on shapes the simulator cannot reach, against float64 through PyTorch:
the forward (both loop orders, 16-bit tensor cores, float32 on CUDA cores and in tf32x3), the
backward (its three loop orders on tensor cores, whose K/V kernels split dK_j, dV_j's columns
between two warps per 16 keys; tf32x3; CUDA cores), decode (contiguous and paged, split) and a
packed batch. 16-bit: FlashAttention's rule (at most twice a plain 16-bit implementation's error
against float64); gradients: ``test_gpu_backward``'s bounds."""

from __future__ import annotations

import itertools

import pytest
from helpers import torch_attention

pytestmark = pytest.mark.gpu


def _inputs(shape, dtype, seed=3):
    torch = pytest.importorskip("torch")
    B, H, Hkv, Nq, Nk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    q = torch.randn(B, H, Nq, D, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", generator=gen).to(dt) for _ in range(2))
    return q, k, v


def _fa_rule(o, q, k, v, causal):
    """(error, allowed): the error against float64 and twice a plain implementation's in o's dtype
    (float32: 1e-5 of the largest output)."""
    ref = torch_attention(*(x.double() for x in (q, k, v)), causal)
    err = float((o.double() - ref).abs().max())
    if o.dtype.itemsize == 4:
        return err, 1e-5 * float(ref.abs().max())
    plain = torch_attention(q, k, v, causal)  # a plain implementation in the inputs' dtype (FA's upcast=False)
    return err, 2 * float((plain.double() - ref).abs().max()) + 1e-6


@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
@pytest.mark.parametrize("dtype, precision, head_dim", [("float16", None, 256), ("bfloat16", None, 256),
                                                        ("float16", None, 200), ("float32", None, 256),
                                                        ("float32", "tf32x3", 256)])
def test_forward(algorithm, dtype, precision, head_dim):
    import numba_flash

    q, k, v = _inputs((2, 4, 2, 333, 517, head_dim), dtype)
    for causal in (True, False):
        o = numba_flash.attention(q, k, v, causal=causal, algorithm=algorithm, precision=precision)
        err, allowed = _fa_rule(o, q, k, v, causal)
        assert err <= allowed, (causal, err, allowed)


@pytest.mark.parametrize("variant", [("fa2", False), ("fa2", True), ("fa1", False)])
@pytest.mark.parametrize("dtype, precision, head_dim", [("float16", None, 256), ("bfloat16", None, 200),
                                                        ("float32", None, 256), ("float32", "ieee", 160)])
def test_backward(variant, dtype, precision, head_dim):
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import gradients

    algorithm, deterministic = variant
    q, k, v = _inputs((1, 4, 2, 301, 517, head_dim), dtype)
    o, lse = numba_flash.attention(q, k, v, causal=True, return_lse=True)
    do = torch.randn(o.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)).to(q.dtype)
    grads = gradients(do, q, k, v, o, lse, causal=True, algorithm=algorithm, deterministic=deterministic,
                      precision=precision)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    torch_attention(q64, k64, v64, True).backward(do.double())
    tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (q64.grad, k64.grad, v64.grad)):
        assert got.dtype == q.dtype and not torch.isnan(got).any(), name
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert err < tol, (name, err)
    if deterministic or algorithm == "fa1":
        again = gradients(do, q, k, v, o, lse, causal=True, algorithm=algorithm, deterministic=deterministic,
                          precision=precision)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.parametrize("dtype, page_size, splits", [("float16", None, None), ("float16", 16, None),
                                                      ("float16", 64, 1), ("bfloat16", None, 7), ("float32", None, None)])
def test_decode(dtype, page_size, splits):
    torch = pytest.importorskip("torch")
    import numba_flash

    B, H, Hkv, N, D = 4, 8, 2, 3000, 256
    gen = torch.Generator(device="cuda").manual_seed(9)
    dt = getattr(torch, dtype)
    q = torch.randn(B, H, 1, D, device="cuda", generator=gen).to(dt)
    k_cache, v_cache = (torch.randn(B, Hkv, N, D, device="cuda", generator=gen).to(dt) for _ in range(2))
    lengths = torch.tensor([3000, 1, 1777, 0], dtype=torch.int32, device="cuda")
    if page_size is None:
        o = numba_flash.decode(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=splits)
    else:  # FlashAttention's paged layout, pages in a random order
        per_seq = -(-N // page_size)
        table = torch.randperm(B * per_seq, device="cuda", generator=gen).to(torch.int32).reshape(B, per_seq)
        pages = [torch.zeros(B * per_seq, page_size, Hkv, D, device="cuda", dtype=dt) for _ in range(2)]
        for cache, paged in zip((k_cache, v_cache), pages):
            rows = cache.permute(0, 2, 1, 3)  # (B, N, Hkv, D)
            padded = torch.zeros(B, per_seq * page_size, Hkv, D, device="cuda", dtype=dt)
            padded[:, :N] = rows
            paged[table.reshape(-1).long()] = padded.reshape(B * per_seq, page_size, Hkv, D)
        o = numba_flash.decode(q, pages[0], pages[1], cache_seqlens=lengths, block_table=table, num_splits=splits)
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            assert torch.all(o[b] == 0)
            continue
        sub = (q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n])
        err, allowed = _fa_rule(o[b:b + 1], *sub, False)
        assert err <= allowed, (b, err, allowed)


def test_packed_batch():
    torch = pytest.importorskip("torch")
    import numba_flash

    lengths = [300, 0, 1, 129, 700]
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    total, D = int(cu[-1]), 256
    gen = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(total, 4, D, device="cuda", generator=gen).half()
    k, v = (torch.randn(total, 2, D, device="cuda", generator=gen).half() for _ in range(2))
    o, lse = numba_flash.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, return_lse=True)
    do = torch.randn(o.shape, device="cuda", generator=gen).half()
    dq, dk, dv = numba_flash.attention_backward_varlen(do, q, k, v, o, lse, cu, cu, max(lengths), max(lengths),
                                                       causal=True)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        r = slice(int(cu[b]), int(cu[b + 1]))
        qb, kb, vb = (x[r].transpose(0, 1)[None] for x in (q, k, v))
        err, allowed = _fa_rule(o[r].transpose(0, 1)[None], qb, kb, vb, True)
        assert err <= allowed, (b, err, allowed)
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (qb, kb, vb))
        torch_attention(q64, k64, v64, True).backward(do[r].transpose(0, 1)[None].double())
        for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), (q64.grad, k64.grad, v64.grad)):
            got = got[r].transpose(0, 1)[None]
            scale = max(float(ref.abs().max()), 1e-3)
            assert float((got.double() - ref).abs().max()) / scale < 2e-2, (b, name)


@pytest.mark.parametrize("dims", [(192, 128), (64, 256)])
def test_value_head_dim_of_its_own(dims):
    """``v`` with its own head dim (``numba_flash.value_dim``): DeepSeek's 192/128 and a wider v,
    through ``numba_flash.torch.attention`` and autograd (the padding is torch's own ops)."""
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft

    D, Dv = dims
    gen = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(2, 4, 300, D, device="cuda", generator=gen).half().requires_grad_()
    k = torch.randn(2, 2, 517, D, device="cuda", generator=gen).half().requires_grad_()
    v = torch.randn(2, 2, 517, Dv, device="cuda", generator=gen).half().requires_grad_()
    o = nft.attention(q, k, v, causal=True)
    assert o.shape == (2, 4, 300, Dv)
    err, allowed = _fa_rule(o.detach(), q.detach(), k.detach(), v.detach(), True)
    assert err <= allowed, (err, allowed)
    do = torch.randn(o.shape, device="cuda", generator=gen).half()
    grads = torch.autograd.grad(o, (q, k, v), do)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    torch_attention(q64, k64, v64, True).backward(do.double())
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (q64.grad, k64.grad, v64.grad)):
        assert got.shape == ref.shape, name
        assert float((got.double() - ref).abs().max() / ref.abs().max()) < 2e-2, name
