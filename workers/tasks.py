"""The Celery tasks, callable by name from any Celery client with JSON keyword arguments:

    send_task("tandem.generate", kwargs={"prompt": "Hi", "max_tokens": 32}, queue="llm")
    send_task("tandem.detect", kwargs={"image": "<base64>"}, queue="vision")

The task id is the job id: a JobClient sends its job ids as task ids, and a plain Celery
client's task becomes a job under its task id, with the same leases and stream.
"""

from __future__ import annotations

from functools import partial
from queue import Empty
from time import monotonic

from celery.exceptions import Ignore
from celery.utils.log import get_logger
from celery.worker.consumer import Consumer as CeleryConsumer
from celery.worker.control import inspect_command
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads
from redis.exceptions import ResponseError

from workers.app import BROKER_RETRY, app
from workers.host import current_host
from workers.jobs import Duplicate, JobCancelled, detect_body, generate_body, run_job


def _run(task, name: str, kwargs: dict, body, default_queue: str) -> dict:
    request = task.request
    queue = (request.delivery_info or {}).get("routing_key") or default_queue
    try:
        return run_job(current_host(), name, request.id, queue, kwargs, body)
    except Duplicate:
        # Another delivery owns this job and will store its result under the same task id.
        raise Ignore() from None
    except JobCancelled as exc:
        # To a plain Celery client a cancelled job is a revoked task (its get() raises
        # TaskRevokedError); JobClient's messages ask for no Celery result at all.
        if not request.ignore_result:
            task.backend.mark_as_revoked(request.id, str(exc), request=request)
        raise Ignore() from None


@app.task(name="tandem.generate", bind=True)
def generate(self, **kwargs) -> dict:
    """A prompt (text or token ids) or chat messages, SamplingParams fields, priority,
    deadline_s, and the fair scheduler's tenant and tier (interactive or batch). Returns
    {job_id, text, token_ids, finish_reason, usage, timings}."""
    return _run(self, "tandem.generate", kwargs, generate_body, "llm")


@app.task(name="tandem.detect", bind=True)
def detect(self, **kwargs) -> dict:
    """One image: base64 bytes (`image`), an allowed `url`, or a `path` under
    TANDEM_ALLOWED_ROOTS. Returns the `tandem detect` record."""
    return _run(self, "tandem.detect", kwargs, detect_body, "vision")


@inspect_command(name="tandem_stats")
def tandem_stats(state, **_) -> dict:
    """`app.control.broadcast("tandem_stats", reply=True)`: this worker's jobs, memory and
    Runtime statistics (KV blocks in use, queue depths)."""
    from workers.host import host_stats

    return host_stats()


@inspect_command(name="tandem_fault", args=[("reason", str)])
def tandem_fault(state, reason: str = "fault drill", **_) -> dict:
    """Break this worker's Runtime as an error its loop cannot survive would: the drill for what a
    worker does then (it leaves with host.EXIT_RUNTIME_BROKEN and its jobs run elsewhere). Only
    on a worker started with TANDEM_ALLOW_FAULTS=1; any other refuses."""
    import os

    from workers.host import current_host

    if os.environ.get("TANDEM_ALLOW_FAULTS") != "1":
        return {"error": "this worker allows no fault drills (TANDEM_ALLOW_FAULTS=1)"}
    current_host().runtime.fail_loop(reason)
    return {"ok": True}


class Consumer(CeleryConsumer):
    """Celery's consumer (app.conf.worker_consumer), retrying a broker connection within a second
    of Redis coming back (app.BROKER_RETRY) where Celery's own waits up to 30 s. Here, with the
    tasks, because only a worker imports this module: clients of workers.app never pay for it."""

    def ensure_connected(self, conn):
        # Celery calls conn.ensure_connection(errback, max_retries, callback=...) and leaves
        # the waits to kombu's defaults; the retry count and callbacks stay Celery's.
        conn.ensure_connection = partial(conn.ensure_connection, **BROKER_RETRY)
        # Before the connection is made: kombu creates the first channel as it connects.
        batch_pops(conn.transport)
        return super().ensure_connected(conn)


# The most messages one pop takes (below that, the consumer's free prefetch credit decides).
MAX_POP = 64
log = get_logger(__name__)


class BatchPop:
    """A mixin for Kombu's Redis channel: one BLMPOP takes every message waiting on the first
    non-empty list, up to the consumer's free prefetch credit, where Kombu's BRPOP takes one.

    Why: every pop is a write, and Redis with `appendfsync always` (how jobs stay durable)
    syncs its append-only file before it answers. A pop and its fsync took 4-5 ms on the
    development machine's disk, one after another: a flood of 40 jobs took the worker 150 ms to
    take off the queue, and a light tenant's chat queued behind it waited all of that before
    the engine, whose fair scheduler would have served it at once, ever saw it
    (BENCHMARKS.md, issue 31). One pop of many costs one fsync. Beside a backlog the same holds
    the other way: popped one at a time, batch jobs kept arriving, and their threads claiming
    and tokenizing, while the chats sent after them waited for their first token (on SmolLM2,
    the chats' TTFT 1.92-2.86x idle with single pops, 1.32-1.76x with batched ones).

    Same order as BRPOP: lists in Kombu's priority order, each list's oldest message first.
    A Redis without BLMPOP (before 7.0) answers "unknown command": the channel goes back to
    Kombu's BRPOP for good. A global key prefix does too (Kombu prefixes BRPOP's keys only)."""

    _blmpop = True
    _pop_sent: str | None = None

    def _brpop_start(self, timeout=None):
        count = self._pop_count()
        self._pop_sent = None  # what the reply will answer (a pop sent and lost to a disconnect too)
        if not self._blmpop or count <= 1 or self.global_keyprefix:
            return super()._brpop_start(timeout)
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        keys = [self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues]
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()
        self._pop_sent = "BLMPOP"
        timeout = self.brpop_timeout if timeout is None else timeout
        self.client.connection.send_command("BLMPOP", timeout or 0, len(keys), *keys, "RIGHT", "COUNT", count)

    def _pop_count(self) -> int:
        free = self.qos.can_consume_max_estimate()  # None: no prefetch limit
        return MAX_POP if free is None else min(MAX_POP, free)

    def _brpop_read(self, **options):
        if self._pop_sent != "BLMPOP":
            return super()._brpop_read(**options)
        self._pop_sent = None
        try:
            try:
                reply = self.client.parse_response(self.client.connection, "BLMPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # as Kombu does: the next poll reconnects
                raise
            except ResponseError as exc:
                if "unknown command" not in str(exc).lower():
                    raise
                log.warning("redis has no BLMPOP (before 7.0): taking one message a round trip (%s)", exc)
                self._blmpop = False
                raise Empty() from None
            if not reply:
                raise Empty()
            dest, items = reply
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            for item in items:
                try:
                    message = loads(bytes_to_str(item))
                except ValueError:
                    # Out of Redis already, and no job: JobClient and Celery write JSON. Dropped
                    # alone, so that the messages popped with it still reach their jobs.
                    log.error("dropped a message on %s that is not JSON: %.200r", dest, item)
                    continue
                self.connection._deliver(message, dest)
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()


def batch_pops(transport) -> None:
    """Give a Kombu Redis transport (plain or Sentinel) BatchPop channels; others are left as they are."""
    from kombu.transport.redis import Channel as RedisChannel

    channel = getattr(transport, "Channel", None)
    if isinstance(channel, type) and issubclass(channel, RedisChannel) and not issubclass(channel, BatchPop):
        transport.Channel = type(f"BatchPop{channel.__name__}", (BatchPop, channel), {})
