"""Sliding windows (``window_size=(left, right)``, API.md section 2c) through every kernel path.

The window is a compile-time constant of each kernel (``kernels.mask``): the forward's two loop
nests on both engines (CUDA cores, tensor cores), split-KV, decode, and the backward's dK/dV and
dQ nests, each checked against the float64 reference's window on small awkward shapes: lengths
that are not tile multiples, Nq != Nk (bottom-right alignment), windows narrower than a tile (a
tile's rows see disjoint keys), windows that hide whole tiles on both sides, and rows that see no
key (a window with ``causal`` and Nq > Nk). Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import backward_problem, check_against_reference, examples, gradient_error, random_qkv, run_poisoned, to_numpy
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash import reference, tiled
from numba_flash.masking import window_spec

SIDES = st.one_of(st.just(-1), st.integers(0, 9))


@settings(max_examples=examples(14), deadline=None)
@given(
    algorithm=st.sampled_from(["fa1", "fa2"]),
    n_q=st.integers(1, 13),
    n_k=st.integers(1, 13),
    left=SIDES,
    right=SIDES,
    causal=st.booleans(),
    block_m=st.sampled_from([1, 2, 4]),
    block_n=st.sampled_from([1, 2, 4]),
    gqa=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_cuda_cores_match_the_reference(algorithm, n_q, n_k, left, right, causal, block_m, block_n, gqa, seed, xp):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 2, 1 if gqa else 2, n_q, n_k, 3, "float32", xp)
    o, lse = run_poisoned(xp, q, k, v, causal=causal, window_size=(left, right), algorithm=algorithm,
                          block_m=block_m, block_n=block_n)
    spec = window_spec(causal, (left, right))
    check_against_reference(q, k, v, o, lse, spec)
    # the same loop nest and tiles on the online-softmax algebra (numba_flash.tiled)
    nest = {"fa1": tiled.fa1_tiled, "fa2": tiled.fa2_tiled}[algorithm]
    tiled_o, tiled_lse = nest(*(to_numpy(x) for x in (q, k, v)), block_m, block_n, causal, window_size=(left, right))
    check_against_reference(q, k, v, o, lse, spec, oracle=(tiled_o, tiled_lse))


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("precision, dtype, n_q, n_k, window, causal", [
    (None, "float16", 37, 29, (5, 3), False),  # narrower than a tile: the tiles' rows see disjoint keys
    (None, "float16", 21, 50, (20, -1), False),  # left edge only: the first K/V tiles hidden from the late Q tiles
    (None, "float16", 40, 19, (7, 0), True),  # a window with causal, Nq > Nk: the first rows see nothing
    ("tf32x3", "float32", 37, 29, (5, 3), False),  # (the tf32x3 engine: one shape)
], ids=["f16-both-edges", "f16-left-only", "f16-with-causal", "tf32x3-both-edges"])
def test_tensor_cores_match_the_reference(algorithm, precision, dtype, n_q, n_k, window, causal, xp, rng):
    q, k, v = random_qkv(rng, 1, 2, 1, n_q, n_k, 16, dtype, xp)
    o, lse = run_poisoned(xp, q, k, v, causal=causal, window_size=window, algorithm=algorithm, precision=precision,
                          block_m=16, block_n=16)
    spec = window_spec(causal, window)
    check_against_reference(q, k, v, o, lse, spec)
    if causal and n_q > n_k:  # rows that see no key: o = 0, lse = -inf
        hidden = n_q - n_k
        assert (to_numpy(o)[:, :, :hidden] == 0).all() and np.isneginf(to_numpy(lse)[:, :, :hidden]).all()


@pytest.mark.parametrize("precision, dtype", [("ieee", "float32"), (None, "float16")], ids=["cuda-cores", "tensor-cores"])
def test_split_kv_partials_merge_to_the_window(precision, dtype, xp, rng):
    """num_splits=3 over a window that hides the first K/V tiles from the late Q tiles (and the
    last ones from the early Q tiles): each split walks its share of a range that starts past
    tile 0, and a split whose share is empty writes the merge's identity."""
    q, k, v = random_qkv(rng, 1, 2, 2, 20, 70, 8, dtype, xp)
    o, lse = run_poisoned(xp, q, k, v, window_size=(12, 4), num_splits=3, precision=precision,
                          block_m=16 if precision is None else 4, block_n=16 if precision is None else 8)
    check_against_reference(q, k, v, o, lse, (12, 4))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_decode_window_over_ragged_caches(dtype, xp, rng):
    """Decode's packed GQA rows, ragged lengths (one of them 0), a window with causal."""
    q, k, v = random_qkv(rng, 3, 2, 1, 2, 40, 16, dtype, xp)  # (GQA 2:1 on one KV head: the simulator's time)
    lengths = np.array([40, 0, 23], np.int32)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=xp.asarray(lengths), causal=True, window_size=(9, -1),
                                return_lse=True)
    ref_o, ref_lse = reference.decode(*(to_numpy(x) for x in (q, k, v)), cache_seqlens=lengths, causal=True,
                                      window_size=(9, -1))
    tol = 2e-3 if dtype == "float16" else 1e-5
    assert np.allclose(to_numpy(o).astype(np.float64), ref_o, atol=tol, rtol=tol)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(to_numpy(lse)), finite)
    assert np.allclose(to_numpy(lse)[finite], ref_lse[finite], atol=1e-4)


