"""A `python:` agent as a team writes one on the OpenAI SDK, with no evalpipe code: its own
client and a tool loop. The case says which API (chat completions or Responses), which client
(sync or async) and whether to stream (tests/test_capture.py)."""

import asyncio
import inspect
import json
import os

from openai import AsyncOpenAI, AsyncStream, OpenAI

TOOLS = {
    "get_weather": lambda a: {"city": a["city"], "sky": "sunny"},
    "get_order": lambda a: {"order_id": a["order_id"], "status": "shipped"},
    "search_kb": lambda a: "Reset it under Settings > Security > Password.",
    "convert_currency": lambda a: {"amount": 92.0, "currency": a["to"]},
}
PARAMETERS = {"type": "object", "additionalProperties": True}


def answer(inputs, ctx):
    url = os.environ["CHAT_URL" if inputs["api"] == "chat" else "RESPONSES_URL"]
    client = (AsyncOpenAI if inputs["client"] == "async" else OpenAI)(base_url=url, api_key="sk-own-client")
    loop = _chat if inputs["api"] == "chat" else _responses
    return asyncio.run(loop(client, inputs["question"], inputs["stream"]))


async def _chat(client, question, stream):
    messages = [{"role": "user", "content": question}]
    tools = [{"type": "function", "function": {"name": n, "parameters": PARAMETERS}} for n in TOOLS]
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    while True:
        made = await _ready(client.chat.completions.create(
            model="support-good", messages=messages, tools=tools, stream=stream, **extra))
        message = await _joined(made) if stream else made.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        if not message.get("tool_calls"):
            return message.get("content") or ""
        for call in message["tool_calls"]:
            result = TOOLS[call["function"]["name"]](json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})


async def _responses(client, question, stream):
    items = [{"role": "user", "content": question}]
    tools = [{"type": "function", "name": n, "parameters": PARAMETERS} for n in TOOLS]
    while True:
        made = await _ready(client.responses.create(model="support-good", input=items, tools=tools, stream=stream))
        response = await _completed(made) if stream else made
        items += [item.model_dump(exclude_none=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return response.output_text
        items += [{"type": "function_call_output", "call_id": c.call_id,
                   "output": json.dumps(TOOLS[c.name](json.loads(c.arguments)))} for c in calls]


async def _ready(made):
    """A sync client's answer, an async one's awaited."""
    return await made if inspect.isawaitable(made) else made


async def _events(stream):
    # By the stream's class: the instrumentation's proxy of a sync stream has `__aiter__` too.
    if isinstance(stream, AsyncStream):
        return [event async for event in stream]
    return list(stream)


async def _joined(stream):
    """A streamed chat completion's message, rebuilt from its chunks."""
    content, calls = "", {}
    for chunk in await _events(stream):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": part.id, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                call["function"]["name"] += part.function.name or ""
                call["function"]["arguments"] += part.function.arguments or ""
    message = {"role": "assistant", "content": content or None}
    return {**message, "tool_calls": [calls[i] for i in sorted(calls)]} if calls else message


async def _completed(stream):
    return next(e.response for e in await _events(stream) if e.type == "response.completed")
