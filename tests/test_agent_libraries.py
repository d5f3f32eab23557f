"""The agent libraries themselves against a real `tandem serve` (issue 28): instructor (TOOLS and
JSON_SCHEMA modes), LangChain (`bind_tools(tool_choice="any")`, `with_structured_output`),
pydantic-ai (`Agent(output_type=...)`), the OpenAI Agents SDK over chat completions with a
function tool, the `openai` client's streamed tool calls, and a hand-written two-turn loop.

Each runs on three servers, all shared with other modules (no process of its own): `tandem serve`
over Redis and a worker on the real SmolLM2-135M-Instruct (the session's two-model fleet), and
the tiny random Llama both over the session fleet's worker and in `tandem serve --embedded`, so
that the calls travel as job events through Redis and in process. Every call's arguments
are validated against its tool's JSON Schema here, independently of the libraries' own parsing:
the claim is that the server's calls always parse, so the tiny model's random weights must
produce valid calls too (the grammar, not the model, makes them valid)."""

from __future__ import annotations

import json
from typing import Annotated

import jsonschema
import pytest
from fleet_support import MODELS_SMOL, model_ids
from pydantic import BaseModel, ConfigDict, Field
from test_jobs_support import wait_for

pytestmark = pytest.mark.slow


# Strings carry a maxLength and numbers a range: the tiny model's random weights would otherwise
# fill a string or a number until max_tokens (nearly every token is allowed inside one), while
# SmolLM2 closes them by itself.
class City(BaseModel):
    # No properties beyond these (additionalProperties false), as OpenAI's strict mode asks:
    # SmolLM2 otherwise goes on inventing "population_density_per_square_kilometer_..." keys.
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the city's name", max_length=24)
    population: int = Field(description="how many people live there", ge=0, le=100_000_000)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city's name", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
WEATHER_SCHEMA = WEATHER_TOOL["function"]["parameters"]
CITY_SCHEMA = City.model_json_schema()
QUESTION = "Use the tool: what is the weather in Paris, in celsius?"
MAX_TOKENS = 64  # a call to these tools takes about 20 tokens; the tiny model stops at the grammar's end


class Server:
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.base_url = url + "/v1"

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)

    def async_openai(self):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def smollm2_worker(models_fleet):
    fleet = models_fleet.ready()
    return Server(fleet.server.url, MODELS_SMOL)


@pytest.fixture(scope="module")
def tiny_worker(shared_fleet):
    fleet = shared_fleet.ready()
    return Server(fleet.server.url, fleet.model)


@pytest.fixture(scope="module")
def tiny_embedded(shared_fleet):
    proc = shared_fleet.embedded()
    return Server(proc.url, wait_for(lambda: model_ids(proc.url), 30, "the model in /v1/models")[0])


@pytest.fixture(params=["worker-smollm2", "worker-tiny", "embedded-tiny"])
def server(request) -> Server:
    return request.getfixturevalue(request.param.split("-")[1] + "_" + request.param.split("-")[0])