BACKWARD_CASES = [  # each engine's dK/dV walk (both orders) and dQ walk
    # (regime precision, dtype, algorithm, deterministic, n_q, n_k, window, causal)
    ("ieee", "float32", "fa2", True, 26, 19, (4, -1), True),
    ("ieee", "float32", "fa1", False, 17, 17, (-1, 3), False),
    (None, "float16", "fa2", True, 29, 45, (20, 0), False),
    (None, "float16", "fa1", False, 40, 19, (7, 0), True),
]


@pytest.mark.parametrize("precision, dtype, algorithm, deterministic, n_q, n_k, window, causal", BACKWARD_CASES)
def test_backward_matches_the_reference(precision, dtype, algorithm, deterministic, n_q, n_k, window, causal, rng):
    from numba_flash.backward import gradients

    # (one head: the window is the same on every head; GQA's backward walks: test_backward, test_backward_tc)
    do, q, k, v, _, _ = backward_problem(rng, 1, 1, 1, n_q, n_k, 16 if precision is None else 6, dtype, causal)
    o, lse = numba_flash.attention(q, k, v, causal=causal, window_size=window, return_lse=True, precision="ieee")
    tiles = {"tiles": (16, 16)} if precision is None else {}
    grads = gradients(do, q, k, v, o, lse, causal=causal, window_size=window, algorithm=algorithm,
                      deterministic=deterministic, precision=precision, **tiles)
    refs = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), causal=causal,
                                        window_size=window)
    bound = 1e-4 if dtype == "float32" else 5e-3
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert not np.isnan(np.asarray(got, np.float64)).any(), name
        assert gradient_error(got, ref, refs) < bound, name


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
def test_window_hides_nan_values_of_keys_outside_it(algorithm, xp, rng):
    """On CUDA cores a key outside a row's window contributes nothing, not even 0 * NaN: a NaN in
    key 0's V reaches only the rows that see key 0 (window (1, -1): rows 0 and 1)."""
    q, k, v = (to_numpy(x).copy() for x in random_qkv(rng, 1, 1, 1, 8, 8, 4, "float32", np))
    v[0, 0, 0, 1] = np.nan
    q, k, v = (xp.asarray(x) for x in (q, k, v))
    o, _ = run_poisoned(xp, q, k, v, window_size=(1, -1), algorithm=algorithm, block_m=8, block_n=8)
    o = to_numpy(o)
    assert np.isnan(o[0, 0, :2, 1]).all() and np.isfinite(o[0, 0, 2:]).all()
    ref_o, _ = reference.attention(to_numpy(q)[:, :, 2:], to_numpy(k), to_numpy(v), window_size=(1, 7))
    assert np.allclose(o[0, 0, 2:], ref_o[0, 0], atol=1e-5)  # rows 2.. (their window, realigned)


def test_window_size_errors_name_the_argument(rng):
    q, k, v = random_qkv(rng, 1, 1, 1, 4, 4, 8, "float32")
    with pytest.raises(TypeError, match="window_size"):
        numba_flash.attention(q, k, v, window_size=3)
    with pytest.raises(ValueError, match="window_size"):
        numba_flash.attention(q, k, v, window_size=(-2, 0))
    with pytest.raises(ValueError, match="window_size"):
        numba_flash.decode(q, k, v, window_size=(0, -5))
    with pytest.raises(TypeError, match="window_size"):  # a set has no order: not a pair
        numba_flash.attention(q, k, v, window_size={5, 0})


def test_causal_is_the_window_minus_one_zero(xp, rng):
    """``causal=True`` and ``window_size=(-1, 0)`` are one mask, one kernel: bitwise equal."""
    q, k, v = random_qkv(rng, 1, 2, 2, 9, 14, 4, "float32", xp)
    a = run_poisoned(xp, q, k, v, causal=True, block_m=4, block_n=4)
    b = run_poisoned(xp, q, k, v, window_size=(-1, 0), block_m=4, block_n=4)
    for x, y in zip(a, b):
        assert np.array_equal(to_numpy(x), to_numpy(y))
