"""``decode(..., block_table=)`` (API.md section 2e) in the simulator: paged KV caches read in
place through a block table (``kernels.paged``, ``numba_flash.paging``).

Every cache here is built so that a wrong page cannot pass: pages in a random order, spare pages
and the rows past each sequence's keys poisoned with NaN, the table's unused entries -1."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import examples, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash import reference

NUMPY_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def paged_copy(rng, cache, lengths, page_size, max_blocks, spare=2):
    """A contiguous cache ``(B, Hkv, N, D)`` laid out in pages of ``page_size``: ``(pages
    (num_blocks, page_size, Hkv, D), block_table (B, max_blocks) int32)``. Sequence ``b``'s first
    ``lengths[b]`` keys go to pages in a random order; every other row is NaN, every unused
    table entry -1."""
    B, Hkv, _, D = cache.shape
    used = [-(-int(n) // page_size) for n in lengths]
    num_blocks = sum(used) + spare
    pages = np.full((num_blocks, page_size, Hkv, D), np.nan, cache.dtype)
    table = np.full((B, max_blocks), -1, np.int32)
    order = rng.permutation(num_blocks)
    at = 0
    for b, (n, n_pages) in enumerate(zip(lengths, used)):
        for j in range(n_pages):
            page = order[at]
            at += 1
            table[b, j] = page
            rows = min(page_size, int(n) - j * page_size)
            pages[page, :rows] = cache[b, :, j * page_size : j * page_size + rows].transpose(1, 0, 2)
    return pages, table


def check(o, lse, want_o, want_lse, dtype):
    got = np.asarray(o).astype(np.float64)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(want_lse))
    assert rel_err(got, want_o) < (2e-6 if dtype == "float32" else 1e-2)
    seen = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[seen], want_lse[seen], rtol=1e-4, atol=1e-4)


@settings(max_examples=examples(3), deadline=None)
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    page_size=st.sampled_from([16, 32, 48]),
    group=st.sampled_from([1, 2]),
    n_q=st.integers(1, 2),
    causal=st.booleans(),
    num_splits=st.sampled_from([None, 1, 2]),
    n_new=st.sampled_from([0, 0, 2]),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_paged_decode_is_the_contiguous_oracle(dtype, page_size, group, n_q, causal, num_splits, n_new, data, seed):
    """Random lengths (0 and exact page multiples among them), pages in a random order, GQA,
    splits and appended keys: the float64 oracle's result on the same keys."""
    rng = np.random.default_rng(seed)
    B, Hkv, D, max_blocks = 2, 2, 16, 3
    capacity = max_blocks * page_size
    lens = np.array(data.draw(st.lists(st.sampled_from([0, 1, page_size, capacity - n_new, 17, 40]),
                                       min_size=B, max_size=B)), np.int32)
    lens = np.minimum(lens, capacity - n_new)
    npdt = NUMPY_DTYPE[dtype]
    q = rng.standard_normal((B, Hkv * group, n_q, D)).astype(npdt)
    keys, values = (rng.standard_normal((B, Hkv, capacity, D)).astype(npdt) for _ in range(2))
    k_pages, table = paged_copy(np.random.default_rng(seed), keys, lens + n_new, page_size, max_blocks)
    v_pages, _ = paged_copy(np.random.default_rng(seed), values, lens + n_new, page_size, max_blocks)
    new = {}
    if n_new:
        new = {name: rng.standard_normal((B, Hkv, n_new, D)).astype(npdt) for name in ("k_new", "v_new")}
    want_o, want_lse = reference.decode(q, k_pages, v_pages, cache_seqlens=lens, block_table=table, causal=causal, **new)
    o, lse = numba_flash.decode(q, k_pages, v_pages, cache_seqlens=lens, block_table=table, causal=causal,
                                num_splits=num_splits, return_lse=True, **new)
    assert o.shape == q.shape and o.dtype == q.dtype
    check(o, lse, want_o, want_lse, dtype)


