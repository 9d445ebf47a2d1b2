"""A run's options are declared once, as `RunConfig` (issue 30): the `evaluate` flow's parameters
(the deployment's form, `prefect deployment run --param`) and `evalpipe run`'s options are
checked against it here, field by field: names, types, defaults, bounds and help. (The flow's
signature and docstring stay literal, because `prefect deploy` reads them from the source.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.run import RunConfig
from tasks.run.rescore import RESCORE_OPTIONS

ROOT = Path(__file__).resolve().parent.parent


def _bounds(schema: dict) -> dict:
    """A JSON schema property's numeric bounds, wherever pydantic put them (anyOf for Optional)."""
    found = {}
    for part in [schema, *schema.get("anyOf", [])]:
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems"):
            if key in part:
                found[key] = part[key]
    return found


def _types(schema: dict) -> set[str]:
    parts = schema.get("anyOf", [schema])
    return {p.get("type", p.get("$ref", "enum" if "enum" in p else "?")) for p in parts}


def test_the_flow_s_parameters_are_the_run_configuration_field_by_field():
    from flows.evaluate import evaluate

    flow = evaluate.parameters.model_dump()["properties"]
    config = RunConfig.model_json_schema()["properties"]
    assert set(flow) == set(config)
    for name, want in config.items():
        got = flow[name]
        assert got.get("default") == want.get("default") or (name == "k" and got["default"] == [1]), name
        assert _bounds(got) == _bounds(want), name
        assert _types(got) == _types(want) or name in {"k", "metric", "runner"}, name
        assert got.get("description"), f"the flow's docstring does not describe {name}"


def test_the_rescore_flow_s_parameters_are_run_configuration_fields():
    """A rescore is a run (`tasks.run.rescore.prepare_rescore` builds its `RunConfig`): each of
    its flow's parameters but the source run is a field, with the field's bounds and default."""
    from flows.rescore import rescore

    flow = rescore.parameters.model_dump()["properties"]
    config = RunConfig.model_json_schema()["properties"]
    assert set(flow) - {"run_id"} <= set(config)
    for name in set(flow) - {"run_id"}:
        assert _bounds(flow[name]) == _bounds(config[name]), name
        assert flow[name].get("default") == config[name].get("default"), name
        assert flow[name].get("description"), f"the rescore flow's docstring does not describe {name}"


def test_the_flow_s_help_is_the_field_s():
    from flows.evaluate import evaluate

    flow = evaluate.parameters.model_dump()["properties"]
    reads = {name: " ".join(flow[name].get("description", "").split()) for name in flow}
    differ = {name for name, field in RunConfig.model_fields.items() if reads[name] != field.description}
    assert differ == set(), "the flow's help differs from the field's description"


def _command(name: str):
    import typer

    from flows.cli import app

    return typer.main.get_command(app).commands[name]


# The commands whose options are fields, with what they take of them; their own beside.
RULES = {"min_pass_at_1", "max_drop", "max_new_failures", "min_slice", "max_increase"}
FIELD_COMMANDS = {
    "run": (set(RunConfig.model_fields), {"max_agent_errors", "max_grader_errors", "as_json"}),
    "rescore": (RESCORE_OPTIONS - {"runner"}, {"run_id", "as_json"}),  # it grades on threads
    "gate": (RULES, {"run_id", "baseline", "metric", "shared_only", "fmt", "as_json"}),
    "report": (RULES, {"run_id", "out", "baseline", "metric"}),
}


@pytest.mark.parametrize("command", sorted(FIELD_COMMANDS))
def test_a_command_s_run_options_are_the_run_configuration_s_fields(command):
    """Generated (`flows/cli/run_options.py`): each field is an option with the field's help,
    bounds and required-ness, and its default (`gate` and `report`: none, the stored decision
    stands); the command adds only its own."""
    from tasks.run.options import flag_name, flag_of

    taken, own = FIELD_COMMANDS[command]
    params = {p.name: p for p in _command(command).params}
    assert set(params) == taken | own
    fields = RunConfig.model_fields
    schema = RunConfig.model_json_schema()["properties"]
    problems = []
    for name in taken:
        field, option = fields[name], params[name]
        flag = flag_of(field)
        if option.help != field.description or not option.help:
            problems.append(f"{name}: help {option.help!r}, field {field.description!r}")
        if not flag.argument and option.opts != [flag_name(name, field)]:
            problems.append(f"{name}: named {option.opts}")
        bounds = _bounds(schema[name])  # an exclusive bound (> 0) is the field's to enforce
        if (option.min, option.max) != (bounds.get("minimum"), bounds.get("maximum")):
            problems.append(f"{name}: bounds {option.min}..{option.max}, field {bounds}")
        if option.required != field.is_required():
            problems.append(f"{name}: required {option.required}")
        given = flag.parse(option.default) if flag.parse and option.default is not None else option.default
        if not field.is_required() and given != (None if command in ("gate", "report") else field.default):
            problems.append(f"{name}: default {option.default!r}, field {field.default!r}")
    assert problems == [], "\n".join(problems)


def test_the_run_command_is_generated_only_when_it_is_used():
    """The fields' module loads the core (NumPy, Arrow): `evalpipe --help` and the other
    commands do not pay for it; `run --help` lists the fields, in their order."""
    probe = ("import json, sys\nfrom flows.cli import main\nmain(['--help'])\n"
             "loaded = 'tasks.run.config' in sys.modules\nmain(['run', '--help'])\n"
             "print(json.dumps([loaded, 'tasks.run.config' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [False, True]
    listed = re.findall(r"^│ [ *]+(--?[a-z0-9-]+)", done.stdout, re.M)
    from tasks.run.options import flag_name, flag_of

    fields = [flag_name(n, f) for n, f in RunConfig.model_fields.items() if not flag_of(f).argument]
    assert [o for o in listed if o in fields] == fields


def test_a_numeric_environment_override_is_of_a_positive_field():
    """`env_overrides` refuses a value that is not positive: true of every field that declares one."""
    from tasks.run.options import flag_of

    schema = RunConfig.model_json_schema()["properties"]
    for name, field in RunConfig.model_fields.items():
        bounds = _bounds(schema[name])
        if flag_of(field).env and "string" not in _types(schema[name]):
            assert bounds.get("minimum", 0) >= 1 or "exclusiveMinimum" in bounds, name


@pytest.mark.parametrize("args, message", [
    (["--max-cost", "0"], "run: --max-cost: Input should be greater than 0"),
    (["--agent-timeout", "0", "--workspace"], "run: --agent-timeout: Input should be greater than 0"),
    (["--agent-timeout", "5"], "run: --agent-timeout goes with --workspace"),
    (["--max-drop", "0.1"], "run: --max-drop, --max-new-failures and --max-increase compare with a baseline: they go"
     " with --baseline"),
    (["--sequential"], "run: --sequential needs --baseline"),
    (["--dask-address", "tls://127.0.0.1:1"], "run: --dask-address goes with --runner dask"),
])
def test_bad_options_are_one_line_and_exit_2_before_anything_runs(home, tmp_path, capsys, args, message):
    from flows.cli import main

    suite = tmp_path / "one.jsonl"
    suite.write_text('{"id": "c0", "inputs": {}, "reference": "yes", "grader": {"kind": "exact"}}\n')
    capsys.readouterr()
    code = main(["run", str(suite), "--agent", "reference", *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"evalpipe: {message}") and err.count("\n") == 1, err
    assert not home.exists() or not (home / "evalpipe.duckdb").exists()  # nothing half-written
