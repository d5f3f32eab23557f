"""OpenAI's response shapes, for /v1/completions and /v1/chat/completions: the answer, its
choices and the streamed chunks, with logprobs (the prompt's too: echo, and vLLM's
prompt_logprobs) and usage, and a chat answer's tool calls (from the job's tool_call / tool_args
events: never from its text). Plain dicts in, plain dicts out; `Answer` gathers a job's events
(workers/events.py) into its choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.protocol import Generation
from workers.events import CHOICE_END, DONE, PROMPT, TOKEN, TOOL_CALL, TOOL_KINDS, JobEvent


@dataclass(slots=True)
class ToolCalls:
    """A choice's calls as its tool events come: call_index -> [id, name, arguments]."""

    calls: dict[int, list] = field(default_factory=dict)

    def add(self, event: JobEvent) -> None:
        if event.type == TOOL_CALL:
            self.calls[event.call_index] = [event.call_id, event.name, ""]
        else:
            self.calls[event.call_index][2] += event.arguments

    def to_openai(self) -> list[dict]:
        """message.tool_calls: [{id, type: "function", function: {name, arguments}}], in order."""
        return [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in (self.calls[i] for i in sorted(self.calls))
        ]


def tool_call_delta(event: JobEvent) -> dict:
    """A streamed delta.tool_calls entry: a call's first (index, id, type, name, arguments ""),
    then its arguments' fragments (index, arguments), as OpenAI streams them."""
    if event.type == TOOL_CALL:
        return {
            "index": event.call_index,
            "id": event.call_id,
            "type": "function",
            "function": {"name": event.name, "arguments": ""},
        }
    return {"index": event.call_index, "function": {"arguments": event.arguments}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def logprobs_of(gen: Generation, entries: list[dict] | None, offset: int = 0) -> dict | None:
    """Contract B's per-token entries in the endpoint's shape: chat's
    {"content": [{token, logprob, bytes, top_logprobs: [...]}]}, or the completions API's
    {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}. `offset`: the
    characters of this choice's text before these tokens (a stream's earlier chunks). Each token's
    text offset counts the token strings before it (a token may end mid-character). An echoed
    prompt's first token has logprob null: its token_logprobs and top_logprobs entries are null,
    as OpenAI's and vLLM's. Each token's alternatives are cut to the request's k (a prompt's may
    carry more, for prompt_logprobs)."""
    if gen.logprobs is None or entries is None:
        return None
    k = gen.logprobs
    if gen.kind == "chat":
        return {
            "content": [
                {
                    "token": e["token"],
                    "logprob": e["logprob"],
                    "bytes": e["bytes"],
                    "top_logprobs": [
                        {"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]} for t in e["top"][:k]
                    ],
                }
                for e in entries
            ]
        }
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        # As vLLM: the top k and the sampled token, which may not be among them.
        "top_logprobs": [
            None
            if e["logprob"] is None
            else {**{t["token"]: t["logprob"] for t in e["top"][:k]}, e["token"]: e["logprob"]}
            for e in entries
        ],
        "text_offset": offsets,
    }


def choice(
    gen: Generation,
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason,
    logprobs,
    tool_calls: list[dict] | None = None,
) -> dict:
    """One choice of the non-streaming answer. A chat answer with tool calls has content null
    when the model wrote no text besides them."""
    if gen.kind == "chat":
        message: dict = {"role": "assistant", "content": text}
        if tool_calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def response(gen: Generation, model: str, choices: list[dict], use: dict, prompt: list[dict] | None = None) -> dict:
    """The non-streaming answer; a chat answer asked prompt_logprobs has them at its top level,
    as vLLM's (`prompt`: the prompt event's entries)."""
    obj = "chat.completion" if gen.kind == "chat" else "text_completion"
    out = {"id": gen.id, "object": obj, "created": gen.created, "model": model, "choices": choices, "usage": use}
    if gen.kind == "chat" and gen.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs_of(prompt, gen.prompt_logprobs)
    return out


def chunk(
    gen: Generation,
    model: str,
    text: str | None,
    finish_reason: str | None = None,
    *,
    index: int = 0,
    role: bool = False,
    logprobs: dict | None = None,
    stop_reason=None,
    use: dict | None = None,
    no_choices: bool = False,
    tool_calls: list[dict] | None = None,
) -> dict:
    """One streamed chunk of choice `index`. `role`: a chat choice's first chunk; `no_choices`:
    the usage chunk; `tool_calls`: delta.tool_calls entries (tool_call_delta), with no content."""
    if gen.kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if tool_calls:
            delta["tool_calls"] = tool_calls
        elif text is not None:
            delta["content"] = text
        item = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        item = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    if finish_reason is not None:
        item["stop_reason"] = stop_reason
    out = {
        "id": gen.id,
        "object": obj,
        "created": gen.created,
        "model": model,
        "choices": [] if no_choices else [item],
    }
    if gen.include_usage:
        out["usage"] = use  # null on every chunk but the last, as OpenAI sends it
    return out


def prompt_logprobs_of(entries: list[dict] | None, k: int) -> list[dict | None] | None:
    """vLLM's prompt_logprobs from the prompt event's entries: None for the first token, then per
    token {token_id: {"logprob", "rank", "decoded_token"}}, the prompt's token first and its k
    alternatives (ranks 1..k). The prompt token's own rank is its place among them when it is
    one of them, else null: the engine ranks the top k, not the whole vocabulary."""
    if entries is None:
        return None
    out: list[dict | None] = [None]
    for e in entries[1:]:
        top = e["top"][:k]
        rank = next((i + 1 for i, t in enumerate(top) if t["token_id"] == e["token_id"]), None)
        step = {e["token_id"]: {"logprob": e["logprob"], "rank": rank, "decoded_token": e["token"]}}
        for i, t in enumerate(top):
            step.setdefault(t["token_id"], {"logprob": t["logprob"], "rank": i + 1, "decoded_token": t["token"]})
        out.append(step)
    return out


@dataclass(slots=True)
class ChoiceText:
    """One choice's answer as its events come."""

    index: int
    parts: list[str] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)
    calls: ToolCalls = field(default_factory=ToolCalls)
    ended: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_offset: int = 0  # a stream's: characters of token strings sent (the completions API's text_offset)


