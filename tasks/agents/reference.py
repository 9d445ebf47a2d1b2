"""The `reference` agent: each case's own reference as the output, which every grader
should pass (what `suite validate` checks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tasks.agents.base import AgentContext, Reloadable, spec_fingerprint
from tasks.models import EvalCase, canonical_json
from tasks.registry import agent_kind


@agent_kind("reference", bare=True, sees=lambda case: {"reference": case.reference})
@dataclass(frozen=True)
class ReferenceAgent(Reloadable):
    recorded: ClassVar[bool] = True  # `makes_calls`

    @classmethod
    def load(cls, spec: str, rest: str, base: Path) -> ReferenceAgent:
        return cls(spec, spec_fingerprint(spec, None), base)

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        return reference_text(case.reference)


def reference_text(reference: Any) -> str:
    """A reference as an output: a string as is, null as "", other JSON as canonical JSON."""
    if reference is None:
        return ""
    if isinstance(reference, str):
        return reference
    return canonical_json(reference).decode("utf-8")
