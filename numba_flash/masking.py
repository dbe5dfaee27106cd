"""Which keys a query sees: the host's one statement of the attention mask.

A :class:`MaskSpec` is FlashAttention's window ``(left, right)``, bottom-right aligned
(API.md section 2c): with ``offset = Nk - Nq``, query ``i`` sees key ``j`` iff::

    i + offset - left  <=  j  <=  i + offset + right

where ``-1`` leaves that side unbounded. ``(-1, -1)`` is no mask, ``(-1, 0)`` is the causal
mask of ``attention(..., causal=True)`` (``j <= i + Nk - Nq``; SDPA's ``is_causal`` when
``Nq == Nk``). Rows can see no key at all (causal with ``Nq > Nk``: the first ``Nq - Nk``
rows); they give ``o = 0``, ``lse = -inf``.

Everything on the host that needs the mask asks this module: the float64 references
(``reference``, ``tiled``), the CuPy baseline, the traffic model, the ring schedule's work
count and its verification. The kernels have their own device-side copy (``kernels.mask``,
compiled for the window ``(left, right)``); the public functions take ``causal`` and
``window_size``, checked by :func:`window_spec`.

:meth:`MaskSpec.visible` uses only ``+``, ``<=`` and ``&`` on its index arguments, so it works
on Python ints, NumPy arrays and CuPy arrays alike (broadcasting as they do); the per-row and
per-key bounds are Python ints.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numba_flash.checks import whole_number

__all__ = ["MaskSpec", "FULL", "CAUSAL", "mask_spec", "window_spec", "evaluate_mask_mod"]


@dataclass(frozen=True)
class MaskSpec:
    """A bottom-right aligned window ``(left, right)``; ``-1``: unbounded on that side."""

    left: int = -1
    right: int = -1

    def __post_init__(self):
        for name in ("left", "right"):
            value = getattr(self, name)
            value = whole_number(value, f"window {name}", minimum=None)
            if value < -1:
                raise ValueError(f"window {name} must be -1 (unbounded) or >= 0; got {value}")
            object.__setattr__(self, name, int(value))

    @classmethod
    def of(cls, causal: bool = False, window=(-1, -1)) -> MaskSpec:
        """The mask of ``causal`` and ``window`` together (both given: their intersection, so
        causal caps ``right`` at 0)."""
        left, right = window
        spec = cls(left, right)
        if causal:
            spec = cls(spec.left, 0 if spec.right == -1 else min(spec.right, 0))
        return spec

    @property
    def window(self) -> tuple[int, int]:
        return (self.left, self.right)

    @property
    def is_causal(self) -> bool:
        """Exactly ``attention(..., causal=True)``'s mask."""
        return self.window == (-1, 0)

    @property
    def is_full(self) -> bool:
        """No mask: every query sees every key."""
        return self.window == (-1, -1)

    @staticmethod
    def offset(n_q: int, n_k: int) -> int:
        """The bottom-right alignment: query ``i``'s diagonal key is ``i + offset``."""
        return n_k - n_q

    # -- the predicate -----------------------------------------------------------------------

    def visible(self, q_idx, k_idx, n_q: int, n_k: int):
        """Does query ``q_idx`` see key ``k_idx``? Elementwise with broadcasting (shape the
        indices, e.g. ``rows[:, None]`` and ``cols[None, :]``, for a matrix); Python ints give a
        bool. Indices are taken to be in range (``0 <= q_idx < n_q``, ``0 <= k_idx < n_k``)."""
        diagonal = q_idx + (n_k - n_q)
        seen = (k_idx == k_idx) & (q_idx == q_idx)  # all True, of the broadcast shape and library
        if self.right != -1:
            seen = seen & (k_idx <= diagonal + self.right)
        if self.left != -1:
            seen = seen & (diagonal - self.left <= k_idx)
        return seen

    def matrix(self, n_q: int, n_k: int, xp=np):
        """The ``(n_q, n_k)`` boolean visibility matrix, in array module ``xp``."""
        return self.visible(xp.arange(n_q)[:, None], xp.arange(n_k)[None, :], n_q, n_k)

    # -- bounds (Python ints; "none": first = n, last = -1, so last - first + 1 <= 0) --------

    def first_visible_key(self, row: int, n_q: int, n_k: int) -> int:
        """The first key query ``row`` sees; ``n_k`` when it sees none."""
        first, last = self._key_bounds(row, n_q, n_k)
        return first if first <= last else n_k

    def last_visible_key(self, row: int, n_q: int, n_k: int) -> int:
        """The last key query ``row`` sees; ``-1`` when it sees none."""
        first, last = self._key_bounds(row, n_q, n_k)
        return last if first <= last else -1

    def first_visible_query(self, key: int, n_q: int, n_k: int) -> int:
        """The first query that sees ``key``; ``n_q`` when none does."""
        first, last = self._query_bounds(key, n_q, n_k)
        return first if first <= last else n_q

    def last_visible_query(self, key: int, n_q: int, n_k: int) -> int:
        """The last query that sees ``key``; ``-1`` when none does."""
        first, last = self._query_bounds(key, n_q, n_k)
        return last if first <= last else -1

    def _key_bounds(self, row, n_q, n_k):
        diagonal = row + (n_k - n_q)
        first = 0 if self.left == -1 else max(0, diagonal - self.left)
        last = n_k - 1 if self.right == -1 else min(n_k - 1, diagonal + self.right)
        return first, last

    def _query_bounds(self, key, n_q, n_k):
        # i + off - left <= key <= i + off + right  <=>  key - off - right <= i <= key - off + left
        anti = key - (n_k - n_q)
        first = 0 if self.right == -1 else max(0, anti - self.right)
        last = n_q - 1 if self.left == -1 else min(n_q - 1, anti + self.left)
        return first, last

    def key_span(self, row_start: int, row_stop: int, n_q: int, n_k: int) -> tuple[int, int]:
        """``(first, last)``: the keys seen by any query of ``row_start:row_stop`` (a Q tile);
        ``(n_k, -1)`` when none sees a key. The window's bounds grow with the row, so the seen
        keys of consecutive rows form one range."""
        row_start, row_stop = max(0, row_start), min(n_q, row_stop)
        if row_start >= row_stop:
            return (n_k, -1)
        # Each row's unclamped range [i + offset - left, i + offset + right] is one key past the
        # previous row's at both ends, so their union is [lo(row_start), hi(row_stop - 1)].
        first, _ = self._key_bounds(row_start, n_q, n_k)
        _, last = self._key_bounds(row_stop - 1, n_q, n_k)
        return (first, last) if first <= last else (n_k, -1)

    def visible_keys(self, n_q: int, n_k: int) -> np.ndarray:
        """Keys each query row sees: int64 ``(n_q,)``."""
        rows = np.arange(n_q, dtype=np.int64)
        diagonal = rows + (n_k - n_q)
        first = np.zeros_like(rows) if self.left == -1 else np.maximum(0, diagonal - self.left)
        last = np.full_like(rows, n_k - 1) if self.right == -1 else np.minimum(n_k - 1, diagonal + self.right)
        return np.maximum(0, last - first + 1)

    def visible_pairs(self, n_q: int, n_k: int) -> int:
        """(query, key) pairs the mask keeps: the work of one head."""
        if self.is_full:
            return n_q * n_k
        return int(self.visible_keys(n_q, n_k).sum())


