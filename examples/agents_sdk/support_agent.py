"""A support agent built on the OpenAI Agents SDK, with two function tools: nothing in it is
written for evalpipe. evalpipe runs it as `python:` and records its model calls and tool calls
as each sample's trajectory (docs/agents.md "An OpenAI Agents SDK agent, in process").

    python examples/agents_sdk/scripted_responses.py --port 8766 &   # a stand-in model, no key
    OPENAI_BASE_URL=http://127.0.0.1:8766/v1 OPENAI_API_KEY=unused \\
        evalpipe run examples/agents_sdk/support.yaml \\
        --agent python:examples/agents_sdk/support_agent.py:answer -n 3
"""

import json

from agents import Agent, Runner, function_tool, set_trace_processors

# The SDK sends its traces to OpenAI unless told otherwise; replacing its processors with none
# is how its docs say to keep them here (evalpipe adds its own processor beside them).
set_trace_processors([])

WEATHER = {"Paris": {"city": "Paris", "sky": "sunny", "celsius": 21},
           "Rome": {"city": "Rome", "sky": "cloudy", "celsius": 18}}
ORDERS = {"1042": {"order_id": "1042", "status": "shipped", "amount": 40.0}}


@function_tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return json.dumps(WEATHER.get(city, {"error": f"no weather for {city}"}))


@function_tool
def get_order(order_id: str) -> str:
    """An order's status and amount."""
    return json.dumps(ORDERS.get(order_id, {"error": f"no order {order_id}"}))


support = Agent(
    name="support",
    instructions="You answer customers' questions. Look things up with your tools; never guess.",
    tools=[get_weather, get_order],
    model="support-good",  # the stand-in's name; against OpenAI, e.g. "gpt-4.1-mini"
)


def answer(inputs: dict, ctx) -> str:
    return str(Runner.run_sync(support, inputs["question"]).final_output)
