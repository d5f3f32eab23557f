"""Request-level dynamic batching for fixed-cost inputs (images, frames), Triton-style.

A released batch runs to completion in one forward pass, so `update` finishes every member.
The payloads are opaque here (the vision runner knows they are images); the plan is a `Batch`.
"""

from __future__ import annotations

from typing import Any

from schedulers.batch_queue import BatchQueue, QueuedItem
from schedulers.config import DynamicBatchConfig
from schedulers.interface import SchedulerStats
from schedulers.plan import Batch


class DynamicBatchScheduler:
    def __init__(self, config: DynamicBatchConfig | None = None) -> None:
        self.config = config or DynamicBatchConfig()
        self.queue = BatchQueue(self.config)
        self.in_flight: set[str] = set()
        self.batch_sizes: list[int] = []  # every released batch's size, for reports

    def add_request(
        self, request_id: str, payload: Any, now: float, priority: int = 0, timeout_ms: float | None = None
    ) -> QueuedItem:
        """Queue one input; raises QueueFullError when the queue is full, ValueError on bad fields.
        The returned item carries the request's queue deadline (None: no timeout)."""
        if request_id in self.in_flight:
            raise ValueError(f"request_id {request_id!r} is already running")
        return self.queue.put(request_id, payload, now, priority, timeout_ms)

    def abort(self, request_id: str) -> bool:
        """Drop a request that still waits in the queue; False once its batch has formed."""
        return self.queue.remove(request_id) is not None

    def has_unfinished(self) -> bool:
        return len(self.queue) > 0 or bool(self.in_flight)

    def next_due(self, now: float) -> float | None:
        return self.queue.next_due(now)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_waiting=len(self.queue), num_running=len(self.in_flight))

    def schedule(self, now: float) -> Batch:
        """The batch due now (possibly empty), with any requests that timed out meanwhile."""
        rejected = {item.request_id: msg for item, msg in self.queue.expire(now)}
        items = self.queue.pop_batch(self.queue.release_size(now))
        batch = Batch([i.request_id for i in items], [i.payload for i in items], [i.priority for i in items], rejected)
        if items:
            self.in_flight.update(batch.request_ids)
            self.batch_sizes.append(batch.size)
        return batch

    def update(self, plan: Batch, results: list[Any]) -> dict[str, Any]:
        """Every member of a request-level batch finishes with its batch: request id -> result."""
        if len(results) != plan.size:
            raise ValueError(f"results must hold one entry per batch member ({plan.size}), got {len(results)}")
        self.in_flight.difference_update(plan.request_ids)
        return dict(zip(plan.request_ids, results))
