"""Bad input raises before any launch, naming the argument: ValueError for shapes and
values, TypeError for dtypes and array kinds."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_qkv

from numba_flash import attention
from numba_flash.kernels.tiles import BLOCK_M_CHOICES, BLOCK_N_CHOICES


@pytest.fixture
def qkv(rng):
    return random_qkv(rng, 1, 2, 1, 5, 6, 4, "float32")


def test_wrong_rank(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="q must be 4-D"):
        attention(q[0], k, v)


def test_k_v_shapes_differ(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        attention(q, k, v[:, :, :3])


def test_head_dim_mismatch(rng):
    q = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 3)).astype(np.float32)
    with pytest.raises(ValueError, match="head_dim"):
        attention(q, k, k)


def test_head_dim_too_large(rng):
    q = rng.standard_normal((1, 1, 2, 129)).astype(np.float32)
    with pytest.raises(ValueError, match="head_dim .* from 1 to 128"):
        attention(q, q, q)


def test_heads_not_a_multiple(rng):
    q = rng.standard_normal((1, 3, 5, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="multiple of k's and v's heads"):
        attention(q, k, k)


def test_batch_mismatch(rng):
    q = rng.standard_normal((2, 2, 5, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="batch"):
        attention(q, k, k)


@pytest.mark.parametrize("dtype", ["float64", "int32", "bool"])
def test_unsupported_dtype(qkv, dtype):
    q, k, v = qkv
    with pytest.raises(TypeError, match="q must be float16, bfloat16 or float32"):
        attention(q.astype(dtype), k, v)


def test_mixed_dtypes(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="one dtype"):
        attention(q, k.astype(np.float16), v)


def test_not_an_array(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match="expected a NumPy array"):
        attention(q.tolist(), k, v)


def test_unknown_algorithm(qkv):
    with pytest.raises(ValueError, match="algorithm must be one of"):
        attention(*qkv, algorithm="fa3")


@pytest.mark.parametrize("bad", [0, 3, 512, 2.0, True, "64"])
def test_block_m_unsupported(qkv, bad):
    with pytest.raises(ValueError, match=r"block_m=.* one of \[1, 2, 4"):
        attention(*qkv, block_m=bad)


@pytest.mark.parametrize("bad", [0, 6, 256])
def test_block_n_unsupported(qkv, bad):
    with pytest.raises(ValueError, match=r"block_n=.* one of \[1, 2, 4"):
        attention(*qkv, block_n=bad)


def test_tiles_beyond_shared_memory(rng):
    q = rng.standard_normal((1, 1, 4, 128)).astype(np.float32)
    with pytest.raises(ValueError, match=r"shared memory.*block_n can be one of \[1, 2, 4, 8, 16\]"):
        attention(q, q, q, block_m=32, block_n=128)
    with pytest.raises(ValueError, match="shared memory.*no block_n fits with block_m=256"):
        attention(q, q, q, block_m=256, block_n=128)


def test_choices_are_powers_of_two():
    assert BLOCK_M_CHOICES == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert BLOCK_N_CHOICES == (1, 2, 4, 8, 16, 32, 64, 128)


def test_scale_must_be_a_finite_number(qkv):
    with pytest.raises(TypeError, match="scale"):
        attention(*qkv, scale="0.5")
    with pytest.raises(ValueError, match="scale must be finite"):
        attention(*qkv, scale=float("inf"))


def test_causal_must_be_bool(qkv):
    with pytest.raises(TypeError, match="causal must be a bool"):
        attention(*qkv, causal="yes")


def test_numpy_integer_tiles_are_accepted(qkv):
    o = attention(*qkv, block_m=np.int64(4), block_n=np.int32(2))
    assert o.shape == qkv[0].shape


def test_scale_that_overflows_float32_is_refused(qkv):
    with pytest.raises(ValueError, match="scale must be finite and below"):
        attention(*qkv, scale=1e40)


def test_return_lse_must_be_bool(qkv):
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        attention(*qkv, return_lse="no")


def test_kv_without_heads(rng):
    q = rng.standard_normal((1, 0, 5, 4)).astype(np.float32)
    k = rng.standard_normal((1, 0, 5, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="k and v must have at least one head"):
        attention(q, k, k)


def test_kv_heads_more_than_q_heads(rng):
    q = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    k = rng.standard_normal((1, 4, 5, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="multiple of k's and v's heads"):
        attention(q, k, k)


@pytest.mark.parametrize(
    "name, make, err, match",
    [
        ("out", lambda: np.empty((1, 2, 5, 3), np.float32), ValueError, "out must have shape"),
        ("out", lambda: np.empty((1, 2, 5, 4), np.float16), TypeError, "out must be float32"),
        ("out", lambda: np.empty((1, 2, 4, 5), np.float32).transpose(0, 1, 3, 2), ValueError, "C-contiguous"),
        ("lse_out", lambda: np.empty((1, 2, 5), np.float64), TypeError, "lse_out must be float32"),
        ("lse_out", lambda: [[0.0]], TypeError, "expected a NumPy array"),
    ],
)
def test_result_buffers_are_checked(qkv, name, make, err, match):
    from numba_flash.api import forward

    with pytest.raises(err, match=match):
        forward(*qkv, **{name: make()})
