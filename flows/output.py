"""JSON documents as the CLI prints them.

Floats are printed to 6 significant digits: 0.5599999999999999 is 0.56, and no figure
evalpipe reports is that precise. Only the printed text is rounded; what is stored keeps
full precision.
"""

from __future__ import annotations

import json
import math
from typing import Any

SIGNIFICANT_DIGITS = 6


def rounded(value: Any) -> Any:
    """`value` with every finite float rounded to SIGNIFICANT_DIGITS significant digits."""
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}") if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v) for v in value]
    return value


def json_doc(doc: Any, indent: int | None = None) -> str:
    return json.dumps(rounded(doc), indent=indent, default=str)
