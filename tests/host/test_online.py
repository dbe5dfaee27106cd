"""Properties of the online-softmax algebra (numba_flash.online).

The oracles are independent of the code under test: ``softmax_oracle`` is a per-row
pure-Python softmax (``math.exp``, ``math.fsum``), and ``reference_rows`` runs
``numba_flash.reference.attention`` on a q/k/v whose scores are exactly the given ones.
Every test runs with warnings turned into errors: no RuntimeWarning may leak.
"""

from __future__ import annotations

import io
import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numba_flash import reference, seed_example
from numba_flash.online import SoftmaxState, empty_state, finalize, merge, update

pytestmark = pytest.mark.filterwarnings("error")

NEG_INF = -math.inf

# Float64 results of different but equivalent summation orders agree to a few ulps of
# the largest term; outputs are convex combinations of values bounded by VALUE_BOUND.
RTOL = 1e-12
ATOL = 1e-11
VALUE_BOUND = 10.0


# --------------------------------------------------------------------------- strategies


def elements(dtype, bound: float):
    """Finite numbers of ``dtype`` in ``[-bound, bound]``."""
    return hnp.from_dtype(
        np.dtype(dtype), min_value=-bound, max_value=bound, allow_nan=False, allow_infinity=False
    )


@st.composite
def chunked_problems(draw, score_bound=30.0, masked=False, min_keys=0, dtype=np.float64):
    """``(s, v, bounds)``: 1..4 rows, head_dim 1..4, 1..4 chunks of 0..6 keys each.

    ``s`` is (rows, n), ``v`` is (n, head_dim), chunk ``c`` is ``bounds[c]:bounds[c + 1]``.
    With ``masked``, some scores (possibly whole rows) are ``-inf``.
    """
    lengths = draw(
        st.lists(st.integers(0, 6), min_size=1, max_size=4).filter(lambda ls: sum(ls) >= min_keys)
    )
    bounds = np.cumsum([0, *lengths]).tolist()
    rows, head_dim, n = draw(st.integers(1, 4)), draw(st.integers(1, 4)), bounds[-1]
    s = draw(hnp.arrays(dtype, (rows, n), elements=elements(dtype, score_bound)))
    if masked:
        s = np.where(draw(hnp.arrays(np.bool_, (rows, n))), NEG_INF, s).astype(dtype)
    v = draw(hnp.arrays(dtype, (n, head_dim), elements=elements(dtype, VALUE_BOUND)))
    return s, v, bounds


# --------------------------------------------------------------------------- helpers


def chunks(bounds):
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def run_chunks(s, v, bounds, order=None):
    """Fold ``update`` over the chunks of ``bounds`` (in ``order`` if given)."""
    parts = chunks(bounds)
    if order is not None:
        parts = [parts[i] for i in order]
    state = empty_state(s.shape[0], v.shape[1])
    for part in parts:
        state = update(state, s[:, part], v[part])
    return state


def chunk_state(s, v, part):
    """The state of having seen only the keys in ``part``."""
    return update(empty_state(s.shape[0], v.shape[1]), s[:, part], v[part])


def softmax_oracle(s, v):
    """Row-by-row float64 softmax in pure Python: ``-inf`` keys are skipped entirely."""
    rows, head_dim = s.shape[0], v.shape[1]
    o = np.zeros((rows, head_dim))
    lse = np.full(rows, NEG_INF)
    for i in range(rows):
        seen = [j for j in range(s.shape[1]) if s[i, j] != NEG_INF]
        if not seen:
            continue
        m = max(s[i, j] for j in seen)
        w = {j: math.exp(s[i, j] - m) for j in seen}
        l = math.fsum(w.values())  # noqa: E741
        lse[i] = m + math.log(l)
        for d in range(head_dim):
            o[i, d] = math.fsum(w[j] * v[j, d] for j in seen) / l
    return o, lse