def valid(arguments: str | dict, schema: dict) -> dict:
    """The call's arguments, parsed and checked against the tool's schema (raises if not)."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, schema)
    return args


def test_instructor_tools_mode_returns_a_validated_model(server):
    import instructor

    client = instructor.from_openai(server.openai(), mode=instructor.Mode.TOOLS)
    city, raw = client.chat.completions.create_with_completion(
        model=server.model,
        response_model=City,
        messages=[{"role": "user", "content": "Paris has about 2 million people. Extract the city."}],
        max_tokens=MAX_TOKENS,
        max_retries=0,
    )
    assert isinstance(city, City)
    (call,) = raw.choices[0].message.tool_calls
    assert call.function.name == "City"
    valid(call.function.arguments, CITY_SCHEMA)
    assert raw.choices[0].finish_reason == "tool_calls"


def test_instructor_json_schema_mode_returns_a_validated_model(server):
    import instructor

    client = instructor.from_openai(server.openai(), mode=instructor.Mode.JSON_SCHEMA)
    city, raw = client.chat.completions.create_with_completion(
        model=server.model,
        response_model=City,
        messages=[{"role": "user", "content": "Paris has about 2 million people. Extract the city as JSON."}],
        max_tokens=MAX_TOKENS,
        max_retries=0,
    )
    assert isinstance(city, City)
    valid(raw.choices[0].message.content, CITY_SCHEMA)


def test_langchain_bind_tools_any_calls_the_tool(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=server.model, base_url=server.base_url, api_key="unused", max_retries=0, max_tokens=MAX_TOKENS
    )
    message = llm.bind_tools([WEATHER_TOOL], tool_choice="any").invoke(QUESTION)
    (call,) = message.tool_calls[:1]
    assert call["name"] == "get_weather"
    valid(call["args"], WEATHER_SCHEMA)
    assert not message.invalid_tool_calls


def test_langchain_with_structured_output_returns_the_model(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=server.model, base_url=server.base_url, api_key="unused", max_retries=0, max_tokens=MAX_TOKENS
    )
    city = llm.with_structured_output(City).invoke("Paris has about 2 million people. Extract the city.")
    assert isinstance(city, City)
    valid(city.model_dump(), CITY_SCHEMA)


def test_pydantic_ai_agent_with_typed_output(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model = OpenAIChatModel(server.model, provider=OpenAIProvider(openai_client=server.async_openai()))
    agent = Agent(model, output_type=City, model_settings=ModelSettings(max_tokens=MAX_TOKENS), retries=0)
    result = agent.run_sync("Paris has about 2 million people. Extract the city.")
    assert isinstance(result.output, City)
    calls = [p for m in result.all_messages() for p in getattr(m, "parts", []) if p.part_kind == "tool-call"]
    assert calls and calls[0].tool_name == "final_result"
    valid(calls[0].args, CITY_SCHEMA)


def test_openai_agents_sdk_runs_a_function_tool(server):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # tracing would post to OpenAI's servers
    seen: list[str] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=24)]) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"It is sunny in {city}, 21 degrees celsius."

    agent = Agent(
        name="weather",
        instructions="Answer briefly. Call get_weather for weather questions.",
        model=OpenAIChatCompletionsModel(model=server.model, openai_client=server.async_openai()),
        tools=[get_weather],
        # The turn must call the tool, and the tool's result is the run's answer: SmolLM2, never
        # trained on tools, calls again when given the result under auto (the hand-written loop
        # below covers an answer after a result, under tool_choice none).
        model_settings=ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS),
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert seen, "the function tool was never called"
    assert all(isinstance(c, str) for c in seen)
    assert result.final_output == f"It is sunny in {seen[0]}, 21 degrees celsius."


def test_openai_client_streams_tool_calls(server):
    client = server.openai()
    stream = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": QUESTION}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    calls: dict[int, dict] = {}
    fragments = 0
    finish, usage_last = None, False
    for chunk in stream:
        usage_last = chunk.usage is not None
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call: id, type and name
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and (d.function.name is None)
                if d.function.arguments:
                    calls[d.index]["arguments"] += d.function.arguments
                    fragments += 1
    assert usage_last, "usage must come in the last chunk"
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    valid(calls[0]["arguments"], WEATHER_SCHEMA)
    assert fragments >= 1


def test_hand_written_two_turn_loop(server):
    client = server.openai()
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(
        model=server.model, messages=messages, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=MAX_TOKENS
    )
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    args = valid(msg.tool_calls[0].function.arguments, WEATHER_SCHEMA)
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": f"Sunny, 21 degrees {args['unit']} in {args['city']}."}
        )
    second = client.chat.completions.create(
        model=server.model, messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=MAX_TOKENS
    )
    answer = second.choices[0]
    assert answer.message.tool_calls in (None, [])
    assert answer.message.content and answer.finish_reason in ("stop", "length")
    # The call and its result were read: tool_choice none leaves the tools out of the prompt, so
    # the second turn's prompt is the question's alone plus the call and the result.
    alone = client.chat.completions.create(
        model=server.model, messages=messages[:1], tools=[WEATHER_TOOL], tool_choice="none", max_tokens=1
    )
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 20
