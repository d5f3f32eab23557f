"""WorkerHost: what one worker process holds. Its Runtime (loaded once, after the worker
starts), its lease in Redis, the jobs it runs, and three threads:

    tandem-lease    renews this worker's lease every heartbeat_s; requeues the jobs of workers
                    whose lease expired; queues again the jobs whose message the broker lost;
                    polls cancel flags of its own jobs (pub/sub backup)
    tandem-cancel   pub/sub: a cancelled running job stops within one engine step
    tandem-events   the EventWriter (writer.py)

A lease is one key per worker with a TTL of lease_s, not one per job, so a worker running
a thousand jobs renews one key. A job names its owner; the job is the owner's for as long as
the owner's key lives, however long the job runs. SIGKILL, OOM or power loss stop the
heartbeat: within lease_s + heartbeat_s some other worker's lease thread requeues the job.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from runtime.heap import freeze_startup_heap
from runtime.metrics import runtime_payload
from workers import fleet_metrics
from workers.retry import Backoff, retry
from workers.settings import JobSettings
from workers.store import CANCEL_CHANNEL, Claim, JobStore
from workers.writer import EventWriter

log = logging.getLogger("tandem.jobs")


class Fenced(Exception):
    """This worker no longer holds the job (its lease lapsed and the job moved on)."""


class Cancelled(Exception):
    """The job was cancelled while this worker ran it."""


class Abandoned(Exception):
    """This worker's Runtime broke under the job: the job is not the job's fault, so no final
    state is written; it runs again elsewhere once this worker's lease is gone."""


EXIT_RUNTIME_BROKEN = 70  # EX_SOFTWARE: a supervisor restarts the worker


class ActiveJob:
    """One job this worker runs: its claim and whatever runs it in the Runtime."""

    __slots__ = (
        "job_id",
        "token",
        "attempt",
        "resumed_from",
        "submitted_at",
        "claimed_at",
        "prompt_token_ids",
        "queue",
        "work",
        "cancel_requested",
        "fenced",
        "_lock",
    )

    def __init__(self, job_id: str, token: str, claim: Claim) -> None:
        self.job_id = job_id
        self.token = token
        self.attempt = claim.attempt
        self.resumed_from = claim.num_tokens  # tokens streamed by earlier attempts
        self.submitted_at = claim.submitted_at
        self.claimed_at = time.time()
        self.prompt_token_ids = claim.prompt_token_ids  # the first attempt's, for a resumed one
        self.queue = ""  # the queue its message came on (`llm.NAME` names the model)
        self.work: Any = None  # a GenerationHandle or a Future
        self.cancel_requested = False
        self.fenced = False
        self._lock = threading.Lock()

    def attach(self, work: Any) -> None:
        with self._lock:
            self.work = work
            stop = self.cancel_requested or self.fenced
        if stop:
            work.cancel()

    def request_cancel(self) -> None:
        with self._lock:
            self.cancel_requested = True
            work = self.work
        if work is not None:
            work.cancel()

    def on_fenced(self) -> None:
        with self._lock:
            self.fenced = True
            work = self.work
        if work is not None:
            work.cancel()


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_model_name(model: str | None, env: dict | None = None) -> str:
    """The name clients ask for: TANDEM_SERVED_MODEL_NAME if set, else the model file's or
    folder's name (the default model's: SmolLM2-135M-Instruct)."""
    env = os.environ if env is None else env
    if env.get("TANDEM_SERVED_MODEL_NAME"):
        return env["TANDEM_SERVED_MODEL_NAME"]
    if not model:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def runtime_config(queues: list[str] | None, env: dict | None = None) -> dict:
    """Runtime keyword arguments: TANDEM_WORKER_RUNTIME (JSON {"llm": {...}|null, "vision":
    {...}|null, "profile": bool}) if set, else the embedded defaults for the queues this
    worker consumes."""
    env = os.environ if env is None else env
    raw = env.get("TANDEM_WORKER_RUNTIME")
    if raw:
        try:
            config = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"TANDEM_WORKER_RUNTIME must be JSON, got {raw[:80]!r}: {exc}") from None
        if not isinstance(config, dict) or set(config) - {"llm", "vision", "profile"}:
            raise ValueError(
                'TANDEM_WORKER_RUNTIME must be {"llm": {...} or null, "vision": {...} or null, "profile": bool}'
            )
        return {"llm": config.get("llm"), "vision": config.get("vision"), "profile": bool(config.get("profile", True))}
    queues = queues or ["llm", "vision"]
    return {"llm": {} if "llm" in queues else None, "vision": {} if "vision" in queues else None}


