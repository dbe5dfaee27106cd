"""The float64 oracle's masks and score modifications (API.md section 2c): ``window_size``,
``softcap``, ``alibi_slopes``, ``mask_mod``, ``score_mod`` (+ ``score_mod_grad``), ``mod_args``.

Forward: each argument against an independent statement of it (a pure-Python loop written from
API.md's words, another argument that means the same thing, a hand-written formula). Backward:
against central finite differences of the float64 forward. Warnings are errors throughout.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from helpers import central_differences, examples
from hypothesis import example, given, settings
from hypothesis import strategies as st

from numba_flash import reference

pytestmark = pytest.mark.filterwarnings("error")

STEP = 1e-5  # central differences, as test_reference_backward.py
RTOL = 1e-6
ATOL = 1e-7


def random_problem(seed, batch=1, heads=2, kv_heads=1, n_q=3, n_k=4, dim=2):
    """``(do, q, k, v)``, standard normal float64."""
    rng = np.random.default_rng(seed)
    q_shape, kv_shape = (batch, heads, n_q, dim), (batch, kv_heads, n_k, dim)
    return tuple(rng.standard_normal(s) for s in (q_shape, q_shape, kv_shape, kv_shape))


@st.composite
def problems(draw, max_seq=5):
    """``(do, q, k, v)``: B 1..2, Hkv 1..2, H = Hkv * (1..2), Nq and Nk 0..max_seq, D 1..3."""
    kv_heads = draw(st.integers(1, 2))
    return random_problem(
        draw(st.integers(0, 2**32 - 1)),
        batch=draw(st.integers(1, 2)),
        heads=kv_heads * draw(st.integers(1, 2)),
        kv_heads=kv_heads,
        n_q=draw(st.integers(0, max_seq)),
        n_k=draw(st.integers(0, max_seq)),
        dim=draw(st.integers(1, 3)),
    )


windows = st.tuples(st.integers(-1, 4), st.integers(-1, 4))


def window_mask_mod(left, right, n_q, n_k):
    """API.md 2c's window, word for word, as a mask_mod (vectorisable)."""
    offset = n_k - n_q

    def mask_mod(b, h, i, j):
        seen = (j == j) & (i == i)
        if left != -1:
            seen = seen & (i + offset - left <= j)
        if right != -1:
            seen = seen & (j <= i + offset + right)
        return seen

    return mask_mod


def naive_attention(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None, visible=None, score_mod=None):
    """One (b, h, i) at a time in pure Python from API.md 2c: scale, softcap, ALiBi, score_mod,
    then the masks (causal, window, ``visible[b, h, i, j]``); empty rows give (0, -inf)."""
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    scale, offset = 1 / math.sqrt(dim), n_k - n_q
    left, right = window
    o, lse = np.zeros(q.shape), np.full(q.shape[:3], -math.inf)
    for b, h, i in itertools.product(range(batch), range(heads), range(n_q)):
        g = h // (heads // kv_heads)
        scores = {}
        for j in range(n_k):
            if causal and j > i + offset:
                continue
            if left != -1 and j < i + offset - left:
                continue
            if right != -1 and j > i + offset + right:
                continue
            if visible is not None and not visible[b, h, i, j]:
                continue
            s = scale * math.fsum(q[b, h, i, d] * k[b, g, j, d] for d in range(dim))
            if softcap:
                s = softcap * math.tanh(s / softcap)
            if slopes is not None:
                table = slopes.reshape(-1, heads)  # (1 or B, H)
                s -= float(table[b % len(table), h]) * abs(i + offset - j)
            if score_mod is not None:
                s = score_mod(s, b, h, i, j)
            scores[j] = s
        if not scores:
            continue
        m = max(scores.values())
        w = {j: math.exp(s - m) for j, s in scores.items()}
        total = math.fsum(w.values())
        lse[b, h, i] = m + math.log(total)
        for d in range(dim):
            o[b, h, i, d] = math.fsum(w[j] * v[b, g, j, d] for j in w) / total
    return o, lse


def finite_difference_gradients(do, q, k, v, **kwargs):
    """``(dq, dk, dv)`` of ``sum(do * attention(q, k, v, **kwargs)[0])``, central differences."""
    return central_differences(lambda *args: float(np.sum(do * reference.attention(*args, **kwargs)[0])), q, k, v,
                               step=STEP)


