"""OpenAI's requests, checked field by field (the answers' shapes are server/responses.py's).
No FastAPI, Redis or torch here: plain dicts in, plain dicts out, so the checks are testable on
their own.

A request becomes a `Generation`: what to run (a prompt, token ids or chat messages), the job
keyword arguments the workers take (SamplingParams fields, n and best_of, prompt_logprobs,
priority, chat's tools), and how to answer (n choices, echo, logprobs, stream or not, usage in
the stream). One job whatever n: the engine forks the choices from one prefill. Every refusal is an
`APIError` naming the field, with the HTTP status OpenAI's API would give. The job API
(/v1/jobs) runs `check_job` too, so that both front doors refuse the same inputs.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import FieldError
from runtime.llm.sampling_params import SamplingParams
from server.http_errors import APIError  # the shape serve and streams share (protocol.APIError)
from workers.jobspec import check_chat_messages
from workers.tool_stream import TOOL_FIELDS, ToolJob, has_tool_turns

MAX_N = 16  # choices per request (best_of too): one prefill, but each choice its own KV and steps
MAX_LOGPROBS = 20  # vLLM's cap (OpenAI's is 5 for completions, 20 for chat)
# No tokenizer we serve has tokens longer than this many UTF-8 bytes, so a prompt with more than
# max_model_len * this many bytes is too long for the context whatever it says, and is refused
# before anything tokenizes it (a 30 MB prompt took seconds of a worker's tokenizer to refuse).
MAX_BYTES_PER_TOKEN = 256
MAX_ECHO = 200  # characters of a client's input an error message repeats
_INT64 = 1 << 63
ROLES = ("system", "user", "assistant", "developer", "tool")

# Fields of OpenAI's API that take only their default here, with the values that are allowed.
_ONLY_DEFAULT = {
    "suffix": ("",),
    "logit_bias": ({},),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),  # beam search only
    "spaces_between_special_tokens": (True,),
}
_ONLY_DEFAULT_CHAT = {"add_generation_prompt": (True,)}
# Fields accepted and ignored, as in OpenAI's and vLLM's servers: they change nothing in the answer.
_IGNORED = {"user", "metadata", "store", "service_tier"}
# Chat's tool calling (workers/tool_stream.py): OpenAI's fields, carried by the job as sent.
_TOOLS = ("tools", "tool_choice", "parallel_tool_calls")
# SamplingParams fields a request may set directly (vLLM's extras included).
_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "speculate",  # Tandem's: false opts this request out of speculative decoding
)
# vLLM's guided decoding fields, and the structured_outputs key (contract A) each becomes.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_SOURCES = ("response_format", "structured_outputs", *_GUIDED)
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTS = ("max_tokens", "top_k", "min_tokens", "seed", "priority")
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_NOT_SAMPLING = ("prompt", "messages", "priority", "deadline_s", "tenant", "tier", *TOOL_FIELDS)


def clip(value: Any) -> str:
    """repr(value), cut to MAX_ECHO characters: an error message never repeats a whole input."""
    text = repr(value)
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "..."


def fallback_param(message: str) -> str:
    """The field a plain ValueError's message names: its first word. Only for the checks that do
    not raise a FieldError yet (runtime/llm/sampling_params.py and runtime/llm/structured.py,
    whose messages start with the field's name, as every check in Tandem does); every check on
    this server's own paths (this module, workers/jobspec.py) raises FieldError instead."""
    return message.split(" ", 1)[0].rstrip(":,")


def field_error(exc: ValueError, renamed: dict[str, str] | None = None) -> APIError:
    """The HTTP error of a refused input, 400: a FieldError answers with its own field; a plain
    ValueError falls back to fallback_param. `renamed`: the request's own name for a job
    field (response_format for structured_outputs), so the answer names what was sent."""
    if isinstance(exc, FieldError):
        name, text = exc.field, str(exc)
    else:
        text = str(exc)
        name = fallback_param(text)
    base = re.split(r"[.\[]", name, maxsplit=1)[0]  # structured_outputs.choice: a part of the field
    if renamed and base in renamed:  # say it in the request's terms: "response_format: structured_outputs ..."
        return APIError(400, f"{renamed[base]}: {text}", renamed[base])
    return APIError(400, text, name)


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
    n: int = 1  # choices, all of one job
    echo: bool = False  # completions: the prompt's text (and logprobs) before each choice's
    prompt_logprobs: int | None = None  # vLLM's extra, as asked: the answer's prompt_logprobs, k alternatives
    max_tokens_name: str = "max_tokens"  # what the request called it (chat: max_completion_tokens too)
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex

    @property
    def logprobs(self) -> int | None:
        return self.job.get("logprobs")

    @property
    def tools(self) -> bool:
        """Is this a tool job (tools offered, or tool turns in the conversation)? Its answer's
        calls come as tool events, parsed where it runs (workers/tool_stream.py)."""
        return any(self.job.get(f) is not None for f in TOOL_FIELDS) or has_tool_turns(self.job.get("messages"))

    def prompt_bytes(self) -> int:
        """The UTF-8 size of what the model reads (token ids: one per id, the least a token takes)."""
        if "messages" in self.job:
            return sum(_message_bytes(m) for m in self.job["messages"])
        prompt = self.job["prompt"]
        return len(prompt.encode("utf-8", "surrogatepass")) if isinstance(prompt, str) else len(prompt)


def _message_bytes(m: dict) -> int:
    size = len((m.get("content") or "").encode("utf-8", "surrogatepass"))
    for call in m.get("tool_calls") or ():
        size += len(call["function"]["arguments"].encode("utf-8", "surrogatepass"))
    return size


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    """A number that is not NaN or infinite (Python's json reads NaN and Infinity)."""
    return _is_number(v) and math.isfinite(v)


def check_messages(messages: Any) -> list[dict]:
    """Chat messages as the workers take them: {"role", "content": str}, developer as system;
    an assistant's `tool_calls` (its content then may be null) and a tool's `tool_call_id` kept,
    checked by workers/jobspec.py's check_chat_messages (the workers run it again)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {'role', 'content'} objects")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(ROLES)}, got {clip(role)}")
        extra = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"})
        if extra:
            raise bad(f"messages[{i}].{extra[0]}", f"messages[{i}].{extra[0]} is not supported (text messages only)")
        entry = {"role": "system" if role == "developer" else role}
        calls = m.get("tool_calls")
        content = m.get("content")
        entry["content"] = None if content is None and calls else _content(i, content)
        if calls is not None:
            entry["tool_calls"] = calls
        if "tool_call_id" in m:
            entry["tool_call_id"] = m["tool_call_id"]
        clean.append(entry)
    try:
        return check_chat_messages(clean)
    except ValueError as exc:
        raise field_error(exc) from None


def _tools(body: dict, source: str | None) -> dict:
    """Chat's tools, tool_choice and parallel_tool_calls as job fields, checked; {} for none."""
    fields = {name: body[name] for name in _TOOLS if body.get(name) is not None}
    if not fields:
        return {}
    try:
        job = ToolJob.from_kwargs({**fields, "messages": []})
    except ValueError as exc:
        raise field_error(exc) from None
    if source is not None and job.request is not None and job.request.tool_choice != "none":
        raise bad(source, f"{source} cannot be combined with tools (the tool grammar holds the output); use one")
    return fields


def check_text(name: str, value: str) -> None:
    """A URL or path with a control character (CR, LF, NUL, ...) is refused: it could split a
    request line or a header on its way, and no real one holds one."""
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise bad(name, f"{name} must not contain control characters (CR, LF, NUL, ...), got {clip(value)}")


def check_job(job: dict, renamed: dict[str, str] | None = None) -> None:
    """The checks both the OpenAI endpoints and the job API run on a generate job's fields, on
    top of SamplingParams' own: numbers finite (JSON here reads NaN and Infinity, and inf passes a
    `>= 0` test), integers within 64 bits (they reach torch, Lua and Redis scores), deadline_s finite."""
    for name in _FLOATS:
        v = job.get(name)
        if v is not None and _is_number(v) and not math.isfinite(v):
            raise bad(name, f"{name} must be a finite number, got {v!r}")
    for name in _INTS:
        v = job.get(name)
        if _is_int(v) and not -_INT64 <= v < _INT64:
            raise bad(name, f"{name} must fit in 64 bits, got {clip(v)}")
    ids = job.get("stop_token_ids")
    big = [t for t in ids if _is_int(t) and t >= _INT64] if isinstance(ids, list) else []
    if big:
        raise bad("stop_token_ids", f"stop_token_ids must fit in 64 bits, got {clip(big[0])}")
    if isinstance(job.get("prompt"), list) and any(_is_int(t) and t >= _INT64 for t in job["prompt"]):
        raise bad("prompt", "prompt token ids must fit in 64 bits")
    if "messages" in job:
        job["messages"] = check_messages(job["messages"])
    deadline = job.get("deadline_s")
    if deadline is not None and (not _is_finite(deadline) or deadline <= 0):
        raise bad("deadline_s", f"deadline_s must be a finite number of seconds > 0, got {clip(deadline)}")
    _sampling_params(job, renamed)


def _sampling_params(job: dict, renamed: dict[str, str] | None = None) -> None:
    """SamplingParams' checks, once, where the workers run them too; `renamed`: the request's own
    name for a job field (response_format for structured_outputs), so the error names what was sent."""
    renamed = renamed or {}
    fields = {k: v for k, v in job.items() if k not in _NOT_SAMPLING}
    unknown = sorted(set(fields) - set(SAMPLING_FIELDS))
    if unknown:  # a field this runtime's SamplingParams does not have (yet)
        name = renamed.get(unknown[0], unknown[0])
        raise bad(name, f"{name} is not supported by this server")
    try:
        SamplingParams(**fields)
    except ValueError as exc:
        raise field_error(exc, renamed) from None


def _structured(body: dict) -> tuple[dict | None, str | None]:
    """response_format, structured_outputs or a guided_* field as contract A's structured_outputs
    job field, and the request field it came from."""
    given = [name for name in _STRUCTURED_SOURCES if body.get(name) is not None]
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise bad("response_format", "response_format must be {'type': 'text' | 'json_object' | 'json_schema'}")
        if fmt["type"] == "text":
            given.remove("response_format")
    if len(given) > 1:
        raise bad(given[1], f"{given[1]}: give one of {', '.join(given)}, not both")
    if not given:
        return None, None
    name = given[0]
    value = body[name]
    if name == "response_format":
        if value["type"] == "json_object":
            return {"json_object": True}, name
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad("response_format", "response_format.json_schema must be {'name', 'schema': {...}}")
        return {"json": spec["schema"]}, name
    if name == "structured_outputs":
        return value, name  # SamplingParams checks its shape
    return {_GUIDED[name]: value}, name


def _logprobs(body: dict, kind: str) -> int | None:
    """The job's logprobs (k alternatives per token) from the endpoint's own spelling."""
    if kind == "completion":
        k = body.get("logprobs")
        if k is None:
            return None
        if not _is_int(k) or not 0 <= k <= MAX_LOGPROBS:
            raise bad("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {clip(k)}")
        return k
    on, k = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise bad("logprobs", f"logprobs must be true or false, got {clip(on)}")
    if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
        raise bad("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {clip(k)}")
    if k is not None and not on:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    return (k or 0) if on else None


def _common(body: dict, kind: str, echo: bool = False) -> tuple[dict, bool, bool, float | None, int]:
    """Sampling fields, priority, n and best_of, prompt logprobs, stream flags and timeout shared
    by both endpoints. `echo` (completions): the prompt's logprobs go before the choice's."""
    defaults = {**_ONLY_DEFAULT, **(_ONLY_DEFAULT_CHAT if kind == "chat" else {})}
    for name, allowed in defaults.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise bad(name, f"{name} must be {allowed[0]!r} or absent (not supported here), got {clip(value)}")
    job: dict[str, Any] = {}
    for name in _SAMPLING:
        if body.get(name) is not None:
            job[name] = body[name]
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        job["max_tokens"] = body["max_completion_tokens"]
    mt_name = (
        "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    )
    if "max_tokens" in job and (not _is_int(job["max_tokens"]) or job["max_tokens"] < 0):
        raise bad(mt_name, f"{mt_name} must be an integer >= 1, got {clip(job['max_tokens'])}")
    if "temperature" in job and (not _is_finite(job["temperature"]) or job["temperature"] < 0):
        raise bad("temperature", f"temperature must be a number >= 0 (0 = greedy), got {clip(job['temperature'])}")
    if "top_p" in job and (not _is_finite(job["top_p"]) or not 0 < job["top_p"] <= 1):
        raise bad("top_p", f"top_p must be a number in (0, 1], got {clip(job['top_p'])}")
    if isinstance(job.get("stop"), str):
        job["stop"] = [job["stop"]]
    stream = body.get("stream", False)
    k = _logprobs(body, kind)
    if k is not None:
        job["logprobs"] = k
    _prompt_logprobs(body, job, k, echo, bool(stream), mt_name)
    structured, source = _structured(body)
    if structured is not None:
        job["structured_outputs"] = structured
    n = body.get("n")
    if n is not None and (not _is_int(n) or not 1 <= n <= MAX_N):
        raise bad("n", f"n must be an integer in [1, {MAX_N}], got {clip(n)}")
    n = n or 1
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or not n <= best_of <= MAX_N):
        raise bad("best_of", f"best_of must be an integer in [n={n}, {MAX_N}], got {clip(best_of)}")
    if best_of is not None and best_of > n and stream is True:
        raise bad("best_of", "best_of > n cannot stream (which choices are kept is known at the end); set stream false")
    if n > 1:
        job["n"] = n
    if best_of is not None and best_of > n:
        job["best_of"] = best_of
    priority = body.get("priority")
    if priority is not None:
        if not _is_int(priority):
            raise bad("priority", f"priority must be an integer (lower runs first), got {clip(priority)}")
        if priority:
            job["priority"] = priority
    _tenancy(body, job)
    check_job(job, {"structured_outputs": source} if source else None)
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", f"stream must be a boolean, got {clip(stream)}")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options", f"stream_options must be an object, got {clip(options)}")
        extra = sorted(set(options) - {"include_usage"})
        if extra:
            raise bad(f"stream_options.{extra[0]}", f"stream_options.{extra[0]}: only include_usage is supported")
        if not isinstance(options.get("include_usage", False), bool):
            raise bad("stream_options", "stream_options.include_usage must be true or false")
    include_usage = bool((options or {}).get("include_usage", False))
    if include_usage and not stream:
        raise bad("stream_options", "stream_options is only allowed when stream is true")
    timeout = body.get("request_timeout")
    if timeout is not None and (not _is_finite(timeout) or timeout <= 0):
        raise bad("request_timeout", f"request_timeout must be a number of seconds > 0, got {clip(timeout)}")
    return job, bool(stream), include_usage, timeout, n


