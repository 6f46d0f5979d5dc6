"""An OpenAI Agents SDK agent with a function tool, on the SDK's default model provider, against a running app.

Run by tests/e2e/test_client_libraries.py in the client libraries' own environment
(.venv-clients, pyproject.toml's ``clients`` group). The SDK's default provider calls
OpenAI's Responses API (``client.responses.create``) with the client set as its default,
as its documentation shows for an OpenAI-compatible server. The agent must call its tool
(``tool_choice`` names it; the tiny model's random weights would not choose to), the SDK
runs the tool and sends its output back as a ``function_call_output`` item, and the SDK
resets ``tool_choice`` for the next turn, whose answer ends the run: the agent's structured
output (``output_type``, a strict JSON schema through ``text.format``), which the random
model's text could not end on its own within the token limit.
Prints one JSON line: the tool's calls, the items the run made, its final output and its responses' ids.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Annotated

from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

CALLS: list[str] = []


class Report(BaseModel):
    """The agent's answer."""

    summary: str = Field(max_length=20)


# The random model writes whatever the schema allows, and the call's argument comes back twice in
# the next turn's prompt (the call and the tool's output): unbounded, a long one took that prompt
# past the tiny model's context (889 of 1,024 tokens, with max_tokens 200 asked).
City = Annotated[str, Field(max_length=20)]


@function_tool
def get_weather(city: City) -> str:
    """The current weather in a city."""
    CALLS.append(city)
    return f"It is sunny in {city}."


async def run_agent(url: str, model: str) -> dict:
    set_default_openai_client(AsyncOpenAI(base_url=url, api_key="unused", max_retries=0))
    set_tracing_disabled(True)  # (the SDK's traces go to OpenAI's platform)
    agent = Agent(
        name="Weather",
        instructions="Answer with the weather tool.",
        model=model,
        tools=[get_weather],
        output_type=Report,
        model_settings=ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, max_tokens=200),
    )
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    return {
        "calls": CALLS,
        "items": [item.type for item in result.new_items],
        "final_output": result.final_output.model_dump(),
        "responses": [response.response_id for response in result.raw_responses],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True, help="the app's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run_agent(args.url, args.model))))


if __name__ == "__main__":
    main()
