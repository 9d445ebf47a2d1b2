"""Headless Chromium driven over the DevTools protocol (websockets): open a page, wait for
what a script finds on it, click, take a screenshot. Enough for UI checks, no Playwright."""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

CHROMIUM = "/usr/bin/chromium"
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    "--window-size=1400,1000", "--remote-debugging-port=0",
)


class Browser:
    def __init__(self, profile: Path, log: Path, timeout_s: float = 30.0):
        self._ids = itertools.count(1)
        self.process = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=log.open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self.ws = connect(_page_url(profile, self.process, log, timeout_s), max_size=None,
                              open_timeout=timeout_s)
        except BaseException:
            self._kill()
            raise

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def open(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Evaluate `expression` until it is truthy; return its value."""
        deadline = time.monotonic() + timeout_s
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never satisfied: {expression}")
            time.sleep(0.2)
        return value

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        self.ws.close()
        self._kill()

    def _kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)  # chromium's helpers share its group
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _page_url(profile: Path, process: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """The DevTools websocket of chromium's first page, once it has written its port."""
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout_s
    while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"chromium did not start its DevTools endpoint (see {log})")
        time.sleep(0.05)
    port = port_file.read_text().split()[0]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as resp:
        return next(t for t in json.load(resp) if t["type"] == "page")["webSocketDebuggerUrl"]
