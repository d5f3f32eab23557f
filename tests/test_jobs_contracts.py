"""The job layer's side of the helpers' contracts, against a real Redis and no Celery worker:

C  logprobs ride the token events (aligned with their token_ids) and stop_reason the final
   one, through the worker's EventWriter and workers/events.py's JobEvent (client and server)
G  a job submitted with an owner is no job to any other owner (status, result, events,
   cancel), and its job_id is refused to them
10 JobsBackend.read_events outlives a Redis restart (it goes on from the last id it saw);
   when Redis stays away past the deadline, the stream ends with an event naming the job
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from test_jobs_support import RedisServer, wait_for

from server.backends import JobsBackend
from workers.client import JobClient, JobNotFoundError
from workers.events import JobEvent
from workers.settings import JobSettings
from workers.store import JobOwnedError, JobStore, events_key
from workers.writer import EventWriter

LOGPROBS = [
    {"token_id": 5, "token": "a", "bytes": [97], "logprob": -0.5, "top": []},
    {"token_id": 6, "token": "b", "bytes": [98], "logprob": -1.5, "top": []},
    {"token_id": 7, "token": "c", "bytes": [99], "logprob": -2.5, "top": []},
]


class _Job:
    """What the EventWriter needs of a host.ActiveJob."""

    def __init__(self, job_id: str, token: str) -> None:
        self.job_id, self.token, self.fenced = job_id, token, False

    def on_fenced(self) -> None:
        self.fenced = True


@pytest.fixture()
def redis_server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture()
def store(redis_server):
    s = JobStore(JobSettings(redis_url=redis_server.url))
    yield s
    s.close()


def _claimed(store: JobStore, job_id: str, owner: str | None = None) -> _Job:
    store.submit(job_id, "tandem.generate", "llm", {"prompt": "hi"}, ttl_s=60, max_tokens=16, owner=owner)
    store.heartbeat("w")
    claim = store.claim(
        job_id, "w", "tok", "tandem.generate", "llm", {"prompt": "hi"}, ttl_s=60, max_tokens=16, submitted_at=0.0
    )
    assert claim.outcome == "claimed"
    return _Job(job_id, "tok")


class _RefusingStore:
    """A JobStore whose Redis refuses every connection until `back` is set, as one restarting
    does (a refusal answers at once)."""

    def __init__(self) -> None:
        self.back, self.tries, self.written = threading.Event(), 0, threading.Event()

    def finish_args(self, *args) -> list:
        return list(args)

    def run_scripts(self, calls: list) -> list:
        self.tries += 1
        if not self.back.is_set():
            raise RedisConnectionError("Connection refused")
        self.written.set()
        return [1] * len(calls)


def test_the_event_writer_waits_between_tries_while_redis_refuses_and_writes_once_it_is_back():
    """It retries however long Redis is away, but does not spin: a refused connection answers at
    once, and a loop without a wait tried thousands of times a second (red seen without it)."""
    store = _RefusingStore()
    writer = EventWriter(store)
    try:
        done = writer.finish(_Job("w1", "tok"), "done", {}, "", "stop")
        wait_for(lambda: store.tries >= 2, 10, "a second try")
        t0, tries0 = time.monotonic(), store.tries
        wait_for(lambda: time.monotonic() - t0 >= 1.0, 5, "a second of outage")
        assert store.tries - tries0 <= 20, store.tries - tries0  # waits grow to 0.5 s: a few tries a second
        store.back.set()
        assert done.result(10) is True
    finally:
        store.back.set()
        writer.close()


def test_logprobs_ride_the_token_events_and_stop_reason_the_final_one(store):
    job = _claimed(store, "c1")
    writer = EventWriter(store)
    try:
        writer.emit(job, 0, [5, 6], "ab", [1, 2], LOGPROBS[:2])
        writer.emit(job, 2, [7], "c", None, LOGPROBS[2:])
        assert writer.finish(job, "done", {"logprobs": LOGPROBS, "stop_reason": "\n"}, "", "stop", "", "\n").result(10)
    finally:
        writer.close()
    entries = store.redis.xrange(events_key("c1"))
    events = [JobEvent.from_fields(f, i).to_dict() for i, f in entries]  # what JobClient.stream gives
    tokens = [e for e in events if e["type"] == "token"]
    assert [t for e in tokens for t in e["token_ids"]] == [5, 6, 7]
    assert [lp for e in tokens for lp in e["logprobs"]] == LOGPROBS  # aligned, in order, merged or not
    assert all(len(e["logprobs"]) == len(e["token_ids"]) for e in tokens)
    assert events[-1]["type"] == "done" and events[-1]["stop_reason"] == "\n"
    server_side = [JobEvent.from_fields(f, i) for i, f in entries]  # what `tandem serve` routes see
    assert [lp for e in server_side if e.type == "token" for lp in e.logprobs] == LOGPROBS
    assert server_side[-1].stop_reason == "\n"
    assert store.prefix("c1") == ([5, 6, 7], "abc", LOGPROBS)  # what a resumed attempt starts from


def test_a_stop_token_id_stays_an_int_and_a_job_without_logprobs_carries_none(store):
    job = _claimed(store, "c2")
    writer = EventWriter(store)
    try:
        writer.emit(job, 0, [5], "a", [1])
        assert writer.finish(job, "done", {"logprobs": None}, "", "stop", "", 2).result(10)
    finally:
        writer.close()
    events = [JobEvent.from_fields(f, i).to_dict() for i, f in store.redis.xrange(events_key("c2"))]
    assert "logprobs" not in events[0] and events[-1]["stop_reason"] == 2
    assert store.prefix("c2")[2] is None


def test_another_owners_job_is_no_job_and_its_id_is_refused(store):
    settings = store.settings
    jobs = JobClient(settings=settings)
    try:
        job_id = jobs.submit("hi", max_tokens=4, job_id="mine", owner="alice", queue="parked")
        assert jobs.status(job_id, owner="alice")["state"] == "queued"
        for other in ("bob", None):
            with pytest.raises(JobNotFoundError):
                jobs.status(job_id, owner=other)
            with pytest.raises(JobNotFoundError):
                jobs.cancel(job_id, owner=other)
            with pytest.raises(JobNotFoundError):
                next(jobs.stream(job_id, owner=other))
        with pytest.raises(JobOwnedError, match="job_id 'mine'"):  # same arguments, another owner
            jobs.submit("hi", max_tokens=4, job_id="mine", owner="bob", queue="parked")
        with pytest.raises(JobOwnedError):
            jobs.submit("hi", max_tokens=4, job_id="mine", queue="parked")
        assert jobs.status(job_id, owner="alice")["state"] == "queued"  # bob's cancel changed nothing
        # An ownerless job is everyone's, as before.
        free = jobs.submit("hi", max_tokens=4, queue="parked")
        assert jobs.status(free, owner="bob")["state"] == "queued"

        async def server_side():
            backend = JobsBackend(settings)
            try:
                assert await backend.status(job_id, owner="bob") is None
                assert await backend.cancel(job_id, owner="bob") == "missing"
                assert await backend.result(job_id, owner="bob") is None
                with pytest.raises(Exception, match="does not exist"):
                    async for _ in backend.read_events(job_id, owner="bob"):
                        pass
                with pytest.raises(ValueError, match="already used"):  # the route answers 409
                    await backend.submit(
                        "tandem.generate", {"prompt": "hi"}, job_id="mine", queue="parked", owner="bob"
                    )
                assert (await backend.status(job_id, owner="alice"))["state"] == "queued"
                assert await backend.cancel(job_id, owner="alice") == "cancelled"
            finally:
                await backend.close()

        asyncio.run(server_side())
    finally:
        jobs.close()


def test_a_stream_outlives_a_redis_restart_and_ends_naming_the_job_past_its_deadline(redis_server, store):
    job = _claimed(store, "s1")
    store.run_scripts([("emit", store.emit_args("s1", job.token, 0, [1, 2], "ab", [9]))])

    async def read(deadline_s: float, outage) -> list[dict]:
        backend = JobsBackend(JobSettings(redis_url=redis_server.url))
        got = []
        try:
            async for _, event in backend.read_events("s1", deadline=time.monotonic() + deadline_s):
                got.append(event)
                if len(got) == 1:
                    await asyncio.to_thread(outage)  # the reader's connection dies under it
        finally:
            await backend.close()
        return got

    def restart_then_go_on():
        redis_server.kill()
        redis_server.start()  # the append-only file brings the job and its stream back
        store.run_scripts([("emit", store.emit_args("s1", job.token, 2, [3], "c", None))])
        store.run_scripts([("finish", store.finish_args("s1", job.token, "done", {"ok": 1}, "", "length"))])

    events = asyncio.run(read(30, restart_then_go_on))
    assert [e.type for e in events] == ["token", "token", "done"]  # nothing lost, nothing twice
    assert [t for e in events for t in e.token_ids] == [1, 2, 3]

    job = _claimed(store, "s2")
    store.run_scripts([("emit", store.emit_args("s2", job.token, 0, [1], "a", [9]))])

    async def read_lost() -> list[dict]:
        backend = JobsBackend(JobSettings(redis_url=redis_server.url))
        got = []
        try:
            async for _, event in backend.read_events("s2", deadline=time.monotonic() + 2.0):
                got.append(event)
                if len(got) == 1:
                    await asyncio.to_thread(redis_server.kill)  # and it stays away
        finally:
            await backend.close()
        return got

    t0 = time.monotonic()
    events = asyncio.run(read_lost())
    assert time.monotonic() - t0 < 10, "the stream waited past its deadline"
    assert [e.type for e in events] == ["token", "failed"]
    assert events[-1].job_id == "s2" and "GET /v1/jobs/s2" in events[-1].error


def test_health_is_503_until_a_live_worker_serves_and_names_what_each_serves(redis_server, store):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from workers import fleet_metrics

    backend = JobsBackend(JobSettings(redis_url=redis_server.url))
    with TestClient(create_app(backend)) as client:
        empty = client.get("/health")
        assert empty.status_code == 503 and empty.json()["error"] == "no live worker"  # a balancer sends nothing here
        # What a worker publishes at every heartbeat (host._publish_metrics), here with a short life.
        payload = {"kind": "runtime", "serves": ["llm"], "models": [{"name": "smol", "max_model_len": 512}]}
        fleet_metrics.publish(store.redis, "w1", {**payload, "metrics": {}}, ttl_s=1.5)
        up = wait_for(lambda: (lambda r: r.status_code == 200 and r)(client.get("/health")), 5, "/health to turn 200")
        assert up.status_code == 200 and up.json()["models"] == {"smol": 1} and up.json()["llm"] == 1
        assert client.get("/health", params={"model": "smol"}).status_code == 200
        assert client.get("/health", params={"model": "other"}).status_code == 503
        # The worker stops beating: its payload expires, and /health says so again.
        wait_for(lambda: client.get("/health").status_code == 503, 5, "/health to turn 503")


def test_one_job_id_with_the_same_arguments_on_another_models_queue_is_a_conflict(store):
    """A job id names one job: resubmitting it for another model (another queue) is refused,
    not answered with the first model's job."""
    jobs = JobClient(settings=store.settings)
    try:
        job_id = jobs.submit("hi", max_tokens=4, job_id="one-id", queue="llm.smol")
        assert jobs.submit("hi", max_tokens=4, job_id="one-id", queue="llm.smol") == job_id  # the same job
        with pytest.raises(ValueError, match="already used by a job with other arguments"):
            jobs.submit("hi", max_tokens=4, job_id="one-id", queue="llm.big")
    finally:
        jobs.close()
