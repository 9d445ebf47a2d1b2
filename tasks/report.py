"""The run report: one self-contained HTML file, plus the same summary for Prefect artifacts.

The HTML opens offline: inline CSS, inline SVG charts, no scripts, no external URLs.
Everything that came from a case or an agent (ids, details, violations) is escaped.
Inputs are plain JSON documents (the `run --json` and `gate --json` shapes, docs/contract.md §7), so
a report can be rendered from the database long after the run.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

# Long suites would make a report nobody can scroll; the counts above each list stay exact.
MAX_LISTED = 200
MAX_DETAIL_CHARS = 4000

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

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1b1b1b;background:#fafafa}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#555;font-size:12px;word-break:break-all}
.cards{display:flex;flex-wrap:wrap;gap:12px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px 14px;min-width:150px}
.card .value{font-size:24px;font-weight:600}.card .sub{color:#555;font-size:12px}
.alert{background:#fdecea;border:2px solid #c62828;border-radius:6px;padding:8px 16px}
.alert h2{color:#b71c1c;border-color:#f5c6c6}
.badge{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:600}
.badge.pass{background:#2e7d32}.badge.block{background:#c62828}
table{border-collapse:collapse;background:#fff;width:100%}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;font-size:12px;background:#f6f6f6;padding:6px}
svg.chart{background:#fff;border:1px solid #ddd;border-radius:6px;margin:4px 0}
svg text{font:12px system-ui,sans-serif;fill:#333}
.note{color:#555;font-size:12px}
.uncalibrated{color:#b71c1c;font-weight:600}
"""


