"""`tandem serve` where it went wrong before, each pinned by a test: a stream whose job's events
can no longer be read ends at once with an error naming the job; the OpenAI endpoints' jobs
belong to the caller's key; /health?model= takes the served name; n choices' usage is their one
job's (the prompt once). Fake backends for the HTTP layer; a real Redis for ownership."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from test_jobs_support import RedisServer, wait_for

from server import responses
from server.app import create_app
from server.backends import JobsBackend
from server.common import ServeConfig
from server.protocol import APIError
from workers import fleet_metrics
from workers.events import JobEvent
from workers.settings import JobSettings
from workers.store import PREFIX, JobStore


class _Stream:
    """One job: `events` given as a list; an exception in the list is raised there."""

    def __init__(self, job_id: str, events: list, use: dict) -> None:
        self.id, self._events, self._use = job_id, events, use
        self.cancelled = False

    async def events(self):
        for e in self._events:
            if isinstance(e, BaseException):
                raise e
            yield e

    async def usage(self) -> dict:
        return self._use

    async def cancel(self) -> None:
        self.cancelled = True


class _Backend:
    """A backend whose i-th job runs script(i): what the completions route does with it."""

    mode = "jobs"

    def __init__(self, script, workers: list[dict] | None = None) -> None:
        self.script = script
        self.streams: list[_Stream] = []
        self.owners: list[str | None] = []
        self._workers = workers or [
            {"kind": "runtime", "serves": ["llm"], "models": [{"name": "smol", "max_model_len": 512}]}
        ]

    async def workers(self) -> list[dict]:
        return self._workers

    async def health(self) -> dict:
        from server.backends import fleet_health

        return fleet_health(self._workers)

    async def generate(self, gen, deadline_s, owner=None):
        i = len(self.streams)
        events, use = self.script(i)
        self.streams.append(_Stream(f"job-{i}", events, use))
        self.owners.append(owner)
        return self.streams[-1]

    async def close(self) -> None:
        pass


def _token(text: str) -> JobEvent:
    return JobEvent("token", text, [1])


def _done(text: str = "") -> JobEvent:
    return JobEvent("done", text, finish_reason="length")


def _data(body: str) -> list:
    return [line[6:] for line in body.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("exc", [APIError(404, "job job-0 does not exist (or expired)", "job_id"), OSError("ro")])
def test_a_job_whose_events_fail_mid_stream_ends_the_stream_at_once_naming_it(exc):
    """n=2, streamed (one job): its events raise after each choice's first token (its key gone
    after a Redis restart without AOF, a ReadOnlyError after a failover). The stream ends at once
    with an error naming job-0 and [DONE], not keep-alives until the request's timeout."""

    def script(i):
        return [_token("a"), JobEvent("token", "x", [1], choice=1), exc], {}

    backend = _Backend(script)
    config = ServeConfig(request_timeout_s=5, keepalive_s=0.2)
    with TestClient(create_app(backend, config)) as client:
        start = time.monotonic()
        body = {"prompt": "hi", "max_tokens": 4, "n": 2, "stream": True}
        resp = client.post("/v1/completions", json=body)
        took = time.monotonic() - start
    assert resp.status_code == 200, resp.text
    data = _data(resp.text)
    assert data[-1] == "[DONE]", data
    assert [json.loads(d)["choices"][0]["index"] for d in data[:2]] == [0, 1]
    err = json.loads(data[-2])["error"]
    assert "job-0" in err["message"] and "504" not in str(err["code"]), err
    assert took < 3, took  # at once, not at the 5 s request timeout
    assert len(backend.streams) == 1 and backend.streams[0].cancelled


def test_n_choices_usage_is_the_jobs_own_prompt_once_every_choice_counted():
    use = responses.usage(3, 6)  # what the worker's result says: 3 prompt tokens, two choices of 3

    def script(i):
        events = [_token("a"), JobEvent("token", "x", [1], choice=1)]
        ends = [JobEvent("choice_end", "", choice=k, finish_reason="length") for k in (0, 1)]
        return [*events, *ends, _done()], use

    backend = _Backend(script)
    with TestClient(create_app(backend)) as client:
        resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "n": 2})
    assert resp.status_code == 200 and resp.json()["usage"] == use, resp.text
    assert [c["text"] for c in resp.json()["choices"]] == ["a", "x"] and len(backend.streams) == 1


def test_health_takes_the_served_model_name():
    backend = _Backend(lambda i: ([], {}))
    with TestClient(create_app(backend, ServeConfig(served_model_name="alias"))) as client:
        resp = client.get("/health", params={"model": "alias"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["models"] == {"alias": 1}  # the names clients use, as /v1/models lists them
        assert client.get("/health", params={"model": "smol"}).status_code == 503  # the workers' name is hidden
        assert client.get("/health").status_code == 200
    with TestClient(create_app(backend)) as client:  # without a rename: the workers' names
        assert client.get("/health", params={"model": "smol"}).status_code == 200
        assert client.get("/health", params={"model": "alias"}).status_code == 503


def test_health_with_a_rename_over_several_models_is_503_saying_why():
    workers = [
        {"kind": "runtime", "serves": ["llm"], "models": [{"name": n, "max_model_len": 512}]} for n in ("a", "b")
    ]
    backend = _Backend(lambda i: ([], {}), workers)
    with TestClient(create_app(backend, ServeConfig(served_model_name="alias"))) as client:
        resp = client.get("/health", params={"model": "alias"})
        assert resp.status_code == 503 and "--served-model-name" in resp.json()["error"], resp.text


# ---- ownership of the OpenAI endpoints' jobs, over a real Redis ---------------------------------


@pytest.fixture()
def keyed(tmp_path):
    redis = RedisServer(tmp_path).start()
    store = JobStore(JobSettings(redis_url=redis.url))
    payload = {"kind": "runtime", "serves": ["llm"], "models": [{"name": "smol", "max_model_len": 512}]}
    fleet_metrics.publish(store.redis, "w1", {**payload, "metrics": {}}, ttl_s=600)  # a worker that takes no job
    backend = JobsBackend(JobSettings(redis_url=redis.url))
    config = ServeConfig(api_key="key-a, key-b", keepalive_s=0.2)
    try:
        with TestClient(create_app(backend, config)) as c:
            wait_for(lambda: c.get("/health").status_code == 200, 10, "the fake worker to count as live")
            yield c, store
    finally:
        store.close()
        redis.stop()


def _as(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _job_ids(store: JobStore) -> set[str]:
    prefix = f"{PREFIX}job:"
    return {k[len(prefix) :] for k in store.redis.scan_iter(prefix + "*") if k.count(":") == 2}


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_a_streamed_chats_job_is_no_job_to_another_key(keyed, path, body):
    client, store = keyed
    before = _job_ids(store)
    # Nobody runs it: the stream waits, then ends at its request_timeout, which cancels the job.
    resp = client.post(path, json={**body, "stream": True, "request_timeout": 1}, headers=_as("key-a"))
    assert resp.status_code == 200 and "[DONE]" in resp.text, resp.text
    (job_id,) = _job_ids(store) - before
    assert client.get(f"/v1/jobs/{job_id}", headers=_as("key-a")).status_code == 200
    assert client.get(f"/v1/jobs/{job_id}", headers=_as("key-b")).status_code == 404
    assert client.get(f"/v1/jobs/{job_id}/events", headers=_as("key-b")).status_code == 404
    assert client.delete(f"/v1/jobs/{job_id}", headers=_as("key-b")).status_code == 404
