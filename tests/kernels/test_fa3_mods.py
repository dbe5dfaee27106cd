"""Score modifications on algorithm="fa3" (API.md 2c, issue 24 on the Hopper kernel): softcap, ALiBi,
a user's ``mask_mod`` / ``score_mod`` and the block-sparse walk of a ``mask_mod``'s block mask.

The kernel applies them through ``kernels.score_mods`` exactly as the other engines do (scale,
cap, bias, user mods, then the built-in mask), on its own register layout (wgmma's accumulator);
the producer warpgroup loads the tiles a block mask lists and no other. Checked in the simulator
against the float64 reference, each case where the modification changes the result enough for
the check to fail without it; NaN in the keys of hidden tiles shows a walk that loads them.
"""

import numpy as np
import pytest

from conftest import SIMULATED

import numba_flash
from numba_flash import reference
from numba_flash.api import forward
from numba_flash.tile_visibility import HIDDEN, PARTIAL

pytestmark = pytest.mark.skipif(not SIMULATED, reason="the GPU runs these in tests/gpu/test_gpu_fa3.py")

TOL = 2e-3  # float16 output, scores of a few units (as tests/host/test_softcap.py's tensor-core cases)


def _inputs(rng, B, H, Hkv, Nq, Nk, D, scale=1.0):
    q = (scale * rng.standard_normal((B, H, Nq, D))).astype(np.float16)
    k = rng.standard_normal((B, Hkv, Nk, D)).astype(np.float16)
    v = rng.standard_normal((B, Hkv, Nk, D)).astype(np.float16)
    return q, k, v


def _poisoned_fa3(q, k, v, **kw):
    B, H, Nq, D = q.shape
    out = np.full((B, H, Nq, D), np.nan, np.float16)
    lse_out = np.full((B, H, Nq), np.nan, np.float32)
    return forward(q, k, v, algorithm="fa3", out=out, lse_out=lse_out, **kw)


def _check(o, lse, ref_o, ref_lse, plain_o):
    assert np.abs(plain_o - ref_o).max() > 50 * TOL  # the modification changes the result: the check can fail
    assert np.abs(o.astype(np.float64) - ref_o).max() < TOL * max(1.0, np.abs(ref_o).max())
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse))
    assert np.abs(lse[finite] - ref_lse[finite]).max() < 10 * TOL


MODS = [  # (causal, window, softcap, alibi, Nq, Nk): block_n 32, tails of Q and K/V tiles (one batch each
    # but the causal case's two: per-batch slopes there; the others' per-head slopes are one's)
    (False, (-1, -1), 0.8, False, 40, 50),  # the cap alone: it bends every score
    (True, (-1, -1), 0.0, True, 70, 50),  # ALiBi under a right edge at the diagonal (the bias over the scale)
    (False, (20, 10), 3.0, True, 40, 70),  # both, under a window
    (False, (-1, -1), 0.0, True, 40, 70),  # ALiBi alone, no right edge: tiles left of, across and right of rows'
    # diagonals (the one-sided bias less a row shift, the whole bias across)
    (False, (-1, -1), 0.0, True, 70, 40),  # Nq > Nk: early rows' diagonals left of every key (all right)
    (False, (20, 10), 0.0, True, 40, 70),  # ALiBi alone under a right edge past the diagonal: one-sided and across
    (False, (-1, 5), 0.0, True, 70, 40),  # ... and with no left edge, Nq > Nk
]


@pytest.mark.parametrize("causal, window, softcap, alibi, n_q, n_k", MODS, ids=lambda x: str(x))
def test_softcap_and_alibi_match_the_reference(causal, window, softcap, alibi, n_q, n_k, rng):
    batch = 2 if causal else 1
    q, k, v = _inputs(rng, batch, 1, 1, n_q, n_k, 64, scale=2.0)  # scores of a few units: the cap bends them
    slopes = np.array([[0.3], [0.9]][2 - batch:], np.float32) if alibi else None  # per batch and head
    mods = dict(causal=causal, window_size=window, softcap=softcap)
    o, lse = _poisoned_fa3(q, k, v, alibi_slopes=slopes, block_n=32, **mods)
    ref_o, ref_lse = reference.attention(q, k, v, alibi_slopes=slopes, **mods)
    plain_o, _ = reference.attention(q, k, v, causal=causal, window_size=window)
    _check(o, lse, ref_o, ref_lse, plain_o)


