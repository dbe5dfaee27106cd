"""Chunk-order invariance on the real kernels (the seed's third property): walking the
K/V tiles in any order changes the result by rounding only."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    assert_equal_up_to_rounding,
    examples,
    output_rounding_bound,
    random_qkv,
    score_rounding_bound,
    to_numpy,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import reference
from numba_flash.api import forward


@st.composite
def problems(draw):
    block_n = draw(st.sampled_from([1, 2, 4]))
    n_k = draw(st.integers(1, 12))
    n_tiles = -(-n_k // block_n)
    order = draw(st.permutations(list(range(n_tiles))))
    return dict(
        algorithm=draw(st.sampled_from(["fa1", "fa2"])),
        n_q=draw(st.integers(1, 9)),
        n_k=n_k,
        head_dim=draw(st.integers(1, 6)),
        block_m=draw(st.sampled_from([2, 4, 8])),
        block_n=block_n,
        causal=draw(st.booleans()),
        order=order,
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=examples(10))
@given(p=problems())
def test_any_tile_order_gives_the_same_output(p, xp):
    rng = np.random.default_rng(p["seed"])
    q, k, v = random_qkv(rng, 1, 2, 1, p["n_q"], p["n_k"], p["head_dim"], "float32", xp)
    kw = dict(causal=p["causal"], algorithm=p["algorithm"], block_m=p["block_m"], block_n=p["block_n"])
    o_fwd, lse_fwd = forward(q, k, v, **kw)
    o_perm, lse_perm = forward(q, k, v, kv_tile_order=p["order"], **kw)
    ref_o, _ = reference.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=p["causal"])
    # Each walk is within the score-rounding bound of the exact result (it grows with |score|),
    # so the two are within twice that of each other; beyond it, rounding of the sums only.
    allowed = output_rounding_bound(q, k, v, ref_o, None, p["causal"])
    assert_equal_up_to_rounding(o_perm, o_fwd, ref_o, 2 * allowed, 1e-6)
    assert_equal_up_to_rounding(o_perm, ref_o, ref_o, allowed, 2e-6)
    delta = score_rounding_bound(q, k, None, p["causal"])
    lse_perm, lse_fwd = to_numpy(lse_perm), to_numpy(lse_fwd)
    assert np.array_equal(np.isneginf(lse_perm), np.isneginf(lse_fwd))
    fin = np.isfinite(lse_fwd)
    gap = np.abs(lse_perm[fin] - lse_fwd[fin]) - (1e-6 + 1e-6 * np.abs(lse_fwd[fin]) + 2 * delta[fin])
    assert (gap <= 0).all(), (lse_perm, lse_fwd, delta)


def test_reverse_order_really_changes_the_walk(xp, rng):
    """Guard against a knob that is silently ignored: the sums are reassociated, so with
    many tiles of very different scales the last bits differ somewhere."""
    q, k, v = random_qkv(rng, 1, 1, 1, 8, 32, 4, "float32", xp, scale=3.0)
    n_tiles = 32
    o_fwd, _ = forward(q, k, v, algorithm="fa2", block_m=8, block_n=1)
    o_rev, _ = forward(q, k, v, algorithm="fa2", block_m=8, block_n=1, kv_tile_order=list(range(n_tiles))[::-1])
    assert not np.array_equal(to_numpy(o_fwd), to_numpy(o_rev))
    ref_o, _ = reference.attention(to_numpy(q), to_numpy(k), to_numpy(v))
    assert_equal_up_to_rounding(o_rev, o_fwd, ref_o, 2 * output_rounding_bound(q, k, v, ref_o), 1e-5)


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 1], [1, 2, 3], [[0, 1, 2]]])
def test_order_must_be_a_permutation(order, xp, rng):
    q, k, v = random_qkv(rng, 1, 1, 1, 4, 6, 2, "float32", xp)
    with pytest.raises(ValueError, match=r"permutation of range\(3\)"):
        forward(q, k, v, block_n=2, kv_tile_order=order)