FULL = MaskSpec(-1, -1)
CAUSAL = MaskSpec(-1, 0)


def mask_spec(causal: bool = False, window=(-1, -1)) -> MaskSpec:
    """:meth:`MaskSpec.of`: the mask of the public ``causal`` flag (and a window)."""
    return MaskSpec.of(causal, window)


def window_spec(causal=False, window_size=(-1, -1)) -> MaskSpec:
    """The mask of a public call's ``causal`` and ``window_size`` (API.md section 2c), checked:
    ``TypeError`` unless ``window_size`` is a pair of ints, ``ValueError`` for a side below -1,
    each naming ``window_size``."""
    ordered = isinstance(window_size, (tuple, list)) or (isinstance(window_size, np.ndarray) and window_size.ndim == 1)
    if not ordered or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints (a tuple or list), got {window_size!r}")
    try:
        return mask_spec(causal, tuple(window_size))
    except (TypeError, ValueError) as err:
        raise type(err)(f"window_size={tuple(window_size)!r}: {err}") from None


def evaluate_mask_mod(mask_mod, grid, mod_args, shape) -> np.ndarray:
    """A user ``mask_mod(b, h, q_idx, kv_idx, *mod_args) -> bool`` over an index grid: bool
    ``shape``. ``grid``: four int64 arrays that broadcast to ``shape`` (read-only). One call on
    the broadcast arrays when the function is vectorisable (returns a bool or integer array of
    a broadcastable shape), else one call per element. ``TypeError`` naming the element when a
    call returns something that is not a bool."""
    with np.errstate(all="ignore"):
        try:
            out = np.asarray(mask_mod(*grid, *mod_args))
            if out.dtype.kind in "biu":
                return np.broadcast_to(out, shape).astype(bool)
        except Exception:  # noqa: BLE001 -- not vectorisable: the elementwise loop below
            pass
        out = np.zeros(shape, dtype=bool)
        full = [np.broadcast_to(a, shape) for a in grid]
        for e in np.ndindex(*shape):
            index = tuple(int(a[e]) for a in full)
            result = mask_mod(*index, *mod_args)
            try:
                out[e] = bool(result)
            except (TypeError, ValueError):
                raise TypeError(f"mask_mod must return a bool, got {type(result).__name__} at (b, h, q_idx, kv_idx) = "
                                f"{index}") from None
    return out