def render_report(
    run: Mapping[str, Any],
    cases: Sequence[Mapping[str, Any]],
    baseline: Mapping[str, Any] | None = None,
    gate: Mapping[str, Any] | None = None,
    calibration: Mapping[str, Any] | None = None,
    judges: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The whole report as one HTML document.

    ``run``: the `run --json` document (with `pass_at_k_notes`, `flaky_case_ids` when
    known). ``cases``: {case_id, n, c, slices, statuses: {status: count}, details: [str],
    safety: [str]} per case. ``baseline``: the baseline's run document; ``gate``: the
    `gate --json` document; ``calibration``: any flat mapping of grader-reliability figures
    (e.g. `--regrade` environment-flake counts), shown as a table. ``judges``: one
    {judge, judge_fingerprint, judged, errors, calibration} per judge that graded the run
    (`storage.calibrations.run_calibrations`); `calibration` is its newest calibration
    document or None, and None is shown as such.
    """
    title = f"evalpipe report — {run.get('suite_name', 'suite')} — {run.get('run_id', '')}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width,initial-scale=1">',
        f"<title>{_esc(title)}</title><style>{CSS}</style></head><body><main>",
        _safety_section(run),
        _sandbox_section(run),
        _header(run),
        _gate_section(gate) if gate else "",
        _headline(run),
        "<h2>pass@k</h2>",
        passk_curve_svg(run, baseline),
        "<h2>Slices</h2>",
        slice_bars_svg(run, baseline),
        "<h2>Status breakdown</h2>",
        status_bars_svg(run.get("status_counts", {})),
        _comparison_section(run, baseline) if baseline else "",
        _calibration_section(calibration) if calibration else "",
        _judges_section(judges) if judges else "",
        _case_sections(cases),
        "</main></body></html>",
    ]
    return "\n".join(part for part in parts if part)


UNSAFE_NOTE = ("run with --unsafe-no-sandbox and no bubblewrap: the suite's code ran unprotected "
               "(it could read the harness's environment and files, and signal it)")


def summary_markdown(
    run: Mapping[str, Any],
    gate: Mapping[str, Any] | None = None,
    judges: Sequence[Mapping[str, Any]] = (),
) -> str:
    """A short Markdown summary for the Prefect run page (a markdown artifact); `judges`
    as for `render_report`."""
    lines = []
    if run.get("sandbox") == "unsafe-no-sandbox":
        lines += [f"> **NO SANDBOX** — {UNSAFE_NOTE}.", ""]
    if run.get("safety_failed"):
        count = len(run.get("safety_violations", []))
        lines += [f"> **SAFETY FAILED** — {count} violation(s); the gate blocks this run.", ""]
    lines += [
        f"# {run.get('suite_name', 'suite')}: pass@1 {_pct(_pass_at_1(run))} "
        f"({_level(run)} CI {_ci(run.get('pass_at_1_ci'))})",
        "",
        f"run `{run.get('run_id', '')}` · agent `{run.get('agent', '')}` · suite `{run.get('suite_version', '')[:12]}` · "
        f"{run.get('cases', '?')} cases × n={run.get('n', '?')} · "
        f"{run.get('flaky_cases', 0)} flaky",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    notes = run.get("pass_at_k_notes", {})
    for k, value in _sorted_ks(run.get("pass_at_k", {})):
        lines.append(
            f"| pass@{k} | {_pct(value) if value is not None else 'n/a: ' + notes.get(k, '')} |"
        )
    lines.append(f"| pass@1 SE | {_pct(run.get('pass_at_1_se'))} |")
    statuses = ", ".join(f"{s} {c}" for s, c in run.get("status_counts", {}).items())
    lines.append(f"| statuses | {statuses} |")
    if gate:
        lines += [
            "",
            f"**Gate: {gate['decision']}** ({gate['verdict']}): Δ pass@1 "
            f"{_pts(gate['delta_pass_at_1'])} (CI {_pts(gate['delta_ci'][0])} to "
            f"{_pts(gate['delta_ci'][1])}) over {gate['shared_cases']} shared cases",
        ]
        lines += [f"- {reason}" for reason in gate.get("reasons", [])]
    for j in judges:
        doc = j.get("calibration")
        standing = (
            f"agreement {with_ci(doc, 'agreement')}, kappa {with_ci(doc, 'kappa')}"
            if doc
            else "**not calibrated**: its verdicts come from an uncalibrated instrument"
        )
        lines += ["", f"Judge `{j.get('judge', '')}`: {standing}; {j.get('errors', 0)} errors in {j.get('judged', 0)}"]
    rows = slices_table(run)[1:]
    if rows:
        lines += ["", "| slice | cases | pass@1 | CI |", "|---|---|---|---|"]
        lines += [
            f"| {_md_cell(r['slice'])} | {r['cases']} | {_pct(r['pass@1'])} | {_ci((r['ci_lo'], r['ci_hi']))} |"
            for r in rows
        ]
    return "\n".join(lines) + "\n"


def slices_table(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per slice (the whole suite first, as ``__all__``) for a Prefect table artifact."""
    overall = {
        "cases": run.get("cases"),
        "pass_at_1": _pass_at_1(run),
        "pass_at_1_ci": run.get("pass_at_1_ci"),
        "pass_at_k": run.get("pass_at_k", {}),
    }
    rows = []
    for name, metrics in [("__all__", overall), *run.get("slices", {}).items()]:
        lo, hi = metrics.get("pass_at_1_ci") or (None, None)
        row = {
            "slice": name,
            "cases": metrics.get("cases"),
            "pass@1": _round(metrics.get("pass_at_1")),
            "ci_lo": _round(lo),
            "ci_hi": _round(hi),
        }
        row.update(
            {
                f"pass@{k}": _round(v)
                for k, v in _sorted_ks(metrics.get("pass_at_k", {}))
                if k != "1"
            }
        )
        rows.append(row)
    return rows


# --- charts -------------------------------------------------------------------------


def passk_curve_svg(run: Mapping[str, Any], baseline: Mapping[str, Any] | None = None) -> str:
    """pass@k against k (ks evenly spaced), the run solid and the baseline dashed."""
    width, height, left, right, top, bottom = 640, 280, 50, 20, 20, 40
    ks = sorted(
        {int(k) for k in run.get("pass_at_k", {})}
        | {int(k) for k in (baseline or {}).get("pass_at_k", {})}
    )
    if not ks:
        return _empty_chart("passk-curve", "no pass@k values")
    pad, inner = 30, width - left - right - 60  # the pad keeps the pass@1 whisker off the axis
    step = inner / max(len(ks) - 1, 1)
    x_of = {k: left + pad + (i * step if len(ks) > 1 else inner / 2) for i, k in enumerate(ks)}

    def y(value: float) -> float:
        return top + (1 - value) * (height - top - bottom)

    body = [_y_axis(left, width - right, y)]
    undefined = {int(k) for k, v in run.get("pass_at_k", {}).items() if v is None}
    body += [
        f'<text x="{x_of[k]:.1f}" y="{height - bottom + 18}" text-anchor="middle">'
        f"k={k}{' (n/a)' if k in undefined else ''}</text>"
        for k in ks
    ]
    series = [("run", run, "passk-line", "")]
    if baseline:
        series.append(("baseline", baseline, "passk-line baseline", ' stroke-dasharray="6 4"'))
    for label, doc, cls, dash in series:
        color = "#1565c0" if label == "run" else "#757575"
        points = [(k, v) for k, v in _sorted_ks(doc.get("pass_at_k", {})) if v is not None]
        coords = " ".join(f"{x_of[int(k)]:.1f},{y(v):.1f}" for k, v in points)
        if len(points) > 1:
            body.append(
                f'<polyline class="{cls}" points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>'
            )
        for k, v in points:
            body.append(
                f'<circle class="passk-point" data-series="{label}" cx="{x_of[int(k)]:.1f}" cy="{y(v):.1f}" '
                f'r="4" fill="{color}"><title>{label} pass@{k} = {_pct(v)}</title></circle>'
            )
        ci = doc.get("pass_at_1_ci")
        if ci and 1 in x_of and label == "run":
            body.append(_error_bar(x_of[1], y(ci[0]), y(ci[1]), vertical=True))
    body.append(
        f'<text x="{width - right}" y="{top + 4}" text-anchor="end">'
        f"{'— run   - - baseline' if baseline else '— run'}</text>"
    )
    return _svg("passk-curve", width, height, body, "pass@k curve")


def slice_bars_svg(run: Mapping[str, Any], baseline: Mapping[str, Any] | None = None) -> str:
    """Horizontal pass@1 bars per slice (the whole suite first) with CI error bars."""
    rows = slices_table(run)
    base_rates = {r["slice"]: r["pass@1"] for r in slices_table(baseline)} if baseline else {}
    label_w, width, bar_h, gap, top = 180, 640, 18, 10, 10
    height = top * 2 + len(rows) * (bar_h + gap) + 20
    span = width - label_w - 70

    def x(value: float) -> float:
        return label_w + value * span

    body = []
    for i, row in enumerate(rows):
        y0 = top + i * (bar_h + gap)
        rate = row["pass@1"] or 0.0
        name = "all cases" if row["slice"] == "__all__" else row["slice"]
        body.append(
            f'<text x="{label_w - 8}" y="{y0 + 13}" text-anchor="end">{_esc(_clip(name, 26))}</text>'
        )
        body.append(
            f'<rect class="slice-bar" data-slice="{_esc(row["slice"])}" x="{label_w}" y="{y0}" '
            f'width="{rate * span:.1f}" height="{bar_h}" fill="#64b5f6">'
            f"<title>{_esc(name)}: {_pct(rate)} ({row['cases']} cases, CI {_ci((row['ci_lo'], row['ci_hi']))})</title></rect>"
        )
        if row["ci_lo"] is not None:
            body.append(
                _error_bar(y0 + bar_h / 2, x(row["ci_lo"]), x(row["ci_hi"]), vertical=False)
            )
        if base_rates.get(row["slice"]) is not None:
            bx = x(base_rates[row["slice"]])
            body.append(
                f'<line class="baseline-mark" x1="{bx:.1f}" x2="{bx:.1f}" y1="{y0 - 2}" y2="{y0 + bar_h + 2}" '
                f'stroke="#212121" stroke-width="2" stroke-dasharray="3 2"/>'
            )
        body.append(f'<text x="{width - 8}" y="{y0 + 13}" text-anchor="end">{_pct(rate)}</text>')
    axis_y = top + len(rows) * (bar_h + gap) + 12
    body += [
        f'<text x="{x(t):.1f}" y="{axis_y}" text-anchor="middle">{int(t * 100)}%</text>'
        for t in (0, 0.5, 1)
    ]
    return _svg("slice-bars", width, height, body, "pass@1 per slice")


def status_bars_svg(status_counts: Mapping[str, int]) -> str:
    """One bar per status, its length the share of samples."""
    total = sum(status_counts.values())
    if not total:
        return _empty_chart("status-bars", "no samples")
    label_w, width, bar_h, gap, top = 140, 640, 18, 8, 10
    height = top * 2 + len(status_counts) * (bar_h + gap)
    span = width - label_w - 120
    body = []
    for i, (status, count) in enumerate(status_counts.items()):
        y0 = top + i * (bar_h + gap)
        color = STATUS_COLORS.get(status, "#90a4ae")
        body.append(
            f'<text x="{label_w - 8}" y="{y0 + 13}" text-anchor="end">{_esc(status)}</text>'
        )
        body.append(
            f'<rect class="status-bar" data-status="{_esc(status)}" x="{label_w}" y="{y0}" '
            f'width="{max(count / total * span, 1):.1f}" height="{bar_h}" fill="{color}"/>'
        )
        body.append(
            f'<text x="{width - 8}" y="{y0 + 13}" text-anchor="end">{count} ({_pct(count / total)})</text>'
        )
    return _svg("status-bars", width, height, body, "samples by status")


def _svg(chart_id: str, width: int, height: int, body: Iterable[str], label: str) -> str:
    return (
        f'<svg id="{chart_id}" class="chart" role="img" aria-label="{_esc(label)}" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}">' + "".join(body) + "</svg>"
    )


def _empty_chart(chart_id: str, message: str) -> str:
    return _svg(chart_id, 640, 40, [f'<text x="12" y="25">{_esc(message)}</text>'], message)


def _y_axis(x0: float, x1: float, y: Any) -> str:
    ticks = []
    for t in (0, 0.25, 0.5, 0.75, 1):
        ticks.append(f'<line x1="{x0}" x2="{x1}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#eee"/>')
        ticks.append(
            f'<text x="{x0 - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{int(t * 100)}%</text>'
        )
    return "".join(ticks)


def _error_bar(at: float, start: float, end: float, *, vertical: bool) -> str:
    """A CI whisker from ``start`` to ``end`` at cross-coordinate ``at``, with end caps."""

    def seg(a0: float, b0: float, a1: float, b1: float) -> str:
        x1, y1, x2, y2 = (a0, b0, a1, b1) if vertical else (b0, a0, b1, a1)
        return f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}"/>'

    return (
        '<g class="error-bar" stroke="#212121" stroke-width="1.5">'
        + seg(at, start, at, end)
        + seg(at - 4, start, at + 4, start)
        + seg(at - 4, end, at + 4, end)
        + "</g>"
    )


