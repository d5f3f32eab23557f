"""What `LLM.generate` returns, shaped like vLLM's RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    deadline: float | None = None  # the caller's deadline (monotonic seconds), if it set one

    @property
    def deadline_missed(self) -> bool | None:
        """Whether the request finished after its deadline (None: no deadline, or running)."""
        if self.deadline is None or self.finished_time is None:
            return None
        return self.finished_time > self.deadline

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        t = self.token_times
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else None


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request (vLLM's). The delta_* fields hold what is new since the choice's
    previous streamed output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None = None
    stop_reason: str | int | None = None
    # The sum of its tokens' logprobs, where they were computed (logprobs asked, or best_of > n).
    cumulative_logprob: float | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length" or "abort"; None while running
    metrics: RequestMetrics
    error: str | None = None  # why a request was rejected after it was accepted (e.g. a queue timeout)
    delta_text: str = ""  # text added since the previous streamed output of this request
    delta_token_ids: list[int] = field(default_factory=list)  # token ids added since then
    # Why `error` happened, for callers that branch on it: "queue_timeout", "deadline_exceeded",
    # "engine_error" or "runtime_closed".
    error_code: str | None = None
    # One entry per generated token when params.logprobs is not None (else None):
    #   {"token_id", "token", "bytes", "logprob", "top": [{"token_id", "token", "bytes", "logprob"}, ...]}
    # `top` holds params.logprobs entries, most likely first; logprobs are of the raw logits.
    logprobs: list[dict] | None = None
    delta_logprobs: list[dict] | None = None  # the entries of delta_token_ids
    # The stop string or stop token id that ended the request; None for EOS, length or abort.
    stop_reason: str | int | None = None
    # When params.prompt_logprobs is not None: one entry per prompt token, None for the first
    # (nothing predicts it), then entries shaped as `logprobs`' ("top" holds prompt_logprobs
    # alternatives). In the final output, and in the first streamed one.
    prompt_logprobs: list[dict | None] | None = None
    cumulative_logprob: float | None = None  # see CompletionOutput
    # n > 1 (or best_of): every choice, by index; the fields above are then choice 0's. A
    # streamed output holds the choices that moved (with their deltas); the final one, finished
    # once every choice is, holds the n choices whole (best_of: the n of highest
    # cumulative_logprob, best first). None for a single choice: `outputs` builds it.
    completions: list[CompletionOutput] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: one CompletionOutput per choice."""
        if self.completions is not None:
            return self.completions
        return [
            CompletionOutput(
                0,
                self.text,
                self.token_ids,
                self.finish_reason,
                self.logprobs,
                self.stop_reason,
                self.cumulative_logprob,
                self.delta_text,
                self.delta_token_ids,
                self.delta_logprobs,
            )
        ]
