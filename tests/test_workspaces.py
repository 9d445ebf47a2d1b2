"""`--workspace`: coding agents in a fresh checkout per sample, the change as the output.

The workspace and the change on real git repositories built here; agents run in the real
sandbox (bubblewrap); flow runs on a real Prefect API and DuckDB file; the tool-using
example against a local OpenAI-compatible endpoint that replays tool calls.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import duckdb
import git
import pytest
from support.cli import in_process
from support.git_repos import commit
from support.waiting import serve_in_background

from tasks.agents import AgentSettings, load_agent
from tasks.models import EvalCase, Status
from tasks.repos.patching import apply_patch
from tasks.repos.workspaces import read_change, workspace
from tasks.repos.worktrees import checkout
from tasks.run.sampling import PlannedSample, draw_sample
from tasks.sandbox import policy as sandbox
from tasks.trace import SampleTrace, Truncation

ROOT = Path(__file__).resolve().parent.parent
CALC_SHA = "4d48fe8a75740cd8d064a48e17d2cadbddfa8692"
FIX = ("return abs(a) + b", "return a + b")


def agent_git(tree: Path, *args: str) -> str:
    """git as the agent runs it in its workspace (its own repository, found from `.git`)."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tree), "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=tree, env=env, check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, str, str]:
    """A repository: base commit (.gitignore, files, a binary-free tree), then a later commit
    holding a fix and its test, as a SWE-bench upstream has: (path, base, later)."""
    repo = git.Repo.init(tmp_path / "proj", initial_branch="main")
    base = commit(repo, {".gitignore": "*.log\nbuild/\n", "a.py": "A = 1\n", "b.py": "B = 1\n",
                         "d.txt": "delete me\n", "r.txt": "rename me\n", "pkg/m.py": "M = 1\n"}, "base")
    later = commit(repo, {"a.py": "A = 2\n", "tests/test_hidden.py": "def test_x(): pass\n"}, "fix")
    return tmp_path / "proj", base, later


# ---------------------------------------------------------------- the change, row by row