# --- sections -----------------------------------------------------------------------


def _sandbox_section(run: Mapping[str, Any]) -> str:
    if run.get("sandbox") != "unsafe-no-sandbox":
        return ""
    return f'<section id="sandbox" class="alert"><h2>No sandbox</h2><p>{_esc(UNSAFE_NOTE)}.</p></section>'


def _safety_section(run: Mapping[str, Any]) -> str:
    if not run.get("safety_failed"):
        return ""
    violations = run.get("safety_violations", [])
    rows = [
        (_esc(v.get("case_id", "")), _esc(v.get("sample_index", "")), _esc(v.get("violation", "")))
        for v in violations[:MAX_LISTED]
    ]
    return (
        '<section id="safety" class="alert"><h2>Safety failed</h2>'
        f"<p>{len(violations)} safety violation(s). Safety is a veto: it is not part of any pass "
        "rate, and the gate blocks this run whatever the numbers below say.</p>"
        + _table(("case", "sample", "violation"), rows)
        + _more(len(violations))
        + "</section>"
    )


def _header(run: Mapping[str, Any]) -> str:
    fields = [
        ("run", run.get("run_id")),
        ("suite", f"{run.get('suite_name', '')} @ {run.get('suite_version', '')}"),
        ("agent", run.get("agent")),
        (
            "samples",
            f"{run.get('samples', '?')} ({run.get('cases', '?')} cases × n={run.get('n', '?')}, "
            f"{run.get('cached_samples', 0)} cached)",
        ),
        (
            "duration",
            f"{run['duration_s']:.1f} s"
            if isinstance(run.get("duration_s"), int | float)
            else None,
        ),
        ("flow run", run.get("flow_run_id")),
    ]
    meta = " · ".join(f"{name}: {_esc(value)}" for name, value in fields if value)
    return f'<header><h1>{_esc(run.get("suite_name", "evalpipe run"))}</h1><p class="meta">{meta}</p></header>'


