"""The request-level batching policy of NVIDIA Triton's dynamic batcher, payload-agnostic.

Requests wait in one FIFO per priority level (0 is served first). A batch is released when
  - `max_batch_size` requests wait, or
  - a preferred batch size can be formed (the largest one that fits), or
  - the oldest request has waited `max_queue_delay_ms` (then everything up to max_batch_size).
A request whose own timeout passes while it waits is rejected with an error; a full queue
rejects a new request at once. Both the vision scheduler and the LLM static batcher use this,
each with the knobs of one `DynamicBatchConfig`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from schedulers.config import DynamicBatchConfig


def _positive_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


class QueueFullError(RuntimeError):
    """The queue holds max_queue_size requests already; the caller should retry later."""


@dataclass(slots=True)
class QueuedItem:
    request_id: str
    payload: Any
    priority: int
    arrival: float  # seconds, on the scheduler's clock
    deadline: float | None  # seconds, or None for no timeout


class BatchQueue:
    def __init__(self, config: DynamicBatchConfig) -> None:
        self.config = config
        self.preferred = tuple(sorted(config.preferred_batch_sizes, reverse=True))  # largest first
        self.delay = config.max_queue_delay_ms / 1000.0
        self.default_timeout = None if config.default_timeout_ms is None else config.default_timeout_ms / 1000.0
        self.levels: list[deque[QueuedItem]] = [deque() for _ in range(config.priority_levels)]
        self._ids: dict[str, QueuedItem] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def put(
        self, request_id: str, payload: Any, now: float, priority: int = 0, timeout_ms: float | None = None
    ) -> QueuedItem:
        """Queue one request; the returned item carries its deadline on the caller's clock."""
        if not isinstance(priority, int) or not 0 <= priority < len(self.levels):
            raise ValueError(f"priority must be an integer in [0, {len(self.levels) - 1}], got {priority!r}")
        if timeout_ms is not None and not _positive_number(timeout_ms):
            raise ValueError(f"timeout_ms must be > 0 or None, got {timeout_ms!r}")
        if request_id in self._ids:
            raise ValueError(f"request_id {request_id!r} is already queued")
        limit = self.config.max_queue_size
        if len(self._ids) >= limit:
            raise QueueFullError(
                f"queue is full ({limit} requests wait, max_queue_size={limit}); "
                f"request {request_id!r} rejected, retry later"
            )
        timeout = self.default_timeout if timeout_ms is None else timeout_ms / 1000.0
        item = QueuedItem(request_id, payload, priority, now, None if timeout is None else now + timeout)
        self.levels[priority].append(item)
        self._ids[request_id] = item
        return item

    def remove(self, request_id: str) -> QueuedItem | None:
        item = self._ids.pop(request_id, None)
        if item is not None:
            self.levels[item.priority].remove(item)
        return item

    def expire(self, now: float) -> list[tuple[QueuedItem, str]]:
        """Take out every request whose timeout has passed, with the error to report."""
        out = []
        for level in self.levels:
            if not level:
                continue
            for item in [i for i in level if i.deadline is not None and i.deadline <= now]:
                level.remove(item)
                del self._ids[item.request_id]
                waited_ms = (now - item.arrival) * 1000.0
                out.append(
                    (item, f"request {item.request_id!r} timed out after waiting {waited_ms:.1f} ms in the queue")
                )
        return out

    def oldest_arrival(self) -> float | None:
        heads = [level[0].arrival for level in self.levels if level]
        return min(heads) if heads else None

    def release_size(self, now: float) -> int:
        """How many requests a batch released now would hold (0: keep waiting)."""
        n = len(self._ids)
        if n == 0:
            return 0
        if n >= self.config.max_batch_size:
            return self.config.max_batch_size
        for size in self.preferred:
            if n >= size:
                return size
        if now - self.oldest_arrival() >= self.delay:
            return n
        return 0

    def pop_batch(self, size: int) -> list[QueuedItem]:
        """The `size` highest-priority requests, FIFO within a level."""
        out: list[QueuedItem] = []
        for level in self.levels:
            while level and len(out) < size:
                item = level.popleft()
                del self._ids[item.request_id]
                out.append(item)
        return out

    def next_due(self, now: float) -> float | None:
        """Seconds until a batch may be released or a timeout falls due; None if empty."""
        if not self._ids:
            return None
        if self.release_size(now):
            return 0.0
        due = self.oldest_arrival() + self.delay - now
        deadlines = [i.deadline for i in self._ids.values() if i.deadline is not None]
        if deadlines:
            due = min(due, min(deadlines) - now)
        return max(due, 0.0)
