"""Draftless speculative decoding, the scheduler's half: the configuration (vLLM's
`speculative_config` names), the n-gram prompt-lookup proposer, and the adaptive policy that
says how many drafts each decoding request gets this step.

Prompt lookup (vLLM's `method: "ngram"`): the request's last n tokens (n from
`prompt_lookup_max` down to `prompt_lookup_min`) are looked up among its own earlier tokens,
prompt and output; the tokens that followed the most recent earlier occurrence are the draft.
Grounded text (summaries, extraction, edits of a given passage) repeats its input, so drafts
are often right; random text never repeats and gets no drafts at all, so it pays nothing.

The lookup is an index per request, {(n, n-gram): end of its latest occurrence that has a
continuation}, grown by the tokens added since the last step: proposing is a few dict
lookups, never a scan of the sequence, and it never touches the device.

Adaptive, so that it does not cost (issue 29): no drafts when the running batch is larger than
`max_batch_size` (a large continuous batch already keeps the hardware busy), fewer as the
batch grows (`k_by_batch_size`), and none for a request whose running acceptance rate fell
below `min_acceptance` after `warmup_drafts` drafted tokens (its text does not repeat).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

METHODS = ("ngram",)


def _int_at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"speculative_config.{name} must be an integer >= {low}, got {value!r}")


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for draftless (n-gram) speculation, plus the adaptive knobs."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: most drafts verified per request and step
    prompt_lookup_max: int = 4  # longest n-gram matched
    prompt_lookup_min: int = 2  # shortest n-gram matched (1 matches too often on random text)
    max_batch_size: int = 8  # running requests above which nobody drafts
    min_acceptance: float = 0.3  # a request's accepted / drafted below which it stops drafting
    warmup_drafts: int = 16  # drafted tokens before min_acceptance is applied

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        _int_at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
        _int_at_least("prompt_lookup_min", self.prompt_lookup_min, 1)
        _int_at_least("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        _int_at_least("max_batch_size", self.max_batch_size, 1)
        _int_at_least("warmup_drafts", self.warmup_drafts, 0)
        m = self.min_acceptance
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m <= 1.0:
            raise ValueError(f"speculative_config.min_acceptance must be a number in [0, 1], got {m!r}")

    @classmethod
    def from_dict(cls, data: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """A config from vLLM's dict form; an unknown key is an error naming it (never ignored)."""
        if data is None or isinstance(data, SpeculativeConfig):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"speculative_config must be a JSON object (dict), got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]} is not a known field; known: {sorted(known)}")
        return cls(**data)

    def k_for(self, batch_size: int) -> int:
        """Drafts per request at this running batch size: k up to 2 sequences, then fewer,
        none above max_batch_size (vLLM's dynamic speculation: a table by batch size)."""
        if batch_size > self.max_batch_size:
            return 0
        if batch_size <= 2:
            return self.num_speculative_tokens
        return max(1, self.num_speculative_tokens // 2)


@dataclass(slots=True)
class _Lookup:
    index: dict = field(default_factory=dict)  # (n, n-gram tuple) -> end of latest occurrence
    indexed: int = 0  # tokens whose n-grams ending before them are in the index
    drafted: int = 0
    accepted: int = 0


class NgramProposer:
    """Prompt-lookup drafts, one index per request (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._lookups: dict[str, _Lookup] = {}

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `token_ids` ([] when nothing matches or the
        request's acceptance fell too low)."""
        lk = self._lookups.get(request_id)
        if lk is None:
            lk = self._lookups[request_id] = _Lookup()
        c = self.config
        if lk.drafted >= c.warmup_drafts and lk.accepted < c.min_acceptance * lk.drafted:
            return []
        lo, hi = c.prompt_lookup_min, c.prompt_lookup_max
        n_tokens = len(token_ids)
        index = lk.index
        # Enter the n-grams that end at each position whose next token is now known.
        for end in range(max(lk.indexed, lo), n_tokens):
            for n in range(lo, min(hi, end) + 1):
                index[(n, tuple(token_ids[end - n : end]))] = end
        lk.indexed = max(lk.indexed, n_tokens)
        for n in range(min(hi, n_tokens - 1), lo - 1, -1):
            end = index.get((n, tuple(token_ids[n_tokens - n :])))
            if end is not None:
                return token_ids[end : end + k]
        return []

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        lk = self._lookups.get(request_id)
        if lk is not None:
            lk.drafted += drafted
            lk.accepted += accepted

    def forget(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)


@dataclass(slots=True)
class SpeculationStats:
    """Totals under vLLM's metric names (tandem:spec_decode_*)."""

    num_drafts: int = 0  # verification rounds (a request with drafts in a step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted tokens at draft position i

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        per = self.accepted_per_pos
        if len(per) < drafted:
            per.extend([0] * (drafted - len(per)))
        for i in range(accepted):
            per[i] += 1
