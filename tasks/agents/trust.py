"""Which agents a Prefect deployment runs. A deployment's run form (the UI's custom run, the
API's create_flow_run) takes parameters from anyone who may start a run, and `python:` and
`cmd:` agents (every kind registered with `runs_code`), like `unsafe_no_sandbox`, run code as
the worker's user. So a deployment runs
them only when its own configuration says so: the agent its parameters name, or the kinds
its job variables allow in EVALPIPE_DEPLOYMENT_ALLOWS. A form's `dask_address` would send
the run's tasks, the Prefect auth string in their context, to whatever scheduler it names:
only the deployment's own, or a `tls://` one (the worker's certificates decide which)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tasks.registry import agent_kinds

ALLOW_ENV = "EVALPIPE_DEPLOYMENT_ALLOWS"  # comma-separated: python, cmd, unsafe-no-sandbox
UNSAFE = "unsafe-no-sandbox"


def deployment_refusal(agent: str, unsafe_no_sandbox: bool, configured: Mapping[str, Any],
                       allows: str, dask_address: str | None = None) -> str | None:
    """Why a deployment's flow run must not run these parameters, or None. `configured`: the
    deployment's own parameters; `allows`: its EVALPIPE_DEPLOYMENT_ALLOWS."""
    if dask_address and dask_address != configured.get("dask_address") and not dask_address.startswith("tls://"):
        return (f"dask_address {dask_address!r}: this deployment sends its tasks only to its own scheduler or"
                " a tls:// one (docs/deployments.md)")
    allowed = {word.strip().lower() for word in allows.split(",") if word.strip()}
    kind = agent.split(":", 1)[0].strip().lower()
    registered = agent_kinds().get(kind)
    if registered is not None and registered.runs_code and kind not in allowed and agent != configured.get("agent"):
        return (f"agent {agent!r}: this deployment runs {kind}: agents only as its own parameters "
                f"name them; allow any with {ALLOW_ENV}={kind} in its job variables (docs/deployments.md)")
    if unsafe_no_sandbox and UNSAFE not in allowed and not configured.get("unsafe_no_sandbox"):
        return (f"unsafe_no_sandbox: this deployment does not run code unprotected; allow it with "
                f"{ALLOW_ENV}={UNSAFE} in its job variables (docs/deployments.md)")
    return None
