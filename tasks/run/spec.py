"""What a run is: the `RunSpec` recorded in the `runs` table when it starts, and the
`RunStatus` it ends in."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import PurePath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tasks.models import InputError


class RunStatus(StrEnum):
    """A run's `status` in the `runs` table (docs/storage.md); the stored strings are the values."""

    running = "running"
    completed = "completed"
    partial = "partial"  # a budget left samples undrawn
    failed = "failed"  # the run raised an error
    interrupted = "interrupted"  # stopped (Ctrl-C, a signal, a killed process): the same command resumes it


def new_run_id() -> str:
    return f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


class RunSpec(BaseModel):
    """One run as recorded in the `runs` table when it starts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str = Field(default_factory=new_run_id)
    suite_version: str
    suite_name: str
    agent: str
    agent_fingerprint: str
    n: int = Field(ge=1)
    ks: list[int]
    seed: int = Field(ge=0)
    regrade: int = Field(default=0, ge=0)
    flow_run_id: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)


def run_title(suite_ref: str, agent: str | None, n: int) -> str:
    """A run's name in the Prefect UI: the suite file's stem, the agent, n."""
    return f"{PurePath(suite_ref).stem} · {agent} · n={n}"


def check_ks(ks: Sequence[int]) -> list[int]:
    if any(x < 1 for x in ks):
        raise InputError(f"k: every k must be at least 1, got {list(ks)}")
    return list(ks)
