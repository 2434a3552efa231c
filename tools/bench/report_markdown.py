"""Markdown cells and tables shared by `report.py` and its section modules."""

from __future__ import annotations

import math


def _f(v, spec: str = ".2f", suffix: str = "") -> str:
    """A number for a table cell; '-' when absent or not finite."""
    if v is None:
        return "-"
    if not isinstance(v, (int, float)):
        raise TypeError(f"expected a number, got {v!r}")  # the section says "not measured"
    if isinstance(v, float) and not math.isfinite(v):
        return "inf"
    return f"{v:{spec}}{suffix}"


def _table(headers: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]


def _scale(v, k):
    return None if v is None else v * k
