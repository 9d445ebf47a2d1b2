"""What does the model gateway add to a call, and does it hold 100 streamed calls at once?
(printed, not asserted)

The scripted model of examples/tools (a server in a process of its own) answers. Measured:
- p50 and p95 of a chat completion on loopback, straight to the model (the peer) and through
  the gateway with a sample's token, alternating, on one keep-alive-less client each;
- 100 streamed calls at once through the gateway (threads), each reading every event: how many
  completed, and the wall time.
The issue's targets: at most 2 ms added at p50, and all 100 streamed calls held.

Usage: python bench/gateway.py [--calls 200] [--concurrent 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BODY = {"model": "support-good", "messages": [{"role": "user", "content": "Where is my order 1042?"}]}


def call(url: str, token: str, stream: bool = False) -> float:
    body = json.dumps({**BODY, "stream": stream}).encode()
    request = urllib.request.Request(url + "/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as answer:
        answer.read()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--concurrent", type=int, default=100)
    args = parser.parse_args()
    from tasks.agents.gateway import Gateway

    port = 19000 + os.getpid() % 1000
    model = subprocess.Popen([sys.executable, str(ROOT / "examples/tools/scripted_model.py"), "--port", str(port)],
                             stdout=subprocess.PIPE, text=True)
    model.stdout.readline()
    direct = f"http://127.0.0.1:{port}/v1"
    gateway = Gateway(direct, "sk-bench-key")
    try:
        token, tap = gateway.grant()
        for _ in range(10):  # warm both paths
            call(direct, "sk-bench-key"), call(gateway.url, token)
        peer, ours = [], []
        for _ in range(args.calls):
            peer.append(call(direct, "sk-bench-key"))
            ours.append(call(gateway.url, token))
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrent) as pool:
            done = list(pool.map(lambda _: call(gateway.url, token, stream=True), range(args.concurrent)))
        wall = time.perf_counter() - started
    finally:
        gateway.close()
        model.terminate()
        model.wait()
    ms = lambda xs, q: 1e3 * statistics.quantiles(xs, n=100)[q - 1]  # noqa: E731
    print(f"load {os.getloadavg()[0]:.2f}; {args.calls} calls each way, alternating")
    print(f"peer, straight to the model: p50 {ms(peer, 50):.2f} ms  p95 {ms(peer, 95):.2f} ms")
    print(f"through the gateway:         p50 {ms(ours, 50):.2f} ms  p95 {ms(ours, 95):.2f} ms")
    print(f"added at p50: {ms(ours, 50) - ms(peer, 50):+.2f} ms (target: at most 2 ms)")
    print(f"{len(done)} of {args.concurrent} streamed calls at once completed in {wall:.2f} s;"
          f" {tap.calls} calls recorded in the sample's tap")


if __name__ == "__main__":
    main()
