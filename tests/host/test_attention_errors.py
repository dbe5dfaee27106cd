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
    q = rng.standard_normal((1, 1, 2, 257)).astype(np.float32)
    with pytest.raises(ValueError, match="head_dim .* from 1 to 256"):
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
    with pytest.raises(TypeError, match="^q must be a NumPy array"):
        attention(q.tolist(), k, v)


def test_unknown_algorithm(qkv):
    with pytest.raises(ValueError, match="algorithm must be one of"):
        attention(*qkv, algorithm="fa4")


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
    with pytest.raises(ValueError, match=r"shared memory.*block_n can be one of \[1, 2, 4, 8, 16, 32, 64\]"):
        attention(q, q, q, block_m=128, block_n=128)
    with pytest.raises(ValueError, match="512 threads per block, more than the 256 whose registers fit an SM"):
        attention(q, q, q, block_m=256, block_n=8)


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
        ("lse_out", lambda: [[0.0]], TypeError, "^lse_out must be a NumPy array"),
    ],
)
def test_result_buffers_are_checked(qkv, name, make, err, match):
    from numba_flash.api import forward

    with pytest.raises(err, match=match):
        forward(*qkv, **{name: make()})


def _packed(rng, n=5):
    """q, k, v and spare room as views of one (4, 1, 2, n, 4) float32 buffer."""
    buf = rng.standard_normal((4, 1, 2, n, 4)).astype(np.float32)
    return buf, buf[0], buf[1, :, :1], buf[2, :, :1]


@pytest.mark.parametrize("target", ["q", "k", "v"])
def test_out_overlapping_an_input_is_refused(rng, target):
    """FA-1 uses ``out`` as its running O: an aliased input would be read after being
    overwritten. Refused before any launch, and the inputs stay untouched."""
    from numba_flash.api import forward

    buf, q, k, v = _packed(rng)
    before = buf.copy()
    out = {"q": q, "k": buf[1], "v": buf[2]}[target]  # q itself; the slabs that hold k and v
    with pytest.raises(ValueError, match=f"out must not share memory with {target}"):
        forward(q, k, v, out=out, algorithm="fa1")
    assert np.array_equal(buf, before)


def test_lse_out_overlapping_an_input_or_out_is_refused(rng):
    from numba_flash.api import forward

    buf, q, k, v = _packed(rng)
    lse_in_q = q.reshape(-1)[: 2 * 5].reshape(1, 2, 5)  # q's first ten floats
    with pytest.raises(ValueError, match="lse_out must not share memory with q"):
        forward(q, k, v, lse_out=lse_in_q)
    out = np.empty((1, 2, 5, 4), np.float32)
    lse_in_out = out.reshape(-1)[:10].reshape(1, 2, 5)
    with pytest.raises(ValueError, match="lse_out must not share memory with out"):
        forward(q, k, v, out=out, lse_out=lse_in_out)


def test_separate_buffers_next_to_the_inputs_are_accepted(rng):
    """Only real sharing is refused: the unused fourth slab of the packed buffer is fine."""
    from numba_flash.api import forward

    buf, q, k, v = _packed(rng)
    out = buf[3]  # (1, 2, 5, 4), C-contiguous, disjoint from q, k, v
    o, _ = forward(q, k, v, out=out, block_m=4, block_n=4)
    assert o is out and np.isfinite(out).all()


def test_byte_ranges_of_device_arrays():
    """The overlap test of CuPy/torch buffers: byte ranges from pointer, shape and strides."""
    from types import SimpleNamespace

    from numba_flash.arrays import byte_extent, extents_overlap, may_overlap

    assert byte_extent(1000, (2, 3), (12, 4), 4) == (1000, 1024)
    assert byte_extent(1000, (2, 3), (-12, 4), 4) == (988, 1012)  # negative strides reach back
    assert byte_extent(1000, (0, 3), (12, 4), 4) == (1000, 1000)  # empty: touches nothing
    assert extents_overlap((0, 10), (9, 20)) and not extents_overlap((0, 10), (10, 20))
    assert not extents_overlap((5, 5), (0, 10))

    def cupy_like(ptr, shape, strides, itemsize=4):
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr), shape=shape, strides=strides, itemsize=itemsize)

    q = cupy_like(4096, (1, 2, 5, 4), (160, 80, 16, 4))  # 160 bytes
    assert may_overlap(cupy_like(4096 + 156, (1,), (4,)), q, "cupy")  # its last float
    assert not may_overlap(cupy_like(4096 + 160, (1, 2, 5, 4), (160, 80, 16, 4)), q, "cupy")


@pytest.mark.parametrize("position, name", [(0, "q"), (1, "k"), (2, "v")])
@pytest.mark.parametrize("bad", [[[1.0]], 1.0, None])
def test_an_argument_that_is_not_an_array_is_named(qkv, position, name, bad):
    args = list(qkv)
    args[position] = bad
    with pytest.raises(TypeError, match=rf"^{name} must be a NumPy array, a CuPy array, .*; got builtins\."):
        attention(*args)


@pytest.mark.parametrize("name", ["do", "q", "k", "v", "o", "lse"])
def test_backward_names_an_argument_that_is_not_an_array(qkv, name):
    from numba_flash import attention_backward

    q, k, v = qkv
    o, lse = np.zeros_like(q), np.zeros(q.shape[:3], np.float32)  # checked before anything runs
    args = dict(do=o, q=q, k=k, v=v, o=o, lse=lse)
    args[name] = [1.0]
    with pytest.raises(TypeError, match=rf"^{name} must be a NumPy array"):
        attention_backward(*args.values())
