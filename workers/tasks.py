"""The Celery tasks, callable by name from any Celery client with JSON keyword arguments:

    send_task("tandem.generate", kwargs={"prompt": "Hi", "max_tokens": 32}, queue="llm")
    send_task("tandem.detect", kwargs={"image": "<base64>"}, queue="vision")

The task id is the job id: a JobClient sends its job ids as task ids, and a plain Celery
client's task becomes a job under its task id, with the same leases and stream.
"""

from __future__ import annotations

from functools import partial

from celery.exceptions import Ignore
from celery.worker.consumer import Consumer as CeleryConsumer
from celery.worker.control import inspect_command

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
        return super().ensure_connected(conn)
