"""Split-KV (API.md section 2b) on the real kernels, in the simulator.

The claim under test is the seeds' algebra carried onto the GPU code: partial softmax states
over disjoint key ranges, merged by ``kernels.combine`` (twin of ``online.combine``, itself a
fold of ``online.merge``), give the single-pass result whatever the cut points and the order
of the partials; a split that sees only masked keys contributes nothing and never a NaN.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from helpers import examples, poisoned, random_qkv, rel_err, to_numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import online, reference
from numba_flash.api import attention, forward
from numba_flash.arrays import ArrayContext
from numba_flash.split_kv import MAX_SPLITS, combine, num_splits_heuristic

# (dtype, precision) of each regime the FA-2 kernel runs in
REGIMES = [("float32", None), ("float16", None), ("float32", "tf32x3"), ("float16", "ieee")]
TOL = {"float32": 2e-6, "float16": 2e-3}  # relative, split against unsplit (float32 partials)


def run_split(q, k, v, **kw):
    B, H, Nq, D = q.shape
    o = np.full((B, H, Nq, D), np.nan, dtype=q.dtype)
    lse = poisoned(np, (B, H, Nq), np.float32)
    return forward(q, k, v, out=o, lse_out=lse, **kw)


@settings(max_examples=examples(4), deadline=None)  # (the simulator's time)
@given(
    regime=st.sampled_from(REGIMES),
    n_splits=st.integers(2, 6),
    n_q=st.integers(1, 20),
    n_k=st.integers(1, 70),
    causal=st.booleans(),
    gqa=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_split_equals_unsplit_and_reference(regime, n_splits, n_q, n_k, causal, gqa, seed):
    dtype, precision = regime
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 2, 1 if gqa else 2, n_q, n_k, 16, dtype)
    kw = dict(causal=causal, precision=precision, block_m=16, block_n=16)
    o1, l1 = run_split(q, k, v, num_splits=1, **kw)
    o_s, l_s = run_split(q, k, v, num_splits=n_splits, **kw)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal)
    got = o_s.astype(np.float64)
    assert not np.isnan(got).any() and not np.isnan(l_s).any()
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(l_s), seen)  # fully masked rows: -inf, o = 0
    assert (got[~seen] == 0).all()
    assert rel_err(got, o1.astype(np.float64)) <= TOL[dtype]
    assert rel_err(got, ref_o) <= max(4 * rel_err(o1, ref_o), TOL[dtype])
    np.testing.assert_allclose(l_s[seen], l1[seen], rtol=1e-6, atol=1e-6)


def _device_combine(o_parts, lse_parts):
    """``kernels.combine`` on NumPy partials ``(S, rows, D)``, ``(S, rows)``."""
    S, rows, D = o_parts.shape
    o = poisoned(np, (1, 1, rows, D), np.float32)
    lse = poisoned(np, (1, 1, rows), np.float32)
    combine(ArrayContext("numpy", o), o_parts.reshape(S, 1, rows, D).astype(np.float32),
            lse_parts.reshape(S, 1, rows).astype(np.float32), o, lse)
    return o[0, 0], lse[0, 0]


@settings(max_examples=examples(4), deadline=None)
@given(
    n_k=st.integers(2, 60),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_kernel_partials_at_random_cuts_combine_to_single_pass(n_k, data, seed):
    """Cut the keys anywhere (not on tile boundaries), run the real FA-2 kernel on each piece,
    merge the partials with the real combine kernel: the single-pass result."""
    cuts = sorted(data.draw(st.sets(st.integers(1, n_k - 1), max_size=3)))
    bounds = [0, *cuts, n_k]
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 1, 1, 5, n_k, 16, "float32")
    parts = [attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True, block_m=16, block_n=16)
             for a, b in zip(bounds, bounds[1:])]
    o_parts = np.stack([o[0, 0] for o, _ in parts])
    lse_parts = np.stack([lse[0, 0] for _, lse in parts])
    o, lse = _device_combine(o_parts, lse_parts)
    whole_o, whole_lse = attention(q, k, v, return_lse=True, block_m=16, block_n=16)
    assert rel_err(o, whole_o[0, 0]) < 2e-6
    np.testing.assert_allclose(lse, whole_lse[0, 0], rtol=1e-6, atol=1e-6)
    twin_o, twin_lse = online.combine(o_parts, lse_parts)  # the NumPy twin agrees
    assert rel_err(o, twin_o) < 1e-6
    np.testing.assert_allclose(lse, twin_lse, rtol=1e-6, atol=1e-6)


lse_values = st.one_of(st.floats(-30, 30), st.just(-np.inf))


@settings(max_examples=examples(4), deadline=None)
@given(
    lse_parts=st.lists(st.lists(lse_values, min_size=3, max_size=3), min_size=1, max_size=5),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_combine_kernel_is_the_twin_and_order_invariant(lse_parts, data, seed):
    lse_parts = np.array(lse_parts, dtype=np.float32)
    S = lse_parts.shape[0]
    rng = np.random.default_rng(seed)
    o_parts = rng.standard_normal((S, 3, 8)).astype(np.float32)
    o_parts[lse_parts == -np.inf] = 0.0  # an empty partial, as the kernel writes it
    o, lse = _device_combine(o_parts, lse_parts)
    twin_o, twin_lse = online.combine(o_parts, lse_parts)
    np.testing.assert_allclose(o, twin_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, twin_lse, rtol=1e-6, atol=1e-6)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    perm = data.draw(st.permutations(range(S)))
    o_p, lse_p = _device_combine(o_parts[perm], lse_parts[perm])
    np.testing.assert_allclose(o_p, o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse_p, lse, rtol=1e-6, atol=1e-6)


def _launch_combine(o_parts, lse_parts, shape, bits=None, block=None):
    """The combine kernel on NumPy partials ``(S*B, H, Nq, >= D)``, ``(S*B, H, Nq)`` into fresh
    NaN-poisoned outputs of ``shape``; ``block``: another block than ``combine_launch``'s."""
    from numba_flash.kernels.combine import combine_launch

    S = lse_parts.shape[0] // shape[0]
    kernel, grid, launch_block = combine_launch(S, shape, bits)
    o = poisoned(np, shape, np.float32) if bits is None else np.full(shape, 0x7FC0, np.uint16)
    lse = poisoned(np, shape[:3], np.float32)
    kernel[grid, block or launch_block](o_parts, lse_parts, o, lse)
    return o, lse


