"""``attention_varlen`` on the GPU (issue 25): FlashAttention's varlen forward grid in small --
random lengths per sequence with 0 and 1 among them, MHA/GQA/MQA, causal and windows -- against
a float64 loop over the sequences (FlashAttention's 2x rule for 16-bit), both loop orders and
both regimes, torch and CuPy inputs."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu


def _lengths(gen, n, longest, torch):
    lens = torch.randint(0, longest + 1, (n,), generator=gen).tolist()
    lens[0], lens[1] = 0, 1  # (an empty sequence and a one-row one)
    return lens


def _spans(cu_q, cu_k):
    """(rows, keys, n_q, n_k) of each sequence with queries and keys (the others' results are 0)."""
    for b in range(len(cu_q) - 1):
        n_q, n_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if n_q and n_k:
            yield slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1]), n_q, n_k


def _reference(q, k, v, cu_q, cu_k, causal, window, dtype, torch):
    """o per sequence in float64 (``dtype``: a plain implementation's type, S and P in it)."""
    out = torch.zeros(q.shape, dtype=torch.float64 if dtype is None else dtype, device="cuda")
    g = q.shape[1] // k.shape[1]
    for rows, keys, n_q, n_k in _spans(cu_q, cu_k):
        t = torch.float64 if dtype is None else dtype
        qq = q[rows].transpose(0, 1).to(t)
        kk, vv = (x[keys].transpose(0, 1).repeat_interleave(g, 0).to(t) for x in (k, v))
        s = (qq @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        i = torch.arange(n_q, device="cuda")[:, None] + n_k - n_q
        j = torch.arange(n_k, device="cuda")[None, :]
        seen = torch.ones(n_q, n_k, dtype=torch.bool, device="cuda")
        left, right = window
        if causal:
            right = 0 if right < 0 else min(right, 0)
        if left >= 0:
            seen &= j >= i - left
        if right >= 0:
            seen &= j <= i + right
        p = torch.softmax(s.masked_fill(~seen, -math.inf).double() if dtype is None else s.masked_fill(~seen, -math.inf).float(),
                          -1).nan_to_num(0.0).to(t)
        out[rows] = (p @ vv).transpose(0, 1)
    return out


@pytest.mark.parametrize("algorithm", ["fa2", "fa1", "fa3"])
@pytest.mark.parametrize("dtype, precision", [("float16", None), ("bfloat16", None), ("float32", "ieee")])
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (-1, -1)), (False, (100, 30))])
def test_varlen_forward_grid(algorithm, dtype, precision, causal, window):
    torch = pytest.importorskip("torch")
    import numba_flash

    if algorithm == "fa3" and (dtype == "float32" or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("fa3: 16-bit inputs on a Hopper GPU")

    gen = torch.Generator().manual_seed(3)
    dt = getattr(torch, dtype)
    for H, Hkv, D in ((6, 6, 64), (6, 2, 128), (6, 1, 40)):
        lens_q = _lengths(gen, 7, 300, torch)
        lens_k = [n if causal else m for n, m in zip(lens_q, _lengths(gen, 7, 500, torch))]
        lens_k[1] = max(lens_k[1], 1)
        cu_q = [0]
        cu_k = [0]
        for a, b in zip(lens_q, lens_k):
            cu_q.append(cu_q[-1] + a)
            cu_k.append(cu_k[-1] + b)
        q = torch.randn(cu_q[-1], H, D, generator=gen).to("cuda", dt)
        k, v = (torch.randn(cu_k[-1], Hkv, D, generator=gen).to("cuda", dt) for _ in range(2))
        o, lse = numba_flash.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                              window_size=window, algorithm=algorithm, precision=precision,
                                              return_lse=True)
        assert o.shape == q.shape and o.dtype == dt and lse.shape == (H, cu_q[-1])
        ref = _reference(q, k, v, cu_q, cu_k, causal, window, None, torch)
        err = float((o.double() - ref).abs().max())
        if dtype == "float32":
            assert err < 1e-5, (H, Hkv, D, err)
        else:
            base = float((_reference(q, k, v, cu_q, cu_k, causal, window, dt, torch).double() - ref).abs().max())
            assert err <= 2 * base + 1e-6, (H, Hkv, D, err, base)