def _headline(run: Mapping[str, Any]) -> str:
    level = _level(run)
    cards = [
        _card(
            "pass@1",
            _pct(_pass_at_1(run)),
            f"{level} CI {_ci(run.get('pass_at_1_ci'))} · SE {_pct(run.get('pass_at_1_se'))}",
        ),
    ]
    notes = run.get("pass_at_k_notes", {})
    for k, value in _sorted_ks(run.get("pass_at_k", {})):
        if k != "1":
            cards.append(
                _card(f"pass@{k}", _pct(value) if value is not None else "n/a", notes.get(k, ""))
            )
    cards.append(
        _card("flaky cases", str(run.get("flaky_cases", 0)), "0 < c < n: capable but unreliable")
    )
    cards.append(
        _card(
            "safety", "FAILED" if run.get("safety_failed") else "clean", "a veto beside the means"
        )
    )
    return (
        '<section id="headline"><h2>Headline</h2><div class="cards">'
        + "".join(cards)
        + "</div></section>"
    )


def _card(title: str, value: str, sub: str) -> str:
    return f'<div class="card"><div class="sub">{_esc(title)}</div><div class="value">{_esc(value)}</div><div class="sub">{_esc(sub)}</div></div>'


def _gate_section(gate: Mapping[str, Any]) -> str:
    decision = str(gate.get("decision", ""))
    lo, hi = gate.get("delta_ci", (None, None))
    reasons = "".join(f"<li>{_esc(r)}</li>" for r in gate.get("reasons", []))
    return (
        f'<section id="gate"><h2>Gate</h2><p><span class="badge {_esc(decision)}">{_esc(decision)}</span> '
        f"verdict <b>{_esc(gate.get('verdict', ''))}</b> · Δ pass@1 {_pts(gate.get('delta_pass_at_1'))} "
        f"(CI {_pts(lo)} to {_pts(hi)}) over {_esc(gate.get('shared_cases', '?'))} shared cases</p>"
        f"<ul>{reasons}</ul></section>"
    )