@pytest.mark.parametrize("kind, page_size, block_n, stages, warps", [
    ("f16", 16, 32, 1, 1),   # a tile over two pages: the walk looks a page up per run of 16 rows
    ("f16", 64, 32, 2, 1),   # two tiles in one page, a ring
    ("bf16", 16, 32, 2, 2),  # key warps: every thread copies, each warp multiplies its half
    ("tf32", 32, 16, 1, 1),
])
def test_paged_copies_are_the_contiguous_ones_bit_for_bit(kind, page_size, block_n, stages, warps):
    """The tensor-core kernel reading a paged cache (``row_walk=True``: full tiles by the paged
    row walk, as on the GPU; the simulator's own tiles are below ``row_walk_default``'s rule)
    gives the contiguous cache's partials bit for bit: the same products in the same order, for
    full tiles, a tail, an empty sequence, and splits."""
    from numba_flash.kernels.engines import TensorCores
    from numba_flash.kernels.forward import FA2, forward_kernel
    from numba_flash.kernels.jit import LOG2E
    from numba_flash.kernels.tc_ops import tc_layout
    from numba_flash.launch import numba_launch

    rng = np.random.default_rng(11)
    B, group, D, max_blocks = 3, 4, 32, 128 // page_size
    lens = np.array([77, 0, 64], np.int32)
    dtype = np.float32 if kind == "tf32" else np.float16
    q = rng.standard_normal((B, 1, group, D)).astype(dtype)
    keys, values = (rng.standard_normal((B, 1, 128, D)).astype(dtype) for _ in range(2))
    k_pages, table = paged_copy(np.random.default_rng(3), keys, lens, page_size, max_blocks)
    v_pages, _ = paged_copy(np.random.default_rng(3), values, lens, page_size, max_blocks)
    for cache in (keys, values):  # past each length: NaN (never read)
        for b, n in enumerate(lens):
            cache[b, :, n:] = np.nan

    def bits(x):
        return x.view(np.uint16) if kind == "f16" else x if kind == "tf32" else _bf16_bits(x)

    def run(page, n_splits):
        tiles = TensorCores(kind, D, 16, block_n, True, None, stages, warps)
        kernel = forward_kernel(FA2, tiles, (-1, -1), False, True, f32_out=True, page_size=page)
        if page:
            k = (np.ascontiguousarray(bits(k_pages).swapaxes(1, 2)), table)
            v = (np.ascontiguousarray(bits(v_pages).swapaxes(1, 2)), table)
        else:
            k, v = bits(keys), bits(values)
        o = np.full((n_splits * B, 1, group, D), np.nan, np.float32)
        lse = np.full((n_splits * B, 1, group), np.nan, np.float32)
        numba_launch(kernel, (B * n_splits,), tc_layout(kind, D, 16, block_n, stages, key_warps=warps).threads, None,
                     [bits(q), k, v, o, lse, np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32),
                      np.zeros((1, 1, 1), np.float32), np.float32(LOG2E / np.sqrt(D)), np.zeros(1, np.int32), lens,
                      np.int32(n_splits), np.int32(group), np.float32(0.0), np.zeros((1, 1), np.float32)],
                     shared_mem_bytes=tc_layout(kind, D, 16, block_n, stages, key_warps=warps).smem_bytes)
        return o, lse

    for n_splits in (1, 2):
        o0, l0 = run(0, n_splits)
        o1, l1 = run(page_size, n_splits)
        assert not np.isnan(o0[~np.isinf(l0)]).any()
        np.testing.assert_array_equal(o1, o0)
        np.testing.assert_array_equal(l1, l0)


def _bf16_bits(x):
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    u = np.where(np.isnan(x), 0x7FC0, u)
    return u.astype(np.uint16)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_appended_keys_are_written_into_their_pages(dtype):
    """``k_new`` / ``v_new`` land in page ``table[b, j // page_size]``, row ``j % page_size``,
    ``j = cache_seqlens[b] + t``, across a page boundary (sequence 0: 15 cached keys, 3 new);
    nothing else in the caches changes and the lengths are not advanced."""
    rng = np.random.default_rng(4)
    B, H, Hkv, D, P, n_new = 2, 2, 1, 16, 16, 3
    lengths = np.array([15, 0], np.int32)
    table = np.array([[4, 1, -1], [0, 2, 3]], np.int32)
    k_cache, v_cache = (rng.standard_normal((5, P, Hkv, D)).astype(dtype) for _ in range(2))
    k_new, v_new = (rng.standard_normal((B, Hkv, n_new, D)).astype(dtype) for _ in range(2))
    q = rng.standard_normal((B, H, 1, D)).astype(dtype)
    k_before, v_before = k_cache.copy(), v_cache.copy()
    want_o, want_lse = reference.decode(q, k_before, v_before, cache_seqlens=lengths, block_table=table,
                                        k_new=k_new, v_new=v_new)
    o, lse = numba_flash.decode(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, k_new=k_new,
                                v_new=v_new, return_lse=True)
    np.testing.assert_array_equal(lengths, [15, 0])
    written = {(4, 15): (0, 0), (1, 0): (0, 1), (1, 1): (0, 2), (0, 0): (1, 0), (0, 1): (1, 1), (0, 2): (1, 2)}
    for (page, row), (b, t) in written.items():
        np.testing.assert_array_equal(k_cache[page, row], k_new[b, :, t])
        np.testing.assert_array_equal(v_cache[page, row], v_new[b, :, t])
    untouched = np.ones((5, P), bool)
    for page, row in written:
        untouched[page, row] = False
    np.testing.assert_array_equal(k_cache[untouched], k_before[untouched])
    np.testing.assert_array_equal(v_cache[untouched], v_before[untouched])
    check(o, lse, want_o, want_lse, dtype)


