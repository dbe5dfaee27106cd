"""Split-KV and decoding on a real GPU (``pytest -m gpu``; skipped in the simulator).

Long caches, ragged lengths with a NaN-poisoned tail, GQA packing, every dtype (bfloat16 and
float16 through PyTorch, float32 through CuPy), splits chosen by the heuristic and forced: each
against float64, float16/bfloat16 by FlashAttention's rule (at most twice the error of PyTorch's
math SDPA in the same dtype).
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu


def _torch():
    return pytest.importorskip("torch")


def _reference(q, k, v, lens, causal, dtype=None):
    """Per sequence: attention over its valid keys, in float64 (or ``dtype``: the plain
    implementation of FlashAttention's rule); GQA by repetition; rows that see nothing: 0."""
    torch = _torch()
    outs, lses = [], []
    g = q.shape[1] // k.shape[1]
    for b, n in enumerate(lens):
        qb, kb, vb = (x[b : b + 1].to(dtype or torch.float64) for x in (q, k[:, :, :n], v[:, :, :n]))
        kb, vb = kb.repeat_interleave(g, dim=1), vb.repeat_interleave(g, dim=1)
        s = (qb @ kb.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if causal:
            i = torch.arange(qb.shape[2], device=q.device)[:, None]
            j = torch.arange(n, device=q.device)[None, :]
            s = s.masked_fill(j > i + (n - qb.shape[2]), -math.inf)
        lse = torch.logsumexp(s.double(), dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        outs.append(p @ vb)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal, n_q", [(False, 1), (True, 4)])
@pytest.mark.parametrize("num_splits", [None, 1, 13])
def test_decode_long_ragged_cache(dtype, causal, n_q, num_splits):
    torch = _torch()
    import numba_flash

    gen = torch.Generator(device="cuda").manual_seed(7)
    B, H, Hkv, N, D = 3, 32, 8, 20000, 128
    dt = getattr(torch, dtype)
    q = torch.randn(B, H, n_q, D, device="cuda", generator=gen).to(dt)
    k = torch.randn(B, Hkv, N, D, device="cuda", generator=gen).to(dt)
    v = torch.randn(B, Hkv, N, D, device="cuda", generator=gen).to(dt)
    lens = [N, 7777, 0]
    for b, n in enumerate(lens):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=seqlens, causal=causal, num_splits=num_splits, return_lse=True)
    torch.cuda.synchronize()
    ref_o, ref_lse = _reference(q, k, v, lens, causal)
    assert o.dtype == dt and o.shape == q.shape
    assert not torch.isnan(o).any()
    assert (o[2] == 0).all() and torch.isinf(lse[2]).all()  # length 0: nothing seen
    err = (o.double() - ref_o).abs().max().item()
    if dtype == "float32":
        assert err / ref_o.abs().max().item() < 1e-5
    else:
        plain, _ = _reference(q, k, v, lens, causal, dtype=dt)
        base = (plain.double() - ref_o).abs().max().item()
        assert err <= 2 * base + 1e-6, (err, base)
    seen = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[seen], ref_lse[seen], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype, precision", [("float16", None), ("float32", None), ("float32", "tf32x3")])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_split_equals_unsplit(dtype, precision, causal):
    torch = _torch()
    import numba_flash

    gen = torch.Generator(device="cuda").manual_seed(3)
    dt = getattr(torch, dtype)
    q = torch.randn(1, 4, 300, 64, device="cuda", generator=gen).to(dt)
    k = torch.randn(1, 2, 30000, 64, device="cuda", generator=gen).to(dt)
    v = torch.randn(1, 2, 30000, 64, device="cuda", generator=gen).to(dt)
    ref_o, _ = _reference(q, k, v, [k.shape[2]], causal)

    def rel(x, y):
        return ((x.double() - y.double()).norm() / y.double().norm()).item()

    o1, l1 = numba_flash.attention(q, k, v, causal=causal, precision=precision, num_splits=1, return_lse=True)
    unsplit_err = rel(o1, ref_o)
    assert unsplit_err < (1e-3 if dtype == "float16" else 1e-5)
    for splits in (None, 2, 37):
        o, lse = numba_flash.attention(q, k, v, causal=causal, precision=precision, num_splits=splits, return_lse=True)
        torch.cuda.synchronize()
        assert not torch.isnan(o).any()
        # within float32 rounding of the unsplit result, and no further from float64 than it
        assert rel(o, o1) < (2e-3 if dtype == "float16" else 1e-5), (splits, rel(o, o1))
        assert rel(o, ref_o) <= 2 * unsplit_err + 1e-7, (splits, rel(o, ref_o), unsplit_err)
        assert torch.allclose(lse, l1, rtol=1e-5, atol=1e-5)


def test_decode_cupy_float32_and_list_lengths():
    cp = pytest.importorskip("cupy")
    import numba_flash

    rng = cp.random.default_rng(1)
    q = rng.standard_normal((2, 8, 1, 64), dtype=cp.float32)
    k = rng.standard_normal((2, 2, 5000, 64), dtype=cp.float32)
    v = rng.standard_normal((2, 2, 5000, 64), dtype=cp.float32)
    o = numba_flash.decode(q, k, v, cache_seqlens=[5000, 1234])
    assert isinstance(o, cp.ndarray)
    for b, n in enumerate((5000, 1234)):
        ref = numba_flash.attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], num_splits=1)
        assert float(cp.abs(o[b : b + 1] - ref).max()) < 1e-5


