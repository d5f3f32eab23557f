"""JobStore: the Redis side of jobs, shared by clients and workers. The state machine itself
is in lua.py; this module names the keys, calls the scripts, and retries across a Redis
restart (every write is idempotent, so a retry after a lost reply changes nothing)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from workers import lua
from workers.events import APPENDED, TOKEN, JobEvent
from workers.lua_events import APPEND
from workers.message import broker_list, broker_lists, task_message
from workers.retry import Backoff, retry
from workers.settings import JobSettings

log = logging.getLogger("tandem.jobs")

PREFIX = "tandem:"
FINAL_STATES = ("done", "failed", "cancelled")
STATES = ("queued", "running", *FINAL_STATES)
_JOB_ID = re.compile(r"[A-Za-z0-9._:@-]{1,200}")
T = TypeVar("T")


def check_job_id(job_id: object) -> str:
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"job_id must be 1-200 characters of [A-Za-z0-9._:@-], got {job_id!r}")
    return job_id


def digest(task: str, kwargs: dict) -> str:
    """What makes two submissions of one job id the same job."""
    return hashlib.sha256(json.dumps([task, kwargs], sort_keys=True).encode()).hexdigest()[:32]


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def events_key(job_id: str) -> str:
    return f"{PREFIX}events:{job_id}"


def end_key(job_id: str) -> str:
    return f"{PREFIX}end:{job_id}"


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


CANCEL_CHANNEL = f"{PREFIX}cancel"
RUNNING = f"{PREFIX}running"
ORPHANS = f"{PREFIX}orphans"  # zset: queued jobs seen without a broker message, by first sighting
SWEEP_LOCK = f"{PREFIX}sweep-lock"


def broker_priority(priority: int) -> int:
    """Kombu's Redis lists are polled in ascending priority number, 0 first. A job that lost its
    worker or its message goes again at 0, so it does not wait behind a long queue twice;
    plain Celery clients send 0 too. Job priorities (lower first) map onto the rest: below 0
    (urgent) -> 0, 0 (the default) -> 3, 1..9 -> 6, 10 and above -> 9."""
    return 0 if priority < 0 else 3 if priority == 0 else 6 if priority < 10 else 9


class JobOwnedError(ValueError):
    """The job id belongs to another owner (contract G): refused, 409, saying nothing of it."""


def submit_args(
    job_id: str,
    task: str,
    queue: str,
    kwargs: dict,
    *,
    ttl_s: int,
    max_tokens: int,
    priority: int = 0,
    owner: str | None = None,
    now: float | None = None,
) -> list:
    """ARGV of the SUBMIT script (lua.py), for a client on either Redis API, sync or asyncio.
    `owner`: who submits (None: nobody in particular); a job with an owner is the owner's only.
    `now`: the submission time (None: time.time())."""
    step = broker_priority(priority)
    message = task_message(task, job_id, kwargs, queue, step, ignore_result=True)
    return [
        PREFIX,
        job_id,
        task,
        queue,
        digest(task, kwargs),
        message,
        broker_list(queue, step),
        time.time() if now is None else now,
        ttl_s,
        max_tokens,
        owner or "",
    ]


def submit_outcome(job_id: str, outcome: str, state: str) -> tuple[bool, str]:
    if outcome == "owned":
        raise JobOwnedError(f"job_id {job_id!r} is already used by another caller's job; choose another")
    if outcome == "conflict":
        raise ValueError(f"job_id {job_id!r} is already used by a job with other arguments (state {state})")
    return outcome == "new", state


@dataclass(slots=True)
class Claim:
    outcome: str  # "claimed", "final" (nothing to run) or "busy" (a live worker has it)
    attempt: int = 0
    num_tokens: int = 0  # tokens already streamed by earlier attempts
    detail: str = ""  # the final state, or the busy owner
    submitted_at: float = 0.0
    prompt_token_ids: list[int] | None = None  # recorded by the first attempt's first token


def connect(url: str) -> redis.Redis:
    # Blocking stream reads wait at most 2 s at a time (client.BLOCK_MS), well under the socket
    # timeout; a dead connection surfaces within it and `JobStore.retrying` reconnects.
    return redis.Redis.from_url(
        url, decode_responses=True, socket_timeout=10.0, socket_connect_timeout=2.0, health_check_interval=15
    )


class JobStore:
    """`clock`: the time every script is given as `now`, and that leases are written and read in
    (wall-clock seconds; tests pass a fake one to expire leases without waiting them out)."""

    def __init__(
        self,
        settings: JobSettings | None = None,
        client: redis.Redis | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings or JobSettings.from_env()
        self.clock = clock
        self.redis = client or connect(self.settings.redis_url)
        r = self.redis
        self._submit = r.register_script(lua.SUBMIT)
        self._claim = r.register_script(lua.CLAIM)
        self._emit = r.register_script(lua.EMIT)
        self._finish = r.register_script(lua.FINISH)
        self._cancel = r.register_script(lua.CANCEL)
        self._reap = r.register_script(lua.REAP)
        self._republish = r.register_script(lua.REPUBLISH)
        self._append = r.register_script(APPEND)

    def retrying(self, fn: Callable[[], T], what: str) -> T:
        """Run `fn`, retrying while Redis is unreachable or still loading its append-only file,
        for up to `settings.reconnect_s`."""
        # reconnect_s counts from the call (the server's reads count from the first failure),
        # so a first try that hung for its socket timeout has spent that much of it.
        backoff = Backoff(0.02, until=time.monotonic() + self.settings.reconnect_s)
        return retry(
            fn,
            backoff,
            (RedisConnectionError, RedisTimeoutError),
            lambda exc: log.warning("redis unavailable during %s (%s); retrying", what, exc),
        )

    def close(self) -> None:
        self.redis.close()

    # ---- clients ----------------------------------------------------------------------------

    def submit(
        self,
        job_id: str,
        task: str,
        queue: str,
        kwargs: dict,
        *,
        ttl_s: int,
        max_tokens: int,
        priority: int = 0,
        owner: str | None = None,
    ) -> tuple[bool, str]:
        """Record a job and queue its Celery message, in one script. Returns (created, state).
        The same id with the same arguments is the same job; with others it is a ValueError;
        under another owner a JobOwnedError."""
        args = submit_args(
            job_id,
            task,
            queue,
            kwargs,
            ttl_s=ttl_s,
            max_tokens=max_tokens,
            priority=priority,
            owner=owner,
            now=self.clock(),
        )
        return submit_outcome(job_id, *self.retrying(lambda: self._submit(args=args), "submit"))

    def record(self, job_id: str) -> dict[str, str]:
        """The job's record, whoever owns it (workers, reapers); {} when there is none."""
        return self.retrying(lambda: self.redis.hgetall(job_key(job_id)), "record")

    def record_for(self, job_id: str, owner: str | None) -> dict[str, str]:
        """The job's record as `owner` sees it: {} when there is none, or when it is another
        owner's (a job with an owner is invisible to everyone else)."""
        rec = self.record(job_id)
        return rec if visible(rec, owner) else {}

    def missing(self, job_ids: list[str]) -> list[str]:
        """The ids among `job_ids` with no record (never submitted, or expired)."""

        def check():
            pipe = self.redis.pipeline(transaction=False)
            for j in job_ids:
                pipe.exists(job_key(j))
            return [j for j, n in zip(job_ids, pipe.execute()) if not n]

        return self.retrying(check, "missing")

    def queue_position(self, queue: str, job_id: str) -> int | None:
        return self.retrying(lambda: self.redis.zrank(f"{PREFIX}queued:{queue}", job_id), "queue_position")

    def cancel(self, job_id: str, owner: str | None = None) -> str:
        args = [PREFIX, job_id, self.clock(), self.settings.stream_maxlen, owner or ""]
        return self.retrying(lambda: self._cancel(args=args), "cancel")

    def read_events(self, job_id: str, after: str, block_ms: int | None, count: int = 512) -> list[tuple[str, dict]]:
        def read():
            got = _streams(self.redis.xread({events_key(job_id): after}, count=count, block=block_ms))
            return got[0][1] if got else []

        return self.retrying(read, "read_events")

    def wait_final(self, job_ids: list[str], block_ms: int | None) -> dict[str, dict]:
        """Block until at least one of `job_ids` is final (or block_ms passes); returns the
        final ones' {state, result, error}. Each job's `end` stream gets one entry when it
        becomes final, so this never misses a transition, whenever it is called."""

        def read():
            got = _streams(self.redis.xread({end_key(j): "0-0" for j in job_ids}, count=1, block=block_ms))
            return {key[len(PREFIX) + 4 :]: entries[0][1] for key, entries in got if entries}

        return self.retrying(read, "wait_final")

    # ---- workers ----------------------------------------------------------------------------

    def claim(
        self,
        job_id: str,
        worker_id: str,
        token: str,
        task: str,
        queue: str,
        kwargs: dict,
        *,
        ttl_s: int,
        max_tokens: int,
        submitted_at: float,
    ) -> Claim:
        # The message is stored only if this claim creates the job (a plain Celery client's
        # task): what a reaper queues again should the job lose its worker.
        message = task_message(task, job_id, kwargs, queue, 0, ignore_result=False)
        args = [
            PREFIX,
            job_id,
            worker_id,
            token,
            self.clock(),
            self.settings.stream_maxlen,
            task,
            queue,
            digest(task, kwargs),
            message,
            submitted_at,
            ttl_s,
            max_tokens,
        ]
        out = self.retrying(lambda: self._claim(args=args), "claim")
        if out[0] != "claimed":
            return Claim(out[0], detail=out[1])
        prompt = json.loads(out[4]) if out[4] else None
        return Claim("claimed", int(out[1]), int(out[2]), submitted_at=float(out[3]), prompt_token_ids=prompt)

    def emit_args(
        self,
        job_id: str,
        token: str,
        start: int,
        token_ids: list[int],
        text: str,
        prompt_token_ids: list[int] | None,
        at: float | None = None,
        logprobs: list[dict] | None = None,
        choice: int | None = None,
    ) -> list:
        """ARGV of lua.EMIT: `start` counts in choice `choice`'s output (None: a job of one)."""
        prompt = json.dumps(prompt_token_ids) if prompt_token_ids is not None else ""
        return [
            PREFIX,
            job_id,
            token,
            start,
            len(token_ids),
            json.dumps(token_ids),
            text,
            prompt,
            self.clock() if at is None else at,
            self.settings.stream_maxlen,
            json.dumps(logprobs) if logprobs is not None else "",
            "" if choice is None else str(choice),
        ]

    def finish_args(
        self,
        job_id: str,
        token: str,
        state: str,
        result: dict | None,
        error: str = "",
        finish_reason: str = "",
        text: str = "",
        stop_reason: str | int | None = None,
    ) -> list:
        assert state in FINAL_STATES
        body = json.dumps(result) if result is not None else ""
        return [
            PREFIX,
            job_id,
            token,
            state,
            body,
            error,
            finish_reason,
            self.clock(),
            self.settings.stream_maxlen,
            text,
            json.dumps(stop_reason) if stop_reason is not None else "",  # JSON: a stop string or a token id
        ]

    def append_args(self, job_id: str, token: str, seq: int, event: JobEvent) -> list:
        """ARGV of lua_events.APPEND: the job's `seq`-th appended event (0, 1, ...), of an
        APPENDED kind (tool, prompt, choice_end)."""
        if event.type not in APPENDED:
            raise ValueError(f"only {APPENDED} events are appended; tokens and ends have scripts of their own")
        pairs = [x for kv in event.to_fields().items() for x in kv]
        return [PREFIX, job_id, token, seq, self.settings.stream_maxlen, *pairs]

    def run_scripts(self, calls: list[tuple[str, list]]) -> list[int]:
        """Run ("emit" | "append" | "finish", args) calls in one round trip, in order."""
        scripts = {"emit": self._emit, "append": self._append, "finish": self._finish}

        def run():
            pipe = self.redis.pipeline(transaction=False)
            for name, args in calls:
                scripts[name](args=args, client=pipe)
            return [int(x) for x in pipe.execute()]

        return self.retrying(run, "write events")

    def heartbeat(self, worker_id: str, now: float | None = None) -> None:
        """Renew this worker's lease. One key per worker, whatever the number of its jobs: it
        holds the lease's end on this store's clock (what lua.py's `alive` compares with the
        reader's `now`), and expires by itself in Redis lease_s later, so a dead worker's key
        goes away whatever the clocks say."""
        now = self.clock() if now is None else now
        # "end:" marks the value as a lease's end: an older worker's key holds its beat time,
        # which lease_alive (and lua.py's alive) must not read as an end long past (a rolling
        # upgrade would requeue every job the older workers run).
        lease_end = f"end:{now + self.settings.lease_s!r}"
        self.redis.set(worker_key(worker_id), lease_end, px=int(self.settings.lease_s * 1000))

    def release(self, worker_id: str) -> None:
        """A worker leaving cleanly drops its lease, so that its unfinished jobs move at once."""
        self.redis.delete(worker_key(worker_id), f"{PREFIX}held:{worker_id}")

    def reap(self, now: float | None = None) -> list[str]:
        """Requeue (and queue the message of) the running jobs whose owner's lease expired by
        `now` (None: this store's clock). Two pipelined reads find them, whatever the number of
        running jobs; the script then checks again, atomically, for each one found."""
        r = self.redis
        job_ids = r.zrange(RUNNING, 0, -1)
        if not job_ids:
            return []
        pipe = r.pipeline(transaction=False)
        for j in job_ids:
            pipe.hget(job_key(j), "owner")
        owners = pipe.execute()
        distinct = sorted({o for o in owners if o})
        pipe = r.pipeline(transaction=False)
        for o in distinct:
            pipe.get(worker_key(o))
        now = self.clock() if now is None else now
        dead = {o for o, until in zip(distinct, pipe.execute()) if not lease_alive(until, now)}
        maxlen = self.settings.stream_maxlen
        return [
            j
            for j, o in zip(job_ids, owners)
            if (o in dead or not o) and self._reap(args=[PREFIX, j, now, maxlen]) == "requeued"
        ]

    def orphans(self, every_s: float, now: float | None = None) -> list[str]:
        """Queue again the jobs whose broker message is gone, seen so on two sweeps `every_s`
        apart; returns their ids.

        A pop (the worker's BLMPOP, workers/tasks.py BatchPop, or Kombu's BRPOP) hands a message
        over at most once: a worker SIGKILLed between taking it and claiming the job, or a Redis
        that dies between removing it and replying, loses it.
        The job record still says queued, so it is found here and published again. One worker
        sweeps per period (a lock); a message merely in flight between the list and a live
        worker's claim lasts milliseconds, and a false sighting costs only a duplicate message,
        which the claim turns into a no-op."""
        r = self.redis
        if not r.set(SWEEP_LOCK, "1", nx=True, px=max(1, int(every_s * 1000))):
            return []
        candidates: set[str] = set()
        for key in r.scan_iter(match=f"{PREFIX}queued:*", count=256):
            queued = r.zrange(key, 0, -1)
            if not queued:
                continue
            present: set[str] = set()
            for name in broker_lists(key[len(PREFIX) + 7 :]):
                for raw in r.lrange(name, 0, -1):
                    try:
                        present.add(json.loads(raw)["headers"]["id"])
                    except (ValueError, KeyError, TypeError):
                        continue
            candidates.update(j for j in queued if j not in present)
        if candidates:  # a live worker's prefetched messages are held, not lost
            for key in r.scan_iter(match=f"{PREFIX}held:*", count=256):
                candidates.difference_update(r.smembers(key))
        now = self.clock() if now is None else now
        seen = dict(r.zrange(ORPHANS, 0, -1, withscores=True))
        due = [j for j in candidates if j in seen and seen[j] <= now - every_s]
        pipe = r.pipeline(transaction=False)
        stale = (set(seen) - candidates) | set(due)
        if stale:
            pipe.zrem(ORPHANS, *stale)
        fresh = {j: now for j in candidates - set(seen)}
        if fresh:
            pipe.zadd(ORPHANS, fresh, nx=True)
        pipe.execute()
        return [j for j in due if self._republish(args=[PREFIX, j])]

    def hold(self, worker_id: str, job_ids: list[str]) -> None:
        """Say which jobs' messages this worker has taken from the broker and not yet run
        (Celery prefetches for its idle threads): the orphan sweep leaves them alone while the
        key lives, one lease long."""
        key = f"{PREFIX}held:{worker_id}"
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(key)
        if job_ids:
            pipe.sadd(key, *job_ids)
            pipe.pexpire(key, max(1, int(self.settings.lease_s * 1000)))
        pipe.execute()

    def cancel_requested(self, job_ids: list[str]) -> list[str]:
        if not job_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for j in job_ids:
            pipe.hget(job_key(j), "cancel")
        return [j for j, flag in zip(job_ids, pipe.execute()) if flag == "1"]

    def prefix_tokens(self, job_id: str) -> tuple[list[int], str]:
        """The token ids and text already streamed by earlier attempts, in order."""
        ids, text, _ = self.prefix(job_id)
        return ids, text

    def events(self, job_id: str) -> list[JobEvent]:
        """Every event of the job's stream so far, in order (a resumed tool job reads its calls)."""
        entries = self.retrying(lambda: self.redis.xrange(events_key(job_id)), "events")
        return [JobEvent.from_fields(fields, event_id) for event_id, fields in entries]

    def prefix(self, job_id: str) -> tuple[list[int], str, list[dict] | None]:
        """The token ids, text and logprobs (None where the events carry none) already streamed
        by earlier attempts, in order."""
        return prefix_of(self.events(job_id))