def _paged_args(**change):
    rng = np.random.default_rng(5)
    args = dict(q=rng.standard_normal((2, 2, 1, 8)).astype(np.float32),
                k_cache=rng.standard_normal((4, 16, 1, 8)).astype(np.float32),
                v_cache=rng.standard_normal((4, 16, 1, 8)).astype(np.float32),
                block_table=np.array([[0, 1], [2, -1]], np.int32), cache_seqlens=np.array([20, 10], np.int32),
                k_new=rng.standard_normal((2, 1, 2, 8)).astype(np.float32),
                v_new=rng.standard_normal((2, 1, 2, 8)).astype(np.float32))
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, match", [
    (dict(block_table=np.array([[0, 1], [7, -1]], np.int32)), ValueError, r"block_table\[1, 0\] = 7 is not a page"),
    (dict(block_table=np.array([[0, -1], [2, -1]], np.int32)), ValueError, r"block_table\[0, 1\] = -1 is not a page"),
    (dict(cache_seqlens=np.array([31, 10], np.int32)), ValueError, r"cache_seqlens\[0\] \+ Nnew = 31 \+ 2 is past"),
    (dict(block_table=np.array([[0, 1], [0, -1]], np.int32)), ValueError, "written to page 0 row 10"),
    (dict(block_table=np.array([[0, 1]], np.int32)), ValueError, r"block_table must have shape \(B, max_blocks\)"),
    (dict(block_table=np.array([[0.0, 1.0], [2.0, 3.0]])), TypeError, "block_table must hold integers"),
    (dict(k_cache=np.zeros((4, 8, 1, 8), np.float32), v_cache=np.zeros((4, 8, 1, 8), np.float32)), ValueError,
     "page_size .* must be a positive multiple of 16"),
    (dict(v_cache=np.zeros((4, 16, 1, 4), np.float32)), ValueError, "k_cache and v_cache must have the same shape"),
    (dict(k_new=np.zeros((2, 1, 2, 8), np.float16)), TypeError, "k_new must have k_cache's dtype float32"),
    (dict(v_new=None), ValueError, "k_new and v_new go together"),
    (dict(q=np.zeros((2, 3, 1, 8), np.float32), k_cache=np.zeros((4, 16, 2, 8), np.float32),
          v_cache=np.zeros((4, 16, 2, 8), np.float32), k_new=None, v_new=None), ValueError, "multiple"),
])
def test_paged_errors_come_before_any_write(change, error, match):
    """Bad pages (outside the cache, or -1 among the pages a sequence uses), lengths past the
    table, an append onto a row another sequence reads (sequence 1 shares page 0 with sequence
    0's keys 0..15), malformed tables and caches: ``ValueError`` / ``TypeError`` naming the
    argument, and the caches untouched."""
    args = _paged_args(**change)
    k_cache, v_cache = args["k_cache"], args["v_cache"]
    before = k_cache.copy(), v_cache.copy()
    with pytest.raises(error, match=match):
        numba_flash.decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])