@pytest.mark.parametrize("library, dtype", [("cupy", "float16"), ("torch", "bfloat16")])
def test_decode_appends_new_keys_in_place(library, dtype):
    """``decode(..., k_new=, v_new=)`` on the GPU (CuPy float16, torch bfloat16): the new keys
    land in the caches at each sequence's length, the lengths are not advanced, and the result
    is the reference's with the keys appended (float64, FlashAttention's 2x rule loosened to a
    bound: 16-bit caches)."""
    cp = pytest.importorskip("cupy")
    import numpy as np

    import numba_flash
    from numba_flash import reference

    rng = np.random.default_rng(23)
    B, H, Hkv, D, n_max, n_new = 4, 8, 2, 128, 4096, 5
    host = [rng.standard_normal(s).astype(np.float32) for s in
            ((B, H, 1, D), (B, Hkv, n_max, D), (B, Hkv, n_max, D), (B, Hkv, n_new, D), (B, Hkv, n_new, D))]
    lengths = np.array([4000, 0, 1, 2048], np.int32)
    if library == "torch":
        torch = pytest.importorskip("torch")
        q, k_cache, v_cache, k_new, v_new = (torch.as_tensor(x, device="cuda").to(torch.bfloat16) for x in host)
        seqlens = torch.as_tensor(lengths, device="cuda")
        as_host = lambda x: x.float().cpu().numpy()  # noqa: E731
    else:
        q, k_cache, v_cache, k_new, v_new = (cp.asarray(x).astype(dtype) for x in host)
        seqlens = cp.asarray(lengths)
        as_host = lambda x: cp.asnumpy(x).astype(np.float32)  # noqa: E731
    k_before, v_before = as_host(k_cache), as_host(v_cache)
    o = numba_flash.decode(q, k_cache, v_cache, cache_seqlens=seqlens, k_new=k_new, v_new=v_new, causal=True)
    want, _ = reference.decode(as_host(q), k_before, v_before, cache_seqlens=lengths, k_new=as_host(k_new),
                               v_new=as_host(v_new), causal=True)
    got = as_host(o)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    assert as_host(seqlens).tolist() == lengths.tolist()
    k_after = as_host(k_cache)
    for b, n in enumerate(lengths.tolist()):
        np.testing.assert_array_equal(k_after[b, :, n:n + n_new], as_host(k_new)[b])
        np.testing.assert_array_equal(k_after[b, :, :n], k_before[b, :, :n])