def prefix_of(events: list[JobEvent]) -> tuple[list[int], str, list[dict] | None]:
    """The token ids, content text and logprobs (None where the events carry none) of `events`."""
    ids: list[int] = []
    parts: list[str] = []
    logprobs: list[dict] | None = None
    for ev in events:
        if ev.type == TOKEN:
            ids.extend(ev.token_ids)
            parts.append(ev.text)
            if ev.logprobs:
                logprobs = (logprobs or []) + ev.logprobs
    return ids, "".join(parts), logprobs


def lease_alive(until: str | None, now: float) -> bool:
    """A worker key's value, read at `now`: lua.py's `alive`, in Python. "end:<t>" is the end of
    its lease; any other value is an older worker's key (its beat time), alive while it exists."""
    if until is None:
        return False
    if not until.startswith("end:"):
        return True
    try:
        return float(until[4:]) > now
    except ValueError:
        return False


def visible(rec: dict, owner: str | None) -> bool:
    """May `owner` see this job record? A job without an owner is everyone's."""
    submitter = rec.get("submitter") or ""
    return not submitter or submitter == (owner or "")


def _streams(reply) -> list:
    """XREAD's reply as [(key, entries)], whichever protocol (RESP2 list, RESP3 dict)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return list(reply.items())
    return [(k, v) for k, v in reply]
