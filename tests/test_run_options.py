"""A run's options are declared once, as `RunConfig` (issue 30): the `evaluate` flow's parameters
(the deployment's form, `prefect deployment run --param`) and `evalpipe run`'s options are
checked against it here, field by field: names, types, defaults, bounds and help. (The flow's
signature and docstring stay literal, because `prefect deploy` reads them from the source.)"""

from __future__ import annotations

import inspect
import typing

import pytest

from tasks.run import RunConfig

# `run` options that are not the run's configuration but the command's own reading of its result.
CLI_ONLY = {"max_agent_errors", "max_grader_errors", "as_json"}
CLI_NAMES = {"sequential_rounds": "rounds"}  # field -> the CLI's parameter, where they differ


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


def test_the_run_command_s_options_are_the_run_configuration():
    from flows.cli import run

    hints = typing.get_type_hints(run, include_extras=True)
    params = inspect.signature(run).parameters
    fields = RunConfig.model_fields
    assert set(params) - CLI_ONLY == {CLI_NAMES.get(name, name) for name in fields}
    schema = RunConfig.model_json_schema()["properties"]
    problems = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    for name, info in fields.items():
        cli_name = CLI_NAMES.get(name, name)
        option = next(m for m in hints[cli_name].__metadata__ if hasattr(m, "help"))
        if name != "suite":  # the argument's help is SUITE's, shared by every command
            check(bool(option.help), f"--{name} has no help")
        bounds = _bounds(schema[name])
        # An exclusive bound (> 0) is RunConfig's to enforce: typer cannot state one.
        low = bounds.get("minimum")
        check((option.min, option.max) == (low, bounds.get("maximum")),
              f"--{name}'s bounds: {option.min}..{option.max}, config {low}..{bounds.get('maximum')}")
        default, given = info.default, params[cli_name].default
        if info.is_required():
            check(given is inspect.Parameter.empty or name == "agent", f"--{name} is required")
        elif given is not None and name != "k":
            check(given == default, f"--{name}'s default: {given!r}, config {default!r}")
        elif given is None:  # the CLI leaves it unset: the config's default applies
            check(default is None or name == "agent_timeout", f"--{name}'s default: None, config {default!r}")
    assert problems == [], "\n".join(problems)


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
