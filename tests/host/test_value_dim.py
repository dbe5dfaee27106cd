"""A ``v`` with a head dim of its own (API.md 2e, ``numba_flash.value_dim``): ``o`` has ``Dv``
columns, the gradients the shapes of q, k, v, against the float64 reference (which takes ``Dv``
natively), in the simulator; the padding's errors and that no input is modified."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import gradient_error, plain_fp16_attention

import numba_flash
from numba_flash import reference, value_dim

DIMS = [(24, 40), (40, 24)]  # (D, Dv): v wider, v narrower


def _inputs(rng, D, Dv, dtype, Nq=9, Nk=13):
    return (rng.standard_normal((1, 2, Nq, D)).astype(dtype), rng.standard_normal((1, 1, Nk, D)).astype(dtype),
            rng.standard_normal((1, 1, Nk, Dv)).astype(dtype))


@pytest.mark.parametrize("dtype, dims, algorithm", [  # float16 (tensor cores): every pair
    ("float16", DIMS[0], "fa2"), ("float16", DIMS[0], "fa1"), ("float16", DIMS[1], "fa2"), ("float16", DIMS[1], "fa1"),
    # float32 (the CUDA-core forward, the tf32x3 backward; 5-7 s each in the simulator): each loop order once,
    # each on one of the two dims (the other loop order's case and float16's cover the other pairing)
    ("float32", DIMS[0], "fa2"), ("float32", DIMS[1], "fa1"),
])
def test_forward_and_backward(algorithm, dims, dtype):
    D, Dv = dims
    rng = np.random.default_rng(D + Dv)
    q, k, v = _inputs(rng, D, Dv, dtype)
    before = [x.copy() for x in (q, k, v)]
    o, lse = numba_flash.attention(q, k, v, causal=True, algorithm=algorithm, return_lse=True)
    ref_o, ref_lse = reference.attention(q, k, v, True)
    assert o.shape == (1, 2, 9, Dv) and o.dtype == q.dtype
    err = np.abs(o.astype(np.float64) - ref_o).max()
    if dtype == "float16":  # FlashAttention's rule
        plain = plain_fp16_attention(q, k, v, True, None)
        assert err <= 2 * np.abs(plain.astype(np.float64) - ref_o).max() + 1e-6
    else:
        assert err <= 1e-5 * np.abs(ref_o).max()
    assert np.allclose(lse, ref_lse, atol=1e-4)  # the scale is 1/sqrt(D), not of the padded width
    do = rng.standard_normal(o.shape).astype(dtype)
    grads = numba_flash.attention_backward(do, q, k, v, o, lse, causal=True, algorithm=algorithm)
    refs = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), causal=True)
    for name, got, want, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype, name
        assert gradient_error(got, want, refs) < (2e-2 if dtype == "float16" else 1e-4), name
    assert all(np.array_equal(a, b) for a, b in zip(before, (q, k, v)))  # nothing modified


def test_packed_batch():
    rng = np.random.default_rng(3)
    cu = np.array([0, 5, 5, 14], np.int32)
    q, k = (rng.standard_normal((14, h, 24)).astype("float16") for h in (2, 1))
    v = rng.standard_normal((14, 1, 40)).astype("float16")
    o, lse = numba_flash.attention_varlen(q, k, v, cu, cu, 9, 9, causal=True, return_lse=True)
    ref_o, _ = reference.attention_varlen(q, k, v, cu, cu, 9, 9, causal=True)
    assert o.shape == (14, 2, 40) and np.abs(o.astype(np.float64) - ref_o).max() <= 2e-3 * np.abs(ref_o).max()
    do = rng.standard_normal(o.shape).astype("float16")
    grads = numba_flash.attention_backward_varlen(do, q, k, v, o, lse, cu, cu, 9, 9, causal=True)
    refs = reference.attention_backward_varlen(*(x.astype(np.float64) for x in (do, q, k, v)), o, lse, cu, cu, 9, 9,
                                               causal=True)
    for name, got, want, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert got.shape == x.shape and gradient_error(got, want, refs) < 2e-2, name


def test_errors():
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, 24, 40, "float32")
    with pytest.raises(ValueError, match="v's head_dim .* from 1 to 256"):
        numba_flash.attention(q, k, np.zeros((1, 1, 13, 257), np.float32))
    with pytest.raises(ValueError, match="k must have q's head_dim 24"):
        numba_flash.attention(q, np.zeros((1, 1, 13, 32), np.float32), v)
    empty = np.zeros((1, 2, 9, 0), np.float32)  # padding must not turn a head dim of 0 into a valid call
    with pytest.raises(ValueError, match=r"head_dim \(last axis of q\) must be from 1 to 256"):
        numba_flash.attention(empty, empty[:, :1], v, scale=1.0)
    with pytest.raises(ValueError, match=r"k and v must have the same shape but for the last axis; got k \(1, 1, 13, 24\)"):
        numba_flash.attention(q, k, v[:, :, :12])
    o, lse = np.zeros((1, 2, 9, 40), np.float32), np.zeros((1, 2, 9), np.float32)  # (the forward's shapes: the
    # backward checks them before it runs; the forward of these inputs is test_forward_and_backward's)
    with pytest.raises(ValueError, match="do must have v's head_dim 40"):
        numba_flash.attention_backward(np.zeros_like(q), q, k, v, o, lse)
    with pytest.raises(ValueError, match="do and o must have the same shape"):
        numba_flash.attention_backward(np.zeros_like(o[:, :, :4]), q, k, v, o, lse)
    with pytest.raises(ValueError, match="must have the same shape"):  # decode: not yet (value_dim's docstring)
        numba_flash.decode(q[:, :, :1], k, v)


def test_padding_helpers():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    padded = value_dim.pad(x, 5)
    assert padded.shape == (2, 5) and np.array_equal(padded[:, :3], x) and not padded[:, 3:].any()
    assert value_dim.pad(x, 3) is x and value_dim.narrow(padded, 3).flags.c_contiguous
    assert value_dim.value_dims(x, x) is None and value_dims_of(4, 6) == (4, 6)


def value_dims_of(d, dv):
    return value_dim.value_dims(np.zeros((1, d)), np.zeros((1, dv)))
