"""InputProcessor: a request as the caller gives it, checked and tokenized into a
PreparedRequest, then turned into the scheduler's Request. Safe on any thread: the Runtime calls
`prepare()` on its callers' threads, so that a bad request is their ValueError, at once, naming
the field, before anything is queued.

Structured outputs (params.structured_outputs; runtime/llm/structured.py): `prepare()` compiles
the spec (cached per spec) and makes the request's matcher, so a bad spec is a ValueError
naming structured_outputs.<kind> on the caller's thread, and the engine's thread never waits on
a compile.

Resumed requests (`num_resumed_outputs=n`): the last n prompt token ids are the request's own
earlier outputs (a job resumed after its worker died, with the tokens it had streamed). The
caller passes the request's ORIGINAL SamplingParams (max_tokens, min_tokens, seed untouched);
the n tokens count as outputs already made, so the rest is what an uninterrupted run would have
produced:
  - max_tokens / min_tokens count them (the scheduler gets max_tokens - n and min_tokens - n;
    max_tokens is checked against the context as for the original prompt; None = what the
    context leaves after all the tokens);
  - presence / frequency penalties count them as sampled; a seeded request's random stream
    goes on at output index n (the runner, told n, does both; no `resumed_seed` needed);
  - the grammar matcher replays them here (a refused one: ValueError naming
    num_resumed_outputs);
  - the detokenizer is seeded with them (runtime/llm/output_processor.py), so a stop string
    spanning the resume point is found.
A request already complete after its n tokens (max_tokens reached, the last one a stop token
past min_tokens, or a terminated grammar) gets `done_reason` here; a stop string in their text
is the detokenizer's to find, when the request is queued.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

from runtime.llm.detokenizer import PromptBound
from runtime.llm.sampling_params import SamplingParams
from runtime.llm.structured import GrammarCompiler, GrammarMatcher
from schedulers import Request, StopCriteria
from schedulers.request import TIERS


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
    # n > 1 (or best_of) with structured outputs: the matchers of choices 1, 2, ... (choice 0's
    # is `grammar`), one per choice, as each advances on its own tokens.
    choice_grammars: list[GrammarMatcher] | None = None
    tenant: str = ""  # fair shares (policy="fair"); "" = anonymous
    tier: str = "interactive"  # or "batch": fills the slots interactive traffic leaves

    @property
    def resumed_token_ids(self) -> list[int]:
        """The earlier outputs a resumed request came with ([] for a fresh one)."""
        n = self.num_resumed_outputs
        return self.token_ids[len(self.token_ids) - n :] if n else []


class InputProcessor:
    """Checks and tokenizes requests for one model. `kv_capacity_tokens` is what the whole KV
    pool holds, the ceiling of a request whose max_tokens is None."""

    def __init__(
        self,
        tokenizer,
        *,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        kv_capacity_tokens: int,
        max_num_seqs: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs  # the most choices (n, best_of) one request may make
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens
        # Read on any thread; made once here, before any request.
        self.prompt_bound = PromptBound.of(tokenizer) if tokenizer is not None else None
        self._ids = itertools.count()
        self._ids_lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        # Made on the first constrained request, not here: building llguidance's view of the
        # tokenizer took 1.15 s for SmolLM2's 49k tokens (2 busy cores), a cost every engine
        # start would pay for a feature most of them never use.
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string or a non-empty list of token ids, got ''")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass a list of token ids")
            # A prompt whose bytes alone prove it too long is refused before tokenizing: encoding
            # megabytes only to count them past the limit would hold the tokenizer (and its lock).
            bound = self.prompt_bound
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
        *,
        tenant: str = "",
        tier: str = "interactive",
    ) -> PreparedRequest:
        """Check and tokenize a request. ValueError names the field. `tenant` ("" anonymous) and
        `tier` ("interactive" or "batch") are the scheduler's (schedulers/fair.py, and
        schedulers/continuous.py's tiers). `deadline_s` (seconds from
        now): if the request is still queued then, it is rejected. `num_resumed_outputs`: how
        many of the prompt's last tokens are this request's earlier outputs (see the module
        docstring); `params` are then the original request's."""
        if deadline_s is not None and (
            isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0
        ):
            raise ValueError(f"deadline_s must be a number of seconds > 0 or None, got {deadline_s!r}")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string ('' = anonymous), got {tenant!r}")
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
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
        if params.prompt_logprobs is not None and self.tokenizer is None:
            raise ValueError("prompt_logprobs: token texts need a tokenizer; this model has none")
        choices = params.num_choices
        if choices > 1:
            name = "n" if params.best_of is None else "best_of"
            if self.max_num_seqs is not None and choices > self.max_num_seqs:
                raise ValueError(
                    f"{name} must be at most max_num_seqs ({self.max_num_seqs}): the choices decode side by side, "
                    f"got {choices}"
                )
            if n:
                raise ValueError(f"num_resumed_outputs must be 0 for a request of {name}={choices} choices, got {n}")
        max_tokens, done = self._max_tokens(params, len(ids), n)
        # Token ids index [rows, vocab] tensors in the sampler: one out of range there would
        # fail the whole step, so it is refused here, on the caller's thread.
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids must be token ids in [0, {self.vocab_size}) (the model's vocabulary), got {bad[:4]!r}"
            )
        grammar = None
        choice_grammars = None
        if params.structured_outputs is not None:
            self._check_spellable(params.structured_outputs)
            compiled = self.grammar_compiler().compile(params.structured_outputs)
            grammar = compiled.matcher()
            if choices > 1:
                choice_grammars = [compiled.matcher() for _ in range(choices - 1)]
            if n:
                self._replay_grammar(grammar, ids[-n:])
        if n and done is None:
            done = self._resumed_done(params, ids[-n:], grammar)
        with self._ids_lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        now = time.monotonic()
        deadline = None if deadline_s is None else now + deadline_s
        return PreparedRequest(
            rid, text, ids, params, priority, now, deadline, max_tokens, grammar, n, done, choice_grammars, tenant, tier
        )

    def to_request(self, p: PreparedRequest) -> Request:
        """The scheduler's view of a prepared request. Its stop criteria count only what this
        request samples: a resumed request's earlier outputs are taken off min_tokens (and
        were taken off max_tokens in prepare)."""
        params = p.params
        if (params.structured_outputs is None) != (p.grammar is None):
            raise ValueError("structured_outputs: a request is queued with its matcher from prepare(), and only then")
        min_tokens = min(max(0, params.min_tokens - p.num_resumed_outputs), p.max_tokens)
        return Request(
            p.request_id,
            p.token_ids,
            StopCriteria(p.max_tokens, min_tokens, self._stop_ids(params)),
            priority=p.priority,
            arrival_time=p.arrival_time,
            sampling=params,
            tenant=p.tenant,
            tier=p.tier,
            # Prompt logprobs need every prompt position's logits, so such a request computes its
            # whole prompt, as vLLM does (its blocks still enter the cache for others).
            skip_prefix_cache=params.prompt_logprobs is not None,
            # Speculation drafts only where verification keeps the request exact with nothing
            # per position but its temperature, top-k, top-p and min-p (runtime/llm/spec_verify.py):
            # penalties, grammars, logprobs, seeds and stop strings decode one token a step.
            spec_ok=params.speculate
            and not (
                params.has_penalties
                or params.structured_outputs is not None
                or params.logprobs is not None
                or params.seed is not None
                or params.stop
            ),
        )

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return frozenset(stop_ids)

    def apply_chat_template(self, conversation: list[dict]) -> str:
        """The prompt text of a conversation ({"role", "content"} dicts)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template; use plain prompts")
        if not isinstance(conversation, list) or not conversation:
            raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {conversation!r}")
        for i, m in enumerate(conversation):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")
        with self._tokenizer_lock:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)

    def grammar_compiler(self) -> GrammarCompiler:
        """The grammar compiler (made on first use)."""
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

    def _check_spellable(self, spec: dict) -> None:
        """Refuse a choice the model cannot write: a byte-level vocabulary may lack tokens for
        some bytes (SmolLM2 has none for 21 of them, e.g. 0x01), and a choice holding one forces
        bytes no token gives, so the grammar fails mid-generation (found by the fuzz test). A
        JSON schema or regex may hit the same wall; that is then the abort at the token."""
        bound = self.prompt_bound
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
        (a stop string in their text is the detokenizer's to find, when the request is queued)."""
        if grammar is not None and grammar.is_terminated:
            return "stop"
        if len(resumed) >= params.min_tokens and resumed[-1] in self._stop_ids(params):
            return "stop"
        return None

    def _max_tokens(self, params: SamplingParams, num_tokens: int, num_resumed: int = 0) -> tuple[int, str | None]:
        """The scheduler's output limit (what is left after `num_resumed` earlier outputs), and
        "length" when nothing is left. An explicit max_tokens the context cannot hold is refused
        (it used to be cut to fit without a word, and the request ended "length" early), checked
        against the original prompt, as on the request's first attempt; None takes what the
        context leaves after all `num_tokens`, within what the whole KV pool can hold."""
        num_prompt = num_tokens - num_resumed
        room = self.max_model_len - num_prompt
        why = f"(max_model_len {self.max_model_len} minus the prompt's {num_prompt} tokens)"
        if params.max_tokens == 0 and not num_resumed:  # scoring the prompt (prompt_logprobs): nothing to generate
            return 0, None
        if params.max_tokens is not None:
            if params.max_tokens > room:
                raise ValueError(f"max_tokens must be at most {room} {why}, got {params.max_tokens}")
            if num_resumed > params.max_tokens:
                raise ValueError(
                    f"num_resumed_outputs must be at most max_tokens={params.max_tokens}, got {num_resumed}"
                )
            left = params.max_tokens - num_resumed
            return (left, None) if left else (1, "length")
        room = min(room, self.kv_capacity_tokens - num_prompt)
        if params.min_tokens > max(1, room):
            raise ValueError(f"min_tokens must be at most {max(1, room)} {why}, got {params.min_tokens}")
        left = room - num_resumed
        if num_resumed and left <= 0:  # the earlier outputs filled the context: done, as they would have
            return 1, "length"
        return max(1, left), None
