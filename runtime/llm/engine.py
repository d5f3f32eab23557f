"""LLMEngine: requests in, tokens and text out. It owns one scheduler and one model runner and
turns each step's token ids into text, metrics and finished outputs:

    plan = scheduler.schedule(now)
    result = runner.execute(plan)
    outputs = scheduler.update(plan, result)

Not thread-safe: one thread drives `step()` (the caller's, or the Runtime's loop thread).
`prepare()` alone may be called from any thread, so that callers of the Runtime get their
ValueError at once, on their own thread.

A request's own data (token ids, sampling fields) enters the runner once, when it first joins
a step; the runner admits each newcomer on its own and reports the ones it could not admit
(`StepResult.failed`): those fail alone and the step goes on for everyone else, with the same
tokens. A runner exception inside the step itself fails exactly the requests of that step's
plan (aborted in the scheduler, so their KV blocks return, and dropped from the runner), each
with the error; the engine stays consistent and serves the rest.

Structured outputs (params.structured_outputs; runtime/llm/structured.py): `prepare()` compiles
the spec (cached per spec) and makes the request's matcher, so a bad spec is a ValueError
naming structured_outputs.<kind> on the caller's thread, before anything is queued. The matcher
lives from `add_prepared()` to `_finish()` in `runner.grammars`, where the runner finds it when
the request joins a step (again after a preemption, past the outputs it kept) and fills the
request's row of the allowed-token mask before sampling. After each step the engine feeds the
sampled token to the matcher; a terminated grammar (nothing but EOS may follow) finishes the
request "stop", and a token the grammar refuses (a bug, or a row with no allowed token left)
finishes it with an error.

Resumed requests (`num_resumed_outputs=n`): the last n prompt token ids are the request's own
earlier outputs (a job resumed after its worker died, with the tokens it had streamed). The
caller passes the request's ORIGINAL SamplingParams (max_tokens, min_tokens, seed untouched);
the engine treats the n tokens as outputs already made, so the rest is what an uninterrupted
run would have produced:
  - max_tokens / min_tokens count them (the scheduler gets max_tokens - n and min_tokens - n;
    max_tokens is checked against the context as for the original prompt; None = what the
    context leaves after all the tokens);
  - presence / frequency penalties count them as sampled; a seeded request's random stream
    goes on at output index n (no `resumed_seed` needed);
  - the grammar matcher replays them at prepare (a refused one: ValueError naming
    num_resumed_outputs);
  - the detokenizer is seeded with them, so a stop string spanning the resume point is found.
A request already complete after its n tokens (max_tokens reached, the last one a stop token
past min_tokens, a stop string in their text, or a terminated grammar) finishes at once, with
no step, "length" or "stop". Its outputs (token_ids, text, logprobs) hold only what is new:
`text` begins where a stream of the n tokens would have stopped emitting (the characters held
back for a stop string or an unfinished UTF-8 character come first), so that the earlier
attempt's streamed text followed by this one's is the whole text. `prompt_token_ids` stays the
whole prompt as passed, the n tokens included.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from runtime.llm.detokenizer import IncrementalDetokenizer, PromptBound, TokenTexts
from runtime.llm.outputs import RequestMetrics, RequestOutput
from runtime.llm.sampling_params import SamplingParams
from runtime.llm.structured import GrammarCompiler, GrammarMatcher
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
QUANTIZATIONS = (None, "int4")
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
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    static_max_queue_delay_ms: float = 0.0
    cache_dir: str | None = None  # converted GGUF models, and the captured step's inductor cache
    # None: weights in `dtype`. "int4": the decoder layers' weights held at 4 bits (groups of
    # 32, as GGUF's Q4_1), read by torch's CPU int4 kernel; CPU and bfloat16 only. Off by
    # default: see BENCHMARKS.md for its speed and quality figures.
    quantization: str | None = None
    # False: decode-only steps run a graph captured by torch.compile once it is compiled (on a
    # background thread; eager until then). True: always eager, as vLLM's flag. None: the
    # environment's TANDEM_ENFORCE_EAGER (1 or 0; the test suite sets 1), else the default.
    enforce_eager: bool | None = None

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
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


Sink = Callable[[RequestOutput], None]


@dataclass(slots=True)
class PreparedRequest:
    """A checked, tokenized request, made on the caller's thread (`LLMEngine.prepare`) and
    queued on the engine's thread (`LLMEngine.add_prepared`)."""

    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    deadline: float | None = None  # monotonic seconds; past it, a still-queued request is rejected
    max_tokens: int = 16  # params.max_tokens, or what the context leaves when that is None
    grammar: GrammarMatcher | None = None  # params.structured_outputs compiled, one matcher per request
    num_resumed_outputs: int = 0  # the last n of token_ids are this request's earlier outputs
    done_reason: str | None = None  # "stop" / "length": complete already after the resumed outputs


