"""How a run is made: `RunConfig`, every option of `evalpipe run` (and of the flow's parameter
form, and of `evalpipe.evaluate`) as one typed, frozen value, built once at the top and read
by the loop, instead of parameters threaded through each layer and environment variables.
Each field declares the whole option: its help (`description`), bounds and default (`Field`),
and its flag and environment variable (`tasks.run.options.Flag`); `evalpipe run`'s options are
generated from the fields (`flows/cli/run_options.py`), so a new option is one field. The
documented `EVALPIPE_*` overrides of its defaults (the agent's settings, the price file) are
read here, once, by `RunConfig.build`: nothing below reads them."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.agents import DEFAULT_AGENT_TIMEOUT_S, AgentSettings
from tasks.agents.settings import ENV as AGENT_ENV
from tasks.metrics.cost import PRICES_ENV
from tasks.metrics.diff import Metric, check_metric
from tasks.metrics.rules import GateRules
from tasks.metrics.sequential import DEFAULT_ROUNDS
from tasks.models import MAX_N, MAX_REGRADE, MAX_ROUNDS, MAX_WORKERS, InputError
from tasks.run.budget import Budget
from tasks.run.options import Flag, env_overrides, increases, parse_ks, slice_thresholds

Runner = Literal["threads", "processes", "dask"]

# Agent calls wait on an API or a coding agent's minutes, not on a core: many may be in
# flight on a small machine. Grading runs tests, about one per core (`workers`).
DEFAULT_AGENT_CONCURRENCY = 16


class RunConfig(BaseModel):
    """A run's options; the fields are the flow's parameters (docs/contract.md: `run`'s options)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    suite: Annotated[str, Field(description="Suite file, git URL#PATH (URL@REF#PATH), or stored version."),
                     Flag(argument=True)]
    agent: Annotated[str, Field(description="Agent spec (python:, cmd:, replay:, reference, openai:).")]
    n: Annotated[int, Field(ge=1, le=MAX_N, description="Samples per case."), Flag("-n")] = 1
    k: Annotated[tuple[int, ...], Field(min_length=1, description="Comma-separated k values for pass@k."),
                 Flag("-k", text=str, parse=parse_ks, text_default="1")] = (1,)
    seed: Annotated[int, Field(
        ge=0, description="Run seed; with a deterministic agent, the same seed gives the same run.")] = 0
    workers: Annotated[int | None, Field(ge=1, le=MAX_WORKERS, description="Parallel graders (default: CPU count).")] = None
    agent_concurrency: Annotated[int | None, Field(
        ge=1, le=MAX_WORKERS, description="Agent calls in flight (default 16): they wait on an API, not on a core.")] = None
    runner: Annotated[Runner, Field(description="threads, processes or dask."), Flag(text=str)] = "threads"
    dask_address: Annotated[str | None, Field(
        description="With --runner dask: an existing Dask scheduler (tls://HOST:PORT).")] = None
    batch_size: Annotated[int | None, Field(
        ge=1, description="Cases per task (default: as many as fit about 2 s).")] = None
    regrade: Annotated[int, Field(ge=0, le=MAX_REGRADE, description="Re-grade each output R times.")] = 0
    baseline: Annotated[str | None, Field(
        description="Gate against this run (id, unambiguous prefix, or 'previous').")] = None
    min_pass_at_1: Annotated[float | None, Field(
        ge=0, le=1, description="Block when the run's pass@1 is below this.")] = None
    max_drop: Annotated[float, Field(
        ge=0, le=1, description="Block only when the drop in pass@1 vs the baseline is surely larger than this"
                                " (CI wholly below -D).")] = 0.0
    max_new_failures: Annotated[int | None, Field(
        ge=0, description="Gate rule: block when more than N always-passing cases now fail.")] = None
    min_slice: Annotated[dict[str, Annotated[float, Field(ge=0, le=1)]] | None, Field(
        description="Gate rule: block when the slice is below X; repeatable."),
        Flag(metavar="SLICE=X", text=list[str], parse=slice_thresholds)] = None
    # figure → the largest relative growth per sample allowed (`--max-increase tool_calls=0.2`).
    max_increase: Annotated[dict[str, Annotated[float, Field(ge=0)]] | None, Field(
        description="Block when a figure per sample (turns, tool_calls, tokens, cost) grew by more than FRACTION"
                    " (0.2: 20 %) over the baseline, the whole paired CI above it; repeatable."),
        Flag(metavar="FIGURE=FRACTION", text=list[str], parse=increases)] = None
    metric: Annotated[Metric, Field(
        description="What the paired CI compares: pass (pass@1), score (mean score), or a registered per-case"
                    " metric by name (pass@1, mean_score, a plugin's).")] = "pass"
    unsafe_no_sandbox: Annotated[bool, Field(
        description="Without bubblewrap, run the suite's code unprotected instead of refusing.")] = False
    max_output_bytes: Annotated[int | None, Field(
        ge=1, description="Cap on each agent output (default 4 MB; $EVALPIPE_MAX_OUTPUT_BYTES)."),
        Flag(env=AGENT_ENV["max_output_bytes"])] = None
    cmd_timeout: Annotated[float | None, Field(
        gt=0, description="Seconds a cmd: agent may take per sample (default 300; $EVALPIPE_AGENT_TIMEOUT_S)."),
        Flag(metavar="SECONDS", env=AGENT_ENV["cmd_timeout"])] = None
    openai_timeout: Annotated[float | None, Field(
        gt=0, description="Seconds per request of an openai: agent (default 60; $EVALPIPE_OPENAI_TIMEOUT_S)."),
        Flag(metavar="SECONDS", env=AGENT_ENV["openai_timeout"])] = None
    openai_max_attempts: Annotated[int | None, Field(
        ge=1, description="Requests an openai: agent makes per sample, retries included (default 5;"
                          " $EVALPIPE_OPENAI_MAX_ATTEMPTS)."),
        Flag(metavar="N", env=AGENT_ENV["openai_max_attempts"])] = None
    workspace: Annotated[bool, Field(
        description="Run a cmd:/python: coding agent per sample in a fresh checkout of the case's base commit,"
                    " sandboxed; its output is the change it leaves there.")] = False
    agent_timeout: Annotated[float | None, Field(
        gt=0, description="With --workspace: seconds per agent run (default 1800)."), Flag(metavar="SECONDS")] = None
    agent_memory_mb: Annotated[int | None, Field(
        ge=1, description="With --workspace: the agent's address-space cap (default 8192;"
                          " $EVALPIPE_AGENT_MEMORY_MB)."),
        Flag(metavar="MB", env=AGENT_ENV["agent_memory_mb"])] = None
    workspace_tree_mb: Annotated[int | None, Field(
        ge=1, description="With --workspace: cap on the files the agent leaves (default 4096;"
                          " $EVALPIPE_WORKSPACE_TREE_MB)."),
        Flag(metavar="MB", env=AGENT_ENV["workspace_tree_mb"])] = None
    workspace_change_bytes: Annotated[int | None, Field(
        ge=1, description="With --workspace: cap on the agent's change (default 4 MB;"
                          " $EVALPIPE_WORKSPACE_CHANGE_BYTES)."),
        Flag(metavar="N", env=AGENT_ENV["workspace_change_bytes"])] = None
    max_model_calls: Annotated[int | None, Field(
        ge=1, description="Model calls one sample may make (the openai: tool loop's turns, a workspace agent's"
                          " calls through the gateway); the call past it is refused and the sample is agent_error"
                          " naming the cap."),
        Flag(metavar="N", env=AGENT_ENV["max_model_calls"])] = None
    max_sample_cost: Annotated[float | None, Field(
        gt=0, description="USD one sample's model calls through the gateway may cost, priced as the run's usage:"
                          " the call that would pass it (at the dearest call so far) is refused and the sample is"
                          " agent_error naming the cap."),
        Flag(metavar="USD", env=AGENT_ENV["max_sample_cost"])] = None
    model_concurrency: Annotated[int | None, Field(
        ge=1, description="Model calls in flight at once across the run (default: no cap beyond"
                          " --agent-concurrency), through the gateway and an in-process agent's OpenAI SDK."),
        Flag(metavar="N", env=AGENT_ENV["model_concurrency"])] = None
    replay_model_calls: Annotated[bool, Field(
        description="Keep each model call made through the gateway or an in-process agent's OpenAI SDK, and answer"
                    " a call identical to one an earlier run of this agent spec kept for the same case, sample index"
                    " and seed (same request body, same ordinal among identical requests) from it, with no upstream"
                    " call.")] = False
    fresh: Annotated[bool, Field(
        description="Draw every sample from the agent again, taking no output nor verdict from the cache (what"
                    " the cache cannot see changed: a venv's packages, a model behind the same endpoint); the"
                    " outputs drawn are kept, and later runs reuse them.")] = False
    max_trajectory_bytes: Annotated[int | None, Field(
        ge=1, description="With --workspace: cap on the trajectory kept (default 1 MB;"
                          " $EVALPIPE_MAX_TRAJECTORY_BYTES)."),
        Flag(metavar="N", env=AGENT_ENV["max_trajectory_bytes"])] = None
    max_cost: Annotated[float | None, Field(
        gt=0, description="Start no new agent call once the drawn samples cost this much; the run ends partial"
                          " (exit 6). The same command with a larger budget draws the rest."),
        Flag(metavar="USD")] = None
    max_samples: Annotated[int | None, Field(
        ge=1, description="Draw at most N samples from the agent (cached outputs are free); the run ends partial"
                          " (exit 6) if more were needed."),
        Flag(metavar="N")] = None
    prices: Annotated[str | None, Field(
        description="Price file (YAML/JSON: model -> input_per_mtok, output_per_mtok) over genai-prices' table"
                    " (default: $EVALPIPE_PRICES)."),
        Flag(env=PRICES_ENV, text=Path, parse=str)] = None
    sequential: Annotated[bool, Field(
        description="With --baseline: draw cases in a seeded random order, in rounds, and stop as soon as the"
                    " gate's decision cannot change (anytime-valid).")] = False
    sequential_rounds: Annotated[int, Field(
        ge=1, le=MAX_ROUNDS, description="Rounds (looks) of --sequential."), Flag("--rounds")] = DEFAULT_ROUNDS

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, metric: str) -> Metric:
        return check_metric(metric)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        """The options that only mean something together: refused here, whoever builds the run."""
        if self.dask_address and self.runner != "dask":
            raise ValueError("--dask-address goes with --runner dask")
        if self.agent_timeout is not None and not self.workspace:
            raise ValueError("--agent-timeout goes with --workspace")
        # --min-pass-at-1 and --min-slice read the run alone and decide without a baseline.
        if not self.baseline and (self.max_drop != GateRules.max_drop or self.max_new_failures is not None
                                  or self.max_increase):
            raise ValueError("--max-drop, --max-new-failures and --max-increase compare with a baseline: they go"
                             " with --baseline")
        GateRules(max_increase=self.max_increase or {})  # a figure it cannot bound is refused here
        if self.sequential and not self.baseline:
            raise ValueError("--sequential needs --baseline: it stops when the comparison with the baseline is"
                             " decided")
        return self

    @classmethod
    def build(cls, command: str, named: Callable[[str], str] = lambda field: field,
              environ: Mapping[str, str] | None = None, **options: Any) -> RunConfig:
        """The configuration of `options`, or `InputError`: one line, prefixed by `command`,
        naming the option as `named` shows a field (`--max-cost` on the command line). An
        option not given (None) takes its documented override from `environ` (default: this
        process's environment; the variable its field declares, `Flag.env`), read here once."""
        environ = os.environ if environ is None else environ
        overrides = env_overrides(cls.model_fields, environ)
        options = {**options, **{name: value for name, value in overrides.items() if options.get(name) is None}}
        try:
            return cls(**options)
        except ValidationError as exc:
            first = exc.errors()[0]
            if first["type"] == "value_error":  # a rule between options, or a check's own line
                raise InputError(f"{command}: {first['ctx']['error']}") from None
            where = ".".join(named(str(part)) if i == 0 else str(part) for i, part in enumerate(first["loc"]))
            raise InputError(f"{command}: {where}: {first['msg']}") from None

    @property
    def grade_workers(self) -> int:
        """Grading's concurrency: `workers`, default one per core."""
        return self.workers or os.cpu_count() or 1

    @property
    def draw_slots(self) -> int:
        """Drawing's concurrency: `agent_concurrency`, default DEFAULT_AGENT_CONCURRENCY."""
        return self.agent_concurrency or DEFAULT_AGENT_CONCURRENCY

    @property
    def grades_where_drawn(self) -> bool:
        """Whether every output is graded by the task that drew it, not only the cheap graders'
        (`GraderSpec.inline`): on a Dask cluster both stages run on the same workers, and a
        grading task of its own sends the outputs through this process and back, and leaves a
        worker's thread to draws and grades by turns (each waiting on the other)."""
        return self.runner == "dask"

    @property
    def stage_slots(self) -> int:
        """Draw tasks in flight: `draw_slots`, or where they grade too, the graders' as well."""
        return max(self.draw_slots, self.grade_workers) if self.grades_where_drawn else self.draw_slots

    @property
    def agent_settings(self) -> AgentSettings:
        """The settings the agent takes from the run (those not given: the built-in defaults)."""
        given = {name: getattr(self, name) for name in AgentSettings.model_fields}
        return AgentSettings(**{name: value for name, value in given.items() if value is not None})

    @property
    def output_cap(self) -> int:
        """The cap on each agent output in bytes."""
        return self.agent_settings.max_output_bytes

    @property
    def agent_timeout_s(self) -> float | None:
        """Seconds each coding agent run may take: with `workspace` only."""
        return (self.agent_timeout or DEFAULT_AGENT_TIMEOUT_S) if self.workspace else None

    @property
    def rules(self) -> GateRules:
        """The gate's rules these options state (the suite's must-pass cases are added where
        the run's suite is known)."""
        return GateRules(max_new_failures=self.max_new_failures, slice_min=self.min_slice or {},
                         min_pass_at_1=self.min_pass_at_1, max_drop=self.max_drop,
                         max_increase=self.max_increase or {})

    @property
    def budget(self) -> Budget:
        return Budget(max_cost_usd=self.max_cost, max_samples=self.max_samples)

    def recorded(self, **resolved: Any) -> dict[str, Any]:
        """The `config` stored with the run (`runs.config`): the options that shape it, with
        what was resolved at its start (`resolved`: the pinned suite, the sandbox, ...)."""
        return {"runner": self.runner, "workers": self.grade_workers, "agent_concurrency": self.draw_slots,
                "batch_size": self.batch_size, "regrade": self.regrade, "baseline": self.baseline,
                "min_pass_at_1": self.min_pass_at_1, "max_drop": self.max_drop,
                "max_new_failures": self.max_new_failures, "min_slice": self.min_slice, "metric": self.metric,
                **({"max_increase": self.max_increase} if self.max_increase else {}),
                "suite_ref": self.suite, "workspace": self.workspace, "agent_timeout_s": self.agent_timeout_s,
                "max_cost": self.max_cost, "max_samples": self.max_samples,
                **({"replay_model_calls": True} if self.replay_model_calls else {}),
                **({"fresh": True} if self.fresh else {}),
                "agent_settings": self.agent_settings.model_dump(), **resolved}
