"""The run report: one self-contained HTML file, plus the same summary for Prefect artifacts.

The HTML opens offline: inline CSS, inline SVG charts, no scripts, no external URLs. It is
drawn by a Jinja template (templates/report.html.j2) with autoescaping on, so everything that
came from a case or an agent (ids, details, violations) is escaped where it is printed; this
module only computes what to show and where (chart geometry, formatted figures).
The run is read as the typed `RunSummary` (the `run --json` document, docs/contract.md §7); the
gate, calibration and judge inputs are their plain JSON documents, so a report can be rendered
from the database long after the run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined

from tasks.metrics.percent import headline_ci, percent, shown_ci, signed_points, with_ci
from tasks.report.figures import metric_rows
from tasks.report.gate_text import decided_by
from tasks.report.inert import code_span
from tasks.report.judges import UNCALIBRATED, judge_standing, judged_count
from tasks.report.trajectory import steps_text
from tasks.run import RunSummary
from tasks.run.usage import USAGE_COLUMNS, usage_rows
from tasks.sandbox import UNSAFE_NOTE

# Long suites would make a report nobody can scroll; the counts above each list stay exact.
MAX_LISTED = 200
MAX_DETAIL_CHARS = 4000
MAX_OUTPUT_CHARS = 4000

STATUS_COLORS = {
    "passed": "#2e7d32",
    "failed": "#c62828",
    "empty": "#8d6e63",
    "not_applied": "#ef6c00",
    "scope_violation": "#6a1b9a",
    "timeout": "#f9a825",
    "error": "#455a64",
    "agent_error": "#ad1457",
}

TRUTH_SOURCES = {"human": "human labels", "oracle": "execution oracle"}

Summary = RunSummary | Mapping[str, Any]


def render_report(
    run: Summary,
    cases: Sequence[Mapping[str, Any]],
    baseline: Summary | None = None,
    gate: Mapping[str, Any] | None = None,
    calibration: Mapping[str, Any] | None = None,
    judges: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The whole report as one HTML document.

    ``run``: the run's summary. ``cases``: {case_id, n, c, slices, statuses: {status: count},
    details: [str], safety: [str], outputs: [str] (failing samples' outputs, optional),
    trajectory (optional): {sample_index, lines}} per case. ``baseline``: the baseline's summary; ``gate``:
    the `gate --json` document; ``calibration``: any flat mapping of grader-reliability
    figures (e.g. `--regrade` environment-flake counts), shown as a table. ``judges``: one
    {judge, judge_fingerprint, judged, errors, calibration} per judge that graded the run
    (`Store.calibrations.of_run`, `storage/calibrations.py`); `calibration` is its newest calibration
    document or None, and None is shown as such.
    """
    run = RunSummary.read(run)
    base = RunSummary.read(baseline) if baseline is not None else None
    return TEMPLATES.get_template("report.html.j2").render(
        run=run,
        baseline=base,
        gate=_gate_view(gate) if gate else None,
        unsafe_note=UNSAFE_NOTE,
        safety_rows=[(v.case_id, v.sample_index, v.violation) for v in run.safety_violations[:MAX_LISTED]],
        meta=_meta(run),
        level=_level(run),
        pass_at_1=_pass_at_1(run),
        pass_at_1_ci=shown_ci(run.pass_at_1_ci, run.cases),
        other_ks=[(k, v, run.pass_at_k_notes.get(k, "")) for k, v in _sorted_ks(run.pass_at_k) if k != "1"],
        hat_ks=[(k, v) for k, v in _sorted_ks(run.pass_hat_k or {}) if k != "1"],
        metric_cards=metric_rows(run),
        passk=_passk_chart(run, base),
        slice_bars=_slice_chart(run, base),
        status_bars=_status_chart(run.status_counts),
        comparison=_comparison_rows(run, base) if base else [],
        calibration=[(k, ", ".join(map(str, v)) if isinstance(v, list | tuple) else v)
                     for k, v in (calibration or {}).items()],
        judges=[_judge_view(j) for j in judges],
        case_lists=_case_lists(cases),
        max_listed=MAX_LISTED,
        usage_columns=USAGE_COLUMNS,
        usage=usage_rows(run.usage) if run.usage else None,
    ).strip() + "\n"


