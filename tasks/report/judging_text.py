"""The judge, pairwise and human-label documents as text for a terminal (`evalpipe judge
calibrate`, `compare`, `labels import`): percentages, "n/a" where a figure is undefined."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.metrics.percent import ci_text, figure, shown_ci, with_ci


def calibration_text(doc: Mapping[str, Any]) -> str:
    """A judge's calibration against the truth: agreement, kappa, the error rates, the confusion."""
    c = doc["confusion"]
    return "\n".join([
        f"{'trajectory judge' if doc.get('kind') == 'trajectory_judge' else 'judge'} {doc['judge']}"
        f" ({doc['judge_fingerprint'][:12]}) vs {doc['truth']} on {doc['items']}"
        f" {'trajectories' if doc.get('kind') == 'trajectory_judge' else 'outputs'}"
        f" of {doc['cases']} cases; {int(doc['ci_level'] * 100)}% CIs",
        f"agreement       {with_ci(doc, 'agreement')}",
        f"Cohen's kappa   {with_ci(doc, 'kappa')}",
        f"false-pass rate {with_ci(doc, 'false_pass_rate')}  (judge passed, truth failed)",
        f"false-fail rate {with_ci(doc, 'false_fail_rate')}  (judge failed, truth passed)",
        f"confusion tp {c['tp']} fp {c['fp']} fn {c['fn']} tn {c['tn']};"
        f" judge errors {doc['judge_errors']} ({figure(doc['judge_error_rate'])})",
    ])


def pairwise_text(doc: Mapping[str, Any]) -> str:
    """Two runs judged pairwise: A's win rate with its CI, the counts, the position bias."""
    ci, bias = doc["win_rate_a_ci"], doc["position_bias"]
    return "\n".join([
        f"{doc['run_a']} (A) vs {doc['run_b']} (B), judge {doc['judge']}: {doc['pairs']} pairs, {doc['cases']} cases",
        f"win rate of A {figure(doc['win_rate_a'])}"
        + (f" [{figure(ci[0])}, {figure(ci[1])}]" if ci else "")
        + f" ({int(doc['ci_level'] * 100)}% CI; ties and inconsistent pairs count half)",
        f"A wins {doc['wins_a']}  B wins {doc['wins_b']}  ties {doc['ties']}  errors {doc['errors']}",
        f"order-inconsistent {doc['inconsistent']} ({figure(doc['inconsistent_rate'])}):"
        f" first position won both {bias['first']}, second {bias['second']}, mixed {bias['mixed']}",
    ])


def labelled_text(summary: Mapping[str, Any]) -> str:
    """The derived run of imported labels (its `run --json` document) in one line."""
    ci = shown_ci(summary["pass_at_1_ci"], summary["cases"])
    return (f"run {summary['run_id']}: {summary['labelled']} labels by {summary['labeller']} on run"
            f" {summary['source_run']} ({summary['unlabelled']} left blank); human pass@1"
            f" {figure(summary['pass_at_k']['1'])} {ci_text(ci)}"
            + ("; SAFETY FAILED" if summary["safety_failed"] else ""))
