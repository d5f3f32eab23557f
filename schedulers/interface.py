"""The two small contracts of the scheduling layer.

`BlockAllocator` is what a scheduler needs from the device memory manager's KV block pool
(mechanism); the schedulers hold the policy. `Scheduler` is what the runtime loop needs from
either scheduler, so the continuous, static and vision schedulers are interchangeable:

    plan = scheduler.schedule(now)
    result = runner.execute(plan)
    outputs = scheduler.update(plan, result)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class BlockAllocator(Protocol):
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool

    @property
    def num_free_blocks(self) -> int: ...

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` blocks (ref count 1 each), or None if there are not enough."""

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; unreferenced blocks return to the free list."""

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each of these blocks, all in use (a fork shares them)."""

    def extend_block_hashes(self, token_ids: Sequence[int], hashes: list[bytes]) -> None:
        """Append one chained hash per further full block of `token_ids` to `hashes`. The
        hashes are opaque digests, keyed per pool: only the pool that made them can use them."""

    def find_cached_prefix(self, block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of full blocks (no references taken). A block
        matches only if its tokens and its whole prefix match, never on the hash alone."""

    def num_evictable(self, block_ids: Sequence[int]) -> int:
        """How many of these cached blocks sit unreferenced in the free list."""

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one reference on each cached block (removing it from the free list if needed)."""

    def publish_blocks(
        self, token_ids: Sequence[int], block_ids: Sequence[int], hashes: list[bytes], start: int, end: int
    ) -> None:
        """Enter computed full blocks [start, end) of a sequence in the prefix cache, extending
        its `hashes` as needed; blocks [0, start) were entered (or hit) before."""


@dataclass(slots=True, frozen=True)
class SchedulerStats:
    """How loaded a scheduler is now, as plain numbers (the Runtime's `stats()`, /metrics and
    the server's queue limit read it; nobody reaches into a scheduler's queues)."""

    num_waiting: int  # accepted, not yet running (queued, or preempted and re-queued)
    num_running: int  # running now (LLM), or in a batch being computed (vision)
    num_preemptions: int = 0  # since start
    kv_blocks_used: int | None = None  # None: this scheduler holds no KV blocks (vision)
    kv_blocks_total: int | None = None
    # LLM: prompt tokens whose KV was computed, since start (prefix-cache hits and the prompt
    # that n > 1 choices share are not counted again; recomputes after preemption are).
    num_computed_prompt_tokens: int = 0
    # LLM speculative decoding, since start (schedulers/speculation.py's SpeculationStats).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float | None:
        """The share of the KV pool in use, in [0, 1]; None without a pool."""
        if self.kv_blocks_used is None or not self.kv_blocks_total:
            return None
        return self.kv_blocks_used / self.kv_blocks_total


class Scheduler(Protocol):
    def add_request(self, request: Any) -> None:
        """Queue a request; raises ValueError (naming the field) if it can never run."""

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is, freeing what it holds; False if unknown."""

    def schedule(self, now: float) -> Any:
        """The next plan, or an empty plan / None when nothing is due yet."""

    def next_due(self, now: float) -> float | None:
        """Seconds until `schedule` may have work (0 for now); None when idle."""

    def update(self, plan: Any, result: Any) -> Any:
        """Take the runner's result for `plan`; return what changed and what finished."""

    def has_unfinished(self) -> bool: ...

    def stats(self) -> SchedulerStats:
        """Queue depth, running count and KV use, now."""
