"""Argument checks shared by the library modules."""

from __future__ import annotations

import operator
from typing import Any


def positive_int(value: Any, name: str, error: type[Exception] = ValueError) -> int:
    """``value`` as an int >= 1, else ``error`` naming ``name``; bools are refused."""
    if isinstance(value, bool):  # bool is an int subclass, never a count or a size
        raise error(f"{name} must be a positive integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise error(f"{name} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise error(f"{name} must be a positive integer, got {number}")
    return number
