"""`make demo`: the whole pipeline on the bundled examples, on evalpipe's local server.

Its first run starts evalpipe's managed server, as any flow-running command does (reused
when already up), so the runs can be looked at in the Prefect UI afterwards; the server stops
itself once unused for EVALPIPE_SERVER_IDLE_S (30 min). QA and HumanEval with a
deterministic demo agent that is right only some of the time, and the calc repository task
with a mix of good, trapped and unsafe patches.
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
    runs = store.list_runs(limit=3)
    for run in runs:
        report = out / f"report-{run['suite_name']}.html"
        step("report", run["run_id"], "--out", str(report))
    print(f"\nDuckDB: {store.db_path}\nruns:   {json.dumps([r['run_id'] for r in runs])}")
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


if __name__ == "__main__":
    main()
