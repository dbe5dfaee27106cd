"""The ablation variants (``kernels.forward``) on a real GPU (``pytest -m gpu``; skipped in the
simulator): every point against float64 on shapes larger than the simulator reaches."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant_name", [
    "kv_outer-heads-every_step-split_q-at_update", "kv_outer-heads-every_step-split_k-at_update",
    "kv_outer-heads-deferred-split_q-with_q", "kv_outer-heads_x_qtiles-every_step-split_q-at_update",
    "kv_outer-heads_x_qtiles-deferred-split_k-with_q", "q_outer-heads-every_step-split_q-at_update",
    "q_outer-heads-deferred-split_k-at_update", "q_outer-heads_x_qtiles-every_step-split_k-at_update",
    "q_outer-heads_x_qtiles-deferred-split_q-at_update",
])
def test_variant_large(variant_name, causal):
    cp = pytest.importorskip("cupy")
    from numba_flash.research.ablation import parse_variant
    from numba_flash.api import forward
    from numba_flash.baselines import cupy_attention

    rng = cp.random.default_rng(5)
    q = rng.standard_normal((2, 4, 700, 64), dtype=cp.float32)
    k, v = (rng.standard_normal((2, 2, 1100, 64), dtype=cp.float32) for _ in range(2))
    o = cp.full(q.shape, math.nan, dtype=cp.float32)
    lse = cp.full(q.shape[:3], math.nan, dtype=cp.float32)
    forward(q, k, v, causal=causal, variant=parse_variant(variant_name), out=o, lse_out=lse, num_splits=1)
    ref = cupy_attention(*(x.astype(cp.float64) for x in (q, k, v)), causal=causal)
    assert not bool(cp.isnan(o).any())
    assert float(cp.linalg.norm(o - ref) / cp.linalg.norm(ref)) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant_name", [
    "kv_outer-heads-every_step-split_q-at_update", "kv_outer-heads-deferred-split_q-with_q",
    "kv_outer-heads_x_qtiles-every_step-split_q-with_q", "kv_outer-heads_x_qtiles-deferred-split_q-at_update",
    "q_outer-heads-every_step-split_q-at_update", "q_outer-heads_x_qtiles-every_step-split_q-at_update",
    "kv_outer-heads-every_step-split_k-at_update", "kv_outer-heads_x_qtiles-deferred-split_k-with_q",
    "q_outer-heads-deferred-split_k-at_update", "q_outer-heads_x_qtiles-deferred-split_k-at_update",
])
def test_variant_large_on_tensor_cores(variant_name, causal):
    """The same variants on the mma engine (float16 inputs): FlashAttention's rule, at most twice a
    plain float16 implementation's error against float64, on 700 queries x 1100 keys with GQA."""
    cp = pytest.importorskip("cupy")
    from helpers import plain_fp16_attention, rel_err

    from numba_flash.api import forward
    from numba_flash.baselines import cupy_attention
    from numba_flash.research.ablation import parse_variant

    rng = cp.random.default_rng(6)
    q = rng.standard_normal((2, 4, 700, 64), dtype=cp.float32).astype(cp.float16)
    k, v = (rng.standard_normal((2, 2, 1100, 64), dtype=cp.float32).astype(cp.float16) for _ in range(2))
    o = cp.full(q.shape, math.nan, dtype=cp.float16)
    lse = cp.full(q.shape[:3], math.nan, dtype=cp.float32)
    forward(q, k, v, causal=causal, variant=parse_variant(variant_name), out=o, lse_out=lse, num_splits=1)
    ref = cupy_attention(*(x.astype(cp.float64) for x in (q, k, v)), causal=causal)
    plain = plain_fp16_attention(q, k, v, causal=causal)  # S, P and O rounded to float16
    ref = cp.asnumpy(ref)
    assert not bool(cp.isnan(o).any()) and not bool(cp.isnan(lse).any())
    assert rel_err(cp.asnumpy(o), ref) <= 2 * rel_err(plain, ref)


@pytest.mark.parametrize("loop_order", ["kv_outer", "q_outer"])
def test_split_k_on_tensor_cores_at_sixteen_warps(loop_order):
    """split_k on tensor cores at TF32's 128 x 64 tiles: two groups of 8 warps, 512 threads, so
    the kernel is compiled under a 128-register cap (``specs.kernel_spec``) or it would not
    launch; the merge's states sit over the tiles (q_outer) or after them (kv_outer)."""
    cp = pytest.importorskip("cupy")
    from numba_flash.api import forward
    from numba_flash.baselines import cupy_attention
    from numba_flash.kernels.forward import Variant
    from numba_flash.specs import kernel_spec

    variant = Variant(loop_order, "heads_x_qtiles", "deferred", "split_k")
    spec = kernel_spec("fa2", 64, "float32", 128, 64, regime="tf32", variant=variant)
    assert (spec.threads, spec.register_cap) == (512, 128)
    rng = cp.random.default_rng(7)
    q = rng.standard_normal((1, 4, 900, 64), dtype=cp.float32)
    k, v = (rng.standard_normal((1, 2, 1000, 64), dtype=cp.float32) for _ in range(2))
    o = cp.full(q.shape, math.nan, dtype=cp.float32)
    lse = cp.full(q.shape[:3], math.nan, dtype=cp.float32)
    forward(q, k, v, causal=True, variant=variant, precision="tf32", block_m=128, block_n=64, out=o, lse_out=lse,
            num_splits=1)
    ref = cupy_attention(*(x.astype(cp.float64) for x in (q, k, v)), causal=True)
    assert not bool(cp.isnan(o).any()) and not bool(cp.isnan(lse).any())
    assert float(cp.linalg.norm(o - ref) / cp.linalg.norm(ref)) < 2e-3  # TF32's 10-bit mantissa