def assert_same(got, want, exact=False):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == np.float64
        if exact:
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- forward: masks


@settings(max_examples=examples(30))
@given(problem=problems())
def test_window_minus_one_zero_is_causal(problem):
    _, q, k, v = problem
    want = reference.attention(q, k, v, causal=True)
    assert_same(reference.attention(q, k, v, window_size=(-1, 0)), want, exact=True)


@settings(max_examples=examples(40))
@given(problem=problems(), window=windows, causal=st.booleans())
@example(problem=random_problem(0, n_q=4, n_k=5), window=(2, 3), causal=True)  # causal caps right
@example(problem=random_problem(1, n_q=5, n_k=3), window=(1, -1), causal=False)  # rows see nothing
def test_window_equals_its_mask_mod(problem, window, causal):
    """The window (with causal: their intersection) equals API.md's formula as a mask_mod."""
    _, q, k, v = problem
    n_q, n_k = q.shape[2], k.shape[2]
    got = reference.attention(q, k, v, causal=causal, window_size=window)
    right = window[1] if not causal else (0 if window[1] == -1 else min(window[1], 0))
    want = reference.attention(q, k, v, mask_mod=window_mask_mod(window[0], right, n_q, n_k))
    assert_same(got, want, exact=True)


@settings(max_examples=examples(30))
@given(problem=problems(max_seq=4), window=windows, causal=st.booleans(), data=st.data())
def test_masks_intersect(problem, window, causal, data):
    """causal, window and a random mask_mod (a table through mod_args) together: a key is seen
    when every mask says so (against the pure-Python loop)."""
    _, q, k, v = problem
    shape = q.shape[:3] + k.shape[2:3]
    size = math.prod(shape)
    table = np.asarray(data.draw(st.lists(st.booleans(), min_size=size, max_size=size))).reshape(shape)
    got = reference.attention(
        q, k, v, causal=causal, window_size=window, mask_mod=lambda b, h, i, j, t: t[b, h, i, j], mod_args=(table,)
    )
    want = naive_attention(q, k, v, causal=causal, window=window, visible=table)
    assert_same(got, want)


# --------------------------------------------------------------------------- forward: scores


@settings(max_examples=examples(30))
@given(problem=problems(), per_batch=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_alibi_equals_a_score_mod_that_adds_its_bias(problem, per_batch, seed):
    _, q, k, v = problem
    batch, heads, n_q, _ = q.shape
    n_k = k.shape[2]
    rng = np.random.default_rng(seed)
    slopes = rng.uniform(0, 1, (batch, heads) if per_batch else (heads,)).astype(np.float32)
    got = reference.attention(q, k, v, alibi_slopes=slopes)
    table = slopes.reshape(-1, heads).astype(np.float64)

    def bias(score, b, h, i, j, t):  # vectorisable: indexing and abs broadcast
        return score - t[b % t.shape[0], h] * abs(i + (n_k - n_q) - j)

    assert_same(got, reference.attention(q, k, v, score_mod=bias, mod_args=(table,)))


def test_softcap_alibi_and_score_mod_in_order_by_hand():
    """Nq = 1, Nk = 2, D = 1: each score written out, in API.md's order (scale, softcap, ALiBi,
    score_mod); any other order gives other numbers here."""
    q = np.array([[[[1.5]]], [[[-0.7]]]])  # (B=2, H=1, 1, 1)
    k = np.array([[[[2.0], [-1.0]]], [[[0.5], [3.0]]]])  # (2, 1, 2, 1)
    v = np.array([[[[1.0], [-2.0]]], [[[4.0], [0.25]]]])
    scale, cap, slopes = 1.3, 0.8, np.array([[0.5], [1.25]], dtype=np.float32)
    o, lse = reference.attention(
        q, k, v, scale=scale, softcap=cap, alibi_slopes=slopes, score_mod=lambda s, b, h, i, j: 2 * s + b
    )
    for b in range(2):
        # Nq = 1, Nk = 2: offset 1, so key j is |0 + 1 - j| from the diagonal.
        s = [scale * q[b, 0, 0, 0] * k[b, 0, j, 0] for j in range(2)]
        s = [cap * math.tanh(x / cap) for x in s]
        s = [x - float(slopes[b, 0]) * abs(1 - j) for j, x in enumerate(s)]
        s = [2 * x + b for x in s]
        w = [math.exp(x) for x in s]
        assert lse[b, 0, 0] == pytest.approx(math.log(sum(w)), rel=1e-14)
        assert o[b, 0, 0, 0] == pytest.approx((w[0] * v[b, 0, 0, 0] + w[1] * v[b, 0, 1, 0]) / sum(w), rel=1e-14)


@settings(max_examples=examples(30))
@given(
    problem=problems(max_seq=4),
    window=windows,
    softcap=st.sampled_from([0.0, 0.3, 2.0]),
    alibi=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_everything_together_matches_the_pure_python_loop(problem, window, softcap, alibi, seed):
    _, q, k, v = problem
    slopes = np.random.default_rng(seed).uniform(0, 1, q.shape[:2]).astype(np.float32) if alibi else None

    def score_mod(s, b, h, i, j):
        return s * (1 + 0.5 * h) - 0.1 * b + 0.05 * (i - j)

    got = reference.attention(q, k, v, window_size=window, softcap=softcap, alibi_slopes=slopes, score_mod=score_mod)
    want = naive_attention(q, k, v, window=window, softcap=softcap, slopes=slopes, score_mod=score_mod)
    assert_same(got, want)


def test_mods_see_the_query_head_under_gqa():
    """h is the query head (not the kv head): the same as MHA on repeated k, v."""
    _, q, k, v = random_problem(1, batch=2, heads=6, kv_heads=2, n_q=3, n_k=5, dim=2)
    kwargs = dict(
        mask_mod=lambda b, h, i, j: (h + j) % 3 != 0,
        score_mod=lambda s, b, h, i, j: s + 0.3 * h,
        alibi_slopes=np.linspace(0.1, 0.6, 6),
    )
    got = reference.attention(q, k, v, **kwargs)
    want = reference.attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), **kwargs)
    assert_same(got, want, exact=True)


