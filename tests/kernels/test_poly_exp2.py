"""``kernels.poly_exp2``: 2^x by FA-4's cubic on the FMA units, and the fa3 kernel that uses it.

The host twin is the statement of the GPU's instruction sequence (the GPU test compares the two
bit for bit); here it is held to what the softmax needs of an exponential: close to 2^x where P~
lives, exactly 0 for a masked score, NaN kept, and never decreasing (the order of the scores is
the order of P~).
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SIMULATED
from helpers import examples

from numba_flash import fa3, reference
from numba_flash.kernels.poly_exp2 import MAX_RELATIVE_ERROR, host_exp2_poly

f32 = st.floats(-126.0, 8.0, width=32)


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(f32, min_size=1, max_size=50))
def test_close_to_exp2_where_p_lives(xs):
    x = np.array(xs, np.float32)
    got = host_exp2_poly(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.all(np.abs(got / want - 1) <= MAX_RELATIVE_ERROR + 2e-7)


def test_error_bound_is_reached_and_integers_are_exact():
    """The bound is the cubic's (not loose): met within 5% on a dense grid; at integers f = 0 and the
    cubic is 1 exactly, so 2^n is exact."""
    x = np.linspace(-20, 0, 400001, dtype=np.float32)
    rel = np.abs(host_exp2_poly(x).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert 0.95 * MAX_RELATIVE_ERROR < rel.max() <= MAX_RELATIVE_ERROR + 2e-7
    n = np.arange(-126, 9, dtype=np.float32)
    assert np.array_equal(host_exp2_poly(n), np.exp2(n))


def test_masked_scores_give_exact_zeros_and_nan_stays():
    x = np.array([-np.inf, -1e30, -200.0, -127.0, -127.5, np.nan], np.float32)
    got = host_exp2_poly(x)
    assert np.array_equal(got[:5], np.zeros(5, np.float32)) and not np.signbit(got[:5]).any()
    assert np.isnan(got[5])
    tiny = host_exp2_poly(np.array([-126.9, -126.5], np.float32))  # subnormal, below any 16-bit P
    assert np.all((tiny > 0) & (tiny < 2.0 ** -126))


def test_never_decreasing():
    x = np.sort(np.concatenate([np.linspace(-130, 8, 300001, dtype=np.float32),
                                np.nextafter(np.arange(-126, 9, dtype=np.float32), np.float32(-np.inf))]))
    y = host_exp2_poly(x)
    assert np.all(np.diff(y.astype(np.float64)) >= 0)


@pytest.mark.skipif(not SIMULATED, reason="the GPU runs fa3 with poly_exp2 in tests/gpu/test_gpu_fa3.py")
@pytest.mark.parametrize("dtype", ["bfloat16"])  # (float16: tests/gpu/test_gpu_fa3.py::test_fa3_poly_exp2)
def test_fa3_with_every_exponential_on_the_fma_units(dtype, rng):
    """poly_exp2=8 (all of P~ by the cubic): within FlashAttention's rule of float64, and the rows
    that see no key (causal, Nq > Nk) exactly 0 with lse -inf -- in bfloat16 too, whose P would keep
    a subnormal that a masked score's -inf turned into (its sum l would not be 0)."""
    dt = pytest.importorskip("ml_dtypes").bfloat16 if dtype == "bfloat16" else dtype
    B, H, Nq, Nk, D = 1, 1, 70, 50, 64
    q, k, v = (rng.standard_normal((B, H, n, D)).astype(dt) for n in (Nq, Nk, Nk))
    out = np.full((B, H, Nq, D), np.nan, dt)
    lse_out = np.full((B, H, Nq), np.nan, np.float32)
    o, lse = fa3.forward(q, k, v, causal=True, poly_exp2=8, out=out, lse_out=lse_out)
    ref_o, ref_lse = reference.attention(q, k, v, causal=True)
    blind = Nq - Nk  # bottom-right causal: the first rows see no key
    assert np.all(o[:, :, :blind].astype(np.float64) == 0) and np.all(np.isneginf(lse[:, :, :blind]))
    unit = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
    err = np.abs(o[:, :, blind:].astype(np.float64) - ref_o[:, :, blind:]).max()
    assert err < 4 * unit  # a 16-bit output's rounding of values of order 1, twice over
    np.testing.assert_allclose(lse[:, :, blind:], ref_lse[:, :, blind:], atol=1e-3)
    base, _ = fa3.forward(q, k, v, causal=True)
    assert not np.array_equal(o, base)  # the cubic ran: P~ differs from ex2.approx's somewhere


@pytest.mark.parametrize("bad", [9, -1, True, 2.0])
def test_fa3_refuses_a_share_that_is_not_eighths(bad):
    q = np.ones((1, 1, 4, 64), np.float16)
    with pytest.raises(ValueError, match="poly_exp2"):
        fa3.forward(q, q, q, poly_exp2=bad)
