"""Fractions as the percentages every message and report shows: 0.123 is "12.3%"."""

from __future__ import annotations


def percent(value: float | None, digits: int = 1, none: str = "—") -> str:
    """A fraction as a percentage with `digits` decimals; `none` stands for a missing value."""
    return none if value is None else f"{100 * value:.{digits}f}%"


def signed_points(value: float | None, none: str = "—") -> str:
    """A difference of two fractions in percentage points, always signed: -0.02 is "-2.0 pts"."""
    return none if value is None else f"{100 * value:+.1f} pts"
