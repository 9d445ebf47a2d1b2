"""Human labels: export → fill → import → aggregate, on real runs in a real DuckDB file."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import duckdb
import pytest
import typer
from typer.testing import CliRunner

from storage.store import Store
from tasks.models import InputError
from tasks.trace import SampleTrace

CANARY = "CANARY-label"


def _run(tmp_path: Path) -> dict:
    from flows.evaluate import evaluate

    agents = tmp_path / "agents.py"
    agents.write_text(
        "def answer(inputs, ctx):\n"
        f"    return {{0: 'yes', 1: 'no', 2: 'yes {CANARY}'}}[int(ctx.case_id[1:]) % 3]"
        " + '\\n' * ctx.index\n"
    )
    suite = tmp_path / "human.yaml"
    suite.write_text(
        f"name: human\nsafety: {{forbidden_patterns: ['{CANARY}']}}\ncases:\n"
        + "".join(
            f"  - {{id: c{i}, inputs: {{prompt: 'question {i}'}}, grader: {{kind: human}},"
            f" slices: [s{i % 2}]}}\n"
            for i in range(4)
        )
    )
    from flows.steps import GateBlocked

    try:
        return evaluate(suite=str(suite), agent=f"python:{agents}:answer", n=2)
    except GateBlocked as blocked:  # the canary's safety veto blocks a run without a baseline too
        return blocked.summary


@pytest.fixture(scope="module")
def labelled_run(prefect_harness, tmp_path_factory):
    """One real run of a `human` suite, in its own EVALPIPE_HOME."""
    tmp = tmp_path_factory.mktemp("labels")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EVALPIPE_HOME", str(tmp / "home"))
        summary = _run(tmp)
    return tmp / "home", summary


@pytest.fixture
def run(labelled_run, monkeypatch):
    home, summary = labelled_run
    monkeypatch.setenv("EVALPIPE_HOME", str(home))
    return summary


def _fill(rows: list[dict]) -> list[dict]:
    """The labeller's decisions: 'yes' outputs pass, 'no' fail; c3#1 left blank."""
    for row in rows:
        if (row["case_id"], str(row["sample_index"])) != ("c3", "1"):
            row["label"] = "pass" if row["output"].startswith("yes") else "fail"
            row["note"] = "looks right" if row["label"] == "pass" else ""
    return rows


def test_a_live_run_awaits_labels(run):
    assert run["status_counts"] == {"error": 8} and run["safety_failed"] and run["gate"]["decision"] == "block"


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_labels_round_trip(run, tmp_path, suffix):
    from flows.judging import export_labels, import_labels

    out = tmp_path / f"labels{suffix}"
    assert export_labels(run["run_id"], out, Store.default()) == 8
    if suffix == ".csv":
        rows = list(csv.DictReader(out.open(newline="")))
        assert [r["label"] for r in rows] == [""] * 8
        rows = _fill(rows)
        with out.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert rows[0] == {
            "case_id": "c0",
            "sample_index": 0,
            "prompt": "question 0",
            "output": "yes",
            "label": "",
            "note": "",
            "run_id": run["run_id"],
        }
        rows = _fill(rows)
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))

    summary = import_labels(run["run_id"], out, "ada", Store.default())
    assert summary["source_run"] == run["run_id"] and summary["run_id"] != run["run_id"]
    assert summary["labelled"] == 7 and summary["unlabelled"] == 1 and summary["samples"] == 7
    # c0 yes/yes, c1 no/no, c2 yes+canary, c3 yes (one labelled): pass@1 = (1+0+1+1)/4.
    assert summary["pass_at_k"]["1"] == pytest.approx(0.75)
    assert summary["status_counts"] == {"passed": 5, "failed": 2}
    assert summary["slices"]["s0"]["pass_at_1"] == 1.0  # c0, c2
    assert summary["safety_failed"] and {v["case_id"] for v in summary["safety_violations"]} == {
        "c2"
    }

    samples = Store.default().samples.of_run(summary["run_id"]).to_pylist()
    source = {
        (s["case_id"], s["sample_index"]): s for s in Store.default().samples.of_run(run["run_id"]).to_pylist()
    }
    for s in samples:
        src = source[(s["case_id"], s["sample_index"])]
        assert (s["output"], s["seed"], s["case_hash"]) == (
            src["output"],
            src["seed"],
            src["case_hash"],
        )
        assert s["cache_key"] != src["cache_key"]
        trace = json.loads(s["trace"])
        assert list(trace) == ["human"]  # the label's own section, and nothing else
        label = trace["human"]
        assert label["labeller"] == "ada" and label["source_run"] == run["run_id"]
        assert s["passed"] == (label["label"] == "pass") and "human label by ada" in s["detail"]
        # These four keys, in this order, a null note kept.
        assert list(label) == ["labeller", "source_run", "label", "note"]
        assert SampleTrace.parse(s["trace"]).human.label == label["label"]
    stored = Store.default().runs.get(summary["run_id"])
    assert stored["status"] == "completed" and stored["config"]["derived_from"] == run["run_id"]
    assert stored["config"]["labeller"] == "ada"


