"""SamplingParams, shaped like vLLM's so that users feel at home. Validated on construction:
a bad field raises ValueError naming the field and the allowed range. The fields are never
rewritten by the engine (one instance may serve many requests): what depends on the model
(max_tokens None, the greedy epsilon) is resolved where it is used."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from runtime.errors import OUT_OF_RANGE, FieldError

# structured.py imports neither torch nor llguidance at module level: workers/jobspec.py, which
# imports this module, stays torch-free.
from runtime.llm.structured import StructuredSpec

# Temperatures below this are greedy, as vLLM's _SAMPLING_EPS: 1/T overflows float32 long before
# T reaches 0 (T = 1e-320 made every logit inf, the softmax NaN, and the text empty).
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_STOP = 64  # stop strings, and stop token ids, per request
MAX_STOP_LEN = 512  # characters per stop string: the detokenizer rescans this much text per step


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed` (n > 1, best_of): choice 0 keeps
    it (n=1 and n=2 agree on their first choice); the others take 63 bits of
    sha256("seed:index"). A hash, not seed + index: the sampler's row_seed is affine in the seed,
    so nearby seeds would give choices whose random streams are shifted copies of each other.
    The server's choices (one job each) and the engine's forked ones derive it alike, so a
    choice's tokens do not depend on which of them made it."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little") >> 1


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: whatever the context leaves after the prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 (or -1, as vLLM spells it) means no top-k
    min_tokens: int = 0
    seed: int | None = None  # per request: the same tokens whatever else shares the batch
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the output text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # As in vLLM. repetition: logits of tokens in the prompt or the output are divided by it
    # (multiplied when negative), as Hugging Face does; 1 = off. presence / frequency: subtracted
    # once per token present in the output / once per occurrence there; 0 = off.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # None: no logprobs; k in [0, 20]: each sampled token's logprob (log_softmax of the raw
    # logits, before penalties and temperature, as vLLM) and the k most likely alternatives.
    logprobs: int | None = None
    min_p: float = 0.0  # in [0, 1]: drop tokens whose probability is below min_p * the top one's
    include_stop_str_in_output: bool = False
    # One key of json (a JSON-schema dict or its text), json_object (True), regex, choice (a list
    # of strings), grammar (Lark / GBNF): the output is held to it (runtime/llm/structured.py).
    # Its shape is checked here; whether the grammar engine compiles it, at the engine's prepare.
    structured_outputs: dict | None = None
    # None: none; k in [0, 20]: for each prompt token after the first, its logprob given the
    # tokens before it (log_softmax of the raw logits) and the k most likely alternatives, as
    # vLLM's. With max_tokens=0 the prompt is scored and nothing is generated.
    prompt_logprobs: int | None = None
    # As vLLM's: n completions of one prompt, forked from one prefill (the choices share the
    # prompt's KV blocks). best_of >= n completions are made and the n with the highest
    # cumulative logprob returned; None = n. Choice k samples with choice_seed(seed, k).
    n: int = 1
    best_of: int | None = None
    # False: this request never drafts when the engine runs speculative decoding (its tokens
    # are the same either way for greedy requests; a sampled one keeps its random draws as
    # without speculation). No effect on an engine without speculative_config.
    speculate: bool = True

    def __post_init__(self) -> None:
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise FieldError(
                "prompt_logprobs",
                f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
            )
        if self.max_tokens is not None and (
            not _is_int(self.max_tokens) or self.max_tokens < (0 if self.prompt_logprobs is not None else 1)
        ):
            raise FieldError(
                "max_tokens",
                f"max_tokens must be an integer >= 1 or None (the rest of the context), or 0 with prompt_logprobs "
                f"set (score the prompt, generate nothing), got {self.max_tokens!r}",
            )
        if not _is_int(self.n) or self.n < 1:
            raise FieldError("n", f"n must be an integer >= 1, got {self.n!r}", OUT_OF_RANGE)
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise FieldError(
                "best_of", f"best_of must be None or an integer >= n ({self.n}), got {self.best_of!r}", OUT_OF_RANGE
            )
        if self.max_tokens == 0 and self.num_choices > 1:
            raise FieldError(
                "n",
                f"n must be 1 when max_tokens is 0 (scoring a prompt makes no choices), got n={self.n}, "
                f"best_of={self.best_of}",
            )
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not self.temperature >= 0
        ):
            raise FieldError(
                "temperature", f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}", OUT_OF_RANGE
            )
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}", OUT_OF_RANGE)
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise FieldError(
                "top_k", f"top_k must be an integer >= 0 (0 or -1 = disabled), got {self.top_k!r}", OUT_OF_RANGE
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise FieldError("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}", OUT_OF_RANGE)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise FieldError(
                "min_tokens",
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise FieldError("seed", f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise FieldError("stop", f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if len(self.stop) > MAX_STOP:
            raise FieldError("stop", f"stop must hold at most {MAX_STOP} strings, got {len(self.stop)}", OUT_OF_RANGE)
        long = [s for s in self.stop if len(s) > MAX_STOP_LEN]
        if long:
            raise FieldError(
                "stop",
                f"stop strings must be at most {MAX_STOP_LEN} characters, got one of {len(long[0])}",
                OUT_OF_RANGE,
            )
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise FieldError(
                "stop_token_ids", f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(self.stop_token_ids)
        if len(self.stop_token_ids) > MAX_STOP:
            raise FieldError(
                "stop_token_ids",
                f"stop_token_ids must hold at most {MAX_STOP} ids, got {len(self.stop_token_ids)}",
                OUT_OF_RANGE,
            )
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0 < rp < float("inf"):
            raise FieldError(
                "repetition_penalty",
                f"repetition_penalty must be a number > 0 (1 = off, > 1 discourages repeats), got {rp!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise FieldError(name, f"{name} must be a number in [-2, 2] (0 = off), got {v!r}", OUT_OF_RANGE)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise FieldError(
                "logprobs",
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                OUT_OF_RANGE,
            )
        mp = self.min_p
        if isinstance(mp, bool) or not isinstance(mp, (int, float)) or not 0 <= mp <= 1:
            raise FieldError("min_p", f"min_p must be a number in [0, 1] (0 = off), got {mp!r}", OUT_OF_RANGE)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            # Checked, not rewritten: the caller's dict stays as given (the engine parses it again,
            # cheaply, when it compiles it).
            StructuredSpec.parse(self.structured_outputs)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def num_choices(self) -> int:
        """Completions made: best_of, else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS
