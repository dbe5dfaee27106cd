"""The float64 oracle (numba_flash.reference) against an independent naive loop.

``naive_attention`` follows API.md word for word, one (batch, head, query) at a time in
pure Python (``math.exp``, ``math.fsum``): kv head ``h // (H // Hkv)``, query ``i``
sees key ``j`` iff ``j <= i + (Nk - Nq)``. Warnings are errors throughout.
"""

from __future__ import annotations

import itertools
import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numba_flash import reference

pytestmark = pytest.mark.filterwarnings("error")

NEG_INF = -math.inf
RTOL = 1e-12
ATOL = 1e-12


def naive_attention(q, k, v, causal=False, scale=None):
    """Per-row softmax attention in pure Python; rows that see no key give (0, -inf)."""
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(dim) if scale is None else scale
    o = np.zeros((batch, heads, n_q, dim))
    lse = np.full((batch, heads, n_q), NEG_INF)
    for b, h, i in itertools.product(range(batch), range(heads), range(n_q)):
        g = h // (heads // kv_heads)
        keys = [j for j in range(n_k) if not causal or j <= i + (n_k - n_q)]
        if not keys:
            continue
        scores = {
            j: scale * math.fsum(q[b, h, i, d] * k[b, g, j, d] for d in range(dim)) for j in keys
        }
        m = max(scores.values())
        w = {j: math.exp(x - m) for j, x in scores.items()}
        l = math.fsum(w.values())  # noqa: E741
        lse[b, h, i] = m + math.log(l)
        for d in range(dim):
            o[b, h, i, d] = math.fsum(w[j] * v[b, g, j, d] for j in keys) / l
    return o, lse


def assert_results_close(actual, expected):
    for got, want, name in zip(actual, expected, ("o", "lse")):
        assert got.shape == want.shape, name
        assert got.dtype == np.float64, name
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=name)


@st.composite
def qkv(draw, bound=3.0, max_seq=5):
    """q (B, H, Nq, D), k and v (B, Hkv, Nk, D).

    B 1..2, Hkv 1..2, H = Hkv * (1..3), Nq and Nk 0..max_seq, D 1..4.
    """
    batch, kv_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    n_q, n_k = draw(st.integers(0, max_seq)), draw(st.integers(0, max_seq))
    dim = draw(st.integers(1, 4))
    elements = st.floats(-bound, bound, allow_nan=False, allow_infinity=False)
    q = draw(hnp.arrays(np.float64, (batch, kv_heads * group, n_q, dim), elements=elements))
    k = draw(hnp.arrays(np.float64, (batch, kv_heads, n_k, dim), elements=elements))
    v = draw(hnp.arrays(np.float64, (batch, kv_heads, n_k, dim), elements=elements))
    return q, k, v


scales = st.one_of(st.none(), st.floats(0.05, 2.0))


# --------------------------------------------------------------------------- against the naive loop


@given(qkv(), st.booleans(), scales)
def test_matches_naive_loop(tensors, causal, scale):
    """Covers GQA, both causal alignments, Nq or Nk = 0, explicit and default scale."""
    expected = naive_attention(*tensors, causal, scale)
    assert_results_close(reference.attention(*tensors, causal=causal, scale=scale), expected)


@given(qkv(bound=100.0), st.booleans())
def test_large_scores_stay_finite(tensors, causal):
    """|scores| up to 2e4: the softmax is stabilised, nothing overflows."""
    o, lse = reference.attention(*tensors, causal=causal)
    assert np.isfinite(o).all()
    assert not np.isnan(lse).any() and (lse < np.inf).all()
    np.testing.assert_allclose(o, naive_attention(*tensors, causal)[0], rtol=RTOL, atol=1e-10)


@given(qkv(), st.booleans())
def test_gqa_equals_repeating_kv_heads(tensors, causal):
    q, k, v = tensors
    group = q.shape[1] // k.shape[1]
    # np.repeat gives heads [kv0] * group + [kv1] * group + ...: head h gets kv head h // group.
    k_rep, v_rep = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    expected = reference.attention(q, k_rep, v_rep, causal=causal)
    assert_results_close(reference.attention(q, k, v, causal=causal), expected)


def test_gqa_mapping_by_hand():
    """H = 4, Hkv = 2: heads 0, 1 read kv head 0 and heads 2, 3 read kv head 1 (not h % Hkv)."""
    q = np.zeros((1, 4, 1, 1))  # equal scores: o is the mean of the kv head's values
    k = np.zeros((1, 2, 2, 1))
    v = np.array([10.0, 20.0, 30.0, 40.0]).reshape(1, 2, 2, 1)
    o, _ = reference.attention(q, k, v)
    np.testing.assert_allclose(o[0, :, 0, 0], [15.0, 15.0, 35.0, 35.0], rtol=RTOL)


# --------------------------------------------------------------------------- causal alignment


