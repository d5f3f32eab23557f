"""Scheduler knobs, validated on construction without any I/O. Names follow vLLM (LLM) and
NVIDIA Triton's dynamic batcher (request-level batching) so users find what they know."""

from __future__ import annotations

from dataclasses import dataclass, field

from schedulers.speculation import SpeculativeConfig

POLICIES = ("fcfs", "priority", "fair")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(slots=True)
class SchedulerConfig:
    """Iteration-level (continuous) batching of LLM requests."""

    max_num_seqs: int = 16  # requests running at once
    max_num_batched_tokens: int = 512  # tokens computed per step, decodes and prefill chunks together
    max_model_len: int = 2048  # prompt + generated tokens of one request
    # "fcfs"; "priority": lower Request.priority first, aged by the wait (priority_aging_s);
    # "fair": per-tenant Virtual Token Counters within a priority level (schedulers/fair.py).
    policy: str = "fcfs"
    # Under "priority", a waiting request gains one level per this many seconds of wait (0: no
    # aging, strict priorities that can starve). 10 s: ordinary queueing delays (well under a
    # second) leave priorities strict, while under overload a request of priority p waits at
    # most (p - p_min) * priority_aging_s plus the drain of what was queued ahead of it then
    # (the bound: schedulers/continuous.py, WaitingQueue).
    priority_aging_s: float = 10.0
    # Under "fair": tenant -> weight (> 0); a tenant not named has weight 1. A tenant of weight
    # 2 gets twice the service of one of weight 1 when both are backlogged.
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # A prompt longer than this per step is split; by default a chunk may use the whole budget.
    long_prefill_token_threshold: int = 0
    # Draftless speculative decoding (schedulers/speculation.py); None: off. A dict (vLLM's
    # form) is turned into a SpeculativeConfig here.
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_model_len", self.max_model_len)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not _number(self.priority_aging_s) or not self.priority_aging_s >= 0:
            raise ValueError(
                f"priority_aging_s must be a number of seconds >= 0 (0 = no aging), got {self.priority_aging_s!r}"
            )
        if not isinstance(self.tenant_weights, dict):
            raise ValueError(f"tenant_weights must be a dict of tenant -> weight > 0, got {self.tenant_weights!r}")
        for tenant, w in self.tenant_weights.items():
            if not isinstance(tenant, str) or not _number(w) or not w > 0:
                raise ValueError(f"tenant_weights must map tenant names to numbers > 0, got {tenant!r}: {w!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be an integer >= 0 (0 = no limit), "
                f"got {self.long_prefill_token_threshold!r}"
            )


@dataclass(slots=True)
class DynamicBatchConfig:
    """Request-level batching, as NVIDIA Triton's dynamic batcher does it.

    A batch is released when `max_batch_size` requests wait, when a preferred size can be
    formed, or when the oldest request has waited `max_queue_delay_ms`.
    """

    max_batch_size: int = 8
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_ms: float = 5.0
    max_queue_size: int = 1024  # waiting requests; one more is rejected at once
    default_timeout_ms: float | None = None  # per-request queue timeout unless the request sets one
    priority_levels: int = 1  # priorities 0 (served first) .. priority_levels - 1

    def __post_init__(self) -> None:
        _positive_int("max_batch_size", self.max_batch_size)
        _positive_int("max_queue_size", self.max_queue_size)
        _positive_int("priority_levels", self.priority_levels)
        sizes = self.preferred_batch_sizes
        if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
            raise ValueError(f"preferred_batch_sizes must be a sequence of integers, got {sizes!r}")
        sizes = tuple(sizes)
        for size in sizes:
            if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= self.max_batch_size:
                raise ValueError(
                    f"preferred_batch_sizes must hold integers in [1, max_batch_size={self.max_batch_size}], "
                    f"got {size!r}"
                )
        self.preferred_batch_sizes = tuple(sorted(set(sizes)))
        if not _number(self.max_queue_delay_ms) or not self.max_queue_delay_ms >= 0:
            raise ValueError(f"max_queue_delay_ms must be a number >= 0, got {self.max_queue_delay_ms!r}")
        timeout = self.default_timeout_ms
        if timeout is not None and not (_number(timeout) and timeout > 0):
            raise ValueError(f"default_timeout_ms must be a number > 0 or None, got {timeout!r}")
