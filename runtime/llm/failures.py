"""The engine's failure policy: who fails, with what error, and what is undone so that the
scheduler, the KV pool and the runner agree again. Every failure stays with the requests it
belongs to; the engine serves the rest, with the same tokens.

  - a request still queued past its deadline is rejected ("deadline_exceeded"); one already
    running goes on, and its metrics say whether it missed;
  - a request the scheduler refuses while queued (a queue timeout) fails ("queue_timeout");
  - a newcomer the runner cannot admit (bad data, `StepResult.failed`) fails alone
    ("invalid_request"), aborted in the scheduler before it takes the step's result, so that
    it skips it and its blocks return; the step went on for everyone else;
  - a runner exception inside the step fails exactly the requests of that step's plan
    ("engine_error"): aborted in the scheduler (their KV blocks return) and dropped from the
    runner.

Each function here returns request id -> Failure; the engine ends those requests with it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from schedulers.plan import StepPlan


@dataclass(slots=True, frozen=True)
class Failure:
    message: str
    code: str  # the error_code of the request's output


def rejected_in_queue(plan: StepPlan) -> dict[str, Failure]:
    """The requests the scheduler refused while they were queued."""
    return {rid: Failure(msg, "queue_timeout") for rid, msg in plan.rejected.items()}


def refused_by_runner(scheduler, errors: dict[str, str]) -> dict[str, Failure]:
    """Abort each request the runner refused (`errors`: id -> why). Called before the
    scheduler takes the step's result, so that it skips them and their blocks return."""
    failed = {}
    for rid, why in errors.items():
        scheduler.abort(rid)
        failed[rid] = Failure(f"request {rid!r} failed: {why}", "invalid_request")
    return failed


def step_failed(scheduler, runner, plan: StepPlan, exc: Exception) -> dict[str, Failure]:
    """The runner raised: every request of the plan fails with the error, their blocks go
    back and their runner state is dropped, so scheduler, pool and runner agree again."""
    ids = list(dict.fromkeys([*plan.req_ids, *(n.request_id for n in plan.new_requests)]))
    failure = Failure(f"the engine step failed: {type(exc).__name__}: {exc}", "engine_error")
    for rid in ids:
        scheduler.abort(rid)
    runner.drop_requests(ids)
    return dict.fromkeys(ids, failure)


class QueueDeadlines:
    """The deadlines of requests that may still be queued (monotonic seconds), earliest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []  # (deadline, request id)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def add(self, deadline: float, request_id: str) -> None:
        heapq.heappush(self._heap, (deadline, request_id))

    def next(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[tuple[float, str]]:
        """(deadline, request id) of every deadline passed by `now`; the caller rejects those
        requests that were never scheduled (`missed`)."""
        heap, due = self._heap, []
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap))
        return due


def missed(request_id: str, arrival_time: float, deadline: float, now: float) -> Failure:
    """The error of a request still queued at its deadline."""
    waited = (now - arrival_time) * 1000
    return Failure(
        f"request {request_id!r} waited {waited:.0f} ms in the queue, past its deadline of "
        f"{(deadline - arrival_time) * 1000:.0f} ms, and was not started",
        "deadline_exceeded",
    )
