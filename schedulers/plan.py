"""The data that crosses between a scheduler and a runner.

Plain dataclasses of ints, strings and lists: they pickle, so a runner can live in another
process, and tests can write them by hand. Running requests are sent as a diff (the runner
keeps each request's token ids and block table from the step it was first sent), the way
vLLM's v1 SchedulerOutput does, so a decode step costs a few list appends per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class NewRequestData:
    """Everything a runner needs to start (or restart, after preemption) a request."""

    request_id: str
    token_ids: list[int]  # prompt plus any tokens generated before a preemption
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    num_prompt_tokens: int  # the rest of token_ids were generated (min_tokens counts them)
    sampling: Any = None  # the request's sampling parameters, opaque to the scheduler


@dataclass(slots=True)
class StepPlan:
    """One iteration: which requests run and how many of their tokens each computes.

    For request `req_ids[i]`, tokens `[num_computed_tokens[i], num_computed_tokens[i] +
    num_scheduled_tokens[i])` of its token ids are computed; `sample[i]` says whether that
    reaches the end of its known tokens, so that a next token is sampled.
    """

    req_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Blocks appended to running requests' tables this step, by request id.
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests whose runner-side state can go: finished, aborted or preempted since the last plan.
    freed_req_ids: list[str] = field(default_factory=list)
    # Requests refused while queued (e.g. a queue timeout), request id -> error message.
    rejected: dict[str, str] = field(default_factory=dict)
    # Parallel sampling: choices forked this step, child id -> parent id. A child computes no
    # token (0 scheduled, its prompt's KV is its parent's); it samples from the logits of its
    # parent's last token of this step.
    forks: dict[str, str] = field(default_factory=dict)
    # (source, destination) KV blocks to copy after this step's forward: a forked child's own
    # copy of the partial block its parent's prompt ends in (copy on write: each child writes
    # its first tokens there; the full prompt blocks before it are shared, never written).
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: a decoding request's draft tokens, by request id. It is scheduled
    # 1 + len(drafts) tokens (its last token, then the drafts); the runner verifies the drafts
    # and returns the accepted ones plus one token of its own.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Block tables cut back since the last plan (rejected drafts' emptied blocks went back to
    # the pool): request id -> blocks it keeps. Applied before new_block_ids.
    trimmed_block_ids: dict[str, int] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.req_ids


@dataclass(slots=True)
class StepResult:
    """The runner's answer: one list of sampled token ids per planned request (empty where
    `sample` was False, or where the request is in `failed`), in plan order."""

    sampled_token_ids: list[list[int]]
    # Requests the runner could not admit (their data is bad), request id -> why. They were
    # left out of the step; the engine fails them, everyone else's tokens stand.
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class StepOutputs:
    """What changed in one step, for the engine to stream. `req_ids` and `new_token_ids` are
    the plan's and the result's own lists (not copied: this is the hot path), so an entry may
    be empty (a prefill chunk) or name a request aborted since the plan was made."""

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    finished: dict[str, str] = field(default_factory=dict)  # request id -> finish reason
    num_preempted: int = 0


@dataclass(slots=True)
class Batch:
    """A request-level batch (vision): run every item to completion in one forward pass."""

    request_ids: list[str]
    payloads: list[Any]
    priorities: list[int] = field(default_factory=list)
    # Requests refused while queued (timeouts), request id -> error message.
    rejected: dict[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.request_ids)
