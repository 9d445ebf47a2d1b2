"""The judge, pairwise and human rungs from the command line (`evalpipe judge|compare|labels`).

Each command is a typer wrapper over a plain function of the same purpose
(`calibrate_judge`, `compare_runs`, `export_labels`, `import_labels`), which tests and
other flows call directly. `flows/cli/__init__.py` mounts the apps; as there, the storage
and core imports are inside the commands, so `evalpipe --help` loads neither DuckDB nor Arrow.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flows.output import json_doc
from tasks.models import InputError

if TYPE_CHECKING:
    from storage.store import Store
    from tasks.metrics.calibration import StoredRun
    from tasks.metrics.labels import LabelRow

judge_app = typer.Typer(
    no_args_is_help=True, help="Model judges: calibrate them before trusting them."
)
labels_app = typer.Typer(no_args_is_help=True, help="Human labels: export samples, import labels.")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document.")]
JudgeOpt = Annotated[
    str | None, typer.Option("--judge", help="MODULE:FUNC, path.py:FUNC or openai:MODEL.")
]
RubricOpt = Annotated[
    Path | None, typer.Option("--rubric", help="File with the prompt template (openai: judges).")
]
WORKERS = 4  # judge calls in flight: endpoint latency, not CPU, is what they wait on


def _run_suite(run: dict[str, Any], store: Store):
    if not store.snapshots.path(run["suite_version"]).exists():
        raise InputError(
            f"run {run['run_id']}: snapshot of suite {run['suite_version'][:12]} is missing"
        )
    return store.snapshots.read(run["suite_version"])


def _read_rubric(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--rubric {path}: cannot read: {exc}") from None


def _samples(store: Store, run_id: str, columns: list[str]) -> list[dict[str, Any]]:
    """The run's sample rows (`columns` and `output`), a long output as a `StoredOutput` read
    when it is used: a command over every output holds the few it is using, not all of them."""
    from tasks.run.stored import row_output

    rows = store.samples.of_run(run_id, [*columns, "output", "output_sha"], whole_outputs=False).to_pylist()
    return [{**row, "output": row_output(row, store.db)} for row in rows]


# --- calibration -------------------------------------------------------------------------


def calibrate_judge(
    suite: str,
    labels: Path,
    *,
    judge: str | None = None,
    rubric: str | None = None,
    samples: int | None = None,
    oracle: bool = False,
    grader: str | None = None,
    run: str | None = None,
    store: Store,
) -> dict[str, Any]:
    """Grade each labelled output with the judge and measure it against the truth: the
    human label, or with `oracle` the case's own (execution or assertion) grader.
    The judge is each case's grader named `grader` (a `judge` or `trajectory_judge`), else
    its own deciding `judge`; `judge`, `rubric` and `samples` override the case's. With
    `run` (the run the labels came from), each labelled sample is judged as that run stored
    it, trajectory included. The result is stored under the judge's fingerprint."""
    from storage.suites import load_suite_ref
    from tasks.metrics.calibration import judge_calibration
    from tasks.metrics.labels import labelled_run, read_labels

    overrides = {
        k: v
        for k, v in (("function", judge), ("rubric", rubric), ("samples", samples))
        if v is not None
    }
    rows = read_labels(labels, need_output=True)
    exported_from = labelled_run(rows, str(labels))
    if run is None and exported_from is not None and store.runs.get(exported_from) is not None:
        run = exported_from  # the run `labels export` wrote the file from, kept in this home
    elif run is not None and exported_from is not None and store.runs.find(run)["run_id"] != exported_from:
        raise InputError(f"{labels}: the labels were exported from run {exported_from}, not --run {run}")
    doc = judge_calibration(rows, load_suite_ref(suite, store.snapshots), overrides, oracle=oracle, where=str(labels),
                            workers=WORKERS, grader=grader,
                            run=None if run is None else _stored_run(store, run, rows))
    return store.calibrations.record(doc)


def _stored_run(store: Store, run_ref: str, rows: list[LabelRow]) -> StoredRun:
    """The labelled rows' samples as the run stored them: output and the agent's trace."""
    from tasks.metrics.calibration import StoredRun, StoredSample
    from tasks.run.stored import output_text
    from tasks.trace import SampleTrace

    run_id = store.runs.find(run_ref)["run_id"]
    wanted = {(r.case_id, r.sample_index) for r in rows}
    found = {
        key: StoredSample(output_text(s["output"]) or "", SampleTrace.parse(s["trace"]).agent_part())
        for s in _samples(store, run_id, ["case_id", "sample_index", "trace"])
        if (key := (s["case_id"], s["sample_index"])) in wanted
    }
    return StoredRun(run_id, found)


