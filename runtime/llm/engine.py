"""LLMEngine: requests in, tokens and text out. It wires four rooms, each with one job, as
vLLM v1 does:

  - runtime/llm/input_processor.py: checks and tokenizes a request (`prepare()`, on any
    thread), compiles its grammar, replays a resumed request's earlier outputs;
  - runtime/llm/engine_core.py: one scheduler and one model runner, and the step:

        plan = scheduler.schedule(now)
        result = runner.execute(plan)
        outputs = scheduler.update(plan, result)

  - runtime/llm/output_processor.py: token ids to text, logprobs, stop strings, grammar
    advances, metrics and RequestOutputs, streamed to each request's sink;
  - runtime/llm/failures.py: the failure policy. A bad request, a missed deadline or a failed
    step fails its own requests, each with its error; the engine stays consistent and serves
    the rest, with the same tokens.

Not thread-safe: one thread drives `step()` (the caller's, or the Runtime's loop thread).
`prepare()` alone may be called from any thread, so that callers of the Runtime get their
ValueError at once, on their own thread.

Parallel sampling (SamplingParams.n > 1, best_of): one request per choice, tied by a
ParentRequest (runtime/llm/parallel_sampling.py); the prompt is computed once and the choices
fork from it. `abort` takes the request's id (every choice) or a choice's.

Resumed requests (`num_resumed_outputs=n`, the last n prompt token ids being the request's own
earlier outputs; see runtime/llm/input_processor.py): a request already complete after its n
tokens (max_tokens reached, the last one a stop token past min_tokens, a stop string in their
text, or a terminated grammar) finishes at once, with no step, "length" or "stop".
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from runtime.llm import failures
from runtime.llm.engine_core import EngineCore
from runtime.llm.failures import Failure, QueueDeadlines
from runtime.llm.input_processor import InputProcessor, PreparedRequest
from runtime.llm.output_processor import OutputProcessor, RequestState, Sink
from runtime.llm.outputs import RequestOutput
from runtime.llm.parallel_sampling import ParentRequest
from runtime.llm.sampling_params import SamplingParams
from runtime.llm.structured import GrammarCompiler
from runtime.memory import DeviceMemoryManager, MemoryConfig
from runtime.threads import settle_native_pools
from schedulers import ContinuousBatchScheduler, DynamicBatchConfig, SchedulerConfig, StaticBatchScheduler
from schedulers.config import POLICIES
from schedulers.speculation import SpeculativeConfig

SCHEDULERS = ("continuous", "static")
QUANTIZATIONS = (None, "float", "int4", "gguf")
# Whether steps stay eager unless asked otherwise (BENCHMARKS.md, "A captured decode step").
DEFAULT_ENFORCE_EAGER = True


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # local HF folder or .gguf; None = SmolLM2-135M-Instruct
    dtype: str = "auto"  # bfloat16 where the hardware has it natively, else float32 (loader.resolve_dtype)
    device: str | None = None  # None: cuda if available, else cpu
    max_num_seqs: int | None = None  # None: 16 on CPU, 256 on CUDA
    max_num_batched_tokens: int | None = None  # None: 256 on CPU, 2048 on CUDA
    max_model_len: int | None = None  # None: the model's, capped at 2048
    block_size: int = 16
    kv_cache_bytes: int | None = None  # None: the rest of the device budget
    num_kv_blocks: int | None = None  # exact pool size (tests); overrides kv_cache_bytes
    scheduler: str = "continuous"  # or "static": request-level batching, the baseline
    policy: str = "fcfs"  # POLICIES: "fcfs", "priority" (aged) or "fair" (per-tenant VTC)
    tenant_weights: dict | None = None  # policy="fair": tenant -> weight > 0; None: every tenant 1
    enable_prefix_caching: bool = True
    static_max_queue_delay_ms: float = 0.0
    cache_dir: str | None = None  # converted GGUF models, and the captured step's inductor cache
    # None: as the model ships (vLLM's default): "gguf" for a .gguf file on CPU where the kernel
    # builds, else "float". "float": weights in `dtype` (a GGUF dequantized). "gguf": a .gguf
    # model's Q4_1 and Q8_0 layers stay in their blocks as shipped, read by Tandem's integer
    # kernel with 8-bit activations (kernels/quant_linear.py); CPU, float32 or bfloat16; its
    # quality and speed: BENCHMARKS.md, issue 30, and tests/test_llm_gguf.py. "int4": the decoder
    # layers' weights requantized to 4 bits for torch's CPU int4 kernel; CPU and bfloat16 only.
    quantization: str | None = None
    # False: decode-only steps run a graph captured by torch.compile once it is compiled (on a
    # background thread; eager until then). True: always eager, as vLLM's flag. None: the
    # environment's TANDEM_ENFORCE_EAGER (1 or 0; the test suite sets 1), else the default.
    enforce_eager: bool | None = None
    # Draftless speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens":
    # 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} plus the adaptive knobs of
    # schedulers/speculation.py. None: off. Greedy tokens are exactly those without it.
    speculative_config: dict | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.speculative_config is not None and self.scheduler != "continuous":
            raise ValueError("speculative_config needs scheduler='continuous' (drafts ride in its steps)")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.policy == "fair" and self.scheduler != "continuous":
            raise ValueError("policy='fair' needs scheduler='continuous' (the static batcher groups requests by queue)")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0 or None, got {self.kv_cache_bytes!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.enforce_eager not in (None, True, False):
            raise ValueError(f"enforce_eager must be True, False or None, got {self.enforce_eager!r}")

    def resolved_enforce_eager(self) -> bool:
        if self.enforce_eager is not None:
            return self.enforce_eager
        env = os.environ.get("TANDEM_ENFORCE_EAGER", "")
        if env not in ("", "0", "1"):
            raise ValueError(f"TANDEM_ENFORCE_EAGER must be 0 or 1, got {env!r}")
        return env == "1" if env else DEFAULT_ENFORCE_EAGER

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, memory: DeviceMemoryManager | None = None) -> None:
        from runtime.llm.loader import load_model, resolve_dtype
        from runtime.llm.runner import ModelRunner

        self.config = c = config or EngineConfig()
        settle_native_pools()  # see runtime/threads.py
        device = c.resolved_device()
        on_cpu = device == "cpu"
        self.dtype = resolve_dtype(c.dtype, device)
        if c.quantization == "int4" and (device != "cpu" or self.dtype != "bfloat16"):
            raise ValueError(
                f"quantization='int4' runs on CPU in bfloat16 (torch's int4 kernel takes bfloat16 activations; in "
                f"float32 it is 3x to 30x slower than the plain path), got device {device!r} and dtype {self.dtype!r}"
            )
        if c.quantization == "gguf" and device != "cpu":
            raise ValueError(f"quantization='gguf' runs on CPU (the kernel is C++ for x86), got device {device!r}")
        self.loaded = load_model(c.model, dtype=self.dtype, device=device, cache_dir=c.cache_dir)
        if c.quantization == "gguf" and self.loaded.gguf_path is None:
            raise ValueError(
                f"quantization='gguf' keeps a GGUF file's blocks, but model={c.model!r} is a Hugging Face folder: "
                "pass the .gguf file (or leave model out for the default SmolLM2 GGUF)"
            )
        self.quantization = c.quantization or self._as_shipped(on_cpu)
        self.tokenizer = self.loaded.tokenizer
        model_max = getattr(self.loaded.config, "max_position_embeddings", 2048) or 2048
        self.max_model_len = c.max_model_len or min(model_max, 2048)
        if self.max_model_len > model_max:
            raise ValueError(f"max_model_len must be <= the model's {model_max}, got {self.max_model_len}")
        max_num_seqs = c.max_num_seqs or (16 if on_cpu else 256)
        budget = c.max_num_batched_tokens or (256 if on_cpu else 2048)
        sched_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            policy=c.policy,
            tenant_weights=dict(c.tenant_weights or {}),
            speculative_config=c.speculative_config,
        )
        self.memory = memory or DeviceMemoryManager(MemoryConfig(device=device))
        self.runner = ModelRunner(
            self.loaded,
            self.memory,
            block_size=c.block_size,
            kv_cache_bytes=c.kv_cache_bytes,
            num_kv_blocks=c.num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_prefix_caching=c.enable_prefix_caching,
            dtype=self.dtype,
            device=device,
            quantization=self.quantization,
            enforce_eager=c.resolved_enforce_eager(),
            cache_dir=c.cache_dir,
        )
        pool = self.runner.kv_pool
        if c.scheduler == "static":
            batching = DynamicBatchConfig(max_batch_size=max_num_seqs, max_queue_delay_ms=c.static_max_queue_delay_ms)
            self.scheduler = StaticBatchScheduler(sched_config, pool, batching)
        else:
            self.scheduler = ContinuousBatchScheduler(sched_config, pool)
        self.vocab_size = int(self.loaded.config.vocab_size)
        self.eos_token_ids = frozenset(t for t in self.loaded.eos_token_ids if 0 <= t < self.vocab_size)
        self.core = EngineCore(self.scheduler, self.runner)
        self.inputs = InputProcessor(
            self.tokenizer,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            kv_capacity_tokens=pool.num_blocks * pool.block_size,
            max_num_seqs=max_num_seqs,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self._deadlines = QueueDeadlines()
        self.groups: dict[str, ParentRequest] = {}  # requests of n > 1 choices in flight, by id

    # The core counts its steps; read here, where the Runtime, benches and tests look.
    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def num_failed_steps(self) -> int:
        return self.core.num_failed_steps

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens whose KV the engine computed: prefix-cache hits and the prompts that
        forked choices share are not counted; a recompute after preemption is."""
        return self.scheduler.stats().num_computed_prompt_tokens

    @property
    def last_step_shape(self) -> tuple[int, int]:
        """(requests, tokens) of the last step, for cost models."""
        return self.core.last_step_shape

    # ---- requests in ------------------------------------------------------------------------

    def _as_shipped(self, on_cpu: bool) -> str:
        """quantization=None: a GGUF file keeps its blocks on CPU when the kernel is there (its
        build failing leaves a warning and the float path, not the torch fallback's pace)."""
        if self.loaded.gguf_path is not None and on_cpu:
            from kernels import quant_linear

            if quant_linear.available():
                return "gguf"
        return "float"

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return self.inputs.tokenize(prompt)

    def prepare(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
        num_resumed_outputs: int = 0,
        *,
        tenant: str = "",
        tier: str = "interactive",
    ) -> PreparedRequest:
        """Check and tokenize a request; safe on any thread. ValueError names the field (see
        InputProcessor.prepare for `deadline_s`, `num_resumed_outputs`, `tenant` and `tier`)."""
        return self.inputs.prepare(
            prompt, params, request_id, priority, deadline_s, num_resumed_outputs, tenant=tenant, tier=tier
        )

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler (made on first use; safe on any thread)."""
        return self.inputs.grammar_compiler()

    def apply_chat_template(self, conversation: list[dict]) -> str:
        """The prompt text of a conversation ({"role", "content"} dicts); safe on any thread."""
        return self.inputs.apply_chat_template(conversation)

    def add_prepared(self, p: PreparedRequest, sink: Sink | None = None) -> str:
        """Queue a prepared request (on the engine's thread). With a sink, every step that
        adds text hands it a streamed output, and the final output goes there too."""
        rid = p.request_id
        if rid in self.outputs.requests or rid in self.groups:
            raise ValueError(f"request_id {rid!r} is already in use")
        if p.params.num_choices > 1:
            return self._add_choices(p, sink)
        req = self.inputs.to_request(p)
        if p.deadline is not None:
            self._deadlines.add(p.deadline, rid)
        t, done = self.outputs.new_request(req, p, sink)
        if done is not None:
            # Complete already: never scheduled, so nothing holds blocks or runner state.
            self.outputs.track(t)
            self._finish(t, done, time.monotonic())
            return rid
        compiler = self.inputs.grammar_compiler() if p.grammar is not None else None
        self.core.add_request(req, p, compiler)  # may refuse it (ValueError): then it is not tracked
        self.outputs.track(t)
        return rid

    def _add_choices(self, p: PreparedRequest, sink: Sink | None) -> str:
        """Queue a request of n > 1 choices: one request per choice, the first leading."""
        g = ParentRequest(p, sink)
        choices = g.choices(p)
        for c in choices:
            if c.request_id in self.outputs.requests or c.request_id in self.groups:
                raise ValueError(f"request_id {p.request_id!r} is already in use (by its choice {c.request_id!r})")
        reqs = [self.inputs.to_request(c) for c in choices]
        reqs[0].followers = reqs[1:]
        states = []
        for k, (req, c) in enumerate(zip(reqs, choices)):
            t, _ = self.outputs.new_request(req, c, g.choice_sink(k))
            t.group, t.index = g, k
            if not g.reports_logprobs:
                t.logprobs = None  # computed for best_of's ranking alone
            states.append(t)
        if p.deadline is not None:
            self._deadlines.add(p.deadline, choices[0].request_id)
        compiler = self.inputs.grammar_compiler() if p.grammar is not None else None
        self.core.add_request(reqs[0], choices[0], compiler, choices[1:])  # may refuse it: then nothing is tracked
        for t in states:
            self.outputs.track(t)
        self.groups[p.request_id] = g
        return p.request_id

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        sink: Sink | None = None,
        deadline_s: float | None = None,
        num_resumed_outputs: int = 0,
        *,
        tenant: str = "",
        tier: str = "interactive",
    ) -> str:
        """Queue a request; raises ValueError (naming the field) if it can never run. Nothing
        else in flight is touched by a rejected request."""
        prepared = self.prepare(
            prompt, params, request_id, priority, deadline_s, num_resumed_outputs, tenant=tenant, tier=tier
        )
        return self.add_prepared(prepared, sink)

    def abort(self, request_id: str, error: str | None = None, error_code: str | None = None) -> bool:
        """End a request wherever it is (its blocks return at once); False if unknown. A request
        of n > 1 choices ends every choice (a choice's id ends that choice alone)."""
        g = self.groups.get(request_id)
        if g is not None:
            for cid in reversed(g.unfinished_ids()):  # followers first: the leader forks nobody
                self.abort(cid, error, error_code)
            return True
        t = self.outputs.requests.get(request_id)
        if t is None or not self.core.abort(request_id):
            return False
        t.error, t.error_code = error, error_code
        self._finish(t, "abort", time.monotonic())
        return True

    def abort_all(self, error: str, error_code: str) -> int:
        """End every request not yet finished with `error` (the Runtime closing or broken);
        returns how many. On the engine's thread, or once nobody steps it any more."""
        return sum(self.abort(rid, error, error_code) for rid in list(self.outputs.requests))

    def next_step_shape(self) -> tuple[int, int]:
        """A guess of the next step's (requests, tokens), before planning it: running requests
        decode one token each, and if anyone waits for a slot, a prefill fills the budget."""
        return self.core.next_step_shape()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def close(self) -> None:
        """Give the device memory back (weights, activations, KV pool). The engine is unusable after."""
        self.runner.release_memory()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. Returns the outputs of requests that finished in it (streamed
        outputs go to each request's sink)."""
        now = time.monotonic()
        finished = self.expire_queued(now) if self._deadlines else []
        step = self.core.step(now)
        finished += self._fail(step.rejected, now)
        if step.plan.is_empty:
            return finished
        self.outputs.mark_scheduled(step.plan.new_requests, now)
        if step.outputs is None:  # the runner raised
            return finished + self._fail(step.failed_step, time.monotonic())
        finished += self._fail(step.refused, now)
        outs = step.outputs
        now = time.monotonic()
        ended, streamed = self.outputs.process(outs, step.logprobs, now, step.prompt_logprobs)
        for rid, reason in ended.items():  # the scheduler hears first: their blocks return
            if reason == "stop":
                self.core.stop(rid)
            else:
                self.core.abort(rid)
        requests = self.outputs.requests
        for rid, reason in outs.finished.items():
            t = requests.get(rid)
            if t is not None and (out := self._finish(t, reason, now)) is not None:
                finished.append(out)
        self.outputs.stream(streamed)
        return finished

    def next_deadline(self) -> float | None:
        """The earliest deadline of a request that may still be queued (monotonic seconds)."""
        return self._deadlines.next()

    def expire_queued(self, now: float) -> list[RequestOutput]:
        """Reject requests whose deadline passed before they were first scheduled. One that
        is already running goes on; its metrics say whether it missed."""
        out = []
        for deadline, rid in self._deadlines.pop_due(now):
            t = self.outputs.requests.get(rid)
            if t is None or t.metrics.first_scheduled_time is not None:
                continue
            self.core.abort(rid)
            f = failures.missed(rid, t.metrics.arrival_time, deadline, now)
            t.error, t.error_code = f.message, f.code
            if (done := self._finish(t, "abort", now)) is not None:
                out.append(done)
        return out

    def _fail(self, failed: dict[str, Failure], now: float) -> list[RequestOutput]:
        """End each request of `failed` with its error."""
        out = []
        requests = self.outputs.requests
        for rid, f in failed.items():
            t = requests.get(rid)
            if t is not None:
                t.error, t.error_code = f.message, f.code
                if (done := self._finish(t, "abort", now)) is not None:
                    out.append(done)
        return out

    def _finish(self, t: RequestState, reason: str, now: float) -> RequestOutput | None:
        """End `t`; its final output, or for a choice of n > 1, the request's once its last
        choice ends (None before: it goes to no sink, and no caller returns it)."""
        self.core.release(t.req.request_id)
        out = self.outputs.finish(t, reason, now)
        g = t.group
        if g is None:
            return out
        final = g.finish_choice(t.index, out)
        if final is not None:
            self.groups.pop(g.request_id, None)
            if g.sink is not None:
                g.sink(final)
            return final
        if out.error is not None:  # a choice that fails fails the request: its error ends the others
            requests = self.outputs.requests
            for cid in reversed(g.unfinished_ids()):
                s = requests.get(cid)
                if s is not None and self.core.abort(cid):  # else it ended in this step: it comes next
                    s.error, s.error_code = out.error, out.error_code
                    final = self._finish(s, "abort", now) or final
        return final

    # ---- streaming --------------------------------------------------------------------------

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, **kw) -> Iterator[RequestOutput]:
        """Add a request and yield its outputs as text arrives, driving steps from this thread.
        The last output has finished=True. Other requests in flight advance too."""
        pending: list[RequestOutput] = []
        rid = self.add_request(prompt, params, sink=pending.append, **kw)
        try:
            while True:
                while pending:
                    out = pending.pop(0)
                    yield out
                    if out.finished:
                        return
                self.step()
        finally:
            if rid in self.outputs.requests or rid in self.groups:  # the consumer stopped early
                self.abort(rid)