# --------------------------------------------------------------------------- how mods are called


def test_a_vectorisable_mod_is_called_once_and_a_branching_one_per_element():
    _, q, k, v = random_problem(2, batch=2, heads=2, n_q=3, n_k=4)
    calls = {"vector": 0, "scalar": 0}

    def vector(b, h, i, j):
        calls["vector"] += 1
        return (j <= i + 1) & (b + h != 2)

    def scalar(b, h, i, j):  # `if` and `and` on an array raise: the elementwise loop runs it
        calls["scalar"] += 1
        if j <= i + 1 and b + h != 2:
            return True
        return False

    got = reference.attention(q, k, v, mask_mod=vector)
    want = reference.attention(q, k, v, mask_mod=scalar)
    assert_same(got, want, exact=True)
    assert calls["vector"] == 1
    assert calls["scalar"] == 1 + 2 * 2 * 3 * 4  # the failed array call, then every element


def test_a_score_mod_with_math_runs_elementwise_on_the_seen_keys():
    _, q, k, v = random_problem(3, n_q=3, n_k=4)
    seen = []

    def score_mod(s, b, h, i, j):
        seen.append((b, h, i, j))
        return 2.0 * math.tanh(s)  # math.tanh of an array raises

    got = reference.attention(q, k, v, causal=True, score_mod=score_mod)
    want = reference.attention(q, k, v, causal=True, score_mod=lambda s, b, h, i, j: 2.0 * np.tanh(s))
    assert_same(got, want)
    assert all(type(x) is int for x in seen[-1])
    assert len(seen) == 1 + 2 * (2 + 3 + 4)  # the failed array call, then the seen keys only


def test_a_numba_device_function_is_called_through_its_python_function():
    from numba import cuda

    @cuda.jit(device=True)
    def mask_mod(b, h, i, j):
        return j <= i + 1

    class HostUncallable:  # as numba's CUDADispatcher on a GPU: not callable from the host
        def __init__(self, py_func):
            self.py_func = py_func

        def __call__(self, *args):
            raise RuntimeError("a device function cannot be called from the host")

    _, q, k, v = random_problem(4)
    want = reference.attention(q, k, v, causal=True)
    assert_same(reference.attention(q, k, v, mask_mod=mask_mod), want, exact=True)
    assert_same(reference.attention(q, k, v, mask_mod=HostUncallable(mask_mod.py_func)), want, exact=True)


