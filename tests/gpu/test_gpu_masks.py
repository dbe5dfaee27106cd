"""Sliding windows, softcap and ALiBi on a real GPU (``pytest -m gpu``; skipped in the simulator): the
forward in both loop orders and both regimes, split-KV, decode and the backward, at shapes whose
windows hide whole K/V tiles on both sides of every Q tile, against float64 torch with the same
mask and cap (FlashAttention's 2x rule for 16-bit forwards, ``test_gpu_backward``'s bounds for
gradients)."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu

WINDOWS = [((256, 0), False), ((100, 37), False), ((-1, 64), False), ((300, -1), True)]


def _visible(n_q, n_k, window, causal, device):
    import torch

    from numba_flash.masking import window_spec

    spec = window_spec(causal, window)
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return spec.visible(i, j, n_q, n_k)


def _inputs(B, H, Hkv, Nq, Nk, D, dtype, seed):
    """Fresh normal q ``(B, H, Nq, D)``, k, v ``(B, Hkv, Nk, D)`` on the GPU, of ``dtype``, and the
    generator (for what a test draws next)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    q = torch.randn(B, H, Nq, D, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", generator=gen).to(dt) for _ in range(2))
    return q, k, v, gen


def _document_ids(gen, n_k, n_bounds, low, first_end):
    """int32 document ids of ``n_k`` keys: documents end at ``first_end`` and at ``n_bounds``
    random keys drawn in ``[low, n_k)`` (the first document, keys below ``first_end``)."""
    import torch

    bounds = torch.randint(low, n_k, (n_bounds,), device="cuda", generator=gen)
    bounds = torch.sort(torch.cat([bounds, torch.tensor([first_end], device="cuda")])).values
    return torch.searchsorted(bounds, torch.arange(n_k, device="cuda"), right=True).to(torch.int32)


def _attention64(q, k, v, seen, do=None, dtype=None, softcap=0.0, alibi=None):
    """o (and with ``do``, the gradients) in float64 (``dtype``: a plain implementation's type);
    ``alibi``: ``(B, H)`` slopes (the bias -slope |i + Nk - Nq - j|)."""
    import torch

    dt = torch.float64 if dtype is None else dtype
    q, k, v = (x.detach().to(dt).requires_grad_(do is not None) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        n_q, n_k = q.shape[2], k.shape[2]
        i = torch.arange(n_q, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        s = s - alibi.to(dt)[:, :, None, None] * (i + n_k - n_q - j).abs().to(dt)
    s = s.masked_fill(~seen, -math.inf)
    p = torch.softmax(s.float() if dtype is not None else s, dim=-1).nan_to_num(0.0).to(dt)
    o = p @ vv
    if do is None:
        return o
    o.backward(do.to(dt))
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
@pytest.mark.parametrize("dtype, precision", [("float16", None), ("bfloat16", None), ("float32", "ieee"),
                                              ("float32", "tf32x3")])
@pytest.mark.parametrize("window, causal", WINDOWS)
def test_forward_windows(algorithm, dtype, precision, window, causal):
    torch = pytest.importorskip("torch")
    import numba_flash

    B, H, Hkv, Nq, Nk, D = 2, 4, 2, 1000, 1300, 64
    dt = getattr(torch, dtype)
    q, k, v, _ = _inputs(B, H, Hkv, Nq, Nk, D, dtype, 7)
    o, lse = numba_flash.attention(q, k, v, causal=causal, window_size=window, algorithm=algorithm, precision=precision,
                                   return_lse=True)
    seen = _visible(Nq, Nk, window, causal, "cuda")
    ref = _attention64(q, k, v, seen)
    err = float((o.double() - ref).abs().max())
    if dtype == "float32":
        assert err < 1e-5, err
    else:
        base = float((_attention64(q, k, v, seen, dtype=dt).double() - ref).abs().max())
        assert err <= 2 * base + 1e-6, (err, base)
    empty = ~seen.any(dim=1)
    assert torch.isneginf(lse[:, :, empty]).all() and torch.isfinite(lse[:, :, ~empty]).all()


@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
@pytest.mark.parametrize("dtype, precision", [("float16", None), ("float32", "ieee")])
def test_rows_that_see_no_key(algorithm, dtype, precision):
    """Nq > Nk with causal and a window: the first Nq - Nk rows see no key (o = 0, lse = -inf)."""
    torch = pytest.importorskip("torch")
    import numba_flash

    Nq, Nk, window = 1300, 1000, (7, 0)
    gen = torch.Generator(device="cuda").manual_seed(17)
    dt = getattr(torch, dtype)
    q = torch.randn(1, 4, Nq, 64, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(1, 2, Nk, 64, device="cuda", generator=gen).to(dt) for _ in range(2))
    o, lse = numba_flash.attention(q, k, v, causal=True, window_size=window, algorithm=algorithm, precision=precision,
                                   return_lse=True)
    seen = _visible(Nq, Nk, window, True, "cuda")
    empty = ~seen.any(dim=1)
    assert int(empty.sum()) == Nq - Nk
    assert (o[:, :, empty] == 0).all() and torch.isneginf(lse[:, :, empty]).all()
    ref = _attention64(q, k, v, seen)
    assert float((o.double() - ref).abs().max()) < (5e-3 if dtype == "float16" else 1e-5)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_split_kv_and_decode_windows(dtype):
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash import reference

    gen = torch.Generator(device="cuda").manual_seed(3)
    dt = getattr(torch, dtype)
    q = torch.randn(2, 8, 64, 128, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(2, 2, 5000, 128, device="cuda", generator=gen).to(dt) for _ in range(2))
    o = numba_flash.attention(q, k, v, window_size=(700, 0), num_splits=4)
    ref = _attention64(q, k, v, _visible(64, 5000, (700, 0), False, "cuda"))
    assert float((o.double() - ref).abs().max()) < (2e-3 if dtype == "float16" else 1e-5)
    lengths = torch.tensor([5000, 1234], dtype=torch.int32, device="cuda")
    qd = q[:, :, :3]
    od = numba_flash.decode(qd, k, v, cache_seqlens=lengths, causal=True, window_size=(511, -1))
    ref_o, _ = reference.decode(*(x.float().cpu().numpy() for x in (qd, k, v)), cache_seqlens=lengths.cpu().numpy(),
                                causal=True, window_size=(511, -1))
    assert float((od.double().cpu() - torch.as_tensor(ref_o)).abs().max()) < (2e-3 if dtype == "float16" else 1e-5)


@pytest.mark.parametrize("variant", [("fa2", False), ("fa2", True), ("fa1", False)])
@pytest.mark.parametrize("dtype, precision", [("float16", None), ("bfloat16", None), ("float32", "ieee")])
@pytest.mark.parametrize("window, causal", WINDOWS[:2] + WINDOWS[3:])
def test_backward_windows(variant, dtype, precision, window, causal):
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import gradients

    algorithm, deterministic = variant
    B, H, Hkv, Nq, Nk, D = 1, 4, 2, 700, 900, 64
    gen = torch.Generator(device="cuda").manual_seed(5)
    dt = getattr(torch, dtype)
    q = torch.randn(B, H, Nq, D, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", generator=gen).to(dt) for _ in range(2))
    o, lse = numba_flash.attention(q, k, v, causal=causal, window_size=window, return_lse=True, precision="ieee")
    do = torch.randn(o.shape, device="cuda", generator=gen).to(dt)
    grads = gradients(do, q, k, v, o, lse, causal=causal, window_size=window, algorithm=algorithm,
                      deterministic=deterministic, precision=precision)
    refs = _attention64(q, k, v, _visible(Nq, Nk, window, causal, "cuda"), do=do)
    tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert got.dtype == dt and not torch.isnan(got).any(), name
        err = float((got.double() - ref).abs().max() / ref.abs().max())
        assert err < tol, (name, err)


def test_torch_autograd_takes_the_window():
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft

    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (torch.randn(1, 2, 300, 64, device="cuda", generator=gen).half().requires_grad_() for _ in range(3))
    o = nft.attention(q, k, v, window_size=(64, 0))
    o.float().sum().backward()
    seen = _visible(300, 300, (64, 0), False, "cuda")
    refs = _attention64(q, k, v, seen, do=torch.ones_like(o))
    assert float((o.detach().double() - _attention64(q, k, v, seen)).abs().max()) < 5e-3
    for got, ref in zip((q.grad, k.grad, v.grad), refs):
        assert float((got.double() - ref).abs().max() / ref.abs().max()) < 2e-2


@pytest.mark.parametrize("cap", [5.0, 60.0])  # scores past the cap; every score within it
@pytest.mark.parametrize("algorithm", ["fa2", "fa1", "fa3"])
@pytest.mark.parametrize("dtype, precision", [("float16", None), ("bfloat16", None), ("float32", "ieee")])
def test_softcap_forward_and_backward(algorithm, dtype, precision, cap):
    if algorithm == "fa3" and dtype == "float32":
        pytest.skip("fa3 runs 16-bit inputs")
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import gradients

    B, H, Hkv, Nq, Nk, D, window = 1, 4, 2, 800, 1000, 128, (300, 0)
    gen = torch.Generator(device="cuda").manual_seed(13)
    dt = getattr(torch, dtype)
    q = (3 * torch.randn(B, H, Nq, D, device="cuda", generator=gen)).to(dt)  # scores of several units: capped
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", generator=gen).to(dt) for _ in range(2))
    o, lse = numba_flash.attention(q, k, v, softcap=cap, window_size=window, algorithm=algorithm, precision=precision,
                                   return_lse=True)
    seen = _visible(Nq, Nk, window, False, "cuda")
    ref = _attention64(q, k, v, seen, softcap=cap)
    err = float((o.double() - ref).abs().max())
    if dtype == "float32":
        assert err < 1e-5, err
    else:
        base = float((_attention64(q, k, v, seen, dtype=dt, softcap=cap).double() - ref).abs().max())
        assert err <= 2 * base + 1e-6, (err, base)
    if algorithm == "fa3":
        return  # (a forward: fa3's gradients are fa2's backward)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(dt)
    grads = gradients(do, q, k, v, o, lse, softcap=cap, window_size=window, algorithm=algorithm,
                      precision=precision)
    refs = _attention64(q, k, v, seen, do=do, softcap=cap)
    tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
        rel = float((got.double() - want).abs().max() / want.abs().max())
        assert rel < tol, (name, rel)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("algorithm", ["fa2", "fa1", "fa3"])
@pytest.mark.parametrize("dtype, precision", [("float16", None), ("bfloat16", None), ("float32", "ieee"),
                                              ("float32", "tf32x3")])
def test_alibi_forward_and_backward(algorithm, dtype, precision, causal):
    """ALiBi with (B, H) slopes, a window on top, Nq != Nk (the bias's alignment); causal (fa1 / fa2:
    the bias fused with the scale), and not (keys on both sides of the diagonal: |i - j|); fa3 adds
    the bias over the scale to the unscaled tile in both."""
    if algorithm == "fa3" and dtype == "float32":
        pytest.skip("fa3 runs 16-bit inputs")
    if not causal and dtype != "float16":
        pytest.skip("both sides of the diagonal: float16 only (the kernels' bias does not depend on the dtype)")
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import gradients

    B, H, Hkv, Nq, Nk, D, window = 2, 4, 2, 700, 1000, 128, (400, -1)
    gen = torch.Generator(device="cuda").manual_seed(17)
    dt = getattr(torch, dtype)
    q = torch.randn(B, H, Nq, D, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(B, Hkv, Nk, D, device="cuda", generator=gen).to(dt) for _ in range(2))
    slopes = torch.rand(B, H, device="cuda", generator=gen) * 0.1  # a bias of units over tens of keys
    o, lse = numba_flash.attention(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes, algorithm=algorithm,
                                   precision=precision, return_lse=True)
    seen = _visible(Nq, Nk, window, causal, "cuda")
    ref = _attention64(q, k, v, seen, alibi=slopes)
    assert float((_attention64(q, k, v, seen) - ref).abs().max()) > 0.1  # the bias matters here
    err = float((o.double() - ref).abs().max())
    if dtype == "float32":
        assert err < 1e-4 if precision == "tf32x3" else err < 1e-5, err
    else:
        base = float((_attention64(q, k, v, seen, dtype=dt, alibi=slopes).double() - ref).abs().max())
        assert err <= 2 * base + 1e-6, (err, base)
    if precision == "tf32x3" or algorithm == "fa3":
        return  # (the backward's float32 regimes: ieee here, tf32x3 by default elsewhere; fa3: a forward)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(dt)
    for deterministic in ((False, True) if algorithm == "fa2" else (False,)):
        grads = gradients(do, q, k, v, o, lse, causal=causal, window_size=window, alibi_slopes=slopes,
                          algorithm=algorithm, deterministic=deterministic, precision=precision)
        refs = _attention64(q, k, v, seen, do=do, alibi=slopes)
        tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
        for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
            rel = float((got.double() - want).abs().max() / want.abs().max())
            assert rel < tol, (name, deterministic, rel)


@pytest.mark.parametrize("n_q, n_k", [(1000, 4096), (4096, 1000)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fa3_alibi_steep_slopes_on_long_rows(dtype, n_q, n_k):
    """fa3's ALiBi off the diagonal: the bias less a row shift of up to slope * N (``kernels.fa3``'s
    ``folded_alibi``), with steep slopes (0.5: the shift reaches 2000) over 4096 keys, tiles left and
    right of every row's diagonal (Nk > Nq, then Nq > Nk: rows whose every key is right of it), causal
    and not, within FlashAttention's 2x rule of float64."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3 needs compute capability 9.0")
    import numba_flash

    q, k, v, gen = _inputs(1, 4, 2, n_q, n_k, 128, dtype, seed=23)
    slopes = torch.tensor([[0.5, 0.0625, 0.004, 0.0]], device="cuda")  # the standard slopes' range, and none
    for causal in (False, True):
        o = numba_flash.attention(q, k, v, causal=causal, alibi_slopes=slopes, algorithm="fa3")
        seen = _visible(n_q, n_k, (-1, -1), causal, "cuda")
        ref = _attention64(q, k, v, seen, alibi=slopes)
        assert float((_attention64(q, k, v, seen) - ref).abs().max()) > 0.1  # the bias matters here
        err = float((o.double() - ref).abs().max())
        base = float((_attention64(q, k, v, seen, dtype=getattr(torch, dtype), alibi=slopes).double() - ref).abs().max())
        assert err <= 2 * base + 1e-6, (causal, err, base)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_alibi_split_kv_decode_and_torch(dtype):
    """Split-KV, decode (packed GQA rows, ragged lengths: each row its own head's slope and its own
    distance from its sequence's end) and the torch operator with autograd."""
    torch = pytest.importorskip("torch")
    import numba_flash
    import numba_flash.torch as nft
    from numba_flash import reference

    gen = torch.Generator(device="cuda").manual_seed(19)
    dt = getattr(torch, dtype)
    q = torch.randn(2, 8, 64, 128, device="cuda", generator=gen).to(dt)
    k, v = (torch.randn(2, 2, 5000, 128, device="cuda", generator=gen).to(dt) for _ in range(2))
    slopes = torch.rand(8, device="cuda", generator=gen) * 0.05
    o = numba_flash.attention(q, k, v, alibi_slopes=slopes, num_splits=4)
    ref = _attention64(q, k, v, _visible(64, 5000, (-1, -1), False, "cuda"), alibi=slopes.expand(2, 8))
    assert float((o.double() - ref).abs().max()) < (2e-3 if dtype == "float16" else 1e-5)
    lengths = torch.tensor([5000, 1234], dtype=torch.int32, device="cuda")
    qd = q[:, :, :3]
    od = numba_flash.decode(qd, k, v, cache_seqlens=lengths, causal=True, alibi_slopes=slopes)
    ref_o, _ = reference.decode(*(x.float().cpu().numpy() for x in (qd, k, v)), cache_seqlens=lengths.cpu().numpy(),
                                causal=True, alibi_slopes=slopes.cpu().numpy())
    assert float((od.double().cpu() - torch.as_tensor(ref_o)).abs().max()) < (2e-3 if dtype == "float16" else 1e-5)
    qt, kt, vt = (x[:1, :4, :300].detach().clone().requires_grad_() for x in (q, k, v))  # 64 queries, 300 keys
    ot = nft.attention(qt, kt, vt, causal=True, alibi_slopes=slopes[:4])
    ot.float().sum().backward()
    seen = _visible(64, 300, (-1, 0), False, "cuda")
    refs = _attention64(qt, kt, vt, seen, do=torch.ones_like(ot), alibi=slopes[:4].expand(1, 4))
    assert float((ot.detach().double() - _attention64(qt, kt, vt, seen, alibi=slopes[:4].expand(1, 4))).abs().max()) < 5e-3
    for got, want in zip((qt.grad, kt.grad, vt.grad), refs):
        assert float((got.double() - want).abs().max() / want.abs().max()) < (2e-2 if dtype == "float16" else 1e-4)


@pytest.mark.parametrize("algorithm", ["fa2", "fa1", "fa3"])
@pytest.mark.parametrize("dtype, precision", [("float16", None), ("float32", "ieee")])
def test_user_mods_forward_and_backward(algorithm, dtype, precision):
    """A user's mask_mod (document ids through mod_args) and score_mod (a relative-position bias
    table, with its gradient) compiled into the forward and the backward, causal on top."""
    if algorithm == "fa3" and dtype == "float32":
        pytest.skip("fa3 runs 16-bit inputs")
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import gradients

    B, H, Hkv, Nq, Nk, D = 1, 4, 2, 700, 1000, 64
    dt = getattr(torch, dtype)
    q, k, v, gen = _inputs(B, H, Hkv, Nq, Nk, D, dtype, 23)
    doc = torch.sort(torch.randint(0, 5, (Nk,), device="cuda", generator=gen)).values.to(torch.int32)
    table = 0.5 * torch.randn(H, Nq + Nk + 1, device="cuda", generator=gen)

    def mask(b, h, q_idx, kv_idx, doc, table):
        return doc[q_idx + 300] == doc[kv_idx]  # (queries are the last 700 positions)

    def score(s, b, h, q_idx, kv_idx, doc, table):
        return s + table[h, q_idx - kv_idx + 1000]

    def grad(s, b, h, q_idx, kv_idx, doc, table):
        return 1.0

    mods = dict(mask_mod=mask, score_mod=score, mod_args=(doc, table), causal=True)
    o, lse = numba_flash.attention(q, k, v, algorithm=algorithm, precision=precision, return_lse=True, **mods)
    i = torch.arange(Nq, device="cuda")[:, None]
    j = torch.arange(Nk, device="cuda")[None, :]
    seen = (doc[i + 300] == doc[j]) & (j <= i + 300)
    bias = table[:, (i - j + 1000)].double()  # (H, Nq, Nk)

    def reference64(x_dtype=None, do=None):
        t = torch.float64 if x_dtype is None else x_dtype
        qq, kk, vv = (x.detach().to(t).requires_grad_(do is not None) for x in (q, k, v))
        g = H // Hkv
        s = (qq @ kk.repeat_interleave(g, 1).transpose(-1, -2)) / math.sqrt(D) + bias.to(t)
        p = torch.softmax(s.masked_fill(~seen, -math.inf).double(), dim=-1).nan_to_num(0.0).to(t)
        out = p @ vv.repeat_interleave(g, 1)
        if do is None:
            return out
        out.backward(do.to(t))
        return qq.grad, kk.grad, vv.grad

    ref = reference64()
    err = float((o.double() - ref).abs().max())
    if dtype == "float32":
        assert err < 1e-5, err
    else:
        base = float((reference64(dt).double() - ref).abs().max())
        assert err <= 2 * base + 1e-6, (err, base)
    if algorithm == "fa3":
        return  # (a forward: fa3's gradients are fa2's backward)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(dt)
    refs = reference64(do=do)
    for deterministic in ((False, True) if algorithm == "fa2" else (False,)):
        grads = gradients(do, q, k, v, o, lse, algorithm=algorithm, deterministic=deterministic, precision=precision,
                          score_mod_grad=grad, **mods)
        tol = {"float32": 1e-4, "float16": 2e-2}[dtype]
        for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
            rel = float((got.double() - want).abs().max() / want.abs().max())
            assert rel < tol, (name, deterministic, rel)


@pytest.mark.parametrize("algorithm", ["fa2", "fa1", "fa3"])
@pytest.mark.parametrize("dtype, precision", [("float16", None), ("bfloat16", None), ("float32", "ieee"),
                                              ("float32", "tf32x3")])
def test_block_sparse_walks(algorithm, dtype, precision):
    """The block-sparse forward on the GPU (issue 24): documents of random lengths by mask_mod,
    NaN in the keys and values no query sees (a walk that loaded them would spread it), the
    block mask derived by the kernels, given at FlexAttention's 128 x 128 (carried to the
    kernel's tiles), and split over the listed tiles; a causal mask_mod matches causal=True."""
    if algorithm == "fa3" and dtype == "float32":
        pytest.skip("fa3 runs 16-bit inputs")
    torch = pytest.importorskip("torch")
    import numba_flash

    B, H, Hkv, Nq, Nk, D = 2, 4, 2, 1500, 2300, 64
    dt = getattr(torch, dtype)
    q, k, v, gen = _inputs(B, H, Hkv, Nq, Nk, D, dtype, 29)
    doc = _document_ids(gen, Nk, 6, 1, 500)  # keys < 500: no query's
    offset = Nk - Nq  # (queries are the last Nq positions)

    def same_doc(b, h, q_idx, kv_idx, doc):
        return doc[q_idx + 800] == doc[kv_idx]

    i = torch.arange(Nq, device="cuda")[:, None]
    j = torch.arange(Nk, device="cuda")[None, :]
    seen = doc[i + offset] == doc[j]
    # NaN in every 128 keys no query sees (whole K/V tiles of every kernel and of the given block
    # mask: hidden, never loaded; a key hidden in a partial tile is loaded and its NaN would reach
    # P~ V as 0 x NaN, so those stay finite)
    blocks = (~seen.any(0))[: Nk // 128 * 128].view(-1, 128).all(1)
    nan_keys = torch.zeros(Nk, dtype=torch.bool, device="cuda")
    nan_keys[: Nk // 128 * 128] = blocks.repeat_interleave(128)
    assert int(nan_keys.sum()) >= 256  # (keys < 500 are in documents before every query's)
    ref = _attention64(q, k, v, seen)
    k, v = k.clone(), v.clone()
    k[:, :, nan_keys] = float("nan")
    v[:, :, nan_keys] = float("nan")
    mods = dict(mask_mod=same_doc, mod_args=(doc,))
    given = numba_flash.block_mask(same_doc, None, None, Nq, Nk, block_m=128, block_n=128, mod_args=(doc.cpu().numpy(),))
    runs = [{}, {"block_mask": given}] + ([{"num_splits": 3}] if algorithm == "fa2" else [])
    for extra in runs:
        o = numba_flash.attention(q, k, v, algorithm=algorithm, precision=precision, **mods, **extra)
        err = float((o.double() - ref).abs().max())
        if dtype == "float32":
            assert err < 1e-4, (extra.keys(), err)
        else:
            base = float((_attention64(q, k, v.nan_to_num(0.0), seen, dtype=dt).double() - ref).abs().max())
            assert err <= 2 * base + 1e-6, (extra.keys(), err, base)

    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx + 800 >= kv_idx

    q, k, v, _ = _inputs(B, H, Hkv, Nq, Nk, D, dtype, 31)
    by_mod = numba_flash.attention(q, k, v, algorithm=algorithm, precision=precision, mask_mod=causal_mod)
    builtin = numba_flash.attention(q, k, v, algorithm=algorithm, precision=precision, causal=True)
    assert float((by_mod.double() - builtin.double()).abs().max()) < (1e-5 if dtype == "float32" else 1e-2)


@pytest.mark.parametrize("variant", [("fa2", False), ("fa2", True), ("fa1", False)])
@pytest.mark.parametrize("dtype, precision", [("float16", None), ("bfloat16", None), ("float32", "ieee")])
def test_block_sparse_backward(variant, dtype, precision):
    """The block-sparse backward on the GPU (issue 24): documents of random lengths by mask_mod,
    NaN in the keys and values no query sees (a dK/dV walk that visited their tiles' Q tiles, or
    a dQ walk that loaded them, would spread it); dq, dk, dv against float64 autograd, dk and dv
    zero on the hidden keys, with the block masks derived at the backward's own tiles."""
    torch = pytest.importorskip("torch")
    import numba_flash
    from numba_flash.backward import gradients

    algorithm, deterministic = variant
    B, H, Hkv, Nq, Nk, D = 1, 4, 2, 900, 1400, 64
    dt = getattr(torch, dtype)
    q, k, v, gen = _inputs(B, H, Hkv, Nq, Nk, D, dtype, 41)
    doc = _document_ids(gen, Nk, 4, 600, 384)  # keys < 384: no query's
    offset = Nk - Nq

    def same_doc(b, h, q_idx, kv_idx, doc):
        return doc[q_idx + 500] == doc[kv_idx]

    i = torch.arange(Nq, device="cuda")[:, None]
    j = torch.arange(Nk, device="cuda")[None, :]
    seen = doc[i + offset] == doc[j]
    assert not bool(seen[:, :384].any())  # (the queries are keys 500 on)
    mods = dict(mask_mod=same_doc, mod_args=(doc,))
    o, lse = numba_flash.attention(q, k, v, algorithm=algorithm, precision=precision, return_lse=True, **mods)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(dt)
    refs = _attention64(q, k, v, seen, do=do)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :384] = float("nan")  # (whole tiles of every backward kernel: hidden, never loaded)
    v_nan[:, :, :384] = float("nan")
    grads = gradients(do, q, k_nan, v_nan, o, lse, algorithm=algorithm, deterministic=deterministic,
                      precision=precision, **mods)
    tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
        assert bool(torch.isfinite(got).all()), name
        rel = float((got.double() - want).abs().max() / want.abs().max())
        assert rel < tol, (name, rel)
    assert float(grads[1][:, :, :384].abs().max()) == 0.0 and float(grads[2][:, :, :384].abs().max()) == 0.0


@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
def test_torch_attention_takes_the_mods(algorithm):
    """``numba_flash.torch.attention`` with a mask_mod, a score_mod and its gradient, mod_args
    tensors and a given block mask: o and the gradients of q, k, v against float64 autograd
    (float16; FlashAttention's 2x rule on o); without score_mod_grad the backward says so."""
    torch = pytest.importorskip("torch")
    import numba_flash
    import numba_flash.torch as nft

    B, H, Hkv, Nq, Nk, D = 1, 4, 2, 300, 400, 64
    q, k, v, gen = _inputs(B, H, Hkv, Nq, Nk, D, "float16", 37)
    doc = torch.sort(torch.randint(0, 4, (Nk,), device="cuda", generator=gen)).values.to(torch.int32)
    table = 0.3 * torch.randn(H, Nq + Nk + 1, device="cuda", generator=gen)

    def mask(b, h, q_idx, kv_idx, doc, table):
        return doc[q_idx + 100] == doc[kv_idx]

    def score(s, b, h, q_idx, kv_idx, doc, table):
        return s + table[h, q_idx - kv_idx + 400]

    def grad(s, b, h, q_idx, kv_idx, doc, table):
        return 1.0

    i = torch.arange(Nq, device="cuda")[:, None]
    j = torch.arange(Nk, device="cuda")[None, :]
    seen = doc[i + 100] == doc[j]
    bias = table[:, (i - j + 400)].double()
    given = numba_flash.block_mask(mask, None, None, Nq, Nk, block_m=128, block_n=128,
                                   mod_args=(doc.cpu().numpy(), table.cpu().numpy()))

    def plain(t, qq, kk, vv):
        g = H // Hkv
        s = (qq.to(t) @ kk.to(t).repeat_interleave(g, 1).transpose(-1, -2)) / math.sqrt(D) + bias.to(t)
        p = torch.softmax(s.masked_fill(~seen, -math.inf).double(), dim=-1).nan_to_num(0.0).to(t)
        return p @ vv.to(t).repeat_interleave(g, 1)

    do = torch.randn(q.shape, device="cuda", generator=gen).half()
    for extra in ({}, {"block_mask": given}):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        o = nft.attention(qq, kk, vv, algorithm=algorithm, mask_mod=mask, score_mod=score, score_mod_grad=grad,
                          mod_args=(doc, table), **extra)
        o.backward(do)
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = plain(torch.float64, q64, k64, v64)
        ref.backward(do.double())
        base = float((plain(torch.float16, q, k, v).double() - ref).abs().max())
        assert float((o.double() - ref).abs().max()) <= 2 * base + 1e-6
        for name, got, want in (("dq", qq.grad, q64.grad), ("dk", kk.grad, k64.grad), ("dv", vv.grad, v64.grad)):
            assert float((got.double() - want).abs().max() / want.abs().max()) < 2e-2, (name, extra.keys())
    qq = q.detach().clone().requires_grad_()
    o = nft.attention(qq, k, v, algorithm=algorithm, mask_mod=mask, score_mod=score, mod_args=(doc, table))
    with pytest.raises(ValueError, match="score_mod_grad"):
        o.backward(do)
