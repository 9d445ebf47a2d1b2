"""`--workspace`: a coding agent (`cmd:` or `python:`) run in a fresh checkout of its
case's base commit, confined in the sandbox; its output is the change it left there.

Per sample (docs/agents.md, "Coding agents"):
- a workspace (`tasks.repos.workspaces`): the base commit checked out from the pooled
  worktrees, a git repository of the agent's own, none of the case's hidden tests (they
  are applied at grading only) and no reference patch (the agent sees the case's inputs);
- the agent runs in bubblewrap with a network of its own (`tasks.sandbox.network`: the
  outside and the endpoints its environment names on this machine's loopback, nothing
  else of the host; `EVALPIPE_AGENT_NETWORK=host` shares the host's instead), the
  workspace and its scratch directory writable, `EVALPIPE_HOME` hidden (the database,
  mirrors, other samples' workspaces), so are the suite file and the case's repository
  source (`concealing`), HOME a scratch directory, a private /tmp, a
  wall-clock timeout, memory and process caps (the run's `AgentSettings`), and the tree's cap
  held on the workspace and its scratch directory while it writes (`DiskCap`); when it exits,
  everything it started is killed. Only the variables of `PASSED_ENV` and `EVALPIPE_AGENT_ENV` reach it;
- what it printed goes to the trace (its tails), its trajectory too; the output graded is
  the change against the base commit (`read_change`).

What the agent sees: its working directory is the workspace (`EVALPIPE_WORKSPACE`), the
case JSON on stdin (and in the file `EVALPIPE_CASE`), `EVALPIPE_PYTHON` the interpreter the
case's tests run with (the case's `environment`, else the harness's),
`EVALPIPE_TRAJECTORY` the file for its steps. A `python:` agent gets the same as
`ctx.workspace`, `ctx.trajectory` (`ctx.record(step)`), run in the sandbox by
`tasks.agents.workspace_host`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tasks.agents.base import AgentContext, AgentError, spec_fingerprint
from tasks.agents.chat import OpenAIAgent, chat_messages
from tasks.agents.cmd import STDERR_TAIL, CmdAgent
from tasks.agents.gateway import grant_for
from tasks.agents.python import PythonAgent
from tasks.agents.settings import AgentSettings
from tasks.agents.toolbox import Toolbox, ToolFailed
from tasks.agents.trajectory import TRAJECTORY_ENV, read_trajectory
from tasks.agents.workspace_tools import WORKSPACE_TOOLS, workspace_handlers
from tasks.callables import load_callable
from tasks.home import HOME_DIR, evalpipe_home
from tasks.models import EvalCase, InputError
from tasks.redaction import redact
from tasks.repos.environments import TESTBED, EnvironmentFailed, runtime_for
from tasks.repos.workspaces import Change, Workspace, read_change, workspace
from tasks.repos.worktrees import RepoError, case_repo, is_url, missing_repo
from tasks.sandbox import DiskCap, Limits, Mounts, SandboxError, bwrap_available, run_command
from tasks.sandbox.namespace import runtime_dirs
from tasks.sandbox.network import agent_network
from tasks.settings import ENV, current
from tasks.trace import ProcessRun, WorkspaceChange

DEFAULT_AGENT_TIMEOUT_S = 1800.0
BASH_TIMEOUT_S = 300.0  # of one `bash` call of an `openai:` workspace agent
# An `openai:` workspace agent's system prompt, unless its spec gives one (`system=`).
WORKSPACE_SYSTEM = ("You work in a git checkout of a repository, at its root. Use the tools to read, run and edit"
                    " its files until the task is done, then answer with a short summary of the change.")
AGENT_MAX_PROCS = 512
AGENT_FILE_SIZE_MB = 1024
EXTRA_ENV = ENV["agent_env"]  # more variable names to pass (`MachineSettings.agent_env`)
# What reaches the agent from the harness's environment besides PATH and the locale: the
# model endpoints' keys and addresses, and proxies.
PASSED_ENV = (
    "OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_ORG_ID", "OPENAI_PROJECT_ID",
    "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "GEMINI_API_KEY", "GOOGLE_API_KEY",
    "MISTRAL_API_KEY", "OPENROUTER_API_KEY", "TOGETHER_API_KEY", "GROQ_API_KEY",
    "DEEPSEEK_API_KEY", "HF_TOKEN", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
    "http_proxy", "https_proxy", "no_proxy",
)  # fmt: skip
# Where the user's credentials usually are, under their home: hidden from the agent,
# whose network is on (the rest of the machine is read-only, not hidden).
CREDENTIALS = (
    ".ssh", ".aws", ".azure", ".config/gcloud", ".kube", ".docker", ".gnupg", ".netrc",
    ".git-credentials", ".pypirc", ".npmrc", ".prefect", ".config/gh",
)  # fmt: skip
OUTPUT_TAIL = 16_000  # characters of the agent's stdout and stderr kept in the trace
# In a `cmd:` workspace agent's words: the case's task as text, for the agent CLIs that take it
# as an argument (`mini -t`, `claude -p`, `aider --message`) rather than on stdin.
TASK_WORD = "{task}"


def passed_env_names() -> tuple[str, ...]:
    """The names of the harness's variables a workspace agent is handed: PASSED_ENV and those
    the machine's settings add."""
    return tuple(dict.fromkeys([*PASSED_ENV, *current().agent_env]))