class WorkerHost:
    """`clock`: its store's (JobStore's `clock`); the lease thread's turns are `beat(now)`, which
    a test may call itself with a fake clock and no thread (tests/test_leases.py)."""

    def __init__(
        self,
        settings: JobSettings,
        runtime_factory: Callable[[], Any],
        name: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.store = JobStore(settings, clock=clock)
        self.worker_id = f"{name or socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._factory = runtime_factory
        self.runtime: Any = None
        self.model_name: str | None = None  # the served name of the Runtime's LLM, once loaded
        self.active: dict[str, ActiveJob | None] = {}  # None: reserved, not yet claimed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.writer: EventWriter | None = None
        self.num_republished = 0
        self.outcomes: Counter[str] = Counter()  # final states of the jobs this worker finished
        # Since when Redis has answered this worker's beats without a break (None: it has not).
        # The host counts from its creation: Redis was there as far as it knows.
        self._connected_since: float | None = self.store.clock()

    # ---- life ---------------------------------------------------------------------------------

    def start(self) -> WorkerHost:
        # The model loads whatever Redis does meanwhile: the lease used to be written first, so
        # a Redis restart at the start held the load back until Redis answered. No job comes
        # before this returns (Celery's consumer starts after worker_init), so the lease can wait
        # for the end of the load; the lease thread sweeps for dead workers' jobs meanwhile.
        self._spawn(self._lease_loop, "tandem-lease")
        t0 = time.monotonic()
        self.runtime = self._factory()
        llm = getattr(self.runtime, "llm", None)
        if llm is not None:
            self.model_name = served_model_name(llm.config.model)
        # The precision the model runs at, which a .gguf file's default decides (as shipped).
        precision = f" ({llm.dtype}, weights {llm.quantization})" if llm is not None else ""
        log.info("worker %s: runtime ready in %.1f s%s", self.worker_id, time.monotonic() - t0, precision)
        self.writer = EventWriter(self.store)
        self._spawn(self._cancel_loop, "tandem-cancel")
        self._register()
        return self

    def _register(self) -> None:
        """The lease, then the payload `tandem serve` counts as a live worker (it learns this
        worker's model at once), tried again every 0.5 s at most for as long as Redis is away.
        A worker that gave up here (a failed write raised out of worker_init) served on without
        an event writer, and every job it took failed; one that waits is registered, and its
        consumer started, within half a second of Redis coming back."""

        def register() -> None:
            self.store.heartbeat(self.worker_id)
            self._publish_metrics()

        def on_retry(exc: BaseException) -> None:
            if not waited:
                log.warning("worker %s: Redis unavailable (%s); registering once it is back", self.worker_id, exc)
            waited.append(exc)

        waited: list[BaseException] = []
        retry(register, Backoff(0.02, until=math.inf), (RedisConnectionError, RedisTimeoutError), on_retry)
        if waited:
            log.warning("worker %s: registered after %d tries", self.worker_id, len(waited) + 1)

    def stop(self) -> None:
        """After Celery's warm shutdown: every task has returned."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self.writer is not None:
            self.writer.close()
        try:
            fleet_metrics.withdraw(self.store.redis, self.worker_id)
            if not self.active:
                self.store.release(self.worker_id)  # nothing left: no need to wait out the lease
        except Exception:  # noqa: BLE001 - Redis gone: the lease expires by itself
            pass
        if self.runtime is not None:
            self.runtime.close(drain=False, timeout=10)
        self.store.close()

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    # ---- jobs ---------------------------------------------------------------------------------

    def reserve(self, job_id: str) -> bool:
        """Hold `job_id` for one delivery on this worker (False: another delivery has it)."""
        with self._lock:
            if job_id in self.active:
                return False
            self.active[job_id] = None
            return True

    def activate(self, job: ActiveJob) -> None:
        with self._lock:
            self.active[job.job_id] = job

    def release_job(self, job_id: str) -> None:
        with self._lock:
            self.active.pop(job_id, None)

    def _running_jobs(self) -> dict[str, ActiveJob]:
        with self._lock:
            return {j: job for j, job in self.active.items() if job is not None}

    def count(self, state: str) -> None:
        with self._lock:
            self.outcomes[state] += 1

    def stats(self) -> dict:
        with self._lock:
            out = {
                "worker_id": self.worker_id,
                "active_jobs": len(self.active),
                "jobs": dict(self.outcomes),
                "republished": self.num_republished,
                "gc_frozen_objects": gc.get_freeze_count(),  # runtime/heap.py
            }
        try:
            import resource

            out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            with open(f"/proc/{os.getpid()}/statm") as f:
                out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, ImportError):
            pass
        if self.runtime is not None:
            out["runtime"] = self.runtime.stats()
        return out

    # ---- the lease thread ---------------------------------------------------------------------

    def runtime_broken(self) -> str | None:
        rt = self.runtime
        return getattr(rt, "broken", None) if rt is not None else None

    def _leave_broken(self, reason: str) -> None:
        """The Runtime broke: stop taking jobs and leave with EXIT_RUNTIME_BROKEN, so that a
        supervisor starts a fresh worker. The lease is dropped first, so that the jobs this
        worker held are queued again at once by the other workers' reapers (the usual lease
        rules), and the messages it had prefetched by their orphan sweeps."""
        log.error(
            "worker %s: its runtime broke (%s); leaving with exit code %d", self.worker_id, reason, EXIT_RUNTIME_BROKEN
        )
        self._stop.set()
        try:
            fleet_metrics.withdraw(self.store.redis, self.worker_id)
            self.store.release(self.worker_id)
        except Exception:  # noqa: BLE001 - Redis away: the lease expires by itself
            pass
        logging.shutdown()
        # Not Celery's warm shutdown: that waits for every task, and a broken Runtime may never
        # answer them. Nothing here is worth saving: every write is fenced by the claim.
        os._exit(EXIT_RUNTIME_BROKEN)

    def _lease_loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            broken = self.runtime_broken()
            if broken is not None:
                self._leave_broken(broken)
                return
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - keep beating through a Redis restart
                if self._connected_since is not None:
                    log.warning("worker %s: lease renewal failed (%s); retrying", self.worker_id, exc)
                self.lost_redis()

    def beat(self, now: float | None = None) -> None:
        """One turn of the lease thread, at `now` (None: the store's clock): renew this worker's
        lease and its held messages, publish its metrics, requeue the jobs of workers whose lease
        expired, queue again the jobs whose broker message is gone, and pass on cancel flags.
        Raises what Redis raises; the next turn tries again."""
        store = self.store
        now = store.clock() if now is None else now
        store.heartbeat(self.worker_id, now)
        store.hold(self.worker_id, _reserved_ids())
        self._publish_metrics()
        if self._connected_since is None:
            self._connected_since = now
        # Right after Redis comes back, leases that expired during the outage belong to live
        # workers that have not beaten yet: reap only after a full lease period.
        if now - self._connected_since >= self.settings.lease_s:
            self._note(store.reap(now), "its worker's lease expired")
        self._note(store.orphans(2 * self.settings.heartbeat_s, now), "the broker lost its message")
        jobs = self._running_jobs()
        for job_id in store.cancel_requested(list(jobs)):
            jobs[job_id].request_cancel()

    def lost_redis(self) -> None:
        """What the lease thread does when a turn fails: the reaping waits a full lease period
        again once Redis answers."""
        self._connected_since = None

    def metrics_payload(self) -> dict | None:
        """What `tandem serve` scrapes for this worker (workers/fleet_metrics.py): its model, what it
        serves, and its Runtime's metrics."""
        rt = self.runtime
        if rt is None:
            return None
        return {**runtime_payload(rt, self.model_name), "worker": self.worker_id}

    def _publish_metrics(self) -> None:
        payload = self.metrics_payload()
        if payload is not None:  # kept a little past the lease: a scrape never misses a live worker
            fleet_metrics.publish(
                self.store.redis, self.worker_id, payload, self.settings.lease_s + self.settings.heartbeat_s
            )

    def _note(self, job_ids: list[str], why: str) -> None:
        for job_id in job_ids:
            self.num_republished += 1
            log.warning("worker %s: job %s queued again, first in line: %s", self.worker_id, job_id, why)

    # ---- the cancel thread --------------------------------------------------------------------

    def _cancel_loop(self) -> None:
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = self.store.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(CANCEL_CHANNEL)
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg is not None:
                        job = self._running_jobs().get(msg["data"])
                        if job is not None:
                            job.request_cancel()
            except Exception:  # noqa: BLE001 - Redis restarting: subscribe again (the lease thread polls meanwhile)
                self._stop.wait(0.5)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # noqa: BLE001
                        pass


def _reserved_ids() -> list[str]:
    """Ids of the task messages this Celery worker has taken and not finished (prefetched
    ones included); empty outside a Celery worker."""
    try:
        from celery.worker import state
    except ImportError:  # pragma: no cover - celery is a dependency
        return []
    # `requests` is a dict (reserved and running, by id): copying its keys is one atomic step,
    # where iterating the WeakSet `reserved_requests` can fail while the consumer adds to it.
    return list(state.requests)


# ---- the process's host ---------------------------------------------------------------------

_HOST: WorkerHost | None = None
_HOST_LOCK = threading.Lock()


def start_host(app, queues: list[str] | None, name: str = "") -> WorkerHost:
    """Build this process's host and load its Runtime (once; later calls return it)."""
    global _HOST
    with _HOST_LOCK:
        if _HOST is None:
            settings = JobSettings.from_env()
            config = runtime_config(queues)

            def factory():
                from runtime.runtime import Runtime

                return Runtime(**config)

            _HOST = WorkerHost(settings, factory, name=name)
            _HOST.start()
            freeze_startup_heap()  # the model and imports out of the collector's full passes
        return _HOST


def current_host() -> WorkerHost:
    host = _HOST
    if host is None:
        raise RuntimeError("no WorkerHost in this process: tandem tasks run in a `tandem worker` process")
    return host


def host_stats() -> dict:
    """This process's host statistics, or {} where none is running (a worker still starting)."""
    host = _HOST
    return host.stats() if host is not None else {}


def stop_host() -> None:
    global _HOST
    with _HOST_LOCK:
        host, _HOST = _HOST, None
    if host is not None:
        host.stop()