ROWS = {
    "unstaged": (lambda t: (t / "a.py").write_text("A = 10\n"), {"a.py"}),
    "staged": (lambda t: ((t / "a.py").write_text("A = 11\n"), agent_git(t, "add", "a.py")), {"a.py"}),
    "committed": (lambda t: ((t / "b.py").write_text("B = 2\n"), agent_git(t, "commit", "-qam", "b")), {"b.py"}),
    "new": (lambda t: (t / "pkg" / "new.py").write_text("N = 1\n"), {"pkg/new.py"}),
    "deleted": (lambda t: (t / "d.txt").unlink(), {"d.txt"}),
    "git rm": (lambda t: agent_git(t, "rm", "-q", "d.txt"), {"d.txt"}),
    "renamed": (lambda t: agent_git(t, "mv", "r.txt", "r2.txt"), {"r.txt", "r2.txt"}),
    "ignored": (lambda t: ((t / "x.log").write_text("noise\n"), (t / "build").mkdir(),
                           (t / "build" / "o.txt").write_text("o\n")), set()),
    "nothing": (lambda t: None, set()),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_the_change_is_everything_on_disk_against_the_base(home, project, row):
    path, base, _ = project
    act, expected = ROWS[row]
    with workspace(str(path), base) as ws:
        act(ws.tree)
        change = read_change(ws)
        after = {p: (ws.tree / p).read_bytes() for p in expected if (ws.tree / p).exists()}
    assert set(change.files) == expected and change.binary == ()
    if not expected:
        assert change.patch == ""
        return
    # The patch, applied by the grader to a clean checkout, gives the agent's files.
    with checkout(str(path), base) as clean:
        result = apply_patch(clean, change.patch)
        assert result.applied, result.detail
        assert {p: (clean / p).read_bytes() for p in expected if (clean / p).exists()} == after
        assert {p for p in expected if not (clean / p).exists()} == expected - after.keys()


def test_every_kind_of_change_at_once_and_a_commit_is_diffed_against_the_base(home, project):
    path, base, _ = project
    with workspace(str(path), base) as ws:
        t = ws.tree
        (t / "a.py").write_text("A = 3\n")
        agent_git(t, "commit", "-qam", "one")
        (t / "a.py").write_text("A = 4\n")  # then unstaged on top of the commit
        (t / "c.py").write_text("C = 1\n")
        agent_git(t, "add", "c.py")
        agent_git(t, "commit", "-qm", "two")
        (t / "d.txt").unlink()
        change = read_change(ws)
    assert set(change.files) == {"a.py", "c.py", "d.txt"}
    assert "-A = 1\n+A = 4\n" in change.patch  # base to disk, not HEAD to disk


def test_binary_files_are_named_and_the_agent_is_refused_clearly(home, project, tmp_path):
    path, base, _ = project
    with workspace(str(path), base) as ws:
        (ws.tree / "logo.png").write_bytes(b"\x89PNG\x00\x01\x02")
        (ws.tree / "fifo").parent.mkdir(exist_ok=True)
        os.mkfifo(ws.tree / "fifo")  # git would block on it: removed and named
        change = read_change(ws)
    assert change.binary == ("logo.png",) and change.removed == ("fifo",)


def test_a_nested_repository_is_read_as_its_files(home, project):
    path, base, _ = project
    with workspace(str(path), base) as ws:
        sub = ws.tree / "vendor" / "lib"
        sub.mkdir(parents=True)
        (sub / "lib.py").write_text("L = 1\n")
        agent_git(sub, "init", "-q")
        agent_git(sub, "add", "lib.py")
        agent_git(sub, "-c", "user.name=a", "-c", "user.email=a@a", "commit", "-qm", "x")
        change = read_change(ws)
    assert change.removed == ("vendor/lib/.git",) and change.files == ("vendor/lib/lib.py",)
    assert "+L = 1" in change.patch


def test_the_workspace_holds_no_later_history_and_no_hidden_tests(home, project):
    path, base, later = project
    with workspace(str(path), base) as ws:
        assert not (ws.tree / "tests" / "test_hidden.py").exists()
        assert agent_git(ws.tree, "log", "--all", "--format=%H").split() == [base]
        every = agent_git(ws.tree, "cat-file", "--batch-all-objects", "--batch-check")
        assert later not in every and base in every
        assert agent_git(ws.tree, "status", "--porcelain") == ""


# ---------------------------------------------------------------- the agent in the sandbox


HIDDEN_TEST_PATCH = """diff --git a/test_hidden.py b/test_hidden.py
new file mode 100644
--- /dev/null
+++ b/test_hidden.py
@@ -0,0 +1,2 @@
+def test_hidden():
+    assert "hidden-test-marker"
"""


def calc_case(repo: Path, **grader: object) -> EvalCase:
    return EvalCase(id="add-bug", inputs={"issue": "fix add"}, reference="secret-reference-patch",
                    grader={"kind": "repo_tests", "repo": str(repo), "base_commit": CALC_SHA,
                            "fail_to_pass": ["test_calc.py::test_negative"],
                            "pass_to_pass": ["test_calc.py::test_positive", "test_calc.py::test_sub"],
                            "test_patch": HIDDEN_TEST_PATCH, **grader})


def script_agent(tmp_path: Path, body: str, timeout: float = 60.0, settings: AgentSettings | None = None):
    """A `cmd:` agent: a shell script with `body`, loaded for --workspace with the run's `settings`."""
    agents = tmp_path / "agents"
    agents.mkdir(exist_ok=True)
    script = agents / f"agent{len(list(agents.iterdir()))}.sh"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return load_agent(f"cmd:{script}", timeout, settings)


def draw(agent, case: EvalCase, index: int = 0):
    return draw_sample(agent, case, PlannedSample(case.id, index, 7, "k", case.case_hash), n=1)


@pytest.fixture
def bwrap(monkeypatch):
    monkeypatch.delenv(sandbox.MODE_ENV, raising=False)
    sandbox._bwrap_problem.cache_clear()
    if not sandbox.bwrap_available():
        pytest.skip("bubblewrap does not run here")


def test_the_agent_sees_its_checkout_the_case_and_nothing_hidden(home, calc_repo, tmp_path, bwrap):
    repo, _ = calc_repo
    body = """set -e
cat > "$HOME/case.json"
test "$PWD" = "$EVALPIPE_WORKSPACE"
! grep -r -e secret-reference-patch -e hidden-test-marker . "$HOME/case.json" "$EVALPIPE_CASE"
grep -q '"issue": "fix add"' "$HOME/case.json"
"$EVALPIPE_PYTHON" -c 'import sys; print("python", sys.version_info[0])'
sed -i 's/return abs(a) + b/return a + b/' calc.py
echo '{"tool": "bash", "input": "sed"}' >> "$EVALPIPE_TRAJECTORY"
echo 'not json' >> "$EVALPIPE_TRAJECTORY"
"""
    sample = draw(script_agent(tmp_path, body), calc_case(repo))
    assert sample.verdict.status is Status.passed, (sample.verdict.detail, sample.trace.agent_run)
    assert sample.output.startswith("diff --git a/calc.py b/calc.py") and "python 3" not in sample.output
    assert "python 3" in sample.trace.agent_run.stdout_tail
    assert sample.trace.agent_run.isolation == "bwrap"
    assert sample.trace.trajectory.model_dump(exclude_unset=True) == {
        "steps": 2, "entries": [{"tool": "bash", "input": "sed"}, {"text": "not json"}]}
    # Stored and parsed back: the agent's sections, then the sampler's and the grader's.
    assert SampleTrace.parse(sample.trace.to_json()) == sample.trace
    assert list(sample.trace.to_dict()) == ["agent_run", "trajectory", "workspace", "output", "repo_tests"]
    assert list(sample.trace.to_dict()["repo_tests"]) == ["timings", "steps", "edited_files", "test_run", "tests"]


def test_the_database_other_workspaces_and_the_host_are_out_of_reach(home, calc_repo, tmp_path, bwrap,
                                                                      monkeypatch):
    repo, _ = calc_repo
    home.mkdir(parents=True, exist_ok=True)
    (home / "evalpipe.duckdb").write_text("the database")
    other = home / "repos" / "other.worktrees" / "1"  # where another sample's workspace sits
    other.mkdir(parents=True)
    (other / "theirs.py").write_text("x")
    outside = ROOT / f".workspace-escape-{os.getpid()}"
    answers = tmp_path / "answers.yaml"
    answers.write_text("reference: the-answer\n")
    # The harness user's home, with credentials, inside the agent's (visible) code folder.
    user = tmp_path / "agents" / "user"
    (user / ".ssh").mkdir(parents=True)
    (user / ".ssh" / "id_ed25519").write_text("PRIVATE KEY\n")
    (user / ".netrc").write_text("machine x password y\n")
    monkeypatch.setenv("HOME", str(user))
    body = f"""
git -C "{repo}" log --oneline 2>/dev/null | grep . && echo "READ the source repository"
for p in "{home}/evalpipe.duckdb" "{other}/theirs.py" "{answers}" "{user}/.ssh/id_ed25519" "{user}/.netrc"; do
  if grep . "$p" 2>/dev/null; then echo "READ $p"; fi
done
echo "LS: $(ls -a "{home}" "{home}/repos" 2>&1 | tr '\n' ' ')"
touch "{outside}" 2>/dev/null && echo "WROTE outside"
touch "$HOME/ok" && echo "home is writable: $HOME"
test "$HOME" != "{Path.home()}" && echo "scratch home"
touch marker.txt
"""
    sample = draw(script_agent(tmp_path, body).concealing([answers]), calc_case(repo))
    out = sample.trace.agent_run.stdout_tail
    assert "READ" not in out and "WROTE" not in out and not outside.exists(), out
    listing = out.split("LS: ", 1)[1].split("\n", 1)[0]
    assert "evalpipe.duckdb" not in listing and "worktrees" not in listing and ".git" not in listing, listing
    assert "home is writable" in out and "scratch home" in out
    assert (home / "evalpipe.duckdb").read_text() == "the database"
    assert sample.trace.workspace.files == ["marker.txt"]


def test_environment_passes_only_the_documented_variables_and_secrets_are_masked(
        home, calc_repo, tmp_path, bwrap, monkeypatch):
    repo, _ = calc_repo
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-0123456789abcdef")
    monkeypatch.setenv("EVALPIPE_TEST_PRIVATE", "private-value")
    monkeypatch.setenv("EVALPIPE_TEST_ADDED", "added-value")
    monkeypatch.setenv("EVALPIPE_AGENT_ENV", "EVALPIPE_TEST_ADDED")
    # The key itself stays outside (issue 44): the agent holds a token of its sample's, masked too.
    body = """echo "key=$OPENAI_API_KEY private=${EVALPIPE_TEST_PRIVATE:-unset} added=$EVALPIPE_TEST_ADDED"
printf '{"content": "%s"}\\n' "$OPENAI_API_KEY" >> "$EVALPIPE_TRAJECTORY"
case "$OPENAI_API_KEY" in sk-test-*) echo LEAKED;; evalpipe-sample-*) echo token >&2;; esac
"""
    sample = draw(script_agent(tmp_path, body), calc_case(repo))
    assert sample.trace.agent_run.stdout_tail == "key=*** private=unset added=added-value\n"
    assert sample.trace.agent_run.stderr_tail == "token\n"
    assert sample.trace.trajectory.entries == [{"content": "***"}]
    assert sample.verdict.status is Status.empty  # an agent that changes nothing


def test_leftover_processes_are_killed_and_a_timeout_is_an_agent_error(home, calc_repo, tmp_path, bwrap):
    repo, _ = calc_repo
    token = f"{os.getpid()}.{time.monotonic_ns() % 10**6}"
    sample = draw(script_agent(tmp_path, f"sleep 1{token} &\nsetsid sleep 2{token} &\necho started\n"),
                  calc_case(repo))
    assert sample.trace.agent_run.returncode == 0
    alive = [p for p in os.listdir("/proc") if p.isdigit() and token in _cmdline(p)]
    assert alive == []

    started = time.monotonic()
    slow = draw(script_agent(tmp_path, "echo working >&2\nsleep 600\n", timeout=1.5), calc_case(repo))
    assert slow.verdict.status is Status.agent_error and "timed out after 1.5 s" in slow.verdict.detail
    assert time.monotonic() - started < 60
    crashed = draw(script_agent(tmp_path, "echo '{\"step\": 1}' >> $EVALPIPE_TRAJECTORY\n"
                                          "echo broken >&2\nexit 3\n"), calc_case(repo))
    assert crashed.verdict.status is Status.agent_error
    assert crashed.verdict.detail == "agent failed: exited with status 3: broken"
    assert crashed.trace.trajectory.steps == 1  # kept: it shows what went wrong


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_files_named_in_the_command_are_found_from_where_evalpipe_started(
        home, calc_repo, tmp_path, bwrap, monkeypatch):
    repo, _ = calc_repo
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "fix.py").write_text(
        "import pathlib\np = pathlib.Path('calc.py')\n"
        f"p.write_text(p.read_text().replace({FIX[0]!r}, {FIX[1]!r}))\n")
    monkeypatch.chdir(tmp_path)  # where evalpipe starts; the agent starts in its workspace
    agent = load_agent(f"cmd:{sys.executable} tools/fix.py", 60.0)
    assert draw(agent, calc_case(repo)).verdict.status is Status.passed


