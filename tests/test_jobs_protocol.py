"""The job state machine (workers/lua.py through workers/store.py) against a real Redis, with
no Celery worker: claims, fencing, idempotent writes, cancel, reaping, expiry. Plus the
field checks that clients and workers share."""

from __future__ import annotations

import base64
import json
import os

import pytest
from test_jobs_support import RedisServer

from workers.jobspec import allowed_path, parse_detect, parse_generate
from workers.settings import JobSettings
from workers.store import JobStore, end_key, events_key, job_key, worker_key

WORKER_A, WORKER_B = "a@test:1:x", "b@test:2:y"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture()
def store(redis_server):
    s = JobStore(JobSettings(redis_url=redis_server.url, lease_s=1.0, heartbeat_s=0.2))
    s.redis.flushdb()
    yield s
    s.close()


def _submit(store: JobStore, job_id: str = "j1", **kwargs) -> None:
    store.submit(job_id, "tandem.generate", "llm", kwargs or {"prompt": "hi"}, ttl_s=60, max_tokens=16)


def _claim(store: JobStore, worker: str, token: str, job_id: str = "j1"):
    store.heartbeat(worker)
    return store.claim(
        job_id, worker, token, "tandem.generate", "llm", {"prompt": "hi"}, ttl_s=60, max_tokens=16, submitted_at=0.0
    )


def _emit(store: JobStore, token: str, start: int, ids: list[int], job_id: str = "j1") -> int:
    return store.run_scripts([("emit", store.emit_args(job_id, token, start, ids, "t" * len(ids), None))])[0]


def _finish(store: JobStore, token: str, state: str = "done", job_id: str = "j1") -> int:
    return store.run_scripts([("finish", store.finish_args(job_id, token, state, {"ok": 1}, "", "length"))])[0]


def _event_types(store: JobStore, job_id: str = "j1") -> list[str]:
    return [f["type"] for _, f in store.redis.xrange(events_key(job_id))]


def _messages(store: JobStore, queue_list: str) -> list[dict]:
    return [json.loads(m) for m in store.redis.lrange(queue_list, 0, -1)]


def test_same_job_id_and_arguments_is_one_job_other_arguments_are_refused(store):
    assert store.submit("j1", "tandem.generate", "llm", {"prompt": "hi"}, ttl_s=60, max_tokens=16) == (True, "queued")
    assert store.submit("j1", "tandem.generate", "llm", {"prompt": "hi"}, ttl_s=60, max_tokens=16) == (False, "queued")
    assert store.redis.zcard("tandem:queued:llm") == 1
    (message,) = _messages(store, "llm\x06\x163")  # recorded and queued together, once
    assert message["headers"]["id"] == "j1" and message["headers"]["task"] == "tandem.generate"
    body = json.loads(base64.b64decode(message["body"]))
    assert body[1] == {"prompt": "hi"}
    with pytest.raises(ValueError, match="job_id 'j1' is already used"):
        store.submit("j1", "tandem.generate", "llm", {"prompt": "other"}, ttl_s=60, max_tokens=16)


def test_a_retried_claim_is_the_same_claim_and_a_live_owner_keeps_its_job(store):
    _submit(store)
    first = _claim(store, WORKER_A, "tok-a")
    assert (first.outcome, first.attempt) == ("claimed", 1)
    assert _claim(store, WORKER_A, "tok-a").attempt == 1  # the reply was lost; nothing changes
    busy = _claim(store, WORKER_B, "tok-b")
    assert (busy.outcome, busy.detail) == ("busy", WORKER_A)
    assert store.redis.zcard("tandem:queued:llm") == 0


def test_a_worker_whose_lease_lapsed_is_fenced_out_and_the_stream_says_restarted(store):
    _submit(store)
    _claim(store, WORKER_A, "tok-a")
    assert _emit(store, "tok-a", 0, [1, 2]) == 1
    store.release(WORKER_A)  # its lease is gone: as after SIGKILL, once lease_s passed
    second = _claim(store, WORKER_B, "tok-b")
    assert (second.outcome, second.attempt, second.num_tokens) == ("claimed", 2, 2)
    assert _emit(store, "tok-a", 2, [3]) == 0  # the old owner can no longer write
    assert _finish(store, "tok-a") == 0
    assert _emit(store, "tok-b", 2, [3]) == 1
    assert _finish(store, "tok-b") == 1
    assert _event_types(store) == ["token", "restarted", "token", "done"]
    assert store.prefix_tokens("j1") == ([1, 2, 3], "ttt")
    restarted = store.redis.xrange(events_key("j1"))[1][1]
    assert (restarted["attempt"], restarted["resumed_from"]) == ("2", "2")


