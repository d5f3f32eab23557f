"""Several API keys, one per client: each key is let in, and each key's jobs are its own
(another key gets 404 for them on every job route and 409 for reusing their id). Against a
real Redis; the worker is only its heartbeat payload, so the job stays queued."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from test_jobs_support import RedisServer, wait_for

from server.app import create_app
from server.backends import JobsBackend
from server.common import ServeConfig
from workers import fleet_metrics
from workers.settings import JobSettings
from workers.store import JobStore


@pytest.fixture()
def client(tmp_path):
    redis = RedisServer(tmp_path).start()
    store = JobStore(JobSettings(redis_url=redis.url))
    payload = {"kind": "runtime", "serves": ["llm"], "models": [{"name": "smol", "max_model_len": 512}]}
    fleet_metrics.publish(store.redis, "w1", {**payload, "metrics": {}}, ttl_s=600)
    backend = JobsBackend(JobSettings(redis_url=redis.url))
    try:
        with TestClient(create_app(backend, ServeConfig(api_key="key-a, key-b"))) as c:
            wait_for(lambda: c.get("/health").status_code == 200, 10, "the fake worker to count as live")
            yield c
    finally:
        store.close()
        redis.stop()


def _as(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_each_key_gets_in_and_anything_else_is_401(client):
    for key in ("key-a", "key-b"):
        assert client.get("/v1/models", headers=_as(key)).status_code == 200
    for headers in ({}, _as("key-c"), _as("key-a, key-b"), _as("key-a,key-b"), {"Authorization": "Basic key-a"}):
        resp = client.get("/v1/models", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == 401


def test_one_keys_job_is_no_job_to_another_key(client):
    job = {"prompt": "hello", "max_tokens": 4, "job_id": "job-of-a"}
    resp = client.post("/v1/jobs", json=job, headers=_as("key-a"))
    assert resp.status_code == 202, resp.text
    assert client.get("/v1/jobs/job-of-a", headers=_as("key-a")).status_code == 200
    # key b: not its job, on every route; and the id is not its to take
    assert client.get("/v1/jobs/job-of-a", headers=_as("key-b")).status_code == 404
    assert client.get("/v1/jobs/job-of-a/events", headers=_as("key-b")).status_code == 404
    assert client.delete("/v1/jobs/job-of-a", headers=_as("key-b")).status_code == 404
    assert client.post("/v1/jobs", json=job, headers=_as("key-b")).status_code == 409
    # key a's job is untouched by all that: still there, still queued, and a's to cancel
    status = client.get("/v1/jobs/job-of-a", headers=_as("key-a")).json()
    assert status["state"] == "queued", status
    assert client.delete("/v1/jobs/job-of-a", headers=_as("key-a")).status_code in (200, 202)


def test_the_cli_refuses_an_empty_key_between_commas(monkeypatch):
    import argparse

    from tandem.serve_cli import api_key

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert api_key(argparse.Namespace(api_key="a,b")) == "a,b"
    with pytest.raises(ValueError, match="--api-key"):
        api_key(argparse.Namespace(api_key="a,,b"))
