"""The device's online softmax (``kernels.softmax``) is ``numba_flash.online``'s algebra.

The device keeps (m, l, O~) in log2 units; ``online`` states the same algebra in natural-log
units, float64; the device works in float32 (the simulator too: its 0 and weights are float32). The merge weights and the row update, run as plain Python in the simulator, must
give ``online.merge`` and ``online.update``'s states (m scaled by log2(e)), including the empty
state (m = -inf, the merge's identity) and NaN propagation.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import examples

from numba_flash import online
from numba_flash.kernels import softmax

LOG2E = 1.0 / math.log(2.0)
maxima = st.one_of(st.just(-math.inf), st.floats(-30, 30))


def device_merge(m_a, l_a, o_a, m_b, l_b, o_b):
    m = softmax.nan_max(m_a, m_b)
    w_a, w_b = softmax.merge_weights(m_a, m_b, softmax.finite_or_zero(m))
    return m, w_a * l_a + w_b * l_b, w_a * o_a + w_b * o_b


@settings(max_examples=examples(200), deadline=None)
@given(maxima, maxima, st.floats(0.5, 4), st.floats(0.5, 4), st.floats(-3, 3), st.floats(-3, 3))
def test_merge_weights_give_online_merge(m_a, m_b, l_a, l_b, o_a, o_b):
    # a state that has seen nothing has m = -inf and l = 0, O~ = 0
    l_a, o_a = (0.0, 0.0) if m_a == -math.inf else (l_a, o_a)
    l_b, o_b = (0.0, 0.0) if m_b == -math.inf else (l_b, o_b)
    a = online.SoftmaxState(np.array([m_a / LOG2E]), np.array([l_a]), np.array([[o_a]]))
    b = online.SoftmaxState(np.array([m_b / LOG2E]), np.array([l_b]), np.array([[o_b]]))
    ref = online.merge(a, b)
    m, l_sum, o = device_merge(m_a, l_a, o_a, m_b, l_b, o_b)
    assert m == ref.m[0] * LOG2E or math.isclose(m, ref.m[0] * LOG2E, rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(l_sum, ref.l[0], rel_tol=1e-6, abs_tol=1e-30)
    assert math.isclose(o, ref.acc[0, 0], rel_tol=1e-6, abs_tol=1e-6)


def test_merge_with_the_empty_state_is_the_identity():
    m, l_sum, o = device_merge(3.0, 2.0, 5.0, -math.inf, 0.0, 0.0)
    assert (m, l_sum, o) == (3.0, 2.0, 5.0)
    m, l_sum, o = device_merge(-math.inf, 0.0, 0.0, -math.inf, 0.0, 0.0)
    assert m == -math.inf and l_sum == 0.0 and o == 0.0  # never NaN
    assert softmax.log_sum_exp(m, l_sum) == -math.inf and softmax.reciprocal_or_zero(l_sum) == 0.0


def test_nan_propagates():
    assert math.isnan(softmax.nan_max(float("nan"), 1.0)) and math.isnan(softmax.nan_max(1.0, float("nan")))


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.lists(st.one_of(st.just(-math.inf), st.floats(-20, 20)), min_size=3, max_size=3), min_size=1,
                max_size=4))
def test_row_update_is_online_update(chunks):
    """Lines 9-10 over a sequence of score chunks (one row, head dim 1, v = 1): m, l and the
    rescaled O~ match ``online.update``'s after every chunk."""

    def rescale_row(acc, i, alpha):
        acc[i, 0] *= alpha

    update = softmax.row_update(1, rescale_row)
    m, l_run, acc = np.array([-math.inf]), np.array([0.0]), np.zeros((1, 1))
    tile_max, m_ref = np.zeros(1), np.zeros(1)
    ref = online.empty_state(1, 1)
    for s in chunks:
        s = np.array(s)  # log2 units on the device
        tile_max[0] = max(s) if not np.isnan(s).any() else float("nan")
        update(m, l_run, acc, tile_max, m_ref)
        p = np.exp2(s - m_ref[0])  # P~ = exp2(S - m) and its row sum, the engine's part
        l_run[0] += p.sum()
        acc[0, 0] += p.sum()
        ref = online.update(ref, (s / LOG2E)[None, :], np.ones((3, 1)))
        assert m[0] == -math.inf if ref.m[0] == -math.inf else math.isclose(m[0], ref.m[0] * LOG2E, rel_tol=1e-9, abs_tol=1e-9)
        assert math.isclose(l_run[0], ref.l[0], rel_tol=1e-6, abs_tol=1e-30)
        assert math.isclose(acc[0, 0], ref.acc[0, 0], rel_tol=1e-6, abs_tol=1e-30)
