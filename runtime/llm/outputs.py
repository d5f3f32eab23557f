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
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None = None
    stop_reason: str | int | None = None


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape: one completion per request (Tandem samples n=1)."""
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs, self.stop_reason)]
