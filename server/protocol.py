"""OpenAI's request and response shapes, checked field by field. No FastAPI, Redis or torch
here: plain dicts in, plain dicts out, so the checks are testable on their own.

A request becomes a `Generation`: what to run (a prompt, token ids or chat messages), the job
keyword arguments the workers take (SamplingParams fields, priority, deadline_s), and how to
answer (stream or not, usage in the stream). Every refusal is an `APIError` naming the field,
with the HTTP status OpenAI's API would give.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from runtime.llm.sampling_params import SamplingParams

# Fields of OpenAI's API that take only their default here, with the value that is allowed.
_ONLY_DEFAULT = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "suffix": ("",),
    "logit_bias": ({},),
    "use_beam_search": (False,),
}
# Fields accepted and ignored, as in OpenAI's and vLLM's servers.
_IGNORED = {
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "response_format",
    "include_stop_str_in_output",
    "spaces_between_special_tokens",
    "add_generation_prompt",
    "length_penalty",
    "stream_options",
    "stream",
    "model",
    "request_timeout",
    "min_p",
}
# SamplingParams fields a request may set directly (vLLM's extras included).
_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_tokens",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable",
    504: "timeout",
}


def param_of(message: str) -> str:
    """The field a ValueError's message names: the first unknown field it lists, else its first
    word (every check in Tandem starts its message with the field's name)."""
    m = _UNKNOWN.search(message)
    return m.group(1) if m else message.split(" ", 1)[0].rstrip(":,")


_UNKNOWN = re.compile(r"unknown field\(s\) \['([^']+)'")


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param)


@dataclass(slots=True)
class Generation:
    kind: str  # "completion" or "chat"
    model: str | None
    job: dict  # the tandem.generate keyword arguments (prompt or messages, sampling fields, priority)
    stream: bool = False
    include_usage: bool = False
    timeout_s: float | None = None  # this request's own limit (else the server's)
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    """A number that is not NaN or infinite (Python's json reads NaN and Infinity)."""
    return _is_number(v) and math.isfinite(v)


def _common(body: dict, kind: str) -> tuple[dict, bool, bool, float | None]:
    """Sampling fields, priority, stream flags and timeout shared by both endpoints."""
    for name, allowed in _ONLY_DEFAULT.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise bad(
                name,
                f"{name} must be {allowed[0]!r} or absent (Tandem returns one choice without logprobs), got {value!r}",
            )
    job: dict[str, Any] = {}
    for name in _SAMPLING:
        if body.get(name) is not None:
            job[name] = body[name]
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        job["max_tokens"] = body["max_completion_tokens"]
    if "max_tokens" in job and (not _is_int(job["max_tokens"]) or job["max_tokens"] < 1):
        name = (
            "max_completion_tokens"
            if kind == "chat" and body.get("max_completion_tokens") is not None
            else "max_tokens"
        )
        raise bad(name, f"{name} must be an integer >= 1, got {job['max_tokens']!r}")
    if "temperature" in job and (not _is_finite(job["temperature"]) or job["temperature"] < 0):
        raise bad("temperature", f"temperature must be a number >= 0 (0 = greedy), got {job['temperature']!r}")
    if "top_p" in job and (not _is_number(job["top_p"]) or not 0 < job["top_p"] <= 1):
        raise bad("top_p", f"top_p must be a number in (0, 1], got {job['top_p']!r}")
    if isinstance(job.get("stop"), str):
        job["stop"] = [job["stop"]]
    try:
        SamplingParams(**job)  # the rest of the checks, once, where the workers run them too
    except (TypeError, ValueError) as exc:
        text = str(exc)
        raise bad(text.split(" ", 1)[0], text) from None
    priority = body.get("priority")
    if priority is not None:
        if not _is_int(priority):
            raise bad("priority", f"priority must be an integer (lower runs first), got {priority!r}")
        if priority:
            job["priority"] = priority
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", f"stream must be a boolean, got {stream!r}")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", f"stream_options must be an object, got {options!r}")
    include_usage = bool((options or {}).get("include_usage", False))
    if include_usage and not stream:
        raise bad("stream_options", "stream_options is only allowed when stream is true")
    timeout = body.get("request_timeout")
    if timeout is not None and (not _is_finite(timeout) or timeout <= 0):
        raise bad("request_timeout", f"request_timeout must be a number of seconds > 0, got {timeout!r}")
    return job, bool(stream), include_usage, timeout


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("model", f"model must be a non-empty string, got {model!r}")
    return model


def _unknown(body: dict, known: set[str]) -> None:
    extra = sorted(set(body) - known)
    if extra:
        raise bad(extra[0], f"unknown field(s) {extra}; see the OpenAI API and vLLM's extra fields")


_COMMON_FIELDS = set(_ONLY_DEFAULT) | _IGNORED | set(_SAMPLING) | {"priority"}


def parse_completion(body: Any) -> Generation:
    """POST /v1/completions: one prompt (text, token ids, or a one-element list of either)."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    _unknown(body, _COMMON_FIELDS | {"prompt"})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt must be a non-empty string or a non-empty list of token ids")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        pass
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", f"prompt: one prompt per request (got a batch of {len(prompt)}); send one request each")
    else:
        raise bad("prompt", f"prompt must be a non-empty string or a non-empty list of token ids, got {prompt!r}"[:200])
    job, stream, include_usage, timeout = _common(body, "completion")
    job["prompt"] = prompt
    return Generation("completion", _model(body), job, stream, include_usage, timeout)


def _content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(
                    f"messages[{i}].content[{j}]",
                    "content parts must be {'type': 'text', 'text': str} (this model reads text only)",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")


def parse_chat(body: Any) -> Generation:
    """POST /v1/chat/completions."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    _unknown(body, _COMMON_FIELDS | {"messages", "max_completion_tokens", "tools", "tool_choice", "chat_template"})
    if body.get("tools"):
        raise bad("tools", "tools are not supported")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {'role', 'content'} objects")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise bad(
                f"messages[{i}].role", f"messages[{i}].role must be system, user, assistant or developer, got {role!r}"
            )
        clean.append({"role": "system" if role == "developer" else role, "content": _content(i, m.get("content"))})
    job, stream, include_usage, timeout = _common(body, "chat")
    job["messages"] = clean
    return Generation("chat", _model(body), job, stream, include_usage, timeout)


# ---- responses ----------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response(gen: Generation, model: str, text: str, finish_reason: str | None, use: dict) -> dict:
    """The non-streaming answer."""
    if gen.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": gen.id, "object": obj, "created": gen.created, "model": model, "choices": [choice], "usage": use}


def chunk(
    gen: Generation,
    model: str,
    text: str | None,
    finish_reason: str | None = None,
    *,
    role: bool = False,
    use: dict | None = None,
    no_choices: bool = False,
) -> dict:
    """One streamed chunk. `role`: the chat stream's first chunk; `no_choices`: the usage chunk."""
    if gen.kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {
        "id": gen.id,
        "object": obj,
        "created": gen.created,
        "model": model,
        "choices": [] if no_choices else [choice],
    }
    if gen.include_usage:
        out["usage"] = use  # null on every chunk but the last, as OpenAI sends it
    return out
