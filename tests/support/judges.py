"""Deterministic judges for the judge, pairwise and label tests, and a local
OpenAI-compatible chat endpoint to exercise `openai:` judges against."""

from __future__ import annotations

import json
import random
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SUPPORT = Path(__file__).resolve()


def ref(name: str) -> str:
    return f"{SUPPORT}:{name}"


# --- grading judges: fn(output, case, seed) ------------------------------------------------


def says_yes(output, case, seed):
    """Passes outputs containing 'yes' — and nothing else: blind to any canary."""
    return {"passed": "yes" in output, "score": 1.0 if "yes" in output else 0.0, "rationale": "r"}


def coin(output, case, seed):
    """A noisy judge: its draws depend only on the seed it is given."""
    return random.Random(seed).random() < 0.5


def boom(output, case, seed):
    raise RuntimeError("judge endpoint down")


def garbage(output, case, seed):
    return {"verdict": "looks fine"}


def length_judge(output, case, seed):
    """Passes outputs longer than 3 characters (the 'labelled fixture' judge)."""
    return len(output) > 3


# --- pairwise judges: fn(case, first, second, seed) -----------------------------------------


def always_first(case, first, second, seed):
    return "A"


def prefers_reference(case, first, second, seed):
    ref_text = str(case.reference)
    if (first == ref_text) == (second == ref_text):
        return "tie"
    return "first" if first == ref_text else "second"


def flaky_pairwise(case, first, second, seed):
    raise TimeoutError("no answer")


# --- a local chat endpoint ------------------------------------------------------------------


class ChatServer:
    """`POST /v1/chat/completions` on 127.0.0.1, a free port. `reply(body) -> (status,
    content)` decides each answer (a `dict` content is the whole response, e.g. a scripted
    agent's tool calls); every request body is kept in `requests`. With `usage` (and
    `model`), each response carries them as an OpenAI server's does."""

    def __init__(self, reply, usage: dict | None = None, model: str | None = None):
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                body["_auth"] = self.headers.get("Authorization")
                outer.requests.append(body)
                status, content = reply(body)
                doc = content if isinstance(content, dict) else {"choices": [{"message": {"content": content}}]}
                doc.update({k: v for k, v in (("usage", usage), ("model", model)) if v is not None})
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> ChatServer:
        # Imported here: a judge process loads this file by its path, without `support`.
        from support.waiting import serve_in_background

        serve_in_background(self.httpd)
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def user_text(body: dict) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")
