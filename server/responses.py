"""OpenAI's response shapes, for /v1/completions and /v1/chat/completions: the answer, its
choices and the streamed chunks, with logprobs and usage, and a chat answer's tool calls (from
the job's tool_call / tool_args events: never from its text). Plain dicts in, plain dicts out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.protocol import Generation
from workers.events import TOOL_CALL, JobEvent


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


def merged_usage(uses: list[dict]) -> dict:
    """n choices' usage: the prompt counted once, the completions summed. A choice that reports
    none ({}: its result could not be read) adds nothing, and takes nothing from the others."""
    known = [u for u in uses if u]
    if not known:
        return {}
    return usage(known[0]["prompt_tokens"], sum(u["completion_tokens"] for u in known))


def logprobs_of(gen: Generation, entries: list[dict] | None, offset: int = 0) -> dict | None:
    """Contract B's per-token entries in the endpoint's shape: chat's
    {"content": [{token, logprob, bytes, top_logprobs: [...]}]}, or the completions API's
    {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}. `offset`: the
    characters of this choice's text before these tokens (a stream's earlier chunks). Each token's
    text offset counts the token strings before it (a token may end mid-character)."""
    if gen.logprobs is None or entries is None:
        return None
    if gen.kind == "chat":
        return {
            "content": [
                {
                    "token": e["token"],
                    "logprob": e["logprob"],
                    "bytes": e["bytes"],
                    "top_logprobs": [
                        {"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]} for t in e["top"]
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
        "top_logprobs": [{**{t["token"]: t["logprob"] for t in e["top"]}, e["token"]: e["logprob"]} for e in entries],
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


def response(gen: Generation, model: str, choices: list[dict], use: dict) -> dict:
    """The non-streaming answer."""
    obj = "chat.completion" if gen.kind == "chat" else "text_completion"
    return {"id": gen.id, "object": obj, "created": gen.created, "model": model, "choices": choices, "usage": use}


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
