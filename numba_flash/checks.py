"""Checks of scalar arguments that several host modules take, with one wording for their errors."""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np

__all__ = ["softcap_value", "whole_number"]


def whole_number(value, name: str, minimum: int | None = 0) -> int:
    """``value`` as a Python int (any integer type; not a bool): ``TypeError`` naming ``name``
    otherwise, and ``ValueError`` when it is below ``minimum`` (``None``: no bound)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def softcap_value(softcap) -> float:
    """``softcap`` (API.md 2c) as a float: ``TypeError`` unless a real number, ``ValueError``
    unless finite and >= 0 (0: off)."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
    value = float(softcap)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {value}")
    return value