def test_mod_args_are_read_only_and_inputs_unchanged():
    _, q, k, v = random_problem(5)
    table = np.zeros(4)

    def writes(s, b, h, i, j, t):
        t[0] = 1.0
        return s

    with pytest.raises(ValueError, match="read-only"):
        reference.attention(q, k, v, score_mod=writes, mod_args=(table,))
    assert np.all(table == 0.0)


def test_a_score_mod_that_writes_into_its_score_cannot_change_what_the_gradient_sees():
    """The score array is read-only: a mod that updates it in place runs elementwise (on
    floats), and score_mod_grad still gets the unmodified score."""
    do, q, k, v = random_problem(12)

    def in_place(s, b, h, i, j):
        s += np.sin(s)
        return s

    def out_of_place(s, b, h, i, j):
        return s + np.sin(s)

    def grad(s, b, h, i, j):
        return 1 + np.cos(s)

    want = reference.attention(q, k, v, score_mod=out_of_place)
    assert_same(reference.attention(q, k, v, score_mod=in_place), want)
    got = reference.attention_backward(do, q, k, v, score_mod=in_place, score_mod_grad=grad)
    want = reference.attention_backward(do, q, k, v, score_mod=out_of_place, score_mod_grad=grad)
    assert_same(got, want)


# --------------------------------------------------------------------------- rows that see no key


ROW_HIDING = [
    dict(window_size=(0, 0)),  # Nq > Nk: the first Nq - Nk rows see nothing
    dict(window_size=(1, -1), causal=True, softcap=0.5),
    dict(mask_mod=lambda b, h, i, j: (i != 1) & (h != 1), alibi_slopes=np.array([0.5, 0.25])),
    # A gradient that is NaN where the mask hides the key: those entries must still give 0.
    dict(
        mask_mod=lambda b, h, i, j: i >= 4,
        score_mod=lambda s, b, h, i, j: 3 * s,
        score_mod_grad=lambda s, b, h, i, j: np.where(i >= 4, 3.0, np.nan),
    ),
]


@pytest.mark.parametrize("kwargs", ROW_HIDING)
def test_rows_that_see_no_key(kwargs):
    """o = 0, lse = -inf, dq = 0 for the hidden rows, and their do changes nothing."""
    do, q, k, v = random_problem(6, heads=2, n_q=6, n_k=4, dim=3)
    fwd = {key: val for key, val in kwargs.items() if key != "score_mod_grad"}
    o, lse = reference.attention(q, k, v, **fwd)
    empty = lse == -np.inf
    assert empty.any() and not empty.all()
    assert np.all(o[empty] == 0.0) and np.isfinite(o).all() and np.isfinite(lse[~empty]).all()
    dq, dk, dv = reference.attention_backward(do, q, k, v, **kwargs)
    assert np.all(dq[empty] == 0.0)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    junk = do.copy()
    junk[empty] = 1e300
    for got, want in zip(reference.attention_backward(junk, q, k, v, **kwargs), (dq, dk, dv)):
        np.testing.assert_array_equal(got, want)


def test_a_mask_that_hides_everything():
    do, q, k, v = random_problem(7)
    o, lse = reference.attention(q, k, v, mask_mod=lambda b, h, i, j: False, softcap=1.0)
    assert np.all(o == 0.0) and np.all(lse == -np.inf)
    for grad in reference.attention_backward(do, q, k, v, mask_mod=lambda b, h, i, j: False, softcap=1.0):
        assert np.all(grad == 0.0)


# --------------------------------------------------------------------------- backward


def smooth_mod(s, b, h, i, j):
    return s + 0.5 * np.sin(s) + 0.1 * h * s


def smooth_mod_grad(s, b, h, i, j):
    return 1 + 0.5 * np.cos(s) + 0.1 * h


