"""Repository environments: a src-layout repository with a dependency that evalpipe's venv
does not have, graded in its own environment, built here from local wheels (offline)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from support.cli import in_process

from tasks.graders import grade
from tasks.graders.repo_tests import grade_base
from tasks.graders.validation import check_case
from tasks.models import EvalCase, InputError, Status
from tasks.repos import environments
from tasks.repos.environments import (
    TESTBED,
    identify,
    list_environments,
    parse_environment,
    prune,
    runtime_for,
)
from tasks.sandbox import Limits
from tasks.suites.dataset import load_suite
from tasks.suites.importers import swebench_suite
from tasks.trace import SampleTrace

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples/pricing"
_spec = importlib.util.spec_from_file_location("build_pricing", EXAMPLE / "build_repo.py")
pricing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pricing)

OFFLINE = pricing.OFFLINE_ENVIRONMENT
ISOLATION_TESTS = textwrap.dedent('''
    import importlib.util
    import os
    import sys

    import centscribe


    def test_harness_hidden():
        for name in ("prefect", "pydantic", "duckdb", "tasks", "flows", "storage"):
            assert importlib.util.find_spec(name) is None, name


    def test_runs_in_its_environment():
        assert sys.prefix == os.environ["VIRTUAL_ENV"]
        assert centscribe.__version__ == "0.9.0"
        assert os.getcwd() == "/tmp/testbed"
''')
F2P = ["tests/test_cart.py::test_discount"]
P2P = [
    "tests/test_cart.py::test_subtotal",
    "tests/test_cart.py::test_receipt",
    "tests/test_isolation.py::test_harness_hidden",
    "tests/test_isolation.py::test_runs_in_its_environment",
]
CART = "src/pricing/cart.py"
GOLD = f"{CART}\n<<<<<<< SEARCH\n    return sub - sub * discount_percent // 10\n=======\n    return sub - sub * discount_percent // 100\n>>>>>>> REPLACE\n"
BREAKS_P2P = GOLD + (  # fixes the discount, and breaks the receipt
    "<<<<<<< SEARCH\n    return fmt(total(prices, discount_percent))\n=======\n"
    "    return fmt(total(prices, discount_percent), \"EUR \")\n>>>>>>> REPLACE\n"
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The pricing example plus pytest's wheels and isolation checks: (path, base commit)."""
    path = tmp_path_factory.mktemp("repos") / "evalpipe__pricing"
    return path, pricing.build_offline(path, {"tests/test_isolation.py": ISOLATION_TESTS})


@pytest.fixture(scope="module")
def env_home(tmp_path_factory: pytest.TempPathFactory):
    """One EVALPIPE_HOME for the module, so its environments are built once."""
    path = tmp_path_factory.mktemp("env-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EVALPIPE_HOME", str(path))
        mp.delenv(environments.INSTALLER_ENV, raising=False)
        yield path


def make_case(repo: tuple[Path, str], environment: dict | None = OFFLINE, **grader) -> EvalCase:
    path, sha = repo
    params = {"kind": "repo_tests", "repo": str(path), "base_commit": sha,
              "fail_to_pass": F2P, "pass_to_pass": P2P, "timeout_s": 120, **grader}
    if environment is not None:
        params["environment"] = environment
    return EvalCase(id="pricing-1", reference=GOLD, grader=params)


# ---------------------------------------------------------------- the spec


def test_spec_is_checked_and_named() -> None:
    assert parse_environment(None) is None
    spec = parse_environment({"python": "python3.11", "install": "pip install -e ."})
    assert spec.install == ("pip install -e .",) and spec.timeout_s == 1800
    for bad, field in (({"install": [1]}, "install.0"), ({"pythn": "x"}, "pythn"),
                       ({"timeout_s": -1}, "timeout_s")):
        with pytest.raises(InputError, match=f"environment: {field}"):
            parse_environment(bad)
    with pytest.raises(InputError, match="must be a mapping"):
        parse_environment(["pip install ."])


def test_a_bad_spec_is_refused_when_the_case_is_made(repo) -> None:
    # Grader parameters are typed and checked when the suite loads (not an error verdict later).
    with pytest.raises(ValueError, match="grader.environment.install"):
        make_case(repo, environment={"install": {"a": 1}})


