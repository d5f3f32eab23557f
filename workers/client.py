"""JobClient: the LLM text-job queue API over Redis and Celery.

    from workers import JobClient
    jobs = JobClient()                                   # TANDEM_REDIS_URL or redis://127.0.0.1:6379/0
    job_id = jobs.submit("Tell me a joke", max_tokens=64, temperature=0.7)
    for event in jobs.stream(job_id):                    # token events, then done/failed/cancelled
        print(event["text"], end="", flush=True)
    print(jobs.result(job_id)["usage"])

A job id the caller chooses makes submission idempotent. Records, results and streams expire
`ttl_s` after the job ends (TANDEM_JOB_TTL_S, one day by default).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator

from workers.events import JobEvent
from workers.jobspec import parse_detect, parse_generate, queue_priority
from workers.settings import JobSettings, model_queue
from workers.store import FINAL_STATES, JobStore, check_job_id

BLOCK_MS = 2000


class JobError(RuntimeError):
    """The job failed; the message is the job's error. A job refused by a FieldError keeps the
    error's data: `field` (the bad field) and `code` (runtime/errors.py); None otherwise."""

    def __init__(self, job_id: str, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.field = field
        self.code = code


class JobCancelledError(JobError):
    """The job was cancelled."""


class JobNotFoundError(KeyError):
    """No such job (never submitted, or its record expired)."""


def _floats(rec: dict, *names: str) -> dict[str, float]:
    return {n: float(rec[n]) for n in names if rec.get(n)}


class JobClient:
    def __init__(
        self, redis_url: str | None = None, *, ttl_s: int | None = None, settings: JobSettings | None = None
    ) -> None:
        self.settings = settings or JobSettings.from_env(redis_url=redis_url, job_ttl_s=ttl_s)
        self.store = JobStore(self.settings)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> JobClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- submit ---------------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | list[int] | None = None,
        messages: list[dict] | None = None,
        *,
        priority: int = 0,
        deadline_s: float | None = None,
        job_id: str | None = None,
        queue: str | None = None,
        model: str | None = None,
        ttl_s: int | None = None,
        owner: str | None = None,
        tenant: str | None = None,
        tier: str | None = None,
        **sampling,
    ) -> str:
        """Queue a generation; returns its job id once the job is recorded and its Celery
        message queued, in one atomic step (durable with Redis's appendfsync always). Bad
        fields raise ValueError here (a FieldError naming the field). `model`: the served name
        of the model to run it (its queue, settings.model_queue); neither model nor queue: the
        plain `llm` queue, which any LLM worker runs on its model. With `messages`, OpenAI's
        `tools`, `tool_choice` and `parallel_tool_calls` (and `tool_call_parser`) make a tool
        job: its stream has tool_call / tool_args events, its result `content` and `tool_calls`.
        `n` (and `best_of`): one job of n choices from one prefill; its token events name their
        `choice`, each choice ends with a choice_end event, its result lists `choices` (the
        top-level text and tokens are choice 0's; usage counts the prompt once).
        `prompt_logprobs`: a prompt event (before any token) and the result's `prompt_logprobs`
        hold one entry per prompt token, the first with logprob null. `tenant` (default: the
        anonymous tenant, jobspec.DEFAULT_TENANT) and `tier` ("interactive" or "batch"): the
        engine's fair shares under --policy fair; a Celery client is trusted to name its own."""
        if model is not None and queue is not None:
            raise ValueError(f"model: give a model or a queue, not both (got {model!r} and {queue!r})")
        queue = model_queue(model) if model is not None else (queue or "llm")
        kwargs = {"prompt": prompt, "messages": messages, "priority": priority or None, "deadline_s": deadline_s}
        kwargs.update(tenant=tenant, tier=tier)
        kwargs = {k: v for k, v in {**kwargs, **sampling}.items() if v is not None}
        spec = parse_generate(kwargs)
        max_tokens = spec.params.max_tokens if isinstance(spec.params.max_tokens, int) else 0
        waits_as = queue_priority(priority, spec.tier)  # a batch job waits behind interactive ones
        return self._submit("tandem.generate", kwargs, job_id, queue, ttl_s, max_tokens, waits_as, owner)

    def submit_detect(
        self,
        *,
        image: str | None = None,
        url: str | None = None,
        path: str | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
        job_id: str | None = None,
        queue: str = "vision",
        ttl_s: int | None = None,
        owner: str | None = None,
    ) -> str:
        """Queue a detection on one image (base64 bytes, an allowed URL, or a path under the
        worker's TANDEM_ALLOWED_ROOTS); its result is the `tandem detect` record."""
        kwargs = {"image": image, "url": url, "path": path, "priority": priority or None, "deadline_s": deadline_s}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        parse_detect(kwargs)
        return self._submit("tandem.detect", kwargs, job_id, queue, ttl_s, 0, priority, owner)

    def _submit(
        self,
        task: str,
        kwargs: dict,
        job_id: str | None,
        queue: str,
        ttl_s: int | None,
        max_tokens: int,
        priority: int,
        owner: str | None = None,
    ) -> str:
        job_id = check_job_id(job_id) if job_id is not None else uuid.uuid4().hex
        ttl = ttl_s if ttl_s is not None else self.settings.job_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ValueError(f"ttl_s must be an integer >= 1, got {ttl!r}")
        if not isinstance(queue, str) or not queue:
            raise ValueError(f"queue must be a non-empty string, got {queue!r}")
        self.store.submit(job_id, task, queue, kwargs, ttl_s=ttl, max_tokens=max_tokens, priority=priority, owner=owner)
        return job_id

    # ---- read -----------------------------------------------------------------------------------

    def _record(self, job_id: str, owner: str | None = None) -> dict:
        rec = self.store.record_for(job_id, owner)
        if not rec:
            raise JobNotFoundError(job_id)
        return rec

    def status(self, job_id: str, owner: str | None = None) -> dict:
        """{job_id, state, queue, position (queued: jobs ahead on its queue), progress
        (tokens made / max_tokens), attempts, worker, error, timings (epoch seconds)}."""
        rec = self._record(job_id, owner)
        state = rec["state"]
        out = {
            "job_id": job_id,
            "state": state,
            "queue": rec.get("queue"),
            "attempts": int(rec.get("attempt") or 0),
            "progress": {"tokens": int(rec.get("num_tokens") or 0), "max_tokens": int(rec.get("max_tokens") or 0)},
            "worker": rec.get("owner") or None,
            "error": rec.get("error") or None,
            "timings": _floats(rec, "submitted_at", "started_at", "first_token_at", "finished_at"),
        }
        if state == "queued":
            out["position"] = self.store.queue_position(rec["queue"], job_id)
        if state == "running" and rec.get("cancel") == "1":
            out["cancelling"] = True
        return out

    def result(self, job_id: str, timeout: float | None = None, owner: str | None = None) -> dict:
        """The task's result dict once the job is done. Raises JobError (failed),
        JobCancelledError, JobNotFoundError (none, or another owner's) or TimeoutError."""
        self._record(job_id, owner)
        final = self._wait([job_id], timeout).get(job_id)
        if final is None:
            raise TimeoutError(f"job {job_id} did not finish within {timeout} s")
        if final["state"] == "done":
            return json.loads(final["result"])
        if final["state"] == "cancelled":
            raise JobCancelledError(job_id, f"job {job_id} was cancelled")
        detail = _error_detail(final)
        raise JobError(job_id, final.get("error") or f"job {job_id} failed", detail.get("field"), detail.get("code"))

    def wait(self, job_ids: Iterable[str], timeout: float | None = None) -> set[str]:
        """Block until every job is final or `timeout` passes; returns the final ones."""
        return set(self._wait(job_ids, timeout))

    def _wait(self, job_ids: Iterable[str], timeout: float | None) -> dict[str, dict]:
        pending = set(job_ids)
        missing = self.store.missing(sorted(pending))
        if missing:  # rather than waiting forever
            raise JobNotFoundError(missing[0])
        done: dict[str, dict] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        block_ms: int | None = None  # the first look never blocks
        while pending:
            got = self.store.wait_final(sorted(pending), block_ms=block_ms)
            done.update(got)
            pending.difference_update(got)
            block_ms = _block_ms(deadline)
            if pending and block_ms <= 0:
                break
        return done

    def stream(
        self, job_id: str, after: str | None = None, timeout: float | None = None, owner: str | None = None
    ) -> Iterator[dict]:
        """Events of the job as they are made: {"id", "type", "token_ids", "text", ...} with
        type "token", "restarted" (a worker died; the job goes on from token `resumed_from`),
        and last "done", "failed" or "cancelled". Pass the last `id` you saw as `after` to
        resume: nothing is lost or repeated. A finished job's stream replays in full."""
        self._record(job_id, owner)
        last = after or "0-0"
        deadline = None if timeout is None else time.monotonic() + timeout
        block_ms: int | None = None  # the first read never blocks: a finished job needs no wait
        while True:
            entries = self.store.read_events(job_id, last, block_ms=block_ms)
            for event_id, fields in entries:
                event = JobEvent.from_fields(fields, event_id).to_dict()
                last = event_id
                yield event
                if event["type"] in FINAL_STATES:
                    return
            if not entries and self._record(job_id, owner)["state"] in FINAL_STATES:
                if not self.store.read_events(job_id, last, block_ms=None):
                    return  # resumed after the final event: nothing more will come
            block_ms = _block_ms(deadline)
            if block_ms <= 0:
                raise TimeoutError(f"no final event from job {job_id} within {timeout} s")

    def cancel(self, job_id: str, owner: str | None = None) -> bool:
        """Cancel a job: a queued one never runs, a running one stops within one engine step
        (its KV blocks freed). True if it is (or is becoming) cancelled, False if it had
        already ended."""
        outcome = self.store.cancel(job_id, owner)
        if outcome == "missing":
            raise JobNotFoundError(job_id)
        return outcome in ("cancelled", "cancelling")


def _error_detail(final: dict) -> dict:
    """A failed job's FieldError data ({field, code, message}), which the worker writes as the
    final record's result (workers/jobs.py); {} for any other failure."""
    try:
        detail = json.loads(final.get("result") or "null")
    except ValueError:
        return {}
    err = detail.get("error") if isinstance(detail, dict) else None
    return err if isinstance(err, dict) else {}


def _block_ms(deadline: float | None) -> int:
    """How long the next blocking read may wait: up to BLOCK_MS, less near the deadline (0: it
    passed). Short blocks keep each read under the socket timeout and retry across restarts."""
    if deadline is None:
        return BLOCK_MS
    left = deadline - time.monotonic()
    return 0 if left <= 0 else max(1, min(BLOCK_MS, int(left * 1000)))
