"""Request-level ("static") batching of LLM requests: the baseline continuous batching beats.

Groups form exactly as in the dynamic batcher (same queue policy: size, preferred sizes, queue
delay, priorities, timeouts, bound). A group then runs, step by step on the same engine and the
same KV block pool, until its longest member finishes; members that finish early leave their
slot idle, and the next group starts only when the whole group is done.
"""

from __future__ import annotations

from schedulers.batch_queue import BatchQueue
from schedulers.config import DynamicBatchConfig, SchedulerConfig
from schedulers.continuous import ContinuousBatchScheduler
from schedulers.interface import BlockAllocator
from schedulers.plan import StepPlan
from schedulers.request import Request, RequestStatus


class StaticBatchScheduler(ContinuousBatchScheduler):
    """Reuses the continuous scheduler's step mechanics (chunks, blocks, preemption within the
    group) and replaces only its admission: nobody joins a group once it has started."""

    def __init__(
        self, config: SchedulerConfig, pool: BlockAllocator, batching: DynamicBatchConfig | None = None
    ) -> None:
        super().__init__(config, pool)
        b = batching or DynamicBatchConfig(max_batch_size=config.max_num_seqs, max_queue_delay_ms=0.0)
        if b.max_batch_size > config.max_num_seqs:
            raise ValueError(f"max_batch_size ({b.max_batch_size}) must be <= max_num_seqs ({config.max_num_seqs})")
        self.batching = b
        self.queue = BatchQueue(b)
        self.group_sizes: list[int] = []

    def add_request(self, request: Request, timeout_ms: float | None = None) -> None:
        self.validate(request)
        if not 0 <= request.priority < self.batching.priority_levels:
            raise ValueError(
                f"priority must be an integer in [0, {self.batching.priority_levels - 1}], got {request.priority!r}"
            )
        self.queue.put(request.request_id, request, request.arrival_time, request.priority, timeout_ms)
        request.status = RequestStatus.WAITING
        self.table.register(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        if self.queue.remove(request_id) is not None:
            req = self.table.requests[request_id]
            heir = self.table.hand_over(req)
            self.table.finish(req, status)
            if heir is not None:  # its followers go on without it: the first leads, queued in its place
                self.queue.put(heir.request_id, heir, heir.arrival_time, heir.priority, None)
            return True
        return super().finish_request(request_id, status)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or len(self.queue) > 0

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.queue)  # re-queued by preemption, and not yet grouped

    def next_due(self, now: float = 0.0) -> float | None:
        if super().has_unfinished():
            return 0.0
        return self.queue.next_due(now)

    def schedule(self, now: float = 0.0) -> StepPlan:
        rejected = {}
        for item, msg in self.queue.expire(now):
            self.table.finish(item.payload, RequestStatus.FINISHED_ABORTED)
            rejected[item.request_id] = msg
        if not super().has_unfinished():  # the last group is done: release the next
            items = self.queue.pop_batch(self.queue.release_size(now))
            for item in items:
                self.waiting.push(item.payload)
            if items:
                self.group_sizes.append(len(items))
        plan = super().schedule(now)
        plan.rejected = rejected
        return plan
