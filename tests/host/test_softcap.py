"""Logit soft-capping (``softcap``, API.md section 2c) compiled into the kernels.

Each scaled score ``s`` becomes ``softcap * tanh(s / softcap)`` before the mask, in the forward
of both loop orders and both regimes, and the backward recomputes P from the capped scores and
multiplies dS by the cap's slope ``1 - tanh^2``. Checked against the float64 reference (which
states the same order) on small awkward shapes, with a window on top, and by the cap's limits:
a huge cap is no cap, a small one flattens the scores towards a uniform average.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import backward_problem, gradient_error, random_qkv, run_poisoned, to_numpy

import numba_flash
from numba_flash import reference
from numba_flash.backward import gradients

FORWARD = [  # (precision, dtype, tol, softcap, window): every engine; a cap alone (CUDA cores: the next test)
    ("ieee", "float32", 1e-5, 3.0, (6, 2)),
    (None, "float16", 2e-3, 0.8, (-1, -1)), (None, "float16", 2e-3, 3.0, (6, 2)),
    ("tf32x3", "float32", 1e-5, 3.0, (6, 2)),
]


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("precision, dtype, tol, softcap, window", FORWARD)
def test_forward_matches_the_reference(algorithm, precision, dtype, tol, softcap, window, xp, rng):
    # scores of a few units: the cap bends them (tanh(s / 0.8) is far from s / 0.8 there)
    q, k, v = random_qkv(rng, 1, 2, 1, 21, 27, 16, dtype, xp, scale=2.0)
    tiles = {"block_m": 16, "block_n": 16} if precision != "ieee" else {"block_m": 4, "block_n": 8}
    o, lse = run_poisoned(xp, q, k, v, softcap=softcap, window_size=window, algorithm=algorithm, precision=precision,
                          **tiles)
    ref_o, ref_lse = reference.attention(*(to_numpy(x) for x in (q, k, v)), softcap=softcap, window_size=window)
    plain_o, _ = reference.attention(*(to_numpy(x) for x in (q, k, v)), window_size=window)
    assert np.abs(plain_o - ref_o).max() > 50 * tol  # the cap changes the result: the check can fail
    assert np.abs(to_numpy(o).astype(np.float64) - ref_o).max() < tol * max(1.0, np.abs(ref_o).max())  # (relative to o)
    assert np.abs(to_numpy(lse) - ref_lse).max() < 10 * tol


def test_a_huge_cap_is_no_cap_and_a_tiny_one_averages(xp, rng):
    q, k, v = random_qkv(rng, 1, 1, 1, 6, 9, 8, "float32", xp)
    plain = run_poisoned(xp, q, k, v, block_m=2, block_n=4)[0]
    huge = run_poisoned(xp, q, k, v, softcap=1e6, block_m=2, block_n=4)[0]
    assert np.allclose(to_numpy(huge), to_numpy(plain), atol=1e-6)
    tiny = run_poisoned(xp, q, k, v, softcap=1e-6, block_m=2, block_n=4)[0]  # every score ~0: the mean of V
    assert np.allclose(to_numpy(tiny), to_numpy(v).mean(axis=2, keepdims=True), atol=1e-5)


@pytest.mark.parametrize("precision, dtype, algorithm, deterministic", [  # each engine's dK/dV and dQ walks
    ("ieee", "float32", "fa2", True), ("ieee", "float32", "fa1", False),
    (None, "float16", "fa2", False), (None, "float16", "fa2", True),
])
def test_backward_matches_the_reference(precision, dtype, algorithm, deterministic, rng):
    # (one head: the cap is the same on every head; GQA's backward walks: test_backward, test_backward_tc)
    do, q, k, v, _, _ = backward_problem(rng, 1, 1, 1, 19, 23, 16, dtype, False, scale=2.0)
    o, lse = numba_flash.attention(q, k, v, softcap=0.7, window_size=(8, 3), return_lse=True, precision="ieee")
    tiles = {"tiles": (16, 16)} if precision is None else {}
    grads = gradients(do, q, k, v, o, lse, softcap=0.7, window_size=(8, 3), algorithm=algorithm,
                      deterministic=deterministic, precision=precision, **tiles)
    refs = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), softcap=0.7, window_size=(8, 3))
    uncapped = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), window_size=(8, 3))
    bound = 1e-4 if dtype == "float32" else 5e-3
    for name, got, ref, plain in zip(("dq", "dk", "dv"), grads, refs, uncapped):
        assert gradient_error(plain, ref, refs) > 20 * bound, name  # the cap's slope matters here
        assert gradient_error(got, ref, refs) < bound, name


@pytest.mark.parametrize("dtype", ["float16"])
def test_decode_caps_the_scores(dtype, xp, rng):
    """Decode (packed GQA rows, ragged lengths, split in two) with a cap and a window."""
    q, k, v = random_qkv(rng, 2, 4, 2, 2, 40, 16, dtype, xp, scale=2.0)
    lengths = np.array([40, 17], np.int32)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=xp.asarray(lengths), softcap=0.9, window_size=(12, -1),
                                num_splits=2, return_lse=True)
    ref_o, ref_lse = reference.decode(*(to_numpy(x) for x in (q, k, v)), cache_seqlens=lengths, softcap=0.9,
                                      window_size=(12, -1))
    plain_o, _ = reference.decode(*(to_numpy(x) for x in (q, k, v)), cache_seqlens=lengths, window_size=(12, -1))
    tol = 2e-3 if dtype == "float16" else 1e-5
    assert np.abs(plain_o - ref_o).max() > 50 * tol  # the cap matters here
    assert np.abs(to_numpy(o).astype(np.float64) - ref_o).max() < tol * max(1.0, np.abs(ref_o).max())  # (relative to o)
    assert np.abs(to_numpy(lse) - ref_lse).max() < 10 * tol


def test_softcap_errors_name_the_argument(rng):
    q, k, v = random_qkv(rng, 1, 1, 1, 4, 4, 8, "float32")
    with pytest.raises(TypeError, match="softcap"):
        numba_flash.attention(q, k, v, softcap="1")
    with pytest.raises(ValueError, match="softcap"):
        numba_flash.attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        numba_flash.decode(q, k, v, softcap=float("inf"))
    with pytest.raises(ValueError, match="softcap"):  # softcap * log2(e) past float32: the kernels' unit
        numba_flash.attention(q, k, v, softcap=3e38)