def test_suite_level_default(tmp_path: Path, repo) -> None:
    path, sha = repo
    suite = tmp_path / "s.yaml"
    suite.write_text(yaml.safe_dump({
        "name": "s",
        "grader_defaults": {"environment": OFFLINE},
        "cases": [{"id": "a", "grader": {"kind": "repo_tests", "repo": str(path), "base_commit": sha,
                                          "fail_to_pass": F2P}}],
    }))
    assert load_suite(suite).case("a").grader["environment"] == OFFLINE


@pytest.mark.slow
def test_identity_is_the_content(repo, env_home: Path) -> None:
    path, sha = repo
    spec = parse_environment(OFFLINE)
    same = identify(spec, str(path), sha, env_home)
    assert identify(parse_environment({**OFFLINE, "setup_commit": sha}), str(path), "main", env_home).key == same.key
    assert identify(parse_environment({"install": OFFLINE["install"][:1]}), str(path), sha, env_home).key != same.key
    assert identify(parse_environment({**OFFLINE, "python": sys.executable}), str(path), sha, env_home).key == same.key
    assert same.name.startswith("evalpipe__pricing-")


# ---------------------------------------------------------------- grading


def test_the_harness_alone_cannot_grade_it(repo, home: Path) -> None:
    """Without an environment the src-layout package and its pinned dependency are missing."""
    verdict = grade(GOLD, make_case(repo, environment=None))
    assert verdict.status is Status.failed


@pytest.mark.slow
def test_gold_resolves_empty_and_breaking_patches_fail(repo, env_home: Path) -> None:
    case = make_case(repo)
    trace = SampleTrace()
    verdict = grade(GOLD, case, trace)
    assert verdict.status is Status.passed, verdict.detail
    name = trace.repo_tests.environment.name
    assert SampleTrace.parse(trace.to_json()).repo_tests.environment == trace.repo_tests.environment  # parsed back
    built = json.loads((env_home / "envs" / name / "env.json").read_text())
    assert built["pytest"] == importlib.metadata.version("pytest")
    # Compiled when built: a graded run, on the venv read-only, can keep no bytecode of its own.
    assert list((env_home / "envs" / name / "venv").glob("lib/python*/site-packages/_pytest/__pycache__/*.pyc"))

    base = grade_base(case)
    assert base.status is Status.failed and "test_discount" in base.detail
    assert "PASS_TO_PASS" not in base.detail  # isolation checks pass at the base too

    broken = grade(BREAKS_P2P, case)
    assert broken.status is Status.failed
    assert "tests/test_cart.py::test_receipt" in broken.detail and "FAIL_TO_PASS" not in broken.detail

    # Reused, not rebuilt: the same env.json, and well under a second of overhead.
    trace = SampleTrace()
    assert grade(GOLD, case, trace).passed
    assert json.loads((env_home / "envs" / name / "env.json").read_text())["built_at"] == built["built_at"]
    assert trace.repo_tests.timings["environment"] < 1.0


@pytest.mark.slow
def test_graded_code_cannot_reach_the_harness(repo, env_home: Path) -> None:
    runtime = runtime_for(parse_environment(OFFLINE), str(repo[0]), repo[1], needs_pytest=True)
    probe = ("import os, sys; [print(sum(len(f) for _, _, f in os.walk(p))) for p in sys.argv[1:]];"
             " open(os.path.join(os.environ['VIRTUAL_ENV'], 'x'), 'w')")
    harness = str(ROOT)
    tree = env_home / "probe-tree"
    tree.mkdir(exist_ok=True)
    result = runtime.run([runtime.python, "-c", probe, harness, sys.prefix], tree, Limits(timeout_s=60), {})
    out = result.stdout.decode().splitlines()
    # Not one file of the harness's code or venv is there; the env is read-only.
    assert out == ["0", "0"] and b"Read-only file system" in result.stderr
    assert runtime.path(tree / "a" / "b.xml", tree) == f"{TESTBED}/a/b.xml"


