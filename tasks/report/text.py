"""A run summary as text for a terminal (`evalpipe run`, `runs show`, `rescore`): the
figures as the Markdown summary and the HTML report write them, percentages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tasks.metrics.percent import ci_text, figure, headline_ci
from tasks.report.figures import metric_rows
from tasks.report.gate_text import gate_lines
from tasks.report.judges import UNCALIBRATED, judge_standing, judged_count
from tasks.report.trajectory import steps_text
from tasks.run.replayed import model_calls_line
from tasks.run.usage import usage_lines
from tasks.sandbox import UNSAFE_NOTE


def summary_text(s: Mapping[str, Any], judges: Sequence[Mapping[str, Any]] = ()) -> str:
    """The `run --json` document as lines: headline, other metrics, slices, statuses, then
    what qualifies the figures (partial, rescored, unsafe, safety, the judges that graded it
    with their calibration, as `store.calibrations.of_run` gives them, sequential, the gate)."""
    lines = [
        f"run {s['run_id']}  suite {s['suite_name']} ({s['suite_version'][:12]})  agent {s['agent']}",
        f"{_sample_count(s)} ({s['cached_samples']} from cache) in {s['duration_s']:.1f}s",
        f"pass@1 {figure(s['pass_at_k'].get('1'))}  {headline_ci(s['pass_at_1_ci'], s['cases'], s['ci_level'])}"
        + (f"  SE {figure(s['pass_at_1_se'])}" if s["cases"] > 1 else ""),
    ]
    if s.get("all_cached"):
        lines.insert(2, f"ALL FROM CACHE: {s['all_cached']['message']}")
    others = [f"pass@{k} {figure(v)}" for k, v in s["pass_at_k"].items() if k != "1"]
    if others:
        lines.append("  ".join(others))
    hats = [f"pass^{k} {figure(v)}" for k, v in (s.get("pass_hat_k") or {}).items() if k != "1"]
    if hats:
        lines.append("  ".join(hats) + "  (all k of k samples pass)")
    lines.extend(f"{name} {value}  {ci}".rstrip() for name, value, ci in metric_rows(s))
    for k, note in s.get("pass_at_k_notes", {}).items():
        lines.append(f"pass@{k}: null ({note})")
    for name, sl in s.get("slices", {}).items():
        lines.append(f"  slice {name:<16} {sl['cases']:>5} cases  pass@1 {figure(sl['pass_at_1'])}"
                     f"  {ci_text(sl['pass_at_1_ci'])}")
    lines.append(f"flaky cases {s['flaky_cases']}  statuses "
                 + ", ".join(f"{k} {v}" for k, v in sorted(s["status_counts"].items())))
    if "env_flaky_samples" in s:
        lines.append(f"environment flakes (same output, different verdicts): {s['env_flaky_samples']}")
    if "agent_steps" in s:
        lines.append(f"agent steps: {steps_text(s['agent_steps'])}")
    if s.get("usage"):
        lines.extend(usage_lines(s["usage"]))
    if s.get("model_calls"):
        lines.append(model_calls_line(s["model_calls"]))
    if s.get("partial"):
        lines.insert(0, f"PARTIAL: {s['undrawn_samples']} samples undrawn ({s['budget']['stopped']});"
                        " the figures below cover the drawn samples only")
    if s.get("unscored") is not None:
        lines.insert(1, f"graded on the stored outputs of run {s['source_run']}, no agent call")
        if s["unscored"]:
            lines.append(f"unscored (no stored output in run {s['source_run']}): {', '.join(s['unscored'])}")
    if s.get("sandbox") == "unsafe-no-sandbox":
        lines.insert(0, f"UNSAFE: {UNSAFE_NOTE}")
    if s["safety_failed"]:
        lines.append(f"SAFETY FAILED: {len(s['safety_violations'])} violation(s)")
        for v in s["safety_violations"][:10]:
            lines.append(f"  {v['case_id']}#{v['sample_index']}: {v['violation']}")
    for j in judges:
        lines.append(f"judge {j.get('judge', '')}: {judge_standing(j) or 'NOT CALIBRATED: ' + UNCALIBRATED}; {judged_count(j)}")
    if s.get("no_baseline"):
        lines.append(f"gate: {s['no_baseline']}")
    if s.get("sequential"):
        lines.append(sequential_line(s["sequential"]))
    gate = s.get("gate")
    if gate:
        decision, *reasons = gate_lines(gate)
        lines.extend([f"gate vs {gate['baseline']}: {decision}" if gate["baseline"] else f"gate: {decision}", *reasons])
    return "\n".join(lines)


def _sample_count(s: Mapping[str, Any]) -> str:
    """The samples the figures cover, and of how many planned when a run drew fewer (a
    budget stopped it, a sequential run decided early)."""
    planned = s["cases"] * s["n"]
    if s["samples"] == planned:
        return f"{s['cases']} cases x n={s['n']} = {planned} samples"
    return f"{s['samples']} of {s['cases']} cases x n={s['n']} = {planned} samples"


def sequential_line(seq: Mapping[str, Any]) -> str:
    """How a --sequential run ended: stopped early on a decision, or after every round."""
    how = (f"stopped early ({seq['decision']})" if seq["stopped_early"] else "ran to the end")
    return (f"sequential: {how} after {seq['rounds']} of {seq['planned_rounds']} rounds,"
            f" {seq['samples_drawn']} of {seq['samples_planned']} samples")
