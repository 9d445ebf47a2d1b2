"""The `mine_suite` flow: a repository's history into a validated SWE-style suite.

Walk the first-parent history (`tasks.repos.mining`), give each candidate its environment
(`tasks.repos.env_inference`), build each distinct environment once (a task per spec), then
derive every candidate's tests (`tasks.graders.derivation`), one mapped task per candidate.
A candidate's result is stored under EVALPIPE_HOME/mining/ as soon as it is done
(`storage.mined`), so a killed mine, run again, derives only the rest. The kept candidates
become an ordinary suite file.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote, unmapped
from pydantic import Field

from storage.store import Store
from tasks.graders.derivation import Derivation, derive, mined_case, mining_report, result_key
from tasks.graders.repo_tests import is_test_file
from tasks.params import Environment
from tasks.repos.env_inference import Assigned, assign_environments, load_environment_rules
from tasks.repos.environments import EnvironmentFailed, ensure_environment
from tasks.repos.issues import DEFAULT_API, IssueSource, issue_source, linked_text
from tasks.repos.mining import DEFAULT_CODE_PATHS, Candidate, mine_history
from tasks.repos.worktrees import fetch, mirror, source_of
from tasks.sandbox import allowing_unsafe
from tasks.suites.dataset import build_suite
from tasks.suites.importers import write_suite_file


@task(name="walk history", cache_policy=NO_CACHE, persist_result=False)
def walk(mirror_path: Path, since: str | None, until: str | None, max_commits: int | None,
         paths: list[str]) -> tuple[list[Candidate], list]:
    return mine_history(mirror_path, is_test=is_test_file, since=since, until=until,
                        max_commits=max_commits, code_paths=paths)


@task(name="build environment", cache_policy=NO_CACHE, persist_result=False,
      task_run_name="build environment {fingerprint:.12}")
def build(environment: dict[str, Any], repo: str, fingerprint: str, home: Path) -> dict[str, Any]:
    """The environment's record, or why it cannot be had (`failed`)."""
    start = time.monotonic()
    try:
        meta = ensure_environment(Environment.model_validate(environment), repo,
                                  environment["setup_commit"], home)
    except EnvironmentFailed as exc:
        return {"fingerprint": fingerprint, "failed": str(exc), "seconds": round(time.monotonic() - start, 3)}
    if not meta.get("pytest"):
        return {"fingerprint": fingerprint, "name": meta["name"], "seconds": round(time.monotonic() - start, 3),
                "failed": f"environment {meta['name']} has no pytest, which the tests need"}
    return {"fingerprint": fingerprint, "name": meta["name"], "built": meta["built_now"],
            "build_s": meta.get("build_s"), "seconds": round(time.monotonic() - start, 3)}


@task(name="linked issue text", cache_policy=NO_CACHE, persist_result=False)
def issue_texts(candidates: list[Candidate], source: IssueSource | None) -> dict[str, tuple[str, list[dict]]]:
    """Each candidate's problem statement and what became of its linked issues."""
    return {c.commit: linked_text(c.message, source) for c in candidates}


@task(name="mine candidate", cache_policy=NO_CACHE, persist_result=False,
      task_run_name="mine {candidate.commit:.12}")
def mine_candidate(candidate: Candidate, repo: str, environment: dict | None, reps: int, key: str,
                   store: Store) -> Derivation:
    derivation = derive(candidate, repo, environment, reps)
    store.mined.write(key, derivation.to_json())
    return derivation


