"""A run's settings of its agent (`AgentSettings`): the output cap, the `cmd:` and `openai:`
timeouts, a coding agent's memory and the caps on what it leaves. They are fields of the run's
configuration (`tasks.run.RunConfig`: `run`'s options, the flow's parameters), handed to the
agent when it is loaded, and carried with it wherever it is pickled (`tasks.agents.base.Reloadable`):
an agent re-created on a worker never reads that machine's environment.

The `EVALPIPE_*` variables of `ENV` stay documented overrides of the defaults, read once, where a
run's configuration is built (`RunConfig.build`, from the environment it is handed); nothing
below that reads them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from tasks.repos.workspaces import DEFAULT_CHANGE_BYTES, DEFAULT_TREE_MB, Caps

DEFAULT_MAX_OUTPUT_BYTES = 4 << 20
DEFAULT_TIMEOUT_S = 60.0  # per request to an OpenAI-compatible endpoint
DEFAULT_MAX_ATTEMPTS = 5  # the first request and up to 4 retries
DEFAULT_CMD_TIMEOUT_S = 300.0


class AgentSettings(BaseModel):
    """The settings an agent takes from its run; each field's default is the built-in one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_output_bytes: Annotated[int, Field(ge=1)] = DEFAULT_MAX_OUTPUT_BYTES
    cmd_timeout: Annotated[float, Field(gt=0)] = DEFAULT_CMD_TIMEOUT_S  # seconds per `cmd:` call
    openai_timeout: Annotated[float, Field(gt=0)] = DEFAULT_TIMEOUT_S  # seconds per request
    openai_max_attempts: Annotated[int, Field(ge=1)] = DEFAULT_MAX_ATTEMPTS
    max_trajectory_bytes: Annotated[int, Field(ge=1)] = 1 << 20
    # Model calls one sample may make (the `openai:` tool loop's turns, a workspace agent's calls
    # through the gateway); None: no cap.
    max_model_calls: Annotated[int, Field(ge=1)] | None = None
    # USD one sample's model calls may cost (the call that would pass it is refused), and the
    # model calls in flight across the run, through the gateway; None: no cap.
    max_sample_cost: Annotated[float, Field(gt=0)] | None = None
    model_concurrency: Annotated[int, Field(ge=1)] | None = None
    # A coding agent's (`--workspace`): an address-space cap (runtimes reserve far more than
    # they use), and the caps on the tree it leaves and on its change.
    agent_memory_mb: Annotated[int, Field(ge=1)] = 8192
    workspace_tree_mb: Annotated[int, Field(ge=1)] = DEFAULT_TREE_MB
    workspace_change_bytes: Annotated[int, Field(ge=1)] = DEFAULT_CHANGE_BYTES

    @property
    def workspace_caps(self) -> Caps:
        return Caps(self.workspace_tree_mb << 20, self.workspace_change_bytes)


# Each setting's documented override (docs/contract.md §10), and what its value must be.
ENV: dict[str, str] = {
    "max_output_bytes": "EVALPIPE_MAX_OUTPUT_BYTES",
    "cmd_timeout": "EVALPIPE_AGENT_TIMEOUT_S",
    "openai_timeout": "EVALPIPE_OPENAI_TIMEOUT_S",
    "openai_max_attempts": "EVALPIPE_OPENAI_MAX_ATTEMPTS",
    "max_trajectory_bytes": "EVALPIPE_MAX_TRAJECTORY_BYTES",
    "max_model_calls": "EVALPIPE_MAX_MODEL_CALLS",
    "max_sample_cost": "EVALPIPE_MAX_SAMPLE_COST",
    "model_concurrency": "EVALPIPE_MODEL_CONCURRENCY",
    "agent_memory_mb": "EVALPIPE_AGENT_MEMORY_MB",
    "workspace_tree_mb": "EVALPIPE_WORKSPACE_TREE_MB",
    "workspace_change_bytes": "EVALPIPE_WORKSPACE_CHANGE_BYTES",
}
