"""Both kernels against the float64 reference, in whichever world this machine has.

In the simulator (CI) shapes and tiles are tiny and awkward on purpose: lengths that
are not tile multiples, GQA, causal with Nq != Nk, float16, one-row inputs, tiles of
one row. Outputs are poisoned with NaN before each run, so an unwritten element fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_against_reference, examples, output_rounding_bound, random_qkv, run_poisoned, to_numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_flash import reference, tiled
from numba_flash.api import attention, forward

ALGORITHMS = ["fa1", "fa2"]
TILES = st.sampled_from([1, 2, 4, 8])


@settings(max_examples=examples(12))
@given(
    algorithm=st.sampled_from(ALGORITHMS),
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 2),
    n_q=st.integers(1, 11),
    n_k=st.integers(1, 11),
    head_dim=st.integers(1, 9),
    block_m=TILES,
    block_n=TILES,
    causal=st.booleans(),
    dtype=st.sampled_from(["float32", "float16"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_reference(algorithm, batch, kv_heads, group, n_q, n_k, head_dim, block_m, block_n, causal, dtype, seed, xp):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch, kv_heads * group, kv_heads, n_q, n_k, head_dim, dtype, xp)
    o, lse = run_poisoned(xp, q, k, v, causal=causal, algorithm=algorithm, block_m=block_m, block_n=block_n)
    assert o.dtype == q.dtype and lse.dtype == np.float32
    check_against_reference(q, k, v, o, lse, causal)
    # Second oracle: the same loop nest and tiles on the online-softmax algebra (numba_flash.tiled).
    loop_nest = {"fa1": tiled.fa1_tiled, "fa2": tiled.fa2_tiled}[algorithm]
    tiled_o, tiled_lse = loop_nest(*(to_numpy(x) for x in (q, k, v)), block_m, block_n, causal)
    check_against_reference(q, k, v, o, lse, causal, oracle=(tiled_o, tiled_lse))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(
    "n_q, n_k",
    [(1, 1), (1, 9), (9, 1), (5, 13), (13, 5)],
    ids=["one-row-one-key", "one-row", "one-key", "nq<nk", "nq>nk"],
)
def test_causal_alignment_and_masked_rows(algorithm, n_q, n_k, xp, rng):
    """Bottom-right causal; rows that see no key (Nq > Nk) give o = 0, lse = -inf."""
    q, k, v = random_qkv(rng, 1, 2, 1, n_q, n_k, 3, "float32", xp)
    o, lse = run_poisoned(xp, q, k, v, causal=True, algorithm=algorithm, block_m=4, block_n=2)
    check_against_reference(q, k, v, o, lse, True)
    hidden = n_q - n_k
    if hidden > 0:
        assert (to_numpy(o)[:, :, :hidden] == 0).all()
        assert np.isneginf(to_numpy(lse)[:, :, :hidden]).all()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_huge_logits_do_not_overflow(algorithm, xp, rng):
    """Scores of magnitude ~1e4: the running max keeps every exp argument <= 0."""
    q, k, v = random_qkv(rng, 1, 1, 1, 6, 7, 4, "float32", xp)
    o, lse = run_poisoned(xp, q, k, v, scale=3e3, algorithm=algorithm, block_m=2, block_n=2)
    assert np.isfinite(to_numpy(o)).all() and np.isfinite(to_numpy(lse)).all()
    check_against_reference(q, k, v, o, lse, False, scale=3e3)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_nan_propagates_to_the_rows_it_touches(algorithm, xp, rng):
    q, k, v = (to_numpy(x).copy() for x in random_qkv(rng, 1, 1, 1, 5, 6, 3, "float32", np))
    q[0, 0, 2, 1] = np.nan  # row 2's scores are all NaN
    v[0, 0, 4, 0] = np.nan  # column 0 of every output row depends on v[4, 0]
    q, k, v = (xp.asarray(x) for x in (q, k, v))
    o = to_numpy(run_poisoned(xp, q, k, v, algorithm=algorithm, block_m=2, block_n=4)[0])
    assert np.isnan(o[0, 0, 2]).all(), "a NaN query row must give a NaN output row"
    assert np.isnan(o[0, 0, :, 0]).all(), "a NaN value must reach every row that attends to it"
    rows = [0, 1, 3, 4]
    assert np.isfinite(o[0, 0, rows, 1:]).all(), "NaN leaked into elements it does not touch"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_empty_lengths(algorithm, xp, rng):
    q, k, v = random_qkv(rng, 1, 2, 2, 0, 5, 4, "float32", xp)
    o, lse = attention(q, k, v, algorithm=algorithm, return_lse=True)
    assert o.shape == (1, 2, 0, 4) and lse.shape == (1, 2, 0)
    q, k, v = random_qkv(rng, 1, 2, 2, 3, 0, 4, "float32", xp)
    o, lse = attention(q, k, v, algorithm=algorithm, return_lse=True)
    assert (to_numpy(o) == 0).all() and np.isneginf(to_numpy(lse)).all()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_strided_views_need_no_copy_and_inputs_are_untouched(algorithm, xp, rng):
    """A (B, N, H, D) buffer viewed as (B, H, N, D) works as is; inputs stay unchanged."""
    buf = [xp.asarray(rng.standard_normal((1, 7, 2, 5)).astype(np.float32)) for _ in range(3)]
    before = [to_numpy(b).copy() for b in buf]
    q, k, v = (b.transpose(0, 2, 1, 3) for b in buf)
    assert not q.flags.c_contiguous
    o, lse = run_poisoned(xp, q, k, v, causal=True, algorithm=algorithm, block_m=4, block_n=4)
    check_against_reference(q, k, v, o, lse, True)
    for b, b0 in zip(buf, before):
        assert np.array_equal(to_numpy(b), b0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_read_only_inputs(algorithm, rng):
    """NumPy inputs are copied to the device, never handed to the kernel: read-only works."""
    q, k, v = random_qkv(rng, 1, 2, 1, 5, 6, 3, "float32")
    for x in (q, k, v):
        x.setflags(write=False)
    o, lse = run_poisoned(np, q, k, v, causal=True, algorithm=algorithm, block_m=4, block_n=4)
    check_against_reference(q, k, v, o, lse, True)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("shape", [(0, 2, 5, 4), (2, 0, 5, 4)], ids=["B=0", "H=0"])
def test_empty_batch_or_heads(algorithm, shape, xp, rng):
    q = xp.asarray(rng.standard_normal(shape).astype(np.float32))
    kv = xp.asarray(rng.standard_normal((shape[0], 1 if shape[1] else 0, 6, 4)).astype(np.float32))
    if shape[1] == 0:
        with pytest.raises(ValueError, match="at least one head"):
            attention(q, kv, kv, algorithm=algorithm)
        return
    o, lse = attention(q, kv, kv, algorithm=algorithm, return_lse=True)
    assert o.shape == shape and lse.shape == shape[:3]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_no_keys_causal_float16(algorithm, xp, rng):
    q, k, v = random_qkv(rng, 1, 2, 1, 3, 0, 4, "float16", xp)
    o, lse = attention(q, k, v, causal=True, algorithm=algorithm, return_lse=True)
    assert o.dtype == np.float16 and (to_numpy(o) == 0).all() and np.isneginf(to_numpy(lse)).all()


def test_fa1_and_fa2_agree_with_default_tiles(xp, rng):
    """Default tiles (64 x 32 up to D = 64, 32 x 16 above): each checked against the reference."""
    q, k, v = random_qkv(rng, 1, 1, 1, 3, 5, 8, "float32", xp)
    for algorithm in ALGORITHMS:
        o, lse = run_poisoned(xp, q, k, v, algorithm=algorithm)
        check_against_reference(q, k, v, o, lse, False)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_causal_mask_hides_nan_values_of_future_keys(algorithm, xp, rng):
    """A masked key contributes nothing, not even 0 * NaN: rows before key 2 stay finite."""
    q, k, v = (to_numpy(x).copy() for x in random_qkv(rng, 1, 1, 1, 4, 4, 8, "float32", np))
    v[0, 0, 2, 1] = np.nan
    q, k, v = (xp.asarray(x) for x in (q, k, v))
    o, lse = run_poisoned(xp, q, k, v, causal=True, algorithm=algorithm, block_m=4, block_n=4)
    o = to_numpy(o)
    ref_o, _ = reference.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True)
    assert np.isfinite(o[0, 0, :2]).all(), "NaN of a future key leaked through the causal mask"
    assert np.isnan(o[0, 0, 2:, 1]).all() and np.isfinite(o[0, 0, 2:, [0, 2, 3, 4, 5, 6, 7]]).all()
    # Rows 0-1 see keys 0-1 only (the same causal mask on the first two rows and keys): within
    # the float32 score-rounding bound of the reference.
    allowed = output_rounding_bound(q[:, :, :2], k[:, :, :2], v[:, :, :2], ref_o[:, :, :2], None, True)
    assert (np.abs(o[0, 0, :2] - ref_o[0, 0, :2]) <= allowed[0, 0] + 2e-6 * np.abs(ref_o[0, 0, :2]).max()).all()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("precision, dtype", [("ieee", "float32"), (None, "float16")], ids=["cuda-cores", "tensor-cores"])
def test_no_warning_reaches_the_caller(algorithm, precision, dtype, xp, rng):
    """inf in the inputs (an inf key score, a row of -inf queries) makes the simulated kernels
    compute inf - inf on purpose; no RuntimeWarning quoting kernel source may reach the user."""
    import warnings

    q, k, v = (to_numpy(x).copy() for x in random_qkv(rng, 1, 1, 1, 4, 8, 8, dtype, np))
    k[0, 0, 1, 0] = np.inf
    q[0, 0, 2, :] = -np.inf
    q, k, v = (xp.asarray(x) for x in (q, k, v))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forward(q, k, v, algorithm=algorithm, precision=precision, block_m=16 if precision is None else 4,
                block_n=16 if precision is None else 4)
    assert not caught, [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
