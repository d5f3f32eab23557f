"""Leases, reaping and resume, in-process against the Lua scripts (a real redis-server) with a
fake clock: the stores and hosts are given the time (JobStore's and WorkerHost's `clock`), and
the lease threads' turns are `WorkerHost.beat(now)`, called here, so a lease lapses when the
test moves the clock on, never by waiting. The hosts are built without `start()`: no Runtime,
no lease thread, and jobs run through `workers.jobs.run_job` with a body of the test's own.

tests/test_failover.py keeps one real SIGKILL run (real processes, a real lease expiring in
Redis); the rules it rests on are pinned here, at the boundaries, in milliseconds."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_jobs_support import RedisServer, wait_for

from workers.host import Fenced, WorkerHost
from workers.jobs import Duplicate, run_job
from workers.settings import JobSettings
from workers.store import JobStore, events_key
from workers.writer import EventWriter

LEASE_S = 10.0  # the production default: the clock is fake, so a lease costs nothing to wait out
HEARTBEAT_S = 2.0
KWARGS = {"prompt": "hi", "max_tokens": 8}


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("leases-redis")).start()
    yield server
    server.stop()


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture()
def settings(redis_server) -> JobSettings:
    return JobSettings(redis_url=redis_server.url, lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S)


@pytest.fixture()
def client(settings, clock):
    store = JobStore(settings, clock=clock)
    store.redis.flushdb()
    yield store
    store.close()


def _host(settings: JobSettings, clock: FakeClock, name: str) -> WorkerHost:
    host = WorkerHost(settings, lambda: None, name=name, clock=clock)
    host.writer = EventWriter(host.store)
    return host


@pytest.fixture()
def hosts(settings, clock, client):
    """Two workers, a and b, each connected to Redis for a full lease already (a worker reaps
    only after that long), with fresh leases."""
    made = [_host(settings, clock, "a"), _host(settings, clock, "b")]
    clock.advance(LEASE_S)
    for h in made:
        h.beat()
    yield made
    for h in made:
        h.writer.close()
        h.store.close()


def _submit(client: JobStore, job_id: str = "j1") -> None:
    assert client.submit(job_id, "tandem.generate", "llm", KWARGS, ttl_s=60, max_tokens=8) == (True, "queued")


def _claim(host: WorkerHost, token: str, job_id: str = "j1"):
    return host.store.claim(
        job_id, host.worker_id, token, "tandem.generate", "llm", KWARGS, ttl_s=60, max_tokens=8, submitted_at=0.0
    )


def _emit(host: WorkerHost, token: str, start: int, ids: list[int], job_id: str = "j1") -> int:
    return host.store.run_scripts([("emit", host.store.emit_args(job_id, token, start, ids, "t" * len(ids), None))])[0]


def _finish(host: WorkerHost, token: str, job_id: str = "j1") -> int:
    args = host.store.finish_args(job_id, token, "done", {"ok": 1}, "", "length")
    return host.store.run_scripts([("finish", args)])[0]


def _requeued_messages(client: JobStore) -> list[str]:
    """Ids of the messages on the broker list polled first (the queue's own name), where a reaped
    job's message goes."""
    return [json.loads(m)["headers"]["id"] for m in client.redis.lrange("llm", 0, -1)]


def test_a_claimed_job_whose_owners_lease_lapsed_is_reaped_and_queued_again_first_in_line(client, hosts, clock):
    a, b = hosts
    _submit(client)
    assert _claim(a, "tok-a").outcome == "claimed"
    clock.advance(LEASE_S - 0.001)  # a beats no more (SIGKILL): its lease has a millisecond left
    b.beat()
    assert (client.record("j1")["state"], client.record("j1")["owner"]) == ("running", a.worker_id)
    assert _requeued_messages(client) == [] and b.num_republished == 0

    requeued_at = clock.advance(0.001)  # the lease's end: a lease is live strictly before it
    b.beat()
    rec = client.record("j1")
    assert (rec["state"], rec["owner"], float(rec["requeued_at"])) == ("queued", "", requeued_at)
    assert client.queue_position("llm", "j1") == 0
    assert _requeued_messages(client) == ["j1"] and b.num_republished == 1
    b.beat()  # once: the job is queued, not running, so a later turn finds nothing
    assert _requeued_messages(client) == ["j1"] and b.num_republished == 1


def test_a_live_lease_keeps_its_job_however_long_the_job_runs(client, hosts, clock):
    a, b = hosts
    _submit(client)
    _claim(a, "tok-a")
    for _ in range(10 * int(LEASE_S / HEARTBEAT_S)):  # ten leases long, a beating all along
        clock.advance(HEARTBEAT_S)
        a.beat()
        b.beat()
        assert client.record("j1")["owner"] == a.worker_id
    busy = _claim(b, "tok-b")  # a redelivered message: the job stays a's
    assert (busy.outcome, busy.detail) == ("busy", a.worker_id)
    assert client.cancel("j1") == "cancelling"  # a live owner is asked to stop, not overruled
    rec = client.record("j1")
    assert (rec["state"], rec["attempt"]) == ("running", "1") and b.num_republished == 0
    assert _requeued_messages(client) == []


def test_a_stale_claim_is_fenced_out_without_waiting_for_a_reaper(client, hosts, clock):
    """The message comes again (the broker redelivered it) after the owner's lease lapsed and
    before any reaper ran: the claim itself sees the lease gone, and the old owner's token
    writes nothing from then on."""
    a, b = hosts
    _submit(client)
    _claim(a, "tok-a")
    assert _emit(a, "tok-a", 0, [1, 2]) == 1
    clock.advance(LEASE_S)
    b.store.heartbeat(b.worker_id)  # b lives on; its lease renewed, no reaping turn
    second = _claim(b, "tok-b")
    assert (second.outcome, second.attempt, second.num_tokens) == ("claimed", 2, 2)
    assert _emit(a, "tok-a", 2, [3]) == 0 and _finish(a, "tok-a") == 0  # fenced
    a.beat()  # a comes back to life: its lease is live again, but the job is b's
    assert _emit(a, "tok-a", 2, [3]) == 0 and _finish(a, "tok-a") == 0
    assert _emit(b, "tok-b", 2, [7]) == 1 and _finish(b, "tok-b") == 1
    assert client.prefix_tokens("j1") == ([1, 2, 7], "ttt")


def test_cancelling_a_job_whose_owner_is_dead_closes_it_at_once_and_the_reaper_leaves_it(client, hosts, clock):
    a, b = hosts
    _submit(client)
    _claim(a, "tok-a")
    clock.advance(LEASE_S)
    assert client.cancel("j1") == "cancelled"  # no live worker to pass the flag to
    b.beat()
    assert client.record("j1")["state"] == "cancelled" and _requeued_messages(client) == []


def test_after_redis_comes_back_a_worker_reaps_only_once_it_has_been_connected_a_full_lease(client, hosts, clock):
    """Leases lapse during a Redis outage while their workers live: a worker whose beats failed
    (its lease thread calls lost_redis) does not take the others' jobs until each has had a
    lease period to beat again."""
    a, b = hosts
    for job_id in ("slow", "dead"):
        _submit(client, job_id)
    _claim(a, "tok-a", "slow")
    dead = _host(client.settings, clock, "dead")
    try:
        dead.beat()
        _claim(dead, "tok-dead", "dead")
    finally:
        dead.writer.close()
        dead.store.close()
    b.lost_redis()
    clock.advance(2 * LEASE_S)  # the outage: every lease lapsed
    b.beat()
    assert [client.record(j)["state"] for j in ("slow", "dead")] == ["running", "running"]
    clock.advance(1.0)
    a.beat()  # a is alive: its first beat since the outage
    clock.advance(LEASE_S - 1.0)
    b.beat()  # b has been back a full lease: the dead worker's job moves, a's stays
    assert [client.record(j)["state"] for j in ("slow", "dead")] == ["running", "queued"]
    assert _requeued_messages(client) == ["dead"]


class FakeWork:
    """What a job runs in the Runtime, as ActiveJob sees it: cancel() stops it."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def test_a_job_resumed_on_another_worker_keeps_the_tokens_already_written(client, hosts, clock):
    """The whole worker side: a runs the job and streams three tokens, then stalls past its
    lease; b reaps the job and runs it again from the tokens the stream holds (with the first
    attempt's prompt ids); a's next write is fenced, which cancels its work, and a's delivery
    ends as a duplicate that wrote nothing."""
    a, b = hosts
    _submit(client)
    a_work = FakeWork()
    stalled = threading.Event()
    go_on = threading.Event()

    def a_body(host, job, kwargs):
        job.attach(a_work)
        host.writer.emit(job, 0, [11, 12, 13], "abc", prompt_token_ids=[5, 6], logprobs=[{"lp": -0.5}] * 3)
        stalled.set()
        go_on.wait(30)
        host.writer.emit(job, 3, [14], "d", logprobs=[{"lp": -0.5}])
        if not a_work.cancelled.wait(30):
            return {"token_ids": [11, 12, 13, 14]}, ""
        raise Fenced()

    seen: dict = {}

    def b_body(host, job, kwargs):
        ids, text, logprobs = host.store.prefix(job.job_id)
        seen.update(resumed_from=job.resumed_from, attempt=job.attempt, prompt=job.prompt_token_ids)
        seen.update(prefix=(ids, text, logprobs))
        host.writer.emit(job, job.resumed_from, [24, 25], "ef", logprobs=[{"lp": -1.0}] * 2)
        return {"token_ids": ids + [24, 25], "text": text + "ef", "finish_reason": "length"}, ""

    with ThreadPoolExecutor(1) as pool:
        a_run = pool.submit(run_job, a, "tandem.generate", "j1", "llm", KWARGS, a_body)
        assert stalled.wait(30)
        wait_for(lambda: client.record("j1")["num_tokens"] == "3", 30, "a's three tokens to be written")
        clock.advance(LEASE_S)
        b.beat()
        assert _requeued_messages(client) == ["j1"]
        result = run_job(b, "tandem.generate", "j1", "llm", KWARGS, b_body)
        go_on.set()
        with pytest.raises(Duplicate, match="moved to another worker"):
            a_run.result(30)
    assert a_work.cancelled.is_set(), "a's fenced write stopped its work"

    assert seen == {
        "resumed_from": 3,
        "attempt": 2,
        "prompt": [5, 6],
        "prefix": ([11, 12, 13], "abc", [{"lp": -0.5}] * 3),
    }
    assert result["token_ids"] == [11, 12, 13, 24, 25]
    events = [f for _, f in client.redis.xrange(events_key("j1"))]
    assert [e["type"] for e in events] == ["token", "restarted", "token", "done"]
    assert (events[1]["attempt"], events[1]["resumed_from"], events[1]["worker"]) == ("2", "3", b.worker_id)
    assert [json.loads(e["token_ids"]) for e in events if e["type"] == "token"] == [[11, 12, 13], [24, 25]]
    assert [int(e["index"]) for e in events if e["type"] == "token"] == [0, 3]
    assert client.prefix("j1") == ([11, 12, 13, 24, 25], "abcef", [{"lp": -0.5}] * 3 + [{"lp": -1.0}] * 2)
    rec = client.record("j1")
    assert (rec["state"], rec["finished_by"] != "", rec["attempt"]) == ("done", True, "2")
    assert (a.outcomes, b.outcomes["done"]) == ({}, 1)


def test_an_older_workers_lease_key_counts_as_alive_while_it_exists(client, hosts, clock):
    """A rolling upgrade: a worker of the previous release writes its beat time into its key
    (alive, as its own scripts read it, while the key exists). The new scripts must not read
    that time as a lease's end long past and requeue the job it runs."""
    from workers.store import lease_alive, worker_key

    a, b = hosts
    _submit(client)
    assert _claim(a, "tok-a").outcome == "claimed"
    old_beat = clock.now - 3 * LEASE_S  # any time at all: the key's TTL is the lease
    client.redis.set(worker_key(a.worker_id), str(old_beat), px=int(LEASE_S * 1000))
    clock.advance(2 * LEASE_S)
    b.beat()
    assert (client.record("j1")["state"], client.record("j1")["owner"]) == ("running", a.worker_id)
    assert _claim(b, "tok-b").outcome == "busy"  # CLAIM's alive(), as REAP's, reads the key as live
    assert lease_alive(str(old_beat), clock.now) and not lease_alive(None, clock.now)
    assert not lease_alive(f"end:{clock.now}", clock.now) and lease_alive(f"end:{clock.now + 1}", clock.now)
    client.redis.delete(worker_key(a.worker_id))  # the older worker died: its key expired
    b.beat()
    assert client.record("j1")["state"] == "queued"
