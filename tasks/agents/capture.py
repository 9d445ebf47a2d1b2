"""In-process capture (docs/agents.md "Model calls captured in process"): the model calls a
`python:` agent's own code makes through the OpenAI SDK, and the function tools the OpenAI
Agents SDK runs for it, recorded as its sample's trajectory and usage with no recording code
in the agent.

OpenInference's instrumentations of the two SDKs make OpenTelemetry spans; they are given a
tracer provider of evalpipe's own (never the global one, and nothing exported), whose one
processor hands each span to the sample that started it: `captured` sets a context variable
around the agent's call, read when a span starts (a thread or an asyncio task of the sample
inherits it; another sample's never does). A model call's span carries its request and answer
as JSON, which the gateway's `Tap` turns into trajectory entries and usage, as for an
out-of-process agent; a function tool's span becomes a tool result.

The run's caps on a sample (`--max-model-calls`, `--max-sample-cost`) hold here as at the
gateway: the SDK's `request` is wrapped, outside the instrumentation's own wrapper, so the call
past a cap raises the SDK's 403 error before anything is sent, and the sample is `agent_error`
naming the cap. Below it, httpx's transports are wrapped for the SDK's requests of a captured
sample (`tasks.agents.sdk_calls`): `--model-concurrency` holds them, and `--replay-model-calls`
answers the recorded ones, whose spans are then recorded as replayed (their tokens not bought).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from tasks.agents import sdk_calls
from tasks.agents.base import AgentContext, AgentError
from tasks.agents.gateway import Tap, tapped
from tasks.agents.otlp import ToolRun
from tasks.agents.settings import AgentSettings

log = logging.getLogger("evalpipe")

# What capture needs; `openai-agents` only adds its function-tool spans.
NEEDED = ("opentelemetry.sdk", "openinference.instrumentation.openai")
INSTALL_HINT = "pip install 'evalpipe[agents]'"

_SAMPLE: ContextVar[Tap | None] = ContextVar("evalpipe_captured_sample", default=None)


@contextmanager
def captured(ctx: AgentContext, settings: AgentSettings | None = None) -> Iterator[None]:
    """Record the model calls made while the block runs (the agent's call) as `ctx`'s sample's:
    its usage, and its trajectory unless the agent recorded model turns itself (`ctx.record`),
    the same rule as the gateway's; `settings`: the run's (the trajectory's cap, the caps on the
    sample's calls). `AgentError` naming the cap that refused a call, if one did."""
    if _instrumented() is None:
        yield
        return
    settings = settings or AgentSettings()
    tap = Tap(max_calls=settings.max_model_calls, max_cost_usd=settings.max_sample_cost, cost_of=ctx.cost_of,
              purse=ctx.purse)
    token = _SAMPLE.set(tap)
    try:
        with sdk_calls.routing(sdk_calls.sample_calls(ctx.calls, settings.model_concurrency)):
            yield
    finally:
        _SAMPLE.reset(token)
        if (kept := tapped(tap, ctx, ctx.trace.trajectory, settings.max_trajectory_bytes)) is not ctx.trace.trajectory:
            ctx.trace.trajectory = kept  # set only when there is one: an unset section is not stored
        if (stopped := tap.stop_reason()) is not None:  # what the refusal made the agent raise, said plainly
            raise AgentError(stopped)


def unavailable() -> str | None:
    """Why capture cannot run in this process (a package missing), or None."""
    missing = [name for name in NEEDED if not _importable(name)]
    if missing:
        return f"in-process capture of model calls is unavailable ({', '.join(missing)} not installed: {INSTALL_HINT})"
    return None


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


class _Installed:
    """The process's instrumentation: the OpenAI SDK's at once, the Agents SDK's once the agent's
    code has imported it (importing it for every `python:` agent would cost each run its import)."""

    def __init__(self) -> None:
        from openinference.instrumentation import TraceConfig
        from openinference.instrumentation.openai import OpenAIInstrumentor
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider

        # Unlimited: a span's request and answer must arrive whole to parse, and the SDK's
        # default count limit evicts the oldest attributes, the request first.
        unset = SpanLimits.UNSET
        self.provider = TracerProvider(span_limits=SpanLimits(
            max_span_attributes=unset, max_span_attribute_length=unset, max_attributes=unset,
            max_attribute_length=unset))
        self.provider.add_span_processor(_processor())
        # Explicit: an OPENINFERENCE_HIDE_* variable in the environment would blind capture.
        self.config = TraceConfig(hide_inputs=False, hide_outputs=False)
        self.agents = False
        OpenAIInstrumentor().instrument(tracer_provider=self.provider, config=self.config)
        _refuse_past_caps()

    def follow_agents_sdk(self) -> None:
        agents = sys.modules.get("agents")
        if self.agents or not hasattr(agents, "add_trace_processor"):  # not imported, or a module of that name
            return
        if importlib.util.find_spec("openinference.instrumentation.openai_agents") is None:
            self.agents = True
            log.warning("evalpipe: the OpenAI Agents SDK's tool calls are not captured"
                        " (openinference-instrumentation-openai-agents not installed: %s)", INSTALL_HINT)
            return
        from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

        # Beside the processors the agent's code set, not instead of them (the default replaces them).
        OpenAIAgentsInstrumentor().instrument(tracer_provider=self.provider, config=self.config,
                                              exclusive_processor=False)
        self.agents = True


def _refuse_past_caps() -> None:
    """The SDK's clients' `request`, wrapped outside the instrumentation's wrapper: a call of a
    captured sample past its cap raises the SDK's own 403 error, and nothing is sent."""
    import httpx
    import openai
    import wrapt

    def refused(instance: Any) -> openai.PermissionDeniedError | None:
        tap = _SAMPLE.get()
        why = tap.refuse_past_cap() if tap is not None else None
        if why is None:
            return None
        message = f"evalpipe: {why} reached for this sample: no more model calls"
        answer = httpx.Response(403, request=httpx.Request("POST", str(instance.base_url)),
                                json={"error": {"message": message, "type": "evalpipe_cap"}})
        return openai.PermissionDeniedError(message, response=answer, body={"message": message})

    def sync_request(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        if (error := refused(instance)) is not None:
            raise error
        with sdk_calls.calling():
            return wrapped(*args, **kwargs)

    async def async_request(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        if (error := refused(instance)) is not None:
            raise error
        with sdk_calls.calling():
            return await wrapped(*args, **kwargs)

    def sync_send(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return sdk_calls.route(args[0] if args else kwargs["request"], wrapped)

    async def async_send(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return await sdk_calls.route_async(args[0] if args else kwargs["request"], wrapped)

    wrapt.wrap_function_wrapper("openai", "OpenAI.request", sync_request)
    wrapt.wrap_function_wrapper("openai", "AsyncOpenAI.request", async_request)
    # The SDK's HTTP library's (httpx2), every client's: an agent may give its SDK client its own.
    # Nothing but a captured sample's SDK request is routed (`tasks.agents.sdk_calls`).
    wrapt.wrap_function_wrapper("httpx2", "HTTPTransport.handle_request", sync_send)
    wrapt.wrap_function_wrapper("httpx2", "AsyncHTTPTransport.handle_async_request", async_send)


_INSTALLED: list[_Installed | None] = []
_INSTALLING = threading.Lock()


def _instrumented() -> _Installed | None:
    """The process's instrumentation, installed on first use; None (said once) without its packages."""
    with _INSTALLING:
        if not _INSTALLED:
            why = unavailable()
            if why:
                log.warning("evalpipe: %s; python: agents report no usage of their own", why)
            _INSTALLED.append(None if why else _Installed())
        installed = _INSTALLED[0]
        if installed is not None:
            installed.follow_agents_sdk()
        return installed


class _ToSample:
    """The span processor: a span started under a sample is recorded into its `Tap` when it ends."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, int], tuple[Tap, sdk_calls.CallMark | None]] = {}
        self._lock = threading.Lock()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        tap = _SAMPLE.get()
        if tap is None:
            return
        if _kind(span) == "model":
            tap.admit()  # counted in flight as the gateway counts it
        with self._lock:  # the SDK request's mark: whether its answer was replayed
            self._open[(span.context.trace_id, span.context.span_id)] = (tap, sdk_calls.current_mark())

    def on_end(self, span: Any) -> None:
        with self._lock:
            tap, mark = self._open.pop((span.context.trace_id, span.context.span_id), (None, None))
        kind = _kind(span) if tap is not None else None
        if kind == "model":
            _record_call(tap, span, mark)
        elif kind == "tool":
            _record_tool(tap, span)



def _processor() -> _ToSample:
    from opentelemetry.sdk.trace import SpanProcessor

    # Built here: the SDK is imported only once a python: agent runs.
    class ToSample(_ToSample, SpanProcessor):
        pass

    return ToSample()


def _kind(span: Any) -> str | None:
    """"model" for the OpenAI SDK's model calls, "tool" for the Agents SDK's function tools; the
    Agents SDK's own model spans are the same calls seen again, and are left out."""
    from openinference.semconv.trace import OpenInferenceSpanKindValues, SpanAttributes

    scope = span.instrumentation_scope.name if span.instrumentation_scope else ""
    kind = (span.attributes or {}).get(SpanAttributes.OPENINFERENCE_SPAN_KIND)
    if scope == "openinference.instrumentation.openai" and kind == OpenInferenceSpanKindValues.LLM.value:
        return "model"
    if scope == "openinference.instrumentation.openai_agents" and kind == OpenInferenceSpanKindValues.TOOL.value:
        return "tool"
    return None


def _record_call(tap: Tap, span: Any, mark: sdk_calls.CallMark | None) -> None:
    from openinference.semconv.trace import SpanAttributes
    from opentelemetry.trace import StatusCode

    attributes = span.attributes or {}
    request = _as_chat(_json(attributes.get(SpanAttributes.INPUT_VALUE)))
    latency_s = (span.end_time - span.start_time) / 1e9
    if span.status.status_code is StatusCode.ERROR:
        # No answer (the SDK raised, after its retries): the gateway records an HTTP status, an
        # in-process call says what the SDK raised. The request's new messages are kept.
        messages = request.get("messages") if isinstance(request.get("messages"), list) else []
        with tap.lock:
            tap.calls += 1
            tap.pending -= 1
            tap.latency_s += latency_s
            tap.entries += [m for m in messages[tap.seen_messages:] if isinstance(m, dict) and m.get("role") != "assistant"]
            tap.seen_messages = max(tap.seen_messages, len(messages))
            tap.entries.append({"error": span.status.description or "the model call failed",
                                "model": request.get("model")})
        return
    mark = mark or sdk_calls.CallMark()
    tap.record(request, _json(attributes.get(SpanAttributes.OUTPUT_VALUE)), latency_s, 200,
               digest=mark.request_sha256, replayed=mark.replayed)


def _record_tool(tap: Tap, span: Any) -> None:
    """A function tool's span as its run (`Tap.ran`: joined to the model's call as an OTLP
    span's is; this one has no call id)."""
    from openinference.semconv.trace import SpanAttributes
    from opentelemetry.trace import StatusCode

    attributes = span.attributes or {}
    failed = span.status.status_code is StatusCode.ERROR
    tap.ran([ToolRun(name=str(attributes.get(SpanAttributes.TOOL_NAME) or span.name), call_id=None,
                     arguments=attributes.get(SpanAttributes.INPUT_VALUE),
                     content=str(attributes.get(SpanAttributes.OUTPUT_VALUE, "")),
                     duration_s=(span.end_time - span.start_time) / 1e9,
                     error=(span.status.description or "the tool failed") if failed else None)])


def _json(text: Any) -> dict[str, Any]:
    try:
        value = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _as_chat(request: dict[str, Any]) -> dict[str, Any]:
    """A Responses API request with its `input` as chat messages (what the `Tap` reads): its
    instructions a system message, each model's output (function calls, a message) one assistant
    message, each function call's output a tool message."""
    if "messages" in request or "input" not in request:
        return request
    items = request["input"]
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    messages: list[dict[str, Any]] = []
    if isinstance(request.get("instructions"), str):
        messages.append({"role": "system", "content": request["instructions"]})
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type")
        if kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        elif kind in ("function_call", "reasoning") or item.get("role") == "assistant":
            if not messages or messages[-1].get("role") != "assistant":
                messages.append({"role": "assistant", "content": None})
        elif "role" in item:
            messages.append({"role": item["role"], "content": item.get("content")})
    return {**request, "messages": messages}
