"""Agents in their own environment (#47 item 1): `pyworker:` and `cmdworker:` persistent
workers of another interpreter, and a `--workspace` agent run by its venv's interpreter.

The venvs are real (`python -m venv`, a package installed into them from a wheel built here),
and nothing of evalpipe is installed in them: the worker needs only the standard library."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import duckdb
import pytest

ROOT = Path(__file__).resolve().parent.parent


def query(home: Path, sql: str, *params):
    with duckdb.connect(str(home / "evalpipe.duckdb"), read_only=True) as con:
        return con.execute(sql, list(params)).fetchall()


@pytest.fixture(scope="module")
def agent_venv(tmp_path_factory) -> Path:
    """A venv without evalpipe, with a package `shout` of its own installed from a local wheel
    (written here: building one would need setuptools' wheel support or the network)."""
    where = tmp_path_factory.mktemp("agent-venv")
    wheel = where / "shout-1.0-py3-none-any.whl"
    files = {"shout/__init__.py": "def shout(text):\n    return text.upper() + '!'\n",
             "shout-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: shout\nVersion: 1.0\n",
             "shout-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "shout-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in {**files, "shout-1.0.dist-info/RECORD": record}.items():
            zf.writestr(name, text)
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "uv", "pip", "install", "-q", "--offline", "--python",
                    str(venv / "bin" / "python"), str(wheel)], check=True)
    check = subprocess.run([str(venv / "bin" / "python"), "-c", "import shout, importlib.util as u;"
                            "print(u.find_spec('tasks') is None and u.find_spec('evalpipe') is None)"],
                           capture_output=True, text=True, check=True, cwd=where)
    assert check.stdout.strip() == "True"  # the package is there, evalpipe is not
    return venv


AGENT = """\
import os, sys, time
import shout

CALLS = 0

def solve(inputs, ctx):
    global CALLS
    CALLS += 1
    print("a print of the agent's")  # must not break the protocol
    ctx.record({"role": "assistant", "content": "thinking about " + ctx.case_id})
    ctx.report_usage(input_tokens=7, output_tokens=2, model="toy")
    if inputs.get("sleep"):
        time.sleep(inputs["sleep"])
    if inputs.get("boom"):
        raise ValueError("boom on " + ctx.case_id)
    if inputs.get("none"):
        return None
    return shout.shout(inputs["q"]) + " pid=%d calls=%d prefix=%s" % (os.getpid(), CALLS, sys.prefix)
"""


@pytest.fixture
def agent_file(tmp_path) -> Path:
    path = tmp_path / "agents" / "venv_agent.py"
    path.parent.mkdir()
    path.write_text(AGENT)
    return path


def _case(case_id: str, **inputs):
    from tasks.models import EvalCase

    return EvalCase.model_validate({"id": case_id, "inputs": inputs, "reference": "x",
                                    "grader": {"kind": "exact"}})


def _draw(agent, case, index=0):
    from tasks.agents import AgentContext, AgentError

    ctx = AgentContext(case_id=case.id, index=index, seed=index, n=1)
    try:
        return agent.generate(case, ctx), ctx
    except AgentError as exc:
        return exc, ctx


def test_a_pyworker_agent_imports_its_venvs_package_once_per_worker_and_reports_through_ctx(
        agent_venv, agent_file, tmp_path, monkeypatch):
    from tasks.agents import load_agent
    from tasks.agents.worker import close_pools

    monkeypatch.chdir(tmp_path)
    agent = load_agent(f"pyworker:agents/venv_agent.py:solve?python={agent_venv}/bin/python")
    try:
        outputs = [_draw(agent, _case("c1", q="hi"), i) for i in range(3)]
        pids = {out.split("pid=")[1].split()[0] for out, _ in outputs}
        assert len(pids) == 1  # one worker, reused (drawn one after another)
        assert [out.split("calls=")[1].split()[0] for out, _ in outputs] == ["1", "2", "3"]  # imported once
        out, ctx = outputs[0]
        assert out.startswith("HI! ") and f"prefix={agent_venv}" in out  # the venv's own package and prefix
        assert ctx.trace.trajectory.entries == [{"role": "assistant", "content": "thinking about c1"}]
        assert ctx.reported["input_tokens"] == 7 and ctx.reported["output_tokens"] == 2
        assert ctx.reported["model"] == "toy" and 0 <= ctx.reported["latency_s"] < 1

        # What the agent raises, and a non-str, fail the sample as they do in process; the worker stays.
        err, _ = _draw(agent, _case("c2", boom=True))
        assert str(err) == "ValueError: boom on c2"
        err, _ = _draw(agent, _case("c3", none=True))
        assert str(err) == "returned NoneType, expected str"
        out, _ = _draw(agent, _case("c1", q="again"))
        assert out.split("pid=")[1].split()[0] in pids
    finally:
        close_pools()
    assert not _alive(int(next(iter(pids))))