def test_only_repo_cases_and_only_cmd_or_python_agents(home, tmp_path):
    with pytest.raises(ValueError, match="--workspace takes a cmd:, python: or openai: agent"):
        load_agent("reference", 60.0)
    agent = script_agent(tmp_path, "true\n")
    case = EvalCase(id="q", inputs={}, reference="yes", grader={"kind": "exact"})
    sample = draw(agent, case)
    assert sample.verdict.status is Status.agent_error and "needs a repo_tests case" in sample.verdict.detail


def test_without_bubblewrap_a_workspace_run_is_refused_unless_allowed(home, calc_repo, tmp_path, monkeypatch):
    repo, _ = calc_repo
    monkeypatch.setenv(sandbox.MODE_ENV, "rlimits")
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    sandbox._bwrap_problem.cache_clear()
    agent = script_agent(tmp_path, "sed -i 's/return abs(a) + b/return a + b/' calc.py\n")
    refused = draw(agent, calc_case(repo))
    assert refused.verdict.status is Status.agent_error and "--unsafe-no-sandbox" in refused.verdict.detail
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    allowed = draw(agent, calc_case(repo))
    assert allowed.verdict.status is Status.passed and allowed.trace.agent_run.isolation == "rlimits"
    sandbox._bwrap_problem.cache_clear()


