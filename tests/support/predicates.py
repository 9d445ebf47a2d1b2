"""Predicates for the flow tests."""

from __future__ import annotations

from collections import Counter

_seen: Counter = Counter()


def alternating(output, case) -> bool:
    """An unstable environment: the same output passes, then fails, then passes again."""
    _seen[(case.id, output)] += 1
    return _seen[(case.id, output)] % 2 == 1
