"""Scheduler-side state of one LLM request.

The scheduler sees a request as token ids and counters, nothing else: no text, no tensors.
"There is no prefill phase nor decode phase": a request has `num_computed_tokens` out of
`len(token_ids)`, and each step computes some of the rest.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.IntEnum):
    """Ordered so that `status > RequestStatus.PREEMPTED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


# Interactive requests are served first; batch requests fill the slots interactive traffic
# leaves, and are the first preempted when interactive requests wait (schedulers/continuous.py).
TIERS = ("interactive", "batch")

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class StopCriteria:
    """What ends a request, as far as token ids tell; stop strings are the engine's business
    (they need text), and it finishes the request through `finish_request`."""

    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()  # the engine adds eos ids here unless ignore_eos

    def __post_init__(self) -> None:
        # 0: prefill the prompt and sample nothing (scoring a prompt: its logprobs).
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )


@dataclass(slots=True, eq=False)
class Request:
    """One generation request as the scheduler tracks it.

    `token_ids` holds the prompt followed by every token generated so far, so that a request
    preempted by recompute can be prefilled again from it.

    Parallel sampling (n > 1): the engine hands in one request per choice, the first with the
    others in `followers`. Only that leader is queued and prefilled; in the step that computes
    the last of its prompt, the followers fork from it (they share its prompt's KV blocks) and
    each samples its first token from the same logits. From then on each is a request of its
    own, decoded, preempted and finished like any other.
    """

    request_id: str
    prompt_token_ids: list[int]
    stop: StopCriteria = field(default_factory=StopCriteria)
    priority: int = 0  # lower value is served first, as in vLLM
    arrival_time: float = 0.0
    sampling: object = None  # opaque to the scheduler; handed to the runner in the plan
    # Its prompt's KV must be computed, not read from the prefix cache (prompt logprobs need
    # the logits of every prompt position). Its blocks are still published for others.
    skip_prefix_cache: bool = False
    # Choices that fork from this request once its prompt is computed (see the docstring);
    # each follower's `leader` is this request until then.
    followers: list[Request] = field(default_factory=list)
    leader: Request | None = None
    # A leader's blocks for its followers' copies of its prompt's last, partial block, taken at
    # admission with its own (so that the fork never waits for blocks); [] when the prompt
    # fills whole blocks.
    fork_tails: list[int] = field(default_factory=list)
    # Speculative decoding may draft for it (schedulers/speculation.py): the engine says so for
    # requests whose sampling the verification keeps exact (runtime/llm/input_processor.py).
    spec_ok: bool = False
    # Who the request is for, in fair shares (policy="fair", schedulers/fair.py); "" = anonymous.
    tenant: str = ""
    tier: str = "interactive"  # or "batch" (TIERS)

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of token_ids, grown as blocks fill (prefix caching);
    # digests keyed by the pool, meaningful to it alone.
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0  # full blocks already entered in the prefix cache
    next_publish_at: int = 0  # num_computed_tokens at which the next block fills (set on admission)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    # Prompt positions charged to the tenant (policy="fair"): each is charged once, when first
    # computed, so neither prefix-cache hits nor a recompute after preemption are charged.
    num_charged_prompt_tokens: int = 0
    # Set when the runner must be sent the whole request (first schedule, or after preemption).
    needs_full_state: bool = True
    # Stop criteria as plain totals of len(token_ids), so the per-step check is two compares.
    min_len: int = field(init=False)
    max_len: int = field(init=False)  # lowered to max_model_len by the scheduler
    stop_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must hold at least one token id, got an empty list")
        if not isinstance(self.tenant, str):
            raise ValueError(f"tenant must be a string ('' = anonymous), got {self.tenant!r}")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.min_len = self.num_prompt_tokens + self.stop.min_tokens
        self.max_len = self.num_prompt_tokens + self.stop.max_tokens
        self.stop_token_ids = self.stop.stop_token_ids

    @property
    def is_batch(self) -> bool:
        return self.tier == "batch"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
