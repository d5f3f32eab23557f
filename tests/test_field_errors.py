"""Errors carry their field as data (issue 28, item 4): a FieldError's `field` and `code` become
the answer's `param` and status, through every path, and the server reads no message text to
find them. Each test gives a message that does not start with the field (or names another
word first), so that a guess from the text would answer differently.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest
from fastapi.testclient import TestClient
from test_jobs_support import JobHost, RedisServer

from runtime.errors import FieldError
from runtime.handles import DeadlineExceededError
from server import protocol
from server.app import create_app
from server.backends import JobsBackend, job_error
from workers.events import JobEvent

ARGS = "messages[2].tool_calls[0].function.arguments"


def test_a_field_error_keeps_its_data_through_pickle_and_json_and_under_a_prefix():
    exc = FieldError(ARGS, f"{ARGS} must be a JSON object, got '[1'", "invalid")
    back = pickle.loads(pickle.dumps(exc))  # across threads and processes
    assert (back.field, back.code, str(back)) == (exc.field, exc.code, str(exc))
    assert FieldError.from_dict(exc.to_dict()).to_dict() == exc.to_dict()
    inner = FieldError("function.name", "function.name must be 1 to 64 of ...").under("tools[1]")
    assert (inner.field, str(inner)) == ("tools[1].function.name", "tools[1].function.name must be 1 to 64 of ...")
    assert isinstance(exc, ValueError)
    with pytest.raises(TypeError):
        FieldError(ARGS, "x", "no-such-code")


def test_the_http_error_of_a_field_error_is_its_data_not_its_words():
    err = protocol.field_error(FieldError(ARGS, "arguments of call 0 are not JSON"))
    assert (err.status, err.param) == (400, ARGS)
    # A plain ValueError (runtime/llm's checks) falls back to its first word, documented as such.
    plain = protocol.field_error(ValueError("stop strings must be at most 100 characters"))
    assert (plain.status, plain.param) == (400, "stop")
    renamed = protocol.field_error(FieldError("structured_outputs.json", "bad schema"), {"structured_outputs": "x"})
    assert renamed.param == "x" and renamed.message.startswith("x: ")


def test_a_failed_events_field_and_finish_reason_give_param_and_status():
    by_field = job_error(JobEvent("failed", error="deadline_s is fine; prompt is not", field="prompt", code="invalid"))
    assert (by_field.status, by_field.param) == (400, "prompt")  # not 504: "deadline" in the words is no deadline
    deadline = job_error(JobEvent("failed", error="request waited 12 ms", finish_reason="deadline_exceeded"))
    assert deadline.status == 504
    words = job_error(JobEvent("failed", error="the deadline passed, says a bug", finish_reason="abort"))
    assert words.status == 500  # once "deadline" in the message made it 504


class _Backend:
    """A backend whose generation refuses with the given error, as the embedded one's Runtime does."""

    mode = "embedded"

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def workers(self) -> list[dict]:
        return [{"kind": "runtime", "serves": ["llm"], "models": [{"name": "m", "max_model_len": 64}]}]

    async def generate(self, gen, deadline_s, owner=None):
        raise self.exc

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("exc", "param"),
    [
        (FieldError(ARGS, "the arguments are not a JSON object"), ARGS),
        (FieldError("messages", "prompt has 99 tokens; max_model_len is 64", "too_long"), "messages"),
        (ValueError("max_tokens must be at most 64"), "max_tokens"),  # the documented fallback
    ],
)
def test_the_app_answers_a_refusal_with_the_errors_field(exc, param):
    with TestClient(create_app(_Backend(exc))) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- over Redis: the worker's run_job writes the data, the server and the client read it ----------


@pytest.fixture()
def host(tmp_path):
    from workers.settings import JobSettings
    from workers.store import JobStore

    server = RedisServer(tmp_path).start()
    store = JobStore(JobSettings(redis_url=server.url))
    h = JobHost(store)
    store.heartbeat(h.worker_id)
    yield h
    h.writer.close()
    store.close()
    server.stop()


def _run(host, job_id: str, raised: Exception) -> None:
    from workers.jobs import run_job

    def body(_host, _job, _kwargs):
        raise raised

    host.store.submit(job_id, "tandem.generate", "llm", {"prompt": "hi"}, ttl_s=60, max_tokens=4)
    with pytest.raises(ValueError if isinstance(raised, ValueError) else RuntimeError):
        run_job(host, "tandem.generate", job_id, "llm", {"prompt": "hi"}, body)


def _server_error(settings, job_id: str):
    async def read():
        from server.backends import JobStream

        backend = JobsBackend(settings)
        try:
            events = [e async for e in JobStream(backend, job_id).events()]
        finally:
            await backend.close()
        return events[-1]

    final = asyncio.run(read())
    assert final.type == "failed"
    return final, job_error(final)


def test_a_workers_field_error_reaches_the_server_and_the_client_as_data(host):
    from workers.client import JobClient, JobError

    _run(host, "fe-1", FieldError(ARGS, "the arguments of call 0 are not a JSON object", "invalid"))
    final, err = _server_error(host.settings, "fe-1")
    assert (final.field, final.code, final.finish_reason) == (ARGS, "invalid", "invalid_request")
    assert (err.status, err.param) == (400, ARGS)
    client = JobClient(settings=host.settings)
    try:
        with pytest.raises(JobError) as info:
            client.result("fe-1", timeout=10)
    finally:
        client.close()
    assert (info.value.field, info.value.code) == (ARGS, "invalid")


def test_a_workers_plain_value_error_and_deadline_are_told_apart_by_finish_reason(host):
    _run(host, "fe-2", ValueError("prompt has 900 tokens; max_model_len is 64"))
    final, err = _server_error(host.settings, "fe-2")
    assert final.field is None and (err.status, err.param) == (400, "prompt")  # the fallback
    _run(host, "fe-3", DeadlineExceededError("request 'x' waited 40 ms in the queue, and was not started"))
    final, err = _server_error(host.settings, "fe-3")
    assert final.finish_reason == "deadline_exceeded" and err.status == 504
    _run(host, "fe-4", RuntimeError("the deadline of a bug"))
    final, err = _server_error(host.settings, "fe-4")
    assert final.finish_reason == "abort" and err.status == 500


@pytest.mark.parametrize(
    "kwargs, field, code",
    [
        ({"top_p": 2}, "top_p", "out_of_range"),
        ({"temperature": -1}, "temperature", "out_of_range"),
        ({"logprobs": 21}, "logprobs", "out_of_range"),
        ({"max_tokens": 0}, "max_tokens", "invalid"),
        ({"presence_penalty": 3}, "presence_penalty", "out_of_range"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "invalid"),
    ],
)
def test_sampling_params_raise_field_errors_with_the_field_as_data(kwargs, field, code):
    """The engine's own checks carry the field as data, so nothing above reads their words."""
    from runtime.llm.sampling_params import SamplingParams

    with pytest.raises(FieldError) as err:
        SamplingParams(**kwargs)
    assert (err.value.field, err.value.code) == (field, code)


def test_tool_and_response_format_checks_raise_field_errors():
    from runtime.llm.structured import structured_outputs_from_response_format
    from runtime.llm.tools import parse_tools

    with pytest.raises(FieldError) as err:
        parse_tools([{"type": "function", "function": {"name": "bad name!"}}])
    assert err.value.field == "tools[0].function.name"
    with pytest.raises(FieldError) as err:
        structured_outputs_from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    assert err.value.field == "response_format.json_schema.schema"
