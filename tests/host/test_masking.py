"""``numba_flash.masking``: the window form of the mask against its brute-force definition
(API.md section 2c), and the masks the public functions use (``causal`` only today)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import examples

from numba_flash.masking import CAUSAL, FULL, MaskSpec, mask_spec


def brute_force(left, right, n_q, n_k):
    """Query i sees key j iff i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right; -1: unbounded."""
    seen = np.zeros((n_q, n_k), bool)
    for i in range(n_q):
        for j in range(n_k):
            d = i + (n_k - n_q)
            seen[i, j] = (left == -1 or d - left <= j) and (right == -1 or j <= d + right)
    return seen


windows = st.tuples(st.integers(-1, 12), st.integers(-1, 12))


@settings(max_examples=examples(300), deadline=None)
@given(n_q=st.integers(0, 20), n_k=st.integers(0, 20), window=windows)
def test_visible_is_the_definition(n_q, n_k, window):
    """The matrix, the scalar predicate, the row and column bounds, counts and tile spans all
    agree with the brute-force definition (Nq > Nk, Nq < Nk, empty sides included)."""
    mask = MaskSpec(*window)
    want = brute_force(*window, n_q, n_k)
    np.testing.assert_array_equal(mask.matrix(n_q, n_k), want)
    assert mask.matrix(n_q, n_k).shape == (n_q, n_k)
    for i in range(n_q):
        for j in range(n_k):
            assert mask.visible(i, j, n_q, n_k) == want[i, j]
    for i in range(n_q):
        keys = np.flatnonzero(want[i])
        assert mask.first_visible_key(i, n_q, n_k) == (keys[0] if keys.size else n_k)
        assert mask.last_visible_key(i, n_q, n_k) == (keys[-1] if keys.size else -1)
    for j in range(n_k):
        queries = np.flatnonzero(want[:, j])
        assert mask.first_visible_query(j, n_q, n_k) == (queries[0] if queries.size else n_q)
        assert mask.last_visible_query(j, n_q, n_k) == (queries[-1] if queries.size else -1)
    np.testing.assert_array_equal(mask.visible_keys(n_q, n_k), want.sum(axis=1))
    assert mask.visible_pairs(n_q, n_k) == want.sum()
    for start in range(n_q):
        for stop in range(start + 1, n_q + 1):
            keys = np.flatnonzero(want[start:stop].any(axis=0))
            span = (keys[0], keys[-1]) if keys.size else (n_k, -1)
            assert mask.key_span(start, stop, n_q, n_k) == span
            if keys.size:  # the keys a block of rows sees form one range
                assert keys[-1] - keys[0] + 1 == keys.size


def test_causal_is_left_unbounded_right_zero():
    assert mask_spec(True) == CAUSAL == MaskSpec(-1, 0) and CAUSAL.is_causal and not CAUSAL.is_full
    assert mask_spec(False) == FULL == MaskSpec() and FULL.is_full and not FULL.is_causal
    # The docstring pictures of attention(): Nq = 2, Nk = 5 and Nq = 5, Nk = 2.
    np.testing.assert_array_equal(CAUSAL.matrix(2, 5), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(CAUSAL.matrix(5, 2), [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]])
    np.testing.assert_array_equal(CAUSAL.matrix(4, 4), np.tril(np.ones((4, 4), bool)))


def test_unbounded_window_sees_everything():
    assert FULL.matrix(3, 7).all() and FULL.matrix(7, 3).all()
    assert FULL.visible_pairs(7, 3) == 21
    assert FULL.first_visible_key(0, 7, 3) == 0 and FULL.last_visible_key(6, 7, 3) == 2


def test_left_and_right_bounds():
    # Nq = Nk = 6: a band of keys i - 2 .. i + 1.
    band = MaskSpec(2, 1).matrix(6, 6)
    i, j = np.indices((6, 6))
    np.testing.assert_array_equal(band, (i - 2 <= j) & (j <= i + 1))
    # Bottom-right aligned: Nq = 2, Nk = 6, left = 1, right = 0: row 0's diagonal is key 4.
    np.testing.assert_array_equal(MaskSpec(1, 0).matrix(2, 6), [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]])
    # (0, 0): each query sees its diagonal key only.
    np.testing.assert_array_equal(MaskSpec(0, 0).matrix(3, 3), np.eye(3, dtype=bool))
    # A right bound without a left one: keys up to i + 2.
    np.testing.assert_array_equal(MaskSpec(-1, 2).matrix(2, 4), [[1, 1, 1, 1], [1, 1, 1, 1]])
    np.testing.assert_array_equal(MaskSpec(-1, 2).matrix(4, 4)[0], [1, 1, 1, 0])


def test_causal_and_window_intersect():
    assert MaskSpec.of(True, (3, -1)) == MaskSpec(3, 0)
    assert MaskSpec.of(True, (3, 5)) == MaskSpec(3, 0)
    assert MaskSpec.of(False, (3, 5)) == MaskSpec(3, 5)


@pytest.mark.parametrize("bad, error", [((-2, 0), ValueError), ((0, -5), ValueError), ((1.5, 0), TypeError),
                                        ((True, 0), TypeError)])
def test_bad_windows_raise(bad, error):
    with pytest.raises(error, match="window"):
        MaskSpec(*bad)


def test_visible_broadcasts_in_the_indices_library():
    rows = np.array([0, 3])
    got = CAUSAL.visible(rows[:, None], np.arange(4)[None, :], 4, 4)
    np.testing.assert_array_equal(got, [[1, 0, 0, 0], [1, 1, 1, 1]])
    assert FULL.visible(rows[:, None], np.arange(4)[None, :], 4, 4).shape == (2, 4)
    assert not CAUSAL.visible(2, 3, 4, 4) and CAUSAL.visible(3, 3, 4, 4)
