"""``numba_flash.attention_backward`` (API.md section 5) in the simulator: both loop orders
(FlashAttention Algorithm 4, FlashAttention-2 Algorithm 2 with atomics or deterministic) against
the float64 reference gradients, on small awkward shapes: causal with Nq != Nk (rows that see no
key), GQA, lengths that are not multiples of a tile, D = 1, float16 and bfloat16 inputs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash import reference
from numba_flash.backward import attention_backward

NUMPY_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
VARIANTS = [("fa2", False), ("fa2", True), ("fa1", False)]


def problem(rng, B, H, Hkv, Nq, Nk, D, dtype, causal):
    npdt = NUMPY_DTYPE[dtype]
    q = rng.standard_normal((B, H, Nq, D)).astype(npdt)
    k = rng.standard_normal((B, Hkv, Nk, D)).astype(npdt)
    v = rng.standard_normal((B, Hkv, Nk, D)).astype(npdt)
    o, lse = numba_flash.attention(q, k, v, causal=causal, return_lse=True, precision="ieee")
    do = rng.standard_normal(o.shape).astype(npdt)
    return do, q, k, v, o, lse


def rel(got, ref):
    got = np.asarray(got).astype(np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


TOL = {"float32": 2e-5, "float16": 2e-2, "bfloat16": 1e-1}  # relative to the largest gradient


@settings(max_examples=examples(6), deadline=None)
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
    grads = attention_backward(do, q, k, v, o, lse, causal=causal, algorithm=algorithm, deterministic=deterministic)
    # The reference of the inputs as the kernels saw them (16-bit values widened exactly).
    refs = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), causal=causal)
    for name, got, ref, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        assert not np.isnan(np.asarray(got, np.float64)).any(), name
        assert rel(got, ref) < TOL[dtype], (name, rel(got, ref))


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
