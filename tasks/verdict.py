"""A verdict: how one output was graded (its `Status`, `passed`, `score`, `detail` and the
safety violations found), a frozen value (docs/contract.md §2)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Status(StrEnum):
    """How a sample ended. Only ``passed`` has ``Verdict.passed == True``."""

    passed = "passed"
    failed = "failed"
    empty = "empty"  # no output / empty patch
    not_applied = "not_applied"  # patch did not apply exactly
    scope_violation = "scope_violation"  # edited files outside allowed_files
    timeout = "timeout"
    error = "error"  # the grader or its environment failed
    agent_error = "agent_error"  # the agent raised or exited non-zero


class Verdict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    passed: bool
    score: float = Field(ge=0.0, le=1.0)
    status: Status
    detail: str = ""
    safety: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _passed_iff_status_passed(self) -> Verdict:
        if self.passed != (self.status is Status.passed):
            raise ValueError(f"passed={self.passed} contradicts status {self.status.value!r}")
        return self

    @classmethod
    def ok(cls, detail: str = "", score: float = 1.0, safety: tuple[str, ...] = ()) -> Verdict:
        return cls(passed=True, score=score, status=Status.passed, detail=detail, safety=safety)

    @classmethod
    def fail(
        cls,
        status: Status = Status.failed,
        detail: str = "",
        score: float = 0.0,
        safety: tuple[str, ...] = (),
    ) -> Verdict:
        return cls(passed=False, score=score, status=status, detail=detail, safety=safety)

    def with_safety(self, violations: tuple[str, ...] | list[str]) -> Verdict:
        """The same verdict with safety violations added: safety never changes ``passed``."""
        if not violations:
            return self
        return self.model_copy(update={"safety": self.safety + tuple(violations)})