def _twin(o_parts, lse_parts, shape):
    """``online.combine`` of every (b, h, i) row of split-major partials, ``(B, H, Nq, D)``."""
    B, H, Nq, D = shape
    S = lse_parts.shape[0] // B
    o_rows = o_parts[..., :D].reshape(S, B * H * Nq, D)
    o, lse = online.combine(o_rows, lse_parts.reshape(S, -1))
    return np.asarray(o).reshape(shape), np.asarray(lse).reshape(shape[:3])


def _partials(rng, S, shape, pad=0):
    """Split-major partials ``(S*B, H, Nq, D + pad)`` and their lse, about a quarter of them
    empty (lse -inf, o NaN: an empty partial must add nothing whatever its o holds)."""
    B, H, Nq, D = shape
    lse_parts = (rng.standard_normal((S * B, H, Nq)) * 4).astype(np.float32)
    lse_parts[rng.random(lse_parts.shape) < 0.25] = -np.inf
    o_parts = rng.standard_normal((S * B, H, Nq, D + pad)).astype(np.float32)
    o_parts[lse_parts == -np.inf] = np.nan
    return o_parts, lse_parts


@pytest.mark.parametrize("S, shape", [
    (3, (2, 3, 5, 40)),  # one warp per row, 4 rows per block, the last block part empty; D off the 32 grid
    (12, (1, 2, 3, 70)),  # two warps per row (a barrier), 2 rows per block, 3 columns per lane
    (20, (2, 1, 1, 8)),  # three warps per row, D < 32
    (128, (1, 1, 2, 33)),  # 16 warps per row, 4 lse per lane
])
def test_combine_kernel_launch_shapes_match_the_twin(S, shape):
    rng = np.random.default_rng(S)
    o_parts, lse_parts = _partials(rng, S, shape, pad=3)
    o, lse = _launch_combine(o_parts, lse_parts, shape)
    clean = np.where(np.isnan(o_parts), 0.0, o_parts).astype(np.float32)  # the twin weighs o by 0
    twin_o, twin_lse = _twin(clean, lse_parts, shape)
    np.testing.assert_allclose(o, twin_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, twin_lse, rtol=1e-6, atol=1e-6)
    assert not np.isnan(o).any()