@dataclass(frozen=True)
class WorkspaceAgent:
    """A `cmd:` or `python:` agent run per sample in its own workspace (see the module)."""

    spec: str
    fingerprint: str
    base: Path
    argv: tuple[str, ...]  # cmd: the command; python: the host running the function
    timeout_s: float
    # The agent's own code, shown read-only (`_own_code`): never the working directory.
    visible: tuple[str, ...]
    # Files and folders that hold answers (the suite file: references, hidden tests), hidden
    # from the agent besides EVALPIPE_HOME and each case's repository source.
    concealed: tuple[str, ...] = ()
    # The run's memory cap, caps on the tree, the change and the trajectory: pickled with it.
    settings: AgentSettings = field(default_factory=AgentSettings)
    # An `openai:` agent: the model whose tool loop works the checkout with `WORKSPACE_TOOLS`.
    model: OpenAIAgent | None = None

    @classmethod
    def load(cls, spec: str, base: Path, timeout_s: float = DEFAULT_AGENT_TIMEOUT_S,
             settings: AgentSettings | None = None) -> WorkspaceAgent:
        scheme, _, rest = spec.partition(":")
        if scheme == "cmd":
            inner = CmdAgent.load(spec, rest, base)
            # The agent starts in its workspace: a word naming a file where evalpipe was
            # started (the script, its config) is made absolute, and it and its folder visible.
            files = [(base / w).resolve() if (base / w).is_file() else None for w in inner.argv]
            # A virtual environment's interpreter keeps its path (resolved, it would be the base
            # interpreter, which knows none of the venv's packages), and the venv is shown whole.
            venvs = [_venv_of(base / w) if f else None for f, w in zip(files, inner.argv, strict=True)]
            argv = tuple(os.path.abspath(base / w) if v else str(f) if f else w
                         for f, v, w in zip(files, venvs, inner.argv, strict=True))
            code = [str(p) for f, v in zip(files, venvs, strict=True) if f
                    for p in (v if v else _own_code(f, base))]
        elif scheme == "python":
            inner = PythonAgent.load(spec, rest, base)
            argv = (sys.executable, "-I", "-m", "tasks.agents.workspace_host", rest, str(base))
            source = load_callable(rest, base).source
            code = [str(p) for p in _own_code(source, base)] if source is not None else []
        elif scheme == "openai":
            inner = OpenAIAgent.load(spec, rest, base)
            argv, code = (), []
        else:
            raise InputError(f"agent {spec!r}: --workspace takes a cmd:, python: or openai: agent")
        if timeout_s <= 0:
            raise InputError(f"--agent-timeout {timeout_s:g}: must be positive")
        if bwrap_available():
            agent_network({})  # no pasta and no EVALPIPE_AGENT_NETWORK=host: refused before any work
        settings = settings or AgentSettings()
        shaping = {"inner": inner.fingerprint,
                   "workspace": {"timeout_s": timeout_s, "memory_mb": settings.agent_memory_mb}}
        visible = tuple(dict.fromkeys(code))
        model = inner.with_settings(settings) if isinstance(inner, OpenAIAgent) else None
        return cls(spec, spec_fingerprint(spec, shaping), base, argv, timeout_s, visible, settings=settings,
                   model=model)

    def concealing(self, paths: Iterable[str]) -> WorkspaceAgent:
        """This agent with `paths` (files or folders) hidden from it too."""
        return replace(self, concealed=tuple(dict.fromkeys((*self.concealed, *map(str, paths)))))

    def _code(self, *, dirs: bool) -> tuple[str, ...]:
        return tuple(p for p in self.visible if os.path.isdir(p) == dirs)

    def generate(self, case: EvalCase, ctx: AgentContext) -> str:
        if case.kind != "repo_tests":
            raise AgentError(f"--workspace needs a repo_tests case (a repository and a base commit); "
                             f"case {case.id!r} is graded by {case.kind}")
        params = case.params
        repo = case_repo(case, params.repo)  # beside the suite file, as the grader finds it
        try:
            runtime = runtime_for(params.environment, repo, params.base_commit, needs_pytest=False)
            with workspace(repo, params.base_commit) as ws:
                return self._run(ws, case, ctx, runtime.python, runtime.mounts, repo)
        except (RepoError, EnvironmentFailed, SandboxError) as exc:
            raise AgentError(f"workspace: {exc}") from None

    def _run(self, ws: Workspace, case: EvalCase, ctx: AgentContext, python: str,
             env_mounts: Mounts | None, repo: str) -> str:
        confined = bwrap_available()
        if self.model is not None:
            return self._run_tools(ws, case, ctx, python, env_mounts, repo, confined)
        inside = TESTBED if confined else str(ws.tree)
        case_file = ws.agent_dir / "case.json"
        case_file.write_text(json.dumps(
            {"id": case.id, "inputs": case.inputs, "index": ctx.index, "seed": ctx.seed, "n": ctx.n}))
        passed = {name: os.environ[name] for name in passed_env_names() if name in os.environ}
        # Its OpenAI-compatible calls go through the gateway: recorded, and the key kept outside.
        grant = grant_for(passed, self.settings, ctx)
        if grant is not None:
            passed = grant.environ(passed)
        env = dict(
            passed, EVALPIPE_WORKSPACE=inside, EVALPIPE_CASE=str(case_file), EVALPIPE_PYTHON=python,
            HOME=str(ws.home), **{TRAJECTORY_ENV: str(ws.trajectory)},
            EVALPIPE_CASE_ID=case.id, EVALPIPE_SAMPLE_INDEX=str(ctx.index), EVALPIPE_SEED=str(ctx.seed),
        )
        mounts = self._mounts(ws, env_mounts, repo) if confined else None
        limits = self._limits(self.timeout_s)
        # The case on stdin, as for a `cmd:` agent outside a workspace.
        argv = ["/bin/sh", "-c", 'case=$1; shift; exec "$@" < "$case"', "evalpipe-agent", str(case_file),
                *_with_task(self.argv, case.inputs)]
        # What it writes to the disk (the tree, its git directory and HOME) is capped as it runs.
        cap = self.settings.workspace_caps.tree_bytes
        try:
            result = run_command(argv, workdir=ws.tree, limits=limits, env=env,
                                 # Only the user's variables name endpoints: evalpipe's own carry case data.
                                 network=agent_network(passed) if confined else True, mounts=mounts,
                                 visible=self._code(dirs=True), disk=DiskCap((str(ws.tree), str(ws.agent_dir)), cap))
        finally:
            if grant is not None:
                grant.revoke()
        mask = grant.masked if grant is not None else redact
        ctx.trace.agent_run = ProcessRun(
            returncode=result.returncode, duration_s=round(result.duration_s, 3), isolation=result.isolation,
            stdout_tail=mask(_tail(result.stdout, OUTPUT_TAIL)), stderr_tail=mask(_tail(result.stderr, OUTPUT_TAIL)),
        )
        trajectory = read_trajectory(ws.trajectory, self.settings.max_trajectory_bytes)
        if grant is not None:
            trajectory = grant.settle(ctx, trajectory, self.settings.max_trajectory_bytes)
        if trajectory is not None:
            ctx.trace.trajectory = trajectory
        if result.disk_over is not None:
            raise AgentError(f"stopped: the workspace and its scratch directory held {result.disk_over:,} bytes,"
                             f" over the {cap:,}-byte cap (--workspace-tree-mb)")
        if result.timed_out:
            raise AgentError(f"timed out after {self.timeout_s:g} s")
        if result.returncode != 0:
            code = result.returncode
            how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
            tail = mask(result.stderr.decode("utf-8", "replace")).strip()[-STDERR_TAIL:]
            raise AgentError(f"{how}: {tail}" if tail else how)
        return self._change(ws, ctx)

    def _mounts(self, ws: Workspace, env_mounts: Mounts | None, repo: str) -> Mounts:
        # The repository's source holds its later history (a fix, its tests).
        named = (*self.concealed, repo, *(str(Path.home() / c) for c in CREDENTIALS))
        secret = [Path(p).resolve() for p in named if not is_url(p) and Path(p).exists()]
        return Mounts(
            workdir_at=TESTBED,
            # Its code files after the hidden folders, so that they show even inside one.
            ro=(str(ws.store), *(env_mounts.ro if env_mounts else ()), *self._code(dirs=False)),
            rw=(str(ws.agent_dir),),
            hide=(str(evalpipe_home()), *(str(p) for p in secret if p.is_dir()),
                  *_answer_folders(self.concealed), *_project_homes(self._code(dirs=True))),
            blank=tuple(str(p) for p in secret if p.is_file()),
        )

    def _limits(self, timeout_s: float) -> Limits:
        return Limits(timeout_s=timeout_s, memory_mb=self.settings.agent_memory_mb, max_procs=AGENT_MAX_PROCS,
                      file_size_mb=AGENT_FILE_SIZE_MB)

    def _run_tools(self, ws: Workspace, case: EvalCase, ctx: AgentContext, python: str,
                   env_mounts: Mounts | None, repo: str, confined: bool) -> str:
        """The model's tool loop in the harness, its `bash` calls in the sandbox (no network,
        none of the harness's variables: the key stays with the loop), its file tools on the
        checkout; the output is the change it left, as any workspace agent's."""
        assert self.model is not None
        mounts = self._mounts(ws, env_mounts, repo) if confined else None
        env = {"EVALPIPE_WORKSPACE": TESTBED if confined else str(ws.tree), "EVALPIPE_PYTHON": python,
               "HOME": str(ws.home)}
        cap = self.settings.workspace_caps.tree_bytes
        deadline = time.monotonic() + self.timeout_s

        def bash(command: str) -> tuple[int | str, str, str]:
            left = deadline - time.monotonic()
            if left <= 1:
                raise ToolFailed(f"the agent's {self.timeout_s:g} s (--agent-timeout) are spent")
            result = run_command(["/bin/sh", "-c", command], workdir=ws.tree, limits=self._limits(min(left, BASH_TIMEOUT_S)),
                                 env=env, network=False, mounts=mounts, disk=DiskCap((str(ws.tree), str(ws.agent_dir)), cap))
            if result.disk_over is not None:
                raise ToolFailed(f"stopped: the checkout held {result.disk_over:,} bytes, over the {cap:,}-byte cap")
            status = result.returncode if not result.timed_out else f"timed out after {min(left, BASH_TIMEOUT_S):g} s"
            return status, result.stdout.decode("utf-8", "replace"), result.stderr.decode("utf-8", "replace")

        toolbox = Toolbox.for_case(case).with_handlers(
            list(WORKSPACE_TOOLS), workspace_handlers(ws.tree, bash, self.settings.workspace_caps.change_bytes))
        system = self.model.system or WORKSPACE_SYSTEM
        self.model.run_tools(toolbox, chat_messages(case.inputs, system), ctx)
        return self._change(ws, ctx)

    def _change(self, ws: Workspace, ctx: AgentContext) -> str:
        change = read_change(ws, self.settings.workspace_caps)
        ctx.trace.workspace = _change_note(change)
        if change.binary:
            raise AgentError(
                f"the change has binary files, which a patch cannot carry: {', '.join(change.binary)} "
                "(delete them, or list them in the repository's .gitignore)")
        return change.patch


