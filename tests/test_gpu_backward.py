"""``numba_flash.attention_backward`` on a real GPU (``pytest -m gpu``; skipped in the simulator):
larger shapes than the simulator reaches, every loop order, against float64 autograd through a
PyTorch implementation of attention (GQA by repetition, bottom-right causal)."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu


def _grads64(do, q, k, v, causal):
    torch = pytest.importorskip("torch")
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        Nq, Nk = q.shape[2], k.shape[2]
        i = torch.arange(Nq, device=q.device)[:, None]
        j = torch.arange(Nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Nk - Nq), -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    (p @ vv).backward(do.double())
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("variant", [("fa2", False), ("fa2", True), ("fa1", False)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
# D = 64: 64 x 64 tiles (128 threads); D = 128: 32 x 32 (64 threads, dQ in two halves, copies in
# two passes); D = 40 and 100: padded head dims (40 -> 64, 100 -> 128); Nq > Nk causal: rows
# that see no key.
@pytest.mark.parametrize("shape, causal", [((2, 4, 2, 700, 900, 64), True), ((1, 2, 2, 513, 257, 128), False),
                                           ((1, 4, 2, 301, 517, 40), True), ((1, 4, 1, 333, 130, 100), True)])
def test_backward_large(variant, dtype, shape, causal):
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import attention_backward

    algorithm, deterministic = variant
    B, H, Hkv, Nq, Nk, D = shape
    gen = torch.Generator(device="cuda").manual_seed(11)
    dt = getattr(torch, dtype)
    q = torch.randn(B, H, Nq, D, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", generator=gen).to(dt) for _ in range(2))
    o, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True, precision="ieee")
    do = torch.randn(o.shape, device="cuda", generator=gen).to(dt)
    grads = attention_backward(do, q, k, v, o, lse, causal=causal, algorithm=algorithm, deterministic=deterministic)
    refs = _grads64(do, q, k, v, causal)
    tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert got.dtype == dt and not torch.isnan(got).any(), name
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert err < tol, (name, err)
    if deterministic or algorithm == "fa1":
        again = attention_backward(do, q, k, v, o, lse, causal=causal, algorithm=algorithm, deterministic=deterministic)
        assert all(torch.equal(a, b) for a, b in zip(grads, again))