@flow(name="mine_suite", persist_result=False, log_prints=False)
def mine_suite(
    repo: Annotated[str, Field(description="Repository: a path or a git URL.")],
    out: Annotated[str, Field(description="Suite file to write (.yaml or .jsonl).")],
    since: Annotated[str | None, Field(description="Walk back to this revision (not included).")] = None,
    until: Annotated[str | None, Field(description="Walk back from this revision (default HEAD).")] = None,
    max_commits: Annotated[int | None, Field(ge=1, description="At most this many first-parent commits.")] = None,
    paths: Annotated[list[str] | None, Field(description="Code files a candidate must change (globs).")] = None,
    environment: Annotated[str | None, Field(description="YAML: the environment, or one per date range.")] = None,
    reps: Annotated[int, Field(ge=2, le=20, description="Runs of each side (before, with the fix).")] = 2,
    workers: Annotated[int, Field(ge=1, le=64)] = 2,
    unsafe_no_sandbox: Annotated[bool, Field(description="Without bubblewrap, run code unprotected.")] = False,
    issues: Annotated[str | None, Field(
        description="Linked issues' text from: github (the REST API) or a JSON-lines export.")] = None,
    github_api: Annotated[str, Field(description="The GitHub REST API's base URL.")] = DEFAULT_API,
    github_repo: Annotated[str | None, Field(
        description="OWNER/NAME on GitHub (default: from the repository's remote URL).")] = None,
    issues_from_other_repos: Annotated[bool, Field(
        description="Also fetch other repositories' issues a message names (org/repo#N).")] = False,
) -> dict[str, Any]:
    start = time.monotonic()
    store = Store.default()
    source = source_of(repo)
    rules = load_environment_rules(Path(environment)) if environment else None
    # The token is read here, never a parameter: Prefect records a flow run's parameters.
    linked = issue_source(issues, source, api=github_api, github_repo=github_repo,
                          cache_dir=store.home / "mining" / "issues", token=os.environ.get("GITHUB_TOKEN") or None,
                          other_repos=issues_from_other_repos)
    mirror_path = mirror(source, store.home)
    fetch(mirror_path, source)  # the source may have moved on since the mirror was made
    candidates, skipped = walk(mirror_path, since, until, max_commits, paths or list(DEFAULT_CODE_PATHS))
    assigned = assign_environments(mirror_path, [(c.commit, c.parent, c.date) for c in candidates], rules)
    keys = {c.commit: result_key(source, c.commit, assigned[c.commit].fingerprint, reps) for c in candidates}
    done = {c.commit: Derivation.from_json(doc) for c in candidates if (doc := store.mined.read(keys[c.commit]))}
    pending = [c for c in candidates if c.commit not in done]
    _say(f"{len(candidates)} candidate(s) in {len(candidates) + len(skipped)} commit(s); "
         f"{len(done)} already derived, {len(pending)} to run")
    failed, environments = _build_environments(pending, assigned, source, store.home, workers)
    unbuildable = {}
    for c in pending:
        a = assigned[c.commit]
        if a.environment is None or a.fingerprint in failed:
            unbuildable[c.commit] = Derivation(c.commit, False, f"environment: {failed.get(a.fingerprint, a.source)}")
    runnable = [c for c in pending if c.commit not in unbuildable]
    derived = {**done, **unbuildable}
    derived |= _derive_all(runnable, assigned, source, reps, keys, store, workers, unsafe_no_sandbox,
                           len(derived), len(candidates))
    name = Path(out).stem  # the suite's name names its cases and, for the agent, the repository
    kept = [c for c in candidates if derived[c.commit].kept]
    texts = issue_texts(kept, linked)
    cases = [(c.commit, mined_case(c, derived[c.commit], case_id=f"{name}-{c.commit[:12]}", repo=source,
                                   repo_name=name, environment=assigned[c.commit].environment,
                                   environment_source=assigned[c.commit].source, linked=texts[c.commit]))
             for c in kept]
    report = mining_report([derived[c.commit] for c in candidates], skipped, environments,
                           seconds=round(time.monotonic() - start, 3), reused=len(done),
                           issues=[r | {"commit": commit} for commit, (_, rs) in texts.items() for r in rs])
    if cases:
        suite = build_suite(Path(out).stem, cases, {}, source=out)
        write_suite_file(suite, Path(out))
        report |= {"out": out, "version": suite.version}
    return report


def _build_environments(pending: list[Candidate], assigned: dict[str, Assigned], repo: str, home: Path,
                        workers: int) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Each distinct environment the pending candidates need, built once: (fingerprint ->
    why it failed, the build records)."""
    needed: dict[str, dict] = {}
    for c in pending:
        a = assigned[c.commit]
        if a.environment is not None:
            needed.setdefault(a.fingerprint, a.environment)
    if not needed:
        return {}, []
    with ThreadPoolTaskRunner(max_workers=min(workers, len(needed))) as runner:
        futures = [runner.submit(build, {"environment": env, "repo": repo, "fingerprint": fp, "home": home})
                   for fp, env in needed.items()]
        records = [f.result() for f in futures]
    for record in records:
        record["candidates"] = sum(assigned[c.commit].fingerprint == record["fingerprint"] for c in pending)
        _say(f"environment {record.get('name', record['fingerprint'][:12])}: "
             + (f"failed: {record['failed']}" if "failed" in record else
                f"{'built' if record['built'] else 'reused'} in {record['seconds']:.1f}s"))
    return {r["fingerprint"]: r["failed"] for r in records if "failed" in r}, records


def _derive_all(runnable: list[Candidate], assigned: dict[str, Assigned], repo: str, reps: int,
                keys: dict[str, str], store: Store, workers: int, unsafe: bool, done: int,
                total: int) -> dict[str, Derivation]:
    """Every runnable candidate's derivation, a mapped task each, progress as they finish."""
    if not runnable:
        return {}
    progress = create_progress_artifact(progress=100 * done / max(total, 1), description="candidates mined")
    derived = {}
    with allowing_unsafe(unsafe), ThreadPoolTaskRunner(max_workers=workers) as runner:
        futures = runner.map(mine_candidate, {
            "candidate": [quote(c) for c in runnable], "repo": unmapped(repo),
            "environment": [assigned[c.commit].environment for c in runnable], "reps": unmapped(reps),
            "key": [keys[c.commit] for c in runnable], "store": unmapped(store),
        })
        for future in as_completed(futures):
            d = future.result()
            derived[d.commit] = d
            done += 1
            _say(f"[{done}/{total}] {d.commit[:12]} {'kept' if d.kept else 'dropped'}: {d.reason} ({d.seconds:.1f}s)")
            update_progress_artifact(progress, 100 * done / total)
    return derived


def _say(message: str) -> None:
    print(f"evalpipe: mine: {message}", file=sys.stderr, flush=True)
