"""LLMEngine: requests in, tokens and text out. It owns one scheduler and one model runner and
turns each step's token ids into text, metrics and finished outputs:

    plan = scheduler.schedule(now)
    result = runner.execute(plan)
    outputs = scheduler.update(plan, result)

Not thread-safe: one thread drives `step()` (the caller's, or the Runtime's loop thread).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterator

from runtime.llm.detokenizer import IncrementalDetokenizer
from runtime.llm.outputs import RequestMetrics, RequestOutput
from runtime.llm.sampling_params import SamplingParams
from runtime.memory import DeviceMemoryManager, MemoryConfig
from runtime.threads import settle_native_pools
from schedulers import (
    ContinuousBatchScheduler,
    DynamicBatchConfig,
    Request,
    RequestStatus,
    SchedulerConfig,
    StaticBatchScheduler,
    StopCriteria,
)

SCHEDULERS = ("continuous", "static")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # local HF folder or .gguf; None = SmolLM2-135M-Instruct
    dtype: str = "float32"
    device: str | None = None  # None: cuda if available, else cpu
    max_num_seqs: int | None = None  # None: 16 on CPU, 256 on CUDA
    max_num_batched_tokens: int | None = None  # None: 256 on CPU, 2048 on CUDA
    max_model_len: int | None = None  # None: the model's, capped at 2048
    block_size: int = 16
    kv_cache_bytes: int | None = None  # None: the rest of the device budget
    num_kv_blocks: int | None = None  # exact pool size (tests); overrides kv_cache_bytes
    scheduler: str = "continuous"  # or "static": request-level batching, the baseline
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    static_max_queue_delay_ms: float = 0.0
    cache_dir: str | None = None  # where converted GGUF models are kept

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0 or None, got {self.kv_cache_bytes!r}")

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


class _Tracked:
    """The engine's side of one request: what the scheduler does not need to know."""

    __slots__ = ("req", "prompt", "params", "metrics", "detok", "stream", "error", "pending")

    def __init__(self, req: Request, prompt: str | None, params: SamplingParams, metrics: RequestMetrics) -> None:
        self.req = req
        self.prompt = prompt
        self.params = params
        self.metrics = metrics
        self.detok: IncrementalDetokenizer | None = None
        self.stream = False
        self.error: str | None = None
        self.pending: list[RequestOutput] = []  # streamed outputs not yet taken


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, memory: DeviceMemoryManager | None = None) -> None:
        from runtime.llm.loader import load_model
        from runtime.llm.runner import ModelRunner

        self.config = c = config or EngineConfig()
        settle_native_pools()  # see runtime/threads.py
        device = c.resolved_device()
        on_cpu = device == "cpu"
        self.loaded = load_model(c.model, dtype=c.dtype, device=device, cache_dir=c.cache_dir)
        self.tokenizer = self.loaded.tokenizer
        model_max = getattr(self.loaded.config, "max_position_embeddings", 2048) or 2048
        self.max_model_len = c.max_model_len or min(model_max, 2048)
        if self.max_model_len > model_max:
            raise ValueError(f"max_model_len must be <= the model's {model_max}, got {self.max_model_len}")
        max_num_seqs = c.max_num_seqs or (16 if on_cpu else 256)
        budget = c.max_num_batched_tokens or (256 if on_cpu else 2048)
        sched_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=self.max_model_len, policy=c.policy
        )
        self.memory = memory or DeviceMemoryManager(MemoryConfig(device=device))
        self.runner = ModelRunner(
            self.loaded, self.memory, block_size=c.block_size, kv_cache_bytes=c.kv_cache_bytes,
            num_kv_blocks=c.num_kv_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
            max_model_len=self.max_model_len, enable_prefix_caching=c.enable_prefix_caching, dtype=c.dtype,
            device=device,
        )  # fmt: skip
        pool = self.runner.kv_pool
        if c.scheduler == "static":
            batching = DynamicBatchConfig(max_batch_size=max_num_seqs, max_queue_delay_ms=c.static_max_queue_delay_ms)
            self.scheduler = StaticBatchScheduler(sched_config, pool, batching)
        else:
            self.scheduler = ContinuousBatchScheduler(sched_config, pool)
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        self.vocab_size = int(self.loaded.config.vocab_size)
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.num_steps = 0

    # ---- requests in ------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string or a non-empty list of token ids, got ''")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass a list of token ids")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False) or []
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"prompt must be a non-empty string or a non-empty list of token ids, got {prompt!r}")
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {ids[:8]!r}...")
        return None, ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        stream: bool = False,
    ) -> str:
        """Queue a request; raises ValueError (naming the field) if it can never run. Nothing
        else in flight is touched by a rejected request."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt must encode to at least one token")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._tracked:
            raise ValueError(f"request_id {rid!r} is already in use")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        now = time.monotonic()
        req = Request(
            rid, ids, StopCriteria(params.max_tokens, params.min_tokens, frozenset(stop_ids)),
            priority=priority, arrival_time=now, sampling=params,
        )  # fmt: skip
        self.scheduler.add_request(req)
        t = _Tracked(req, text, params, RequestMetrics(arrival_time=now))
        if stream or params.stop:
            if self.tokenizer is None and params.stop:
                self.scheduler.abort(rid)
                raise ValueError("stop: stop strings need a tokenizer; this model has none")
            if self.tokenizer is not None:
                t.detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens)
        t.stream = stream
        self._tracked[rid] = t
        return rid

    def abort(self, request_id: str) -> bool:
        t = self._tracked.get(request_id)
        if t is None or not self.scheduler.abort(request_id):
            return False
        self._finish(t, "abort", time.monotonic())
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. Returns the outputs of requests that finished in it, and of streamed
        requests that produced text."""
        finished: list[RequestOutput] = []
        now = time.monotonic()
        plan = self.scheduler.schedule(now)
        for rid, msg in plan.rejected.items():
            t = self._tracked.get(rid)
            if t is not None:
                t.error = msg
                finished.append(self._finish(t, "abort", now))
        if plan.is_empty:
            return finished
        for new in plan.new_requests:
            t = self._tracked.get(new.request_id)
            if t is not None and t.metrics.first_scheduled_time is None:
                t.metrics.first_scheduled_time = now
        result = self.runner.execute(plan)
        outs = self.scheduler.update(plan, result)
        self.num_steps += 1
        now = time.monotonic()
        tracked = self._tracked
        streamed: list[_Tracked] = []
        for rid, tokens in zip(outs.req_ids, outs.new_token_ids):
            if not tokens:
                continue
            t = tracked.get(rid)
            if t is None:
                continue
            times = t.metrics.token_times
            if not times:
                t.metrics.first_token_time = now
            times.append(now)
            detok = t.detok
            if detok is not None:
                detok.add(tokens)
                if detok.stop_at is not None and rid not in outs.finished:
                    self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                    outs.finished[rid] = "stop"
                if t.stream:
                    streamed.append(t)
        for rid, reason in outs.finished.items():
            t = tracked.get(rid)
            if t is not None:
                finished.append(self._finish(t, reason, now))
        for t in streamed:
            if t.req.request_id in tracked:
                t.pending.append(self._output(t, None, delta=t.detok.take_delta(False)))
        return finished

    def _finish(self, t: _Tracked, reason: str, now: float) -> RequestOutput:
        t.metrics.finished_time = now
        self._tracked.pop(t.req.request_id, None)
        out = self._output(t, reason, delta=t.detok.take_delta(True) if t.detok is not None else "")
        if t.stream:
            t.pending.append(out)
        return out

    def _output(self, t: _Tracked, reason: str | None, delta: str) -> RequestOutput:
        req = t.req
        ids = req.output_token_ids
        if t.detok is not None:
            text = t.detok.visible_text()
        elif reason is not None and self.tokenizer is not None:
            text = self.tokenizer.decode(ids, skip_special_tokens=t.params.skip_special_tokens)
        else:
            text = ""
        return RequestOutput(
            req.request_id, t.prompt, req.prompt_token_ids, ids, text, reason, t.metrics, t.error, delta
        )

    # ---- streaming --------------------------------------------------------------------------

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, **kw) -> Iterator[RequestOutput]:
        """Add a request and yield its outputs as text arrives, driving steps from this thread.
        The last output has finished=True. Other requests in flight advance too."""
        rid = self.add_request(prompt, params, stream=True, **kw)
        t = self._tracked[rid]
        try:
            while True:
                while t.pending:
                    out = t.pending.pop(0)
                    yield out
                    if out.finished:
                        return
                self.step()
        finally:
            if rid in self._tracked:  # the consumer stopped early
                self.abort(rid)