def reference_rows(s, v):
    """``reference.attention`` on q, k, v built so that ``q @ k.T`` is exactly ``s``.

    ``q = [s | 0]`` and ``k = [I | 0]`` (one-hot keys) in a head dim ``D >= n, d``;
    ``v`` is zero-padded to ``D`` columns and the first ``d`` output columns kept.
    Only for finite ``s`` (``-inf * 0`` would be NaN).
    """
    rows, n = s.shape
    d = v.shape[1]
    dim = max(n, d, 1)
    q = np.zeros((1, 1, rows, dim))
    q[0, 0, :, :n] = s
    k = np.zeros((1, 1, n, dim))
    k[0, 0, np.arange(n), np.arange(n)] = 1.0
    vv = np.zeros((1, 1, n, dim))
    vv[0, 0, :, :d] = v
    o, lse = reference.attention(q, k, vv, scale=1.0)
    return o[0, 0, :, :d], lse[0, 0]


def assert_results_close(actual, expected):
    """Compare two ``(o, lse)`` pairs; infinities and NaNs must sit in the same places."""
    for got, want, name in zip(actual, expected, ("o", "lse")):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=name)


def assert_states_close(a: SoftmaxState, b: SoftmaxState):
    """``m`` is a max, hence exact; ``l`` and ``acc`` agree up to rounding."""
    np.testing.assert_array_equal(a.m, b.m, err_msg="m")
    np.testing.assert_allclose(a.l, b.l, rtol=RTOL, atol=ATOL, err_msg="l")
    np.testing.assert_allclose(a.acc, b.acc, rtol=RTOL, atol=ATOL, err_msg="acc")


def assert_states_equal(a: SoftmaxState, b: SoftmaxState):
    for got, want, name in zip(a, b, SoftmaxState._fields):
        np.testing.assert_array_equal(got, want, err_msg=name)


@st.composite
def three_states(draw):
    """States of three disjoint key sets of the same rows (some may be empty)."""
    s, v, bounds = draw(chunked_problems(masked=draw(st.booleans())))
    parts = chunks(bounds)
    while len(parts) < 3:
        parts.append(slice(0, 0))
    return [chunk_state(s, v, part) for part in parts[:3]]


# --------------------------------------------------------------------------- the seed


def test_seed_worked_example():
    """s = [1, 2, 3, 10], V = ones, chunks [1, 2] and [3, 10]; numbers from the seed."""
    s = np.array([[1.0, 2.0, 3.0, 10.0]])
    v = np.ones((4, 1))
    after_1 = update(empty_state(1, 1), s[:, :2], v[:2])
    assert after_1.m[0] == 2.0
    assert after_1.l[0] == pytest.approx(1.368, abs=5e-4)
    assert after_1.acc[0, 0] == pytest.approx(1.368, abs=5e-4)  # the seed's O
    after_2 = update(after_1, s[:, 2:], v[2:])
    assert after_2.m[0] == 10.0
    assert after_2.l[0] == pytest.approx(1.00137, abs=5e-6)
    assert after_2.acc[0, 0] == pytest.approx(1.00137, abs=5e-6)
    o, _ = finalize(after_2)
    assert o[0, 0] == pytest.approx(1.0, abs=1e-15)

    # All at once: with V = I the output row is softmax(s) itself. The seed rounds
    # loosely (it prints 3.34e-4 and 9.08e-4 for 3.350e-4 and 9.106e-4), hence rtol.
    weights, _ = finalize(update(empty_state(1, 4), s, np.eye(4)))
    np.testing.assert_allclose(weights[0], [1.23e-4, 3.34e-4, 9.08e-4, 0.9985], rtol=5e-3)


