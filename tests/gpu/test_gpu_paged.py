"""Paged KV caches on the GPU (issue 25, API.md 2e): ``decode(..., block_table=)`` with page sizes
16, 64 and 256 and a random block table, with and without appended keys, against float64
(FlashAttention's 2x rule for 16-bit) and bit for bit against the same keys in a contiguous cache."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _paged(torch, gen, cache, lengths, page_size, max_blocks, spare=3):
    """``cache (B, Hkv, N, D)``'s first ``lengths[b]`` keys in pages of a random order, as
    ``(pages (num_blocks, page_size, Hkv, D), block_table (B, max_blocks) int32)``; other rows NaN,
    unused entries -1."""
    B, Hkv, _, D = cache.shape
    used = [-(-n // page_size) for n in lengths]
    num_blocks = sum(used) + spare
    pages = torch.full((num_blocks, page_size, Hkv, D), math.nan, dtype=cache.dtype, device="cuda")
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    for b, (n, n_pages) in enumerate(zip(lengths, used)):
        for j in range(n_pages):
            page = order.pop()
            table[b, j] = page
            rows = min(page_size, n - j * page_size)
            pages[page, :rows] = cache[b, :, j * page_size : j * page_size + rows].transpose(0, 1)
    return pages, table.cuda()


def _reference(q, keys, values, lengths, causal, dtype, torch):
    """o per sequence: float64 (``dtype=None``) or a plain implementation in ``dtype``."""
    t = torch.float64 if dtype is None else dtype
    B, H, n_q, D = q.shape
    g = H // keys.shape[1]
    out = torch.zeros(q.shape, dtype=t, device="cuda")
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        s = (q[b].to(t) @ keys[b, :, :n].repeat_interleave(g, 0).to(t).transpose(-1, -2)) / math.sqrt(D)
        if causal:
            i = torch.arange(n_q, device="cuda")[:, None] + n - n_q
            s = s.masked_fill(torch.arange(n, device="cuda")[None, :] > i, -math.inf)
        p = torch.softmax(s.double() if dtype is None else s.float(), -1).nan_to_num(0.0).to(t)
        out[b] = p @ values[b, :, :n].repeat_interleave(g, 0).to(t)
    return out


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("n_new", [0, 3])
def test_paged_decode_against_float64(page_size, dtype, n_new):
    torch = pytest.importorskip("torch")
    import numba_flash

    gen = torch.Generator().manual_seed(page_size + n_new)
    dt = getattr(torch, dtype)
    B, H, Hkv, n_q, D, max_blocks = 5, 8, 2, 2, 128, 2048 // page_size
    lengths = torch.randint(1, 2048 - n_new, (B,), generator=gen).tolist()
    lengths[0], lengths[1] = 0, page_size  # an empty cache (then only the new keys), an exact page
    q = torch.randn(B, H, n_q, D, generator=gen).to("cuda", dt)
    keys, values = (torch.randn(B, Hkv, 2048, D, generator=gen).to("cuda", dt) for _ in range(2))
    total = [n + n_new for n in lengths]
    k_cache, table = _paged(torch, torch.Generator().manual_seed(9), keys, total, page_size, max_blocks)
    v_cache, _ = _paged(torch, torch.Generator().manual_seed(9), values, total, page_size, max_blocks)
    new = {}
    if n_new:
        new = dict(k_new=keys[:, :, 2048 - n_new :].contiguous(), v_new=values[:, :, 2048 - n_new :].contiguous())
        for b, n in enumerate(lengths):  # what the append writes: the reference's keys n .. n + n_new - 1
            keys[b, :, n : n + n_new] = new["k_new"][b]
            values[b, :, n : n + n_new] = new["v_new"][b]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    o = torch.full_like(q, math.nan)
    o, lse = numba_flash.decode(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True,
                                return_lse=True, **new)
    assert o.shape == q.shape and o.dtype == dt and lse.shape == (B, H, n_q)
    assert seqlens.tolist() == lengths  # not advanced
    ref = _reference(q, keys, values, total, True, None, torch)
    err = float((o.double() - ref).abs().max())
    if dtype == "float32":
        assert err <= 1e-5 * float(ref.abs().max()) + 1e-6, err
    else:
        plain = float((_reference(q, keys, values, total, True, dt, torch).double() - ref).abs().max())
        assert err <= 2 * plain + 1e-5, (err, plain)
    if n_new:  # the new keys are in their pages
        for b, n in enumerate(lengths):
            for t in range(n_new):
                j = n + t
                page = int(table[b, j // page_size])
                assert torch.equal(k_cache[page, j % page_size], new["k_new"][b, :, t])
                assert torch.equal(v_cache[page, j % page_size], new["v_new"][b, :, t])


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("n_q, group", [(1, 4), (1, 8), (3, 1)])
def test_paged_decode_is_the_contiguous_one_bit_for_bit(page_size, n_q, group):
    """Same keys, same tiles, same splits: the paged copies change where rows come from, not a
    product, so o and lse are the contiguous cache's bit for bit (CuPy inputs; float16)."""
    cupy = pytest.importorskip("cupy")
    import numba_flash

    rng = cupy.random.default_rng(page_size + group)
    B, Hkv, D, n_max = 6, 2, 128, 4096
    lengths = cupy.asarray([4096, 0, 1, page_size, 3001, 2048], dtype=cupy.int32)
    q = rng.standard_normal((B, Hkv * group, n_q, D), dtype=cupy.float32).astype(cupy.float16)
    k, v = (rng.standard_normal((B, Hkv, n_max, D), dtype=cupy.float32).astype(cupy.float16) for _ in range(2))
    per_seq = n_max // page_size
    perm = cupy.asarray(np.random.default_rng(1).permutation(B * per_seq), dtype=cupy.int32)
    table = perm.reshape(B, per_seq)
    k_pages, v_pages = (cupy.empty((B * per_seq, page_size, Hkv, D), cupy.float16) for _ in range(2))
    for cache, pages in ((k, k_pages), (v, v_pages)):  # page table[b, j] <- keys j*P .. of sequence b
        pages[table.reshape(-1)] = cache.reshape(B, Hkv, per_seq, page_size, D).transpose(0, 2, 3, 1, 4).reshape(
            B * per_seq, page_size, Hkv, D)
    for splits in (None, 1, 7):
        o1, l1 = numba_flash.decode(q, k, v, cache_seqlens=lengths, causal=True, num_splits=splits, return_lse=True)
        o2, l2 = numba_flash.decode(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table, causal=True,
                                    num_splits=splits, return_lse=True)
        assert bool(cupy.isfinite(o2).all())
        assert bool((o1 == o2).all()) and bool(cupy.array_equal(l1, l2)), splits


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_page_table_and_torch_operator_give_the_same_bits(dtype):
    """A decode step's form (``page_table`` once, every layer's ``decode`` planned on it) and
    ``numba_flash.torch.decode(..., block_table=)`` (the custom operator) give the bits of the
    table passed to ``decode`` itself, call after call (planned calls reuse one plan)."""
    torch = pytest.importorskip("torch")
    import numba_flash
    import numba_flash.torch as nft

    gen = torch.Generator().manual_seed(5)
    dt = getattr(torch, dtype)
    B, H, Hkv, D, P, max_blocks = 8, 16, 4, 128, 16, 64
    lengths = torch.randint(0, P * max_blocks, (B,), generator=gen).to(torch.int32).cuda()
    table = torch.randperm(B * max_blocks + 5, generator=gen)[: B * max_blocks].reshape(B, max_blocks).to(torch.int32).cuda()
    checked = numba_flash.page_table(torch.empty(B * max_blocks + 5, P, Hkv, D, dtype=dt, device="cuda"), table, lengths)
    for layer in range(3):
        k_cache, v_cache = (torch.randn(B * max_blocks + 5, P, Hkv, D, generator=gen).to("cuda", dt) for _ in range(2))
        q = torch.randn(B, H, 1, D, generator=gen).to("cuda", dt)
        want = numba_flash.decode(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, causal=True)
        got = numba_flash.decode(q, k_cache, v_cache, block_table=checked, causal=True)
        op = nft.decode(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, causal=True)
        assert bool(torch.isfinite(want).all())
        assert torch.equal(got, want) and torch.equal(op, want), layer
