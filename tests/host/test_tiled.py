"""The loop nests on the online-softmax algebra (``numba_flash.tiled``): equal to the
materialised reference for any tiles, and the tile-level oracle of the kernels' state."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    FLOAT32_UNIT_ROUNDOFF,
    examples,
    output_rounding_bound,
    random_qkv,
    score_rounding_bound,
    to_numpy,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import online, reference, tiled
from numba_flash.kernels.jit import LOG2E

ORACLES = {"fa1": tiled.fa1_tiled, "fa2": tiled.fa2_tiled}


@settings(max_examples=examples(40))
@given(
    algorithm=st.sampled_from(sorted(ORACLES)),
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    n_q=st.integers(0, 13),
    n_k=st.integers(0, 13),
    head_dim=st.integers(1, 6),
    block_m=st.integers(1, 8),
    block_n=st.integers(1, 8),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.1, 30.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_loop_nests_equal_the_reference(algorithm, batch, kv_heads, group, n_q, n_k, head_dim, block_m, block_n,
                                        causal, scale, seed):
    """Any tiles (not only powers of two), GQA, causal with Nq != Nk (rows that see nothing),
    empty lengths: the tiled walk is the same function as softmax(S) V, to float64 rounding."""
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch, kv_heads * group, kv_heads, n_q, n_k, head_dim, "float64")
    o, lse = ORACLES[algorithm](q, k, v, block_m, block_n, causal, scale)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, scale=scale)
    np.testing.assert_allclose(o, ref_o, rtol=1e-12, atol=1e-12)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_fa2_is_update_then_one_division():
    """One Q tile, two K/V tiles: fa2_tiled is literally update(update(empty, S_1, V_1), S_2, V_2)."""
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 1, 1, 1, 3, 4, 2, "float64")
    s = q[0, 0] @ k[0, 0].T / np.sqrt(2)
    state = online.update(online.update(online.empty_state(3, 2), s[:, :2], v[0, 0, :2]), s[:, 2:], v[0, 0, 2:])
    o, lse = tiled.fa2_tiled(q, k, v, block_m=3, block_n=2)
    want_o, want_lse = online.finalize(state)
    assert np.array_equal(o[0, 0], want_o) and np.array_equal(lse[0, 0], want_lse)


def test_the_two_walks_differ_but_agree():
    """FA-1 renormalises O at every step, FA-2 divides once: different roundings, same function."""
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, 1, 1, 9, 11, 3, "float64", scale=2.0)
    o1, _ = tiled.fa1_tiled(q, k, v, 4, 2)
    o2, _ = tiled.fa2_tiled(q, k, v, 4, 2)
    assert not np.array_equal(o1, o2)
    np.testing.assert_allclose(o1, o2, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fa1_kernel_state_in_global_memory_is_the_loop_nests(causal, xp, rng):
    """The FA-1 kernel's O, l, m in global memory at the end (what it carried from K/V tile to
    K/V tile) against fa1_tiled's: l and O equal up to float32 rounding, m in log2 units."""
    from numba_flash._world import simulated
    from numba_flash.api import kernel_for
    from numba_flash.kernels.tiles import threads_per_block

    if not simulated():
        pytest.skip("launches the kernel on NumPy arrays (the simulator writes them back)")
    B, H, Nq, Nk, D, bm, bn = 1, 2, 7, 9, 5, 4, 2
    q, k, v = random_qkv(rng, B, H, 1, Nq, Nk, D, "float32")
    o_hbm = np.full((B, H, Nq, D), np.nan, np.float32)
    l_hbm, m_hbm, lse = (np.full((B, H, Nq), np.nan, np.float32) for _ in range(3))
    kernel = kernel_for("fa1", D, bm, bn, causal, "float32")
    scale = 1 / np.sqrt(D)
    kernel[B * H, threads_per_block(D, bm, bn)](q, k, v, np.zeros((1, 1, 1, 1), np.float32), lse, o_hbm, l_hbm, m_hbm,
                                                np.float32(scale * LOG2E), np.zeros(1, np.int32), np.zeros(1, np.int32),
                                                np.int32(1), np.int32(1), np.float32(0.0), np.zeros((1, 1), np.float32))
    want_o, want_lse, want_m, want_l = tiled.fa1_tiled(q, k, v, bm, bn, causal, return_state=True)
    seen = np.isfinite(want_m)
    assert np.array_equal(np.isneginf(m_hbm), ~seen) and (l_hbm[~seen] == 0).all()
    # Bounds: the scores are off by at most delta (float32 rounding, helpers.score_rounding_bound),
    # so m by delta, l by a factor exp(+-2 delta), O by output_rounding_bound; the sums of at
    # most Nk + 2 Nk/bn roundings add (Nk + 2 Nk/bn + 4) u relative (u = 2^-24).
    delta = score_rounding_bound(q, k, None, causal)
    sums = (Nk + 2 * -(-Nk // bn) + 4) * FLOAT32_UNIT_ROUNDOFF
    assert (np.abs(m_hbm[seen] / LOG2E - want_m[seen]) <= delta[seen] + sums * np.abs(want_m[seen])).all()
    assert (np.abs(l_hbm[seen] / want_l[seen] - 1) <= np.expm1(2 * delta[seen]) + sums).all()
    excess = np.abs(o_hbm - want_o) - output_rounding_bound(q, k, v, want_o, None, causal)
    assert (excess <= sums * np.abs(v).max()).all(), excess.max()
    assert (np.abs(to_numpy(lse)[seen] - want_lse[seen]) <= delta[seen] + sums * (1 + np.abs(want_lse[seen]))).all()
