"""Tool jobs (issue 28, item 4): /v1/jobs and JobClient take chat messages with tools, a worker
writes the calls as tool_call / tool_args events and its result carries them; and the worker's
ToolStream (workers/tool_stream.py), which a resumed attempt picks up from the events already
written, sends each call once, with its first id, whatever the text's deltas were.
"""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

from runtime.llm.tools import parse_tools, tool_format_for
from workers.events import JobEvent

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = WEATHER["function"]["parameters"]
ASK = [{"role": "user", "content": "Weather in Rome for three days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _sse(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


@pytest.fixture(scope="module")
def fleet(shared_fleet):
    return shared_fleet.ready()


def test_the_job_api_runs_a_tool_job_whose_events_and_result_carry_the_call(fleet):
    url = fleet.server.url
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": NAMED, "parallel_tool_calls": False, "max_tokens": 60}
    job_id = httpx.post(url + "/v1/jobs", json={**body, "job_id": f"tools-{uuid.uuid4().hex[:8]}"}, timeout=10).json()[
        "job_id"
    ]
    with httpx.stream("GET", f"{url}/v1/jobs/{job_id}/events", timeout=60) as r:
        events = _sse(r.iter_lines())
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "done" and events[-1]["finish_reason"] == "tool_calls", events[-1]
    [start] = [e for e in events if e["type"] == "tool_call"]
    assert start["name"] == "get_weather" and start["call_index"] == 0 and "text" not in start
    arguments = "".join(e["arguments"] for e in events if e["type"] == "tool_args")
    jsonschema.validate(json.loads(arguments), SCHEMA)
    assert "".join(e.get("text", "") for e in events) == ""  # no content: the grammar allowed only the call
    status = httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).json()
    result = status["result"]
    assert result["finish_reason"] == "tool_calls" and result["content"] is None and result["text"] == ""
    assert result["tool_calls"] == [
        {"id": start["call_id"], "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    ]


def test_the_job_client_submits_tools_and_streams_the_calls(fleet):
    from workers.client import JobClient

    jobs = JobClient(settings=fleet.settings)
    try:
        job_id = jobs.submit(
            messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=60, seed=2
        )
        result = jobs.result(job_id, timeout=60)
        events = [JobEvent.from_dict(e) for e in jobs.stream(job_id, timeout=10)]
    finally:
        jobs.close()
    [call] = result["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    assert [(e.call_index, e.call_id, e.name) for e in events if e.type == "tool_call"] == [
        (0, call["id"], "get_weather")
    ]
    assert all(e.attempt == 1 for e in events if e.type in ("tool_call", "tool_args"))


@pytest.mark.parametrize(
    ("param", "body"),
    [
        ("tools", {"prompt": "Hi", "tools": [WEATHER]}),  # tools need messages
        ("tools[0].function.name", {"messages": ASK, "tools": [{"type": "function", "function": {"name": ""}}]}),
        ("tool_choice", {"messages": ASK, "tools": [WEATHER], "tool_choice": 3}),
        ("tool_call_parser", {"messages": ASK, "tools": [WEATHER], "tool_call_parser": 7}),
        ("structured_outputs", {"messages": ASK, "tools": [WEATHER], "structured_outputs": {"json_object": True}}),
        ("messages[1].tool_calls[0].id", {"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": ""}]}]}),
    ],
)
def test_bad_tool_jobs_are_400_naming_the_field(fleet, param, body):
    r = httpx.post(fleet.server.url + "/v1/jobs", json={**body, "max_tokens": 4}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- a resumed attempt's stream (no fleet) ------------------------------------------------------------


class _Tokenizer:
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # renders no tools: generic


def _text(calls: list[tuple[str, dict]], before: str = "Sure. ") -> str:
    fmt = tool_format_for(_Tokenizer())
    return before + "\n".join(fmt.syntax.call_text(name, json.dumps(args)) for name, args in calls)


def _run(stream, pieces: list[str]) -> tuple[str, list[JobEvent]]:
    content, events = "", []
    for piece in pieces:
        text, new = stream.feed(piece)
        content, events = content + text, events + new
    return content, events


def _calls(events: list[JobEvent]) -> list[tuple[str, str, str]]:
    calls: dict[int, list] = {}
    for e in events:
        if e.type == "tool_call":
            calls[e.call_index] = [e.call_id, e.name, ""]
        elif e.type == "tool_args":
            calls[e.call_index][2] += e.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("cut", [3, 9, 17, 30, 48])
def test_a_resumed_stream_sends_what_the_first_attempt_did_not_once_with_its_ids(cut):
    from workers.tool_stream import ToolStream

    request = parse_tools([WEATHER], "required", True)
    fmt = tool_format_for(_Tokenizer())
    text = _text([("get_weather", {"city": "Rome", "days": 3}), ("get_weather", {"city": "Paris", "days": 1})])
    chars = [text[i : i + 2] for i in range(0, len(text), 2)]  # the first attempt's deltas, two characters each
    first = ToolStream(fmt, request)
    content_a, events_a = _run(first, chars[:cut])
    token_events = [JobEvent("token", content_a, [1])]  # what it wrote of the content
    # The worker dies. The next attempt reads the stream, replays the tokens' text at once, goes on in
    # other pieces (three characters), and finishes.
    second = ToolStream(fmt, request, token_events + events_a)
    replayed = "".join(chars[:cut])
    content_b, events_b = _run(second, [replayed])
    rest = "".join(chars[cut:])
    content_c, events_c = _run(second, [rest[i : i + 3] for i in range(0, len(rest), 3)])
    tail, events_d, message, reason = second.finish("stop")
    events = events_a + events_b + events_c + events_d
    assert content_a + content_b + content_c + tail == "Sure."
    ids = [e.call_id for e in events if e.type == "tool_call"]
    assert len(ids) == len(set(ids)) == 2  # each call opened once
    whole = [(name, args) for _, name, args in _calls(events)]
    assert [(n, json.loads(a)) for n, a in whole] == [
        ("get_weather", {"city": "Rome", "days": 3}),
        ("get_weather", {"city": "Paris", "days": 1}),
    ]
    assert [c.id for c in message.tool_calls] == ids and reason == "tool_calls"  # the ids that were sent
    assert second.num_events == len(events)  # the next seq


# ---- a tool job resumed on another worker: generate_body over real Redis, a fake Runtime ---------------


class _Died(Exception):
    """The first worker's end, mid-stream."""


class _Out(SimpleNamespace):
    def __init__(self, ids, delta, text, reason=None) -> None:
        super().__init__(
            token_ids=ids,
            delta_text=delta,
            text=text,
            prompt_token_ids=[9, 9],
            finish_reason=reason,
            error=None,
            error_code=None,
            logprobs=None,
            delta_logprobs=None,
            stop_reason=None,
            metrics=SimpleNamespace(e2e_latency=None, decode_tokens_per_s=None),
        )


class _Runtime:
    """Token i (1-based) is pieces[i - 1]; an attempt streams `ids` (then dies, if told to)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.llm = SimpleNamespace(eos_token_ids={0})
        self.tokenizer = _Tokenizer()
        self.tokenizer.decode = lambda ids, skip_special_tokens=True: "".join(pieces[i - 1] for i in ids)
        self.tokenizer.apply_chat_template = lambda conv, **kw: "".join(m["content"] for m in conv)
        self.max_model_len = 4096
        self.plan: tuple[list[int], bool] = ([], False)
        self.structured = None

    def submit_generate(self, prompt, params, priority=0, deadline_s=None, request_id=None, num_resumed_outputs=0):
        ids, dies = self.plan
        self.structured = params.structured_outputs

        def outputs():
            for k in range(1, len(ids) + 1):
                text = "".join(self.pieces[i - 1] for i in ids[:k])
                yield _Out(ids[:k], self.pieces[ids[k - 1] - 1], text, None if k < len(ids) or dies else "stop")
            if dies:
                raise _Died()

        return _Handle(outputs())


class _Handle:
    def __init__(self, outputs) -> None:
        self.outputs = outputs

    def __iter__(self):
        return self.outputs

    def cancel(self) -> None:
        pass


@pytest.mark.parametrize("cut", [12, 30, 50])
def test_a_tool_job_resumed_on_another_worker_sends_each_call_once_with_its_first_id(tmp_path, cut):
    from test_jobs_support import JobHost, RedisServer

    from workers.host import ActiveJob
    from workers.jobs import generate_body, run_job
    from workers.settings import JobSettings
    from workers.store import JobStore

    text = _text([("get_weather", {"city": "Rome", "days": 3}), ("get_weather", {"city": "Paris", "days": 1})])
    pieces = [text[i : i + 2] for i in range(0, len(text), 2)]
    kwargs = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 200}
    server = RedisServer(tmp_path).start()
    store = JobStore(JobSettings(redis_url=server.url))
    try:
        first, second = JobHost(store, "w1", _Runtime(pieces)), JobHost(store, "w2", _Runtime(pieces))
        store.submit("tj", "tandem.generate", "llm", kwargs, ttl_s=60, max_tokens=200)
        store.heartbeat("w1")
        claim = store.claim(
            "tj", "w1", "t1", "tandem.generate", "llm", kwargs, ttl_s=60, max_tokens=200, submitted_at=0
        )
        job = ActiveJob("tj", "t1", claim)
        job.queue = "llm"
        first.runtime.plan = (list(range(1, cut + 1)), True)
        with pytest.raises(_Died):
            generate_body(first, job, kwargs)
        first.writer.close()  # what it queued is written; then it is gone
        store.release("w1")
        second.runtime.plan = (list(range(cut + 1, len(pieces) + 1)), False)
        store.heartbeat("w2")
        result = run_job(second, "tandem.generate", "tj", "llm", kwargs, generate_body)
        events = store.events("tj")
        record = store.record("tj")
    finally:
        second.writer.close()
        store.close()
        server.stop()
    assert second.runtime.structured is not None  # the tool grammar held the resumed attempt too
    assert [e.type for e in events].count("restarted") == 1
    opened = [e for e in events if e.type == "tool_call"]
    assert [e.call_index for e in opened] == [0, 1]
    calls = _calls(events)
    assert [(name, json.loads(args)) for _, name, args in calls] == [
        ("get_weather", {"city": "Rome", "days": 3}),
        ("get_weather", {"city": "Paris", "days": 1}),
    ]
    assert [c["id"] for c in result["tool_calls"]] == [e.call_id for e in opened]
    assert [c["function"]["arguments"] for c in result["tool_calls"]] == [args for _, _, args in calls]
    assert result["finish_reason"] == "tool_calls" and result["content"] == "Sure."
    assert "".join(e.text for e in events) == "Sure."
    assert int(record["num_appended"]) == sum(e.type in ("tool_call", "tool_args") for e in events)
    assert {e.attempt for e in events if e.type == "tool_args"} <= {1, 2}
