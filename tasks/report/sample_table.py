"""A run's samples as the tables its Prefect flow-run page shows (published by
`flows/artifacts.py`): one row per case of the run (`case_overview`), and, for the failing
and flaky cases only (`cases_to_show`, at most MAX_CASE_TABLES), one row per sample
(`sample_rows`): its status, which grader failed and why, tokens, latency and the first
lines of its output, each cell shortened; and, for the first MAX_TIMELINES of those cases, the
timeline of the first failing sample's trajectory as Markdown (`timeline_section`,
`timelines_markdown`). Plain functions of the stored sample rows, so they are tested without
Prefect; also the flow runs' names (`flow_run_name`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import PurePath
from typing import Any

from tasks.report.html import clip
from tasks.report.inert import code_span, longest_backticks
from tasks.report.trajectory import STEP_CHARS, trajectory_lines
from tasks.run.usage import latency_text
from tasks.trace import SampleTrace
from tasks.trajectory import call_text

MAX_CASE_TABLES = 50  # failing or flaky cases given a table of their own; the summary counts the rest
DETAIL_CHARS = 300  # a grader's detail in a cell
OUTPUT_LINES = 3  # the first lines of an output in a cell
OUTPUT_CHARS = 200
CELL_CHARS = 80  # a case id or a grader's label
MAX_OVERVIEW_ROWS = 1000  # the cases table: the failing and flaky first, then the rest up to this
MAX_SAMPLE_ROWS = 100  # a case's table: the samples a grader failed first, then the rest up to this
MAX_TIMELINES = 10  # failing or flaky cases whose first failing sample's timeline is shown
FOLD_CHARS = 160  # of a step in the timeline; a longer one is cut there, and shown longer folded below
TIMELINE_HEAD, TIMELINE_TAIL = 30, 10  # the first and last steps shown of a longer trajectory
# What `case_overview` reads of each sample: no output, no trace (gigabytes for a large run).
OVERVIEW_COLUMNS = ("case_id", "sample_index", "status", "passed", "detail", "safety")


@dataclass(frozen=True)
class CaseTally:
    """One case of a run: its samples and passes, and its first failing sample's index,
    status and detail (None when every sample passed)."""

    case_id: str
    n: int
    passed: int
    first_failing: tuple[int, str, str] | None

    @property
    def failing(self) -> bool:
        return self.passed == 0 and self.n > 0

    @property
    def flaky(self) -> bool:
        return 0 < self.passed < self.n


def tally(samples: Iterable[Mapping[str, Any]]) -> list[CaseTally]:
    """One `CaseTally` per case, in case id order, from sample rows (`OVERVIEW_COLUMNS`,
    in (case, index) order as the store gives them)."""
    found: dict[str, list[Any]] = {}
    for row in samples:
        case = found.setdefault(row["case_id"], [0, 0, None])
        case[0] += 1
        if row["passed"]:
            case[1] += 1
        elif case[2] is None:
            case[2] = (row["sample_index"], row["status"], row["detail"] or "")
    return [CaseTally(cid, n, c, first) for cid, (n, c, first) in sorted(found.items())]


def cases_to_show(tallies: Sequence[CaseTally], limit: int = MAX_CASE_TABLES) -> tuple[list[CaseTally], int]:
    """The failing and flaky cases a table each is published for, the worst first (fewest
    passes out of n, then case id), at most `limit`; and how many more there were."""
    wanted = sorted((t for t in tallies if t.failing or t.flaky), key=lambda t: (t.passed / t.n, t.case_id))
    return wanted[:limit], max(0, len(wanted) - limit)


def case_overview(tallies: Sequence[CaseTally], kinds: Mapping[str, str],
                  limit: int = MAX_OVERVIEW_ROWS) -> list[dict[str, Any]]:
    """The run-level table: one row per case (`kinds`: case id → its deciding grader's kind),
    the failing and flaky first (fewest passes first), then by case id; at most `limit` rows."""
    ordered = sorted(tallies, key=lambda t: (t.passed == t.n, t.passed / t.n if t.n else 1.0, t.case_id))
    rows = []
    for t in ordered[:limit]:
        first = t.first_failing
        rows.append({
            "case": clip(t.case_id, CELL_CHARS),
            "passed": f"{t.passed}/{t.n}",
            "result": "failing" if t.failing else "flaky" if t.flaky else "passing",
            "failing grader": clip(kinds.get(t.case_id, "?"), CELL_CHARS) if first else "",
            "first failure": f"sample {first[0]} ({first[1]}): {shorten(first[2], DETAIL_CHARS)}" if first else "",
        })
    return rows


def failed_graders(sample: Mapping[str, Any], kind: str | None) -> list[tuple[str, str]]:
    """(label, detail) of each grader that failed a sample: the deciding one (`kind`, the
    case's grader) when the sample did not pass, each extra grader (its `name`, else its
    kind) whose verdict did not pass, as the sample's trace records them; then its safety
    violations, if any, as `safety`."""
    found = []
    if not sample.get("passed"):
        found.append((kind or "grader", sample.get("detail") or ""))
    trace = sample.get("trace")
    extra = (trace if isinstance(trace, SampleTrace) else SampleTrace.parse(trace)).extra_graders or []
    found += [(g.label, g.verdict.detail or "") for g in extra if not g.verdict.passed]
    if safety := list(sample.get("safety") or []):
        found.append(("safety", "; ".join(safety)))
    return found


def sample_rows(samples: Iterable[Mapping[str, Any]], kind: str | None,
                limit: int = MAX_SAMPLE_ROWS) -> list[dict[str, Any]]:
    """One case's table: a row per sample (stored sample rows with `output` as text, in
    index order; `kind`: the case's deciding grader), at most `limit` of them, in index
    order: those some grader failed first, then the others."""
    rows = _rows(samples, kind)
    if len(rows) <= limit:
        return rows
    kept = sorted(range(len(rows)), key=lambda i: (not rows[i]["failed"], i))[:limit]
    return [rows[i] for i in sorted(kept)]


def _rows(samples: Iterable[Mapping[str, Any]], kind: str | None) -> list[dict[str, Any]]:
    rows = []
    for s in samples:
        trace = s.get("trace")
        trace = trace if isinstance(trace, SampleTrace) else SampleTrace.parse(trace)
        failed = failed_graders({**s, "trace": trace}, kind)
        rows.append({
            "sample": s["sample_index"],
            "status": s["status"],
            "failed": ", ".join(clip(label, CELL_CHARS) for label, _ in failed),
            "detail": shorten(failed[0][1], DETAIL_CHARS) if failed else "",
            "output": first_lines(s.get("output") or "", OUTPUT_LINES, OUTPUT_CHARS),
            "actions": actions(trace),
            "tokens": tokens(s.get("input_tokens"), s.get("output_tokens")),
            "latency": seconds(s.get("latency_s")),
        })
    return rows


def actions(trace: SampleTrace) -> str:
    """What the agent did, in a cell: its model turns and each tool call in order, a failed one
    marked (`3 turns: get_order({...}), refund_order({...}) ✗`); "" without a trajectory."""
    if trace.trajectory is None:
        return ""
    steps = trace.trajectory.typed
    calls = [call_text(a.name, a.call.arguments) + (" ✗" if a.result is not None and a.result.error else "")
             for a in steps.actions()]
    stop = f" (stopped: {trace.trajectory.stop})" if trace.trajectory.stop else ""
    return clip(f"{len(steps.turns)} turns{stop}" + (": " + ", ".join(calls) if calls else ""), DETAIL_CHARS)


def shorten(text: str, limit: int) -> str:
    """`text` on one line (its line breaks as ' ⏎ '), cut to `limit` characters."""
    return clip(" ⏎ ".join(line.strip() for line in str(text).splitlines() if line.strip()), limit)


def first_lines(text: str, lines: int, limit: int) -> str:
    """The first `lines` non-blank lines of `text`, on one line, cut to `limit`; a cut marked."""
    kept = [line.rstrip() for line in str(text).splitlines() if line.strip()]
    shown = " ⏎ ".join(kept[:lines])
    if len(kept) > lines:
        shown += " ⏎ …"
    return clip(shown, limit)


def tokens(input_tokens: int | None, output_tokens: int | None) -> str:
    """'in+out' tokens, or '' when the agent reported none."""
    if input_tokens is None and output_tokens is None:
        return ""
    return f"{input_tokens or 0:,}+{output_tokens or 0:,}"


def seconds(value: float | None) -> str:
    """A latency in the unit it fits in three digits of (µs, ms, s), or ''."""
    return latency_text(value)


def short_run_id(run_id: str) -> str:
    """The unique suffix of a run id (`20261206-074012-889c34` → `889c34`), which the CLI
    takes for the run."""
    return run_id.rsplit("-", 1)[-1]


def flow_run_name(suite: str, agent: str | None, n: int, run_id: str) -> str:
    """An `evaluate` flow run's name once its run id is known: suite, agent (`short_agent`), n
    and the run."""
    return f"{suite} · {short_agent(agent or '')} · n={n} · {short_run_id(run_id)}"


def short_agent(spec: str) -> str:
    """An agent spec as a name shows it: each path in it by its last part
    (`python:/home/me/agents/qa.py:answer` → `python:qa.py:answer`), cut to CELL_CHARS."""
    words = [":".join(PurePath(part).name if "/" in part else part for part in word.split(":"))
             for word in spec.split(" ")]
    return clip(" ".join(words), CELL_CHARS)


def rescore_run_name(suite_ref: str, source_run: str, run_id: str | None = None) -> str:
    """A `rescore` flow run's name: the suite, the run whose outputs it grades, and (once
    known) its own run."""
    own = f" · {short_run_id(run_id)}" if run_id else ""
    return f"{PurePath(suite_ref).stem or suite_ref} · rescore of {short_run_id(source_run)}{own}"


def samples_note(run_id: str, shown: int, left_out: int, cases: int) -> str:
    """The summary artifact's lines about the sample tables: how many cases have one, how
    many failing or flaky cases were left without, and the command that writes the HTML report."""
    listed = (f"all {cases} cases" if cases <= MAX_OVERVIEW_ROWS
              else f"{MAX_OVERVIEW_ROWS} of {cases} cases (the failing and flaky first)")
    lines = ["", f"Samples: the `cases` table lists {listed}; "
                 f"{shown} failing or flaky case(s) have a table of their samples"
                 + (f" ({left_out} more failing or flaky case(s) left out: `evalpipe runs show {run_id} --case ID`)"
                    if left_out else "") + ".",
             "", f"HTML report: `evalpipe report {run_id} --out report-{short_run_id(run_id)}.html`"]
    return "\n".join(lines) + "\n"


def case_description(case_id: str, tallied: CaseTally, kind: str | None, run_id: str) -> str:
    """A case table's description (Markdown): the case, its passes and grader, the run, and
    how many samples the table leaves out."""
    cid = case_id.replace("`", "'")
    cut = (f"; the table shows {MAX_SAMPLE_ROWS} of its {tallied.n} samples, those a grader failed first"
           if tallied.n > MAX_SAMPLE_ROWS else "")
    return (f"case `{clip(cid, CELL_CHARS)}`: {tallied.passed}/{tallied.n} samples passed"
            f" ({'failing' if tallied.failing else 'flaky'}), grader `{kind or '?'}`; run `{run_id}`{cut}")


def timeline_section(case_id: str, sample: Mapping[str, Any], kind: str | None, run_id: str) -> list[str]:
    """One case's part of the timelines artifact (Markdown lines): its sample `sample` (a stored
    row, `trace` parsed or not), the graders that failed it, and what the agent did, a step a
    line (`trajectory_lines`) cut at FOLD_CHARS, the cut steps longer in a folded `<details>`
    below; a trajectory of more than TIMELINE_HEAD + TIMELINE_TAIL steps shows its first and
    last. [] when the sample has no trajectory."""
    trace = sample.get("trace")
    doc = (trace if isinstance(trace, SampleTrace) else SampleTrace.parse(trace)).trajectory
    if doc is None:
        return []
    steps, shown, longer = len(doc.entries), trajectory_lines(doc, FOLD_CHARS), trajectory_lines(doc)
    keep = [i for i in range(steps) if i < TIMELINE_HEAD or i >= steps - TIMELINE_TAIL]
    lines = [shown[i] for i in keep]
    if len(keep) < steps:
        lines.insert(TIMELINE_HEAD, f"     … {steps - len(keep)} more steps (evalpipe runs show {run_id}"
                                    f" --case {case_id})")
    lines += shown[steps:]  # what trajectory_lines says after the steps: a cut, a stop
    folded = [longer[i] for i in keep if longer[i] != shown[i]]
    failed = failed_graders(sample, kind)
    out = [f"### {code_span(clip(case_id, CELL_CHARS))}: sample {sample['sample_index']} ({sample['status']})", ""]
    out += [f"- {code_span(clip(label, CELL_CHARS))}: {code_span(shorten(detail, DETAIL_CHARS))}"
            for label, detail in failed if detail]
    text = "\n".join(lines)
    fence = "`" * max(3, longest_backticks(text) + 1)  # a fence no step can close
    out += ["", fence + "text", text, fence, ""]
    if folded:  # one HTML block (no blank line inside), its text escaped: Prefect renders it folded
        out += [f"<details><summary>the {len(folded)} step(s) cut above, up to {STEP_CHARS} characters each"
                f"</summary><pre>{escape(chr(10).join(folded))}</pre></details>", ""]
    return out


def timelines_markdown(run_id: str, sections: Sequence[list[str]], left_out: int) -> str:
    """The timelines artifact: a heading, then each case's `timeline_section`; `left_out`:
    the failing or flaky cases with a trajectory not shown (past MAX_TIMELINES)."""
    more = (f" {left_out} more failing or flaky case(s) left out: `evalpipe runs show {run_id} --case ID`."
            if left_out else "")
    head = [f"## What the agent did: the first failing sample of {len(sections)} case(s)", "",
            f"Run `{run_id}`; each model turn, each tool call with its arguments and result (`->`), in order;"
            f" a step longer than {FOLD_CHARS} characters is cut and shown longer below its timeline.{more}", ""]
    return "\n".join(head + [line for section in sections for line in section])
