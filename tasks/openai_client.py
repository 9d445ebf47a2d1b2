"""A small client for OpenAI-compatible chat completions, with bounded retries.

Used by the `openai:` agent and meant for any grader that asks a model (a judge). It
retries what is worth retrying — 408, 409, 429, 5xx and transport errors (refused or
dropped connections, timeouts) — with exponential backoff and jitter, honouring a
`Retry-After` (or `retry-after-ms`) header, and gives up after `max_attempts`. Any other
status fails at once: a 400 or 401 will not get better by asking again.

The API key is never put in a message or a repr: error text from the server is redacted.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

DEFAULT_BASE_URL = "https://api.openai.com/v1"
RETRY_STATUSES = frozenset({408, 409, 429}) | frozenset(range(500, 600))


class EndpointError(Exception):
    """The endpoint failed for good (after retries, or with a status not worth retrying)."""


@dataclass
class OpenAIClient:
    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 60.0  # per request
    max_attempts: int = 5
    backoff_s: float = 0.5  # first retry waits about this long, doubling each time
    max_backoff_s: float = 30.0  # no single wait is longer, Retry-After included
    _http: httpx.Client | None = field(default=None, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    @classmethod
    def from_env(cls, **overrides: Any) -> OpenAIClient:
        """`OPENAI_BASE_URL`, `OPENAI_API_KEY`, `EVALPIPE_OPENAI_TIMEOUT_S`,
        `EVALPIPE_OPENAI_MAX_ATTEMPTS`; keyword arguments win over the environment."""
        settings: dict[str, Any] = {
            "base_url": os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL,
            "api_key": os.environ.get("OPENAI_API_KEY") or None,
        }
        for key, env, kind in (
            ("timeout_s", "EVALPIPE_OPENAI_TIMEOUT_S", float),
            ("max_attempts", "EVALPIPE_OPENAI_MAX_ATTEMPTS", int),
        ):
            if os.environ.get(env):
                try:
                    settings[key] = kind(os.environ[env])
                except ValueError:
                    raise ValueError(f"{env}={os.environ[env]!r} is not a number") from None
        return cls(**{**settings, **overrides})

    def chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        *,
        seed: int | None = None,
        params: dict[str, Any] | None = None,
    ) -> str:
        """The first choice's message content ("" when the model returned none)."""
        body: dict[str, Any] = {**(params or {}), "model": model, "messages": messages}
        if seed is not None:
            body["seed"] = seed
        data = self.post_json("/chat/completions", body)
        try:
            content = data["choices"][0]["message"].get("content")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise EndpointError(f"response has no choices[0].message: {str(data)[:200]}") from None
        return content if isinstance(content, str) else ""

    def post_json(self, path: str, body: dict[str, Any]) -> Any:
        url = self.base_url.rstrip("/") + path
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        reason = "no attempt made"
        for attempt in range(1, self.max_attempts + 1):
            wait: float | None = None
            try:
                response = self._client().post(url, json=body, headers=headers)
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            else:
                if response.is_success:
                    try:
                        return response.json()
                    except ValueError:
                        raise EndpointError(
                            f"HTTP {response.status_code} with a body that is not JSON: "
                            f"{self._redact(response.text[:200])}"
                        ) from None
                reason = f"HTTP {response.status_code}: {self._redact(response.text[:300])}"
                if response.status_code not in RETRY_STATUSES:
                    raise EndpointError(reason)
                wait = retry_after_s(response.headers)
            if attempt < self.max_attempts:
                time.sleep(self._delay(attempt, wait))
        raise EndpointError(f"gave up after {self.max_attempts} attempts: {reason}")

    def close(self) -> None:
        with self._lock:
            if self._http is not None:
                self._http.close()
                self._http = None

    def _client(self) -> httpx.Client:
        with self._lock:
            if self._http is None:
                self._http = httpx.Client(timeout=httpx.Timeout(self.timeout_s))
            return self._http

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_backoff_s)
        # Equal jitter: half the exponential step for sure, half at random, so that many
        # workers hitting one rate limit do not all come back at the same instant.
        step = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return step / 2 + random.uniform(0, step / 2)

    def _redact(self, text: str) -> str:
        return text.replace(self.api_key, "***") if self.api_key else text


def retry_after_s(headers: httpx.Headers) -> float | None:
    """Seconds the server asked us to wait, from `retry-after-ms` or `Retry-After`."""
    if (ms := headers.get("retry-after-ms")) is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None