def test_seed_practice_problem_1():
    """s = [0, 5], V = [[2], [3]], chunks [0] and [5], solved by hand.

    After [0]: m = 0, l = e^0 = 1, acc = 1 * 2 = 2.
    After [5]: m' = 5, alpha = e^(0 - 5); l = e^-5 + e^0, acc = 2 e^-5 + 3 e^0.
    o = acc / l = 2 e^0 / (e^0 + e^5) + 3 e^5 / (e^0 + e^5); lse = log(e^0 + e^5).
    """
    s = np.array([[0.0, 5.0]])
    v = np.array([[2.0], [3.0]])
    after_1 = update(empty_state(1, 1), s[:, :1], v[:1])
    assert (after_1.m[0], after_1.l[0], after_1.acc[0, 0]) == (0.0, 1.0, 2.0)
    after_2 = update(after_1, s[:, 1:], v[1:])
    assert after_2.m[0] == 5.0
    assert after_2.l[0] == pytest.approx(math.exp(-5) + 1, rel=1e-15)
    assert after_2.acc[0, 0] == pytest.approx(2 * math.exp(-5) + 3, rel=1e-15)
    o, lse = finalize(after_2)
    z = 1 + math.exp(5)
    assert o[0, 0] == pytest.approx(2 * 1 / z + 3 * math.exp(5) / z, rel=1e-14)
    assert o[0, 0] == pytest.approx(2.9933071, abs=1e-7)
    assert lse[0] == pytest.approx(math.log(z), rel=1e-15)


def test_seed_example_module_prints_library_states():
    states = seed_example.worked_example_states()
    s, v = seed_example.SCORES[None, :], seed_example.VALUES
    assert_states_equal(states[-1], run_chunks(s, v, [0, 2, 4]))
    out = io.StringIO()
    seed_example.print_worked_example(file=out)
    text = out.getvalue()
    assert "m = 2, l = 1.36787944, acc = [1.36787944]" in text
    assert "m = 10, l = 1.00137075, acc = [1.00137075]" in text
    assert "o = acc / l = [1]" in text


# --------------------------------------------------------------------------- merge algebra


@given(three_states())
def test_merge_is_associative(states):
    a, b, c = states
    assert_states_close(merge(merge(a, b), c), merge(a, merge(b, c)))


@given(three_states())
def test_merge_is_commutative_exactly(states):
    a, b, _ = states
    assert_states_equal(merge(a, b), merge(b, a))  # max and + are commutative in IEEE


@given(three_states())
def test_empty_state_is_merge_identity_on_both_sides(states):
    a = states[0]
    e = empty_state(*a.acc.shape)
    assert_states_equal(merge(a, e), a)
    assert_states_equal(merge(e, a), a)


@given(chunked_problems(masked=True))
def test_update_is_merge_with_the_chunk_state(problem):
    s, v, bounds = problem
    *earlier, last = chunks(bounds)
    state = run_chunks(s, v, bounds[:-1]) if earlier else empty_state(s.shape[0], v.shape[1])
    assert_states_close(update(state, s[:, last], v[last]), merge(state, chunk_state(s, v, last)))


def test_empty_state_finalizes_to_zero_and_minus_inf():
    e = empty_state(3, 2)
    assert_states_equal(e, SoftmaxState(np.full(3, NEG_INF), np.zeros(3), np.zeros((3, 2))))
    o, lse = finalize(e)
    np.testing.assert_array_equal(o, np.zeros((3, 2)))
    np.testing.assert_array_equal(lse, np.full(3, NEG_INF))


# --------------------------------------------------------------------------- invariance


@given(chunked_problems(masked=True), st.data())
def test_chunk_order_does_not_matter(problem, data):
    s, v, bounds = problem
    order = data.draw(st.permutations(range(len(bounds) - 1)))
    in_order = finalize(run_chunks(s, v, bounds))
    assert_results_close(finalize(run_chunks(s, v, bounds, order)), in_order)


@given(chunked_problems())
def test_any_partition_gives_the_reference_result(problem):
    s, v, bounds = problem
    result = finalize(run_chunks(s, v, bounds))
    assert_results_close(result, reference_rows(s, v))
    assert_results_close(result, softmax_oracle(s, v))