def test_varlen_cupy_inputs_and_device_prefix_sums():
    cupy = pytest.importorskip("cupy")
    import numpy as np

    import numba_flash
    from numba_flash import reference

    rng = np.random.default_rng(5)
    lens = [129, 0, 1, 64, 255]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (rng.standard_normal((cu[-1], 4, 64)).astype(np.float16) for _ in range(3))
    o = numba_flash.attention_varlen(*(cupy.asarray(x) for x in (q, k, v)), cupy.asarray(cu), cupy.asarray(cu),
                                     255, 255, causal=True)
    ref, _ = reference.attention_varlen(q, k, v, cu, cu, 255, 255, causal=True)
    assert float(np.abs(o.get().astype(np.float64) - ref).max()) < 4e-3


def _gradients64(q, k, v, do, cu_q, cu_k, causal, torch):
    """dq, dk, dv per sequence in float64 (autograd), packed as the inputs."""
    grads = [torch.zeros(x.shape, dtype=torch.float64, device="cuda") for x in (q, k, v)]
    g = q.shape[1] // k.shape[1]
    for rows, keys, n_q, n_k in _spans(cu_q, cu_k):
        qq, kk, vv = (x.detach().double().requires_grad_() for x in (q[rows], k[keys], v[keys]))
        s = (qq.transpose(0, 1) @ kk.transpose(0, 1).repeat_interleave(g, 0).transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if causal:
            i = torch.arange(n_q, device="cuda")[:, None] + n_k - n_q
            s = s.masked_fill(torch.arange(n_k, device="cuda")[None, :] > i, -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out = (p @ vv.transpose(0, 1).repeat_interleave(g, 0)).transpose(0, 1)
        out.backward(do[rows].double())
        for acc, x, span in zip(grads, (qq, kk, vv), (rows, keys, keys)):
            acc[span] = x.grad
    return grads


@pytest.mark.parametrize("variant", [("fa2", False), ("fa2", True), ("fa1", False)])
@pytest.mark.parametrize("dtype, precision", [("float16", None), ("bfloat16", None), ("float32", "ieee")])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_backward_grid(variant, dtype, precision, causal):
    """attention_backward_varlen against float64 autograd per sequence: random lengths with 0 and
    1, GQA, D64 and D128; zero gradients where a sequence has no keys."""
    torch = pytest.importorskip("torch")
    import numba_flash

    algorithm, deterministic = variant
    gen = torch.Generator().manual_seed(11)
    dt = getattr(torch, dtype)
    for H, Hkv, D in ((6, 2, 64), (4, 4, 128)):
        lens_q = _lengths(gen, 6, 300, torch)
        lens_k = list(lens_q) if causal else _lengths(gen, 6, 400, torch)
        cu_q, cu_k = [0], [0]
        for a, b in zip(lens_q, lens_k):
            cu_q.append(cu_q[-1] + a)
            cu_k.append(cu_k[-1] + b)
        q = torch.randn(cu_q[-1], H, D, generator=gen).to("cuda", dt)
        k, v = (torch.randn(cu_k[-1], Hkv, D, generator=gen).to("cuda", dt) for _ in range(2))
        do = torch.randn(cu_q[-1], H, D, generator=gen).to("cuda", dt)
        args = (cu_q, cu_k, max(lens_q), max(lens_k))
        o, lse = numba_flash.attention_varlen(q, k, v, *args, causal=causal, algorithm=algorithm, precision=precision,
                                              return_lse=True)
        grads = numba_flash.attention_backward_varlen(do, q, k, v, o, lse, *args, causal=causal, algorithm=algorithm,
                                                      deterministic=deterministic, precision=precision)
        refs = _gradients64(q, k, v, do, cu_q, cu_k, causal, torch)
        tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
        for name, got, want, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
            assert got.shape == x.shape and got.dtype == dt and got.is_contiguous(), name
            assert bool(torch.isfinite(got).all()), name
            rel = float((got.double() - want).abs().max() / want.abs().max())
            assert rel < tol, (name, H, Hkv, D, rel)


def test_torch_attention_varlen_autograd():
    """numba_flash.torch.attention_varlen: o and the gradients of q, k, v against float64."""
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft

    gen = torch.Generator().manual_seed(13)
    lens = [300, 0, 1, 129, 64]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v = (torch.randn(cu[-1], 8, 64, generator=gen).to("cuda", torch.float16).requires_grad_() for _ in range(3))
    o = nft.attention_varlen(q, k, v, torch.tensor(cu, dtype=torch.int32, device="cuda"), cu, 300, 300, causal=True)
    do = torch.randn(o.shape, generator=gen).to("cuda", torch.float16)
    o.backward(do)
    refs = _gradients64(q, k, v, do, cu, cu, True, torch)
    ref_o = _reference(q.detach(), k.detach(), v.detach(), cu, cu, True, (-1, -1), None, torch)
    assert float((o.double() - ref_o).abs().max()) < 4e-3
    for name, got, want in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), refs):
        rel = float((got.double() - want).abs().max() / want.abs().max())
        assert rel < 2e-2, (name, rel)