@judge_app.command("calibrate")
def calibrate_cmd(
    suite: Annotated[str, typer.Argument(help="Suite file or stored version.")],
    labels: Annotated[
        Path,
        typer.Option(
            "--labels", help="Labelled outputs (CSV or JSONL, as `labels export` writes)."
        ),
    ],
    judge: JudgeOpt = None,
    rubric: RubricOpt = None,
    samples: Annotated[
        int | None, typer.Option("--samples", min=1, help="Judge draws per output (J).")
    ] = None,
    oracle: Annotated[
        bool, typer.Option("--oracle", help="Truth from the cases' own graders, not the labels.")
    ] = False,
    grader: Annotated[
        str | None,
        typer.Option("--grader", help="The cases' judge grader of this name (a judge or trajectory_judge)."),
    ] = None,
    run: Annotated[
        str | None,
        typer.Option("--run", help="The run the labels came from: judge its stored samples (trajectories)."
                                   " Default: the run the label file names (its run_id column), when this home holds it."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Measure a judge against human labels (or an execution oracle): agreement, kappa,
    false-pass and false-fail rates with bootstrap CIs."""
    from storage.store import Store

    doc = calibrate_judge(
        suite, labels, judge=judge, rubric=_read_rubric(rubric), samples=samples, oracle=oracle,
        grader=grader, run=run, store=Store.default(),
    )
    from tasks.report.judging_text import calibration_text

    typer.echo(json_doc(doc) if as_json else calibration_text(doc))


# --- pairwise ----------------------------------------------------------------------------


def compare_runs(
    run_a: str,
    run_b: str,
    judge: str,
    *,
    rubric: str | None = None,
    workers: int = WORKERS,
    store: Store,
) -> dict[str, Any]:
    """Pairwise judgement of two runs' outputs for the same cases, in both orders."""
    from tasks.graders.judge import load_judge
    from tasks.metrics.pairwise import compare, pair_samples

    a, b = store.runs.find(run_a), store.runs.find(run_b)
    run_a, run_b = a["run_id"], b["run_id"]
    cases = {c.case_hash: c for c in _run_suite(a, store).cases}
    pairs = pair_samples(_samples(store, run_a, ["case_hash", "sample_index"]),
                         _samples(store, run_b, ["case_hash", "sample_index"]), cases)
    if not pairs:
        raise InputError(f"runs {run_a} and {run_b} share no (case, sample index) to compare")
    doc = compare(load_judge(judge, rubric), pairs, workers=workers, seed=a["seed"])
    return {
        "run_a": run_a,
        "run_b": run_b,
        "same_suite": a["suite_version"] == b["suite_version"],
        **doc,
    }


def compare(
    run_a: Annotated[str, typer.Argument(help="Run A.")],
    run_b: Annotated[str, typer.Argument(help="Run B.")],
    judge: Annotated[
        str, typer.Option("--judge", help="MODULE:FUNC, path.py:FUNC or openai:MODEL.")
    ],
    rubric: RubricOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Which run's outputs are better, case by case, asked in both orders: win rate of A
    with a CI, ties, and order-inconsistent pairs (position bias)."""
    from storage.store import Store

    doc = compare_runs(run_a, run_b, judge, rubric=_read_rubric(rubric), store=Store.default())
    from tasks.report.judging_text import pairwise_text

    typer.echo(json_doc(doc) if as_json else pairwise_text(doc))


# --- human labels ------------------------------------------------------------------------


def export_labels(run_id: str, out: Path, store: Store) -> int:
    """Write the run's samples for labelling; returns the number of rows."""
    from tasks.metrics.labels import export_rows, write_label_file

    run = store.runs.find(run_id)
    run_id = run["run_id"]
    cases = {c.id: c for c in _run_suite(run, store).cases}
    return write_label_file(export_rows(_samples(store, run_id, ["case_id", "sample_index"]), cases, run_id), out)


def import_labels(
    run_id: str, path: Path, labeller: str, store: Store
) -> dict[str, Any]:
    """Store the labels as a derived run of `human` verdicts on the same samples and
    aggregate it like any run. Returns its summary (the `run --json` keys and more)."""
    from tasks.metrics.labels import labelled_samples, read_labels
    from tasks.models import sha256_hex
    from tasks.run import RunStatus, summarize, summary_columns
    from tasks.run.labelled import labelled_spec, labelled_summary
    from tasks.run.stored import output_text, row_output

    started = time.perf_counter()
    source = store.runs.find(run_id)
    run_id = source["run_id"]
    suite = _run_suite(source, store)
    labels = read_labels(path)
    spec = labelled_spec(source, labeller=labeller, labels_file=str(path),
                         labels_sha256=sha256_hex(path.read_bytes()))
    rows = labelled_samples(
        store.samples.of_run(run_id, whole_outputs=False),
        labels,
        labeller=labeller,
        source_run=run_id,
        run_id=spec.run_id,
        where=str(path),
        text_of=lambda sample: output_text(row_output(sample, store.db)) or "",
    )
    with store.runs.recorded(spec):
        store.samples.insert(rows)
        summary, aggregates = summarize(spec, suite, store.samples.of_run(spec.run_id, summary_columns(spec, suite)))
        store.runs.write_aggregates(spec.run_id, aggregates)
        summary = labelled_summary(summary, source_run=run_id, labeller=labeller, labelled=rows.num_rows,
                                   labels=len(labels), duration_s=time.perf_counter() - started)
        store.runs.finish(spec.run_id, RunStatus.completed, summary)
    return summary.to_json()


@labels_app.command("export")
def export_cmd(
    run_id: Annotated[str, typer.Argument(help="The run whose samples to label.")],
    out: Annotated[Path, typer.Option("--out", help="File to write: .csv or .jsonl.")],
) -> None:
    """Write a run's samples (case, sample index, prompt, output, blank label) for labelling."""
    from storage.store import Store

    typer.echo(
        f"wrote {export_labels(run_id, out, Store.default())} samples to {out}; fill the label column with pass/fail"
    )


@labels_app.command("import")
def import_cmd(
    run_id: Annotated[str, typer.Argument(help="The run the labels belong to.")],
    file: Annotated[Path, typer.Argument(help="The filled label file (.csv or .jsonl).")],
    labeller: Annotated[
        str, typer.Option("--labeller", help="Who labelled (recorded on every sample).")
    ],
    as_json: JsonFlag = False,
) -> None:
    """Import labels as `human` verdicts in a new derived run, aggregated like any run."""
    from storage.store import Store

    summary = import_labels(run_id, file, labeller, Store.default())
    from tasks.report.judging_text import labelled_text

    typer.echo(json_doc(summary) if as_json else labelled_text(summary))