@pytest.mark.slow
def test_pip_fallback_without_uv(repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVALPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(environments.INSTALLER_ENV, "pip")
    trace = SampleTrace()
    verdict = grade(GOLD, make_case(repo), trace)
    assert verdict.status is Status.passed, verdict.detail
    meta = json.loads((tmp_path / "home/envs" / trace.repo_tests.environment.name / "env.json").read_text())
    assert meta["installer"] == "pip"


# ---------------------------------------------------------------- building once, failing clearly


@pytest.mark.slow
def test_concurrent_processes_build_it_once(repo, tmp_path: Path) -> None:
    path, sha = repo
    spec = {"install": ["echo built >> \"$VIRTUAL_ENV/builds\"", "sleep 1"]}
    script = textwrap.dedent(f"""
        from tasks.repos.environments import parse_environment, runtime_for
        r = runtime_for(parse_environment({spec!r}), {str(path)!r}, {sha!r}, needs_pytest=False)
        print(r.python)
    """)
    env = {**os.environ, "EVALPIPE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0]
    venv = Path(outs[0][0].strip()).parent.parent
    assert (venv / "builds").read_text() == "built\n"
    assert sum("building environment" in err for _, err in outs) == 1  # the progress line
    home = tmp_path / "home"
    (row,) = list_environments(home)
    assert prune(home=home) == {"removed": [], "busy": []}  # ready and just used: kept
    assert prune(unused_days=0, home=home)["removed"] == [row["name"]] and not venv.exists()


def test_without_bubblewrap_it_is_an_error(repo, tmp_path, monkeypatch) -> None:
    from tasks.sandbox import policy as sandbox

    monkeypatch.setenv("EVALPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(sandbox.MODE_ENV, "rlimits")
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")  # as --unsafe-no-sandbox would
    sandbox._bwrap_problem.cache_clear()
    try:
        verdict = grade(GOLD, make_case(repo, environment={"install": ["true"]}))
    finally:
        monkeypatch.undo()
        sandbox._bwrap_problem.cache_clear()
    assert verdict.status is Status.error and "needs bubblewrap" in verdict.detail


@pytest.mark.slow
@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({"python": "python3.99-nonexistent"}, "python 'python3.99-nonexistent' not found"),
        ({"install": ["pip install --no-index evalpipe-no-such-package"]}, "evalpipe-no-such-package"),
        ({"install": ["sleep 60"], "timeout_s": 2}, "timed out"),
    ],
    ids=["missing-python", "missing-package", "timeout"],
)
def test_a_failed_environment_is_one_clear_error(repo, tmp_path, monkeypatch, environment, expected) -> None:
    monkeypatch.setenv("EVALPIPE_HOME", str(tmp_path / "home"))
    case = make_case(repo, environment=environment)
    verdict = grade(GOLD, case)
    assert verdict.status is Status.error and expected in verdict.detail
    # validate says which environment failed; nothing of it is left as if built.
    checked = check_case(case, 1)
    assert checked.problem == "broken" and "environment" in checked.detail
    assert all(row["status"] == "incomplete" for row in list_environments())
    assert prune()["busy"] == [] and list_environments() == []


# ---------------------------------------------------------------- import, list, prune


def write_instances(path: Path, repo, patches: dict[str, str] | None = None) -> Path:
    _, sha = repo
    rows = [{"instance_id": "evalpipe__pricing-1", "repo": "evalpipe/pricing", "version": "0.1",
             "base_commit": sha, "environment_setup_commit": sha, "patch": GOLD,
             "FAIL_TO_PASS": json.dumps(F2P), "PASS_TO_PASS": json.dumps(P2P)}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_import_maps_repo_and_version(repo, tmp_path: Path) -> None:
    instances = write_instances(tmp_path / "inst.jsonl", repo)
    root = repo[0].parent
    envs = tmp_path / "envs.yaml"
    envs.write_text(yaml.safe_dump({"evalpipe/pricing": {"install": ["true"]},
                                    "evalpipe/pricing@0.1": OFFLINE}))
    grader = swebench_suite(instances, root, envs).cases[0].grader
    assert grader["environment"] == {**OFFLINE, "setup_commit": repo[1]}
    assert "environment" not in swebench_suite(instances, root).cases[0].grader
    envs.write_text(yaml.safe_dump({"other/repo": OFFLINE}))
    with pytest.raises(InputError, match=r"line 1: no environment for evalpipe/pricing@0.1 or evalpipe/pricing"):
        swebench_suite(instances, root, envs)
    envs.write_text(yaml.safe_dump({"evalpipe/pricing": {"install": "x", "pyhton": "3"}}))
    with pytest.raises(InputError, match="evalpipe/pricing: pyhton"):
        swebench_suite(instances, root, envs)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`evalpipe ARGS` in this process (support.cli.in_process)."""
    return in_process(list(args), {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.mark.slow
def test_env_list_and_prune(repo, env_home: Path) -> None:
    runtime = runtime_for(parse_environment(OFFLINE), str(repo[0]), repo[1], needs_pytest=True)
    name = Path(runtime.python).parent.parent.parent.name
    rows = json.loads(cli("env", "list", "--json").stdout)
    (row,) = [r for r in rows if r["name"] == name]
    assert row["status"] == "ready" and row["size_bytes"] > 1_000_000 and row["commit"] == repo[1]
    assert name in cli("env", "list").stdout
    # In use (a test run holds it shared): kept.
    with environments._locked(runtime.lock, shared=True):
        assert json.loads(cli("env", "prune", name, "--json").stdout) == {"removed": [], "busy": [name]}
    assert json.loads(cli("env", "prune", "--json").stdout)["removed"] == []  # recent and ready

def test_a_bad_environments_file_is_exit_2(repo, tmp_path: Path) -> None:
    instances = write_instances(tmp_path / "inst.jsonl", repo)
    envs = tmp_path / "envs.yaml"
    for text in ("evalpipe/pricing: [unclosed", "evalpipe/pricing: {install: 3}", "- a list"):
        envs.write_text(text)
        bad = cli("suite", "import", "swebench", str(instances), "--out", str(tmp_path / "out.yaml"),
                  "--environments", str(envs))
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and str(envs) in bad.stderr
        assert not (tmp_path / "out.yaml").exists()


def test_import_validate_run_end_to_end(repo, env_home: Path, tmp_path: Path, prefect_harness) -> None:
    """`suite import swebench --environments`, `suite validate`, `evalpipe run`, as a user would."""
    instances = write_instances(tmp_path / "inst.jsonl", repo)
    envs = tmp_path / "envs.yaml"
    envs.write_text(yaml.safe_dump({"evalpipe/pricing": OFFLINE}))
    suite = tmp_path / "suite.yaml"
    env = {"PREFECT_API_URL": prefect_harness}
    made = cli("suite", "import", "swebench", str(instances), "--repo-root", str(repo[0].parent),
               "--environments", str(envs), "--out", str(suite))
    assert made.returncode == 0, made.stderr
    checked = cli("suite", "validate", str(suite), "--reps", "2", "--json", env=env)
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["valid"] is True
    predictions = tmp_path / "preds.jsonl"
    predictions.write_text("".join(json.dumps({"instance_id": "evalpipe__pricing-1", "model_patch": p}) + "\n"
                                   for p in (GOLD, BREAKS_P2P, "")))
    ran = cli("run", str(suite), "--agent", f"replay:{predictions}", "-n", "3", "--json", env=env)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["status_counts"] == {"passed": 1, "failed": 1, "empty": 1}


@pytest.mark.slow
def test_the_worked_example_with_its_pinned_pytest_from_pypi(tmp_path: Path, monkeypatch) -> None:
    """docs/repo_tests.md's example as shipped: pytest 7.4.4 from the index, not evalpipe's."""
    monkeypatch.setenv("EVALPIPE_HOME", str(tmp_path / "home"))
    root = tmp_path / "repos"
    sha = pricing.build(root / "evalpipe__pricing")
    (case,) = swebench_suite(EXAMPLE / "instances.jsonl", root, EXAMPLE / "environments.yaml").cases
    assert case.grader["base_commit"] == sha  # instances.jsonl pins the commit the script builds
    trace = SampleTrace()
    assert grade(case.reference, case, trace).status is Status.passed
    assert trace.repo_tests.environment.pytest == "7.4.4" != importlib.metadata.version("pytest")
    assert grade_base(case).status is Status.failed

