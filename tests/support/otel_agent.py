"""A `cmd:` agent that knows nothing of evalpipe (tests/test_otlp.py): an OpenAI client and an
OpenTelemetry tracer with the OTLP/HTTP exporter people use, both configured by the standard
environment variables only. It traces its model calls (GenAI `chat` spans, with the usage the
endpoint reported) and its tool runs (GenAI `execute_tool` spans); the SDK's batch processor
sends them when the process exits."""

import json
import sys

import openai
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Status, StatusCode

provider = TracerProvider()  # flushed at exit (its atexit shutdown)
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
tracer = provider.get_tracer("otel-agent")

SKIES = {"Paris": "sunny", "Rome": "cloudy"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def get_weather(city: str) -> dict:
    if city not in SKIES:
        raise LookupError(f"no weather for {city}")
    return {"sky": SKIES[city]}


def main() -> None:
    case = json.load(sys.stdin)
    client = openai.OpenAI(max_retries=0)
    # A coding case has no question: the weather is asked all the same (what is tested is its spans).
    messages = [{"role": "user", "content": case["inputs"].get("question") or "What's the weather in Paris?"}]
    while True:
        with tracer.start_as_current_span("chat support-good") as span:
            span.set_attribute("gen_ai.operation.name", "chat")
            reply = client.chat.completions.create(model="support-good", messages=messages, tools=TOOLS)
            span.set_attribute("gen_ai.usage.input_tokens", reply.usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", reply.usage.completion_tokens)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            with tracer.start_as_current_span(f"execute_tool {call.function.name}") as span:
                span.set_attribute("gen_ai.operation.name", "execute_tool")
                span.set_attribute("gen_ai.tool.name", call.function.name)
                span.set_attribute("gen_ai.tool.call.id", call.id)
                span.set_attribute("gen_ai.tool.call.arguments", call.function.arguments)
                try:
                    result = json.dumps(get_weather(**json.loads(call.function.arguments)))
                except LookupError as exc:
                    span.set_status(Status(StatusCode.ERROR, str(exc)))
                    result = f"error: {exc}"
                span.set_attribute("gen_ai.tool.call.result", result)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(message.content)


main()