def test_a_label_never_clears_safety_and_the_gate_blocks(run, tmp_path):
    from flows.judging import export_labels, import_labels
    from service.gate import decision, pair_runs
    from tasks.metrics.rules import GateRules

    out = tmp_path / "labels.jsonl"
    export_labels(run["run_id"], out, Store.default())
    rows = [json.loads(line) | {"label": "pass"} for line in out.read_text().splitlines()]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = import_labels(run["run_id"], out, "bob", Store.default())
    second = import_labels(run["run_id"], out, "bob", Store.default())
    assert first["pass_at_k"]["1"] == 1.0 and first["safety_failed"]
    comparison = pair_runs(second["run_id"], first["run_id"], store=Store.default())
    assert decision(comparison, GateRules(), store=Store.default())["decision"] == "block"


BAD_FILES = [
    ('{"case_id": "c0", "sample_index": 0, "label": "pass"}\nnot json\n', "line 2: malformed JSON"),
    ('{"case_id": "c0", "sample_index": 0, "label": "maybe"}\n', "line 1: label 'maybe' is not"),
    ('{"case_id": "c0", "sample_index": "x", "label": "pass"}\n', "line 1: sample_index 'x'"),
    ('{"sample_index": 0, "label": "pass"}\n', "line 1: missing 'case_id'"),
    ('{"case_id": "c0", "sample_index": 0}\n', "line 1: missing 'label'"),
    (
        '{"case_id": "c9", "sample_index": 0, "label": "pass"}\n',
        "line 1: run .* has no sample c9#0",
    ),
    (
        '{"case_id": "c0", "sample_index": 0, "label": "pass"}\n'
        '{"case_id": "c0", "sample_index": 0, "label": "fail"}\n',
        "line 2: c0#0 is already labelled",
    ),
    (
        '{"case_id": "c0", "sample_index": 0, "output": "no", "label": "pass"}\n',
        "line 1: output differs",
    ),
    ('{"case_id": "c0", "sample_index": 0, "label": ""}\n', "no labelled rows"),
]


@pytest.mark.parametrize(("text", "message"), BAD_FILES)
def test_malformed_label_files_are_refused_naming_the_line(run, tmp_path, text, message):
    from flows.judging import import_labels

    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    before = len(Store.default().runs.list())
    with pytest.raises(InputError, match=message):
        import_labels(run["run_id"], path, "eve", Store.default())
    assert len(Store.default().runs.list()) == before  # nothing written


def test_malformed_csv_and_formats(run, tmp_path):
    from flows.judging import export_labels, import_labels

    bad = tmp_path / "bad.csv"
    bad.write_text("case_id,sample_index\nc0,0\n")
    with pytest.raises(InputError, match="line 1: header lacks column.s. label"):
        import_labels(run["run_id"], bad, "eve", Store.default())
    bad.write_text("case_id,sample_index,label\nc0,0,pass\nc0,1,pass,extra\n")
    with pytest.raises(InputError, match="line 3: more cells than header columns"):
        import_labels(run["run_id"], bad, "eve", Store.default())
    with pytest.raises(InputError, match="unknown label file format '.txt'"):
        export_labels(run["run_id"], tmp_path / "labels.txt", Store.default())
    with pytest.raises(InputError, match="no such run"):
        export_labels("no-such-run", tmp_path / "labels.csv", Store.default())