class _Tracked:
    """The engine's side of one request: what the scheduler does not need to know."""

    __slots__ = (
        "req",
        "prompt",
        "params",
        "metrics",
        "detok",
        "sink",
        "error",
        "error_code",
        "num_sent",
        "logprobs",
        "grammar",
        "resumed_ids",
    )

    def __init__(self, req: Request, prompt: str | None, params: SamplingParams, metrics: RequestMetrics) -> None:
        self.req = req
        self.prompt = prompt
        self.params = params
        self.metrics = metrics
        self.detok: IncrementalDetokenizer | None = None
        self.sink: Sink | None = None  # gets every streamed output, and the final one
        self.error: str | None = None
        self.error_code: str | None = None
        self.num_sent = 0  # output tokens already handed to the sink
        self.logprobs: list[dict] | None = None if params.logprobs is None else []  # one per output token
        self.grammar: GrammarMatcher | None = None
        self.resumed_ids: list[int] = []  # the earlier outputs a resumed request came with


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
        self.loaded = load_model(c.model, dtype=self.dtype, device=device, cache_dir=c.cache_dir)
        self.tokenizer = self.loaded.tokenizer
        # Read on any thread (prepare); made once here, before any request.
        self._prompt_bound = PromptBound.of(self.tokenizer) if self.tokenizer is not None else None
        self._token_texts = TokenTexts(self.tokenizer) if self.tokenizer is not None else None
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
            quantization=c.quantization,
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
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._ids_lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self.num_steps = 0
        self.num_failed_steps = 0
        self.last_step_shape = (0, 0)  # (requests, tokens) of the last step, for cost models
        self._deadlines: list[tuple[float, str]] = []  # (deadline, request id), a heap
        # Made on the first constrained request, not here: building llguidance's view of the
        # tokenizer took 1.15 s for SmolLM2's 49k tokens (2 busy cores), a cost every engine
        # start would pay for a feature most of them never use.
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    # ---- requests in ------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string or a non-empty list of token ids, got ''")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass a list of token ids")
            # A prompt whose bytes alone prove it too long is refused before tokenizing: encoding
            # megabytes only to count them past the limit would hold the tokenizer (and its lock).
            bound = self._prompt_bound
            if bound is not None and (least := bound.min_tokens(prompt)) >= self.max_model_len:
                raise ValueError(
                    f"prompt is too long: its {len(prompt.encode('utf-8', 'surrogatepass'))} bytes of UTF-8 make at "
                    f"least {least} tokens (no token of this tokenizer covers more than {bound.longest} bytes), but "
                    f"max_model_len is {self.max_model_len}: the prompt must be shorter than max_model_len"
                )
            with self._tokenizer_lock:  # HF fast tokenizers are not safe to share across threads
                return prompt, self.tokenizer.encode(prompt, add_special_tokens=False) or []
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"prompt must be a non-empty string or a non-empty list of token ids, got {prompt!r}")
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {ids[:8]!r}...")
        return None, ids

    def prepare(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        deadline_s: float | None = None,
        num_resumed_outputs: int = 0,
    ) -> PreparedRequest:
        """Check and tokenize a request; safe on any thread. ValueError names the field.
        `deadline_s` (seconds from now): if the request is still queued then, it is rejected.
        `num_resumed_outputs`: how many of the prompt's last tokens are this request's earlier
        outputs (see the module docstring); `params` are then the original request's."""
        if deadline_s is not None and (
            isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0
        ):
            raise ValueError(f"deadline_s must be a number of seconds > 0 or None, got {deadline_s!r}")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"request_id must be a non-empty string or None, got {request_id!r}")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt must encode to at least one token")
        n = num_resumed_outputs
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < len(ids):
            raise ValueError(
                f"num_resumed_outputs must be an integer in [0, {len(ids) - 1}] (the prompt's {len(ids)} tokens, "
                f"at least one of them the original prompt), got {n!r}"
            )
        if len(ids) - n >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids) - n} tokens, but max_model_len is {self.max_model_len}: "
                f"the prompt must be shorter than max_model_len to generate anything"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; this model has none")
        if params.logprobs is not None and self.tokenizer is None:
            raise ValueError("logprobs: token texts need a tokenizer; this model has none")
        max_tokens, done = self._max_tokens(params, len(ids), n)
        # Token ids index [rows, vocab] tensors in the sampler: one out of range there would
        # fail the whole step, so it is refused here, on the caller's thread.
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids must be token ids in [0, {self.vocab_size}) (the model's vocabulary), got {bad[:4]!r}"
            )
        grammar = None
        if params.structured_outputs is not None:
            # Compiled here, on the caller's thread: a schema the grammar engine refuses is the
            # caller's ValueError, and the engine's thread never waits on a compile.
            self._check_spellable(params.structured_outputs)
            grammar = self.grammar_compiler().compile(params.structured_outputs).matcher()
            if n:
                self._replay_grammar(grammar, ids[-n:])
        if n and done is None:
            done = self._resumed_done(params, ids[-n:], grammar)
        with self._ids_lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        now = time.monotonic()
        deadline = None if deadline_s is None else now + deadline_s
        return PreparedRequest(rid, text, ids, params, priority, now, deadline, max_tokens, grammar, n, done)

    @staticmethod
    def _replay_grammar(grammar: GrammarMatcher, resumed: list[int]) -> None:
        """Bring a resumed request's matcher to where its earlier outputs left it."""
        grammar.reset()
        for i, tok in enumerate(resumed):
            if not grammar.accept_token(tok):
                why = (grammar.error.strip().splitlines() or ["no reason given"])[0][:400]
                raise ValueError(
                    f"num_resumed_outputs: the grammar of structured_outputs does not allow the resumed output "
                    f"{i} (token {tok}): {why}"
                )

    def _resumed_done(self, params: SamplingParams, resumed: list[int], grammar: GrammarMatcher | None) -> str | None:
        """ "stop" when the earlier outputs already ended the request by token id or grammar
        (a stop string in their text is the detokenizer's to find, in add_prepared)."""
        if grammar is not None and grammar.is_terminated:
            return "stop"
        if len(resumed) >= params.min_tokens:
            stop_ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids |= self.eos_token_ids
            if resumed[-1] in stop_ids:
                return "stop"
        return None

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler (made on first use; safe on any thread)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs: grammars need a tokenizer; this model has none")
                try:
                    self._grammar_compiler = GrammarCompiler(
                        self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids
                    )
                except ValueError as e:  # a tokenizer wider than the model's logits
                    raise ValueError(f"structured_outputs: this model cannot be constrained: {e}") from None
            return self._grammar_compiler

    def _max_tokens(self, params: SamplingParams, num_tokens: int, num_resumed: int = 0) -> tuple[int, str | None]:
        """The scheduler's output limit (what is left after `num_resumed` earlier outputs), and
        "length" when nothing is left. An explicit max_tokens the context cannot hold is refused
        (it used to be cut to fit without a word, and the request ended "length" early), checked
        against the original prompt, as on the request's first attempt; None takes what the
        context leaves after all `num_tokens`, within what the whole KV pool can hold."""
        num_prompt = num_tokens - num_resumed
        room = self.max_model_len - num_prompt
        why = f"(max_model_len {self.max_model_len} minus the prompt's {num_prompt} tokens)"
        if params.max_tokens is not None:
            if params.max_tokens > room:
                raise ValueError(f"max_tokens must be at most {room} {why}, got {params.max_tokens}")
            if num_resumed > params.max_tokens:
                raise ValueError(
                    f"num_resumed_outputs must be at most max_tokens={params.max_tokens}, got {num_resumed}"
                )
            left = params.max_tokens - num_resumed
            return (left, None) if left else (1, "length")
        pool = self.runner.kv_pool
        room = min(room, pool.num_blocks * pool.block_size - num_prompt)
        if params.min_tokens > max(1, room):
            raise ValueError(f"min_tokens must be at most {max(1, room)} {why}, got {params.min_tokens}")
        left = room - num_resumed
        if num_resumed and left <= 0:  # the earlier outputs filled the context: done, as they would have
            return 1, "length"
        return max(1, left), None

    def add_prepared(self, p: PreparedRequest, sink: Sink | None = None) -> str:
        """Queue a prepared request (on the engine's thread). With a sink, every step that
        adds text hands it a streamed output, and the final output goes there too."""
        rid = p.request_id
        if rid in self._tracked:
            raise ValueError(f"request_id {rid!r} is already in use")
        params = p.params
        if (params.structured_outputs is None) != (p.grammar is None):
            raise ValueError("structured_outputs: a request is queued with its matcher from prepare(), and only then")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        n = p.num_resumed_outputs
        # The scheduler counts only what this request samples: the earlier outputs are taken off.
        min_tokens = min(max(0, params.min_tokens - n), p.max_tokens)
        req = Request(
            rid,
            p.token_ids,
            StopCriteria(p.max_tokens, min_tokens, frozenset(stop_ids)),
            priority=p.priority,
            arrival_time=p.arrival_time,
            sampling=params,
        )
        t = _Tracked(req, p.prompt, params, RequestMetrics(arrival_time=p.arrival_time, deadline=p.deadline))
        t.resumed_ids = p.token_ids[len(p.token_ids) - n :] if n else []
        if p.deadline is not None:
            heapq.heappush(self._deadlines, (p.deadline, rid))
        if self.tokenizer is not None:
            # One detokenizer gives both the stream and the final text. It runs every step only
            # where text must be seen as it comes (a sink, or stop strings); else once, at the end.
            t.detok = IncrementalDetokenizer(
                self.tokenizer,
                p.token_ids[: len(p.token_ids) - n],
                params.stop,
                params.skip_special_tokens,
                params.min_tokens,
                params.include_stop_str_in_output,
                resumed_token_ids=t.resumed_ids,
            )
        t.sink = sink
        t.grammar = p.grammar
        done = p.done_reason
        if done is None and t.detok is not None and t.detok.stop_at is not None:
            done = "stop"  # a stop string in the earlier outputs' text
        if done is not None:
            # Complete already: never scheduled, so nothing holds blocks or runner state.
            self._tracked[rid] = t
            self._finish(t, done, time.monotonic())
            return rid
        self.scheduler.add_request(req)
        if p.grammar is not None:
            self.runner.grammar_compiler = self._grammar_compiler
            self.runner.grammars[rid] = p.grammar
        if n:
            self.runner.num_resumed_outputs[rid] = n
        self._tracked[rid] = t
        return rid

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        sink: Sink | None = None,
        deadline_s: float | None = None,
        num_resumed_outputs: int = 0,
    ) -> str:
        """Queue a request; raises ValueError (naming the field) if it can never run. Nothing
        else in flight is touched by a rejected request."""
        prepared = self.prepare(prompt, params, request_id, priority, deadline_s, num_resumed_outputs)
        return self.add_prepared(prepared, sink)

    def abort(self, request_id: str, error: str | None = None, error_code: str | None = None) -> bool:
        """End a request wherever it is (its blocks return at once); False if unknown."""
        t = self._tracked.get(request_id)
        if t is None or not self.scheduler.abort(request_id):
            return False
        t.error, t.error_code = error, error_code
        self._finish(t, "abort", time.monotonic())
        return True

    def abort_all(self, error: str, error_code: str) -> int:
        """End every request not yet finished with `error` (the Runtime closing or broken);
        returns how many. On the engine's thread, or once nobody steps it any more."""
        return sum(self.abort(rid, error, error_code) for rid in list(self._tracked))

    def apply_chat_template(self, conversation: list[dict]) -> str:
        """The prompt text of a conversation ({"role", "content"} dicts); safe on any thread."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template; use plain prompts")
        if not isinstance(conversation, list) or not conversation:
            raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {conversation!r}")
        for i, m in enumerate(conversation):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")
        with self._tokenizer_lock:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)

    def next_step_shape(self) -> tuple[int, int]:
        """A guess of the next step's (requests, tokens), before planning it: running requests
        decode one token each, and if anyone waits for a slot, a prefill fills the budget."""
        s = self.scheduler
        load = s.stats()
        running, waiting = load.num_running, load.num_waiting
        if waiting and running < s.config.max_num_seqs:
            return min(s.config.max_num_seqs, running + waiting), s.config.max_num_batched_tokens
        return running, running

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Give the device memory back (weights, activations, KV pool). The engine is unusable after."""
        self.runner.release_memory()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration. Returns the outputs of requests that finished in it (streamed
        outputs go to each request's sink)."""
        now = time.monotonic()
        finished = self.expire_queued(now) if self._deadlines else []
        plan = self.scheduler.schedule(now)
        for rid, msg in plan.rejected.items():
            t = self._tracked.get(rid)
            if t is not None:
                t.error, t.error_code = msg, "queue_timeout"
                finished.append(self._finish(t, "abort", now))
        if plan.is_empty:
            return finished
        for new in plan.new_requests:
            t = self._tracked.get(new.request_id)
            if t is not None and t.metrics.first_scheduled_time is None:
                t.metrics.first_scheduled_time = now
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # noqa: BLE001 - one step's failure stays with its requests
            return finished + self._fail_step(plan, exc)
        if result.failed:  # requests the runner could not admit: they alone fail, the step went on
            finished += self._fail_requests(result.failed, now)
        outs = self.scheduler.update(plan, result)
        self.num_steps += 1
        self.last_step_shape = (plan.num_reqs, plan.total_tokens)
        now = time.monotonic()
        tracked = self._tracked
        streamed: list[_Tracked] = []
        logprobs = result.logprobs
        for rid, tokens in zip(outs.req_ids, outs.new_token_ids):
            if not tokens:
                continue
            t = tracked.get(rid)
            if t is None:
                continue
            if t.logprobs is not None:  # the runner sent (ids, logprobs) for its one new token
                t.logprobs.append(self._logprob_entry(*logprobs[rid]))
            if t.grammar is not None and not self._advance_grammar(t, tokens, outs.finished):
                continue  # finished with an error: no text to stream
            times = t.metrics.token_times
            if not times:
                t.metrics.first_token_time = now
            times.append(now)
            detok = t.detok
            if detok is not None and (t.sink is not None or t.params.stop):
                detok.add(tokens)
                if detok.stop_at is not None and rid not in outs.finished:
                    self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                    outs.finished[rid] = "stop"
            if t.sink is not None:
                streamed.append(t)
        for rid, reason in outs.finished.items():
            t = tracked.get(rid)
            if t is not None:
                finished.append(self._finish(t, reason, now))
        for t in streamed:
            if t.req.request_id in tracked:
                t.sink(self._output(t, None))
        return finished

    def _check_spellable(self, spec: dict) -> None:
        """Refuse a choice the model cannot write: a byte-level vocabulary may lack tokens for
        some bytes (SmolLM2 has none for 21 of them, e.g. 0x01), and a choice holding one forces
        bytes no token gives, so the grammar fails mid-generation (found by the fuzz test). A
        JSON schema or regex may hit the same wall; that is then the abort at the token."""
        bound = self._prompt_bound
        if bound is None or "choice" not in spec or not isinstance(spec["choice"], list):
            return
        for i, choice in enumerate(spec["choice"]):
            data = choice.encode("utf-8", "surrogatepass") if isinstance(choice, str) else b""
            missing = sorted({b[0] for b in bound.dropped if b in data})
            if missing:
                raise ValueError(
                    f"structured_outputs.choice[{i}] holds byte(s) {[hex(b) for b in missing]} that this model's "
                    "tokenizer has no token for, so the model cannot write it"
                )

    def _advance_grammar(self, t: _Tracked, tokens: list[int], finished: dict[str, str]) -> bool:
        """Feed the step's tokens to the request's matcher. A terminated grammar finishes the
        request "stop" (even under ignore_eos or before min_tokens: only EOS could follow); a
        refused token finishes it with an error (False)."""
        g, rid = t.grammar, t.req.request_id
        for tok in tokens:
            if not g.accept_token(tok):
                self.scheduler.abort(rid)
                # llguidance's message ends with the whole grammar: its first line says what failed.
                why = (g.error.strip().splitlines() or ["no reason given"])[0][:400]
                t.error = f"structured_outputs: the grammar does not allow the sampled token {tok}: {why}"
                t.error_code = "engine_error"
                finished[rid] = "abort"
                return False
        if g.is_terminated and rid not in finished:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            finished[rid] = "stop"
        return True

    def _logprob_entry(self, ids: list[int], values: list[float]) -> dict:
        """Contract B's entry for one token: the sampled token (ids[0]) and its top alternatives."""
        texts = self._token_texts
        entries = []
        for tid, lp in zip(ids, values):
            token, raw = texts(tid)
            entries.append({"token_id": tid, "token": token, "bytes": list(raw), "logprob": lp})
        first = entries[0]
        first["top"] = entries[1:]
        return first

    def next_deadline(self) -> float | None:
        """The earliest deadline of a request that may still be queued (monotonic seconds)."""
        return self._deadlines[0][0] if self._deadlines else None

    def expire_queued(self, now: float) -> list[RequestOutput]:
        """Reject requests whose deadline passed before they were first scheduled. One that
        is already running goes on; its metrics say whether it missed."""
        out = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, rid = heapq.heappop(heap)
            t = self._tracked.get(rid)
            if t is None or t.metrics.first_scheduled_time is not None:
                continue
            self.scheduler.abort(rid)
            waited = (now - t.metrics.arrival_time) * 1000
            t.error = (
                f"request {rid!r} waited {waited:.0f} ms in the queue, past its deadline of "
                f"{(deadline - t.metrics.arrival_time) * 1000:.0f} ms, and was not started"
            )
            t.error_code = "deadline_exceeded"
            out.append(self._finish(t, "abort", now))
        return out

    def _fail_step(self, plan, exc: Exception) -> list[RequestOutput]:
        """The runner raised: end every request of the plan with the error, give their blocks
        back and drop their runner state, so scheduler, pool and runner agree again."""
        self.num_failed_steps += 1
        ids = list(dict.fromkeys([*plan.req_ids, *(n.request_id for n in plan.new_requests)]))
        now = time.monotonic()
        failed = []
        message = f"the engine step failed: {type(exc).__name__}: {exc}"
        for rid in ids:
            self.scheduler.abort(rid)
            t = self._tracked.get(rid)
            if t is not None:
                t.error, t.error_code = message, "engine_error"
                failed.append(self._finish(t, "abort", now))
        self.runner.drop_requests(ids)
        return failed

    def _fail_requests(self, errors: dict[str, str], now: float) -> list[RequestOutput]:
        """End each request the runner refused (`errors`: id -> why) before the scheduler takes
        the step's result, so that it skips them and their blocks return."""
        failed = []
        for rid, why in errors.items():
            self.scheduler.abort(rid)
            t = self._tracked.get(rid)
            if t is not None:
                t.error, t.error_code = f"request {rid!r} failed: {why}", "invalid_request"
                failed.append(self._finish(t, "abort", now))
        return failed

    def _finish(self, t: _Tracked, reason: str, now: float) -> RequestOutput:
        t.metrics.finished_time = now
        self._tracked.pop(t.req.request_id, None)
        if t.grammar is not None:
            self.runner.grammars.pop(t.req.request_id, None)
        if t.resumed_ids:
            self.runner.num_resumed_outputs.pop(t.req.request_id, None)
        detok = t.detok
        if detok is not None:
            if t.sink is None and not t.params.stop:
                detok.add(t.req.output_token_ids)  # its one pass, at the end
            detok.finish()
        out = self._output(t, reason)
        if t.sink is not None:
            t.sink(out)
        return out

    def _output(self, t: _Tracked, reason: str | None) -> RequestOutput:
        """A snapshot (lists copied: outputs may cross to other threads while the request
        goes on). `delta_*` hold what is new since the last output handed to the sink."""
        req = t.req
        ids = req.output_token_ids
        detok = t.detok
        text = detok.visible_text() if detok is not None else ""
        delta = detok.take_delta(reason is not None) if detok is not None else ""
        sent = t.num_sent
        new_ids = ids[sent:]
        t.num_sent = len(ids)
        lps = t.logprobs
        return RequestOutput(
            req.request_id,
            t.prompt,
            req.prompt_token_ids,
            list(ids),
            text,
            reason,
            t.metrics,
            t.error,
            delta,
            new_ids,
            t.error_code,
            None if lps is None else list(lps),
            None if lps is None else lps[sent:],
            self._stop_reason(t) if reason == "stop" else None,
        )

    def _stop_reason(self, t: _Tracked) -> str | int | None:
        """vLLM's: the stop string found, else the stop token id that ended it; None for EOS
        (checked first, as vLLM does, when a stop token id is also an EOS id)."""
        detok = t.detok
        if detok is not None and detok.stop_str is not None:
            return detok.stop_str
        ids = t.req.output_token_ids or t.resumed_ids  # finished at once: the earlier outputs' last
        last = ids[-1] if ids else None
        if last is None or (not t.params.ignore_eos and last in self.eos_token_ids):
            return None
        return last if last in t.params.stop_token_ids else None

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
            if rid in self._tracked:  # the consumer stopped early
                self.abort(rid)