def test_combine_kernel_in_rounds_when_the_block_has_fewer_warps():
    """A block of one warp per row still merges all 20 splits (chunks 0, 1, 2 in turn)."""
    shape = (1, 1, 2, 16)
    o_parts, lse_parts = _partials(np.random.default_rng(1), 20, shape)
    o, lse = _launch_combine(o_parts, lse_parts, shape, block=(32, 1, 1))
    twin_o, twin_lse = _twin(np.where(np.isnan(o_parts), 0.0, o_parts).astype(np.float32), lse_parts, shape)
    np.testing.assert_allclose(o, twin_o, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, twin_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("S", [3, 10])
def test_combine_kernel_nan_lse_makes_its_row_nan_only(S):
    shape = (1, 1, 3, 8)
    rng = np.random.default_rng(2)
    lse_parts = rng.standard_normal((S, 1, 3)).astype(np.float32)
    lse_parts[S - 1, 0, 1] = np.nan
    lse_parts[:, 0, 2] = -np.inf  # an all-empty row beside it
    o_parts = rng.standard_normal((S, 1, 3, 8)).astype(np.float32)
    o_parts[:, 0, 2] = 0.0
    o, lse = _launch_combine(o_parts, lse_parts, shape)
    assert np.isnan(o[0, 0, 1]).all() and np.isnan(lse[0, 0, 1])
    assert not np.isnan(o[0, 0, 0]).any() and np.isfinite(lse[0, 0, 0])
    assert (o[0, 0, 2] == 0).all() and lse[0, 0, 2] == -np.inf


def test_combine_kernel_bf16_patterns():
    """``bits="bf16"``: o holds the bfloat16 patterns of the float32 result (nearest)."""
    shape = (1, 2, 3, 40)
    o_parts, lse_parts = _partials(np.random.default_rng(3), 9, shape)
    o32, _ = _launch_combine(o_parts, lse_parts, shape)
    o16, _ = _launch_combine(o_parts, lse_parts, shape, bits="bf16")
    widened = (o16.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_allclose(widened, o32, rtol=2.0**-8, atol=0)


def test_online_combine_is_merge_folded_then_finalized():
    rng = np.random.default_rng(3)
    states = []
    for _ in range(4):
        s = rng.standard_normal((2, 5)) * 3
        states.append(online.update(online.empty_state(2, 4), s, rng.standard_normal((5, 4))))
    parts = [online.finalize(st_) for st_ in states]
    o, lse = online.combine(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    merged = states[0]
    for st_ in states[1:]:
        merged = online.merge(merged, st_)
    ref_o, ref_lse = online.finalize(merged)
    np.testing.assert_allclose(o, ref_o, rtol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12)


@settings(max_examples=examples(60), deadline=None)
@given(n_tiles=st.integers(0, 300), n_splits=st.integers(1, MAX_SPLITS))
def test_split_ranges_cover_the_tiles_once(n_tiles, n_splits):
    """``block_info.split_tiles`` (API.md 2b: the K/V sequence cut into ``num_splits`` contiguous
    ranges) gives each tile to exactly one split, in order, none to a split past the tiles."""
    from numba_flash.kernels.block_info import split_tiles

    ranges = [range(*split_tiles.py_func(n_tiles, n_splits, s)) for s in range(n_splits)]
    assert list(itertools.chain.from_iterable(ranges)) == list(range(n_tiles))
    assert all(len(r) <= -(-n_tiles // n_splits) for r in ranges)


def test_all_empty_partials_give_zero_and_minus_inf():
    o_parts = np.zeros((3, 2, 4))
    lse_parts = np.full((3, 2), -np.inf)
    for o, lse in (online.combine(o_parts, lse_parts), _device_combine(o_parts, lse_parts)):
        assert (np.asarray(o) == 0).all() and (np.asarray(lse) == -np.inf).all()


def test_splits_past_the_causal_diagonal_contribute_nothing():
    """Nq > Nk, causal: the first rows see no key; with 4 splits most partials are empty."""
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 1, 1, 40, 20, 16, "float32")
    o, lse = run_split(q, k, v, causal=True, num_splits=4, block_m=16, block_n=16)
    ref_o, ref_lse = reference.attention(q, k, v, causal=True)
    assert (o[0, 0, :20] == 0).all() and (lse[0, 0, :20] == -np.inf).all()
    assert rel_err(o, ref_o) < 2e-6


def test_more_splits_than_tiles_and_fa1_refusal():
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 1, 1, 1, 3, 10, 8, "float32")
    o, _ = run_split(q, k, v, num_splits=5, block_m=16, block_n=16)  # one tile, five splits
    assert rel_err(o, reference.attention(q, k, v)[0]) < 2e-6
    with pytest.raises(ValueError, match="fa1"):
        attention(q, k, v, algorithm="fa1", num_splits=2)
    attention(q, k, v, algorithm="fa1", num_splits=1, block_m=16, block_n=16)  # accepted


@pytest.mark.parametrize("bad, error", [(0, ValueError), (MAX_SPLITS + 1, ValueError), (True, TypeError), (2.0, TypeError)])
def test_bad_num_splits(bad, error):
    q, k, v = random_qkv(np.random.default_rng(0), 1, 1, 1, 2, 4, 8, "float32")
    with pytest.raises(error, match="num_splits"):
        attention(q, k, v, num_splits=bad)


def test_heuristic():
    assert num_splits_heuristic(blocks=2000, sms=132, resident=4, kv_tiles=64) == 1  # a full grid: no split
    assert num_splits_heuristic(blocks=8, sms=132, resident=5, kv_tiles=7) == 1  # too few tiles to share
    s = num_splits_heuristic(blocks=8, sms=132, resident=5, kv_tiles=2048)  # decoding B1 Hkv8
    assert 25 <= s <= 33  # about 75% of 2 blocks per SM (264 slots), the blocks nearly even over the SMs
    assert 8 * s / 132 / math.ceil(8 * s / 132) >= 0.95
    for blocks, sms, resident, tiles in itertools.product([1, 3, 8, 50, 500], [1, 132], [1, 5], [2, 5, 17, 300, 5000]):
        s = num_splits_heuristic(blocks, sms, resident, tiles)
        assert 1 <= s <= max(1, min(tiles // 4, MAX_SPLITS))
        if s > 1:  # it fills at least 75% of the resident blocks, unless capped
            assert blocks * s >= 0.75 * sms * min(resident, 2) or s == min(tiles // 4, MAX_SPLITS)
