"""``numba_flash.attention_backward`` (API.md section 5) on CUDA cores (``kernels.bwd``) in the
simulator: both loop orders (FlashAttention Algorithm 4, FlashAttention-2 Algorithm 2 with
atomics or deterministic) against the float64 reference gradients, on small awkward shapes:
causal with Nq != Nk (rows that see no key), GQA, lengths that are not multiples of a tile,
D = 1, float16 and bfloat16 inputs (those through ``gradients(precision="ieee")``: by default
they run on tensor cores, ``test_backward_tc.py``). ``attention_backward`` runs float32 on
split-precision tensor cores by default (``backward.TF32X3_BACKWARD``, ``test_backward_tf32x3.py``);
here the switch is off, so its float32 calls reach the CUDA-core kernels."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import backward_problem as problem
from helpers import examples, gradient_error
from helpers import max_rel as rel
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import reference
from numba_flash.backward import attention_backward, gradients

VARIANTS = [("fa2", False), ("fa2", True), ("fa1", False)]


@pytest.fixture(autouse=True)
def cuda_core_float32(monkeypatch):
    """float32 through ``attention_backward`` on the CUDA-core kernels this file tests."""
    from numba_flash import backward

    monkeypatch.setattr(backward, "TF32X3_BACKWARD", False)


TOL = {"float32": 2e-5, "float16": 2e-2, "bfloat16": 1e-1}  # relative to the largest gradient


@settings(max_examples=examples(4), deadline=None)  # (the simulator's time; test_tile_edges pins the edges)
@given(
    variant=st.sampled_from(VARIANTS),
    dtype=st.sampled_from(["float32", "float32", "float16", "bfloat16"]),
    gqa=st.booleans(),
    n_q=st.integers(1, 19),
    n_k=st.integers(1, 19),
    head_dim=st.sampled_from([1, 4, 8]),
    causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_gradients_match_float64_reference(variant, dtype, gqa, n_q, n_k, head_dim, causal, seed):
    algorithm, deterministic = variant
    do, q, k, v, o, lse = problem(np.random.default_rng(seed), 1, 2, 1 if gqa else 2, n_q, n_k, head_dim, dtype, causal)
    grads = gradients(do, q, k, v, o, lse, causal=causal, algorithm=algorithm, deterministic=deterministic,
                      precision="ieee")
    # The reference of the inputs as the kernels saw them (16-bit values widened exactly).
    refs = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), causal=causal)
    for name, got, ref, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        assert not np.isnan(np.asarray(got, np.float64)).any(), name
        err = gradient_error(got, ref, refs)
        assert err < TOL[dtype], (name, err)


def test_rows_that_see_no_key_have_zero_gradients():
    """Causal, Nq > Nk: the first Nq - Nk rows see nothing; their dq is exactly 0, and they
    add nothing to dk, dv."""
    rng = np.random.default_rng(1)
    do, q, k, v, o, lse = problem(rng, 1, 1, 1, 12, 5, 8, "float32", True)
    for algorithm, deterministic in VARIANTS:
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, causal=True, algorithm=algorithm, deterministic=deterministic)
        assert (dq[0, 0, :7] == 0).all()
        ref = reference.attention_backward(do, q, k, v, causal=True)
        assert rel(dk, ref[1]) < 2e-5 and rel(dv, ref[2]) < 2e-5


def test_deterministic_is_bitwise_reproducible_and_fa1_too():
    rng = np.random.default_rng(2)
    do, q, k, v, o, lse = problem(rng, 1, 2, 1, 17, 23, 8, "float32", False)
    for algorithm, deterministic in (("fa2", True), ("fa1", False)):
        first = attention_backward(do, q, k, v, o, lse, algorithm=algorithm, deterministic=deterministic)
        again = attention_backward(do, q, k, v, o, lse, algorithm=algorithm, deterministic=deterministic)
        for a, b in zip(first, again):
            assert np.array_equal(a, b)


def test_the_loop_orders_agree():
    rng = np.random.default_rng(3)
    do, q, k, v, o, lse = problem(rng, 2, 2, 1, 9, 14, 4, "float32", True)
    results = [attention_backward(do, q, k, v, o, lse, causal=True, algorithm=a, deterministic=d) for a, d in VARIANTS]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(algorithm="fa3"), ValueError, "algorithm"),
        (dict(deterministic=1), TypeError, "deterministic"),
        (dict(lse_shape=(1, 1, 3)), ValueError, "lse"),
        (dict(do_dtype=np.float64), TypeError, "do"),
    ],
)
def test_errors(change, error, match):
    rng = np.random.default_rng(4)
    do, q, k, v, o, lse = problem(rng, 1, 1, 1, 4, 4, 8, "float32", False)
    if "lse_shape" in change:
        lse = np.zeros(change.pop("lse_shape"), np.float32)
    if "do_dtype" in change:
        do = do.astype(change.pop("do_dtype"))
    with pytest.raises(error, match=match):
        attention_backward(do, q, k, v, o, lse, **change)


# Tiles other than the simulator's default 8 x 8 (tile_table.backward_block): 16 x 16 (32
# threads, two score columns per thread) and 32 x 32 (64 threads, four), with lengths around the
# tile edges, head dims that are not multiples of 4, GQA, causal with Nq != Nk (rows that see no
# key). Float32 only: the dtype handling is the wrapper's, tested above.
@settings(max_examples=examples(3), deadline=None)  # (the simulator's time)
@given(
    block=st.sampled_from([16, 32]),
    variant=st.sampled_from(VARIANTS),
    gqa=st.booleans(),
    n_q=st.integers(1, 40),
    n_k=st.integers(1, 40),
    head_dim=st.sampled_from([3, 13, 32]),
    causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_larger_tiles_match_float64_reference(block, variant, gqa, n_q, n_k, head_dim, causal, seed):
    _check_with_block(block, variant, gqa, n_q, n_k, head_dim, causal, seed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_wide_head_dim_loads_in_two_passes_and_sums_dq_in_halves(variant):
    """D > 64 (padded to 128): Q_i, dO_i are copied in two passes of rows (``load_rows``) and the
    K/V kernels sum each step's dQ_i share in two halves of the head dim (``atb_half_tile``);
    causal with Nq > Nk (rows that see no key), GQA, lengths off the tile edges."""
    _check_with_block(8, variant, True, 13, 10, 70, True, 5)


@pytest.mark.parametrize(
    "block, n_q, n_k, variant, causal",
    [(16, 32, 17, VARIANTS[0], True), (16, 16, 48, VARIANTS[1], True), (32, 33, 31, VARIANTS[2], True),
     (32, 31, 33, VARIANTS[0], False)],
)
def test_tile_edges(block, n_q, n_k, variant, causal):
    """Lengths one off a multiple of the tile, and a multiple: the last Q or K/V tile full or
    holding one row; causal Nq < Nk and Nq > Nk."""
    _check_with_block(block, variant, False, n_q, n_k, 8, causal, 6)


def _check_with_block(block, variant, gqa, n_q, n_k, head_dim, causal, seed):
    from unittest import mock

    from numba_flash import tile_table

    algorithm, deterministic = variant
    do, q, k, v, o, lse = problem(np.random.default_rng(seed), 1, 2, 1 if gqa else 2, n_q, n_k, head_dim, "float32", causal)
    with mock.patch.object(tile_table, "backward_block", lambda d: block):
        grads = attention_backward(do, q, k, v, o, lse, causal=causal, algorithm=algorithm, deterministic=deterministic)
    refs = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), causal=causal)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert not np.isnan(got).any(), name
        err = gradient_error(got, ref, refs)
        assert err < TOL["float32"], (name, block, err)


def test_tile_rule():
    """tile_table.backward_block on a GPU: 64 x 64 up to D = 64, 32 x 32 up to D = 128, and every
    choice leaves two blocks per SM by shared memory within the opt-in limit of one block."""
    from unittest import mock

    from numba_flash import tile_table
    from numba_flash.arch import SMEM_OPTIN_LIMIT, blocks_per_sm_by_smem
    from numba_flash.kernels import bwd

    with mock.patch.object(tile_table, "simulated", lambda: False):
        assert [tile_table.backward_block(d) for d in (1, 16, 32, 40, 64, 65, 96, 128)] == [64] * 5 + [32] * 3
        for d in (1, 40, 64, 100, 128):
            block = tile_table.backward_block(d)
            for kernel in bwd.KERNELS:
                layout = bwd.bwd_layout(kernel, d, block)
                assert layout.smem_bytes <= SMEM_OPTIN_LIMIT
                assert layout.threads == 2 * block
            assert blocks_per_sm_by_smem(bwd.bwd_layout("fa2", d, block).smem_bytes) >= 2
            assert blocks_per_sm_by_smem(bwd.bwd_layout("fa2", d, 2 * block).smem_bytes) < 2 or block == 64
