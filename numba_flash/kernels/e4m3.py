"""The float8 e4m3 format (``float8_e4m3fn``: torch's and FlashAttention-3's fp8) on the host.

One sign bit, four exponent bits (bias 7), three mantissa bits; no infinities; ``S.1111.111`` is
NaN; the largest finite value is 448; exponent 0 holds the subnormals ``m / 8 * 2^-6``. The GPU
converts with ``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest even, saturating to +-448, NaN
to NaN); :func:`bits_of` does the same on the host, for the simulator twins of ``kernels.hopper``
and for the tests' references. :func:`values_of` reads bit patterns back (float64).
"""

from __future__ import annotations

import numpy as np

MAX = 448.0
NAN_BITS = 0x7F


def _magnitudes() -> np.ndarray:
    """The values of codes 0x00..0x7E (positive, increasing)."""
    codes = np.arange(0x7F)
    exponent, mantissa = codes >> 3, codes & 7
    normal = (1 + mantissa / 8) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8 * 2.0 ** -6
    return np.where(exponent == 0, subnormal, normal)


MAGNITUDES = _magnitudes()
_VALUES = np.concatenate([MAGNITUDES, [np.nan], -MAGNITUDES, [np.nan]])


def values_of(bits) -> np.ndarray:
    """float64 values of e4m3 bit patterns (any integer array; the low 8 bits)."""
    return _VALUES[np.asarray(bits).astype(np.int64) & 0xFF]


def bits_of(x) -> np.ndarray:
    """uint8 e4m3 patterns of ``x`` rounded to nearest, ties to even, saturated to +-448; NaN -> 0x7F."""
    x = np.asarray(x, np.float64)
    a = np.minimum(np.abs(x), MAX)
    hi = np.clip(np.searchsorted(MAGNITUDES, a), 1, len(MAGNITUDES) - 1)  # MAGNITUDES[hi - 1] <= a <= MAGNITUDES[hi]
    lo = hi - 1
    below, above = a - MAGNITUDES[lo], MAGNITUDES[hi] - a
    code = np.where(below < above, lo, np.where(above < below, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a == 0, 0, code)
    out = (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)
    return np.where(np.isnan(x), NAN_BITS, out).astype(np.uint8)


def host_bits(value: float) -> int:
    """One float's e4m3 pattern (a twin's ``cvt``)."""
    return int(bits_of(value))
