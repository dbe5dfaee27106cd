"""The online-softmax algebra in NumPy, stated once: the per-row state that both kernels carry
from tile to tile, and the oracle their tile-level steps are tested against.

:mod:`numba_flash.tiled` runs FA-1's and FA-2's loop nests on these four operations (FA-2:
``update`` per K/V tile, one ``finalize``; FA-1: the tile's own ``update`` then ``merge`` with
the state read back from global memory, lines 9-13 of its Algorithm 1), and the tests hold the
kernels to those walks as well as to the materialised reference (``tests/host/test_tiled.py``,
``tests/host/test_attention.py``). The kernels compute the same recurrences in float32 and in log2
units (``exp2``); this module is float64 and natural-log.

A :class:`SoftmaxState` summarises what some output rows have seen of their keys so
far. For one row that has seen the scores ``s_j`` and value rows ``v_j`` of a set of
keys ``J``:

- ``m   = max_{j in J} s_j``                      (running maximum; ``-inf`` when J is empty)
- ``l   = sum_{j in J} exp(s_j - m)``             (running denominator; ``l >= 1`` once m is finite)
- ``acc = sum_{j in J} exp(s_j - m) * v_j``       (unnormalised output, the FA-2 convention)

so that, once every key has been seen, ``acc / l = softmax(s) @ V`` and
``m + log(l) = logsumexp(s)``. Every argument of ``exp`` is ``<= 0``: nothing overflows.

Four operations maintain the invariants (seed: "01 - La recurrencia del online softmax"):

- :func:`empty_state` -- the state of a row that has seen nothing (the merge identity);
- :func:`update` -- see one more chunk of keys: the seed's recurrence, steps 1-4;
- :func:`merge` -- combine the states of two disjoint sets of keys (the reduction
  operator of the seed's practice problem 4); associative and commutative;
- :func:`finalize` -- divide once: ``o = acc / l``, ``lse = m + log(l)``.

Conventions at the edges, identical in :mod:`numba_flash.reference`:

- A score of ``-inf`` masks its key: the key contributes nothing to that row, not even
  a NaN or infinite value (it is as if the row had never seen the key). A row that has
  seen only ``-inf`` scores, or nothing, finalizes to ``o = 0``, ``lse = -inf``.
- NaN in a score makes its row NaN (``m``, ``l``, ``acc``, ``o`` and ``lse``); NaN in
  ``v[j, d]`` makes ``acc[i, d]`` and ``o[i, d]`` NaN for every row ``i`` that sees key
  ``j``. Nothing raises, and no RuntimeWarning escapes.

Everything is computed in float64 whatever the input dtype: this module is the
executable statement of the math, used by tests and docs, not the fast path.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from numba_flash.checks import whole_number

__all__ = ["SoftmaxState", "empty_state", "update", "merge", "finalize", "combine"]

_NEG_INF = -np.inf


class SoftmaxState(NamedTuple):
    """Running online-softmax state of ``rows`` output rows (all float64).

    Attributes
    ----------
    m : ndarray, shape (rows,)
        Maximum score seen so far per row; ``-inf`` for a row that has seen no
        unmasked key.
    l : ndarray, shape (rows,)
        ``sum_j exp(s_j - m)`` over the keys seen so far; 0 exactly when ``m = -inf``.
    acc : ndarray, shape (rows, head_dim)
        ``sum_j exp(s_j - m) * v_j`` over the keys seen so far (not yet divided by ``l``).
    """

    m: np.ndarray
    l: np.ndarray  # noqa: E741 -- the paper's name
    acc: np.ndarray


# --------------------------------------------------------------------------- validation


def _as_float64(x, name: str) -> np.ndarray:
    """``x`` as a float64 array; TypeError naming ``name`` for non-real dtypes."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _check_ndim(arr: np.ndarray, ndim: int, name: str, layout: str) -> None:
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D with shape {layout}, got shape {arr.shape}")


def _as_state(st, name: str) -> SoftmaxState:
    """Validate a state (any ``(m, l, acc)`` triple) and return it as float64 arrays."""
    try:
        m, l, acc = st  # noqa: E741
    except (TypeError, ValueError):
        kind = type(st).__name__
        raise TypeError(f"{name} must be a SoftmaxState (m, l, acc), got {kind}") from None
    m = _as_float64(m, f"{name}.m")
    l = _as_float64(l, f"{name}.l")  # noqa: E741
    acc = _as_float64(acc, f"{name}.acc")
    _check_ndim(m, 1, f"{name}.m", "(rows,)")
    _check_ndim(l, 1, f"{name}.l", "(rows,)")
    _check_ndim(acc, 2, f"{name}.acc", "(rows, head_dim)")
    if l.shape != m.shape or acc.shape[0] != m.shape[0]:
        raise ValueError(
            f"{name} is inconsistent: m {m.shape}, l {l.shape} and acc {acc.shape} "
            "must have the same number of rows"
        )
    return SoftmaxState(m, l, acc)


def _exp_minus(x: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """``exp(x - shift)`` elementwise, with ``exp(-inf - anything) = 0``.

    This is the one guard the algebra needs: a masked score (``x = -inf``) or the
    maximum of an empty state (``m_old = -inf``) gives weight 0, without evaluating
    ``-inf - (-inf) = nan``. Any other NaN (in ``x`` or ``shift``) propagates.
    """
    x, shift = np.broadcast_arrays(x, shift)
    diff = np.full(x.shape, _NEG_INF)
    np.subtract(x, shift, out=diff, where=(x != _NEG_INF))
    return np.exp(diff)


def empty_state(rows: int, head_dim: int) -> SoftmaxState:
    """The state of ``rows`` rows that have seen no key: ``m = -inf``, ``l = 0``, ``acc = 0``.

    It is the identity of :func:`merge` (on both sides) and finalizes to
    ``o = 0``, ``lse = -inf``.
    """
    rows = whole_number(rows, "rows")
    head_dim = whole_number(head_dim, "head_dim")
    return SoftmaxState(
        m=np.full(rows, _NEG_INF),
        l=np.zeros(rows),
        acc=np.zeros((rows, head_dim)),
    )


def update(st: SoftmaxState, s_chunk, v_chunk) -> SoftmaxState:
    """See one more chunk of ``c`` keys: the seed's recurrence, steps 1-4.

    Parameters
    ----------
    st : SoftmaxState
        State of ``rows`` rows with ``head_dim``-wide values.
    s_chunk : array_like, shape (rows, c)
        Scores of the new keys for every row (``-inf`` masks a key for that row).
    v_chunk : array_like, shape (c, head_dim)
        Value rows of the new keys. ``c = 0`` is allowed and changes nothing.

    Returns
    -------
    SoftmaxState
        A new state (the inputs are not modified) with the invariants restored over
        the old keys plus the new ones:

        1. ``m' = max(m, max_j s_j)``                 -- new running maximum;
        2. ``alpha = exp(m - m')``, ``l <- alpha l``, ``acc <- alpha acc`` -- rescale the old
           sums to the new maximum (the seed's proof: ``sum exp(s - m')
           = exp(m - m') sum exp(s - m)``); ``alpha = 0`` when the row had seen nothing;
        3. ``p_j = exp(s_j - m')``, ``l <- l + sum_j p_j``, ``acc <- acc + sum_j p_j v_j``;
        4. ``m <- m'``.
    """
    st = _as_state(st, "st")
    s = _as_float64(s_chunk, "s_chunk")
    v = _as_float64(v_chunk, "v_chunk")
    rows, head_dim = st.acc.shape
    _check_ndim(s, 2, "s_chunk", "(rows, c)")
    _check_ndim(v, 2, "v_chunk", "(c, head_dim)")
    if s.shape[0] != rows:
        raise ValueError(f"s_chunk must have shape (rows, c) with rows = {rows}, got {s.shape}")
    if v.shape != (s.shape[1], head_dim):
        raise ValueError(
            f"v_chunk must have shape (c, head_dim) = ({s.shape[1]}, {head_dim}) "
            f"(c from s_chunk, head_dim from st), got {v.shape}"
        )

    # inf - inf and 0 * inf (infinite scores or values) give NaN quietly: they propagate.
    with np.errstate(invalid="ignore", over="ignore"):
        m_new = np.maximum(st.m, np.max(s, axis=1, initial=_NEG_INF))  # step 1 (max keeps NaN)
        alpha = _exp_minus(st.m, m_new)  # step 2
        p = _exp_minus(s, m_new[:, None])  # step 3
        seen = s != _NEG_INF
        # sum_j p_ij v_j over the keys row i sees; a masked key adds an exact 0 even if v_j is NaN.
        pv = np.where(seen[:, :, None], p[:, :, None] * v[None, :, :], 0.0).sum(axis=1)
        l = alpha * st.l + p.sum(axis=1)  # noqa: E741
        acc = alpha[:, None] * st.acc + pv
    return SoftmaxState(m_new, l, acc)  # step 4


def merge(a: SoftmaxState, b: SoftmaxState) -> SoftmaxState:
    """Combine the states of two disjoint sets of keys seen by the same rows.

    ``(m_a, l_a, acc_a) (+) (m_b, l_b, acc_b) = (m, l, acc)`` with::

        m   = max(m_a, m_b)
        l   = exp(m_a - m) l_a   + exp(m_b - m) l_b
        acc = exp(m_a - m) acc_a + exp(m_b - m) acc_b

    Each side is rescaled to the common maximum exactly as in step 2 of :func:`update`
    (``exp(-inf - m) = 0``: an empty side contributes nothing). This is the reduction
    operator of the seed's practice problem 4: associative (up to rounding),
    commutative (exactly, since ``max`` and ``+`` are), with :func:`empty_state` as its
    identity on both sides (exactly). ``a`` and ``b`` must have the same shapes.
    """
    a = _as_state(a, "a")
    b = _as_state(b, "b")
    if a.acc.shape != b.acc.shape:
        raise ValueError(
            f"a and b must describe the same (rows, head_dim); got a.acc {a.acc.shape} "
            f"and b.acc {b.acc.shape}"
        )
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.maximum(a.m, b.m)
        alpha_a = _exp_minus(a.m, m)
        alpha_b = _exp_minus(b.m, m)
        l = alpha_a * a.l + alpha_b * b.l  # noqa: E741
        acc = alpha_a[:, None] * a.acc + alpha_b[:, None] * b.acc
    return SoftmaxState(m, l, acc)


def finalize(st: SoftmaxState) -> tuple[np.ndarray, np.ndarray]:
    """Normalise once: ``o = acc / l`` (rows, head_dim) and ``lse = m + log(l)`` (rows,).

    ``lse`` is the natural-log logsumexp of the scores each row has seen. A row with
    ``m = -inf`` (nothing, or only masked keys, seen) gives ``o = 0`` and ``lse = -inf``;
    a NaN row stays NaN (the guard tests ``m == -inf``, which NaN never satisfies).
    """
    st = _as_state(st, "st")
    empty = st.m == _NEG_INF
    o = np.zeros_like(st.acc)
    lse = np.full_like(st.m, _NEG_INF)
    # divide: only a hand-made state with finite m and l = 0 gets here; it gives inf quietly.
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        np.divide(st.acc, st.l[:, None], out=o, where=~empty[:, None])
        np.add(st.m, np.log(st.l, where=~empty, out=np.zeros_like(st.l)), out=lse, where=~empty)
    return o, lse


def combine(o_parts, lse_parts) -> tuple[np.ndarray, np.ndarray]:
    """Merge finalised partial results over disjoint key ranges (split-KV): ``(o, lse)``.

    ``o_parts``: ``(splits, rows, head_dim)``, ``lse_parts``: ``(splits, rows)``, split ``s``
    the :func:`finalize` of the keys of its range. A finalised partial is the state
    ``(m = lse_s, l = 1, acc = o_s)`` (``o_s`` already divided by its ``l``, in units of
    ``exp(lse_s)``); folding :func:`merge` over the splits and finalising once gives::

        lse = m + log sum_s exp(lse_s - m)        m = max_s lse_s
        o   = sum_s exp(lse_s - lse) o_s

    the formula ``kernels.combine`` computes on the GPU (this is its NumPy twin). An empty
    partial (``lse_s = -inf``) contributes nothing; all empty gives ``o = 0``, ``lse = -inf``.
    """
    o_parts = _as_float64(o_parts, "o_parts")
    lse_parts = _as_float64(lse_parts, "lse_parts")
    _check_ndim(o_parts, 3, "o_parts", "(splits, rows, head_dim)")
    _check_ndim(lse_parts, 2, "lse_parts", "(splits, rows)")
    if lse_parts.shape != o_parts.shape[:2]:
        raise ValueError(
            f"lse_parts must have shape (splits, rows) = {o_parts.shape[:2]}; got {lse_parts.shape}"
        )
    splits, rows, head_dim = o_parts.shape
    st = empty_state(rows, head_dim)
    for o_s, lse_s in zip(o_parts, lse_parts):
        weight = np.where(lse_s == _NEG_INF, 0.0, 1.0)  # an empty partial's l is 0, not 1
        st = merge(st, SoftmaxState(lse_s, weight, o_s * weight[:, None]))
    return finalize(st)
