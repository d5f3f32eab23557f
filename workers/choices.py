"""A generation's engine outputs as job events (workers/events.py), for one choice or for n: the
one translation that a worker (workers/jobs.py) and `tandem serve --embedded`
(server/embedded.py) both run, so that a job's stream and an embedded request's events agree.
No I/O here, and no torch: RequestOutputs in, JobEvents out.

    states = [ChoiceState(k) for k in range(params.n)]        # or a resumed job's, from its events
    tr = OutputEvents(params, states, token_texts)
    for out in handle:
        for event in tr.feed(out): ...                         # prompt, token, choice_end events

What it relies on (runtime/llm/parallel_sampling.py): a streamed output of an n > 1 request
holds the one choice that moved (`completions[0]`, with its index), with the top-level fields
that choice's; the choice's last one carries its finish_reason there; the final output holds the
n choices whole (best_of > n: the n kept, best first, and nothing was streamed before). A job of
one choice gets outputs without `completions` (or duck-typed ones: tests' fakes have none).

Tokens go by each choice's `token_ids` (cumulative), text by `delta_text` (what the detokenizer
released: text held back for a stop string is never sent), and what text is left at a choice's
end (out.text past what was sent) goes on its end. Prompt logprobs come first: outputs that come
before the one that carries them (another choice's, in the same step) wait for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from workers.events import APPENDED, CHOICE_END, PROMPT, TOKEN, JobEvent

TokenTexts = Callable[[int], tuple[str, list[int]]]  # runtime/llm/detokenizer.py's TokenTexts


@dataclass(slots=True)
class ChoiceState:
    """One choice's output so far. `ids`, `text` and `logprobs` include what earlier attempts of
    the job streamed (`base` tokens); `sent` and `streamed` count this attempt's outputs only
    (a resumed request's outputs hold only what is new)."""

    index: int
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict] | None = None
    base: int = 0
    sent: int = 0
    streamed: str = ""
    ended: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None

    def to_result(self) -> dict:
        """The choice in a job's result (`choices`). Its cumulative logprob: the engine's, or
        where its tokens' logprobs are known (asked, or a choice resumed), their sum."""
        cumulative = self.cumulative_logprob
        if self.logprobs:
            cumulative = sum(e["logprob"] for e in self.logprobs)
        return {
            "index": self.index,
            "text": self.text,
            "token_ids": list(self.ids),
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "logprobs": self.logprobs,
            "cumulative_logprob": cumulative,
        }


def new_logprobs(out, sent: int, count: int) -> list[dict] | None:
    """The logprobs of out.token_ids[sent:sent + count] (contract B), None when none were asked."""
    whole = getattr(out, "logprobs", None)  # one per token generated so far
    if whole is not None and len(whole) >= sent + count:
        return whole[sent : sent + count]
    delta = getattr(out, "delta_logprobs", None)  # those of the outputs merged into this one
    if delta is not None and len(delta) >= count:
        return delta[len(delta) - count :]
    return None


def prompt_entries(ids: list[int], prompt_logprobs: list, token_texts: TokenTexts | None) -> list[dict]:
    """RequestOutput.prompt_logprobs as the prompt event carries them: the first token gets an
    entry too (its text, logprob null, no top: nothing predicts it), so that a client without a
    tokenizer can echo it; the others are contract B's entries."""
    first = ids[0]
    text, raw = token_texts(first) if token_texts is not None else ("", [])
    return [{"token_id": first, "token": text, "bytes": list(raw), "logprob": None, "top": []}, *prompt_logprobs[1:]]


