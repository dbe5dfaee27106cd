"""A user's ``mask_mod`` and ``score_mod`` (FlexAttention's hooks, API.md section 2c) compiled into
the kernels.

Plain Python functions (and numba device functions) with arrays passed by ``mod_args``, in the
forward of both loop orders and both regimes, split-KV, and every backward walk (``score_mod``
with its ``score_mod_grad``), against the float64 reference calling the same functions on NumPy
arrays; each where the mod changes the result enough for the check to fail without it.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import backward_problem, examples, gradient_error, random_qkv, run_poisoned, to_numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numba_flash
from numba_flash import reference
from numba_flash._cuda import cuda
from numba_flash.backward import gradients

N_Q, N_K = 21, 27


def same_document(b, h, q_idx, kv_idx, q_doc, kv_doc):
    """Document masking: a query sees the keys of its own document (ids through mod_args)."""
    return q_doc[q_idx] == kv_doc[kv_idx]


def relative_bias(score, b, h, q_idx, kv_idx, table):
    """A learned relative-position bias: one value per (head, distance), a table in mod_args."""
    return score + table[h, q_idx - kv_idx + N_K]


def documents_mask(b, h, q_idx, kv_idx, q_doc, kv_doc, table):
    """``same_document`` among three mod_args (the documents' ids, then a bias table)."""
    return q_doc[q_idx] == kv_doc[kv_idx]


# (A mod may call only numba device functions: on a GPU numba cannot compile a call to a plain
# Python function, where the simulator runs it. These spell the expressions out.)
def documents_bias(score, b, h, q_idx, kv_idx, q_doc, kv_doc, table):
    return score + table[h, q_idx - kv_idx + N_K]


def documents_cubic(score, b, h, q_idx, kv_idx, q_doc, kv_doc, table):
    return 0.1 * score * score * score + score + table[h, q_idx - kv_idx + N_K]


def documents_cubic_grad(score, b, h, q_idx, kv_idx, q_doc, kv_doc, table):
    return 0.3 * score * score + 1.0


def _documents(rng, n_q=N_Q, n_k=N_K):
    kv_doc = np.sort(rng.integers(0, 3, n_k)).astype(np.int32)
    return kv_doc[n_k - n_q:].copy(), kv_doc  # queries aligned to the last keys (bottom-right)


def _table(rng, heads=2):
    return (0.5 * rng.standard_normal((heads, N_Q + N_K + 1))).astype(np.float32)


FORWARD = [("ieee", "float32", 1e-5), (None, "float16", 2e-3)]


@pytest.mark.parametrize("algorithm", ["fa1", "fa2"])
@pytest.mark.parametrize("precision, dtype, tol", FORWARD)
def test_forward_document_mask_and_bias_table(algorithm, precision, dtype, tol, xp, rng):
    """Both mods at once, with softcap and ALiBi and causal: API.md 2c's order on every score."""
    q, k, v = random_qkv(rng, 1, 2, 1, N_Q, N_K, 16, dtype, xp, scale=1.5)
    q_doc, kv_doc = _documents(rng)
    table = _table(rng)
    both, bias = documents_mask, documents_bias
    mods = dict(causal=True, softcap=3.0, alibi_slopes=np.array([0.2, 0.05], np.float32))
    args = (q_doc, kv_doc, table)
    tiles = {"block_m": 16, "block_n": 16} if precision != "ieee" else {"block_m": 4, "block_n": 8}
    o, lse = run_poisoned(xp, q, k, v, mask_mod=both, score_mod=bias, mod_args=tuple(xp.asarray(a) for a in args),
                          algorithm=algorithm, precision=precision,
                          **{**mods, "alibi_slopes": xp.asarray(mods["alibi_slopes"])}, **tiles)
    host = [to_numpy(x) for x in (q, k, v)]
    ref_o, ref_lse = reference.attention(*host, mask_mod=both, score_mod=bias, mod_args=args, **mods)
    for plain in (reference.attention(*host, score_mod=bias, mod_args=args, **mods)[0],
                  reference.attention(*host, mask_mod=both, mod_args=args, **mods)[0]):
        assert np.abs(plain - ref_o).max() > 50 * tol  # each mod changes the result: the check can fail
    assert np.abs(to_numpy(o).astype(np.float64) - ref_o).max() < tol * max(1.0, np.abs(ref_o).max())  # (relative to o)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(to_numpy(lse)), finite)
    assert np.abs(to_numpy(lse)[finite] - ref_lse[finite]).max() < 10 * tol


def test_device_functions_closures_and_split_kv(xp, rng):
    """A numba device function as ``mask_mod`` and a closure over a constant (prefix-LM: the
    first 8 keys seen by every query, causal after), on split-KV (two splits); a row the mask
    leaves without keys gives o = 0, lse = -inf."""
    q, k, v = random_qkv(rng, 1, 2, 2, 9, 24, 16, "float16", xp)
    prefix = 8

    @cuda.jit(device=True)
    def prefix_lm(b, h, q_idx, kv_idx):
        return kv_idx < prefix or kv_idx <= q_idx + 15

    def blind_row(b, h, q_idx, kv_idx):
        return q_idx != 4 and prefix_lm(b, h, q_idx, kv_idx)

    def host_prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (kv_idx <= q_idx + 15)

    def host_blind(b, h, q_idx, kv_idx):
        return (q_idx != 4) & host_prefix_lm(b, h, q_idx, kv_idx)

    host = [to_numpy(x) for x in (q, k, v)]
    for device_fn, host_fn in ((prefix_lm, host_prefix_lm), (blind_row, host_blind)):
        o, lse = run_poisoned(xp, q, k, v, mask_mod=device_fn, num_splits=2, precision=None)
        ref_o, ref_lse = reference.attention(*host, mask_mod=host_fn)
        assert np.abs(to_numpy(o).astype(np.float64) - ref_o).max() < 2e-3
    assert np.all(to_numpy(o)[:, :, 4] == 0) and np.all(np.isneginf(to_numpy(lse)[:, :, 4]))


@pytest.mark.parametrize("precision, dtype, algorithm, deterministic", [  # each engine's dK/dV and dQ walks
    ("ieee", "float32", "fa2", True), ("ieee", "float32", "fa1", False),
    (None, "float16", "fa2", False), (None, "float16", "fa2", True),
])
def test_backward_matches_the_reference(precision, dtype, algorithm, deterministic, rng):
    do, q, k, v, _, _ = backward_problem(rng, 1, 2, 1, N_Q, N_K, 16, dtype, False)
    q_doc, kv_doc = _documents(rng)
    table = _table(rng)
    grad = documents_cubic_grad
    mods = dict(mask_mod=documents_mask, score_mod=documents_cubic, mod_args=(q_doc, kv_doc, table))
    o, lse = numba_flash.attention(q, k, v, return_lse=True, precision="ieee", **mods)
    tiles = {"tiles": (16, 16)} if precision is None else {}
    grads = gradients(do, q, k, v, o, lse, algorithm=algorithm, deterministic=deterministic, precision=precision,
                      score_mod_grad=grad, **mods, **tiles)
    host = [x.astype(np.float64) for x in (do, q, k, v)]
    refs = reference.attention_backward(*host, score_mod_grad=grad, **mods)
    unit = reference.attention_backward(*host, score_mod_grad=lambda s, *a: np.ones_like(s), **mods)
    bound = 1e-4 if dtype == "float32" else 5e-3
    for name, got, ref, wrong in zip(("dq", "dk"), grads, refs, unit):
        assert gradient_error(wrong, ref, refs) > 20 * bound, name  # the gradient of score_mod matters here
        assert gradient_error(got, ref, refs) < bound, name
    assert gradient_error(grads[2], refs[2], refs) < bound, "dv"


@settings(max_examples=examples(3), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), density=st.floats(0.1, 0.9))
def test_any_visibility_table_is_the_reference_s(seed, density):
    """Hypothesis: a random (query, key) visibility table given as a mask_mod over mod_args gives
    the reference's result (CUDA cores, FA-2; rows the table leaves empty: o = 0, lse = -inf)."""
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 1, 1, 7, 13, 8, "float32")
    seen = rng.random((7, 13)) < density

    def table_mask(b, h, q_idx, kv_idx, seen):
        return seen[q_idx, kv_idx]

    o, lse = run_poisoned(np, q, k, v, mask_mod=table_mask, mod_args=(seen,), block_m=4, block_n=8)
    ref_o, ref_lse = reference.attention(q, k, v, mask_mod=table_mask, mod_args=(seen,))
    assert np.abs(o - ref_o).max() < 1e-5
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))