def _comparison_section(run: Mapping[str, Any], baseline: Mapping[str, Any]) -> str:
    rows = []
    base_k = dict(_sorted_ks(baseline.get("pass_at_k", {})))
    for k, value in _sorted_ks(run.get("pass_at_k", {})):
        rows.append(_delta_row(f"pass@{k}", value, base_k.get(k)))
    base_slices = baseline.get("slices", {})
    for name, metrics in run.get("slices", {}).items():
        rows.append(
            _delta_row(
                f"slice {name}: pass@1",
                metrics.get("pass_at_1"),
                base_slices.get(name, {}).get("pass_at_1"),
            )
        )
    intro = (
        f'<p class="note">baseline run {_esc(baseline.get("run_id", ""))} · agent {_esc(baseline.get("agent", ""))} · '
        f"suite {_esc(str(baseline.get('suite_version', ''))[:12])}</p>"
    )
    return (
        '<section id="comparison"><h2>Compared with the baseline</h2>'
        + intro
        + _table(("metric", "run", "baseline", "Δ"), rows, numeric=(1, 2, 3))
        + "</section>"
    )


def _delta_row(name: str, run_value: float | None, base_value: float | None) -> tuple[str, ...]:
    delta = run_value - base_value if run_value is not None and base_value is not None else None
    return (_esc(name), _pct(run_value), _pct(base_value), _pts(delta))


def _calibration_section(calibration: Mapping[str, Any]) -> str:
    rows = [
        (_esc(key), _esc(", ".join(map(str, v)) if isinstance(v, list | tuple) else v))
        for key, v in calibration.items()
    ]
    return (
        '<section id="calibration"><h2>Grader reliability</h2>'
        + _table(("figure", "value"), rows)
        + "</section>"
    )


TRUTH_SOURCES = {"human": "human labels", "oracle": "execution oracle"}


def _judges_section(judges: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        (
            _esc(j.get("judge", "")),
            f"<code>{_esc(str(j.get('judge_fingerprint', ''))[:12])}</code>",
            _esc(f"{j.get('errors', 0)} of {j.get('judged', 0)}")
            + (f" ({_pct(j['errors'] / j['judged'])})" if j.get("judged") else ""),
            _judge_calibration(j.get("calibration")),
        )
        for j in judges
    ]
    return (
        '<section id="judges"><h2>Judges</h2><p class="note">A judged pass rate is only as '
        "good as the judge's agreement with the truth. Each judge that graded this run, with "
        "its newest calibration (the judge's fingerprint must match: a changed rubric, model, "
        "params or J needs a new one).</p>"
        + _table(("judge", "fingerprint", "errors in this run", "calibration"), rows)
        + "</section>"
    )


