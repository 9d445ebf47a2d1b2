"""Limits on the shape of user-supplied JSON and YAML, checked while parsing.

A suite or records file is data, but a small one can still cost unbounded time or memory,
or crash the parser: a YAML alias "bomb" (476 bytes that expand to millions of nodes),
nesting deep enough to exhaust Python's recursion, an integer past CPython's digit limit.
Every reader of such input parses through here, so each of these is refused the same way:
a `LimitError` whose message says which limit, for the caller to prefix with the file and
line.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

# Deeper than any sensible case, far shallower than what the recursive parts of the
# pipeline (YAML composing, hashing, validation) survive.
MAX_DEPTH = 100
# Aliases may expand a YAML document to this many times its own nodes, or to this many
# nodes, whichever is more: ordinary reuse of an anchor stays far below both.
ALIAS_EXPANSION_RATIO = 10
ALIAS_EXPANSION_FLOOR = 100_000


class LimitError(ValueError):
    """Input past one of the limits above; `line` (1-based) when known."""

    def __init__(self, problem: str, line: int | None = None) -> None:
        super().__init__(problem)
        self.line = line


def _too_deep(line: int | None = None) -> LimitError:
    return LimitError(f"nested deeper than {MAX_DEPTH} levels", line)


def _big_int(line: int | None = None) -> LimitError:
    return LimitError(f"an integer with more than {sys.get_int_max_str_digits()} digits", line)


def parse_json(text: str) -> Any:
    """`json.loads`, refusing nesting deeper than `MAX_DEPTH` and oversized integers.
    Malformed JSON still raises `json.JSONDecodeError`."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:
        if isinstance(exc, json.JSONDecodeError) or "integer string conversion" not in str(exc):
            raise
        raise _big_int() from None
    if _depth(value) > MAX_DEPTH:
        raise _too_deep()
    return value


def _depth(value: Any) -> int:
    """Nesting depth of lists and dicts, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                break
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


class LimitedLoader(yaml.SafeLoader):
    """A SafeLoader that refuses alias bombs, deep nesting and oversized integers."""

    _depth = 0

    def fetch_flow_collection_start(self, TokenClass):
        # The scanner's work per token grows with the flow level ([[[[...), so stop here,
        # before the composer, which would see the depth only after that quadratic scan.
        if self.flow_level >= MAX_DEPTH:
            raise _too_deep(self.get_mark().line + 1)
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _too_deep(self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        _check_expansion(node)
        return node

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            raise _big_int(node.start_mark.line + 1) from None


LimitedLoader.add_constructor("tag:yaml.org,2002:int", LimitedLoader.construct_yaml_int)


def _check_expansion(root: Node) -> None:
    """Refuse a document whose aliases expand it past the budget, or nest it past
    `MAX_DEPTH`, by walking its node graph once (each shared node is measured once)."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()

    def children(node: Node) -> list[Node]:
        if isinstance(node, SequenceNode):
            return node.value
        if isinstance(node, MappingNode):
            return [part for pair in node.value for part in pair]
        return []

    def measure(node: Node) -> None:
        key = id(node)
        if key in size:
            return
        if key in on_path:
            raise LimitError("an alias refers to a node that contains it", node.start_mark.line + 1)
        on_path.add(key)
        kids = children(node)
        for kid in kids:
            measure(kid)
        on_path.discard(key)
        size[key] = 1 + sum(size[id(k)] for k in kids)
        depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
        if depth[key] > MAX_DEPTH:
            raise _too_deep(node.start_mark.line + 1)

    measure(root)  # recursion is bounded: the composer already refused deeper text
    budget = max(ALIAS_EXPANSION_FLOOR, ALIAS_EXPANSION_RATIO * len(size))
    if size[id(root)] > budget:
        raise LimitError(
            f"aliases expand the document to {size[id(root)]:,} nodes (limit {budget:,}, {len(size):,} written)"
        )