def summary_markdown(
    run: Summary,
    gate: Mapping[str, Any] | None = None,
    judges: Sequence[Mapping[str, Any]] = (),
) -> str:
    """A short Markdown summary for the Prefect run page (a markdown artifact); `judges`
    as for `render_report`."""
    run = RunSummary.read(run)
    lines = []
    if run.sandbox == "unsafe-no-sandbox":
        lines += [f"> **NO SANDBOX** — {UNSAFE_NOTE}.", ""]
    if run.safety_failed:
        count = len(run.safety_violations)
        lines += [f"> **SAFETY FAILED** — {count} violation(s); the gate blocks this run.", ""]
    if run.partial:
        lines += [f"> **PARTIAL** — {run.undrawn_samples} samples undrawn ({run.budget.stopped if run.budget else ''});"
                  " the figures cover the drawn samples only.", ""]
    lines += [
        f"# {run.suite_name}: pass@1 {percent(_pass_at_1(run))} "
        f"({headline_ci(run.pass_at_1_ci, run.cases, run.ci_level)})",
        "",
        f"run `{run.run_id}` · agent `{run.agent}` · suite `{run.suite_version[:12]}` · "
        f"{run.cases} cases × n={run.n} · {run.flaky_cases} flaky",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    for k, value in _sorted_ks(run.pass_at_k):
        shown = percent(value) if value is not None else "n/a: " + run.pass_at_k_notes.get(k, "")
        lines.append(f"| pass@{k} | {shown} |")
    for k, value in _sorted_ks(run.pass_hat_k or {}):
        if k != "1":
            lines.append(f"| pass^{k} (all {k} pass) | {percent(value, none='n/a')} |")
    for name, value, ci in metric_rows(run):
        lines.append(f"| {_md_cell(name)} | {_md_cell(value)} {ci} |")
    lines.append(f"| pass@1 SE | {percent(run.pass_at_1_se)} |")
    statuses = ", ".join(f"{s} {c}" for s, c in run.status_counts.items())
    lines.append(f"| statuses | {statuses} |")
    if run.usage:
        for label, samples, inp, out, cost, p50, p95, note in usage_rows(run.usage):
            lines.append(f"| usage, {label} | {samples} samples · tokens {inp} in, {out} out · cost {cost}"
                         f" · agent latency p50 {p50}, p95 {p95}{' · ' + _md_cell(note) if note else ''} |")
    if run.unscored:
        lines.append(f"| unscored (no output in run {run.source_run}) | {_md_cell(', '.join(run.unscored))} |")
    if gate and "baseline" in gate and gate["baseline"] is None:  # decided by the rules that need no baseline
        lines += ["", f"**Gate: {gate['decision']}** (no baseline: nothing was compared)"]
    elif gate:
        lines += [
            "",
            f"**Gate: {gate['decision']}** ({gate['verdict']}): Δ pass@1 "
            f"{signed_points(gate['delta_pass_at_1'])} (CI {signed_points(gate['delta_ci'][0])} to "
            f"{signed_points(gate['delta_ci'][1])}) over {gate['shared_cases']} shared cases",
        ]
    if gate:
        lines += [basis for basis in [decided_by(gate)] if basis]
        # In code: a reason names suite text (case ids, a slice) that must not render as Markdown.
        lines += [f"- {code_span(reason)}" for reason in gate.get("reasons", [])]
    for j in judges:
        standing = judge_standing(j) or f"**not calibrated**: {UNCALIBRATED}"
        lines += ["", f"Judge `{j.get('judge', '')}`: {standing}; {judged_count(j)}"]
    rows = slices_table(run)[1:]
    if rows:
        lines += ["", "| slice | cases | pass@1 | CI |", "|---|---|---|---|"]
        lines += [
            f"| {_md_cell(r['slice'])} | {r['cases']} | {percent(r['pass@1'])} | {_ci((r['ci_lo'], r['ci_hi']))} |"
            for r in rows
        ]
    return "\n".join(lines) + "\n"


def slices_table(run: Summary) -> list[dict[str, Any]]:
    """One row per slice (the whole suite first, as ``__all__``) for a Prefect table artifact."""
    run = RunSummary.read(run)
    overall = (run.cases, _pass_at_1(run), shown_ci(run.pass_at_1_ci, run.cases), run.pass_at_k)
    rows = []
    for name, (cases, pass_at_1, ci, pass_at_k) in [
        ("__all__", overall),
        *((name, (m.cases, m.pass_at_1, m.pass_at_1_ci, m.pass_at_k)) for name, m in run.slices.items()),
    ]:
        lo, hi = ci or (None, None)
        row = {"slice": name, "cases": cases, "pass@1": _round(pass_at_1),
               "ci_lo": _round(lo), "ci_hi": _round(hi)}
        row.update({f"pass@{k}": _round(v) for k, v in _sorted_ks(pass_at_k) if k != "1"})
        rows.append(row)
    return rows


# --- charts: geometry only; the template draws -----------------------------------------


def _passk_chart(run: RunSummary, baseline: RunSummary | None) -> dict[str, Any] | None:
    """pass@k against k (ks evenly spaced), the run solid and the baseline dashed."""
    width, height, left, right, top, bottom = 640, 280, 50, 20, 20, 40
    ks = sorted({int(k) for k in run.pass_at_k} | {int(k) for k in (baseline.pass_at_k if baseline else {})})
    if not ks:
        return None
    pad, inner = 30, width - left - right - 60  # the pad keeps the pass@1 whisker off the axis
    step = inner / max(len(ks) - 1, 1)
    x_of = {k: left + pad + (i * step if len(ks) > 1 else inner / 2) for i, k in enumerate(ks)}

    def y(value: float) -> float:
        return top + (1 - value) * (height - top - bottom)

    undefined = {int(k) for k, v in run.pass_at_k.items() if v is None}
    series = []
    for label, doc, cls, color, dashed in (
        ("run", run, "passk-line", "#1565c0", False),
        ("baseline", baseline, "passk-line baseline", "#757575", True),
    ):
        if doc is None:
            continue
        points = [(x_of[int(k)], y(v), k, v) for k, v in _sorted_ks(doc.pass_at_k) if v is not None]
        series.append({"label": label, "cls": cls, "color": color, "dashed": dashed, "points": points})
    ci = shown_ci(run.pass_at_1_ci, run.cases)
    return {
        "width": width, "height": height, "left": left, "right": width - right, "top": top,
        "grid": _y_grid(y),
        "ticks": [(x_of[k], height - bottom + 18, f"k={k}{' (n/a)' if k in undefined else ''}") for k in ks],
        "series": series,
        "whisker": _error_bar(x_of[1], y(ci[0]), y(ci[1]), vertical=True) if ci and 1 in x_of else None,
        "legend": "— run   - - baseline" if baseline else "— run",
    }


def _slice_chart(run: RunSummary, baseline: RunSummary | None) -> dict[str, Any]:
    """Horizontal pass@1 bars per slice (the whole suite first) with CI error bars."""
    rows = slices_table(run)
    base_rates = {r["slice"]: r["pass@1"] for r in slices_table(baseline)} if baseline else {}
    label_w, width, bar_h, gap, top = 180, 640, 18, 10, 10
    span = width - label_w - 70

    def x(value: float) -> float:
        return label_w + value * span

    bars = []
    for i, row in enumerate(rows):
        y0 = top + i * (bar_h + gap)
        rate = row["pass@1"] or 0.0
        base = base_rates.get(row["slice"])
        bars.append({
            "slice": row["slice"],
            "name": "all cases" if row["slice"] == "__all__" else row["slice"],
            "y0": y0, "rate": rate, "length": rate * span, "cases": row["cases"],
            "ci": _ci((row["ci_lo"], row["ci_hi"])),
            "whisker": (_error_bar(y0 + bar_h / 2, x(row["ci_lo"]), x(row["ci_hi"]), vertical=False)
                        if row["ci_lo"] is not None else None),
            "base_x": x(base) if base is not None else None,
        })
    axis_y = top + len(rows) * (bar_h + gap) + 12
    return {
        "width": width, "height": top * 2 + len(rows) * (bar_h + gap) + 20,
        "label_w": label_w, "bar_h": bar_h, "bars": bars,
        "axis": [(x(t), axis_y, percent(t, 0)) for t in (0, 0.5, 1)],
    }


def _status_chart(status_counts: Mapping[str, int]) -> dict[str, Any] | None:
    """One bar per status, its length the share of samples."""
    total = sum(status_counts.values())
    if not total:
        return None
    label_w, width, bar_h, gap, top = 140, 640, 18, 8, 10
    span = width - label_w - 120
    return {
        "width": width, "height": top * 2 + len(status_counts) * (bar_h + gap),
        "label_w": label_w, "bar_h": bar_h,
        "bars": [
            {"status": status, "y0": top + i * (bar_h + gap), "count": count, "share": count / total,
             "length": max(count / total * span, 1), "color": STATUS_COLORS.get(status, "#90a4ae")}
            for i, (status, count) in enumerate(status_counts.items())
        ],
    }


def _y_grid(y: Callable[[float], float]) -> list[tuple[float, str]]:
    return [(y(t), percent(t, 0)) for t in (0, 0.25, 0.5, 0.75, 1)]


def _error_bar(at: float, start: float, end: float, *, vertical: bool) -> list[tuple[float, ...]]:
    """A CI whisker from ``start`` to ``end`` at cross-coordinate ``at``, with end caps, as
    (x1, y1, x2, y2) segments."""
    segments = [(at, start, at, end), (at - 4, start, at + 4, start), (at - 4, end, at + 4, end)]
    return [s if vertical else (s[1], s[0], s[3], s[2]) for s in segments]


# --- sections -----------------------------------------------------------------------


def _meta(run: RunSummary) -> list[tuple[str, str]]:
    fields = [
        ("run", run.run_id),
        ("suite", f"{run.suite_name} @ {run.suite_version}"),
        ("agent", run.agent),
        ("samples", f"{run.samples} ({run.cases} cases × n={run.n}, {run.cached_samples} cached)"),
        ("duration", f"{run.duration_s:.1f} s" if run.duration_s is not None else None),
        ("flow run", run.flow_run_id),
        ("agent steps", steps_text(run.agent_steps) if run.agent_steps else None),
    ]
    return [(name, value) for name, value in fields if value]



def _gate_view(gate: Mapping[str, Any]) -> dict[str, Any]:
    lo, hi = gate.get("delta_ci", (None, None))
    return {
        "decision": str(gate.get("decision", "")),
        "verdict": gate.get("verdict", ""),
        "delta": signed_points(gate.get("delta_pass_at_1")),
        "lo": signed_points(lo),
        "hi": signed_points(hi),
        "shared_cases": gate.get("shared_cases", "?"),
        "reasons": gate.get("reasons", []),
        "basis": decided_by(gate),
    }


def _comparison_rows(run: RunSummary, baseline: RunSummary) -> list[tuple[str, ...]]:
    base_k = dict(_sorted_ks(baseline.pass_at_k))
    rows = [_delta_row(f"pass@{k}", v, base_k.get(k)) for k, v in _sorted_ks(run.pass_at_k)]
    for name, metrics in run.slices.items():
        base = baseline.slices.get(name)
        rows.append(_delta_row(f"slice {name}: pass@1", metrics.pass_at_1, base.pass_at_1 if base else None))
    return rows


def _delta_row(name: str, run_value: float | None, base_value: float | None) -> tuple[str, ...]:
    delta = run_value - base_value if run_value is not None and base_value is not None else None
    return (name, percent(run_value), percent(base_value), signed_points(delta))


def _judge_view(j: Mapping[str, Any]) -> dict[str, Any]:
    judged, errors = j.get("judged", 0), j.get("errors", 0)
    view = {
        "judge": j.get("judge", ""),
        "fingerprint": str(j.get("judge_fingerprint", ""))[:12],
        "errors": f"{errors} of {judged}" + (f" ({percent(errors / judged)})" if judged else ""),
        "figures": None,
        "source": "",
    }
    doc = j.get("calibration")
    if doc is None:
        return view
    when = doc.get("created_at")  # absent from calibrations stored before it was stamped
    source = [
        f"{100 * doc.get('ci_level', 0.95):g}% CIs",
        f"{doc.get('items', '?')} labelled outputs of {doc.get('cases', '?')} cases",
        f"truth: {TRUTH_SOURCES.get(doc.get('truth'), doc.get('truth'))}",
        f"suite {doc.get('suite_name', '')} @ {str(doc.get('suite_version', ''))[:12]}",
        datetime.fromisoformat(when).astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC") if when else "",
    ]
    view["figures"] = [
        (name, with_ci(doc, key))
        for name, key in (("agreement", "agreement"), ("Cohen's kappa", "kappa"),
                          ("false-pass rate", "false_pass_rate"), ("false-fail rate", "false_fail_rate"))
    ]
    view["source"] = " · ".join(part for part in source if part)
    return view


def _case_lists(cases: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    flaky = [c for c in cases if 0 < c.get("c", 0) < c.get("n", 0)]
    failing = [c for c in cases if c.get("c", 0) == 0]
    return [
        {
            "id": section_id,
            "title": title,
            "total": len(chosen),
            "rows": [_case_view(c) for c in sorted(chosen, key=lambda c: str(c.get("case_id", "")))[:MAX_LISTED]],
        }
        for section_id, title, chosen in (
            ("flaky", "Flaky cases (0 < c < n)", flaky),
            ("failing", "Failing cases (c = 0)", failing),
        )
    ]


def _case_view(case: Mapping[str, Any]) -> dict[str, Any]:
    details = [f"SAFETY: {v}" for v in case.get("safety", [])] + [d for d in case.get("details", []) if d]
    return {
        "case_id": case.get("case_id", ""),
        "counts": f"{case.get('c', '?')} / {case.get('n', '?')}",
        "slices": ", ".join(case.get("slices", [])),
        "statuses": ", ".join(f"{s} ×{n}" for s, n in case.get("statuses", {}).items()),
        "details": [clip(d, MAX_DETAIL_CHARS) for d in details],
        "outputs": [clip(o, MAX_OUTPUT_CHARS) for o in case.get("outputs", [])],
        # A failing sample's trajectory (coding agents): {sample_index, lines}, or None.
        "trajectory": case.get("trajectory"),
    }


# --- formatting ---------------------------------------------------------------------


def _pass_at_1(run: RunSummary) -> float | None:
    return run.pass_at_k.get("1")


def _sorted_ks(pass_at_k: Mapping[str, float | None]) -> list[tuple[str, float | None]]:
    return sorted(((str(k), v) for k, v in pass_at_k.items()), key=lambda item: int(item[0]))


def _level(run: RunSummary) -> str:
    return f"{100 * run.ci_level:g}%"


def _ci(ci: Sequence[float | None] | None) -> str:
    if not ci or ci[0] is None or ci[1] is None:
        return "—"
    return f"[{percent(ci[0])}, {percent(ci[1])}]"


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 4)


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, an ellipsis marking the cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|")


TEMPLATES = Environment(
    loader=PackageLoader("tasks.report", "templates"),
    autoescape=True,
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
TEMPLATES.filters.update(pct=percent, ci=_ci, clip=clip, f1=lambda x: f"{x:.1f}")
