"""Long outputs are stored once, in chunks, and read back whole and byte for byte wherever a
command reads them (docs/storage.md, "Large outputs"); a home from before opens and reads as
it did. The memory figures are bench/memory.py's."""

from __future__ import annotations

import pickle

import duckdb
import pytest
from support.judges import ref

from storage import db
from storage.store import Store
from tasks.agents.python import CallableAgent
from tasks.models import EvalCase, EvalSuite, Usage
from tasks.run import RunConfig, RunSpec, RunStatus, plan
from tasks.run.loop import local_stages, reuse_cached, run_loop
from tasks.run.rescore import rescore_plan
from tasks.run.sampling import Drawn
from tasks.run.stored import StoredOutput
from tasks.trace import SampleTrace

C = db.OUTPUT_CHUNK_CHARS
TEXTS = {
    "large": "".join(f"{i:07d}\n" for i in range(3 * C // 8 + 5)),  # three chunks and a bit
    # Characters of one, two, three and four UTF-8 bytes, a combining mark, and a pair that
    # a cut by bytes or UTF-16 units would split, across every chunk boundary.
    "unicode": ("aé€𝄞\u0301" * (C // 2))[: 2 * C + 3],
    "small": "yes",
    "small unicode": "naïve 𝄞",
    "empty": "",
    "exactly a chunk": "z" * C,
}
CASES = {name.replace(" ", "-"): text for name, text in TEXTS.items()}


def suite_of(references: dict[str, str]) -> EvalSuite:
    """Cases of CASES (the same question, whatever the reference) graded against `references`."""
    return EvalSuite(name="big", cases=[EvalCase(id=cid, inputs={"i": list(CASES).index(cid)}, reference=ref,
                                                 grader={"kind": "exact"}) for cid, ref in references.items()])


def answer(inputs, ctx) -> str:
    return list(CASES.values())[inputs["i"]]


def agent_of(func) -> CallableAgent:
    """An agent whose outputs the cache keys as one agent's, whatever `func` is."""
    return CallableAgent("callable:big", "big-agent", func)


def never(inputs, ctx) -> str:
    pytest.fail("the agent was called")


GRADED = {"passed": len(TEXTS)}  # each grader saw its whole output: each is its case's reference


def spec_for(suite: EvalSuite, run_config: RunConfig, agent=None, **extra) -> RunSpec:
    return RunSpec(suite_version=suite.version, suite_name=suite.name, agent=agent.spec if agent else "a",
                   agent_fingerprint=agent.fingerprint if agent else "a", n=run_config.n, ks=[1], seed=0,
                   regrade=run_config.regrade, **extra)


def run(store: Store, suite: EvalSuite, agent=None, **options):
    config = RunConfig(suite="big", agent="python:x:y", workers=2, **options)
    spec = spec_for(suite, config, agent)
    with local_stages(config) as stages:
        return spec, run_loop(spec, config, suite, agent, store, stages)


def chunk_rows(store: Store) -> int:
    with store.db.connect(read_only=True) as con:
        return con.execute("SELECT count(*) FROM output_chunks").fetchone()[0]


def stored_rows(store: Store, run_id: str) -> dict[str, tuple]:
    with store.db.connect(read_only=True) as con:
        return {cid: rest for cid, *rest in con.execute(
            "SELECT case_id, output, output_sha, output_head FROM samples WHERE run_id = ?", [run_id]).fetchall()}


@pytest.fixture
def drawn(tmp_path):
    """A run whose agent answered every text of TEXTS, each graded against itself."""
    store = Store(tmp_path / "home")
    suite = suite_of(CASES)
    store.snapshots.save(suite)
    agent = agent_of(answer)
    spec, summary = run(store, suite, agent)
    return store, suite, agent, spec, summary


def test_outputs_round_trip_byte_for_byte_and_only_long_ones_are_chunked(drawn, tmp_path):
    store, suite, _, spec, summary = drawn
    assert summary.status_counts == GRADED
    want = CASES
    for rows in (store.samples.of_run(spec.run_id).to_pylist(),
                 store.samples.of_cases([spec.run_id], list(want))):
        assert {r["case_id"]: r["output"] for r in rows} == want
    # Read when shown (`runs show --case`): a long one is a reference until then.
    shown = {c: r["output"] for c in want for r in store.samples.of_case(spec.run_id, c)}
    assert {c: isinstance(o, StoredOutput) for c, o in shown.items()} == {c: len(t) > C for c, t in want.items()}
    assert {c: str(o) for c, o in shown.items()} == want
    with store.db.connect(read_only=True) as con:
        assert dict(con.execute("SELECT case_id, output FROM sample_outputs").fetchall()) == want

    stored = stored_rows(store, spec.run_id)
    for cid, text in want.items():
        output, sha, head = stored[cid]
        assert (output is None) == (len(text) > C) and (sha is not None) == (len(text) > C), cid
        assert head == text[: db.OUTPUT_HEAD_CHARS]
    assert chunk_rows(store) == 4 + 3  # large: 3 chunks and a bit; unicode: 2 and a bit

    # A run file holds each output whole; imported into another home, the same bytes.
    out = store.exports.export_run(spec.run_id, tmp_path / "run.tar")
    other = Store(tmp_path / "other")
    other.exports.import_run(tmp_path / "run.tar")
    assert out["samples"] == len(TEXTS)
    assert {r["case_id"]: r["output"] for r in other.samples.of_run(spec.run_id).to_pylist()} == want


def test_a_cached_rerun_copies_references_and_a_regrade_reads_the_stored_text(drawn):
    store, suite, agent, spec, _ = drawn
    chunks = chunk_rows(store)
    again, summary = run(store, suite, agent)
    assert summary.cached_samples == len(TEXTS) and summary.status_counts == GRADED
    assert stored_rows(store, again.run_id) == stored_rows(store, spec.run_id)

    # New references: every output graded anew from the store, without the agent.
    changed = suite_of(dict.fromkeys(CASES, "other"))
    regraded, summary = run(store, changed, agent_of(never))
    assert summary.cached_samples == len(TEXTS)
    assert summary.status_counts == {"failed": len(TEXTS)}
    assert stored_rows(store, regraded.run_id) == stored_rows(store, spec.run_id)  # the same texts, referred to
    assert chunk_rows(store) == chunks  # stored once


def test_a_rescore_grades_long_outputs_read_when_graded(drawn):
    store, suite, _, spec, _ = drawn
    source = store.samples.of_run(spec.run_id, whole_outputs=False)
    long = [r for r in source.to_pylist() if r["output_sha"]]
    assert long and all(r["output"] is None for r in long)
    config = RunConfig(suite="big", agent="python:x:y", workers=2)
    new = spec_for(suite, config, agent_of(answer), config={"rescored_from": spec.run_id})
    rescoring = rescore_plan(new.run_id, plan(suite, new), suite, suite, spec.run_id, source, store.db)
    assert sum(isinstance(p.output, StoredOutput) for p in rescoring.to_grade) == len(long)
    with local_stages(config) as stages:
        summary = run_loop(new, config, suite, None, store, stages, rescoring=rescoring)
    assert summary.status_counts == GRADED


def test_a_drawn_long_output_is_stored_in_chunks_and_graded_by_the_next_run(tmp_path):
    store = Store(tmp_path / "home")
    suite = suite_of({"large": TEXTS["large"]})
    config = RunConfig(suite="big", agent="python:x:y")
    spec = spec_for(suite, config)
    store.runs.start(spec)
    (planned,) = plan(suite, spec)
    store.outputs.store_drawn(spec.run_id, [Drawn(planned, TEXTS["large"], Usage(input_tokens=3), SampleTrace())])
    store.runs.finish(spec.run_id, RunStatus.interrupted, None)
    with store.db.connect(read_only=True) as con:
        assert con.execute("SELECT output IS NULL, output_sha IS NOT NULL FROM outputs").fetchall() == [(True, True)]

    again = spec_for(suite, config)
    store.runs.start(again)
    (missing,) = reuse_cached(again, plan(suite, again), store)
    assert isinstance(missing.output, StoredOutput) and missing.output.text() == TEXTS["large"]
    assert missing.usage.input_tokens == 3


def test_runs_show_case_and_the_judges_commands_read_long_outputs_whole_one_at_a_time(drawn, tmp_path):
    """`runs show --case`, `labels export|import` and `compare` read each long output when
    they use it (bench/memory.py measures what they hold) and still see it whole."""
    import json

    from flows.judging import compare_runs, export_labels, import_labels
    from flows.output import json_doc
    from tasks.report.case_view import case_doc, case_text

    store, suite, agent, spec, _ = drawn
    doc = case_doc(spec.run_id, "large", store.samples.of_case(spec.run_id, "large"))
    assert json.loads(json_doc(doc))["samples"][0]["output"] == TEXTS["large"]
    assert f"({len(TEXTS['large'])} chars; --json has all)" in case_text(doc)

    out = tmp_path / "labels.jsonl"
    assert export_labels(spec.run_id, out, store) == len(TEXTS)
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert {r["case_id"]: r["output"] for r in rows} == CASES
    out.write_text("".join(json.dumps({**r, "label": "pass"}, ensure_ascii=False) + "\n" for r in rows),
                   encoding="utf-8")
    labelled = import_labels(spec.run_id, out, "ann", store)
    assert labelled["status_counts"] == {"passed": len(TEXTS)}
    assert stored_rows(store, labelled["run_id"]) == stored_rows(store, spec.run_id)  # the same texts, referred to

    # Run A's outputs are their cases' references, B's are not: a judge preferring the
    # reference picks A in both orders only if it was shown A's outputs whole.
    other, _ = run(store, suite, CallableAgent("callable:other", "other-agent", lambda inputs, ctx: "other"))
    doc = compare_runs(spec.run_id, other.run_id, ref("prefers_reference"), store=store)
    assert doc["wins_a"] == len(TEXTS) and doc["inconsistent"] == 0


def test_a_stored_output_travels_to_another_process_as_its_text(drawn):
    store, _, _, spec, _ = drawn
    sha = stored_rows(store, spec.run_id)["large"][1]
    assert pickle.loads(pickle.dumps(StoredOutput(sha, store.db))) == TEXTS["large"]


def test_a_home_from_before_chunks_opens_and_its_inline_outputs_read_and_serve_the_cache(tmp_path):
    store = Store(tmp_path / "home")
    suite = suite_of({"large": TEXTS["large"]})
    config = RunConfig(suite="big", agent="python:x:y")
    old = spec_for(suite, config, agent_of(answer))
    (planned,) = plan(suite, old)
    store.db.path.parent.mkdir(parents=True)
    before = [step.replace(", output_sha VARCHAR", "") for step in db.MIGRATIONS[:7]]
    assert not any("output_sha" in step for step in before)
    with duckdb.connect(str(store.db.path)) as con:  # the file as version 7 left it: long outputs inline
        con.execute("CREATE TABLE schema_version (version INTEGER); INSERT INTO schema_version VALUES (7)")
        for step in before:
            con.execute(step)
        con.execute("INSERT INTO runs (run_id, status) VALUES (?, 'completed')", [old.run_id])
        con.execute("INSERT INTO samples (run_id, case_id, sample_index, seed, output, status, passed, cache_key,"
                    " cached, case_hash, output_key, output_head) VALUES (?, 'large', 0, ?, ?, 'passed', true, ?,"
                    " false, ?, ?, left(?, 4096))",
                    [old.run_id, planned.seed, TEXTS["large"], planned.cache_key, planned.case_hash,
                     planned.output_key, TEXTS["large"]])

    assert store.samples.of_run(old.run_id)["output"].to_pylist() == [TEXTS["large"]]  # opens, migrated
    with duckdb.connect(str(store.db.path), read_only=True) as con:
        assert con.execute("SELECT version FROM schema_version").fetchall() == [(db.SCHEMA_VERSION,)]
        assert con.execute("SELECT output FROM sample_outputs").fetchall() == [(TEXTS["large"],)]
    agent = agent_of(never)
    _, summary = run(store, suite, agent)
    assert summary.cached_samples == 1 and summary.status_counts == {"passed": 1}
    regraded, summary = run(store, suite_of({"large": "other"}), agent)  # graded anew from the inline text
    assert summary.status_counts == {"failed": 1}
    assert store.samples.of_run(regraded.run_id)["output"].to_pylist() == [TEXTS["large"]]