def _prompt_logprobs(body: dict, job: dict, k: int | None, echo: bool, stream: bool, mt_name: str) -> None:
    """The job's prompt_logprobs: vLLM's extra (k alternatives per prompt token; not streamed, as
    vLLM), and echo with logprobs (the echoed prompt's tokens carry theirs): the larger k, each
    answer cut to its own. max_tokens 0 scores the prompt: it needs one of them (echo alone asks
    the prompt computed, for its token count)."""
    asked = body.get("prompt_logprobs")
    if asked is not None:
        if not _is_int(asked) or not 0 <= asked <= MAX_LOGPROBS:
            raise bad(
                "prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {clip(asked)}"
            )
        if stream:
            raise bad("prompt_logprobs", "prompt_logprobs cannot be streamed (as in vLLM); set stream false")
        job["prompt_logprobs"] = asked
    if echo and k is not None:
        job["prompt_logprobs"] = max(k, job.get("prompt_logprobs", 0))
    if job.get("max_tokens") == 0 and "prompt_logprobs" not in job:
        if not echo:
            raise bad(
                mt_name,
                f"{mt_name} must be an integer >= 1, or 0 to score a prompt (with echo, or prompt_logprobs), got 0",
            )
        job["prompt_logprobs"] = 0


def _tenancy(body: dict, job: dict) -> None:
    """Tandem's extras for fair shares (server/tenants.py): `tier`, "interactive" (the default)
    or "batch" (runs in the slots interactive traffic leaves, preempted first); `tenant`, which
    the route checks against the API key's tenant (server/common.py claimed_tenant)."""
    tier = body.get("tier")
    if tier is not None:
        if tier not in ("interactive", "batch"):
            raise bad("tier", f"tier must be 'interactive' or 'batch', got {clip(tier)}")
        job["tier"] = tier
    tenant = body.get("tenant")
    if tenant is not None:
        if not isinstance(tenant, str) or not tenant:
            raise bad("tenant", f"tenant must be a non-empty string, got {clip(tenant)}")
        job["tenant"] = tenant


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("model", f"model must be a non-empty string, got {clip(model)}")
    return model