@given(chunked_problems(masked=True))
def test_masked_keys_and_rows(problem):
    """-inf keys are skipped; rows that see only -inf (or nothing) give o = 0, lse = -inf."""
    s, v, bounds = problem
    state = run_chunks(s, v, bounds)
    o, lse = finalize(state)
    for arr in (*state, o, lse):
        assert not np.isnan(arr).any()
    blind = np.all(s == NEG_INF, axis=1)
    np.testing.assert_array_equal(o[blind], 0.0)
    np.testing.assert_array_equal(lse[blind], NEG_INF)
    assert np.isfinite(lse[~blind]).all()
    assert_results_close((o, lse), softmax_oracle(s, v))


# --------------------------------------------------------------------------- numerics


@given(chunked_problems(score_bound=1e4, masked=True))
def test_scores_up_to_1e4_do_not_overflow(problem):
    s, v, bounds = problem
    state = run_chunks(s, v, bounds)
    o, lse = finalize(state)
    seen = ~np.all(s == NEG_INF, axis=1)
    assert np.isfinite(state.l).all() and np.isfinite(state.acc).all()
    assert np.isfinite(o).all() and np.isfinite(lse[seen]).all()
    assert (state.l[seen] >= 1).all()  # the max term contributes exp(0) = 1
    assert_results_close((o, lse), softmax_oracle(s, v))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@given(data=st.data())
def test_low_precision_inputs_are_computed_in_float64(dtype, data):
    """The state is float64 whatever the input dtype.

    Bound: against the float64 oracle on the same rounded inputs the only error is
    float64 rounding, at most 1e-12 * max(1, max|v|) on o and 1e-12 * max(1, |lse|) on
    lse (a float16 computation would be off by ~1e-3, a float32 one by ~1e-7).
    """
    s, v, bounds = data.draw(chunked_problems(score_bound=100.0, masked=True, dtype=dtype))
    state = run_chunks(s, v, bounds)
    assert all(arr.dtype == np.float64 for arr in state)
    o, lse = finalize(state)
    assert o.dtype == np.float64 and lse.dtype == np.float64

    o_ref, lse_ref = softmax_oracle(s.astype(np.float64), v.astype(np.float64))
    v_max = max(1.0, float(np.abs(v.astype(np.float64)).max(initial=0.0)))
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    assert np.abs(o - o_ref).max(initial=0.0) <= 1e-12 * v_max
    seen = np.isfinite(lse_ref)
    lse_err = np.abs(lse[seen] - lse_ref[seen])
    assert (lse_err <= 1e-12 * np.maximum(1.0, np.abs(lse_ref[seen]))).all()


# --------------------------------------------------------------------------- NaN and warnings


@given(chunked_problems(masked=True, min_keys=1), st.data())
def test_nan_score_poisons_exactly_its_row(problem, data):
    s, v, bounds = problem
    i = data.draw(st.integers(0, s.shape[0] - 1))
    j = data.draw(st.integers(0, s.shape[1] - 1))
    poisoned = s.copy()
    poisoned[i, j] = np.nan

    state = run_chunks(poisoned, v, bounds)
    o, lse = finalize(state)
    clean_o, clean_lse = finalize(run_chunks(s, v, bounds))
    assert np.isnan(state.m[i]) and np.isnan(state.l[i]) and np.isnan(state.acc[i]).all()
    assert np.isnan(o[i]).all() and np.isnan(lse[i])
    others = np.arange(s.shape[0]) != i
    np.testing.assert_array_equal(o[others], clean_o[others])
    np.testing.assert_array_equal(lse[others], clean_lse[others])


@given(chunked_problems(masked=True, min_keys=1), st.data())
def test_nan_value_poisons_exactly_the_rows_that_see_its_key(problem, data):
    """NaN in v[j, d] reaches o[i, d] iff s[i, j] > -inf; lse and other columns are untouched."""
    s, v, bounds = problem
    j = data.draw(st.integers(0, s.shape[1] - 1))
    d = data.draw(st.integers(0, v.shape[1] - 1))
    poisoned = v.copy()
    poisoned[j, d] = np.nan

    o, lse = finalize(run_chunks(s, poisoned, bounds))
    clean_o, clean_lse = finalize(run_chunks(s, v, bounds))
    sees = s[:, j] != NEG_INF
    assert np.isnan(o[sees, d]).all()
    touched = np.zeros(o.shape, dtype=bool)
    touched[sees, d] = True
    np.testing.assert_array_equal(o[~touched], clean_o[~touched])
    np.testing.assert_array_equal(lse, clean_lse)