GRADIENT_CASES = {
    "softcap": dict(softcap=0.7),
    "alibi": dict(alibi_slopes=np.array([0.4, 1.1], dtype=np.float32)),
    "alibi per batch": dict(alibi_slopes=np.array([[0.4, 1.1], [0.9, 0.2]], dtype=np.float32)),
    "window": dict(window_size=(1, 1)),
    "window and causal": dict(window_size=(2, 1), causal=True),
    "score_mod": dict(score_mod=smooth_mod, score_mod_grad=smooth_mod_grad),
    "all together": dict(
        softcap=1.5,
        alibi_slopes=np.array([0.3, 0.6]),
        window_size=(2, 0),
        mask_mod=lambda b, h, i, j: (i + j + b) % 4 != 1,
        score_mod=smooth_mod,
        score_mod_grad=smooth_mod_grad,
        scale=0.8,
    ),
}


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_gradients_match_finite_differences(name, gqa):
    kwargs = GRADIENT_CASES[name]
    do, q, k, v = random_problem(8, batch=2, heads=2, kv_heads=1 if gqa else 2, n_q=3, n_k=4, dim=2)
    q = 1.5 * q  # scores of order 1-3: softcap's tanh bends
    got = reference.attention_backward(do, q, k, v, **kwargs)
    fwd = {key: val for key, val in kwargs.items() if key != "score_mod_grad"}
    want = finite_difference_gradients(do, q, k, v, **fwd)
    for g, w, what in zip(got, want, ("dq", "dk", "dv")):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=what)


def test_a_wrong_score_mod_grad_gives_wrong_gradients():
    """The backward uses score_mod_grad (it is not re-derived): a wrong one shows."""
    do, q, k, v = random_problem(9)
    right = reference.attention_backward(do, q, k, v, score_mod=smooth_mod, score_mod_grad=smooth_mod_grad)
    wrong = reference.attention_backward(do, q, k, v, score_mod=smooth_mod, score_mod_grad=lambda s, b, h, i, j: 1.0)
    assert not np.allclose(right[0], wrong[0])
    np.testing.assert_array_equal(right[2], wrong[2])  # dv = P^T dO needs no gradient of S


# --------------------------------------------------------------------------- argument errors


def test_score_mod_without_its_gradient_raises():
    do, q, k, v = random_problem(10)
    with pytest.raises(ValueError, match="score_mod_grad"):
        reference.attention_backward(do, q, k, v, score_mod=smooth_mod)
    with pytest.raises(ValueError, match="score_mod_grad was given without score_mod"):
        reference.attention_backward(do, q, k, v, score_mod_grad=smooth_mod_grad)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(window_size=(-2, 0)), ValueError, r"window_size=\(-2, 0\).*-1 \(unbounded\) or >= 0"),
        (dict(window_size=(1.5, 0)), TypeError, "window_size.*must be an int"),
        (dict(window_size=(True, 0)), TypeError, "window_size.*must be an int"),
        (dict(window_size=3), TypeError, r"window_size must be a pair \(left, right\)"),
        (dict(window_size=(1, 2, 3)), TypeError, "window_size must be a pair"),
        (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
        (dict(softcap=math.nan), ValueError, "softcap must be a finite number >= 0"),
        (dict(softcap=math.inf), ValueError, "softcap must be a finite number >= 0"),
        (dict(softcap="1"), TypeError, "softcap must be a real number"),
        (dict(alibi_slopes=np.ones(3)), ValueError, r"alibi_slopes .* \(H,\) = \(2,\) or \(B, H\) = \(1, 2\)"),
        (dict(alibi_slopes=np.ones((2, 2))), ValueError, "alibi_slopes must have shape"),
        (dict(alibi_slopes=np.ones(2, dtype=complex)), TypeError, "alibi_slopes must hold real numbers"),
        (dict(mask_mod=True), TypeError, "mask_mod must be a callable"),
        (dict(score_mod=np.ones(2)), TypeError, "score_mod must be a callable"),
        (dict(mod_args=[np.ones(2)]), TypeError, "mod_args must be a tuple of arrays, got list"),
        (dict(mod_args=(np.ones(2), 3.0)), TypeError, r"mod_args\[1\] must be an array"),
        (dict(score_mod=lambda s, b, h, i, j: None), TypeError, r"score_mod must return a real number, got NoneType"),
    ],
)
def test_argument_errors_name_the_argument(kwargs, error, match):
    do, q, k, v = random_problem(11)
    with pytest.raises(error, match=match):
        reference.attention(q, k, v, **kwargs)
    if "score_mod" not in kwargs:  # (the backward asks for score_mod_grad first)
        with pytest.raises(error, match=match):
            reference.attention_backward(do, q, k, v, **kwargs)
