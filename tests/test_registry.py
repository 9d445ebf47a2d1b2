"""The registry (tasks/registry.py): a grader and a metric from a throw-away package, installed
with pip in a venv of its own, work end to end through the real CLI; plugins named by
EVALPIPE_PLUGINS; a broken plugin, bad parameters and a raising grader or metric each
reported as such."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel

from tasks import registry
from tasks.metrics.tallies import Tallies, metric_values
from tasks.trace import SampleTrace

ROOT = Path(__file__).resolve().parent.parent

PLUGIN = '''
from pydantic import BaseModel, ConfigDict

from tasks.models import EvalCase, Status, Verdict
from tasks.registry import grader, metric


class WordsParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    min_words: int


@grader("min_words", params=WordsParams, version="1")
def min_words(output: str, case: EvalCase, params: WordsParams, *, trace: dict) -> Verdict:
    if "BOOM" in output:
        raise RuntimeError("the wordy grader exploded")
    words = len(output.split())
    trace["words"] = words
    score = min(1.0, words / params.min_words)
    if words >= params.min_words:
        return Verdict.ok(f"{words} words", score=score)
    return Verdict.fail(Status.failed, f"{words} < {params.min_words} words", score=score)


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LongestTrace(BaseModel):
    longest: str = ""


@grader("longest_word", params=NoParams, trace=LongestTrace)
def longest_word(output: str, case: EvalCase, params: NoParams, *, trace: LongestTrace) -> Verdict:
    trace.longest = max(output.split(), key=len, default="")
    return Verdict.ok(trace.longest)


@metric("all_or_nothing")
def all_or_nothing(tallies) -> float:
    return sum(t.passes == t.n for t in tallies) / len(tallies)


@metric("mean_words_seen", percent=False)
def mean_words_seen(tallies) -> float:
    return float(sum(len(t.scores) for t in tallies))
'''

# A PEP 517 backend of a few lines in the package itself, so pip installs it offline with
# nothing but the standard library (no setuptools or wheel needed).
PYPROJECT = """
[build-system]
requires = []
build-backend = "build_backend"
backend-path = ["."]
"""

BACKEND = '''
import base64, hashlib, pathlib, zipfile

DIST = "evalpipe_wordy-0.1"
FILES = {
    "evalpipe_wordy/__init__.py": pathlib.Path("evalpipe_wordy/__init__.py").read_bytes(),
    f"{DIST}.dist-info/METADATA": b"Metadata-Version: 2.1\\nName: evalpipe-wordy\\nVersion: 0.1\\n",
    f"{DIST}.dist-info/WHEEL": b"Wheel-Version: 1.0\\nGenerator: tests\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n",
    f"{DIST}.dist-info/entry_points.txt": b"[evalpipe.plugins]\\nwordy = evalpipe_wordy\\n",
}


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = f"{DIST}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(pathlib.Path(wheel_directory, name), "w") as wheel:
        for path, data in FILES.items():
            wheel.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(data)}")
        wheel.writestr(f"{DIST}.dist-info/RECORD", "\\n".join([*record, f"{DIST}.dist-info/RECORD,,"]) + "\\n")
    return name
'''

AGENT = "def echo(inputs, ctx):\n    return inputs['text']\n"


@pytest.fixture(scope="module")
def plugin_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv that sees evalpipe's environment, with the throw-away plugin package
    pip-installed into it (offline: no index, no build isolation)."""
    base = tmp_path_factory.mktemp("plugin")
    pkg = base / "evalpipe-wordy"
    (pkg / "evalpipe_wordy").mkdir(parents=True)
    (pkg / "evalpipe_wordy/__init__.py").write_text(PLUGIN)
    (pkg / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "build_backend.py").write_text(BACKEND)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin/python"
    site_dir = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True).stdout.strip()
    # evalpipe and its dependencies, as the harness's own venv has them (.pth files included).
    ours = sysconfig.get_path("purelib")
    (Path(site_dir) / "evalpipe-dev.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--quiet", str(pkg)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return python


def evalpipe(python: Path, args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "flows.cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


def write_suite(path: Path, cases: list[tuple[str, str, object]]) -> Path:
    lines = ["name: wordy", "cases:"]
    lines += [f"  - {{id: {cid}, inputs: {{text: {text!r}}}, grader: {{kind: min_words, min_words: {m}}},"
              " extra_graders: [{kind: longest_word}]}" for cid, text, m in cases]
    path.write_text("\n".join(lines) + "\n")
    return path


class Longest(BaseModel):  # the shape of the plugin's `LongestTrace`, as a reader declares it
    longest: str = ""


def test_an_installed_plugin_grades_and_measures_a_run_end_to_end(plugin_python, prefect_harness, home, tmp_path):
    env = {**os.environ, "PREFECT_API_URL": prefect_harness}
    env.pop("EVALPIPE_PLUGINS", None)
    (tmp_path / "agent.py").write_text(AGENT)
    suite = write_suite(tmp_path / "wordy.yaml", [
        ("long", "one two three four", 3), ("short", "one", 3), ("edge", "a b c", 3), ("boom", "BOOM goes it", 1)])
    proc = evalpipe(plugin_python, ["run", str(suite), "--agent", f"python:{tmp_path / 'agent.py'}:echo",
                                    "-n", "2", "--max-grader-errors", "0.5", "--json"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    # Its verdicts: two cases pass, one fails, and the raising grader is an error, not a crash.
    assert doc["status_counts"] == {"passed": 4, "failed": 2, "error": 2}
    assert doc["pass_at_k"]["1"] == pytest.approx(0.5)
    metrics = doc["metrics"]
    assert metrics["all_or_nothing"]["value"] == pytest.approx(0.5)
    lo, hi = metrics["all_or_nothing"]["ci"]
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0 and lo < hi
    assert metrics["mean_words_seen"] == {"value": 8.0, "ci": [8.0, 8.0], "percent": False}
    # The built-ins are registered the same way, and agree with the headline keys.
    assert metrics["pass@1"]["value"] == doc["pass_at_k"]["1"] and metrics["pass@1"]["ci"] == doc["pass_at_1_ci"]
    assert metrics["mean_score"]["value"] == pytest.approx(doc["mean_score"])
    # short: 1 of 3 words scores 1/3; the error samples score 0.
    assert doc["mean_score"] == pytest.approx((1 + 1 / 3 + 1 + 0) / 4)

    from storage.store import Store

    detail, count = Store(home).samples.commonest_detail(doc["run_id"], "error")
    assert count == 2 and "RuntimeError: the wordy grader exploded" in detail
    traces = Store(home).samples.of_run(doc["run_id"], columns=["case_id", "trace"]).to_pylist()
    assert {json.loads(t["trace"]).get("words") for t in traces if t["case_id"] == "long"} == {4}
    # Its declared trace section, stored under its kind in its extra grader's entry, reads back typed.
    longest = [SampleTrace.parse(t["trace"]).extra_graders[0] for t in traces if t["case_id"] == "long"]
    assert [(e.kind, e.trace.section("longest_word", Longest)) for e in longest] == [
        ("longest_word", Longest(longest="three"))] * 2

    shown = evalpipe(plugin_python, ["runs", "show", doc["run_id"]], env, tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "all_or_nothing 50.0%  [" in shown.stdout
    assert "mean_words_seen 8  [8, 8]" in shown.stdout
    assert "pass@1 50.0%" in shown.stdout
    # The HTML report shows the plugin's metrics too, formatted alike.
    report = evalpipe(plugin_python, ["report", doc["run_id"], "--out", str(tmp_path / "r.html")], env, tmp_path)
    assert report.returncode == 0, report.stderr
    html = (tmp_path / "r.html").read_text()
    assert "all_or_nothing" in html and "mean_words_seen" in html and "[8, 8]" in html


def test_bad_parameters_of_a_plugin_grader_are_bad_input(plugin_python, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "EVALPIPE_PLUGINS"}
    suite = write_suite(tmp_path / "bad.yaml", [("ok", "a b", 1), ("typo", "a", "'many'")])
    proc = evalpipe(plugin_python, ["suite", "hash", str(suite)], env, tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "'typo'" in proc.stderr and "grader.min_words" in proc.stderr

    # Without the plugin, its kind is unknown, and the message says where kinds come from.
    plain = evalpipe(Path(sys.executable), ["suite", "hash", str(suite)], env, tmp_path)
    assert plain.returncode == 2 and "unknown grader kind 'min_words'" in plain.stderr
    assert "EVALPIPE_PLUGINS" in plain.stderr


def test_a_plugin_named_by_the_environment_or_one_that_fails_to_import(tmp_path):
    (tmp_path / "shout.py").write_text(
        "from tasks.params import HumanParams\nfrom tasks.models import Verdict\nfrom tasks.registry import grader\n"
        "@grader('shout', params=HumanParams)\n"
        "def shout(output, case, params):\n    return Verdict.ok() if output.isupper() else Verdict.fail()\n")
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    suite = tmp_path / "s.yaml"
    suite.write_text("name: s\ncases:\n  - {id: a, grader: {kind: shout}}\n")
    env = {**os.environ}
    ok = evalpipe(Path(sys.executable), ["suite", "hash", str(suite)], {**env, "EVALPIPE_PLUGINS": "shout.py"},
                  tmp_path)
    assert ok.returncode == 0, ok.stderr
    bad = evalpipe(Path(sys.executable), ["suite", "hash", str(suite)],
                   {**env, "EVALPIPE_PLUGINS": "shout.py, broken.py"}, tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr == ("evalpipe: plugin broken.py (EVALPIPE_PLUGINS) failed to import: "
                          "ModuleNotFoundError: No module named 'no_such_module_here'\n")


def _plugin_file(path: Path, kind: str, passes_when: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "from tasks.params import HumanParams\nfrom tasks.models import Verdict\nfrom tasks.registry import grader\n"
        f"@grader({kind!r}, params=HumanParams)\n"
        f"def grade(output, case, params):\n    return Verdict.ok() if {passes_when} else Verdict.fail()\n")
    return path


def test_two_plugin_files_with_one_stem_registering_one_kind_is_bad_input_naming_both(tmp_path):
    """Issue 33: `a/graders.py` and `b/graders.py` were both imported as module
    `evalpipe_plugin_graders`, so the collision check saw the same function and the second
    silently replaced the first."""
    first = _plugin_file(tmp_path / "a" / "graders.py", "strict", "output == 'yes'")
    second = _plugin_file(tmp_path / "b" / "graders.py", "strict", "True")  # passes anything
    suite = tmp_path / "s.yaml"
    suite.write_text("name: s\ncases:\n  - {id: a, grader: {kind: strict}}\n")
    proc = evalpipe(Path(sys.executable), ["suite", "hash", str(suite)],
                    {**os.environ, "EVALPIPE_PLUGINS": "a/graders.py,b/graders.py"}, tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "'strict'" in line
    assert str(first.resolve()) in line and str(second.resolve()) in line


def test_plugin_files_with_one_stem_are_two_modules_each_grading_its_own_kind(tmp_path):
    _plugin_file(tmp_path / "a" / "graders.py", "only_yes", "output == 'yes'")
    _plugin_file(tmp_path / "b" / "graders.py", "only_no", "output == 'no'")
    script = ("from tasks import registry\nfrom tasks.models import EvalCase\nfrom tasks.trace import SampleTrace\n"
              "for kind in ('only_yes', 'only_no'):\n"
              "    case = EvalCase(id='c', inputs={}, grader={'kind': kind})\n"
              "    spec = registry.grader_spec(kind)\n"
              "    print(kind, spec.fn.__module__ != 'evalpipe_plugin_graders',"
              " [spec(o, case, SampleTrace()).status.value for o in ('yes', 'no')])\n")
    # The same file named twice (once through a symlink) is one plugin, not a collision.
    (tmp_path / "again.py").symlink_to(tmp_path / "a" / "graders.py")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, text=True, capture_output=True, timeout=120,
                          env={**os.environ, "EVALPIPE_PLUGINS": "a/graders.py, b/graders.py, again.py",
                               "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["only_yes True ['passed', 'failed']", "only_no True ['failed', 'passed']"]


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by the test are undone after it."""
    monkeypatch.setattr(registry, "_METRICS", dict(registry.metrics()))
    monkeypatch.setattr(registry, "_GRADERS", dict(registry._GRADERS))


def tallies(passes: list[int], n: int = 4) -> Tallies:
    count = len(passes)
    index = np.repeat(np.arange(count), n)
    scores = np.concatenate([[1.0] * p + [0.0] * (n - p) for p in passes])
    return Tallies.of_samples([f"c{i}" for i in range(count)], index, np.full(count, n), np.array(passes), scores)


def test_a_metric_gets_one_tally_per_case_and_a_ci_clustered_by_case(scratch_registry):
    seen = []

    @registry.metric("perfect_cases")
    def perfect(ts) -> float:
        seen.append(len(ts))
        return float(np.mean(ts.passes == ts.n))

    @registry.metric("raises")
    def raises(ts) -> float:
        raise ZeroDivisionError("nothing to divide")

    @registry.metric("not_a_number")
    def nan(ts) -> float:
        return float("nan")

    t = tallies([4, 4, 0, 2, 4, 1])
    assert [x.passes for x in t] == [4, 4, 0, 2, 4, 1] and t[2].scores == (0.0,) * 4
    out = metric_values(t, seed=3, n_boot=200)
    assert out["perfect_cases"]["value"] == pytest.approx(0.5)
    lo, hi = out["perfect_cases"]["ci"]
    assert lo < 0.5 < hi
    assert seen == [6] * 201  # the point, then each resample, of as many cases
    assert out["raises"] == {"value": None, "ci": None, "percent": True,
                             "error": "metric raises raised ZeroDivisionError: nothing to divide"}
    assert out["not_a_number"]["value"] is None and "not a finite number" in out["not_a_number"]["error"]
    assert metric_values(t, seed=3, n_boot=200) == out  # seeded: the same CI every time
    assert metric_values(tallies([2]), n_boot=50)["perfect_cases"]["ci"] is None  # one case: no CI


def test_a_grader_that_runs_code_makes_a_run_need_the_sandbox(scratch_registry, monkeypatch):
    from tasks.params import HumanParams
    from tasks.sandbox import SandboxUnavailable
    from tasks.sandbox import policy as runner

    @registry.grader("runs_things", params=HumanParams, runs_code=True)
    def runs_things(output, case, params):
        raise AssertionError("not called")

    monkeypatch.setattr(runner, "bwrap_available", lambda: False)
    monkeypatch.delenv(runner.UNSAFE_ENV, raising=False)
    assert runner.run_sandbox_mode(["exact", "human"], unsafe=False) == "not-needed"
    with pytest.raises(SandboxUnavailable, match="runs_things cases"):
        runner.run_sandbox_mode(["exact", "runs_things"], unsafe=False)
    assert runner.run_sandbox_mode(["runs_things"], unsafe=True) == "unsafe-no-sandbox"
    # An extra grader that runs code makes the run need the sandbox as a deciding one does.
    from tasks.models import EvalCase, EvalSuite

    suite = EvalSuite(name="s", cases=(EvalCase(id="c", reference="x", grader={"kind": "exact"},
                                                extra_graders=({"kind": "runs_things"},)),))
    assert suite.grader_kinds == {"exact", "runs_things"}
    with pytest.raises(SandboxUnavailable, match="runs_things cases"):
        runner.run_sandbox_mode(suite.grader_kinds, unsafe=False)


def test_several_graders_on_one_case_each_give_a_verdict_and_grader_decides(scratch_registry, tmp_path):
    from pydantic import BaseModel

    from tasks.graders import grade, grader_fingerprint
    from tasks.models import EvalCase, Status, Verdict
    from tasks.suites.dataset import SuiteError, load_suite

    class NoParams(BaseModel):
        pass

    @registry.grader("explodes", params=NoParams)
    def explodes(output, case, params):
        raise RuntimeError("kaboom")

    @registry.grader("half", params=NoParams)
    def half(output, case, params, *, trace):
        trace["seen"] = output
        return Verdict.fail(Status.failed, "half marks", score=0.5, safety=("half saw something",))

    path = tmp_path / "multi.yaml"
    path.write_text(
        "name: multi\ngrader_defaults: {case_sensitive: false}\ncases:\n"
        "  - id: a\n    reference: Paris\n    grader: {kind: exact}\n"
        "    extra_graders: [{kind: contains}, {kind: half}, {kind: explodes}]\n"
        "  - id: b\n    reference: Paris\n    grader: {kind: exact}\n")
    suite = load_suite(path)
    a, b = suite.case("a"), suite.case("b")
    assert a.extra_graders[0] == {"kind": "contains", "case_sensitive": False}  # suite defaults apply
    trace = SampleTrace()
    verdict = grade("paris!", a, trace)
    # `grader` decides: exact fails although `contains` passes.
    assert verdict.status is Status.failed and verdict.safety == ("half saw something",)
    extra = trace.extra_graders
    assert [(e.kind, e.verdict.status) for e in extra] == [("contains", "passed"), ("half", "failed"),
                                                          ("explodes", "error")]
    assert extra[1].verdict.score == 0.5 and extra[1].trace.to_dict() == {"seen": "paris!"}
    assert extra[0].trace is None and "RuntimeError: kaboom" in extra[2].verdict.detail
    # Stored flat, as before the trace was typed.
    assert trace.to_dict()["extra_graders"][1] == {
        "kind": "half", "passed": False, "score": 0.5, "status": "failed", "detail": "half marks",
        "safety": ("half saw something",), "trace": {"seen": "paris!"}}
    assert grade("Paris", a).passed

    # A case without extra graders hashes and fingerprints as before they existed.
    plain = EvalCase(id="b", reference="Paris", grader={"kind": "exact"})
    assert b.case_hash == plain.case_hash and "extra_graders" not in b.content()
    assert grader_fingerprint(b) == grader_fingerprint(plain) != grader_fingerprint(a.model_copy(update={"id": "b"}))
    fewer = EvalCase(**{**a.content(), "extra_graders": a.extra_graders[:2]})
    assert fewer.case_hash != a.case_hash and grader_fingerprint(fewer) != grader_fingerprint(a)

    for bad, message in [
        ("[{kind: contains, case_sensitiv: true}]", "extra_graders.0.case_sensitiv: not a parameter of contains"),
        ("[{kind: nope}]", "extra_graders.0: unknown grader kind 'nope'"),
    ]:
        path.write_text(f"name: m\ncases:\n  - {{id: c, reference: x, grader: {{kind: exact}}, extra_graders: {bad}}}\n")
        with pytest.raises(SuiteError, match="'c'") as err:
            load_suite(path)
        assert message in str(err.value) and "\n" not in str(err.value)


def test_a_snapshot_keeps_a_case_s_extra_graders(tmp_path):
    from storage.snapshots import read_snapshot_file
    from storage.store import Store
    from tasks.models import EvalCase, EvalSuite

    suite = EvalSuite(name="s", cases=(
        EvalCase(id="a", reference="x", grader={"kind": "exact"}, extra_graders=({"kind": "contains"},)),
        EvalCase(id="b", reference="x", grader={"kind": "exact"})))
    back = read_snapshot_file(Store(tmp_path).snapshots.write(suite))
    assert back.version == suite.version and back.case("a").extra_graders == ({"kind": "contains"},)


ECHO_AGENT = '''
from dataclasses import dataclass
from tasks.registry import agent_kind

@agent_kind("echo", runs_code=True)
@dataclass(frozen=True)
class Echo:
    spec: str
    fingerprint: str

    @classmethod
    def load(cls, spec, rest, base):
        return cls(spec, "echo-" + rest)

    def generate(self, case, ctx):
        return self.spec.partition(":")[2]
'''

AGENT_KIND_PROBE = '''
import json
from evalpipe import evaluate
from tasks.agents import load_agent
from tasks.agents.trust import deployment_refusal
summary = evaluate([{"id": "a", "inputs": {}, "reference": "hi", "grader": {"kind": "exact"}}], "echo:hi",
                   name="echoes")
try:
    load_agent("nope:x")
except Exception as exc:
    unknown = str(exc)
print(json.dumps({"pass_at_1": summary.pass_at_k["1"], "agent": summary.agent, "unknown": unknown,
                  "refused": deployment_refusal("echo:hi", False, {}, ""),
                  "allowed": deployment_refusal("echo:hi", False, {}, "echo")}))
'''


def test_a_plugin_adds_an_agent_kind_that_runs_and_that_deployments_must_allow(tmp_path):
    (tmp_path / "echo_agent.py").write_text(ECHO_AGENT)
    env = {**os.environ, "EVALPIPE_PLUGINS": str(tmp_path / "echo_agent.py"), "EVALPIPE_HOME": str(tmp_path / "home"),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", AGENT_KIND_PROBE], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.splitlines()[-1])
    assert doc["pass_at_1"] == 1.0 and doc["agent"] == "echo:hi"
    assert doc["unknown"] == "agent 'nope:x': unknown scheme 'nope' (expected cmd:, cmdworker:, echo:, openai:, python:, pyworker:, reference or replay:)"
    assert doc["refused"].startswith("agent 'echo:hi': this deployment runs echo: agents only as its own parameters")
    assert doc["allowed"] is None