def test_edge_cases_raise_no_warning_and_no_error():
    """Each case once, under ``-W error`` (the module's mark): quiet, and the documented result."""
    rows, head_dim = 3, 2
    e = empty_state(rows, head_dim)
    nothing = update(e, np.zeros((rows, 0)), np.zeros((0, head_dim)))  # an empty chunk
    assert_states_equal(nothing, e)
    all_masked = update(e, np.full((rows, 2), NEG_INF), np.full((2, head_dim), np.nan))
    assert_states_equal(all_masked, e)
    assert_states_equal(merge(all_masked, e), e)
    o, lse = finalize(all_masked)
    assert not np.isnan(o).any() and (lse == NEG_INF).all()

    # A +inf score is outside softmax's domain (inf - inf): its row is NaN, quietly. An
    # infinite value reaches the rows that see its key, and only those.
    s = np.array([[np.inf, 0.0], [0.0, 1.0], [NEG_INF, 0.0]])
    v = np.array([[1.0, np.inf], [2.0, 3.0]])
    o, lse = finalize(merge(update(e, s, v), all_masked))
    assert np.isnan(o[0]).all() and np.isnan(lse[0])
    assert np.isfinite(o[1, 0]) and o[1, 1] == np.inf
    np.testing.assert_array_equal(o[2], [2.0, 3.0])


def test_update_does_not_modify_its_inputs():
    s = np.array([[1.0, NEG_INF], [2.0, 3.0]])
    v = np.array([[1.0], [np.nan]])
    state = update(empty_state(2, 1), s[:, :1], v[:1])
    copies = [a.copy() for a in (s, v, *state)]
    update(state, s, v)
    merge(state, state)
    finalize(state)
    for before, after in zip(copies, (s, v, *state)):
        np.testing.assert_array_equal(before, after)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "s_shape, v_shape, name",
    [
        ((3, 4), (4, 3), "s_chunk"),  # 3 rows, the state has 2
        ((4,), (4, 3), "s_chunk"),  # not 2-D
        ((2, 4), (5, 3), "v_chunk"),  # 5 keys, s_chunk has 4
        ((2, 4), (4, 2), "v_chunk"),  # head_dim 2, the state has 3
        ((2, 4), (4,), "v_chunk"),  # not 2-D
    ],
)
def test_update_names_the_badly_shaped_chunk(s_shape, v_shape, name):
    with pytest.raises(ValueError, match=name):
        update(empty_state(2, 3), np.zeros(s_shape), np.zeros(v_shape))


def _state(m_shape, l_shape, acc_shape):
    return SoftmaxState(np.zeros(m_shape), np.zeros(l_shape), np.zeros(acc_shape))


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda: update(empty_state(2, 1), [[1j]], [[0.0]]), TypeError, "s_chunk"),
        (lambda: update(_state(2, 3, (2, 3)), np.zeros((2, 1)), np.zeros((1, 3))), ValueError, "st"),
        (lambda: merge(empty_state(2, 3), empty_state(2, 4)), ValueError, "a and b"),
        (lambda: merge(empty_state(2, 3), empty_state(3, 3)), ValueError, "a and b"),
        (lambda: merge(empty_state(2, 3), _state(2, (2, 1), (2, 3))), ValueError, "b.l"),
        (lambda: finalize(_state(2, 2, 2)), ValueError, "st.acc"),
        (lambda: finalize(42), TypeError, "st"),
        (lambda: empty_state(-1, 2), ValueError, "rows"),
        (lambda: empty_state(2, -1), ValueError, "head_dim"),
        (lambda: empty_state(2.5, 1), TypeError, "rows"),
    ],
)
def test_bad_arguments_are_named(call, error, name):
    with pytest.raises(error, match=name):
        call()