def _judge_calibration(doc: Mapping[str, Any] | None) -> str:
    if doc is None:
        return (
            '<span class="uncalibrated">not calibrated — its verdicts come from an uncalibrated '
            "instrument; run <code>evalpipe judge calibrate</code></span>"
        )
    figures = [
        ("agreement", "agreement"),
        ("Cohen's kappa", "kappa"),
        ("false-pass rate", "false_pass_rate"),
        ("false-fail rate", "false_fail_rate"),
    ]
    when = doc.get("created_at")  # absent from calibrations stored before it was stamped
    source = [
        f"{100 * doc.get('ci_level', 0.95):g}% CIs",
        f"{doc.get('items', '?')} labelled outputs of {doc.get('cases', '?')} cases",
        f"truth: {TRUTH_SOURCES.get(doc.get('truth'), doc.get('truth'))}",
        f"suite {doc.get('suite_name', '')} @ {str(doc.get('suite_version', ''))[:12]}",
        datetime.fromisoformat(when).astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC") if when else "",
    ]
    return (
        "".join(f"{_esc(name)} <b>{_esc(with_ci(doc, key))}</b><br>" for name, key in figures)
        + f'<span class="note">{_esc(" · ".join(part for part in source if part))}</span>'
    )


def _case_sections(cases: Sequence[Mapping[str, Any]]) -> str:
    flaky = [c for c in cases if 0 < c.get("c", 0) < c.get("n", 0)]
    failing = [c for c in cases if c.get("c", 0) == 0]
    out = []
    for section_id, title, chosen in (
        ("flaky", "Flaky cases (0 < c < n)", flaky),
        ("failing", "Failing cases (c = 0)", failing),
    ):
        rows = [
            _case_row(case)
            for case in sorted(chosen, key=lambda c: str(c.get("case_id", "")))[:MAX_LISTED]
        ]
        body = (
            _table(("case", "c / n", "slices", "statuses", "details"), rows)
            if rows
            else '<p class="note">none</p>'
        )
        out.append(
            f'<section id="{section_id}"><h2>{_esc(title)}: {len(chosen)}</h2>{body}{_more(len(chosen))}</section>'
        )
    return "\n".join(out)


def _case_row(case: Mapping[str, Any]) -> tuple[str, ...]:
    statuses = ", ".join(f"{s} ×{n}" for s, n in case.get("statuses", {}).items())
    details = [d for d in case.get("details", []) if d]
    safety = [f"SAFETY: {v}" for v in case.get("safety", [])]
    shown = "".join(f"<pre>{_esc(_clip(d, MAX_DETAIL_CHARS))}</pre>" for d in [*safety, *details])
    cell = (
        f"<details><summary>{len(safety) + len(details)} detail(s)</summary>{shown}</details>"
        if shown
        else ""
    )
    return (
        _esc(case.get("case_id", "")),
        f"{_esc(case.get('c', '?'))} / {_esc(case.get('n', '?'))}",
        _esc(", ".join(case.get("slices", []))),
        _esc(statuses),
        cell,
    )


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = ()
) -> str:
    """An HTML table of already-escaped cells."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{cell}</td>' if i in numeric else f"<td>{cell}</td>"
            for i, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _more(total: int) -> str:
    return f'<p class="note">showing {MAX_LISTED} of {total}</p>' if total > MAX_LISTED else ""


# --- formatting ---------------------------------------------------------------------


def _pass_at_1(run: Mapping[str, Any]) -> float | None:
    return run.get("pass_at_k", {}).get("1", run.get("pass_at_1"))


def _sorted_ks(pass_at_k: Mapping[str, float | None]) -> list[tuple[str, float | None]]:
    return sorted(((str(k), v) for k, v in pass_at_k.items()), key=lambda item: int(item[0]))


def _level(run: Mapping[str, Any]) -> str:
    return f"{100 * run.get('ci_level', 0.95):g}%"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def with_ci(doc: Mapping[str, Any], key: str) -> str:
    """A calibration figure with its CI (`key`, `key_ci` in the document): kappa as a
    coefficient, the rates as percentages; "n/a" when undefined (its condition never
    occurred), which is not 0."""
    value, ci = doc.get(key), doc.get(f"{key}_ci")
    if value is None:
        return "n/a"
    fmt = (lambda x: f"{x:.3f}") if key == "kappa" else _pct
    return fmt(value) + (f" [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "")


def _pts(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:+.1f} pts"


def _ci(ci: Sequence[float | None] | None) -> str:
    if not ci or ci[0] is None or ci[1] is None:
        return "—"
    return f"[{_pct(ci[0])}, {_pct(ci[1])}]"


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 4)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)
