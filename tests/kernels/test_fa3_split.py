"""Split-KV on algorithm="fa3" (API.md 2b; issue 23: "fits the split-KV path"): each block walks one
contiguous range of its Q tile's K/V tiles (or of its block-mask list) and writes a float32 partial
(O over its keys, their logsumexp), and ``kernels.combine`` merges them -- the online softmax's
merge across blocks. Checked in the simulator against the float64 reference and against the
unsplit kernel, with splits that get no tile (their partial is the merge's identity), rows that
see no key, bfloat16, and a block-sparse walk cut into splits. (A packed batch runs unsplit:
``attention_varlen`` takes no ``num_splits``.)
"""

import numpy as np
import pytest

from conftest import SIMULATED
from helpers import plain_fp16_attention

from numba_flash import fa3, reference

pytestmark = pytest.mark.skipif(not SIMULATED, reason="the GPU runs these in tests/gpu/test_gpu_fa3.py")


def _inputs(rng, B, H, Hkv, Nq, Nk, D, dtype=np.float16):
    return (rng.standard_normal((B, h, n, D)).astype(dtype) for h, n in ((H, Nq), (Hkv, Nk), (Hkv, Nk)))


CASES = [  # B, H, Hkv, Nq, Nk, D, causal, window, splits (block_n 32)
    (1, 1, 1, 40, 150, 64, False, (-1, -1), 3),  # 5 K/V tiles in ranges of 2, 2, 1 (GQA split: the
    # bfloat16 block-sparse test's two query heads on one K/V head)
    (1, 1, 1, 60, 40, 64, True, (-1, -1), 2),  # Nq > Nk: the first 20 rows see no key, and rows 20-51
    # none of the second split's tile
    (1, 1, 1, 30, 200, 128, False, (40, 10), 5),  # a window: 2-3 tiles a Q tile, so most splits are empty
]


@pytest.mark.parametrize("B, H, Hkv, Nq, Nk, D, causal, window, splits", CASES, ids=lambda x: str(x))
def test_split_matches_the_reference_and_the_unsplit_kernel(B, H, Hkv, Nq, Nk, D, causal, window, splits, rng):
    q, k, v = _inputs(rng, B, H, Hkv, Nq, Nk, D)
    out = np.full((B, H, Nq, D), np.nan, np.float16)
    lse_out = np.full((B, H, Nq), np.nan, np.float32)
    o, lse = fa3.forward(q, k, v, causal=causal, window_size=window, block_n=32, num_splits=splits, out=out,
                         lse_out=lse_out)
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, window_size=window)
    plain = plain_fp16_attention(q, k, v, causal=window if window != (-1, -1) else causal).astype(np.float64)
    err = np.abs(o.astype(np.float64) - ref_o).max()
    assert err <= 2 * np.abs(plain - ref_o).max() + 1e-6  # FlashAttention's rule
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))  # rows that see no key: -inf, and O = 0 there
    assert np.all(o[np.isinf(ref_lse)] == 0)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4)
    whole, whole_lse = fa3.forward(q, k, v, causal=causal, window_size=window, block_n=32, num_splits=1)
    assert np.abs(o.astype(np.float64) - whole.astype(np.float64)).max() <= 2.0 ** -9  # a rounding apart
    np.testing.assert_allclose(lse[finite], whole_lse[finite], atol=1e-5)


def test_split_bfloat16_and_a_block_sparse_walk(rng):
    """bfloat16 out (the combine writes its bit patterns), and a ``mask_mod``'s block mask whose list
    is cut into splits: NaN in the keys of the tile no query sees stays out."""
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    q, k, v = _inputs(rng, 1, 2, 1, 64, 150, 64, bf16)
    kv_doc = np.searchsorted([40, 100], np.arange(150), side="right").astype(np.int32)
    q_doc = kv_doc[150 - 64:].copy()

    def same_document(b, h, q_idx, kv_idx, q_doc, kv_doc):
        return q_doc[q_idx] == kv_doc[kv_idx]

    k[:, :, :32] = np.nan  # keys 0-31: the first document's, hidden from every query (tile 0 unlisted)
    v[:, :, :32] = np.nan
    o, lse = fa3.forward(q, k, v, mask_mod=same_document, mod_args=(q_doc, kv_doc), block_n=32, num_splits=2)
    kc, vc = k.copy(), v.copy()
    kc[:, :, :32] = 0
    vc[:, :, :32] = 0
    ref_o, ref_lse = reference.attention(q, kc, vc, mask_mod=same_document, mod_args=(q_doc, kv_doc))
    assert o.dtype == bf16 and not np.isnan(o.astype(np.float32)).any()
    assert np.abs(o.astype(np.float64) - ref_o).max() < 2 * 2.0 ** -8
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)


def test_split_refuses_bad_counts(rng):
    q, k, v = _inputs(rng, 1, 1, 1, 8, 8, 16)
    with pytest.raises(ValueError, match="num_splits"):
        fa3.forward(q, k, v, num_splits=129)
    with pytest.raises(TypeError, match="num_splits"):
        fa3.forward(q, k, v, num_splits=2.0)
