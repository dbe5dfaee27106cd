"""The float64 gradients (``numba_flash.reference.attention_backward``) against central finite
differences of the float64 forward (``numba_flash.reference.attention``).

The function differentiated is ``f(q, k, v) = sum(do * o)``, so the gradients checked are
exactly what the backward pass receives ``do`` for. Rows that see no key (causal with
Nq > Nk, Nk = 0) must give exactly zero gradients. Warnings are errors throughout.
"""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from helpers import central_differences, examples
from hypothesis import example, given, settings
from hypothesis import strategies as st

from numba_flash import reference

pytestmark = pytest.mark.filterwarnings("error")

STEP = 1e-5  # central differences: truncation ~ STEP^2, cancellation ~ 1e-16 |f| / STEP
RTOL = 1e-6
ATOL = 1e-7


def finite_difference_gradients(do, q, k, v, causal, scale):
    """``(dq, dk, dv)`` of ``sum(do * attention(q, k, v)[0])`` by central differences."""
    return central_differences(
        lambda q, k, v: float(np.sum(do * reference.attention(q, k, v, causal=causal, scale=scale)[0])), q, k, v,
        step=STEP)


@st.composite
def problems(draw, bound=2.0, max_seq=4):
    """``(do, q, k, v)``: B 1..2, Hkv 1..2, H = Hkv * (1..3), Nq and Nk 0..max_seq, D 1..3."""
    batch, kv_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    n_q, n_k = draw(st.integers(0, max_seq)), draw(st.integers(0, max_seq))
    dim = draw(st.integers(1, 3))
    elements = st.floats(-bound, bound, allow_nan=False, allow_infinity=False)
    q_shape = (batch, kv_heads * group, n_q, dim)
    kv_shape = (batch, kv_heads, n_k, dim)
    do = draw(hnp.arrays(np.float64, q_shape, elements=elements))
    q = draw(hnp.arrays(np.float64, q_shape, elements=elements))
    k = draw(hnp.arrays(np.float64, kv_shape, elements=elements))
    v = draw(hnp.arrays(np.float64, kv_shape, elements=elements))
    return do, q, k, v


def _random(seed, batch, heads, kv_heads, n_q, n_k, dim):
    rng = np.random.default_rng(seed)
    q_shape, kv_shape = (batch, heads, n_q, dim), (batch, kv_heads, n_k, dim)
    return tuple(rng.standard_normal(s) for s in (q_shape, q_shape, kv_shape, kv_shape))


scales = st.one_of(st.none(), st.floats(0.05, 2.0))


def assert_gradients_close(got, want):
    for g, w, name in zip(got, want, ("dq", "dk", "dv")):
        assert g.shape == w.shape, name
        assert g.dtype == np.float64, name
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=name)


# --------------------------------------------------------------------------- finite differences


@settings(max_examples=examples(40))
@given(problem=problems(), causal=st.booleans(), scale=scales)
@example(problem=_random(0, 1, 4, 2, 3, 4, 2), causal=True, scale=None)  # GQA, causal, Nq < Nk
@example(problem=_random(1, 2, 3, 1, 4, 2, 3), causal=True, scale=0.7)  # Nq > Nk: 2 rows see nothing
@example(problem=_random(2, 1, 2, 2, 3, 3, 1), causal=False, scale=None)  # D = 1
@example(problem=_random(3, 1, 2, 1, 5, 3, 1), causal=True, scale=1.5)  # D = 1, GQA, masked rows
def test_matches_finite_differences(problem, causal, scale):
    do, q, k, v = problem
    got = reference.attention_backward(do, q, k, v, causal=causal, scale=scale)
    want = finite_difference_gradients(do, q, k, v, causal, scale)
    assert_gradients_close(got, want)


