"""How far to trust a judge: its verdicts against a truth (human labels or an execution oracle).

Four numbers, each with a percentile bootstrap CI clustered by case (outputs of one case
share its difficulty, so the case is the unit of resampling, as in `tasks.metrics.stats`):
- `agreement`: the fraction of outputs where judge and truth agree;
- `kappa`: Cohen's kappa, agreement corrected for what two raters with these pass rates
  would reach by chance (``(p_o - p_e) / (1 - p_e)``; undefined when ``p_e = 1``);
- `false_pass_rate`: P(judge passes | truth fails) — the judge letting bad outputs through;
- `false_fail_rate`: P(judge fails | truth passes).
A rate whose condition never occurs (no failing outputs at all) is null, not 0.

`judge_items` pairs each labelled output with its case and the judge to put it to;
`judge_calibration` puts them to the judge (and the oracle) and `measure` turns the judge's
and the truth's statuses into the calibration's figures. Reading the suite, the labels and
the labelled run's stored samples, and storing the result, are the caller's
(`flows/judging.py`).

A `trajectory_judge` reads what the agent did, not only its answer: it is calibrated on the
labelled samples as their run stored them (`StoredRun`: output and trajectory), so it is
shown exactly what it was shown when it graded them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from tasks.graders import grade, grader_fingerprint
from tasks.graders.judge import Judge, case_judge
from tasks.graders.trajectory import trajectory_fingerprint
from tasks.metrics.labels import LabelRow, same_text
from tasks.metrics.stats import DEFAULT_LEVEL, DEFAULT_N_BOOT, resampled_sums
from tasks.models import EvalCase, EvalSuite, InputError, canonical_json
from tasks.registry import grader_spec
from tasks.trace import SampleTrace

METRICS = ("agreement", "kappa", "false_pass_rate", "false_fail_rate")
LABEL_STATUS = {True: "passed", False: "failed"}
BINARY = ("passed", "failed")  # the statuses a calibration counts; any other is an error of its rater
JUDGE_KINDS = ("judge", "trajectory_judge")  # the graders a calibration measures


@dataclass(frozen=True)
class Calibration:
    items: int
    cases: int
    confusion: dict[str, int]  # tp, fp, fn, tn with the judge as the predictor
    values: dict[str, float | None]
    cis: dict[str, tuple[float, float] | None]
    level: float

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "items": self.items,
            "cases": self.cases,
            "confusion": dict(self.confusion),
            "ci_level": self.level,
        }
        for name in METRICS:
            doc[name] = self.values[name]
            doc[f"{name}_ci"] = None if self.cis[name] is None else list(self.cis[name])
        return doc


def _metrics(counts: NDArray[np.float64]) -> dict[str, NDArray[np.float64]]:
    """The four metrics from confusion counts; `counts[..., :]` is (tp, fp, fn, tn).
    Vectorized over leading axes (one row per bootstrap resample); NaN where undefined."""
    tp, fp, fn, tn = (counts[..., i] for i in range(4))
    total = tp + fp + fn + tn
    with np.errstate(divide="ignore", invalid="ignore"):
        observed = (tp + tn) / total
        judge_pass, truth_pass = (tp + fp) / total, (tp + fn) / total
        chance = judge_pass * truth_pass + (1 - judge_pass) * (1 - truth_pass)
        kappa = np.where(np.isclose(chance, 1.0), np.nan, (observed - chance) / (1 - chance))
        return {
            "agreement": observed,
            "kappa": kappa,
            "false_pass_rate": fp / (fp + tn),
            "false_fail_rate": fn / (fn + tp),
        }


def calibrate(
    judge: Sequence[bool],
    truth: Sequence[bool],
    case_ids: Sequence[str],
    *,
    seed: int = 0,
    n_boot: int = DEFAULT_N_BOOT,
    level: float = DEFAULT_LEVEL,
) -> Calibration:
    """Judge verdicts against truth, one entry per graded output, with case ids to cluster on."""
    j, t = np.asarray(judge, dtype=bool), np.asarray(truth, dtype=bool)
    if not (j.size == t.size == len(case_ids)):
        raise ValueError("judge, truth and case_ids must have one entry per output")
    if j.size == 0:
        raise ValueError("no labelled outputs to calibrate on")
    _, case_index = np.unique(np.asarray(case_ids, dtype=object), return_inverse=True)
    cell = np.stack([j & t, j & ~t, ~j & t, ~j & ~t], axis=1).astype(np.float64)
    per_case = np.zeros((case_index.max() + 1, 4))
    np.add.at(per_case, case_index, cell)
    total = per_case.sum(axis=0)

    m = per_case.shape[0]
    boot = _metrics(resampled_sums(per_case, np.random.default_rng(seed), n_boot))
    point = _metrics(total)
    alpha = (1 - level) / 2
    values: dict[str, float | None] = {}
    cis: dict[str, tuple[float, float] | None] = {}
    for name in METRICS:
        value = float(point[name])
        values[name] = None if np.isnan(value) else value
        draws = boot[name][~np.isnan(boot[name])]
        if values[name] is None or draws.size == 0:
            cis[name] = None
            continue
        lo, hi = np.quantile(draws, [alpha, 1 - alpha])
        cis[name] = (min(float(lo), value), max(float(hi), value))
    confusion = dict(zip(("tp", "fp", "fn", "tn"), (int(x) for x in total), strict=True))
    return Calibration(int(j.size), m, confusion, values, cis, level)


@dataclass(frozen=True)
class StoredSample:
    """A labelled sample as its run stored it."""

    output: str
    trace: SampleTrace  # the agent's part (`SampleTrace.agent_part`): its trajectory


@dataclass(frozen=True)
class StoredRun:
    """The run the labels were exported from: its samples by (case id, sample index)."""

    run_id: str
    samples: Mapping[tuple[str, int], StoredSample]


@dataclass(frozen=True)
class JudgeItem:
    row: LabelRow  # the labelled output
    case: EvalCase  # its case, whose own grader is the oracle
    judge_case: EvalCase  # the case graded by the judge under calibration
    stored: StoredSample | None = None  # the sample as its run stored it, when the run is given

    @property
    def output(self) -> str:
        return self.stored.output if self.stored is not None else self.row.output or ""

    def trace(self) -> SampleTrace:
        """A fresh trace for one grading (grading writes into it): what the agent did."""
        return self.stored.trace.agent_part() if self.stored is not None else SampleTrace()


def judge_items(rows: Sequence[LabelRow], suite: EvalSuite, overrides: Mapping[str, Any], *, oracle: bool,
                where: str, grader: str | None = None, run: StoredRun | None = None) -> list[JudgeItem]:
    """The outputs to calibrate on: each labelled row (every row with `oracle`, whose truth
    is the case's own grader) with its case of `suite` and that case graded by the judge:
    the case's grader named `grader` (else its deciding grader when that is a judge) with
    `overrides` (function, rubric, samples) over it. A row whose case has no grader named
    `grader` is left out. With `run`, each row is its stored sample (a trajectory judge needs
    it). `InputError` naming `where` and the line for a row no judge or oracle can grade."""
    items = []
    for row in rows:
        if not oracle and row.label is None:
            continue
        try:
            case = suite.case(row.case_id)
        except KeyError:
            raise InputError(f"{where}: line {row.line}: suite {suite.name} has no case {row.case_id!r}") from None
        if oracle and not grader_spec(case.kind).oracle:
            raise InputError(
                f"{where}: line {row.line}: case {case.id!r} has no execution oracle (its grader is {case.kind})"
            )
        own = _judge_grader(case, grader, f"{where}: line {row.line}")
        if own is None:
            continue
        if "function" not in own and "function" not in overrides:
            raise InputError(f"case {case.id!r}: no judge to calibrate (pass --judge)")
        judge_case = case.graded_by({**own, **overrides, "kind": own.get("kind", "judge")})
        if judge_case.kind == "trajectory_judge" and run is None:
            raise InputError(f"case {case.id!r}: a trajectory_judge judges the stored trajectory of each labelled"
                             " sample: pass --run RUN, the run the labels were exported from")
        items.append(JudgeItem(row, case, judge_case, None if run is None else _stored(row, run, where)))
    if not items:
        raise InputError(f"{where}: no labelled rows to calibrate on"
                         + (f" (no labelled case has a grader named {grader!r})" if grader else ""))
    return items


def _judge_grader(case: EvalCase, name: str | None, where: str) -> dict[str, Any] | None:
    """The judge grader of `case` to calibrate: the one named `name` (None when the case has
    none by that name), else the deciding grader when it is a judge, else none yet (`{}`:
    `--judge` says which)."""
    if name is None:
        return dict(case.grader) if case.kind in JUDGE_KINDS else {}
    named = dict(zip(case.grader_labels, (case.grader, *case.extra_graders), strict=True)).get(name)
    if named is not None and named["kind"] not in JUDGE_KINDS:
        raise InputError(f"{where}: case {case.id!r}: grader {name!r} is a {named['kind']} grader, not a judge")
    return None if named is None else dict(named)


def _stored(row: LabelRow, run: StoredRun, where: str) -> StoredSample:
    """The row's sample as `run` stored it; `InputError` when the run has no such sample or
    its output is not the one labelled."""
    if row.sample_index is None:
        raise InputError(f"{where}: line {row.line}: missing 'sample_index' (needed to find the sample in the run)")
    stored = run.samples.get((row.case_id, row.sample_index))
    if stored is None:
        raise InputError(f"{where}: line {row.line}: run {run.run_id} has no sample {row.case_id}#{row.sample_index}")
    if row.output is not None and not same_text(row.output, stored.output):
        raise InputError(f"{where}: line {row.line}: output differs from run {run.run_id}'s sample"
                         f" {row.case_id}#{row.sample_index}")
    return stored


def calibrated_judge(case: EvalCase) -> tuple[str, Judge]:
    """The judge grading `case` and the fingerprint its verdicts are recorded under (a
    trajectory judge's is its own: the same judge over outputs is another instrument)."""
    judge = case_judge(case)
    return (trajectory_fingerprint(judge.fingerprint) if case.kind == "trajectory_judge" else judge.fingerprint,
            judge)


def measure(items: Sequence[JudgeItem], verdicts: Sequence[tuple[str, str]], *, where: str) -> dict[str, Any]:
    """The calibration's figures from (judge status, truth status) per item: the rows, the
    judge's and the truth's errors (any status but passed/failed), and `calibrate` over the
    rows where both gave a pass/fail verdict."""
    judge_errors = sum(j not in BINARY for j, _ in verdicts)
    usable = [(item, j, t) for item, (j, t) in zip(items, verdicts, strict=True) if j in BINARY and t in BINARY]
    if not usable:
        raise InputError(f"{where}: the judge (or the oracle) gave no pass/fail verdict on any row")
    stats = calibrate(
        [j == "passed" for _, j, _ in usable],
        [t == "passed" for _, _, t in usable],
        [item.case.id for item, _, _ in usable],
    )
    return {
        "rows": len(verdicts),
        "judge_errors": judge_errors,
        "judge_error_rate": judge_errors / len(verdicts),
        "truth_errors": sum(t not in BINARY for _, t in verdicts),
        **stats.to_json(),
    }


def judge_calibration(rows: Sequence[LabelRow], suite: EvalSuite, overrides: Mapping[str, Any], *, oracle: bool,
                      where: str, workers: int, grader: str | None = None,
                      run: StoredRun | None = None) -> dict[str, Any]:
    """The calibration document (before it is stored): each labelled row of `rows` graded by
    the judge (`judge_items`: the grader named `grader`, each row its sample stored in `run`
    when given; `workers` judge calls in flight) against its truth, the human label or with
    `oracle` the case's own grader, and `measure`d. One judge only: cases naming several are
    bad input, as is a judge spec that does not load."""
    items = judge_items(rows, suite, overrides, oracle=oracle, where=where, grader=grader, run=run)
    # Resolved here, once and in this thread: a bad spec is bad input (not a column of
    # `error` verdicts), and user modules are loaded before the workers need them.
    graders = {canonical_json(i.judge_case.grader): i.judge_case for i in items}.values()
    judges = dict(map(calibrated_judge, graders))
    if len(judges) > 1:
        raise InputError(f"{where}: the cases use {len(judges)} different judges; pass --judge")
    ((fingerprint, the_judge),) = judges.items()
    if oracle:  # the oracle graders' own user code, likewise
        for case in {i.case.id: i.case for i in items}.values():
            grader_fingerprint(case)

    def judged(item: JudgeItem) -> tuple[str, str]:
        truth = grade(item.output, item.case, item.trace()).status.value if oracle else LABEL_STATUS[item.row.label]
        return grade(item.output, item.judge_case, item.trace()).status.value, truth

    with ThreadPoolExecutor(max_workers=workers) as pool:
        verdicts = list(pool.map(judged, items))
    labelled = sum(1 for r in rows if oracle or r.label is not None)
    return {
        "judge": the_judge.spec,
        "judge_fingerprint": fingerprint,
        "kind": items[0].judge_case.kind,
        **({"grader": grader} if grader else {}),
        **({"run": run.run_id} if run else {}),
        # labelled rows whose case has no grader of that name: not measured, and said so
        "rows_without_grader": labelled - len(items),
        "suite_version": suite.version,
        "suite_name": suite.name,
        "truth": "oracle" if oracle else "human",
        "labels": where,
        **measure(items, verdicts, where=where),
    }
