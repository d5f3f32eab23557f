"""Tool calling through `tandem serve` with the `openai` client (issue 28, items 1 and 4), on the
session's two servers: over Redis and a `tandem worker` (the calls travel as tool_call /
tool_args job events), and `tandem serve --embedded` (the same ToolStream, in process). Both run
the tiny random Llama with SmolLM2's tokenizer, whose template renders no tools: the generic
format. Its text is noise; under a named or required tool_choice the grammar makes each call
valid, and that is what is checked: every call's arguments validate against its tool's schema.

The tools' schemas are bounded (enums, small integers), so that a call closes well within
max_tokens whatever the random weights prefer.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from fleet_support import model_ids
from test_jobs_support import wait_for

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["days"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, FORECAST]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 80


class Server:
    def __init__(self, url: str) -> None:
        self.url = url
        self.model = wait_for(lambda: model_ids(url), 60, "a model in /v1/models")[0]
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def chat(self, **kw):
        kw.setdefault("messages", ASK)
        kw.setdefault("max_tokens", MAX_TOKENS)
        return self.client.chat.completions.create(model=self.model, **kw)


@pytest.fixture(scope="module", params=["worker", "embedded"])
def server(request, shared_fleet):
    if request.param == "worker":
        return Server(shared_fleet.ready().server.url)
    return Server(shared_fleet.embedded().url)


def _valid(call) -> dict:
    """The call's arguments, parsed and validated against its tool's schema."""
    assert call.type == "function" and call.id.startswith("call_"), call
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_a_named_tool_choice_calls_that_tool_with_valid_arguments(server):
    resp = server.chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "forecast"}}, seed=1)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None  # no text besides the call
    [call] = choice.message.tool_calls
    assert call.function.name == "forecast"
    _valid(call)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_offered_tools_with_valid_arguments(server, parallel):
    for seed in range(3):
        resp = server.chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, seed=seed, temperature=1)
        choice = resp.choices[0]
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1), calls
        assert len({c.id for c in calls}) == len(calls)
        if choice.finish_reason == "length":  # parallel: the grammar lets the noise call again and again
            assert parallel and len(calls) > 1, choice
            calls = calls[:-1]  # the one max_tokens cut
        else:
            assert choice.finish_reason == "tool_calls", choice
        for call in calls:
            _valid(call)


def test_auto_answers_text_without_a_tag_or_valid_calls(server):
    for seed in range(4):
        resp = server.chat(tools=TOOLS, tool_choice="auto", seed=seed, temperature=1)
        choice = resp.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                _valid(call)
        else:
            assert "<tool_call>" not in (choice.message.content or ""), choice


def test_none_offers_no_call(server):
    resp = server.chat(tools=TOOLS, tool_choice="none", seed=2, max_tokens=12)
    choice = resp.choices[0]
    assert not choice.message.tool_calls and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


def test_streamed_calls_reassemble_to_the_unstreamed_ones_with_usage_last(server):
    """Same seed, same tokens: the fragments joined are the unstreamed call's arguments; a call's
    first delta has its index, id, type and name, the next ones only arguments; usage comes last."""
    kw = {"tools": TOOLS, "tool_choice": "required", "seed": 7, "temperature": 1}
    whole = server.chat(**kw).choices[0].message.tool_calls
    chunks = list(server.chat(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        [c] = chunk.choices
        reasons.append(c.finish_reason)
        for d in c.delta.tool_calls or ():
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments
    assert reasons[-1] == "tool_calls" and [r for r in reasons if r] == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_a_two_turn_loop_call_result_answer(server):
    first = server.chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, seed=3)
    message = first.choices[0].message
    [call] = message.tool_calls
    args = _valid(call)
    turn = [
        *ASK,
        message.model_dump(exclude_none=True),  # as agents send it back: content null dropped
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21, **args})},
    ]
    answer = server.chat(messages=turn, tools=TOOLS, tool_choice="none", seed=3, max_tokens=8)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    again = server.chat(messages=turn, tools=TOOLS, tool_choice="required", seed=4)
    for c in again.choices[0].message.tool_calls:
        _valid(c)


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}


@pytest.mark.parametrize(
    ("param", "change"),
    [
        ("tools[0].function.name", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}),
        ("tools[1].type", {"tools": [WEATHER, {"type": "retrieval"}]}),
        ("tools", {"tools": {"type": "function"}}),
        ("tool_choice", {"tools": TOOLS, "tool_choice": "sometimes"}),
        ("tool_choice.function.name", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}),
        ("tool_choice", {"tool_choice": "required"}),  # no tools to call
        ("parallel_tool_calls", {"tools": TOOLS, "parallel_tool_calls": "yes"}),
        ("response_format", {"tools": TOOLS, "response_format": {"type": "json_object"}}),
        (
            "messages[1].tool_calls[0].function.arguments",
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]},
                ]
            },
        ),
        ("messages[1].content", {"messages": [*ASK, {"role": "assistant", "content": None}]}),
        ("messages[0].tool_calls", {"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]}),
        (
            "messages[2].tool_call_id",
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_2", "content": "21"},
                ]
            },
        ),
        ("messages[1].tool_call_id", {"messages": [*ASK, {"role": "tool", "content": "21"}]}),
    ],
)
def test_bad_tool_shapes_are_400_naming_the_field(server, param, change):
    body = {"model": server.model, "messages": ASK, "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as info:
        server.client.chat.completions.create(**body)
    assert info.value.body["param"] == param, info.value.body
