"""JobEvent: the one typed definition of what a job's Redis Stream carries, read by the job
client (workers/client.py), the store (a resumed job's prefix), and `tandem serve` (its routes
and both backends). No I/O here, and no redis, celery or torch: plain data in, plain data out.

Kinds, and the fields each carries (in Redis every value is a string; lists are JSON):

    token       index (position of its first token in its choice's output), attempt, token_ids,
                text (the content it adds: for a tool job, text outside the calls), logprobs?,
                choice? (n > 1: which choice; absent for a job of one)
    prompt      token_ids (the prompt's), logprobs (one entry per prompt token: the first's
                logprob is null and its top empty, nothing predicts it): a job that asks
                prompt_logprobs, written before any token (none follow for max_tokens=0)
    restarted   attempt, resumed_from (tokens the earlier attempts streamed), worker
    tool_call   call_index, call_id, name: a tool call opens (OpenAI's first delta of a call)
    tool_args   call_index, arguments: the next fragment of that call's arguments (JSON text)
    choice_end  choice, text (trailing), finish_reason, stop_reason?, num_tokens (the choice's):
                n > 1, once per choice, when it ends (best_of > n: the n kept, best first)
    done        text (trailing), finish_reason, num_tokens (every choice's), stop_reason?
                (n > 1: choice 0's reasons; the choices' own ends came before)
    failed      text, finish_reason, error, num_tokens, field?, code? (a FieldError's data)
    cancelled   finish_reason, num_tokens

`text` is present, "" or not, on every kind but the tool kinds, whatever wrote the event:
joining the `text` of a choice's events gives its content, and never a call's arguments. The
token, restarted and final entries are written by the Lua scripts (workers/lua.py), the
appended kinds (tool, prompt, choice_end) by lua_events.APPEND; `to_fields` writes what those
scripts write, so the two agree (tests).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TOKEN, RESTARTED, TOOL_CALL, TOOL_ARGS = "token", "restarted", "tool_call", "tool_args"
PROMPT, CHOICE_END = "prompt", "choice_end"
DONE, FAILED, CANCELLED = "done", "failed", "cancelled"
FINAL = (DONE, FAILED, CANCELLED)
TOOL_KINDS = (TOOL_CALL, TOOL_ARGS)
APPENDED = (*TOOL_KINDS, PROMPT, CHOICE_END)  # written by lua_events.APPEND, one seq per job
KINDS = (TOKEN, RESTARTED, PROMPT, CHOICE_END, *TOOL_KINDS, *FINAL)
_INTS = ("index", "attempt", "resumed_from", "num_tokens", "call_index", "choice")
_STRINGS = ("finish_reason", "error", "worker", "call_id", "name", "field", "code", "job_id")


@dataclass(slots=True)
class JobEvent:
    type: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None  # contract B, aligned with token_ids, when the job asked
    index: int | None = None
    choice: int | None = None  # n > 1: the choice a token or choice_end event is of (None: 0, alone)
    attempt: int | None = None
    resumed_from: int | None = None
    num_tokens: int | None = None
    worker: str | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended a generation
    error: str | None = None
    field: str | None = None  # failed by a FieldError: the field (a request's path) and its code
    code: str | None = None
    job_id: str | None = None  # set on events `tandem serve` makes itself (a lost stream)
    call_index: int | None = None  # tool kinds: which call (0, 1, ... in the order they open)
    call_id: str | None = None
    name: str | None = None
    arguments: str = ""
    id: str | None = None  # the stream entry's id, once read (not a field of the entry)

    @property
    def final(self) -> bool:
        return self.type in FINAL

    @property
    def has_text(self) -> bool:
        """Does this kind carry content text (the rule every reader keeps)?"""
        return self.type not in TOOL_KINDS

    # ---- Redis Stream entries ------------------------------------------------------------------

    def to_fields(self) -> dict[str, str]:
        """The entry's fields, as the scripts write them (strings; lists and stop_reason JSON)."""
        out: dict[str, str] = {"type": self.type}
        if self.type in TOOL_KINDS:
            out["call_index"] = str(self.call_index if self.call_index is not None else 0)
            if self.attempt is not None:
                out["attempt"] = str(self.attempt)
            if self.type == TOOL_CALL:
                out["call_id"], out["name"] = self.call_id or "", self.name or ""
            else:
                out["arguments"] = self.arguments
            return out
        out["token_ids"], out["text"] = json.dumps(self.token_ids), self.text
        if self.logprobs is not None:
            out["logprobs"] = json.dumps(self.logprobs)
        if self.stop_reason is not None:
            out["stop_reason"] = json.dumps(self.stop_reason)
        for name in _INTS:
            value = getattr(self, name)
            if value is not None and name != "call_index":
                out[name] = str(value)
        for name in _STRINGS:
            value = getattr(self, name)
            if value is not None and name not in ("call_id", "name"):
                out[name] = value
        return out

    @classmethod
    def from_fields(cls, fields: dict[str, str], event_id: str | None = None) -> JobEvent:
        """An entry as read (XREAD/XRANGE with decode_responses). Empty strings are absent values:
        the scripts write "" for an error or a stop_reason that there is none of."""
        ev = cls(type=fields.get("type", ""), id=event_id)
        if ev.type in TOOL_KINDS:
            ev.arguments = fields.get("arguments", "")
        else:
            ev.text = fields.get("text", "")
        if fields.get("token_ids"):
            ev.token_ids = json.loads(fields["token_ids"])
        if fields.get("logprobs"):
            ev.logprobs = json.loads(fields["logprobs"])
        if fields.get("stop_reason"):
            ev.stop_reason = json.loads(fields["stop_reason"])
        for name in _INTS:
            if fields.get(name, "") != "":
                setattr(ev, name, int(fields[name]))
        for name in _STRINGS:
            if fields.get(name):
                setattr(ev, name, fields[name])
        return ev

    # ---- what a client reads (JobClient.stream, GET /v1/jobs/{id}/events) --------------------

    def to_dict(self) -> dict[str, Any]:
        """The event as JSON for a client: `text` (and token_ids) on every kind but the tool
        kinds, the other fields only where they have a value."""
        out: dict[str, Any] = {"type": self.type}
        if self.id is not None:
            out["id"] = self.id
        if self.has_text:
            out["text"], out["token_ids"] = self.text, list(self.token_ids)
        else:
            out["call_index"] = self.call_index
            if self.type == TOOL_CALL:
                out["call_id"], out["name"] = self.call_id, self.name
            else:
                out["arguments"] = self.arguments
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.stop_reason is not None:
            out["stop_reason"] = self.stop_reason
        for name in _INTS:
            value = getattr(self, name)
            if value is not None and name != "call_index":
                out[name] = value
        for name in _STRINGS:
            value = getattr(self, name)
            if value and name not in ("call_id", "name"):
                out[name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobEvent:
        """The inverse of to_dict (a client's JSON back to the type)."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)