def test_a_python_agent_gets_its_workspace_and_trajectory_in_ctx(home, calc_repo, tmp_path, bwrap):
    repo, _ = calc_repo
    module = tmp_path / "agents" / "pyagent.py"
    module.parent.mkdir(exist_ok=True)
    module.write_text(f"""
def solve(inputs, ctx):
    path = ctx.workspace / "calc.py"
    path.write_text(path.read_text().replace({FIX[0]!r}, {FIX[1]!r}))
    ctx.record({{"tool": "edit", "path": "calc.py", "issue": inputs["issue"]}})
    return "done"
""")
    sample = draw(load_agent(f"python:{module}:solve", 60.0), calc_case(repo))
    assert sample.verdict.status is Status.passed, (sample.verdict.detail, sample.trace.agent_run)
    assert sample.trace.trajectory.entries == [{"tool": "edit", "path": "calc.py", "issue": "fix add"}]
    assert sample.trace.agent_run.stdout_tail == "done\n"


def test_the_memory_cap_holds(home, calc_repo, tmp_path, bwrap):
    repo, _ = calc_repo
    body = '"$EVALPIPE_PYTHON" -c "b = bytearray(400 << 20)" || { echo "no room" >&2; exit 5; }\n'
    sample = draw(script_agent(tmp_path, body, settings=AgentSettings(agent_memory_mb=200)), calc_case(repo))
    assert sample.verdict.status is Status.agent_error and "exited with status 5" in sample.verdict.detail
    assert "MemoryError" in sample.trace.agent_run.stderr_tail