def _unknown(body: dict, known: set[str]) -> None:
    extra = sorted(set(body) - known)
    if extra:
        raise bad(
            extra[0][:100],
            f"unknown field(s) {[e[:100] for e in extra[:5]]}; see the OpenAI API and vLLM's extra fields",
        )


_COMMON_FIELDS = (
    set(_ONLY_DEFAULT)
    | _IGNORED
    | set(_SAMPLING)
    | set(_STRUCTURED_SOURCES)
    | {
        "priority",
        "tier",
        "tenant",
        "n",
        "best_of",
        "logprobs",
        "prompt_logprobs",
        "stream",
        "stream_options",
        "model",
        "request_timeout",
    }
)


def parse_completion(body: Any) -> Generation:
    """POST /v1/completions: one prompt (text, token ids, or a one-element list of either)."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    _unknown(body, _COMMON_FIELDS | {"prompt", "echo"})
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
        raise bad("prompt", f"prompt must be a non-empty string or a non-empty list of token ids, got {clip(prompt)}")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad("echo", f"echo must be true or false, got {clip(echo)}")
    if echo and not isinstance(prompt, str) and _logprobs(body, "completion") is None:
        # With logprobs, token ids echo as their tokens' text (the prompt event carries each
        # token's): lm-evaluation-harness sends token ids with echo and logprobs by default.
        raise bad("echo", "echo with a token-id prompt needs logprobs (the echo is its tokens' text)")
    if isinstance(prompt, list) and any(t >= _INT64 for t in prompt):
        raise bad("prompt", "prompt token ids must fit in 64 bits")
    job, stream, include_usage, timeout, n = _common(body, "completion", bool(echo))
    job["prompt"] = prompt
    gen = Generation("completion", _model(body), job, stream, include_usage, timeout, n, bool(echo))
    gen.prompt_logprobs = body.get("prompt_logprobs")
    return gen


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
    _unknown(
        body,
        _COMMON_FIELDS
        | set(_ONLY_DEFAULT_CHAT)
        | set(_TOOLS)
        | {"messages", "max_completion_tokens", "top_logprobs", "chat_template"},
    )
    if body.get("chat_template") is not None:
        raise bad(
            "chat_template", "chat_template: the model's own template is used; custom templates are not supported"
        )
    clean = check_messages(body.get("messages"))
    job, stream, include_usage, timeout, n = _common(body, "chat")
    job.update(_tools(body, _structured(body)[1]))
    job["messages"] = clean
    gen = Generation("chat", _model(body), job, stream, include_usage, timeout, n)
    gen.prompt_logprobs = body.get("prompt_logprobs")
    if gen.tools and (n > 1 or "best_of" in job):
        name = "n" if n > 1 else "best_of"
        raise bad(
            name,
            f"{name} must be 1 with tools (or tool turns in messages): a tool answer's calls are parsed from "
            "one choice's text; send n requests for n answers",
        )
    if body.get("max_completion_tokens") is not None:
        gen.max_tokens_name = "max_completion_tokens"
    return gen
