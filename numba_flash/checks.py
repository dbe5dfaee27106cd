"""Checks of scalar arguments that several host modules take, with one wording for their errors."""

from __future__ import annotations

import operator

import numpy as np

__all__ = ["whole_number"]


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