def test_a_sample_past_the_timeout_kills_its_worker_and_a_fresh_one_takes_the_next(
        agent_venv, agent_file, tmp_path, monkeypatch):
    from tasks.agents import AgentSettings, load_agent
    from tasks.agents.worker import close_pools

    monkeypatch.chdir(tmp_path)
    agent = load_agent(f"pyworker:agents/venv_agent.py:solve?python={agent_venv}/bin/python",
                       settings=AgentSettings(cmd_timeout=1.5))
    try:
        first, _ = _draw(agent, _case("c1", q="a"))
        old = int(first.split("pid=")[1].split()[0])
        started = time.monotonic()
        err, _ = _draw(agent, _case("slow", sleep=30))
        assert time.monotonic() - started < 10
        assert "timed out after 1.5 s" in str(err)
        assert not _alive(old)
        out, _ = _draw(agent, _case("c1", q="b"))
        assert int(out.split("pid=")[1].split()[0]) != old and "calls=1" in out
    finally:
        close_pools()


def test_workers_are_as_many_as_samples_at_once_and_the_run_records_what_they_reported(
        agent_venv, agent_file, tmp_path, monkeypatch):
    import evalpipe

    monkeypatch.chdir(tmp_path)
    cases = [{"id": f"q{i}", "inputs": {"q": f"w{i}", "sleep": 0.2}, "reference": "x", "grader": {"kind": "contains"}}
             for i in range(4)]
    for case in cases:
        case["reference"] = case["inputs"]["q"].upper() + "!"
    home = tmp_path / "home"
    run = evalpipe.evaluate(cases, f"pyworker:agents/venv_agent.py:solve?python={agent_venv}/bin/python",
                            n=3, agent_concurrency=4, home=home)
    assert run.status_counts == {"passed": 12}, run.status_counts
    rows = query(home, "SELECT output, input_tokens, output_tokens, usage_model, latency_s, trace FROM samples"
                       " WHERE run_id = ?", run.run_id)
    pids = {row[0].split("pid=")[1].split()[0] for row in rows}
    assert 1 <= len(pids) <= 4
    assert max(int(row[0].split("calls=")[1].split()[0]) for row in rows) >= 2  # a worker drew many
    assert {row[1:4] for row in rows} == {(7, 2, "toy")}
    # Latency is the call (0.2 s asleep), not the import nor the wait for a worker.
    assert all(0.2 <= row[4] < 1.0 for row in rows)
    trace = json.loads(rows[0][5])
    assert trace["trajectory"]["entries"][0]["content"].startswith("thinking about q")
    for pid in pids:
        assert _alive(int(pid))  # kept for the next run of this process ...
    from tasks.agents.worker import close_pools

    close_pools()
    assert not any(_alive(int(p)) for p in pids)  # ... and gone at its end


def test_a_cmdworker_agent_answers_a_json_line_per_case(agent_venv, tmp_path, monkeypatch):
    from tasks.agents import load_agent
    from tasks.agents.worker import close_pools

    monkeypatch.chdir(tmp_path)
    (tmp_path / "lines.py").write_text(textwrap.dedent("""\
        import json, os, sys, shout
        for line in sys.stdin:
            case = json.loads(line)
            if case["inputs"].get("crash"):
                sys.stderr.write("dying on " + case["id"] + "\\n")
                sys.exit(4)
            if case["inputs"].get("plain"):
                print(json.dumps(shout.shout(case["inputs"]["q"])), flush=True)
                continue
            print(json.dumps({"output": shout.shout(case["inputs"]["q"]) + " %d" % os.getpid(),
                              "usage": {"input_tokens": 5, "output_tokens": 1, "model": "toy"},
                              "steps": [{"role": "assistant", "content": "ok"}]}), flush=True)
        """))
    agent = load_agent(f"cmdworker:{agent_venv}/bin/python lines.py")
    try:
        out, ctx = _draw(agent, _case("a", q="x"))
        pid = out.split()[-1]
        assert out == f"X! {pid}" and ctx.reported["input_tokens"] == 5
        assert ctx.trace.trajectory.entries == [{"role": "assistant", "content": "ok"}]
        out, _ = _draw(agent, _case("b", q="y", plain=True))
        assert out == "Y!"
        err, _ = _draw(agent, _case("c", crash=True))
        assert str(err) == "the worker exited with status 4: dying on c"
        out, _ = _draw(agent, _case("a", q="z"))
        assert out.split()[-1] != pid  # a fresh worker after the crash
    finally:
        close_pools()


@pytest.mark.parametrize(("spec", "message"), [
    ("pyworker:agents/venv_agent.py:nope", "defines no 'nope' at its top level"),
    ("pyworker:agents/missing.py:solve", "missing.py"),
    ("pyworker:venv_agent:solve", "expected pyworker:path/to/file.py:FUNCTION"),
    ("pyworker:agents/venv_agent.py:solve?python=/nonexistent/python", "python=/nonexistent/python: not an executable"),
    ("pyworker:agents/venv_agent.py:solve?pyhton=x", "unknown option 'pyhton'"),
])
def test_a_bad_pyworker_spec_is_bad_input_naming_what_is_wrong(agent_file, tmp_path, monkeypatch, spec, message):
    from tasks.agents import load_agent
    from tasks.models import InputError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace("[", r"\[").replace("?", r"\?")):
        load_agent(spec)