def test_mod_errors_name_the_argument(rng):
    q, k, v = random_qkv(rng, 1, 2, 1, 4, 4, 8, "float32")
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        numba_flash.attention(q, k, v, mask_mod=3)
    with pytest.raises(ValueError, match="mod_args are the arguments of mask_mod and score_mod"):
        numba_flash.attention(q, k, v, mod_args=(np.zeros(4),))
    with pytest.raises(TypeError, match="mod_args must be a tuple"):
        numba_flash.attention(q, k, v, mask_mod=same_document, mod_args=np.zeros(4))
    with pytest.raises(ValueError, match="at most 4"):
        numba_flash.attention(q, k, v, mask_mod=same_document, mod_args=(np.zeros(4),) * 5)
    with pytest.raises(TypeError, match=r"mod_args\[0\]"):
        numba_flash.attention(q, k, v, mask_mod=same_document, mod_args=([0, 1],))
    o, lse = numba_flash.attention(q, k, v, score_mod=relative_bias, mod_args=(_table(rng),), return_lse=True)
    with pytest.raises(ValueError, match="score_mod_grad is required"):
        numba_flash.attention_backward(o, q, k, v, o, lse, score_mod=relative_bias, mod_args=(_table(rng),))


def test_decode_takes_the_mods(xp, rng):
    """Decode packs the query heads of a KV head into rows: each row's mods see its own query head
    and index, and its sequence's b; ragged lengths, split in two."""
    q, k, v = random_qkv(rng, 2, 4, 2, 3, 40, 16, "float16", xp)
    lengths = np.array([17, 40], np.int32)
    table = rng.standard_normal((2, 4, 40)).astype(np.float32)

    def sparse(b, h, q_idx, kv_idx, table):  # depends on b, h and q_idx: a wrong index changes it
        return (kv_idx % 3 != q_idx) | (kv_idx < 2 * b + h)

    def per_key(score, b, h, q_idx, kv_idx, table):
        return score + table[b, h, kv_idx]

    mods = dict(mask_mod=sparse, score_mod=per_key)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=xp.asarray(lengths), num_splits=2, return_lse=True,
                                mod_args=(xp.asarray(table),), **mods)
    host = [to_numpy(x) for x in (q, k, v)]
    ref_o, ref_lse = reference.decode(*host, cache_seqlens=lengths, mod_args=(table,), **mods)
    plain_o, _ = reference.decode(*host, cache_seqlens=lengths)
    assert np.abs(plain_o - ref_o).max() > 0.1
    assert np.abs(to_numpy(o).astype(np.float64) - ref_o).max() < 2e-3
    assert np.abs(to_numpy(lse) - ref_lse).max() < 2e-2


def test_a_mod_numba_cannot_compile_is_named():
    """On a GPU numba types a mod (the simulator runs it as Python): its typing error comes back as a
    TypeError naming the mod and what a mod may do; other errors, and kernels without mods, pass."""
    from numba.core.errors import TypingError

    from numba_flash.kernels.score_mods import UserMods
    from numba_flash.user_mods import compiling

    user = UserMods(same_document, relative_bias, 2)
    with pytest.raises(TypeError, match=r"mask_mod='same_document', score_mod='relative_bias'.*device functions"):
        with compiling(user):
            raise TypingError("Untyped global name 'helper'")
    with pytest.raises(ValueError, match="other"):
        with compiling(user):
            raise ValueError("other")
    with pytest.raises(TypingError):
        with compiling(None):
            raise TypingError("no mods: as it is")