def test_host_prefix_sums_that_change_every_call():
    """Prefix sums given on the host (a CPU tensor, a list), new lengths every call (the bounds are
    copied to the device from pinned memory, without a stream wait): each call's o against float64."""
    torch = pytest.importorskip("torch")
    import numba_flash.torch as nft

    gen = torch.Generator().manual_seed(17)
    for step in range(4):
        lens = _lengths(gen, 5, 200, torch)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        q, k, v = (torch.randn(cu[-1], 4, 64, generator=gen).to("cuda", torch.float16) for _ in range(3))
        given = torch.tensor(cu, dtype=torch.int32) if step % 2 else cu  # (a CPU tensor, then a list)
        o = nft.attention_varlen(q, k, v, given, given, max(lens), max(lens), causal=True)
        ref = _reference(q, k, v, cu, cu, True, (-1, -1), None, torch)
        base = float((_reference(q, k, v, cu, cu, True, (-1, -1), torch.float16, torch).double() - ref).abs().max())
        assert float((o.double() - ref).abs().max()) <= 2 * base + 1e-6, step


def test_fa3_sequences_never_see_each_others_values():
    """fa3 reads each sequence through a tensor map of its own rows: NaN and inf in one sequence's
    keys and values reach no other sequence's output, whatever the tile a boundary falls in."""
    torch = pytest.importorskip("torch")
    import numba_flash

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3: a Hopper GPU")
    gen = torch.Generator().manual_seed(5)
    lens = [100, 37, 300, 1, 129]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v = (torch.randn(cu[-1], 4, 128, generator=gen).to("cuda", torch.float16) for _ in range(3))
    ref = _reference(q, k, v, cu, cu, True, (-1, -1), None, torch)
    k, v = k.clone(), v.clone()
    k[cu[1] : cu[2]] = float("nan")  # sequence 1: its rows follow sequence 0's partial tile
    v[cu[1] : cu[2]] = float("inf")
    v[cu[3] : cu[4]] = float("nan")  # sequence 3 (one row), right after sequence 2
    o = numba_flash.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, algorithm="fa3")
    for b in (0, 2, 4):
        rows = slice(cu[b], cu[b + 1])
        assert torch.isfinite(o[rows]).all(), b
        assert float((o[rows].double() - ref[rows]).abs().max()) < 1e-2, b
