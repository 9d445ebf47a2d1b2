"""Which agents a Prefect deployment runs. A deployment's run form (the UI's custom run, the
API's create_flow_run) takes parameters from anyone who may start a run, and `python:` and
`cmd:` agents (every kind registered with `runs_code`), like `unsafe_no_sandbox`, run code as
the worker's user. So a deployment runs
them only when its own configuration says so: the agent its parameters name, or the kinds
its job variables allow in EVALPIPE_DEPLOYMENT_ALLOWS. A form's `dask_address` would send
the run's tasks, the Prefect auth string in their context, to whatever scheduler it names:
only the deployment's own, or a `tls://` one (the worker's certificates decide which). A form's
`suite` names code too (its predicates and judges, a git URL's whole repository, run on the
worker): only the deployment's own suite, or one under a source its allow-list names
(`suite:PREFIX`, a folder of the worker or a URL prefix; `suite` alone: any)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.registry import agent_kinds

ALLOW_ENV = "EVALPIPE_DEPLOYMENT_ALLOWS"  # comma-separated: python, cmd, unsafe-no-sandbox
UNSAFE = "unsafe-no-sandbox"


def deployment_refusal(agent: str | None, unsafe_no_sandbox: bool, configured: Mapping[str, Any],
                       allows: str, dask_address: str | None = None, suite: str | None = None) -> str | None:
    """Why a deployment's flow run must not run these parameters, or None. `configured`: the
    deployment's own parameters; `allows`: its EVALPIPE_DEPLOYMENT_ALLOWS; `agent` None: a
    rescore, which runs none."""
    if dask_address and dask_address != configured.get("dask_address") and not dask_address.startswith("tls://"):
        return (f"dask_address {dask_address!r}: this deployment sends its tasks only to its own scheduler or"
                " a tls:// one (docs/deployments.md)")
    words = [word.strip() for word in allows.split(",") if word.strip()]
    if suite is not None and suite != configured.get("suite") and not _suite_allowed(suite, words):
        return (f"suite {suite!r}: this deployment runs its own suite ({configured.get('suite')!r}) or those under a"
                f" source its job variables allow, {ALLOW_ENV}=suite:FOLDER_OR_URL (docs/deployments.md)")
    allowed = {word.lower() for word in words}
    kind = (agent or "").split(":", 1)[0].strip().lower()
    registered = agent_kinds().get(kind) if agent is not None else None
    if registered is not None and registered.runs_code and kind not in allowed and agent != configured.get("agent"):
        return (f"agent {agent!r}: this deployment runs {kind}: agents only as its own parameters "
                f"name them; allow any with {ALLOW_ENV}={kind} in its job variables (docs/deployments.md)")
    if unsafe_no_sandbox and UNSAFE not in allowed and not configured.get("unsafe_no_sandbox"):
        return (f"unsafe_no_sandbox: this deployment does not run code unprotected; allow it with "
                f"{ALLOW_ENV}={UNSAFE} in its job variables (docs/deployments.md)")
    return None


def _suite_allowed(suite: str, words: list[str]) -> bool:
    """Whether `suite` is under a source an allow-list's `suite:PREFIX` names (a URL prefix ending
    at a path, `#` or `@` boundary; a folder of this machine, `..` and links resolved), or the
    list allows any (`suite`)."""
    for word in words:
        kind, _, prefix = word.partition(":")
        if kind.lower() != "suite":
            continue
        if not prefix:
            return True
        if "://" in prefix or prefix.startswith("git@"):
            rest = suite[len(prefix):] if suite.startswith(prefix) else None
            if rest is not None and (rest == "" or prefix.endswith("/") or rest[0] in "/#@"):
                return True
        elif "://" not in suite and not suite.startswith("git@"):
            if Path(suite).resolve().is_relative_to(Path(prefix).resolve()):
                return True
    return False
