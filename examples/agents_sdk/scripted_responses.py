"""A stand-in for OpenAI's Responses API (`POST /v1/responses`, streamed or not) answering as
examples/tools/scripted_model.py's chat model does: no key, no network, the same answers every
time. The OpenAI Agents SDK calls this API by default. Standard library only.

    python examples/agents_sdk/scripted_responses.py --port 8766
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location("scripted_model", Path(__file__).parent.parent / "tools/scripted_model.py")
scripted_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scripted_model)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses request's input as the chat messages the scripted model reads."""
    items = body.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items or []
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type")
        if kind == "function_call":
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None, "tool_calls": []})
            messages[-1]["tool_calls"].append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif item.get("role") == "assistant":
            messages.append({"role": "assistant", "content": None})
        elif "role" in item:
            content = item.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            messages.append({"role": item["role"], "content": content})
    return messages


def response(body: dict[str, Any], number: int) -> dict[str, Any]:
    """The Responses API answer to a request body."""
    answer = scripted_model.reply({"model": body.get("model"), "messages": chat_messages(body),
                                   "tools": body.get("tools")})
    message = answer["choices"][0]["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append({"type": "message", "id": f"msg_{number}", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{number}_{call['id']}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    used = answer["usage"]
    return {"id": f"resp_{number}", "object": "response", "created_at": 0, "model": answer["model"],
            "status": "completed", "output": output, "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "usage": {"input_tokens": used["prompt_tokens"], "output_tokens": used["completion_tokens"],
                                   "total_tokens": used["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
                                   "output_tokens_details": {"reasoning_tokens": 0}}}


class ScriptedResponses(scripted_model.ScriptedModel):
    """The endpoint on 127.0.0.1 (`port` 0: a free one) until `close()` (the chat model's, as its
    context manager is); `requests` holds every request body and `usage` every answer's usage."""

    def __init__(self, port: int = 0):
        self.requests: list[dict[str, Any]] = []
        self.usage: list[dict[str, int]] = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with lock:
                    outer.requests.append(body)
                    answer = response(body, len(outer.requests))
                    outer.usage.append(answer["usage"])
                if body.get("stream"):
                    self._stream(answer)
                    return
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, answer: dict[str, Any]) -> None:
                """Server-sent events: created, the text a word at a time, completed (the whole answer)."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                events = [{"type": "response.created", "response": {**answer, "status": "in_progress", "output": []}}]
                for item in answer["output"]:
                    for part in item.get("content") or []:
                        events += [{"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0,
                                    "content_index": 0, "delta": word + " "} for word in part["text"].split(" ")]
                events.append({"type": "response.completed", "response": answer})
                for number, event in enumerate(events):
                    event = {**event, "sequence_number": number}
                    self.wfile.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())

            def log_message(self, *args: Any) -> None:
                pass

        self._serve(port, Handler)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8766)
    served = ScriptedResponses(parser.parse_args().port)
    print(f"serving the Responses API at {served.url} (Ctrl-C stops)", flush=True)
    try:
        served._thread.join()
    except KeyboardInterrupt:
        served.close()
