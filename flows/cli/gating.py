"""`evalpipe gate` and `evalpipe report`: a stored run's decision against a baseline, printed
or written as a page (a run's own report too)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from flows.cli.common import METRIC_HELP, JsonFlag, RunArg, bad_input
from flows.cli.run_options import Fields
from flows.diffing import FormatOpt
from flows.output import json_doc

if TYPE_CHECKING:
    from tasks.metrics.rules import GateRules

# The gate's rules, as `run` takes them; not given (None), the decision stored with the run stands.
RuleOptions = Annotated[dict[str, Any], Fields(
    ("min_pass_at_1", "max_drop", "max_new_failures", "min_slice", "max_increase"), unset=True)]


def gate_cmd(
    run_id: RunArg,
    *,
    baseline: Annotated[str, typer.Option(
        "--baseline", help="The run to compare with (id, unambiguous prefix, or 'previous').")],
    given_rules: RuleOptions,
    metric: Annotated[str, typer.Option("--metric", help=METRIC_HELP)] = "pass",
    shared_only: Annotated[bool, typer.Option("--shared-only", help="Compare only shared case hashes.")] = False,
    fmt: FormatOpt = "text",
    as_json: JsonFlag = False,
) -> None:
    """Decide pass/block for RUN_ID against a baseline run; exit 1 when blocked (and only then).

    With no rule option, a run gated against the same baseline when it ran shows that stored
    decision; rule options decide anew by them. Every output states the rules and the baseline."""
    from flows.diffing import output_format
    from tasks.metrics.diff import check_metric
    from tasks.report.gate_text import gate_lines

    fmt = output_format(fmt, as_json)
    rules = _rules(given_rules)
    result, comparison = _decision(run_id, baseline, rules, check_metric(metric), shared_only, fmt)
    if fmt == "json":
        typer.echo(json_doc(result))
    elif fmt == "markdown":
        typer.echo(comparison.markdown(result), nl=False)
    else:
        typer.echo("\n".join(gate_lines(result)))
    if result["decision"] == "block":
        raise typer.Exit(1)


def _rules(given: Mapping[str, Any]) -> GateRules | None:
    """The gate rules given on the command line, or None when no rule option is (then a
    decision stored with the run is shown as it was made)."""
    from tasks.metrics.rules import GateRules

    if all(value is None for value in given.values()):
        return None
    return GateRules(max_new_failures=given["max_new_failures"], slice_min=given["min_slice"] or {},
                     min_pass_at_1=given["min_pass_at_1"], max_drop=given["max_drop"] or 0.0,
                     max_increase=given["max_increase"] or {})


def _decision(run_id: str, baseline: str, rules: Any, metric: str, shared_only: bool, fmt: str):
    """`gate`'s and `report --baseline`'s decision (`service.gate.decision`) with the comparison
    it renders; `previous` resolved to the suite's latest completed run before RUN_ID and
    compared on the shared cases; none: said on one line (`decision` null in JSON), exit 0."""
    from service.gate import decision, pair_runs
    from storage.store import Store
    from tasks.run.prepare import PREVIOUS, find_baseline, no_baseline_message

    store = Store.default()
    run = store.runs.find(run_id)
    found = find_baseline(baseline, run["suite_name"], store, before=run["run_id"])
    if found is None:
        message = no_baseline_message(run["suite_name"], run["run_id"])
        if fmt == "json":
            typer.echo(json_doc({"decision": None, "run_id": run["run_id"], "baseline": None, "no_baseline": message}))
        else:
            typer.echo(f"evalpipe: {message}", err=fmt == "text")
        raise typer.Exit(0)
    baseline, choice, shared_only = found.run_id, found.choice, shared_only or baseline == PREVIOUS
    comparison = pair_runs(run["run_id"], baseline, metric=metric, store=store)
    return decision(comparison, rules, store=store, shared_only=shared_only, choice=choice), comparison



def report_cmd(
    run_id: RunArg,
    *,
    out: Annotated[Path, typer.Option("--out", help="HTML file to write.")],
    baseline: Annotated[str | None, typer.Option(
        "--baseline", help="Write the diff against this run (id, prefix or 'previous') instead: the gate's"
                           " decision, then the changed cases side by side.")] = None,
    given_rules: RuleOptions,
    metric: Annotated[str, typer.Option("--metric", help="With --baseline: " + METRIC_HELP)] = "pass",
) -> None:
    """Write a self-contained HTML report of a stored run (or of what changed against a baseline).

    With --baseline the page shows the decision `gate` gives with the same options: the one
    stored with the run when no rule option is given, else decided by them; it says which."""
    from flows.report import write_diff_report, write_report
    from storage.store import Store
    from tasks.metrics.diff import check_metric

    rules = _rules(given_rules)
    if baseline is None:
        if rules is not None:
            bad_input("--min-pass-at-1, --max-drop, --max-new-failures and --min-slice go with --baseline")
        typer.echo(f"wrote {write_report(run_id, out, Store.default())}")
        return
    # The page compares runs on different suite versions on their shared cases, and says so.
    result, comparison = _decision(run_id, baseline, rules, check_metric(metric), True, "text")
    typer.echo(f"wrote {write_diff_report(comparison, result, out, Store.default())}")