N_Q, N_K = 64, 150


def same_document(b, h, q_idx, kv_idx, q_doc, kv_doc):
    return q_doc[q_idx] == kv_doc[kv_idx]


def relative_bias(score, b, h, q_idx, kv_idx, table):
    """A learned relative-position bias: one value per (head, distance), a table in mod_args."""
    return score + table[h, q_idx - kv_idx + N_K]


def _documents():
    """Three documents over the keys (bounds at 40 and 100: inside 32-key tiles); the queries are
    the last keys' (bottom-right), so no query sees the first document: its tile is hidden."""
    kv_doc = np.searchsorted([40, 100], np.arange(N_K), side="right").astype(np.int32)
    return kv_doc[N_K - N_Q:].copy(), kv_doc


def test_a_mask_mod_walks_its_block_mask(rng):
    """Documents by ``mask_mod``, its block mask derived at the kernel's tiles: NaN in the keys and
    values of the tiles no query sees (a walk that loaded them would spread it), ``mask_mod``
    called on the entries of partial tiles only (the simulator runs it as Python), GQA."""
    q, k, v = _inputs(rng, 1, 2, 1, N_Q, N_K, 64)
    q_doc, kv_doc = _documents()
    ref_o, ref_lse = reference.attention(q, k, v, mask_mod=same_document, mod_args=(q_doc, kv_doc))
    plain_o, _ = reference.attention(q, k, v)
    bm = numba_flash.block_mask(same_document, None, None, N_Q, N_K, block_m=64, block_n=32, mod_args=(q_doc, kv_doc))
    hidden = np.zeros(N_K, bool)
    for j in range(bm.kinds.shape[3]):
        if np.all(bm.kinds[0, 0, :, j] == HIDDEN):
            hidden[32 * j : 32 * (j + 1)] = True
    assert hidden.sum() >= 32  # a whole K/V tile no query sees: the NaN check can fail
    k[:, :, hidden] = np.nan
    v[:, :, hidden] = np.nan
    partial = sum((min(N_Q, 64 * (i + 1)) - 64 * i) * (min(N_K, 32 * (j + 1)) - 32 * j)
                  for i, j in zip(*np.nonzero(bm.kinds[0, 0] == PARTIAL)))
    calls = []

    def counted(b, h, q_idx, kv_idx, q_doc, kv_doc):
        calls.append(1)
        return q_doc[q_idx] == kv_doc[kv_idx]

    o, lse = _poisoned_fa3(q, k, v, mask_mod=counted, mod_args=(q_doc, kv_doc), block_n=32)
    _check(o, lse, ref_o, ref_lse, plain_o)
    calls.clear()  # (the block mask's derivation called it too)
    given = numba_flash.block_mask(counted, None, None, N_Q, N_K, block_m=64, block_n=32, mod_args=(q_doc, kv_doc))
    calls.clear()
    o2, _ = _poisoned_fa3(q, k, v, mask_mod=counted, mod_args=(q_doc, kv_doc), block_mask=given, block_n=32)
    assert 0 < partial < N_Q * N_K and len(calls) == 2 * partial  # two query heads
    assert np.array_equal(o, o2)


def test_a_score_mod_with_a_causal_mask(rng):
    """A ``score_mod`` alone (no block mask: every tile walked) with a bias table through
    ``mod_args``, under ``causal``, GQA."""
    q, k, v = _inputs(rng, 1, 2, 1, N_Q, N_K, 64)
    table = (0.5 * rng.standard_normal((2, N_Q + N_K + 1))).astype(np.float32)
    o, lse = _poisoned_fa3(q, k, v, causal=True, score_mod=relative_bias, mod_args=(table,), block_n=32)
    ref_o, ref_lse = reference.attention(q, k, v, causal=True, score_mod=relative_bias, mod_args=(table,))
    plain_o, _ = reference.attention(q, k, v, causal=True)
    _check(o, lse, ref_o, ref_lse, plain_o)


