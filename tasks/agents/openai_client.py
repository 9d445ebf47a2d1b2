"""OpenAI-compatible chat completions through the official `openai` SDK.

Used by the `openai:` agent and by `openai:` judges. The SDK does the HTTP, the request
timeout and the retries: 408, 409, 429, 5xx, connection errors and timeouts are retried
with exponential backoff and jitter, honouring `Retry-After`/`retry-after-ms`; any other
status fails at once (a 400 or 401 will not get better by asking again). What is left
here: the endpoint and key from the environment, the one request evalpipe makes, and a failure
as one line (`EndpointError`) with every secret masked before it is shortened — a key
cut in half by the shortening would no longer be found, and would leak.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tasks.agents import sdk_calls
from tasks.agents.settings import DEFAULT_MAX_ATTEMPTS, DEFAULT_TIMEOUT_S
from tasks.redaction import redact

if TYPE_CHECKING:
    import openai

DEFAULT_BASE_URL = "https://api.openai.com/v1"
ERROR_CHARS = 300  # of the server's error body kept in the message
# What the SDK retries, so that a failure can say whether it was retried.
RETRIED_STATUSES = frozenset({408, 409, 429})


@dataclass(frozen=True)
class ChatReply:
    """The first choice's content and what the response's `usage` says it took (None
    where the server did not say), with the model the server names (else the one asked)."""

    content: str
    input_tokens: int | None
    output_tokens: int | None
    model: str
    latency_s: float | None = None  # the request itself, the SDK's import and client's start left out
    # The message's `tool_calls` as OpenAI's chat messages write them ({id, type, function}).
    tool_calls: tuple[dict[str, Any], ...] = ()
    # Under `--replay-model-calls`: its request's digest, and whether it was answered from an
    # earlier run's record (its tokens not bought).
    request_sha256: str | None = None
    replayed: bool = False


class EndpointError(Exception):
    """The endpoint failed for good (after the SDK's retries, or with a status not worth
    retrying). The message is one line with no secret in it."""


@dataclass
class OpenAIClient:
    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    _sdk: openai.OpenAI | None = field(default=None, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    @classmethod
    def from_env(cls) -> OpenAIClient:
        """The endpoint and its key, `OPENAI_BASE_URL` and `OPENAI_API_KEY`: each machine's
        own credentials. The timeout and attempts are the caller's to set (an agent's are its
        run's settings: `tasks.agents.settings.AgentSettings`)."""
        return cls(base_url=os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL,
                   api_key=os.environ.get("OPENAI_API_KEY") or None)

    def chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        *,
        seed: int | None = None,
        params: dict[str, Any] | None = None,
    ) -> str:
        """The first choice's message content ("" when the model returned none)."""
        return self.chat_reply(model, messages, seed=seed, params=params).content

    def chat_reply(
        self,
        model: str,
        messages: list[dict[str, Any]],
        *,
        seed: int | None = None,
        params: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> ChatReply:
        """The first choice's message content ("" when the model returned none), its tool
        calls (`tools`: the function tools the request offers) and usage.

        `params` go into the request body as given (`extra_body`), so that a field the
        SDK does not know (`top_k` for vLLM) reaches the server too.
        """
        import openai  # here, not at the top: importing the SDK takes about a second


        # No key (a local server): the SDK would send a placeholder; send no header.
        headers = None if self.api_key else {"Authorization": openai.omit}
        # Started once, on the first call (the client, and the SDK's modules for the resource,
        # imported as they are first touched): not that call's latency.
        completions = self._client().chat.completions
        started = time.perf_counter()
        try:
            with sdk_calls.calling() as mark:
                completion = completions.create(
                    model=model,
                    messages=messages,  # type: ignore[arg-type] - plain role/content dicts
                    seed=openai.omit if seed is None else seed,
                    extra_body=params or None,
                    extra_headers=headers,
                    tools=tools or openai.omit,  # type: ignore[arg-type] - plain function-tool dicts
                )
        except openai.OpenAIError as exc:
            raise EndpointError(self._reason(exc)) from None
        latency = time.perf_counter() - started
        try:
            message = completion.choices[0].message
            content = message.content
            calls = tuple(c.model_dump(mode="json", exclude_none=True) for c in message.tool_calls or ())
        except (AttributeError, IndexError, TypeError):
            raise EndpointError(
                self._line(f"response has no choices[0].message: {completion!r}")
            ) from None
        usage = getattr(completion, "usage", None)
        named = getattr(completion, "model", None)
        return ChatReply(
            content if isinstance(content, str) else "",
            _count(getattr(usage, "prompt_tokens", None)),
            _count(getattr(usage, "completion_tokens", None)),
            named if isinstance(named, str) and named else model,
            latency,
            calls,
            mark.request_sha256,
            mark.replayed,
        )

    def _client(self) -> openai.OpenAI:
        import httpx2
        import openai

        with self._lock:
            if self._sdk is None:
                # Its requests routed as a sample's model calls (`tasks.agents.sdk_calls`): held
                # by `--model-concurrency`, answered by `--replay-model-calls`.
                transport = sdk_calls.Routed(httpx2.HTTPTransport(limits=openai.DEFAULT_CONNECTION_LIMITS))
                self._sdk = openai.OpenAI(
                    base_url=self.base_url,
                    api_key=self.api_key or "none",
                    timeout=self.timeout_s,
                    max_retries=self.max_attempts - 1,
                    http_client=openai.DefaultHttpxClient(transport=transport),
                )
            return self._sdk

    def _reason(self, exc: openai.OpenAIError) -> str:
        import openai

        if isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            reason = f"HTTP {status}: {exc.response.text}"
            retried = status in RETRIED_STATUSES or status >= 500
        elif isinstance(exc, openai.APITimeoutError):
            reason, retried = f"timed out after {self.timeout_s:g} s", True
        elif isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__
            reason = f"{type(cause).__name__}: {cause}" if cause else str(exc)
            retried = True
        else:
            reason, retried = f"{type(exc).__name__}: {exc}", False
        if retried and self.max_attempts > 1:
            reason = f"gave up after {self.max_attempts} attempts: {reason}"
        return self._line(reason)

    def _line(self, text: str) -> str:
        # Mask first, then shorten: the other way round a cut key escapes the mask.
        return " ".join(redact(text, also=[self.api_key]).split())[:ERROR_CHARS]


def _count(value: Any) -> int | None:
    """A token count as the server gave it; anything but a whole number is no count (one
    out of range is checked where it is reported: `AgentContext.report_usage`)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None