@pytest.mark.parametrize("causal", [False, True])
def test_shift_invariances(causal):
    """Two exact identities, independent of finite differences. Adding a vector c to every
    key adds ``scale q_i . c`` to every score of row i, which softmax ignores: the keys'
    gradients sum to zero. Adding c to every value adds c to each ``o_i`` of a row that sees
    a key: the values' gradients sum to the ``do`` of those rows."""
    do, q, k, v = _random(4, 2, 4, 2, 6, 4, 3)  # causal: the first 2 rows see no key
    _, dk, dv = reference.attention_backward(do, q, k, v, causal=causal)
    np.testing.assert_allclose(dk.sum(axis=2), 0.0, atol=1e-12)
    seen = do[:, :, 2:] if causal else do
    want = seen.sum(axis=2).reshape(2, 2, 2, 3).sum(axis=2)  # query heads 2g, 2g+1 -> kv head g
    np.testing.assert_allclose(dv.sum(axis=2), want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- masked rows


@settings(max_examples=examples(20))
@given(
    seed=st.integers(0, 2**32 - 1),
    n_k=st.integers(0, 3),
    extra=st.integers(1, 3),
    group=st.integers(1, 3),
    dim=st.integers(1, 4),
    junk=st.floats(-1e300, 1e300, allow_nan=False),
)
def test_fully_masked_rows_give_exactly_zero_gradients(seed, n_k, extra, group, dim, junk):
    """Causal with Nq = Nk + extra: the first ``extra`` rows see no key. Their dq is exactly 0
    and their do (here replaced by huge values) changes dk and dv by exactly nothing."""
    n_q = n_k + extra
    do, q, k, v = _random(seed, 2, 2 * group, 2, n_q, n_k, dim)
    dq, dk, dv = reference.attention_backward(do, q, k, v, causal=True)
    assert np.all(dq[:, :, :extra] == 0.0)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()

    do_junk = do.copy()
    do_junk[:, :, :extra] = junk
    dq2, dk2, dv2 = reference.attention_backward(do_junk, q, k, v, causal=True)
    np.testing.assert_array_equal(dq2, dq)
    np.testing.assert_array_equal(dk2, dk)
    np.testing.assert_array_equal(dv2, dv)


def test_no_keys_at_all():
    do, q, k, v = _random(5, 1, 4, 2, 3, 0, 2)
    dq, dk, dv = reference.attention_backward(do, q, k, v)
    assert dq.shape == q.shape and np.all(dq == 0.0)
    assert dk.shape == dv.shape == (1, 2, 0, 2)


def test_no_queries_at_all():
    do, q, k, v = _random(6, 1, 2, 1, 0, 3, 2)
    dq, dk, dv = reference.attention_backward(do, q, k, v, causal=True)
    assert dq.shape == (1, 2, 0, 2)
    assert np.all(dk == 0.0) and np.all(dv == 0.0)


# --------------------------------------------------------------------------- structure and inputs


def test_gqa_gradients_sum_over_the_query_heads():
    """dk, dv of a GQA problem equal those of the same problem with k, v repeated per query
    head (MHA), summed over each kv head's query heads."""
    group = 3
    do, q, k, v = _random(7, 2, 2 * group, 2, 4, 5, 3)
    dq, dk, dv = reference.attention_backward(do, q, k, v, causal=True)
    k_rep, v_rep = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    dq_m, dk_m, dv_m = reference.attention_backward(do, q, k_rep, v_rep, causal=True)
    np.testing.assert_allclose(dq, dq_m, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(dk, dk_m.reshape(2, 2, group, 5, 3).sum(axis=2), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(dv, dv_m.reshape(2, 2, group, 5, 3).sum(axis=2), rtol=1e-13, atol=1e-15)


def test_inputs_of_any_kind_are_converted_as_by_the_forward():
    do, q, k, v = _random(8, 1, 2, 1, 3, 3, 2)
    want = reference.attention_backward(do, q, k, v)
    got = reference.attention_backward(do.tolist(), q.astype(np.float32), k.tolist(), v)
    want32 = reference.attention_backward(do, q.astype(np.float32).astype(np.float64), k, v)
    for g, w, w32 in zip(got, want, want32):
        assert g.dtype == np.float64
        np.testing.assert_array_equal(g, w32)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # Inputs are never modified.
    copies = [x.copy() for x in (do, q, k, v)]
    reference.attention_backward(do, q, k, v, causal=True)
    for x, c in zip((do, q, k, v), copies):
        np.testing.assert_array_equal(x, c)


def test_shape_errors_name_the_argument():
    do, q, k, v = _random(9, 1, 2, 1, 3, 3, 2)
    with pytest.raises(ValueError, match="do must have the shape of q"):
        reference.attention_backward(do[:, :, :2], q, k, v)
    with pytest.raises(ValueError, match="v must have the shape of k"):
        reference.attention_backward(do, q, k, v[:, :, :2])
    with pytest.raises(TypeError, match="do must hold real numbers"):
        reference.attention_backward(do.astype(complex), q, k, v)