def test_retried_writes_change_nothing(store):
    _submit(store)
    _claim(store, WORKER_A, "tok-a")
    assert _emit(store, "tok-a", 0, [5, 6]) == 1
    assert _emit(store, "tok-a", 0, [5, 6]) == 1  # the same write again, as after a lost reply
    assert _emit(store, "tok-a", 5, [9]) == -1  # a gap is refused, never written
    assert _finish(store, "tok-a") == 1
    assert _finish(store, "tok-a") == 1
    assert _event_types(store) == ["token", "done"]
    assert store.redis.xlen(end_key("j1")) == 1


def test_cancel_of_a_queued_job_makes_it_final_so_a_later_delivery_runs_nothing(store):
    _submit(store)
    assert store.cancel("j1") == "cancelled"
    assert _claim(store, WORKER_A, "tok-a").outcome == "final"
    assert store.record("j1")["attempt"] == "0"
    assert _event_types(store) == ["cancelled"]
    assert store.cancel("j1") == "final:cancelled"  # nothing more to do
    assert store.cancel("nope") == "missing"


def test_cancel_of_a_running_job_flags_it_for_its_worker(store):
    _submit(store)
    _claim(store, WORKER_A, "tok-a")
    pubsub = store.redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("tandem:cancel")
    assert store.cancel("j1") == "cancelling"
    assert store.cancel_requested(["j1"]) == ["j1"]
    msg = None
    for _ in range(50):
        msg = pubsub.get_message(timeout=0.1)
        if msg:
            break
    assert msg is not None and msg["data"] == "j1"
    pubsub.close()
    assert _finish(store, "tok-a", "cancelled") == 1
    assert store.record("j1")["state"] == "cancelled"


def test_reap_requeues_only_jobs_whose_owner_lease_expired(store):
    for job_id in ("j1", "j2"):
        _submit(store, job_id)
    _claim(store, WORKER_A, "tok-a", "j1")
    _claim(store, WORKER_B, "tok-b", "j2")
    store.release(WORKER_A)
    assert store.reap() == ["j1"]
    rec = store.record("j1")
    assert (rec["state"], rec["owner"]) == ("queued", "")
    assert store.record("j2")["state"] == "running"
    (again,) = _messages(store, "llm")  # queued again, on the list polled first
    assert again["headers"]["id"] == "j1" and again["properties"]["delivery_tag"] == "j1#2"
    assert store.reap() == []


def test_a_job_cancelled_while_its_owner_is_dead_is_cancelled_not_rerun(store):
    _submit(store)
    _claim(store, WORKER_A, "tok-a")
    store.release(WORKER_A)
    assert store.cancel("j1") == "cancelled"
    assert store.reap() == []


def test_final_jobs_expire_after_their_ttl_and_unfinished_ones_do_not(store):
    store.submit("j1", "tandem.generate", "llm", {"prompt": "hi"}, ttl_s=7, max_tokens=16)
    assert store.redis.ttl(job_key("j1")) == -1
    _claim(store, WORKER_A, "tok-a")
    _emit(store, "tok-a", 0, [1])
    _finish(store, "tok-a")
    for key in (job_key("j1"), events_key("j1"), end_key("j1")):
        assert 0 < store.redis.ttl(key) <= 7, key
    assert 0 < store.redis.pttl(worker_key(WORKER_A)) <= 1000  # leases expire by themselves


def test_wait_final_returns_jobs_final_before_or_during_the_wait(store):
    _submit(store, "j1")
    _submit(store, "j2")
    _claim(store, WORKER_A, "tok-a", "j1")
    _finish(store, "tok-a", job_id="j1")
    final = store.wait_final(["j1", "j2"], block_ms=10)
    assert list(final) == ["j1"] and final["j1"]["state"] == "done" and json.loads(final["j1"]["result"]) == {"ok": 1}
    assert store.wait_final(["j2"], block_ms=10) == {}