def test_the_fingerprint_covers_the_file_the_interpreter_and_declared_files(agent_venv, agent_file, tmp_path,
                                                                              monkeypatch):
    from tasks.agents import load_agent

    monkeypatch.chdir(tmp_path)
    spec = f"pyworker:agents/venv_agent.py:solve?python={agent_venv}/bin/python"
    first = load_agent(spec).fingerprint
    assert load_agent(f"pyworker:agents/venv_agent.py:solve?python={sys.executable}").fingerprint != first
    agent_file.write_text(AGENT + "\n# edited\n")
    second = load_agent(spec).fingerprint
    assert second != first
    (agent_file.parent / "prompt.txt").write_text("v1")
    (agent_file.parent / "evalpipe-agent.toml").write_text('files = ["prompt.txt"]\n')
    third = load_agent(spec).fingerprint
    (agent_file.parent / "prompt.txt").write_text("v2")
    assert len({second, third, load_agent(spec).fingerprint}) == 3


def test_an_agent_that_fails_to_import_fails_its_samples_with_the_reason(agent_venv, tmp_path, monkeypatch):
    from tasks.agents import load_agent
    from tasks.agents.worker import close_pools

    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("import not_installed_anywhere\ndef solve(inputs, ctx):\n    return ''\n")
    agent = load_agent(f"pyworker:broken.py:solve?python={agent_venv}/bin/python")
    try:
        err, _ = _draw(agent, _case("a", q="x"))
    finally:
        close_pools()
    assert "ModuleNotFoundError: No module named 'not_installed_anywhere'" in str(err)


def test_workers_die_with_a_killed_harness(agent_venv, agent_file, tmp_path):
    """kill -9 of the process that started them leaves no worker behind (each watches its parent)."""
    script = tmp_path / "harness.py"
    script.write_text(textwrap.dedent(f"""\
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        os.chdir({str(tmp_path)!r})
        from tasks.agents import AgentContext, load_agent
        from tasks.models import EvalCase
        agent = load_agent("pyworker:agents/venv_agent.py:solve?python={agent_venv}/bin/python")
        case = EvalCase.model_validate({{"id": "a", "inputs": {{"q": "x"}}, "reference": "x", "grader": {{"kind": "exact"}}}})
        print(agent.generate(case, AgentContext(case_id="a", index=0, seed=0, n=1)).split("pid=")[1].split()[0], flush=True)
        case = EvalCase.model_validate({{"id": "b", "inputs": {{"q": "x", "sleep": 60}}, "reference": "x", "grader": {{"kind": "exact"}}}})
        agent.generate(case, AgentContext(case_id="b", index=0, seed=0, n=1))
        """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        time.sleep(0.3)  # the worker is in its 60 s sample
        proc.kill()
        proc.wait()
    finally:
        proc.stdout.close()
    gone_by = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < gone_by:
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_workspace_agent_run_by_its_venvs_interpreter_imports_the_venvs_installed_package(
        agent_venv, tmp_path, monkeypatch):
    """`--workspace` with `cmd:/path/venv/bin/python agent.py`: the venv is shown read-only, whole
    (the interpreter alone, resolved, is the base one, which knows none of its packages)."""
    import evalpipe
    from tasks.sandbox import policy as sandbox

    monkeypatch.delenv(sandbox.MODE_ENV, raising=False)
    sandbox._bwrap_problem.cache_clear()
    if not sandbox.bwrap_available():
        pytest.skip("bubblewrap does not run here")
    agent = tmp_path / "agents" / "fix.py"
    agent.parent.mkdir()
    agent.write_text(textwrap.dedent(f"""\
        import os, sys, importlib.metadata, shout
        assert sys.prefix == {str(agent_venv)!r}, sys.prefix
        assert importlib.metadata.version("shout") == "1.0"
        try:
            open(os.path.join(sys.prefix, "written"), "w")
        except OSError as exc:
            print("venv read-only:", exc.strerror, file=sys.stderr)
        else:
            sys.exit("the venv is writable from the sandbox")
        text = open("calc.py").read()
        open("calc.py", "w").write(text.replace("return abs(a) + b", "return a + b"))
        print(shout.shout("fixed"))
        """))
    monkeypatch.chdir(ROOT)
    home = tmp_path / "home"
    run = evalpipe.evaluate("examples/coding/calc.yaml", f"cmd:{agent_venv}/bin/python {agent}", n=1,
                            home=home, workspace=True)
    (status, trace), = query(home, "SELECT status, trace FROM samples WHERE run_id = ?", run.run_id)
    agent_run = json.loads(trace)["agent_run"]
    assert status == "passed", agent_run
    assert "FIXED!" in agent_run["stdout_tail"] and "venv read-only: Read-only file system" in agent_run["stderr_tail"]
