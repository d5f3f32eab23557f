"""EventWriter: one thread per worker writes every job's stream events and final results.

Task threads hand it what they have and go back to their handles; the writer takes all that
is queued, merges consecutive token events of one job, and runs the lot in one pipelined round
trip. Why: a round trip per token per job would cost each of the running jobs a socket write
per engine step, all competing for the GIL with the engine's own thread; batched, a step of
16 jobs costs one.

Order per job is kept (a job's finish is written after its tokens and tool events). Every call is idempotent
(keyed by token index, or by the claim's token for a finish), so a batch retried after a lost
reply from Redis writes nothing twice.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from workers.retry import Backoff
from workers.store import JobStore

log = logging.getLogger("tandem.jobs")
MAX_BATCH = 512


@dataclass(slots=True)
class _Emit:
    job: object  # host.ActiveJob: .job_id, .token, .on_fenced()
    start: int
    token_ids: list[int]
    text: str
    prompt_token_ids: list[int] | None
    at: float  # when the tokens came (time.time()), not when they are written
    logprobs: list[dict] | None = None  # aligned with token_ids, when the job asked for them
    choice: int | None = None  # n > 1: the choice; `start` counts in its output


@dataclass(slots=True)
class _Append:
    job: object
    seq: int  # the job's seq-th appended event (lua_events.APPEND)
    event: object  # events.JobEvent, a tool kind


@dataclass(slots=True)
class _Finish:
    job: object
    args: list
    done: Future = field(default_factory=Future)


class EventWriter:
    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tandem-events", daemon=True)
        self._thread.start()

    def emit(
        self,
        job,
        start: int,
        token_ids: list[int],
        text: str,
        prompt_token_ids: list[int] | None = None,
        logprobs: list[dict] | None = None,
        choice: int | None = None,
    ) -> None:
        lp = list(logprobs) if logprobs is not None else None
        self._queue.put(_Emit(job, start, list(token_ids), text, prompt_token_ids, time.time(), lp, choice))

    def append(self, job, seq: int, event) -> None:
        """Write an appended JobEvent (tool, prompt, choice_end) after the job's tokens queued so far."""
        self._queue.put(_Append(job, seq, event))

    def finish(
        self,
        job,
        state: str,
        result: dict | None,
        error: str = "",
        finish_reason: str = "",
        text: str = "",
        stop_reason: str | int | None = None,
    ) -> Future:
        """Write the job's final state (and trailing `text` with no tokens, if any); the future
        says whether it was written (False: this worker no longer holds the job)."""
        args = self.store.finish_args(job.job_id, job.token, state, result, error, finish_reason, text, stop_reason)
        item = _Finish(job, args)
        self._queue.put(item)
        return item.done

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
            self._write(_merge(batch))

    def _write(self, batch: list) -> None:
        calls = []
        for item in batch:
            if isinstance(item, _Emit):
                args = self.store.emit_args(
                    item.job.job_id,
                    item.job.token,
                    item.start,
                    item.token_ids,
                    item.text,
                    item.prompt_token_ids,
                    item.at,
                    item.logprobs,
                    item.choice,
                )
                calls.append(("emit", args))
            elif isinstance(item, _Append):
                calls.append(("append", self.store.append_args(item.job.job_id, item.job.token, item.seq, item.event)))
            else:
                calls.append(("finish", item.args))
        # Keep trying however long Redis is away: giving up would leave the job claimed by a live
        # worker (its lease renewed) that no longer runs it. A refused connection or a Redis
        # loading its AOF answers at once, so the tries wait between them, or they would spin.
        backoff, tries = Backoff(0.05, budget_s=math.inf), 0
        while True:
            try:
                results = self.store.run_scripts(calls)
                break
            except (RedisConnectionError, RedisTimeoutError) as exc:
                tries += 1
                if tries == 1 or tries % 20 == 0:
                    log.warning("redis unavailable for %d job writes (%s); still retrying", len(calls), exc)
                time.sleep(backoff.next_s())
            except Exception as exc:  # noqa: BLE001 - a script error: fail these jobs, not the writer
                log.error("could not write %d job events: %s", len(calls), exc)
                for item in batch:
                    if isinstance(item, _Finish):
                        item.done.set_exception(exc)
                    else:
                        item.job.on_fenced()
                return
        for item, res in zip(batch, results):
            if isinstance(item, _Finish):
                item.done.set_result(res == 1)
            elif res != 1:
                item.job.on_fenced()


def _merge(batch: list) -> list:
    """Join consecutive token events of one job's choice (what one stream event carries grows,
    the number of events and scripts shrinks). Another choice's tokens between them do not
    stop the join (their order across choices means nothing); any other event of the job does."""
    out: list = []
    last: dict[tuple[str, int | None], _Emit] = {}
    for item in batch:
        if isinstance(item, _Emit):
            key = (item.job.job_id, item.choice)
            prev = last.get(key)
            mergeable = prev is not None and prev.job is item.job and prev.start + len(prev.token_ids) == item.start
            if mergeable and (prev.logprobs is None) == (item.logprobs is None):
                prev.token_ids.extend(item.token_ids)
                prev.text += item.text
                if prev.logprobs is not None:
                    prev.logprobs.extend(item.logprobs)
                continue
            last[key] = item
        else:
            for key in [k for k in last if k[0] == item.job.job_id]:
                del last[key]
        out.append(item)
    return out
