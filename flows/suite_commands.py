"""`evalpipe suite mine` (the `mine_suite` flow, `flows/mining.py`) and `evalpipe suite export`.
Mounted in `flows/cli/suite.py`; Prefect, storage and core imports are inside the commands, so
`evalpipe --help` stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.output import json_doc
from tasks.models import InputError

JsonFlag = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document.")]


def mine(
    repo: Annotated[str, typer.Argument(help="The repository: a path or a git URL.")],
    out: Annotated[Path, typer.Option("--out", help="Suite file to write (.yaml or .jsonl).")],
    since: Annotated[str | None, typer.Option("--since", help="Walk back to this revision (not included).")] = None,
    until: Annotated[str | None, typer.Option("--until", help="Walk back from this revision (default HEAD).")] = None,
    max_commits: Annotated[int | None, typer.Option(
        "--max", min=1, help="Walk at most N first-parent commits.")] = None,
    paths: Annotated[list[str] | None, typer.Option(
        "--paths", metavar="GLOB",
        help="A candidate must change a non-test file matching GLOB (fnmatch, * crosses /; repeatable;"
             " default *.py).")] = None,
    environment: Annotated[Path | None, typer.Option(
        "--environment", help="YAML: the environment (python, install) for every commit, or a list of"
                              " {since, until, environment} by commit date; default: inferred per commit.")] = None,
    reps: Annotated[int, typer.Option("--reps", min=2, max=20, help="Runs of each side (before, with the fix).")] = 2,
    workers: Annotated[int, typer.Option("--workers", min=1, max=64, help="Candidates run at once.")] = 2,
    unsafe_no_sandbox: Annotated[bool, typer.Option(
        "--unsafe-no-sandbox", help="Without bubblewrap, run the repository's code unprotected.")] = False,
    issues: Annotated[str | None, typer.Option(
        "--issues", metavar="github|FILE",
        help="Add the text of the issues a commit message links (#N, fixes #N, an issue URL) to the problem"
             " statement, from: github (the REST API; GITHUB_TOKEN if set; answers cached in EVALPIPE_HOME)"
             " or FILE (JSON lines of {number, title, body}). An issue that cannot be had is named in the"
             " case's metadata, never fails the mine. Default: the message alone.")] = None,
    github_api: Annotated[str, typer.Option(
        "--github-api", metavar="URL", help="The GitHub REST API's base URL (GitHub Enterprise:"
                                            " https://HOST/api/v3).")] = "https://api.github.com",
    github_repo: Annotated[str | None, typer.Option(
        "--github-repo", metavar="OWNER/NAME",
        help="The repository on GitHub whose issues #N are (default: from REPO's remote URL).")] = None,
    issues_from_other_repos: Annotated[bool, typer.Option(
        "--issues-from-other-repos",
        help="Also fetch the issues of other repositories a message names (org/repo#N): a token may see"
             " private ones, copied into a suite that may be shared. Default: the mined repository's only.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Mine REPO's first-parent history into a suite of SWE-style repo_tests cases: commits that
    change code and tests, whose tests fail before the fix and pass with it, every time.
    Exit 1 when no candidate was kept (nothing written)."""
    from tasks.repos.env_inference import load_environment_rules
    from tasks.repos.issues import issue_source
    from tasks.repos.worktrees import source_of
    from tasks.sandbox import run_sandbox_mode
    from tasks.suites.dataset import SuiteError

    # Bad input exits 2 here, before Prefect starts.
    source_of(repo)
    if out.suffix.lower() not in (".yaml", ".yml", ".jsonl"):
        raise SuiteError(f"{out}: unknown suite format {out.suffix!r} (expected .yaml, .yml or .jsonl)")
    if environment is not None:
        load_environment_rules(environment)
    issue_source(issues, source_of(repo), api=github_api, github_repo=github_repo, cache_dir=Path())
    run_sandbox_mode(("repo_tests",), unsafe_no_sandbox)
    from flows.prefect_api import prefect_api

    with prefect_api(as_json) as watch:
        from flows.mining import mine_suite

        report = watch(mine_suite)(
            repo=repo, out=str(out), since=since, until=until, max_commits=max_commits, paths=paths,
            environment=str(environment) if environment else None, reps=reps, workers=workers,
            unsafe_no_sandbox=unsafe_no_sandbox, issues=issues, github_api=github_api, github_repo=github_repo,
            issues_from_other_repos=issues_from_other_repos)
    from tasks.report.mining_text import mining_text

    typer.echo(json_doc(report) if as_json else mining_text(report))
    if not report["kept"]:
        raise typer.Exit(1)


def export(
    suite: Annotated[str, typer.Argument(help="Suite file, git URL#PATH (URL@REF#PATH), or stored version.")],
    out: Annotated[Path, typer.Option("--out", help="The file to write (JSON Lines).")],
    fmt: Annotated[str, typer.Option("--format", help="swebench: SWE-bench's instance records.")] = "swebench",
    as_json: JsonFlag = False,
) -> None:
    """Write a suite's cases in another harness's format (SWE-bench instances, one per line)."""
    from storage.store import Store
    from storage.suites import load_suite_ref
    from tasks.suites.exporters import FORMATS, swebench_instances, write_instances

    if fmt not in FORMATS:
        raise InputError(f"--format: expected {' or '.join(FORMATS)}, got {fmt!r}")
    suite_obj = load_suite_ref(suite, Store.default().snapshots)
    instances = swebench_instances(suite_obj)
    write_instances(instances, out)
    doc = {"format": fmt, "instances": len(instances), "out": str(out), "version": suite_obj.version}
    typer.echo(json_doc(doc) if as_json else f"wrote {len(instances)} SWE-bench instances to {out}"
                                             f" (suite {suite_obj.version[:12]})")