def check_workspace_repos(cases: Iterable[EvalCase]) -> None:
    """Every repository the cases' workspaces check out is there, beside the suite file or
    at a URL; a missing one is bad input (exit 2) naming the case and the path, before any
    agent call, not an agent_error on every sample."""
    for case in cases:
        if case.kind == "repo_tests" and (line := missing_repo(case, case.params.repo)):
            raise InputError(line)


def _with_task(argv: tuple[str, ...], inputs: dict) -> list[str]:
    """`argv` with `{task}` in its words replaced by the case's task: its user messages' text,
    as an `openai:` agent is told it (`chat_messages`)."""
    if not any(TASK_WORD in word for word in argv):
        return list(argv)
    task = "\n\n".join(str(m["content"]) for m in chat_messages(inputs) if m.get("role") == "user")
    return [word.replace(TASK_WORD, task) for word in argv]


def _venv_of(command: Path) -> list[Path] | None:
    """For an interpreter in a virtual environment (`VENV/bin/python`): the venv's folder and
    the installation it was made from (`home` in its pyvenv.cfg), to show read-only; else None."""
    root = Path(os.path.abspath(command)).parent.parent
    try:
        config = (root / "pyvenv.cfg").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    homes = [line.partition("=")[2].strip() for line in config.splitlines() if line.partition("=")[0].strip() == "home"]
    made_from = [Path(homes[0]).resolve().parent] if homes and Path(homes[0]).is_dir() else []
    return [root, *made_from]