def test_paged_cache_full_by_default():
    """Without ``cache_seqlens`` every sequence holds ``max_blocks * page_size`` keys."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((3, 16, 2, 8)).astype(np.float32) for _ in range(2))
    table = np.array([[2, 0]], np.int32)
    o = numba_flash.decode(q, k_cache, v_cache, block_table=table)
    want, _ = reference.decode(q, k_cache, v_cache, block_table=table)
    assert rel_err(o, want) < 2e-6
    np.testing.assert_array_equal(numba_flash.decode(q, k_cache, v_cache, block_table=[[2, 0]]), o)  # (a list too)


def test_a_page_table_checked_once_serves_every_layer():
    """``page_table`` checks a table once; ``decode`` then takes it for any cache of that shape (a
    decode step's layers): each layer's result is the one of passing the table itself, appended
    keys included, and the checked object refuses what it was not made for."""
    rng = np.random.default_rng(8)
    B, H, Hkv, D, P, n_new = 2, 4, 2, 16, 16, 2
    lengths = np.array([30, 3], np.int32)
    table = np.array([[3, 0, 4], [1, -1, -1]], np.int32)
    checked = numba_flash.page_table(np.zeros((5, P, Hkv, D), np.float16), table, lengths, n_new=n_new)
    assert isinstance(checked, numba_flash.PageTable) and checked.batch == B and checked.n_new == n_new
    np.testing.assert_array_equal(checked.lengths, lengths + n_new)
    for layer in range(2):  # each layer's own cache, queries and new keys; one table
        k_cache, v_cache = (rng.standard_normal((5, P, Hkv, D)).astype(np.float16) for _ in range(2))
        q = rng.standard_normal((B, H, 1, D)).astype(np.float16)
        k_new, v_new = (rng.standard_normal((B, Hkv, n_new, D)).astype(np.float16) for _ in range(2))
        k2, v2 = k_cache.copy(), v_cache.copy()
        o1 = numba_flash.decode(q, k_cache, v_cache, block_table=checked, k_new=k_new, v_new=v_new, causal=True)
        o2 = numba_flash.decode(q, k2, v2, block_table=table, cache_seqlens=lengths, k_new=k_new, v_new=v_new,
                                causal=True)
        np.testing.assert_array_equal(o1, o2)
        np.testing.assert_array_equal(k_cache, k2)  # the same rows appended
        np.testing.assert_array_equal(v_cache, v2)
    q = np.zeros((B, H, 1, D), np.float16)
    caches = [np.zeros((5, P, Hkv, D), np.float16)] * 2
    with pytest.raises(ValueError, match="cache_seqlens must be None with a PageTable"):
        numba_flash.decode(q, *caches, block_table=checked, cache_seqlens=lengths, k_new=k_new, v_new=v_new)
    with pytest.raises(ValueError, match="a PageTable made for n_new 2, used with 0"):
        numba_flash.decode(q, *caches, block_table=checked)
    with pytest.raises(ValueError, match="a PageTable made for num_blocks 5, used with 6"):
        numba_flash.decode(q, *[np.zeros((6, P, Hkv, D), np.float16)] * 2, block_table=checked, k_new=k_new,
                           v_new=v_new)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1 is not a page"):
        numba_flash.page_table(caches[0], np.array([[3, -1, 4], [1, -1, -1]]), lengths, n_new=n_new)
    with pytest.raises(ValueError, match="n_new must be >= 0"):
        numba_flash.page_table(caches[0], table, lengths, n_new=-1)


def test_a_paged_argument_is_a_plain_tuple_not_a_device_array():
    """The launch paths tell a paged cache's ``(pages, block_table)`` from one array by its type: a
    ``launch.DeviceArray`` is a NamedTuple too, and must pass whole (a regression found on the GPU)."""
    from numba_flash.arrays import each
    from numba_flash.launch import DeviceArray
    from numba_flash.tensor_cores import _pages

    a = DeviceArray(16, (1, 1, 1, 8), (128, 128, 16, 2), "float16", 2, 8, True)
    assert each(lambda y: y, a) is a and _pages(a) is a
    assert each(lambda y: y.ptr, (a, a)) == (16, 16) and _pages((a, "table")) is a


def test_a_checked_page_table_is_planned_like_a_contiguous_cache(monkeypatch):
    """On a (fake) GPU, ``decode(block_table=PageTable)`` builds a plan once and then launches it
    with no check of the table read back: the second call of a signature repeats the first's
    launches without building a plan again, and each launch is given the table's and the lengths'
    pointers (``decoding._plan_decode``, ``_launch_paged``)."""
    import fake_gpu

    from numba_flash import decoding, paging, plans

    record = fake_gpu.install(monkeypatch.setattr, monkeypatch.setitem)
    plans.clear()
    try:
        built = []
        real = decoding._plan_decode
        monkeypatch.setattr(decoding, "_plan_decode", lambda *a: built.append(1) or real(*a))
        q = fake_gpu.cupy_array((4, 32, 1, 128), "float16")
        k, v = (fake_gpu.cupy_array((40, 16, 8, 128), "float16") for _ in range(2))
        table, lengths = fake_gpu.cupy_array((4, 8), "int32"), fake_gpu.cupy_array((4,), "int32")
        checked = paging.PageTable(table, lengths, 16, 40, 0, "cupy", 0, ())

        def call():
            return numba_flash.decode(q, k, v, block_table=checked, causal=True, return_lse=True)

        first = fake_gpu.launches(record, call)
        raw = [params for _, _, params in record.launches]
        second = fake_gpu.launches(record, call)
        assert first == second and len(built) == 1 and len(decoding._DECODE_PLANS) == 1
        assert raw and all(table.data.ptr in params and lengths.data.ptr in params for params in raw[:1])
        assert k.data.ptr in raw[0] and v.data.ptr in raw[0]  # the caches read where they are
    finally:
        plans.clear()
        fake_gpu.clear_host_caches()
