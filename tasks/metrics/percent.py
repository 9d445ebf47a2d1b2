"""Fractions as the percentages every message and report shows: 0.123 is "12.3%"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def percent(value: float | None, digits: int = 1, none: str = "—") -> str:
    """A fraction as a percentage with `digits` decimals; `none` stands for a missing value."""
    return none if value is None else f"{100 * value:.{digits}f}%"


def signed_points(value: float | None, none: str = "—") -> str:
    """A difference of two fractions in percentage points, always signed: -0.02 is "-2.0 pts"."""
    return none if value is None else f"{100 * value:+.1f} pts"


def with_ci(doc: Mapping[str, Any], key: str) -> str:
    """A calibration figure with its CI (`key`, `key_ci` in the document): kappa as a
    coefficient, the rates as percentages; "n/a" when undefined (its condition never
    occurred), which is not 0."""
    value, ci = doc.get(key), doc.get(f"{key}_ci")
    if value is None:
        return "n/a"
    fmt = (lambda x: f"{x:.3f}") if key == "kappa" else percent
    return fmt(value) + (f" [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "")


def figure(value: float | None, as_percent: bool = True, none: str = "n/a") -> str:
    """A reported figure: a fraction as a percentage, any other number to 4 significant digits."""
    if value is None:
        return none
    return percent(value) if as_percent else f"{value:.4g}"


def ci_text(ci: list[float] | tuple[float, float] | None, as_percent: bool = True) -> str:
    """A CI as every renderer writes it; a figure over one case has none."""
    return "[no CI: one case]" if ci is None else f"[{figure(ci[0], as_percent)}, {figure(ci[1], as_percent)}]"


def shown_ci(ci: list[float] | tuple[float, float] | None, cases: int) -> list[float] | tuple[float, float] | None:
    """A run's pass@1 CI as its renderers show it: none over a single case, where the
    case-clustered bootstrap has nothing to resample (the `--json` document keeps the
    zero-width pair it computes, as it always has)."""
    return ci if cases > 1 else None


def headline_ci(ci: list[float] | tuple[float, float] | None, cases: int, level: float) -> str:
    """A run's pass@1 CI in a headline: "95% CI [55.0%, 67.0%]", or that one case has none."""
    shown = shown_ci(ci, cases)
    return f"{100 * level:g}% CI {ci_text(shown)}" if shown else "no CI: one case"