class Answer:
    """A job's events gathered into its n choices: tokens by their `choice`, each choice's end
    (a choice_end event; for a job of one, its done event), the prompt's logprobs."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.choices = [ChoiceText(i) for i in range(gen.n)]
        self.prompt: list[dict] | None = None  # the prompt event's entries

    def add(self, event: JobEvent) -> ChoiceText | None:
        """Take one event; the choice it is of (None: the prompt's, or a final one)."""
        kind = event.type
        if kind == PROMPT:
            self.prompt = event.logprobs
            return None
        if kind == DONE:
            for c in self.choices:  # a job of one ends its choice with its done event
                if not c.ended:
                    self._end(c, event)
            return None
        if kind not in (TOKEN, CHOICE_END, *TOOL_KINDS):
            return None
        c = self.choices[event.choice or 0]
        if kind in TOOL_KINDS:
            c.calls.add(event)
        elif kind == TOKEN:
            c.parts.append(event.text)
            c.entries.extend(event.logprobs or ())
        else:
            self._end(c, event)
        return c

    @staticmethod
    def _end(c: ChoiceText, event: JobEvent) -> None:
        c.parts.append(event.text)
        c.ended, c.finish_reason, c.stop_reason = True, event.finish_reason, event.stop_reason

    def echoed(self) -> str:
        """The echo's text: a text prompt as sent; token ids as their tokens' text, from the
        prompt's logprobs entries (echo with token ids asks for them: protocol.parse_completion)."""
        if not self.gen.echo:
            return ""
        prompt = self.gen.job["prompt"]
        return prompt if isinstance(prompt, str) else "".join(e["token"] for e in self.prompt or ())

    def echo_entries(self) -> list[dict]:
        """The prompt's entries an echo's logprobs begin with ([] without echo)."""
        return list(self.prompt or ()) if self.gen.echo else []

    def to_choices(self) -> list[dict]:
        """The non-streaming answer's choices (vLLM's prompt_logprobs on each, when asked)."""
        gen, out = self.gen, []
        for c in self.choices:
            text = self.echoed() + "".join(c.parts)
            lp = logprobs_of(gen, self.echo_entries() + c.entries)
            item = choice(gen, c.index, text, c.finish_reason, c.stop_reason, lp, c.calls.to_openai())
            if gen.kind == "completion" and gen.prompt_logprobs is not None:
                item["prompt_logprobs"] = prompt_logprobs_of(self.prompt, gen.prompt_logprobs)
            out.append(item)
        return out