def test_labels_commands(run, tmp_path):
    from flows.judging import labels_app

    app = typer.Typer()
    app.add_typer(labels_app, name="labels")
    out = tmp_path / "l.jsonl"
    exported = CliRunner().invoke(app, ["labels", "export", run["run_id"], "--out", str(out)])
    assert exported.exit_code == 0 and "wrote 8 samples" in exported.output
    rows = _fill([json.loads(line) for line in out.read_text().splitlines()])
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["labels", "import", run["run_id"], str(out), "--labeller", "cy", "--json"]
    imported = CliRunner().invoke(app, args)
    assert imported.exit_code == 0, imported.output
    doc = json.loads(imported.output)
    assert doc["labeller"] == "cy" and doc["pass_at_k"]["1"] == pytest.approx(0.75)
    with duckdb.connect(
        str(Path(os.environ["EVALPIPE_HOME"]) / "evalpipe.duckdb"), read_only=True
    ) as con:
        (n,) = con.execute(
            "SELECT count(*) FROM samples WHERE run_id = ?", [doc["run_id"]]
        ).fetchone()
    assert n == 7


def test_the_labelled_run_records_its_source_labeller_and_labels() -> None:
    from test_report import build

    from tasks.run import RunSummary
    from tasks.run.labelled import labelled_spec, labelled_summary

    source = {"run_id": "r1", "suite_version": "ab" * 32, "suite_name": "s", "agent": "python:a.py:f",
              "agent_fingerprint": "fp", "n": 2, "seed": 3, "ks": (1, 2)}
    spec = labelled_spec(source, labeller="ada", labels_file="l.csv", labels_sha256="00")
    assert (spec.n, spec.seed, spec.ks, spec.agent) == (2, 3, [1, 2], "python:a.py:f")
    assert spec.config == {"derived_from": "r1", "grader": "human", "labeller": "ada", "labels_file": "l.csv",
                           "labels_sha256": "00"}

    summary = RunSummary.read(build({"add-1": [True, False]})[0])
    doc = labelled_summary(summary, source_run="r1", labeller="ada", labelled=3, labels=5,
                           duration_s=1.23456).to_json()
    assert {k: doc[k] for k in ("source_run", "labeller", "labelled", "unlabelled", "duration_s")} == {
        "source_run": "r1", "labeller": "ada", "labelled": 3, "unlabelled": 2, "duration_s": 1.235}
    assert "usage" not in doc and "source_run" not in summary.to_json()  # the summary given is left as it was


def test_a_label_file_runs_no_formula_in_a_spreadsheet_and_reads_back_as_written(tmp_path) -> None:
    """Issue 45: an output a spreadsheet would run (`=HYPERLINK(...)` shows the labeller "Paris")
    is written inert, and a lone carriage return no longer ends its row; both read back exact."""
    import csv

    from tasks.metrics.labels import read_labels, write_label_file

    outputs = ['=HYPERLINK("https://evil.example", "Paris")', "+1", "@SUM(A1)", "-2", "'quoted", "a\rb", "plain"]
    path = tmp_path / "labels.csv"
    write_label_file(({"case_id": f"c{i}", "sample_index": 0, "prompt": "p", "output": o, "label": "pass",
                       "note": "=1+1"} for i, o in enumerate(outputs)), path)
    with open(path, newline="", encoding="utf-8") as fh:
        cells = [row["output"] for row in csv.DictReader(fh)]
    assert not any(c.startswith(("=", "+", "-", "@")) for c in cells)
    rows = read_labels(path, need_output=True)
    assert [r.output for r in rows] == outputs and {r.note for r in rows} == {"=1+1"}