def weights(n_q, n_k, causal):
    """The attention matrix itself: equal scores and v = I (D = Nk) give o = P."""
    q = np.zeros((1, 1, n_q, n_k))
    k = np.zeros((1, 1, n_k, n_k))
    v = np.eye(n_k).reshape(1, 1, n_k, n_k)
    o, lse = reference.attention(q, k, v, causal=causal)
    return o[0, 0], lse[0, 0]


def test_causal_is_bottom_right_aligned_when_nq_lt_nk():
    p, lse = weights(2, 4, causal=True)
    np.testing.assert_allclose(p, [[1 / 3, 1 / 3, 1 / 3, 0], [1 / 4] * 4], rtol=RTOL)
    np.testing.assert_allclose(lse, [math.log(3), math.log(4)], rtol=RTOL)


def test_causal_is_bottom_right_aligned_when_nq_gt_nk():
    """Nq = 4, Nk = 2: the first Nq - Nk rows see no key: o = 0, lse = -inf."""
    p, lse = weights(4, 2, causal=True)
    np.testing.assert_array_equal(p[:2], 0.0)
    np.testing.assert_array_equal(lse[:2], NEG_INF)
    np.testing.assert_allclose(p[2:], [[1, 0], [1 / 2, 1 / 2]], rtol=RTOL)
    np.testing.assert_allclose(lse[2:], [0.0, math.log(2)], atol=ATOL)


def test_causal_square_is_lower_triangular():
    """Nq == Nk: SDPA's is_causal, row i averages keys 0..i."""
    p, _ = weights(3, 3, causal=True)
    expected = np.tril(np.ones((3, 3))) / np.arange(1, 4)[:, None]
    np.testing.assert_allclose(p, expected, rtol=RTOL)
    np.testing.assert_allclose(weights(3, 3, causal=False)[0], np.full((3, 3), 1 / 3), rtol=RTOL)


# --------------------------------------------------------------------------- edges


@pytest.mark.parametrize("causal", [False, True])
def test_no_keys_gives_zero_and_minus_inf(causal):
    q = np.ones((2, 4, 3, 5))
    k = v = np.ones((2, 2, 0, 5))
    o, lse = reference.attention(q, k, v, causal=causal)
    assert o.shape == (2, 4, 3, 5) and lse.shape == (2, 4, 3)
    np.testing.assert_array_equal(o, 0.0)
    np.testing.assert_array_equal(lse, NEG_INF)


@pytest.mark.parametrize("causal", [False, True])
def test_no_queries_gives_empty_arrays(causal):
    kv = np.ones((2, 2, 3, 5))
    o, lse = reference.attention(np.ones((2, 4, 0, 5)), kv, kv, causal=causal)
    assert (o.shape, o.dtype) == ((2, 4, 0, 5), np.float64)
    assert (lse.shape, lse.dtype) == ((2, 4, 0), np.float64)


def test_default_scale_is_one_over_sqrt_head_dim(rng):
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    default = reference.attention(q, k, v)
    for got, want in zip(default, reference.attention(q, k, v, scale=0.5)):
        np.testing.assert_array_equal(got, want)
    assert not np.allclose(default[1], reference.attention(q, k, v, scale=1.0)[1])


def test_low_precision_and_list_inputs_are_upcast_and_not_modified(rng):
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float16) for _ in range(3))
    copies = [a.copy() for a in (q, k, v)]
    o, lse = reference.attention(q, k.astype(np.float32), v.tolist(), causal=True)
    assert o.dtype == lse.dtype == np.float64
    expected = reference.attention(*(a.astype(np.float64) for a in (q, k, v)), causal=True)
    assert_results_close((o, lse), expected)
    for before, after in zip(copies, (q, k, v)):
        np.testing.assert_array_equal(before, after)


class FakeCupyArray:
    """Quacks like a CuPy array: ``__cuda_array_interface__`` and ``get()``."""

    def __init__(self, host):
        self._host = host
        self.__cuda_array_interface__ = {"shape": host.shape}

    def get(self):
        return self._host


class FakeNumbaDeviceArray:
    """Quacks like a Numba device array: ``__cuda_array_interface__`` and ``copy_to_host()``."""

    def __init__(self, host):
        self._host = host
        self.__cuda_array_interface__ = {"shape": host.shape}

    def copy_to_host(self):
        return self._host


class FakeTorchTensor:
    """Quacks like a PyTorch CUDA tensor; ``numpy()`` refuses unless on the CPU, as torch does."""

    def __init__(self, host, on_cpu=False):
        self._host, self._on_cpu = host, on_cpu

    def detach(self):
        return self

    def cpu(self):
        return FakeTorchTensor(self._host, on_cpu=True)

    def double(self):
        return FakeTorchTensor(self._host.astype(np.float64), self._on_cpu)

    def numpy(self):
        if not self._on_cpu:
            raise TypeError("can't convert cuda tensor to numpy")
        return self._host


