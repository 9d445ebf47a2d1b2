"""`make demo`: the whole pipeline on the bundled examples, on evalpipe's local server.

Its first run starts evalpipe's managed server, as any flow-running command does (reused
when already up), so the runs can be looked at in the Prefect UI afterwards; the server stops
itself once unused for EVALPIPE_SERVER_IDLE_S (30 min). QA and HumanEval with a
deterministic demo agent that is right only some of the time, the calc repository task
with a mix of good, trapped and unsafe patches, and a support agent that calls tools
(examples/tools) gated against a worse one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flows.cli import main as evalpipe
from server.managed import credentials_path, running
from storage.store import Store

ROOT = Path(__file__).resolve().parent.parent
AGENT = "python:examples/agents/demo_agent.py:answer"


def step(*args: str) -> int:
    print(f"\n$ evalpipe {' '.join(args)}", flush=True)
    try:
        return evalpipe(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)


def main() -> None:
    os.chdir(ROOT)
    store = Store.default()
    out = store.home / "demo"
    humaneval = out / "humaneval.jsonl"
    step("suite", "import", "humaneval", "--out", str(humaneval))
    step("suite", "hash", "examples/qa.yaml")
    for suite, n, k in (("examples/qa.yaml", "5", "1,5"), (str(humaneval), "5", "1,5"),
                        ("examples/calc/calc.yaml", "8", "1,4")):
        step("run", suite, "--agent", AGENT, "-n", n, "-k", k)
    tools_demo()
    runs = store.runs.list(limit=5)
    for run in runs:
        report = out / f"report-{run['suite_name']}.html"
        step("report", run["run_id"], "--out", str(report))
    print(f"\nDuckDB: {store.db.path}\nruns:   {json.dumps([r['run_id'] for r in runs])}")
    server = running()
    if server is None or os.environ.get("PREFECT_API_URL"):  # the runs went to another API
        return
    print(f"\nPrefect UI: {server.ui_url}/runs (flow runs; each one's Artifacts tab has its summary"
          " and per-slice table)")
    for run in runs:
        if run["flow_run_id"]:
            print(f"  {run['suite_name']:<10} {server.ui_url}/runs/flow-run/{run['flow_run_id']}")
    print(f"The UI asks for the server's credentials: paste the content of {credentials_path(server.directory)}.")
    print("The server serves the next commands too; `evalpipe server stop` stops it now.")


def tools_demo() -> None:
    """An agent that acts (examples/tools): a model that looks things up, then one that skips
    lookups and deletes an account, gated against the first, both served by the scripted stand-in
    for an OpenAI-compatible endpoint (no key, no network)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("scripted_model", ROOT / "examples/tools/scripted_model.py")
    scripted = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scripted)
    saved = {name: os.environ.get(name) for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY")}
    with scripted.ScriptedModel() as model:
        os.environ.update(OPENAI_BASE_URL=model.url, OPENAI_API_KEY="sk-demo-not-a-key")
        try:
            suite = "examples/tools/support.yaml"
            step("run", suite, "--agent", "openai:support-good?max_steps=6", "-n", "3")
            step("run", suite, "--agent", "openai:support-bad?max_steps=6", "-n", "3", "--baseline", "previous",
                 "--max-new-failures", "0")
        finally:
            for name, value in saved.items():
                os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


if __name__ == "__main__":
    main()
