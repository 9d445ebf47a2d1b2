"""The typed trace (`tasks.trace.SampleTrace`): each section as its real writer records it,
stored in a real DuckDB file by a real run and parsed back; old-shape rows still render;
a registered grader's declared section lands typed under its kind."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel
from support.judges import ref

from evalpipe import evaluate
from flows.cli import main
from tasks import registry
from tasks.models import EvalCase, Status, Verdict
from tasks.trace import JudgeDraw, RegradeTrace, SampleTrace

LONG = "x" * 3000
PROGRAM = "    return x + 1\n"


def stored_traces(home: Path, run_id: str) -> dict[str, str]:
    """Each case's `samples.trace` text (one sample per case), read from the DuckDB file."""
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        return dict(con.execute("SELECT case_id, trace FROM samples WHERE run_id = ?", [run_id]).fetchall())


def answer(inputs, ctx) -> str:
    # A lone surrogate no encoding can store: the trace says it was replaced.
    return inputs["say"] + ("\ud800" if ctx.case_id == "judged" else "")


CASES = [
    {"id": "numeric", "inputs": {"say": "about 5.0"}, "reference": "5", "grader": {"kind": "numeric"}},
    {"id": "judged", "inputs": {"say": "yes"}, "reference": "yes",
     "grader": {"kind": "judge", "function": ref("says_yes"), "samples": 3},
     "extra_graders": [{"kind": "contains"}, {"kind": "judge", "function": ref("coin"), "samples": 2}]},
    {"id": "long", "inputs": {"say": LONG}, "reference": "x", "grader": {"kind": "contains"}},
    {"id": "program", "inputs": {"prompt": "def f(x):\n", "say": PROGRAM}, "reference": PROGRAM,
     "grader": {"kind": "python_tests", "entry_point": "f", "test": "def check(c):\n    assert c(1) == 2\n"}},
]


def test_each_section_round_trips_from_its_writer_through_the_store(home):
    summary = evaluate(CASES, answer, regrade=1, max_output_bytes=2000)
    traces = stored_traces(home, summary.run_id)
    parsed = {case_id: SampleTrace.parse(text) for case_id, text in traces.items()}
    # Parsed and stored again: the same text, byte for byte (what older readers read).
    assert {c: t.to_json() for c, t in parsed.items()} == traces

    for trace in parsed.values():  # the sampler's sections, on every sample
        assert trace.output.agent_s > 0 and trace.regrade == RegradeTrace(statuses=[Status.passed], env_flaky=False)

    numeric = parsed["numeric"].grader_steps
    assert [(s.numeric.parsed, s.numeric.reference) for s in numeric] == [(5.0, 5.0)]

    judged = parsed["judged"]
    assert judged.output.replaced_chars == 1
    assert judged.judge.spec == ref("says_yes") and len(judged.judge.fingerprint) == 64
    assert judged.judge.passes == 3 and judged.judge.agreement == 1.0 and judged.judge.errors == 0
    assert all(isinstance(d, JudgeDraw) and d.passed and d.rationale == "r" for d in judged.judge.draws)
    assert judged.judge.seeds == [d.seed for d in judged.judge.draws]
    contains, coin = judged.extra_graders
    assert (contains.kind, contains.verdict.status, contains.trace) == ("contains", Status.passed, None)
    assert coin.kind == "judge" and coin.trace.judge.spec == ref("coin") and len(coin.trace.judge.draws) == 2
    assert coin.verdict.passed == (coin.trace.judge.passes == 2)
    # The stored shape: one key per writer, in the order they write; the extra graders'
    # verdicts flat beside their kind.
    raw = json.loads(traces["judged"])
    assert list(raw) == ["output", "judge", "extra_graders", "regrade"]
    assert list(raw["output"]) == ["replaced_chars", "agent_s"] and list(raw["regrade"]) == ["statuses", "env_flaky"]
    assert list(raw["judge"]) == ["spec", "fingerprint", "seeds", "draws", "passes", "errors", "agreement"]
    assert list(raw["extra_graders"][0]) == ["kind", "passed", "score", "status", "detail", "safety"]
    # A second unnamed grader of the deciding one's kind is labelled apart (`judge#2`).
    assert list(raw["extra_graders"][1]) == ["kind", "name", "passed", "score", "status", "detail", "safety", "trace"]
    assert raw["extra_graders"][1]["name"] == coin.label == "judge#2"

    assert parsed["long"].output.truncated.cap_bytes == 2000 and parsed["long"].output.truncated.bytes == 3000

    program = parsed["program"].python_tests
    assert program.completed and program.returncode == 0 and program.isolation in ("bwrap", "rlimits")

    # The SQL that reads a key of the stored JSON (storage/calibrations.py) still finds it.
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        (fingerprint,), = con.execute("SELECT json_extract_string(trace, '$.judge.fingerprint') FROM samples"
                                      " WHERE case_id = 'judged'").fetchall()
    assert fingerprint == judged.judge.fingerprint


