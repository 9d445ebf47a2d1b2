"""The gateway's OTLP endpoint (docs/agents.md "Spans an agent sends: OTLP"): how long the
OTLP/HTTP exporter agents use waits for one export of N tool spans, sent to the gateway (token
checked, protobuf parsed, each tool run joined into a fresh sample's trajectory) beside the same
export sent in the same run to a peer that only reads the body and answers 200, the floor of any
receiver in Python's standard HTTP server. The difference is what reading and joining cost.

    .venv/bin/python bench/otlp.py [--spans 100] [--exports 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Floor(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def tool_spans(count: int) -> list:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    kept = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(kept))
    tracer = provider.get_tracer("bench")
    for i in range(count):
        with tracer.start_as_current_span("execute_tool get_weather") as span:
            span.set_attributes({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather",
                                 "gen_ai.tool.call.id": f"call_{i}", "gen_ai.tool.call.arguments": '{"city": "Paris"}',
                                 "gen_ai.tool.call.result": '{"sky": "sunny"}'})
    return list(kept.get_finished_spans())


def timed(targets: list[tuple[str, dict[str, str], Callable[[], None] | None]], spans: list,
          exports: int) -> list[list[float]]:
    """Each target's export times, the targets taking turns (a load that comes and goes hits all alike)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    exporters = [OTLPSpanExporter(endpoint=url, headers=headers) for url, headers, _ in targets]
    times: list[list[float]] = [[] for _ in targets]
    for _ in range(exports):
        for (_, _, before), exporter, kept in zip(targets, exporters, times, strict=True):
            if before is not None:
                before()
            started = time.perf_counter()
            assert exporter.export(spans) is SpanExportResult.SUCCESS
            kept.append(time.perf_counter() - started)
    for exporter in exporters:
        exporter.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spans", type=int, default=100)
    parser.add_argument("--exports", type=int, default=50)
    args = parser.parse_args()
    from tasks.agents.gateway import Gateway

    spans = tool_spans(args.spans)
    floor = ThreadingHTTPServer(("127.0.0.1", 0), Floor)
    floor.daemon_threads = True
    threading.Thread(target=floor.serve_forever, daemon=True).start()
    gateway = Gateway("http://127.0.0.1:9/v1", None)  # no model call is made: no endpoint needed
    grants = []
    lease = gateway.lease()

    def fresh_sample() -> None:  # each export a new sample's, as a worker's lease is granted in turn
        grants.append(gateway.grant(lease=lease)[1])

    try:
        base = gateway.url.removesuffix("/v1")
        ours, peer = timed([(base + "/v1/traces", {"authorization": f"Bearer {lease}"}, fresh_sample),
                            (f"http://127.0.0.1:{floor.server_address[1]}/v1/traces", {}, None)], spans, args.exports)
    finally:
        gateway.close()
        floor.shutdown()
        floor.server_close()
    assert all(len(tap.entries) == args.spans for tap in grants)
    print(f"load: {os.getloadavg()[0]:.2f}; one export of {args.spans} tool spans (protobuf), {args.exports} exports")
    for name, times in (("gateway /v1/traces", ours), ("peer: read body, answer 200", peer)):
        times.sort()
        print(f"{name:30s} p50 {statistics.median(times) * 1e3:7.2f} ms   p95 {times[int(len(times) * 0.95) - 1] * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
