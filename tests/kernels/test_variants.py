"""The FA-1 -> FA-2 ablation space (``kernels.forward``, issue 10) in the simulator: every
variant computes attention (Hypothesis over shapes, tiles, causal, GQA and K/V tile orders),
its global traffic is what the model says for its loop order, and the switches are checked."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import examples, plain_fp16_attention, poisoned, random_qkv, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import reference
from numba_flash.api import forward
from numba_flash.kernels.forward import FA1, FA2, GRIDS, LOOP_ORDERS, O_LOADS, RESCALES, WARP_PARTITIONS, Variant

ALL_VARIANTS = [
    Variant(loop, grid, rescale, warps, o_load)
    for loop, grid, rescale, warps, o_load in itertools.product(LOOP_ORDERS, GRIDS, RESCALES, WARP_PARTITIONS, O_LOADS)
    if loop == "kv_outer" or o_load == "at_update"
]


def test_the_space_and_its_named_points():
    assert len(ALL_VARIANTS) == 24 and FA1 in ALL_VARIANTS and FA2 in ALL_VARIANTS
    assert (FA1.name, FA2.name) == ("fa1", "fa2")
    assert Variant("q_outer", "heads", "every_step").name == "q_outer-heads-every_step-split_q-at_update"
    with pytest.raises(ValueError, match="warp_partition"):
        Variant("q_outer", "heads", "deferred", "split_v")
    with pytest.raises(ValueError, match="loop_order"):
        Variant("k_outer", "heads", "deferred")
    with pytest.raises(ValueError, match="o_load"):
        Variant("q_outer", "heads", "deferred", "split_q", "with_q")


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=lambda v: v.name)
@settings(max_examples=examples(2), deadline=None)
@given(
    n_q=st.integers(1, 20),
    n_k=st.integers(1, 20),
    head_dim=st.sampled_from([1, 4, 8]),
    causal=st.booleans(),
    gqa=st.booleans(),
    permuted=st.booleans(),
    tiles=st.sampled_from([(4, 4), (8, 4), (4, 8), (8, 8)]),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_variant_is_attention(variant, n_q, n_k, head_dim, causal, gqa, permuted, tiles, data, seed):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 2, 1 if gqa else 2, n_q, n_k, head_dim, "float32")
    bm, bn = tiles
    order = None
    if permuted:
        order = data.draw(st.permutations(range(-(-n_k // bn))))
    o = poisoned(np, q.shape, np.float32)
    lse = poisoned(np, q.shape[:3], np.float32)
    forward(q, k, v, causal=causal, block_m=bm, block_n=bn, kv_tile_order=order, out=o, lse_out=lse,
            variant=variant, num_splits=1)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert rel_err(o, ref_o) < 2e-6
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", [v for v in ALL_VARIANTS if v.loop_order == "kv_outer"], ids=lambda v: v.name)
def test_kv_outer_variants_with_float16(variant):
    """O kept in float32 and cast at the end (deferred: normalised in the same pass)."""
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, 1, 1, 9, 11, 8, "float16")
    o, lse = forward(q, k, v, causal=True, block_m=4, block_n=4, variant=variant, precision="ieee")
    ref_o, _ = reference.attention(q, k, v, causal=True)
    assert o.dtype == np.float16 and rel_err(o, ref_o) < 2e-3


def test_variant_errors():
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 1, 1, 4, 4, 8, "float32")
    with pytest.raises(TypeError, match="variant"):
        forward(q, k, v, variant="fa1")
    with pytest.raises(ValueError, match="split_k on tensor cores .* block_n=16"):  # 8 keys a key-warp group
        forward(q, k, v, variant=Variant("q_outer", "heads", "deferred", "split_k"), precision="tf32x3", block_m=16,
                block_n=16)
    with pytest.raises(ValueError, match="CUDA-core"):  # the tensor-core copies run ahead of the walk
        forward(*(x.astype(np.float16) for x in (q, k, v)), variant=FA1, kv_tile_order=[0])
    with pytest.raises(ValueError, match="fa1"):  # kv_outer variants do not split their K/V walk
        forward(q, k, v, variant=Variant("kv_outer", "heads_x_qtiles", "deferred"), num_splits=2)
    o, _ = forward(q, k, v, variant=dict(loop_order="q_outer", grid="heads", rescale="every_step"), block_m=4, block_n=4)
    assert rel_err(o, reference.attention(q, k, v)[0]) < 2e-6


def test_split_k_needs_block_n_the_groups_can_share():
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 1, 1, 4, 4, 8, "float32")
    with pytest.raises(ValueError, match="split_k"):
        forward(q, k, v, variant=Variant("q_outer", "heads", "deferred", "split_k"), block_m=4, block_n=1)


def test_split_k_without_tiles_takes_the_comparison_tiles(monkeypatch):
    """FA-2's own float32 default at D = 64 on the GPU (128 x 64) gives split_k's static tiles
    107 KiB; a split_k variant whose caller names no tiles runs at the ablation's tiles instead of
    refusing (the GPU's tile table asked for here: the simulator's defaults are smaller)."""
    from numba_flash import tile_table

    monkeypatch.setattr(tile_table, "simulated", lambda: False)
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 1, 1, 1, 2, 3, 64, "float32")
    o, _ = forward(q, k, v, causal=True, variant=Variant("q_outer", "heads", "deferred", "split_k"))
    assert rel_err(o, reference.attention(q, k, v, causal=True)[0]) < 2e-6


def test_each_variant_has_its_launch_specification():
    """Grid, threads, shared memory, kernel and signature of a variant: one place (specs)."""
    import inspect

    from numba_flash.kernels.tiles import threads_per_block
    from numba_flash.specs import kernel_spec

    per_tile_split_k = Variant("kv_outer", "heads_x_qtiles", "deferred", "split_k")
    spec = kernel_spec("fa2", 64, "float32", 64, 32, variant=per_tile_split_k)
    assert spec.algorithm == "fa1" and spec.kv_outer and spec.per_q_tile  # the loop order's family
    assert spec.grid(2, 3, 100, n_splits=4) == (2 * 3 * 2,)  # kv_outer does not split
    assert spec.threads == 2 * threads_per_block(64, 64, 16)
    assert spec.smem_bytes == 46592  # ptxas sm_90 reports the same (offline)
    assert len(spec.signature()) == len(inspect.signature(spec.kernel.py_func).parameters)
    per_head = kernel_spec("fa2", 64, "float32", 64, 32, variant=Variant("q_outer", "heads", "every_step"))
    assert per_head.grid(2, 3, 100, n_splits=4) == (2 * 3 * 4,)
    assert kernel_spec("fa1", 64, "float32", 64, 32, variant=FA2).variant is None  # a named point: fa2's own


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=lambda v: v.name)
def test_every_variant_runs_on_tensor_cores(variant):
    """The same loop nests on the mma engine (``kernels.engines``): every point of the space is
    attention in float16 (FlashAttention's rule: at most twice a plain float16 implementation's
    error against float64), causal, GQA, lengths no tile divides, and a row that sees no key
    (Nq > Nk, causal: o = 0, lse = -inf). split_k's two groups of key warps take 16 keys each
    of a 32-key tile: two K/V tiles, the second with 5 keys (its second group sees none)."""
    rng = np.random.default_rng(11)
    split_k = variant.warp_partition == "split_k"
    n_q, n_k, block_n = (40, 37, 32) if split_k else (21, 18, 16)
    q, k, v = random_qkv(rng, 1, 2, 1, n_q, n_k, 16, "float16")
    o = poisoned(np, q.shape, np.float16)
    lse = poisoned(np, q.shape[:3], np.float32)
    forward(q, k, v, causal=True, block_m=16, block_n=block_n, out=o, lse_out=lse, variant=variant, num_splits=1)
    ref_o, ref_lse = reference.attention(q, k, v, causal=True)
    plain = plain_fp16_attention(q, k, v, causal=True)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert rel_err(o, ref_o) <= 2 * rel_err(plain, ref_o)
    np.testing.assert_array_equal(o[:, :, :3], 0)  # rows 0..2 see no key
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("kind", ["bf16", "tf32x3"])
@pytest.mark.parametrize("loop_order", LOOP_ORDERS)
def test_split_k_on_tensor_cores_with_two_warps_a_group(kind, loop_order):
    """split_k on tensor cores with 32-row Q tiles (two warps in each key-warp group, the merge
    of the groups over 64 threads each) and 64-key tiles: bfloat16, and float32 in split
    precision (whose pre-split operands split_k does without), GQA, not causal, head dim 24
    (padded to the products' 32), a K/V tile of 40 keys: the second group's half holds 8."""
    rng = np.random.default_rng(12)
    import ml_dtypes

    dtype, precision = (ml_dtypes.bfloat16, None) if kind == "bf16" else (np.float32, "tf32x3")
    heads = 2 if kind == "bf16" else 1  # GQA on the bfloat16 cases (tf32x3 changes the products, not the heads)
    q, k, v = random_qkv(rng, 1, heads, 1, 33, 40, 24, dtype)  # 2 Q tiles (1 row in the second); group 1 sees 8 keys
    variant = Variant(loop_order, "heads_x_qtiles", "deferred", "split_k")
    o, lse = forward(q, k, v, block_m=32, block_n=64, variant=variant, precision=precision)
    ref_o, ref_lse = reference.attention(q, k, v)
    as64 = (lambda x: np.asarray(x, np.float64))
    bound = 2e-2 if kind == "bf16" else 1e-5
    assert rel_err(as64(o), ref_o) < bound
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-3 if kind == "bf16" else 1e-5)
