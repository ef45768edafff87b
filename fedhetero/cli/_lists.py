"""Comma-separated option values (``--seeds 0,1,2``) as lists."""

from __future__ import annotations

__all__ = ["floats", "ints", "names"]


def floats(text: str) -> list[float]:
    """``"0.1,0.5"`` -> ``[0.1, 0.5]``."""
    return [float(x) for x in text.split(",")]


def ints(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``."""
    return [int(x) for x in text.split(",")]


def names(text: str) -> list[str]:
    """``"fedavg, dynamicfl,"`` -> ``["fedavg", "dynamicfl"]`` (blanks dropped)."""
    return [x.strip() for x in text.split(",") if x.strip()]
