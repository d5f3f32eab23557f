"""workers/events.py's JobEvent: the one definition of a job's stream entries (issue 28, item 4).

Every kind goes to Redis fields and back, and to a client's JSON and back, unchanged. The entries
the Lua scripts write read as the same events through the job client (JobClient.stream, what the
store's callers see) and through `tandem serve` (JobsBackend.read_events): once they disagreed on
when `text` is there. The module imports no redis, celery or torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys

import pytest
from test_jobs_support import REPO, RedisServer

from workers.events import FINAL, KINDS, TOOL_KINDS, JobEvent

LOGPROBS = [{"token_id": 5, "token": "a", "bytes": [97], "logprob": -0.5, "top": []}]
SAMPLES = [
    JobEvent("token", "a", [5], LOGPROBS, index=0, attempt=1),
    JobEvent("token", "", [6, 7], index=1, attempt=2),  # held back by a tool parser: no content yet
    JobEvent("token", "b", [8], index=0, attempt=1, choice=2),  # n > 1: choice 2's first token
    JobEvent("prompt", token_ids=[1, 5], logprobs=[{**LOGPROBS[0], "token_id": 1, "logprob": None}, LOGPROBS[0]]),
    JobEvent("choice_end", "!", choice=1, finish_reason="stop", stop_reason="\n", num_tokens=4, attempt=1),
    JobEvent("restarted", attempt=2, resumed_from=3, worker="w@h"),
    JobEvent("tool_call", call_index=0, call_id="call_0a1b", name="get_weather", attempt=1),
    JobEvent("tool_args", call_index=0, arguments='{"city": "Par', attempt=1),
    JobEvent("tool_args", call_index=1, arguments=""),
    JobEvent("done", "tail", finish_reason="stop", num_tokens=3, stop_reason="\n"),
    JobEvent("done", finish_reason="tool_calls", num_tokens=9, stop_reason=2),
    JobEvent(
        "failed", finish_reason="invalid_request", error="max_tokens must be ...", field="max_tokens", code="invalid"
    ),
    JobEvent("failed", finish_reason="abort", error="lost", job_id="j1"),
    JobEvent("cancelled", finish_reason="abort", num_tokens=0),
]


def test_the_samples_cover_every_kind():
    assert {e.type for e in SAMPLES} == set(KINDS)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.type)
def test_every_kind_round_trips_through_redis_fields_and_client_json(event):
    fields = event.to_fields()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())  # what XADD takes
    back = JobEvent.from_fields(fields, "1-0")
    assert back == dataclasses.replace(event, id="1-0")
    assert back.to_fields() == fields
    assert JobEvent.from_dict(back.to_dict()) == back


def test_an_empty_string_in_an_entry_is_no_value():
    """The scripts write error "" and stop_reason "" on a final entry that has none."""
    fields = {"type": "done", "token_ids": "[]", "text": "", "finish_reason": "length", "error": "", "stop_reason": ""}
    assert JobEvent.from_fields(fields) == JobEvent("done", finish_reason="length")


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: e.type)
def test_text_is_on_every_kind_but_the_tool_kinds_and_arguments_never_mix_with_it(event):
    data = event.to_dict()
    assert ("text" in data) == (event.type not in TOOL_KINDS)
    assert ("arguments" in data) == (event.type == "tool_args")
    assert ("text" in event.to_fields()) == (event.type not in TOOL_KINDS)
    assert event.final == (event.type in FINAL)


def test_joining_text_gives_the_content_and_never_a_calls_arguments():
    content = "".join(e.text for e in SAMPLES if e.choice is None)
    assert content == "atail"
    assert "".join(e.text for e in SAMPLES if e.choice is not None) == "b!"  # choices' texts: their own
    args = "".join(e.arguments for e in SAMPLES if e.type == "tool_args" and e.call_index == 0)
    assert args == '{"city": "Par'


def test_the_events_module_imports_no_redis_celery_or_torch():
    code = (
        "import sys, workers.events, runtime.errors\n"
        "heavy = [m for m in ('redis', 'celery', 'torch', 'kombu') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


@pytest.fixture()
def store(tmp_path):
    from workers.settings import JobSettings
    from workers.store import JobStore

    server = RedisServer(tmp_path).start()
    s = JobStore(JobSettings(redis_url=server.url))
    yield s
    s.close()
    server.stop()


def _claim(store, job_id: str, token: str):
    store.heartbeat("w")
    claim = store.claim(
        job_id, "w", token, "tandem.generate", "llm", {"prompt": "hi"}, ttl_s=60, max_tokens=16, submitted_at=0.0
    )
    assert claim.outcome == "claimed"
    return claim


def _server_events(settings, job_id: str) -> list[JobEvent]:
    from server.backends import JobsBackend

    async def read() -> list[JobEvent]:
        backend = JobsBackend(settings)
        try:
            return [e async for _, e in backend.read_events(job_id)]
        finally:
            await backend.close()

    return asyncio.run(read())


@pytest.mark.parametrize("end", ["done", "failed", "cancelled"])
def test_the_job_client_and_the_server_read_the_scripts_entries_alike(store, end):
    """Token, restarted and final entries as workers/lua.py writes them: the client's dicts are the
    server's JobEvents as JSON, text on each of them (the store once gave it only where token_ids
    were, the server always: they disagreed), index 0 kept (the server once dropped falsy ints)."""
    from workers.client import JobClient

    job_id = f"ev-{end}"
    store.submit(job_id, "tandem.generate", "llm", {"prompt": "hi"}, ttl_s=60, max_tokens=16)
    _claim(store, job_id, "t1")
    store.run_scripts([("emit", store.emit_args(job_id, "t1", 0, [5], "a", [1, 2], logprobs=LOGPROBS))])
    store.redis.delete("tandem:worker:w")  # the first worker died: the next claim restarts the job
    store.heartbeat("w2")
    claim = store.claim(
        job_id, "w2", "t2", "tandem.generate", "llm", {"prompt": "hi"}, ttl_s=60, max_tokens=16, submitted_at=0.0
    )
    assert claim.outcome == "claimed" and claim.attempt == 2
    store.run_scripts([("emit", store.emit_args(job_id, "t2", 1, [6], "b", None))])
    if end == "cancelled":
        store.cancel(job_id)
        store.release("w2")
        store.cancel(job_id)
    else:
        args = store.finish_args(job_id, "t2", end, {}, "boom" if end == "failed" else "", "stop", "", 7)
        store.run_scripts([("finish", args)])
    client = JobClient(settings=store.settings)
    try:
        seen_by_client = list(client.stream(job_id, timeout=10))
    finally:
        client.close()
    seen_by_server = _server_events(store.settings, job_id)
    assert seen_by_client == [e.to_dict() for e in seen_by_server]
    assert [e.type for e in seen_by_server] == ["token", "restarted", "token", end]
    assert all("text" in e for e in seen_by_client)
    assert seen_by_server[0].index == 0 and seen_by_server[0].logprobs == LOGPROBS
    assert seen_by_server[1].resumed_from == 1 and seen_by_server[1].worker == "w2"
    assert "".join(e.text for e in seen_by_server) == "ab"
    if end != "cancelled":
        assert seen_by_server[-1].stop_reason == 7
    if end == "failed":
        assert seen_by_server[-1].error == "boom"


class _Job:
    """What the EventWriter needs of a host.ActiveJob."""

    def __init__(self, job_id: str, token: str) -> None:
        self.job_id, self.token, self.fenced = job_id, token, False

    def on_fenced(self) -> None:
        self.fenced = True


def test_tool_events_go_between_the_tokens_once_each_and_only_from_the_claims_holder(store):
    """The writer's order is the stream's; a retried (or resumed) seq writes nothing twice; a
    worker that lost the claim writes nothing; the prefix a resumed attempt reads is the tokens'."""
    from workers.client import JobClient
    from workers.writer import EventWriter

    job_id = "ev-tools"
    store.submit(job_id, "tandem.generate", "llm", {"prompt": "hi"}, ttl_s=60, max_tokens=16)
    _claim(store, job_id, "t1")
    job = _Job(job_id, "t1")
    call = JobEvent("tool_call", call_index=0, call_id="call_1", name="f", attempt=1)
    args = [JobEvent("tool_args", call_index=0, arguments=a) for a in ('{"x": ', "1}")]
    writer = EventWriter(store)
    try:
        writer.emit(job, 0, [5], "Hi", [1])
        writer.emit(job, 1, [6], "", None)
        writer.append(job, 0, call)
        writer.append(job, 1, args[0])
        writer.emit(job, 2, [7], "", None)
        writer.append(job, 2, args[1])
        writer.append(job, 1, args[0])  # a resumed attempt's: already there
        assert writer.finish(job, "done", {}, "", "tool_calls").result(10)
    finally:
        writer.close()
    assert not job.fenced
    assert store.run_scripts([("append", store.append_args(job_id, "t0", 3, args[1]))]) == [0]  # not the claim's
    events = _server_events(store.settings, job_id)
    assert [e.type for e in events] == ["token", "tool_call", "tool_args", "token", "tool_args", "done"]
    assert events[1].call_id == "call_1" and events[1].name == "f" and events[1].attempt == 1
    assert "".join(e.arguments for e in events) == '{"x": 1}'
    assert "".join(e.text for e in events) == "Hi"
    client = JobClient(settings=store.settings)
    try:
        assert list(client.stream(job_id, timeout=10)) == [e.to_dict() for e in events]
    finally:
        client.close()
    assert store.prefix(job_id) == ([5, 6, 7], "Hi", None)
    with pytest.raises(ValueError, match="appended"):
        store.append_args(job_id, "t1", 4, JobEvent("token", "x", [1]))
