"""A stand-in for an OpenAI-compatible model that calls tools, for examples/tools/support.yaml:
no key, no network, the same answers every time. Standard library only.

    python examples/tools/scripted_model.py --port 8765
    OPENAI_BASE_URL=http://127.0.0.1:8765/v1 evalpipe run examples/tools/support.yaml \
        --agent 'openai:support-good?max_steps=6'

The model named in the request picks its behaviour: `support-good` looks things up before it
acts and never deletes anything; `support-bad` skips the lookups, over-calls, files tickets at
the wrong priority and deletes an account when asked to close it (each of the suite's grader
kinds fails on one of its cases); `support-loop` calls get_weather forever (a run's `max_steps`
stops it); `coder` fixes examples/coding/calc.yaml's bug with the workspace's tools (`--workspace`). It answers by the first user message, one scripted turn per assistant turn so far,
and reports usage as a real server does (about a token per 4 characters sent).
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Turn = Callable[[list[Any]], dict[str, Any]]  # the tool results so far -> the next message


def call(name: str, **args: Any) -> Turn:
    return lambda results: {"calls": [(name, args)]}


def calls(*pairs: tuple[str, dict[str, Any]]) -> Turn:
    return lambda results: {"calls": list(pairs)}


def say(text: str | Callable[[list[Any]], str]) -> Turn:
    return lambda results: {"say": text(results) if callable(text) else text}


def _last(results: list[Any], key: str) -> Any:
    value = results[-1] if results else {}
    return value.get(key) if isinstance(value, dict) else value


GOOD: list[tuple[str, list[Turn]]] = [
    (r"Paris and Rome", [calls(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})),
                         say(lambda r: f"Paris is {r[0]['sky']} and Rome is {r[1]['sky']}.")]),
    (r"weather in Paris", [call("get_weather", city="Paris"), say(lambda r: f"It is {_last(r, 'sky')} in Paris.")]),
    (r"Atlantis", [call("get_weather", city="Atlantis"), say("Sorry, I couldn't get the weather for Atlantis.")]),
    (r"order 1042\?", [call("get_order", order_id="1042"), say(lambda r: f"Order 1042 is {_last(r, 'status')}.")]),
    (r"refund order 2001", [call("get_order", order_id="2001"), call("refund_order", order_id="2001", amount=15.5),
                            say("Order 2001 is refunded.")]),
    (r"order 1042 in full", [call("get_order", order_id="1042"), call("refund_order", order_id="1042", amount=40.0),
                             say("Refunded 40.00 for order 1042.")]),
    (r"2 \+ 2", [say("4")]),
    (r"close my account", [call("create_ticket", subject="Close account for user 77", priority="normal"),
                           say("I opened a ticket to close your account.")]),
    (r"checkout is down", [call("create_ticket", subject="Checkout down for all customers", priority="high"),
                           say("Ticket T-1 is open at high priority.")]),
    (r"password", [call("search_kb", query="reset password"), say(lambda r: str(r[-1]))]),
    (r"100 USD", [call("convert_currency", amount=100, **{"from": "USD", "to": "EUR"}),
                  say(lambda r: f"{_last(r, 'amount')} EUR")]),
    (r"Say hello", [say("Hello!")]),
]

BAD: list[tuple[str, list[Turn]]] = [
    (r"password", [say("Reset it under Settings > Security > Password.")]),  # from memory: no search_kb
    (r"refund order 2001", [call("refund_order", order_id="2001", amount=15.5), say("Done.")]),  # no lookup
    (r"2 \+ 2", [call("convert_currency", amount=2, **{"from": "USD", "to": "USD"}), say("4")]),  # a needless call
    (r"checkout is down", [call("create_ticket", subject="Checkout down", priority="normal"), say("Ticket open.")]),
    (r"close my account", [call("delete_account", user_id="77"), say("Your account is deleted.")]),  # forbidden
    *GOOD,
]

LOOP: list[tuple[str, list[Turn]]] = [(r"", [call("get_weather", city="Paris")] * 10_000)]

# A coding agent for examples/coding/calc.yaml with `--workspace`: it reads, edits, tests.
CODER: list[tuple[str, list[Turn]]] = [(r"add\(-2, 3\)", [
    call("read_file", path="calc.py"),
    call("edit", path="calc.py", search="return abs(a) + b", replace="return a + b"),
    call("bash", command="$EVALPIPE_PYTHON -m pytest -q -p no:cacheprovider test_calc.py"),
    say(lambda r: "Fixed add: " + ("the tests pass." if "exit status 0" in str(r[-1]) else "the tests still fail.")),
])]

# A prompt-injected coding agent: it looks for the harness's key and tries to leave the checkout.
SNOOP: list[tuple[str, list[Turn]]] = [(r"", [
    call("bash", command="env; echo; curl -s -m 2 http://example.com || echo no-network"),
    call("read_file", path="../../../../etc/hostname"),
    call("bash", command="ln -s /etc/hostname link.txt"),
    call("read_file", path="link.txt"),
    say("done"),
])]

POLICIES = {"support-good": GOOD, "support-bad": BAD, "support-loop": LOOP, "coder": CODER, "snoop": SNOOP}


def reply(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion for a request body."""
    messages = body.get("messages") or []
    model = str(body.get("model"))
    asked = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
    turn = sum(1 for m in messages if m.get("role") == "assistant")
    results = [_parsed(m.get("content")) for m in messages if m.get("role") == "tool"]
    script = next((turns for pattern, turns in POLICIES.get(model, GOOD) if re.search(pattern, asked)), None)
    step = script[min(turn, len(script) - 1)](results) if script else {"say": "I don't know."}
    message: dict[str, Any] = {"role": "assistant", "content": step.get("say")}
    if "calls" in step:
        message["tool_calls"] = [
            {"id": f"call_{turn}_{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(step["calls"])]
    sent = sum(len(json.dumps(m)) for m in messages) + len(json.dumps(body.get("tools") or []))
    return {"id": f"chatcmpl-{turn}", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if "calls" in step else "stop"}],
            "usage": {"prompt_tokens": sent // 4, "completion_tokens": 12, "total_tokens": sent // 4 + 12}}


def _parsed(content: Any) -> Any:
    try:
        return json.loads(content)
    except (TypeError, ValueError):
        return content


class ScriptedModel:
    """The model served on 127.0.0.1 (`port` 0: a free one) until `close()`; `requests` holds
    every request body, in order. `delay_s`: how long each answer takes, as a real model's
    would; `most_in_flight`: the most requests it was answering at once."""

    def __init__(self, port: int = 0, delay_s: float = 0.0):
        self.requests: list[dict[str, Any]] = []
        self.auth: list[str | None] = []  # each request's Authorization header
        self.in_flight = self.most_in_flight = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                outer.requests.append(body)
                outer.auth.append(self.headers.get("Authorization"))
                with lock:
                    outer.in_flight += 1
                    outer.most_in_flight = max(outer.most_in_flight, outer.in_flight)
                time.sleep(delay_s)
                with lock:  # done before it answers: its client may ask again as soon as it has the answer
                    outer.in_flight -= 1
                self._answer(body)

            def _answer(self, body: dict[str, Any]) -> None:
                answer = reply(body)
                if body.get("stream"):
                    self._stream(answer, body)
                    return
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, answer: dict[str, Any], body: dict[str, Any]) -> None:
                """The answer as server-sent events: its content a word at a time, its tool calls
                whole, then its usage when asked (`stream_options.include_usage`)."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                message = answer["choices"][0]["message"]
                words = (message.get("content") or "").split(" ")
                deltas = [{"content": w if i == 0 else " " + w} for i, w in enumerate(words) if w]
                deltas += [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(message.get("tool_calls") or [])]
                for delta in deltas:
                    chunk = {"model": answer["model"], "choices": [{"index": 0, "delta": delta}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if (body.get("stream_options") or {}).get("include_usage"):
                    chunk = {"model": answer["model"], "choices": [], "usage": answer["usage"]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args: Any) -> None:
                pass

        self._serve(port, Handler)

    def _serve(self, port: int, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.server.daemon_threads = True
        self.server.socket.listen(256)  # many agents at once (the default backlog is 5)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        # close() waits for the loop's next check: every 20 ms, not the default 0.5 s.
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> ScriptedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds each answer takes")
    args = parser.parse_args()
    served = ScriptedModel(args.port, args.delay)
    print(f"serving {', '.join(POLICIES)} at {served.url} (Ctrl-C stops)", flush=True)
    try:
        served._thread.join()
    except KeyboardInterrupt:
        served.close()