# A trace as an older evalpipe stored it: a coding agent's run and trajectory, the draw's
# time and the labeller stored flat (before they had a section each), a judge that was an
# extra grader, and a key no section models.
OLD_TRACE = {
    "agent_run": {"returncode": 0, "duration_s": 1.5, "isolation": "bwrap", "stdout_tail": "done\n",
                  "stderr_tail": ""},
    "trajectory": {"steps": 2, "entries": [{"tool": "bash", "input": "ls", "output": "README"},
                                           {"role": "assistant", "content": "no fix found"}],
                   "truncated": {"cap_bytes": 100, "bytes": 5000}},
    "workspace": {"files": []},
    "agent_s": 1.6,
    "extra_graders": [{"kind": "judge", "passed": False, "score": 0.0, "status": "failed", "detail": "no",
                       "safety": [], "trace": {"judge": {"spec": "s", "fingerprint": "f"}}}],
    "labeller": "ada",
    "kept": {"by": "a newer evalpipe"},
}


def test_an_old_shape_trace_in_the_store_still_renders(home, capsys, tmp_path):
    cases = [{"id": "q", "inputs": {"say": "no"}, "reference": "yes", "grader": {"kind": "exact"}}]
    base = evaluate(cases, lambda inputs, ctx: "yes")
    summary = evaluate(cases, answer)  # fails where the base passed: the diff report expands q
    old = json.dumps(OLD_TRACE)
    with duckdb.connect(str(home / "evalpipe.duckdb")) as con:
        con.execute("UPDATE samples SET trace = ? WHERE run_id = ?", [old, summary.run_id])

    assert main(["runs", "show", summary.run_id, "--case", "q"]) == 0
    shown = capsys.readouterr().out
    assert "trajectory: 2 step(s)" in shown and "1. tool bash: ls -> README" in shown
    assert "2. model: no fix found" in shown and "[trajectory cut at 100 of its 5000 bytes]" in shown
    assert main(["runs", "show", summary.run_id, "--case", "q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"][0]["trace"] == OLD_TRACE  # as stored

    out = tmp_path / "report.html"
    assert main(["report", summary.run_id, "--out", str(out)]) == 0
    assert "tool bash: ls -&gt; README" in out.read_text()
    assert main(["report", summary.run_id, "--baseline", base.run_id, "--out", str(out)]) == 0
    assert "no fix found" in out.read_text()  # the trajectory beside the regressed output

    parsed = SampleTrace.parse(old)
    assert parsed.output.agent_s == 1.6 and parsed.human.labeller == "ada"  # flat keys, in their sections
    assert list(parsed.to_dict()) == ["agent_run", "trajectory", "workspace", "output", "extra_graders", "human",
                                      "kept"]  # stored again in the writers' order, an unknown key kept
    assert parsed.extra_graders[0].trace.judge.draws == []  # a key it lacks is the default


def test_a_section_that_does_not_fit_is_left_out_and_the_rest_read():
    parsed = SampleTrace.parse('{"trajectory": "garbled", "agent_s": 2.0, "env_flaky": true}')
    assert parsed.trajectory is None and parsed.output.agent_s == 2.0 and parsed.regrade.env_flaky is True
    assert SampleTrace.parse(None) == SampleTrace.parse("[]") == SampleTrace()


class WordsParams(BaseModel):
    pass


class WordsTrace(BaseModel):
    words: int = 0
    longest: str = ""


@pytest.fixture
def wordy(monkeypatch):
    """A grader registered for this test, declaring its trace section."""
    monkeypatch.setattr(registry, "_GRADERS", dict(registry._GRADERS))  # undone after the test

    @registry.grader("wordy", params=WordsParams, trace=WordsTrace)
    def wordy_grader(output: str, case: EvalCase, params: WordsParams, *, trace: WordsTrace) -> Verdict:
        if output:  # an empty output records nothing
            trace.words = len(output.split())
            trace.longest = max(output.split(), key=len)
        return Verdict.ok() if trace.words >= 3 else Verdict.fail(Status.failed, "too short")


def test_a_registered_graders_declared_section_lands_typed_under_its_kind(home, wordy):
    cases = [
        {"id": "decides", "inputs": {"say": "three short words"}, "reference": "", "grader": {"kind": "wordy"}},
        {"id": "beside", "inputs": {"say": "yes indeed"}, "reference": "yes", "grader": {"kind": "contains"},
         "extra_graders": [{"kind": "wordy"}]},
        {"id": "silent", "inputs": {"say": ""}, "reference": "", "grader": {"kind": "wordy"}},
    ]
    summary = evaluate(cases, answer)
    traces = stored_traces(home, summary.run_id)
    parsed = {case_id: SampleTrace.parse(text) for case_id, text in traces.items()}

    assert parsed["decides"].section("wordy", WordsTrace) == WordsTrace(words=3, longest="three")
    assert json.loads(traces["decides"])["wordy"] == {"words": 3, "longest": "three"}
    (extra,) = parsed["beside"].extra_graders
    assert extra.verdict.status is Status.failed
    assert extra.trace.section("wordy", WordsTrace) == WordsTrace(words=2, longest="indeed")
    # Left at its default, the section is not stored at all.
    assert "wordy" not in json.loads(traces["silent"]) and parsed["silent"].section("wordy", WordsTrace) is None


def test_a_trace_model_the_registry_cannot_store_is_refused_at_registration(monkeypatch):
    monkeypatch.setattr(registry, "_GRADERS", dict(registry._GRADERS))

    class Required(BaseModel):
        words: int

    def takes(output, case, params, *, trace): ...

    with pytest.raises(ValueError, match="needs a default for every field"):
        registry.grader("needs", params=WordsParams, trace=Required)(takes)
    with pytest.raises(ValueError, match="names a built-in trace section"):
        registry.grader("trajectory", params=WordsParams, trace=WordsTrace)(takes)
    with pytest.raises(ValueError, match="already registered"):
        registry.grader("steps", params=WordsParams, trace=WordsTrace)(takes)
    with pytest.raises(ValueError, match="must be a pydantic model class"):
        registry.grader("plain", params=WordsParams, trace=dict)(takes)
    with pytest.raises(ValueError, match="takes no `trace` parameter"):
        registry.grader("deaf", params=WordsParams, trace=WordsTrace)(lambda output, case, params: None)
    assert not {"needs", "trajectory", "plain", "deaf"} & registry.grader_kinds()
    assert registry.grader_spec("steps").fn.__module__ == "tasks.graders.trajectory"  # the built-in kind, kept


def test_an_undeclared_graders_dict_lands_at_the_top_level_checked_where_it_names_a_section(monkeypatch):
    from tasks.graders import grade

    monkeypatch.setattr(registry, "_GRADERS", dict(registry._GRADERS))

    @registry.grader("loose", params=WordsParams)
    def loose(output: str, case: EvalCase, params: WordsParams, *, trace: dict) -> Verdict:
        trace.update(json.loads(output))
        return Verdict.ok()

    case = EvalCase(id="c", reference="", grader={"kind": "loose"})
    trace = SampleTrace()
    assert grade('{"words": 4, "steps": ["counted"]}', case, trace).passed
    assert trace.steps == ["counted"] and trace.to_dict() == {"words": 4, "steps": ["counted"]}
    # A key that names a section must fit it: what does not is the grader's error, not a bad row.
    verdict = grade('{"env_flaky": "sometimes"}', case, trace := SampleTrace())  # stored flat before `regrade`
    assert verdict.status is Status.error and "env_flaky" in verdict.detail and trace.to_dict() == {}


def test_grade_given_a_plain_dict_fills_it_as_the_trace_is_stored():
    # Scripts and benches written against the untyped trace pass a dict and read keys back.
    from tasks.graders import grade

    case = EvalCase(id="c", reference="4", grader={"kind": "exact"},
                    extra_graders=[{"kind": "numeric"}])
    typed, plain = SampleTrace(), {}
    assert grade("4", case, typed) == grade("4", case, plain)
    assert plain == typed.to_dict() and plain["extra_graders"][0]["kind"] == "numeric"


def old_shape(trace: dict) -> dict:
    """`trace` as evalpipe stored it before the output's bounding, repo_tests, `--regrade`
    and labels had a section each: their keys flat, where the section is now."""
    flat: dict = {}
    for key, value in trace.items():
        if key == "output":
            flat.update({k if k == "agent_s" else f"output_{k}": v for k, v in value.items()})
        elif key in ("repo_tests", "human"):
            flat.update(value)
        elif key == "regrade":
            flat.update(regrade=value["statuses"], env_flaky=value["env_flaky"])
        elif key == "extra_graders":
            flat[key] = [{**g, "trace": old_shape(g["trace"])} if "trace" in g else g for g in value]
        else:
            flat[key] = value
    return flat


FLAT_KEYS = {"output_replaced_chars", "output_redacted", "output_truncated", "agent_s", "timings", "steps",
             "environment", "edited_files", "test_run", "tests", "env_flaky", "labeller", "source_run", "label",
             "note"}


def test_a_home_written_before_sections_shows_what_it_showed(home, calc_repo, capsys, tmp_path):
    from flows.judging import export_labels, import_labels
    from storage.store import Store
    from tasks.suites.dataset import load_suite

    path, _ = calc_repo
    fix = load_suite(Path(__file__).parents[1] / "examples/calc/calc.yaml").case("add-bug")
    cases = [
        {"id": "add-bug", "inputs": {"say": fix.reference}, "reference": fix.reference,
         "grader": {**fix.grader, "repo": str(path)},
         "extra_graders": [{"kind": "repo_tests", **fix.grader, "repo": str(path)}]},
        # A replaced character fails `exact`; the extra grader every sample must pass blocks the gate.
        {"id": "judged", "inputs": {"say": "yes"}, "reference": "yes", "grader": {"kind": "exact"},
         "extra_graders": [{"kind": "exact", "must_pass": True}]},
        {"id": "long", "inputs": {"say": LONG}, "reference": "x", "grader": {"kind": "contains"}},
    ]
    base = evaluate(cases, lambda inputs, ctx: inputs["say"], max_output_bytes=2000).run_id
    run = evaluate(cases, answer, regrade=1, max_output_bytes=2000).run_id
    store, labels = Store.default(), tmp_path / "labels.jsonl"
    export_labels(run, labels, store)
    rows = [{**json.loads(line), "label": "pass", "note": "ok"} for line in labels.read_text().splitlines()]
    labels.write_text("".join(json.dumps(r) + "\n" for r in rows))
    labelled = import_labels(run, labels, "ada", store)["run_id"]

    def shown() -> dict[str, tuple[int, str]]:
        """What a user reads of the home: each command's exit status and output."""
        seen = {}
        for args in (["runs", "show", run], ["runs", "show", labelled], ["runs", "list"],
                     *(["runs", "show", run, "--case", c["id"], *json_] for c in cases for json_ in ([], ["--json"])),
                     ["runs", "show", labelled, "--case", "judged", "--json"],
                     ["diff", run, base], ["diff", run, base, "--json"], ["diff", labelled, run, "--json"],
                     ["gate", run, "--baseline", base, "--min-pass-at-1", "0", "--json"],
                     ["gate", labelled, "--baseline", base, "--min-pass-at-1", "0", "--json"]):
            code = main(args)
            seen[" ".join(args)] = (code, capsys.readouterr().out)
        for name, args in (("report", []), ("diff report", ["--baseline", base])):
            out = tmp_path / f"{name}.html"
            code = main(["report", run, "--out", str(out), *args])
            seen[name] = (code, capsys.readouterr().out + out.read_text())
        return seen

    written = shown()
    with duckdb.connect(str(home / "evalpipe.duckdb")) as con:
        stored = con.execute("SELECT run_id, case_id, sample_index, trace FROM samples").fetchall()
        new = [json.loads(t) for *_, t in stored]
        # A run writes sections only: none of the keys that used to sit at the top level.
        assert not any(FLAT_KEYS & set(t) or any(FLAT_KEYS & set(g.get("trace", {})) for g in t.get("extra_graders", ()))
                       for t in new)
        assert {"output", "repo_tests", "regrade", "human"} <= {key for t in new for key in t}
        assert any("repo_tests" in g.get("trace", {}) for t in new for g in t.get("extra_graders", ()))
        old = {tuple(key): json.dumps(old_shape(t)) for (*key, _), t in zip(stored, new, strict=True)}
        for (run_id, case_id, index), text in old.items():
            con.execute("UPDATE samples SET trace = ? WHERE run_id = ? AND case_id = ? AND sample_index = ?",
                        [text, run_id, case_id, index])

    # The same home as an older evalpipe left it: read into the sections it has now...
    for (*key, _), trace in zip(stored, new, strict=True):
        assert json.loads(SampleTrace.parse(old[tuple(key)]).to_json()) == trace
    # ... and every command shows what it showed; `--json` prints each trace as stored.
    before = shown()
    for command, (code, out) in written.items():
        if "--case" not in command or "--json" not in command:
            assert before[command] == (code, out), command
            continue
        then, now = json.loads(out), json.loads(before[command][1])
        traces = [s.pop("trace") for s in now["samples"]]
        assert traces == [old_shape(s.pop("trace")) for s in then["samples"]]  # as stored: flat
        assert now == then

    # An export carries the traces as they are stored.
    exported = tmp_path / "run.tar"
    assert main(["runs", "export", run, "--out", str(exported)]) == 0
    with tarfile.open(exported) as tar:
        samples = pq.read_table(tar.extractfile("samples.parquet")).to_pylist()
    assert {(run, s["case_id"], s["sample_index"]): s["trace"] for s in samples} == {
        key: text for key, text in old.items() if key[0] == run}
