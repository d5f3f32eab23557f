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
"""

from __future__ import annotations

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
        self.min_tokens = min_tokens
        self.num_output_tokens = 0

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
                hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    self.stop_at = min(hits)

    def visible_text(self) -> str:
        return self.text if self.stop_at is None else self.text[: self.stop_at]

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed. While running, hold back what could be the start of a stop
        string, so a stop string is never streamed."""
        visible = self.visible_text()
        hold = 0 if finished or self.stop_at is not None else max(self.max_stop_len - 1, 0)
        end = max(self.emitted, len(visible) - hold)
        delta = visible[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta
