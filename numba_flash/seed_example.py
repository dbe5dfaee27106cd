"""The seed's worked example of the online softmax, computed by :mod:`numba_flash.online`.

Scores ``s = [1, 2, 3, 10]`` for one query row, values ``V = [[1], [1], [1], [1]]``,
seen in two chunks ``[1, 2]`` and ``[3, 10]`` (seed "01 - La recurrencia del online
softmax", "Un ejemplo trabajado"). Every state printed comes from
:func:`numba_flash.online.update` / :func:`~numba_flash.online.finalize`; the
intermediate quantities of steps 2 and 3 (``alpha``, the rescaled sums, ``p``) are
recomputed from two consecutive states, for display only. Used by
``scripts/online_softmax_demo.py`` and ``docs/theory/online-softmax.md``.
"""

from __future__ import annotations

import sys
from typing import TextIO

import numpy as np

from numba_flash.online import SoftmaxState, empty_state, finalize, update

__all__ = ["SCORES", "VALUES", "CHUNKS", "worked_example_states", "print_worked_example"]

SCORES = np.array([1.0, 2.0, 3.0, 10.0])
VALUES = np.ones((4, 1))
CHUNKS = (slice(0, 2), slice(2, 4))  # the seed's s_1 = [1, 2], s_2 = [3, 10]


def worked_example_states() -> list[SoftmaxState]:
    """The state before any chunk, then after each chunk of :data:`CHUNKS`."""
    states = [empty_state(rows=1, head_dim=VALUES.shape[1])]
    for chunk in CHUNKS:
        states.append(update(states[-1], SCORES[None, chunk], VALUES[chunk]))
    return states


def _fmt(x) -> str:
    """A number, or a 1-D array as ``[a, b]``, to 9 significant digits."""
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 0:
        return f"{float(arr):.9g}"
    return "[" + ", ".join(_fmt(e) for e in arr) + "]"


def _state_line(st: SoftmaxState) -> str:
    return f"m = {_fmt(st.m[0])}, l = {_fmt(st.l[0])}, acc = {_fmt(st.acc[0])}"


def print_worked_example(file: TextIO | None = None) -> None:
    """Print the worked example step by step to ``file`` (default: ``sys.stdout``)."""
    out = sys.stdout if file is None else file

    def say(line: str) -> None:
        print(line, file=out)

    say(f"s = {_fmt(SCORES)}, V = {_fmt(VALUES[:, 0])} (one column), "
        f"chunks {', '.join(_fmt(SCORES[c]) for c in CHUNKS)}")
    states = worked_example_states()
    say(f"start:         {_state_line(states[0])}")
    for n, (chunk, before, after) in enumerate(zip(CHUNKS, states, states[1:]), start=1):
        m_old, m_new = before.m[0], after.m[0]
        alpha = 0.0 if m_old == -np.inf else np.exp(m_old - m_new)
        say(f"chunk {n} {_fmt(SCORES[chunk])}:")
        say(f"  step 1  m' = max({_fmt(m_old)}, {_fmt(SCORES[chunk].max())}) = {_fmt(m_new)}")
        why = " (nothing seen yet)" if m_old == -np.inf else ""
        say(f"  step 2  alpha = exp(m - m') = {_fmt(alpha)}{why}; "
            f"rescaled l = {_fmt(alpha * before.l[0])}, acc = {_fmt(alpha * before.acc[0])}")
        say(f"  step 3  p = exp(s - m') = {_fmt(np.exp(SCORES[chunk] - m_new))}")
        say(f"  state   {_state_line(after)}")
    o, lse = finalize(states[-1])
    say(f"finalize:      o = acc / l = {_fmt(o[0])}, lse = m + log(l) = {_fmt(lse[0])}")

    # The classic stable softmax over the whole row, for comparison.
    exps = np.exp(SCORES - SCORES.max())
    weights = exps / exps.sum()
    say(f"all at once:   softmax(s) = {_fmt(weights)}")
    say(f"               softmax(s) @ V = {_fmt(weights @ VALUES)}, "
        f"logsumexp(s) = {_fmt(SCORES.max() + np.log(exps.sum()))}")