class OutputEvents:
    """One request's outputs -> the job's events. `multi`: the job has n > 1 choices (its token
    events name their choice, each choice ends with a choice_end); `fixed`: every output is that
    choice's (a choice resumed alone, as a request of one). `prompt_sent`: an earlier attempt
    wrote the prompt event already."""

    def __init__(
        self,
        params,
        choices: list[ChoiceState],
        token_texts: TokenTexts | None = None,
        *,
        multi: bool | None = None,
        fixed: int | None = None,
        prompt_sent: bool = False,
    ) -> None:
        self.choices = choices
        self.multi = params.num_choices > 1 if multi is None else multi
        self.fixed = fixed
        self.token_texts = token_texts
        self.want_prompt = params.prompt_logprobs is not None and not prompt_sent
        self.prompt_logprobs: list[dict] | None = None  # the prompt event's entries, once made
        self.prompt_token_ids: list[int] | None = None  # as the first output gave them
        # A job of one choice: the text its end carries (what the final output has past the
        # deltas sent), for the `done` event.
        self.trailing = ""
        self._held: list = []

    def feed(self, out) -> list[JobEvent]:
        """The events of one output (the final one too)."""
        if self.prompt_token_ids is None:
            self.prompt_token_ids = list(out.prompt_token_ids)
        events: list[JobEvent] = []
        if self.want_prompt and self.prompt_logprobs is None:
            given = getattr(out, "prompt_logprobs", None)
            if given is None and out.finish_reason is None:
                self._held.append(out)  # its choice's tokens wait for the prompt's logprobs
                return []
            if given is not None:
                events.append(self._prompt_event(out.prompt_token_ids, given))
            held, self._held = self._held, []
            for o in held:
                events += self._streamed(o)
        finished = out.finish_reason is not None
        if finished and (getattr(out, "error", None) or out.finish_reason == "abort"):
            return events  # failed or cancelled: no choice ends (the job's end says why)
        if finished and getattr(out, "completions", None) is not None and self.fixed is None:
            return events + self._final_of_n(out)
        events += self._streamed(out)
        if finished:
            events += self._finish_one(out)
        return events

    # ---- internals ------------------------------------------------------------------------------

    def _choice(self, out) -> ChoiceState:
        if self.fixed is not None:
            return self.choices[self.fixed]
        completions = getattr(out, "completions", None)
        return self.choices[completions[0].index if completions else 0]

    def _prompt_event(self, ids: list[int], given: list) -> JobEvent:
        self.prompt_logprobs = prompt_entries(ids, given, self.token_texts)
        return JobEvent(PROMPT, token_ids=list(ids[: len(given)]), logprobs=self.prompt_logprobs)

    def _token(self, c: ChoiceState, new: list[int], text: str, lp: list[dict] | None) -> JobEvent:
        event = JobEvent(TOKEN, text, list(new), lp, index=c.base + c.sent, choice=c.index if self.multi else None)
        c.ids += new
        c.text += text
        c.streamed += text
        c.sent += len(new)
        if lp is not None:
            c.logprobs = (c.logprobs or []) + list(lp)
        return event

    def _streamed(self, out) -> list[JobEvent]:
        c = self._choice(out)
        if c.ended:
            return []
        new = out.token_ids[c.sent :]
        events = [self._token(c, new, out.delta_text, new_logprobs(out, c.sent, len(new)))] if new else []
        completions = getattr(out, "completions", None)
        if self.multi and self.fixed is None and completions and completions[0].finish_reason is not None:
            done = completions[0]
            events.append(self._end(c, self._rest(c, out.text), done.finish_reason, done.stop_reason))
            c.cumulative_logprob = done.cumulative_logprob
        return events

    def _finish_one(self, out) -> list[JobEvent]:
        """The final output of a request of one choice (a job of one, or a choice resumed alone)."""
        c = self._choice(out)
        rest = self._rest(c, out.text)
        if not c.base:  # a resumed request's counts its new tokens alone
            c.cumulative_logprob = getattr(out, "cumulative_logprob", None)
        if not self.multi:
            c.text += rest
            c.finish_reason, c.stop_reason, c.ended = out.finish_reason, getattr(out, "stop_reason", None), True
            self.trailing = rest
            return []
        return [self._end(c, rest, out.finish_reason, getattr(out, "stop_reason", None))]

    def _final_of_n(self, out) -> list[JobEvent]:
        """The final output of n choices: what each choice not yet ended still has, and its end."""
        events: list[JobEvent] = []
        for done in out.completions:
            c = self.choices[done.index]
            if c.ended:
                continue
            new = done.token_ids[c.sent :]
            lp = done.logprobs[c.sent :] if done.logprobs is not None else None
            rest = self._rest(c, done.text)
            if new:
                events.append(self._token(c, new, rest, lp))
                rest = ""
            c.cumulative_logprob = done.cumulative_logprob
            events.append(self._end(c, rest, done.finish_reason, done.stop_reason))
        return events

    @staticmethod
    def _rest(c: ChoiceState, text: str) -> str:
        """What `text` (this attempt's whole text of the choice) holds past what was sent."""
        return text[len(c.streamed) :] if text.startswith(c.streamed) else ""

    def _end(self, c: ChoiceState, rest: str, reason: str | None, stop) -> JobEvent:
        c.text += rest
        c.ended, c.finish_reason, c.stop_reason = True, reason, stop
        return JobEvent(CHOICE_END, rest, choice=c.index, finish_reason=reason, stop_reason=stop, num_tokens=len(c.ids))


@dataclass(slots=True)
class Resumed:
    """What a job's events say of its earlier attempts: each choice's output (ChoiceState, with
    `base` set), the prompt event's entries (None: not written), and the appended events written
    (the next APPEND seq)."""

    choices: list[ChoiceState]
    prompt_logprobs: list[dict] | None
    num_appended: int

    @property
    def started(self) -> bool:
        return any(c.ids or c.ended for c in self.choices)


def resumed_from(events: list[JobEvent], num_choices: int) -> Resumed:
    """Each choice's tokens, text, logprobs and end from a job's events, in order."""
    choices = [ChoiceState(k) for k in range(num_choices)]
    prompt, appended = None, 0
    for ev in events:
        appended += ev.type in APPENDED
        if ev.type == PROMPT:
            prompt = ev.logprobs
        elif ev.type in (TOKEN, CHOICE_END):
            c = choices[ev.choice or 0]
            c.text += ev.text
            if ev.type == CHOICE_END:
                c.ended, c.finish_reason, c.stop_reason = True, ev.finish_reason, ev.stop_reason
                continue
            c.ids += ev.token_ids
            if ev.logprobs:
                c.logprobs = (c.logprobs or []) + ev.logprobs
    for c in choices:
        c.base = len(c.ids)
    return Resumed(choices, prompt, appended)