def test_generate_fields_are_checked_by_name():
    assert parse_generate({"prompt": "hi", "max_tokens": 3}).params.max_tokens == 3
    assert parse_generate({"messages": [{"role": "user", "content": "hi"}]}).prompt[0]["role"] == "user"
    for kwargs, field in [
        ({"prompt": "hi", "max_tokenz": 3}, "max_tokenz"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": "x"}, "top_p"),
        ({}, "prompt or messages"),
        ({"prompt": "hi", "messages": []}, "prompt or messages"),
        ({"messages": [{"role": "user"}]}, "messages[0]"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": "hi", "priority": 1.5}, "priority"),
        ({"prompt": "hi", "deadline_s": 0}, "deadline_s"),
    ]:
        with pytest.raises(ValueError, match=field.replace("[", r"\[")):
            parse_generate(kwargs)
    with pytest.raises(ValueError, match="exactly one"):
        parse_detect({"path": "/a", "url": "http://x/"})


def test_allowed_paths_resolve_links_and_dot_dot(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    (root / "a.jpg").write_bytes(b"x")
    outside = tmp_path / "secret.txt"
    outside.write_text("s")
    os.symlink(outside, root / "link.jpg")
    roots = (os.path.realpath(root),)
    assert allowed_path(str(root / "a.jpg"), roots) == os.path.realpath(root / "a.jpg")
    for bad in (str(outside), str(root / ".." / "secret.txt"), str(root / "link.jpg"), "/etc/passwd"):
        with pytest.raises(ValueError, match="outside the allowed roots"):
            allowed_path(bad, roots)
    with pytest.raises(ValueError, match="allows no file paths"):
        allowed_path(str(root / "a.jpg"), ())


def test_settings_come_from_the_environment_and_name_bad_values():
    s = JobSettings.from_env({"TANDEM_REDIS_URL": "redis://h:1/2", "TANDEM_LEASE_S": "6", "TANDEM_HEARTBEAT_S": "1"})
    assert (s.redis_url, s.lease_s, s.heartbeat_s) == ("redis://h:1/2", 6.0, 1.0)
    with pytest.raises(ValueError, match="heartbeat_s"):
        JobSettings(lease_s=3, heartbeat_s=2)
    with pytest.raises(ValueError, match="TANDEM_JOB_TTL_S"):
        JobSettings.from_env({"TANDEM_JOB_TTL_S": "soon"})
    with pytest.raises(ValueError, match="allowed_url_prefixes"):
        JobSettings(allowed_url_prefixes=("https://",))
    assert json.loads(json.dumps(JobSettings().allowed_roots)) == []


def test_a_queued_job_whose_broker_message_is_gone_is_queued_again_on_the_second_sweep(store):
    def sweep(now: float) -> list[str]:
        store.redis.delete("tandem:sweep-lock")  # one sweep per period; here the test sets the pace
        return store.orphans(every_s=4.0, now=now)

    _submit(store, "lost")
    _submit(store, "listed")
    lost = store.redis.lrange("llm\x06\x163", 0, -1)[-1]  # the first pushed, the first to pop
    assert json.loads(lost)["headers"]["id"] == "lost"
    store.redis.lrem("llm\x06\x163", 1, lost)  # taken by a worker that died before claiming
    assert sweep(1000.0) == []  # first sighting only
    assert sweep(1002.0) == []  # too soon: its message may be on its way to a worker
    assert sweep(1004.5) == ["lost"]
    assert [m["headers"]["id"] for m in _messages(store, "llm")] == ["lost"]
    assert sweep(1010.0) == []  # its message is back
    assert store.orphans(every_s=4.0) == []  # the lock: another worker swept this period


def test_a_message_a_live_worker_prefetched_is_not_taken_for_lost(store):
    def sweep(now: float) -> list[str]:
        store.redis.delete("tandem:sweep-lock")
        return store.orphans(every_s=4.0, now=now)

    _submit(store, "prefetched")
    store.redis.delete("llm\x06\x163")  # taken off the broker list by a worker's prefetch
    store.hold("w1", ["prefetched"])  # that worker says it holds it, waiting for a free thread
    assert sweep(1000.0) == [] and sweep(1004.5) == [] and sweep(1009.0) == []
    assert _messages(store, "llm") == []  # no duplicate message
    store.release("w1")  # the worker leaves (or its held key expires with its lease)
    assert sweep(1020.0) == []  # first sighting
    assert sweep(1024.5) == ["prefetched"]
