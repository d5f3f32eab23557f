"""Incremental detokenization for streaming, correct across multi-byte characters, and stop
strings.

A byte-level BPE token can end in the middle of a UTF-8 character; decoding it alone gives
U+FFFD. So text is emitted only once the decoded window no longer ends in U+FFFD, and the
window starts a few tokens back (`prefix_offset`) so that tokenizers which drop a leading space
on the first token of a decode still give the right spacing (the method of Hugging Face TGI).

One detokenizer serves both the stream and the final text of a request, so the streamed
deltas always add up to the final text. At the end, `finish()` flushes whatever is still held
back, a trailing incomplete character included (as a whole-sequence decode shows it). Stop
strings are looked for only once `min_tokens` outputs exist, as vLLM does.

`TokenTexts` gives single tokens' text and bytes, for logprobs.
"""

from __future__ import annotations

import json
from functools import lru_cache

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens that seed the window, for correct spacing of the first token


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop_str: bool = False,
        resumed_token_ids: list[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text decoded so far (stop string included, if hit)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.emitted = 0  # characters of self.text already handed to a stream
        self.stop_at: int | None = None  # index in self.text where a stop string begins
        self.stop_str: str | None = None  # the stop string found there
        self.include_stop_str = include_stop_str  # the stop string stays in the visible text
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.base = 0  # characters of self.text that belong to the resumed outputs' stream
        if resumed_token_ids:
            # A resumed request's earlier outputs, taken one at a time as their first run took
            # them, then "streamed": what that run had emitted is not this one's text, and what it
            # held back (a possible stop string's start, an unfinished character) is.
            for tok in resumed_token_ids:
                self.add([tok])
            self.take_delta(False)
            self.base = self.emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> None:
        """Take new output tokens; sets `stop_at` if a stop string appeared."""
        self.ids.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        self._advance(final=False)

    def finish(self) -> None:
        """The request ended: take in the text still held back for an incomplete character."""
        if self.read_offset < len(self.ids):
            self._advance(final=True)

    def _advance(self, final: bool) -> None:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith(_REPLACEMENT)):
            new = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            start = max(0, len(self.text) - self.max_stop_len + 1)  # a stop string may span deltas
            self.text += new
            if self.stop and self.stop_at is None and self.num_output_tokens >= self.min_tokens:
                hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
                if hits:
                    # The earliest match wins; at one position, the longest (so it is all kept
                    # when include_stop_str: "\n\n" rather than "\n").
                    self.stop_at, self.stop_str = min(hits, key=lambda h: (h[0], -len(h[1])))

    def _visible_end(self) -> int:
        if self.stop_at is None:
            return len(self.text)
        return self.stop_at + len(self.stop_str) if self.include_stop_str else self.stop_at

    def visible_text(self) -> str:
        """The output text (past a resumed request's earlier stream), stop string cut."""
        return self.text[self.base : max(self.base, self._visible_end())]

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed. While running, hold back what could be the start of a stop
        string, so a stop string is never streamed."""
        visible_end = self._visible_end()
        hold = 0 if finished or self.stop_at is not None else max(self.max_stop_len - 1, 0)
        end = max(self.emitted, visible_end - hold)
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: byte-level BPE spells byte b as chr(map[b])."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


class TokenTexts:
    """Each token's text and bytes, as logprobs report them: `token` is what
    convert_ids_to_tokens then convert_tokens_to_string show for the token alone (vLLM's
    choice; a token that ends inside a UTF-8 character shows U+FFFD), `bytes` the bytes it
    stands for: for a byte-level BPE the token's own bytes (so that a client can join the
    bytes of a character split over tokens, as OpenAI's `bytes` field promises), else the UTF-8
    of `token`. Cached per id: at most one entry per vocabulary entry."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            tok = self.tokenizer.convert_ids_to_tokens(token_id)
            text = self.tokenizer.convert_tokens_to_string([tok]) if tok is not None else ""
            raw = None
            if self._byte_level and tok is not None and token_id not in self.tokenizer.all_special_ids:
                dec = _byte_decoder()
                if all(c in dec for c in tok):
                    raw = [dec[c] for c in tok]
            hit = self._cache[token_id] = (text, raw if raw is not None else list(text.encode("utf-8")))
        return hit


# Normalizers and pre-tokenizers that never shrink the text nor drop any of it; with one of
# anything else (NFKC composes "e\u0301" into "é", Lowercase maps the 3-byte Kelvin sign to "k",
# Whitespace drops spaces, StripAccents drops marks) a byte count proves nothing.
_KEEPS_TEXT = {"Prepend", "Replace", "ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "Sequence"}


def _keeps_text(node: dict | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind not in _KEEPS_TEXT or node.get("behavior") == "Removed":
        return False
    if kind == "Replace":
        pattern, content = node.get("pattern", {}), node.get("content", "")
        if "String" not in pattern or len(content.encode()) < len(pattern["String"].encode()):
            return False
    parts = node.get("normalizers", node.get("pretokenizers", []))
    return all(_keeps_text(p) for p in parts)


class PromptBound:
    """A lower bound on the number of tokens a prompt encodes to, from its UTF-8 alone, so that
    a prompt far over the context is refused before the tokenizer spends time on it.

    No token covers more than `longest` bytes of the prompt, and only the bytes in `dropped`
    (characters the vocabulary lacks, which a BPE without an unknown token skips: SmolLM2's
    has no token for the control characters 0x04, 0x06, ...) can vanish, so a prompt of B
    bytes, D of them droppable, encodes to at least ceil((B - D) / longest) tokens."""

    def __init__(self, longest: int, dropped: list[int]) -> None:
        self.longest = longest
        self.dropped = [bytes([b]) for b in dropped]

    def min_tokens(self, prompt: str) -> int:
        data = prompt.encode("utf-8", errors="surrogatepass")
        n = len(data) - sum(data.count(b) for b in self.dropped)  # C-speed scans, no tokenizer
        return -(-n // self.longest)

    @classmethod
    def of(cls, tokenizer) -> PromptBound | None:
        """The bound of `tokenizer`, or None where it gives no guarantee (then only the token
        count, after encoding, says whether a prompt fits).

        It holds when the text reaches the BPE model whole: normalizer and pre-tokenizer only
        add (Prepend, Replace " " by "▁", ByteLevel) or split; no added token strips the
        whitespace beside it; and bytes are not fused into one unknown token (a byte-level
        vocabulary, whose missing bytes are skipped and counted in `dropped`, or byte
        fallback). Then each token spells a piece of the (never shorter) normalized text: a
        byte-level token's characters stand for one byte each; other tokens' spellings are at
        most their UTF-8 length (a fallback "<0xE2>" covers one byte)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        spec = json.loads(backend.to_str())
        model = spec.get("model") or {}
        vocab = model.get("vocab")
        pre = spec.get("pre_tokenizer")
        if model.get("type") != "BPE" or not isinstance(vocab, dict) or not vocab:
            return None
        if not (_keeps_text(spec.get("normalizer")) and _keeps_text(pre)):
            return None
        added = spec.get("added_tokens") or []
        if any(a.get("lstrip") or a.get("rstrip") for a in added):
            return None
        dropped: list[int] = []
        if "ByteLevel" in json.dumps(pre):
            dropped = [b for c, b in _byte_decoder().items() if c not in vocab]
            longest = max(len(t) for t in vocab)
        elif model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
            longest = max(len(t.encode()) for t in vocab)
        else:
            return None
        return cls(max([longest, *(len(a["content"].encode()) for a in added)]), dropped)
