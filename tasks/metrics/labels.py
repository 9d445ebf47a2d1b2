"""The human rung: label files out and back in.

Export writes one row per sample of a run — `case_id`, `sample_index`, `prompt`,
`output`, a blank `label` and a blank `note` — as CSV or JSONL (by the file's suffix).
Import reads the filled file back. A label is pass/fail (1/0, yes/no, true/false); a
blank label means "not labelled" and is skipped. Each labelled row becomes a sample of a
*derived run*: the same case, index, seed and output as the source sample, the verdict
from the label, the source sample's safety violations kept (a label never clears
safety), and the trace's `human` section (`tasks.trace.HumanLabel`: labeller, source_run,
label, note). The derived run is stored and aggregated like any other run, so the gate and the
report read it unchanged.

A malformed file is refused as a whole with an `InputError` naming the file and line:
nothing is half imported.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from tasks.files import atomic_path
from tasks.graders.human import label_verdict, parse_label
from tasks.graders.judge import render
from tasks.models import EvalCase, InputError, canonical_json, sha256_hex
from tasks.suites.cells import cell_text, inert_cell
from tasks.suites.jsonl import object_lines
from tasks.trace import HumanLabel, SampleTrace

COLUMNS = ("case_id", "sample_index", "prompt", "output", "label", "note", "run_id")
FORMATS = (".csv", ".jsonl")


@dataclass(frozen=True)
class LabelRow:
    line: int  # where the row starts in its file, for messages
    case_id: str
    sample_index: int | None
    output: str | None
    label: bool | None  # None: left blank
    note: str = ""
    run_id: str | None = None  # the run the row was exported from (a file written before: None)


def export_rows(samples: Iterable[dict[str, Any]], cases: dict[str, EvalCase], run_id: str) -> Iterator[dict[str, Any]]:
    """One blank-labelled row per sample row (`case_id`, `sample_index`, `output`: a `str`,
    or a stored output whose `str` reads it) of run `run_id`, in their order, each output
    read as its row is made."""
    for sample in samples:
        cid = sample["case_id"]
        prompt = render("{prompt}", cases[cid]) if cid in cases else ""
        yield {"case_id": cid, "sample_index": sample["sample_index"], "prompt": prompt,
               "output": str(sample["output"] or ""), "label": "", "note": "", "run_id": run_id}


def _format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise InputError(f"{path}: unknown label file format {suffix!r} (expected .csv or .jsonl)")
    return suffix


def write_label_file(rows: Iterable[dict[str, Any]], path: Path) -> int:
    """Write `rows` one at a time (a file of large outputs is never whole in memory),
    replacing `path` whole; returns how many."""
    fmt = _format(path)
    count = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as fh:
        # Every cell quoted: a lone carriage return in an output would otherwise end its row.
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, lineterminator="\n", quoting=csv.QUOTE_ALL)
        if fmt == ".csv":
            writer.writeheader()
        for row in rows:
            if fmt == ".jsonl":
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            else:  # no cell a spreadsheet would run as a formula (tasks/suites/cells.py)
                writer.writerow({k: inert_cell(v) if isinstance(v, str) else v for k, v in row.items()})
            count += 1
    return count


def read_labels(path: Path, *, need_output: bool = False) -> list[LabelRow]:
    """Parse a filled label file; `InputError` naming the line on any malformed row."""
    fmt = _format(path)
    try:  # newlines as written: a carriage return inside a quoted cell is the output's
        with open(path, encoding="utf-8", newline="") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read label file: {exc}") from None
    records = object_lines(text, str(path)) if fmt == ".jsonl" else _csv_records(path, text)
    rows = [
        _label_row(record, f"{path}: line {line}", line, need_output) for line, record in records
    ]
    seen: dict[tuple[str, int | None], int] = {}
    for row in rows:
        key = (row.case_id, row.sample_index)
        if row.sample_index is not None and key in seen:
            raise InputError(
                f"{path}: line {row.line}: {row.case_id}#{row.sample_index} is "
                f"already labelled on line {seen[key]}"
            )
        seen[key] = row.line
    return rows


def _csv_records(path: Path, text: str) -> list[tuple[int, dict[str, Any]]]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    missing = [c for c in ("case_id", "label") if c not in (reader.fieldnames or ())]
    if missing:
        raise InputError(f"{path}: line 1: header lacks column(s) {', '.join(missing)}")
    records, start = [], 2
    try:
        for record in reader:
            if None in record:
                raise InputError(f"{path}: line {start}: more cells than header columns")
            records.append((start, {k: cell_text(v) if isinstance(v, str) else v for k, v in record.items()}))
            start = reader.line_num + 1
    except csv.Error as exc:
        raise InputError(f"{path}: line {reader.line_num}: {exc}") from None
    return records


def _label_row(record: dict[str, Any], where: str, line: int, need_output: bool) -> LabelRow:
    cid = record.get("case_id")
    if not isinstance(cid, str) or not cid:
        raise InputError(f"{where}: missing 'case_id'")
    index = record.get("sample_index")
    if index in (None, ""):
        index = None
    else:
        try:
            index = int(index)
        except (TypeError, ValueError):
            raise InputError(f"{where}: sample_index {index!r} is not an integer") from None
        if index < 0:
            raise InputError(f"{where}: sample_index {index} is negative")
    output = record.get("output")
    if output is not None and not isinstance(output, str):
        raise InputError(f"{where}: output must be a string")
    if need_output and output is None:
        raise InputError(f"{where}: missing 'output'")
    if "label" not in record:
        raise InputError(f"{where}: missing 'label'")
    label = record["label"]
    if isinstance(label, bool):
        label = "pass" if label else "fail"
    elif isinstance(label, int):
        label = str(label)
    elif label is None:
        label = ""
    if not isinstance(label, str):
        raise InputError(f"{where}: label {label!r} is not pass/fail")
    note = record.get("note") or ""
    run_id = record.get("run_id") or None
    if run_id is not None and not isinstance(run_id, str):
        raise InputError(f"{where}: run_id must be a string")
    return LabelRow(line, cid, index, output, parse_label(label, where), str(note), run_id)


def labelled_run(rows: Sequence[LabelRow], where: str) -> str | None:
    """The run the rows were exported from, when they name one (`run_id`); `InputError` when
    they name several."""
    named = {row.run_id: row.line for row in rows if row.run_id is not None}
    if len(named) > 1:
        (a, line_a), (b, line_b) = sorted(named.items(), key=lambda item: item[1])[:2]
        raise InputError(f"{where}: the labels come from several runs ({a} on line {line_a}, {b} on line {line_b});"
                         " calibrate on one run's labels at a time")
    return next(iter(named), None)


def same_text(a: str, b: str) -> bool:
    # A spreadsheet round trip may turn \n into \r\n; nothing else is forgiven.
    return a.replace("\r\n", "\n") == b.replace("\r\n", "\n")


def labelled_samples(
    source: pa.Table,
    labels: list[LabelRow],
    *,
    labeller: str,
    source_run: str,
    run_id: str,
    where: str,
    text_of: Callable[[dict[str, Any]], str] = lambda sample: sample["output"] or "",
) -> pa.Table:
    """The derived run's sample rows: one per labelled row, attached to the source sample
    it names. Refuses labels for samples the run does not have or whose output differs.
    `text_of`: a source sample's output, where `source` refers to a long one stored in the
    home (null `output` beside its `output_sha`, which the derived row keeps) rather than
    holding it: read when a label's output is checked against it."""
    if not labeller.strip():
        raise InputError("--labeller: give the name of who labelled")
    by_key = {(r["case_id"], r["sample_index"]): r for r in source.to_pylist()}
    out: list[dict[str, Any]] = []
    for row in labels:
        if row.sample_index is None:
            raise InputError(f"{where}: line {row.line}: missing 'sample_index'")
        sample = by_key.get((row.case_id, row.sample_index))
        if sample is None:
            raise InputError(
                f"{where}: line {row.line}: run {source_run} has no sample "
                f"{row.case_id}#{row.sample_index}"
            )
        if row.output is not None and not same_text(row.output, text_of(sample)):
            raise InputError(
                f"{where}: line {row.line}: output differs from run {source_run}'s "
                f"sample {row.case_id}#{row.sample_index}"
            )
        if row.label is None:
            continue
        verdict = label_verdict(row.label, labeller, row.note).with_safety(sample["safety"] or [])
        trace = SampleTrace(human=HumanLabel(labeller=labeller, source_run=source_run,
                                             label="pass" if row.label else "fail", note=row.note))
        out.append(
            {
                **sample,
                "run_id": run_id,
                "status": verdict.status.value,
                "passed": verdict.passed,
                "score": verdict.score,
                "detail": verdict.detail,
                "safety": list(verdict.safety),
                "trace": trace.to_json(),
                "duration_s": 0.0,
                "cached": False,
                # A key no planned sample can have: a label must never be served as the
                # cached result of the case's own grader.
                "cache_key": sha256_hex(
                    canonical_json(["human", sample["cache_key"], labeller, row.label])
                ),
            }
        )
    if not out:
        raise InputError(f"{where}: no labelled rows (every label is blank)")
    return pa.Table.from_pylist(out, schema=source.schema)