def _own_code(source: Path, base: Path) -> list[Path]:
    """What of an agent's code to show: its file (a python: agent's module: its top package),
    and the folder that holds it, unless that folder is the working directory `base` or
    holds it (a project's answers, its `.evalpipe`): then the file alone."""
    top = source
    while (top.parent / "__init__.py").is_file():
        top = top.parent
    folder = top.parent
    return [top] if base.resolve().is_relative_to(folder) else [top, folder]


def _answer_folders(concealed: Iterable[str]) -> list[str]:
    """The folders of the files that hold answers (the suite's: gold patches sit beside it),
    but not one that holds the runtimes, which every sandbox shows (the file itself is
    hidden all the same)."""
    runtimes = runtime_dirs()
    folders = []
    for path in map(Path, concealed):
        folder = path if path.is_dir() else path.parent
        if folder != Path("/") and not any(Path(r).is_relative_to(folder) for r in runtimes):
            folders.append(str(folder))
    return folders


def _project_homes(code: Iterable[str]) -> list[str]:
    """The `.evalpipe` folders of projects in what the sandbox shows (the runtimes: a
    project's venv or a PYTHONPATH; the agent's code), at the top or one level down:
    another home's runs."""
    found = []
    for shown in (*runtime_dirs(), *code):
        for pattern in (HOME_DIR, f"*/{HOME_DIR}"):
            found += [str(p) for p in Path(shown).glob(pattern) if p.is_dir()]
    return found


def _change_note(change: Change) -> WorkspaceChange:
    if change.removed:
        return WorkspaceChange(files=list(change.files), removed=list(change.removed))
    return WorkspaceChange(files=list(change.files))


def _tail(data: bytes, size: int) -> str:
    return data.decode("utf-8", "replace")[-size:]