def test_fp8_takes_the_soft_cap(rng):
    """float8 inputs with a cap: the descales join the scale before the cap (the cap acts on the
    real scores); compared with the float64 reference on the dequantized values."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = (rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn)
               for shape in ((1, 1, 40, 128), (1, 1, 130, 128), (1, 1, 130, 128)))
    qs, ks, vs = 1.5, 0.5, 2.0
    o = numba_flash.attention(q, k, v, algorithm="fa3", softcap=0.5, causal=True, q_descale=qs, k_descale=ks,
                              v_descale=vs)
    real = [x.astype(np.float64) * s for x, s in ((q, qs), (k, ks), (v, vs))]
    ref_o, _ = reference.attention(*real, softcap=0.5, causal=True)
    uncapped, _ = reference.attention(*real, causal=True)
    err = np.abs(o.astype(np.float64) - ref_o).max()
    assert err < 0.05 * np.abs(ref_o).max()  # (e4m3 P and V: a few percent)
    assert np.abs(uncapped - ref_o).max() > 4 * err  # the cap changes the result beyond that


def test_fp8_takes_alibi(rng):
    """float8 inputs with ALiBi (the bias over the scale, its row shifts beside fp8's exponent
    offset): block_n 32 over 100 keys puts tiles left of, across and right of the rows' diagonals;
    compared with the float64 reference on the dequantized values."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = (rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn)
               for shape in ((1, 1, 40, 128), (1, 1, 100, 128), (1, 1, 100, 128)))
    qs, ks, vs = 1.5, 0.5, 2.0
    slopes = np.array([0.3], np.float32)
    o = numba_flash.attention(q, k, v, algorithm="fa3", alibi_slopes=slopes, block_n=32, q_descale=qs, k_descale=ks,
                              v_descale=vs)
    real = [x.astype(np.float64) * s for x, s in ((q, qs), (k, ks), (v, vs))]
    ref_o, _ = reference.attention(*real, alibi_slopes=slopes)
    plain, _ = reference.attention(*real)
    err = np.abs(o.astype(np.float64) - ref_o).max()
    assert err < 0.05 * np.abs(ref_o).max()  # (e4m3 P and V: a few percent)
    assert np.abs(plain - ref_o).max() > 4 * err  # the bias changes the result beyond that


# ------------------------------------------------------------------------------ packed batches


def test_a_packed_batch_matches_the_reference(rng):
    """``attention_varlen(algorithm="fa3")`` (API.md 2d): sequences of lengths 0, 1 and tails,
    one with queries and no keys, GQA, causal and ALiBi per sequence. NaN in the values of the
    sequence after a partial K/V tile: each sequence's tensor map ends at its rows (the simulator's
    loads read the sequence's slice), so nothing of the next sequence reaches P V."""
    lens_q, lens_k = [70, 0, 1, 33], [40, 3, 0, 90]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 2, 64)).astype(np.float16)
    k, v = (rng.standard_normal((cu_k[-1], 1, 64)).astype(np.float16) for _ in range(2))
    slopes = rng.uniform(0.1, 1.0, (4, 2)).astype(np.float32)
    ref_o, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, 70, 90, causal=True, alibi_slopes=slopes)
    v = v.copy()
    v[cu_k[1] : cu_k[2]] = np.nan  # sequence 1's values: right after sequence 0's partial last tile
    o, lse = numba_flash.attention_varlen(q, k, v, cu_q, cu_k, 70, 90, causal=True, alibi_slopes=slopes,
                                          algorithm="fa3", return_lse=True)
    assert o.shape == q.shape and lse.shape == (2, cu_q[-1])
    assert np.abs(o.astype(np.float64) - ref_o).max() < TOL
    finite = np.isfinite(ref_lse)
    assert np.array_equal(finite, np.isfinite(lse)) and np.abs(lse[finite] - ref_lse[finite]).max() < 1e-3