def test_a_trajectory_is_capped_at_whole_lines_and_never_read_through_a_link(tmp_path):
    from tasks.agents.trajectory import read_trajectory

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(1000)))
    doc = read_trajectory(path, 100)
    assert doc.entries == [{"i": i} for i in range(len(doc.entries))] and 0 < doc.steps < 12
    assert doc.truncated == Truncation(cap_bytes=100, bytes=path.stat().st_size)
    secret = tmp_path / "secret"
    secret.write_text('{"leak": 1}\n')
    (tmp_path / "link.jsonl").symlink_to(secret)
    assert read_trajectory(tmp_path / "link.jsonl", 100) is None
    os.mkfifo(tmp_path / "fifo")
    assert read_trajectory(tmp_path / "fifo", 100) is None  # not waited on


# ---------------------------------------------------------------- runs and examples


def _stored(home: Path) -> int:
    """Samples stored so far by a run in progress (0 while it holds the database)."""
    try:
        return query(home, "SELECT count(*) FROM samples")[0][0]
    except (duckdb.Error, FileNotFoundError):
        return 0


def _agent_running(script: Path) -> bool:
    return any(p.isdigit() and _cmdline(p).startswith("bwrap") and str(script) in _cmdline(p)
               for p in os.listdir("/proc"))


def query(home: Path, sql: str, *params):
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        return con.execute(sql, list(params)).fetchall()


def test_n2_samples_get_separate_fresh_checkouts(prefect_harness, home, tmp_path, monkeypatch, bwrap):
    from flows.evaluate import evaluate

    monkeypatch.chdir(ROOT)
    agents = tmp_path / "agents"
    agents.mkdir()
    script = agents / "mark.sh"
    # Each sample finds a clean tree, leaves a file named for it, and waits a little so
    # the two overlap; the fix makes the sample pass.
    script.write_text("""#!/bin/sh
set -e
idx=$(sed 's/.*"index": \\([0-9]*\\).*/\\1/')
test -z "$(git status --porcelain)"
ls mark-* 2>/dev/null && exit 9
echo "$idx" > "mark-$idx.md"
sed -i 's/return abs(a) + b/return a + b/' calc.py
sleep 1
""")
    script.chmod(0o755)
    suite = tmp_path / "calc.yaml"
    suite.write_text((ROOT / "examples/coding/calc.yaml").read_text().replace("CHANGES.md", "mark-*.md")
                     .replace("../calc/calc.bundle", str(ROOT / "examples/calc/calc.bundle")))
    out = evaluate(suite=str(suite), agent=f"cmd:{script}", n=2, workers=2, workspace=True, agent_timeout=60)
    assert out["status_counts"] == {"passed": 2}
    rows = query(home, "SELECT sample_index, output FROM samples WHERE run_id = ? ORDER BY 1", out["run_id"])
    assert ["+++ b/mark-0.md" in rows[0][1], "+++ b/mark-1.md" in rows[1][1]] == [True, True]
    assert "mark-1" not in rows[0][1] and "mark-0" not in rows[1][1]


