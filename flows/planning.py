"""`evalpipe plan`: how many cases × samples a comparison needs (`tasks.metrics.power`), from a
stored baseline run's per-case pass rates or from a stated prior pass rate. Mounted in
`flows/cli/__init__.py`; storage and core imports are inside the command, so `evalpipe --help` stays fast."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from flows.output import json_doc
from tasks.models import InputError

if TYPE_CHECKING:
    from storage.store import Store


def plan(
    suite: Annotated[str | None, typer.Argument(
        help="Suite file, git URL#PATH or stored version: its case count bounds the cases"
             " (default with --baseline: the baseline's suite).")] = None,
    detect: Annotated[float | None, typer.Option(
        "--detect", help="Required: the paired drop to catch, as a fraction (0.05 = 5 points).")] = None,
    baseline: Annotated[str | None, typer.Option(
        "--baseline", help="A stored run: its per-case pass rates give the variances.")] = None,
    prior: Annotated[float | None, typer.Option(
        "--prior", help="Without a baseline: the pass rate to assume (0..1).")] = None,
    power: Annotated[float, typer.Option("--power", help="Chance of catching the drop.")] = 0.8,
    alpha: Annotated[float, typer.Option("--alpha", help="The gate's CI is 1 - alpha (two-sided).")] = 0.05,
    correlation: Annotated[float | None, typer.Option(
        "--correlation", help="Assumed correlation of the two runs' per-case pass rates (default 0.5).")] = None,
    max_samples: Annotated[int, typer.Option("--max-samples", min=1, help="The most samples per case to consider.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print exactly one JSON document.")] = False,
) -> None:
    """Cases x samples per case to catch a paired drop of --detect with --power; the trade-off
    table. Exit 2 (one line naming the smallest detectable drop) when the suite is too small."""
    from storage.store import Store
    from tasks.metrics import power as pw
    from tasks.report.plan_text import plan_text

    if detect is None:  # checked here: a missing required option would exit 2 without a word
        raise InputError("plan: --detect D is required (the paired drop to catch, e.g. 0.05 for 5 points)")
    if (baseline is None) == (prior is None):
        raise InputError("plan: give --baseline RUN_ID (measured variances) or --prior P (assumed), not both")
    if prior is not None and suite is None:
        raise InputError("plan: --prior needs the SUITE whose cases it plans for")
    variance, suite_cases = _variance(baseline, prior, suite, Store.default())
    rho = pw.DEFAULT_CORRELATION if correlation is None else correlation
    result = pw.plan(variance, detect, suite_cases=suite_cases, power=power, alpha=alpha, correlation=rho,
                     max_samples=max_samples)
    doc = result.to_json()
    if correlation is None:
        doc["assumptions"].append(f"a correlation of {rho:g} between the two runs' per-case pass rates"
                                  " (--correlation)")
    typer.echo(json_doc(doc) if as_json else plan_text(doc))
    if not result.reachable:
        typer.echo(f"evalpipe: plan: {suite_cases} cases cannot detect a drop of {100 * detect:g} points with"
                   f" power {power:g} at up to {max_samples} samples per case; the smallest detectable drop is"
                   f" {100 * result.smallest_detectable:.1f} points", err=True)
        raise typer.Exit(2)


def _variance(baseline: str | None, prior: float | None, suite: str | None, store: Store):
    from tasks.metrics import power as pw

    suite_cases = None
    if suite is not None:
        from storage.suites import load_suite_ref

        suite_cases = len(load_suite_ref(suite, store.snapshots).cases)
    if baseline is None:
        return pw.variance_from_prior(prior), suite_cases  # type: ignore[arg-type]
    run = store.runs.find(baseline)
    counts = list(store.samples.case_counts(run["run_id"]).values())
    if not counts:
        raise InputError(f"plan: baseline {run['run_id']} has no samples")
    if suite_cases is None:
        suite_cases = len(store.snapshots.cases(run["suite_version"])) or len(counts)
    n, c = zip(*counts, strict=True)
    return pw.variance_from_counts(n, c), suite_cases