def test_gpu_array_types_are_fetched_by_duck_typing(rng):
    q, k, v = (rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(3))
    expected = reference.attention(q, k, v)
    got = reference.attention(FakeCupyArray(q), FakeTorchTensor(k), FakeNumbaDeviceArray(v))
    assert_results_close(got, expected)


# --------------------------------------------------------------------------- NaN


def test_nan_in_q_poisons_only_its_row(rng):
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    clean_o, clean_lse = reference.attention(q, k, v)
    q[0, 1, 2, 0] = np.nan
    o, lse = reference.attention(q, k, v)
    assert np.isnan(o[0, 1, 2]).all() and np.isnan(lse[0, 1, 2])
    o[0, 1, 2], lse[0, 1, 2] = clean_o[0, 1, 2], clean_lse[0, 1, 2]
    np.testing.assert_array_equal(o, clean_o)
    np.testing.assert_array_equal(lse, clean_lse)


def test_nan_value_reaches_only_the_rows_that_see_its_key(rng):
    """Causal, Nq = Nk = 4: a NaN in v at key 2 reaches rows 2 and 3, not rows 0 and 1."""
    q, k, v = (rng.standard_normal((1, 1, 4, 3)) for _ in range(3))
    clean_o, _ = reference.attention(q, k, v, causal=True)
    v[0, 0, 2, 1] = np.nan
    o, lse = reference.attention(q, k, v, causal=True)
    assert np.isnan(o[0, 0, 2:, 1]).all()
    # Equal up to rounding only: a non-finite v switches to the explicit per-row sum.
    np.testing.assert_allclose(o[0, 0, :2], clean_o[0, 0, :2], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(o[0, 0, :, [0, 2]], clean_o[0, 0, :, [0, 2]], rtol=RTOL, atol=ATOL)
    assert np.isfinite(lse).all()


def test_infinite_inputs_give_nan_or_inf_quietly():
    """Under ``-W error``: a +inf score (inf - inf) makes its row NaN; an infinite value
    reaches only the rows that see its key (causal: row 0 does not see key 1)."""
    q = np.ones((1, 1, 2, 1))
    k = np.ones((1, 1, 2, 1))
    v = np.array([1.0, np.inf]).reshape(1, 1, 2, 1)
    o, lse = reference.attention(q, k, v, causal=True)
    assert o[0, 0, 0, 0] == 1.0 and o[0, 0, 1, 0] == np.inf
    q[0, 0, 1, 0] = np.inf
    o, lse = reference.attention(q, k, v, causal=True)
    assert np.isnan(o[0, 0, 1, 0]) and np.isnan(lse[0, 0, 1])
    assert o[0, 0, 0, 0] == 1.0 and lse[0, 0, 0] == 1.0


# --------------------------------------------------------------------------- validation

Q, KV = np.zeros((2, 4, 3, 5)), np.zeros((2, 2, 6, 5))


@pytest.mark.parametrize(
    "args, error, name",
    [
        ((Q[0], KV, KV), ValueError, "q must be 4-D"),
        ((Q, KV[0], KV), ValueError, "k must be 4-D"),
        ((Q, KV, KV[0]), ValueError, "v must be 4-D"),
        ((Q, KV[:1], KV[:1]), ValueError, "k must have q's batch"),
        ((Q, KV[..., :4], KV[..., :4]), ValueError, "k must have q's head_dim"),
        ((Q, KV, KV[:, :, :5]), ValueError, "v must have the shape of k"),
        ((Q[:, :3], KV, KV), ValueError, "heads must be a positive multiple"),
        ((Q, KV[:, :0], KV[:, :0]), ValueError, "heads must be a positive multiple"),
        ((Q[..., :0], KV[..., :0], KV[..., :0]), ValueError, "head_dim >= 1"),
        ((Q.astype(complex), KV, KV), TypeError, "q must hold real numbers"),
        ((Q, KV, np.full(KV.shape, "x")), TypeError, "v must hold real numbers"),
    ],
)
def test_bad_arguments_are_named(args, error, name):
    with pytest.raises(error, match=name):
        reference.attention(*args)


def test_bfloat16_arrays_are_read_as_their_values():
    """NumPy bfloat16 (ml_dtypes), as ``numba_flash.attention`` takes it: the reference (forward and
    gradients) of the same values in float32, exactly (every bfloat16 is a float32)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    do, q, k, v = (rng.standard_normal((1, 2, 5, 4)).astype(ml_dtypes.bfloat16) for _ in range(4))
    wide = [x.astype(np.float32) for x in (do, q, k, v)]
    for got, want in zip(reference.attention(q, k, v, causal=True), reference.attention(*wide[1:], causal=True)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(reference.attention_backward(do, q, k, v), reference.attention_backward(*wide)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="q must hold real numbers"):
        reference.attention(q.astype(np.complex64), k, v)
