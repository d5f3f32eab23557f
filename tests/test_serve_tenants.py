"""Admission per tenant against a real `tandem serve --embedded --tenants FILE` (server/admission.py):
past each limit (requests and tokens per minute, concurrent and queued requests) a tenant's
request gets 429 in OpenAI's error shape with an integer Retry-After, while another tenant's
request is let in. SmolLM2 with one slot: its 900-token stream holds the slot for far longer
than the test takes, so the requests after it stay queued (no event yet) until the test closes
them all. A bad tenants file stops the server before it loads anything, naming the tenant and
the field. The job API, against a real Redis with no worker (its jobs stay queued): the key's
tenant and the tier ride on the queued job, a batch job waits on the broker's last list, the
per-minute limits answer 429, and another tenant cannot be named. This module shares no
session fleet: its server has a tenants file of its own."""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient
from fleet_support import ServeProcess
from test_jobs_support import REPO, RedisServer, wait_for

from server.app import create_app
from server.backends import JobsBackend
from server.common import ServeConfig
from server.tenants import Tenant, key_tenant_name
from workers import fleet_metrics
from workers.message import broker_list
from workers.settings import JobSettings
from workers.store import JobStore

TENANTS = """
[tenants.conc]
keys = ["sk-conc"]
max_concurrent = 1

[tenants.queue]
keys = ["sk-queue"]
max_queued = 1

[tenants.rpm]
keys = ["sk-rpm"]
requests_per_minute = 1

[tenants.tpm]
keys = ["sk-tpm"]
tokens_per_minute = 600

[tenants.free]
keys = ["sk-free"]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    tmp = tmp_path_factory.mktemp("serve-tenants")
    (tmp / "tenants.toml").write_text(TENANTS)
    args = [
        "--embedded",
        "--queues",
        "llm",
        "--dtype",
        "float32",
        "--model",
        smollm2_dir,
        "--max-num-seqs",
        "1",
        "--kv-cache-bytes",
        str(128 << 20),
        "--max-model-len",
        "1024",
        "--no-profile",
        "--keepalive",
        "0.2",  # a queued stream's headers come with its first keep-alive: admitted, then waiting
        "--tenants",
        str(tmp / "tenants.toml"),
    ]
    proc = ServeProcess("serve-tenants", tmp, args)
    try:
        yield proc.wait_ready(240)
    finally:
        proc.stop()


def _as(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _body(max_tokens: int, stream: bool = True) -> dict:
    return {"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


def _refused(resp: httpx.Response, reason: str) -> int:
    """The 429's Retry-After, after checking its shape and that it names `reason`."""
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert err["code"] == 429 and err["type"] == "rate_limit_exceeded" and reason in err["message"], err
    retry = resp.headers["retry-after"]
    assert retry.isdigit() and int(retry) >= 1, retry
    return int(retry)


def test_past_each_limit_a_tenant_gets_429_with_retry_after_and_others_get_in(server):
    url = server.url + "/v1/completions"
    with httpx.Client(timeout=60) as client, contextlib.ExitStack() as streams:

        def admitted(key: str, max_tokens: int) -> httpx.Response:
            resp = streams.enter_context(client.stream("POST", url, json=_body(max_tokens), headers=_as(key)))
            assert resp.status_code == 200, resp.read()
            return resp

        # conc's long stream takes the one slot: its first token proves it runs.
        # (The line iterator is kept: a temporary one, closed when dropped, closes the stream.)
        lines = admitted("sk-conc", 900).iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert _refused(client.post(url, json=_body(4), headers=_as("sk-conc")), "max_concurrent") == 1
        admitted("sk-free", 4)  # another tenant: let in (it waits for the slot)

        admitted("sk-queue", 4)  # waits behind conc's stream: queued
        assert _refused(client.post(url, json=_body(4), headers=_as("sk-queue")), "max_queued") == 1
        admitted("sk-free", 4)

        admitted("sk-rpm", 4)
        assert 1 <= _refused(client.post(url, json=_body(4), headers=_as("sk-rpm")), "requests_per_minute") <= 60
        admitted("sk-free", 4)

        admitted("sk-tpm", 500)  # charged ~504 of its 600 a minute at admission
        retry = _refused(client.post(url, json=_body(500), headers=_as("sk-tpm")), "tokens_per_minute")
        assert 1 <= retry <= 60
        admitted("sk-free", 500)

    # Every stream closed: the server cancels their requests, and conc's slot comes back (a
    # ticket never released would lock the tenant out for good).
    def slot_back() -> bool:
        resp = httpx.post(url, json=_body(2, stream=False), headers=_as("sk-conc"), timeout=120)
        assert resp.status_code in (200, 429), resp.text
        return resp.status_code == 200

    wait_for(slot_back, 60, "conc's slot to come back once its stream closed", interval=0.2)


def test_a_bad_tenants_file_stops_the_server_naming_the_tenant_and_field(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.alice]\nkeys = ["sk-a"]\nmax_queued = 0\n')
    proc = subprocess.run(
        [sys.executable, "-m", "tandem", "serve", "--embedded", "--tenants", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "tenant 'alice': max_queued must be an integer >= 1" in proc.stderr, proc.stderr


def _queued_kwargs(store: JobStore, queue: str, priority: int) -> list[dict]:
    """The kwargs of the Celery messages waiting on `queue`'s broker list for `priority`."""
    out = []
    for raw in store.redis.lrange(broker_list(queue, priority), 0, -1):
        body = json.loads(base64.b64decode(json.loads(raw)["body"]))
        out.append(body[1])
    return out


def test_the_job_api_carries_the_keys_tenant_and_tier_and_limits_per_minute(tmp_path):
    redis = RedisServer(tmp_path).start()
    store = JobStore(JobSettings(redis_url=redis.url))
    payload = {"kind": "runtime", "serves": ["llm"], "models": [{"name": "smol", "max_model_len": 512}]}
    fleet_metrics.publish(store.redis, "w1", {**payload, "metrics": {}}, ttl_s=600)
    config = ServeConfig(api_key="sk-b", tenants=(Tenant("alice", ("sk-a",), requests_per_minute=1),))
    job = {"prompt": "hello", "max_tokens": 4}
    try:
        with TestClient(create_app(JobsBackend(JobSettings(redis_url=redis.url)), config)) as c:
            wait_for(lambda: c.get("/health").status_code == 200, 10, "the fake worker to count as live")
            assert c.post("/v1/jobs", json={**job, "tenant": "alice"}, headers=_as("sk-a")).status_code == 202
            again = c.post("/v1/jobs", json=job, headers=_as("sk-a"))
            assert 1 <= _refused(again, "requests_per_minute") <= 60
            assert c.post("/v1/jobs", json={**job, "tier": "batch"}, headers=_as("sk-b")).status_code == 202
            other = c.post("/v1/jobs", json={**job, "tenant": "alice"}, headers=_as("sk-b"))
            assert other.status_code == 400 and other.json()["error"]["param"] == "tenant", other.text
            bad = c.post("/v1/jobs", json={**job, "tier": "bulk"}, headers=_as("sk-b"))
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tier", bad.text
            queue = "llm.smol"
            interactive, batch = _queued_kwargs(store, queue, 3), _queued_kwargs(store, queue, 9)
    finally:
        store.close()
        redis.stop()
    assert [k.get("tenant") for k in interactive] == ["alice"]
    assert [(k.get("tenant"), k.get("tier")) for k in batch] == [(key_tenant_name("sk-b"), "batch")]