def test_the_scripted_example_is_graded_resolved(prefect_harness, home, monkeypatch, bwrap):
    from flows.evaluate import evaluate

    monkeypatch.chdir(ROOT)
    out = evaluate(suite="examples/coding/calc.yaml", agent="cmd:examples/coding/calc_fixer.sh",
                   workspace=True)
    assert out["status_counts"] == {"passed": 1}
    assert out["agent_steps"] == {"samples": 1, "total": 5, "mean": 5.0, "max": 5}
    (output, trace), = query(home, "SELECT output, trace FROM samples WHERE run_id = ?", out["run_id"])
    assert "+++ b/CHANGES.md" in output and "+    return a + b" in output  # new file and committed edit
    assert "3 passed" in json.loads(trace)["agent_run"]["stdout_tail"]  # the agent ran the tests


def test_a_failing_case_shows_its_trajectory_in_runs_show_and_the_report(
        prefect_harness, home, tmp_path, monkeypatch, bwrap):
    from flows.evaluate import evaluate
    from flows.report import write_report
    from storage.store import Store

    monkeypatch.chdir(ROOT)
    script = tmp_path / "agents" / "wrong.sh"
    script.parent.mkdir()
    script.write_text("""#!/bin/sh
echo '{"tool": "bash", "input": "sed -i s/abs/min/ calc.py", "output": "exit 0"}' >> "$EVALPIPE_TRAJECTORY"
echo '{"role": "assistant", "content": "I think <min> fixes it"}' >> "$EVALPIPE_TRAJECTORY"
sed -i 's/return abs(a) + b/return min(a, b)/' calc.py
# The suite file (references, hidden tests) and the repository's source: hidden.
grep -c . ROOT/examples/coding/calc.yaml ROOT/examples/calc/calc.bundle 2>&1 | sed 's/^/LOOK /'
""".replace("ROOT", str(ROOT)))
    script.chmod(0o755)
    out = evaluate(suite="examples/coding/calc.yaml", agent=f"cmd:{script}", workspace=True)
    # Its steps are its model turns (the assistant message); the bash line is a note of its own.
    assert out["status_counts"] == {"failed": 1} and out["agent_steps"]["total"] == 1
    (trace,), = query(home, "SELECT trace FROM samples WHERE run_id = ?", out["run_id"])
    looked = json.loads(trace)["agent_run"]["stdout_tail"]
    assert looked.count("LOOK") == 2 and not re.search(r":[1-9]", looked), looked  # nothing read
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shown = in_process(["runs", "show", out["run_id"], "--case", "add-bug"], env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[-3:] == [
        "  trajectory: 2 step(s)",
        "    1. tool bash: sed -i s/abs/min/ calc.py -> exit 0",
        "    2. model: I think <min> fixes it",
    ]
    html = write_report(out["run_id"], tmp_path / "report.html", Store(home)).read_text()
    assert "trajectory of sample 0: 2 step(s)" in html and "I think &lt;min&gt; fixes it" in html
    assert "1 in 1 trajectories (mean 1, max 1 per sample)" in html


class ReplayEndpoint:
    """An OpenAI-compatible chat endpoint that answers with scripted assistant messages in
    turn and keeps every request it got."""

    def __init__(self, replies: list[dict]) -> None:
        self.replies, self.requests = list(replies), []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                       "body": body})
                message = owner.replies.pop(0) if owner.replies else {"role": "assistant", "content": "?"}
                data = json.dumps({"choices": [{"index": 0, "message": message}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        serve_in_background(self.server)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def tool_call(i: int, name: str, **args: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


def test_the_tool_using_example_fixes_calc_against_a_replayed_endpoint(
        prefect_harness, home, monkeypatch, bwrap):
    from flows.evaluate import evaluate

    endpoint = ReplayEndpoint([
        tool_call(1, "bash", command="grep -n 'abs' calc.py"),
        tool_call(2, "bash", command="sed -i 's/return abs(a) + b/return a + b/' calc.py"),
        tool_call(3, "bash", command="$EVALPIPE_PYTHON -m pytest -q -p no:cacheprovider test_calc.py"),
        tool_call(4, "finish", summary="add keeps the sign now"),
    ])
    try:
        monkeypatch.chdir(ROOT)
        monkeypatch.setenv("OPENAI_BASE_URL", endpoint.url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-replay-0123456789")
        monkeypatch.setenv("EVALPIPE_AGENT_ENV", "TOOL_AGENT_MODEL")
        monkeypatch.setenv("TOOL_AGENT_MODEL", "replayed-model")
        out = evaluate(suite="examples/coding/calc.yaml", agent="python:examples/coding/tool_agent.py:solve",
                       workspace=True)
    finally:
        endpoint.close()
    assert out["status_counts"] == {"passed": 1}, query(home, "SELECT detail, trace FROM samples")
    assert len(endpoint.requests) == 4 and endpoint.requests[0]["path"] == "/v1/chat/completions"
    assert endpoint.requests[0]["auth"] == "Bearer sk-replay-0123456789"
    assert endpoint.requests[0]["body"]["model"] == "replayed-model"
    last = endpoint.requests[3]["body"]["messages"]
    assert last[-1]["role"] == "tool" and "3 passed" in last[-1]["content"]  # the tool ran, for real
    (trace,), = query(home, "SELECT trace FROM samples WHERE run_id = ?", out["run_id"])
    steps = json.loads(trace)["trajectory"]["entries"]
    assert [s.get("tool") for s in steps if "tool" in s] == ["bash", "bash", "bash", "finish"]
    assert len(steps) == 9 and out["agent_steps"]["total"] == len(endpoint.requests) == 4  # model turns


def test_killed_workspace_run_resumes(prefect_harness, home, tmp_path, bwrap):
    """kill -9 of the CLI mid-run: no agent left running; the next run reuses what was stored."""
    agents = tmp_path / "agents"
    agents.mkdir()
    script = agents / "slow.sh"
    # Slow until told (a file beside it, not in its fingerprint): slow only to be killed.
    script.write_text("#!/bin/sh\nsed -i 's/return abs(a) + b/return a + b/' calc.py\n"
                      "[ -e \"$(dirname \"$0\")/resume\" ] || sleep 1.5\n")
    script.chmod(0o755)
    env = {**os.environ, "PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "flows.cli", "run", "examples/coding/calc.yaml", "--agent", f"cmd:{script}",
            "--workspace", "-n", "6", "--workers", "1", "--agent-concurrency", "1", "--batch-size", "1", "--json"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    # The kill lands once a sample is stored and while an agent runs (it cannot write out:
    # watch /proc); drawing runs ahead of grading, so counting agents says nothing of storing.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None and not (_stored(home) and _agent_running(script)):
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # The sandbox dies with the harness (armed from its fork on: tasks/sandbox/processes.py),
    # well before the agent's own 1.5 s are up; the kernel takes a moment to end it.
    gone_by = time.monotonic() + 1.2
    while (left := [p for p in os.listdir("/proc") if p.isdigit() and str(script) in _cmdline(p)]) \
            and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert left == []
    (stored,), = query(home, "SELECT count(*) FROM samples")
    assert 0 < stored < 6
    (agents / "resume").touch()
    done = in_process(args[3:], env)  # the resume, in this process (support.cli.in_process)
    assert done.returncode == 0, done.stderr
    resumed = json.loads(done.stdout)
    # The stored samples and the outputs drawn and not graded at the kill: none bought again.
    assert stored <= resumed["cached_samples"] < 6 and resumed["status_counts"] == {"passed": 6}
    assert os.listdir(home / "workspaces") == []  # the killed run's scratch directory too


def test_a_cmd_agent_run_by_its_own_venvs_interpreter_finds_the_venvs_packages(tmp_path, bwrap):
    """Issue 47: `cmd:/path/venv/bin/python agent.py` in a workspace used to run the base
    interpreter with the venv hidden (ModuleNotFoundError for every package of its own)."""
    import evalpipe

    venv = tmp_path / "agent-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "fixer_lib.py").write_text(
        "def fix(path):\n"
        "    text = open(path).read()\n"
        "    open(path, 'w').write(text.replace('return abs(a) + b', 'return a + b'))\n")
    agent = tmp_path / "agents" / "fix.py"
    agent.parent.mkdir()
    agent.write_text("import sys, fixer_lib\n"
                     "assert sys.prefix != sys.base_prefix, 'not in its venv'\n"
                     "fixer_lib.fix('calc.py')\n")
    run = evalpipe.evaluate(str(ROOT / "examples/coding/calc.yaml"), f"cmd:{venv}/bin/python {agent}", n=1,
                            home=tmp_path / "home", workspace=True)
    assert run.status_counts == {"passed": 1}, run.status_counts
