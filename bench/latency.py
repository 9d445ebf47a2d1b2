"""Agent latency as stored, against an `openai:` endpoint that answers in 0.3 s: each of the
first calls of a fresh process (the SDK imported and the client started on the first). The
stored `latency_s` should read the endpoint's time on every call, the first included; the
whole draw (`output.agent_s` in the trace) shows what the first call's start-up costs besides.

The peer is main before issue 31: 2.68 s for the first call's latency (the SDK's import and
the client's start counted), 0.32 s after.

    .venv/bin/python bench/latency.py [--calls 3] [--delay 0.3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.3)
    args = parser.parse_args()
    from support.judges import ChatServer

    def reply(body):
        time.sleep(args.delay)
        return 200, "yes"

    print(f"load: {os.getloadavg()[0]:.2f}; endpoint answers in {args.delay:g} s")
    with ChatServer(reply) as server:
        os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"] = server.url, "sk-bench"
        from tasks.agents import load_agent
        from tasks.models import EvalCase
        from tasks.run.sampling import PlannedSample, draw_output

        agent = load_agent("openai:bench-model")
        case = EvalCase(id="c", reference="yes", grader={"kind": "exact"}, inputs={"prompt": "hi"})
        for i in range(args.calls):
            drawn = draw_output(agent, case, PlannedSample("c", i, i, "k", case.case_hash), 1, 1 << 20)
            print(f"call {i}: latency_s {drawn.usage.latency_s:.3f} s   whole draw {drawn.draw_s:.3f} s"
                  + (f"   {drawn.error}" if drawn.error else ""))
    print("peer (main before issue 31): call 0 latency_s 2.679 s, later calls 0.322 s")


if __name__ == "__main__":
    main()
