"""What a task's JSON keyword arguments may hold, checked field by field. Clients run the same
checks before they submit; workers run them again, since any Celery client can send anything.
A bad field raises FieldError (a ValueError) naming it, as data and in its message. No torch
here: clients import this."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import os
import re
from dataclasses import dataclass

from runtime import errors
from runtime.errors import FieldError
from runtime.llm.sampling_params import SamplingParams
from workers.tool_stream import TOOL_FIELDS, ToolJob
from workers.urlguard import UrlPolicy, parse_url

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
GENERATE_FIELDS = ("prompt", "messages", "priority", "deadline_s", "tenant", "tier", *TOOL_FIELDS, *SAMPLING_FIELDS)
DETECT_FIELDS = ("image", "url", "path", "priority", "deadline_s")
MAX_IMAGE_BYTES = 32 << 20
# Fair shares (the engine's policy="fair", schedulers/fair.py): a job's tenant, and its tier.
# A job that names no tenant is the anonymous tenant's, as a request to `tandem serve` without
# API keys is (server/tenants.py).
DEFAULT_TENANT = "default"
TIERS = ("interactive", "batch")  # schedulers/request.py's: batch runs in the slots interactive leaves
TENANT_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,64}")


@dataclass(slots=True)
class GenerateSpec:
    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages
    params: SamplingParams
    priority: int = 0
    deadline_s: float | None = None  # from submission
    tools: ToolJob | None = None  # tools offered, or tool turns in the messages (tool_stream.py)
    tenant: str = DEFAULT_TENANT
    tier: str = "interactive"


@dataclass(slots=True)
class DetectSpec:
    kind: str  # "image" (base64 bytes), "url" or "path"
    value: str
    priority: int = 0
    deadline_s: float | None = None


def _unknown(kwargs: dict, allowed: tuple[str, ...], task: str) -> None:
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise FieldError(
            unknown[0], f"{unknown[0]}: unknown field(s) {unknown} of {task}; allowed: {list(allowed)}", errors.UNKNOWN
        )


def _common(kwargs: dict) -> tuple[int, float | None]:
    priority = kwargs.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise FieldError("priority", f"priority must be an integer (lower runs first), got {priority!r}")
    deadline = kwargs.get("deadline_s")
    bad = isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not deadline > 0
    if deadline is not None and bad:
        raise FieldError(
            "deadline_s",
            f"deadline_s must be a number > 0 (seconds from submission) or None, got {deadline!r}",
            errors.OUT_OF_RANGE,
        )
    return priority, deadline


def check_chat_messages(messages: object) -> list[dict]:
    """Chat messages as jobs carry them: {"role", "content": str}, and the tool turns: an
    assistant's {"content": str | None, "tool_calls": [...]} (check_tool_calls) and a tool's
    result {"content": str, "tool_call_id": <an earlier call's id>}."""
    if not isinstance(messages, list) or not messages:
        raise FieldError(
            "messages", f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}"
        )
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise FieldError(at, f"{at} must be a dict with string 'role' and 'content', got {m!r}")
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant":
                raise FieldError(f"{at}.tool_calls", f"{at}.tool_calls: only assistant messages carry tool calls")
            call_ids.update(c["id"] for c in check_tool_calls(f"{at}.tool_calls", calls))
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and calls):
            null = " (or null, with tool_calls)" if m["role"] == "assistant" else ""
            raise FieldError(f"{at}.content", f"{at}.content must be a string{null}, got {content!r}")
        check_tool_call_id(at, m, call_ids)
    return messages


def check_tool_calls(at: str, calls: object) -> list[dict]:
    """An assistant message's tool_calls, as OpenAI sends them back: a non-empty list of
    {"id", "type": "function", "function": {"name", "arguments": <JSON text of an object>}}."""
    if not isinstance(calls, list) or not calls:
        raise FieldError(at, f"{at} must be a non-empty list of calls, got {calls!r}")
    for j, call in enumerate(calls):
        cat = f"{at}[{j}]"
        if not isinstance(call, dict):
            raise FieldError(cat, f"{cat} must be an object {{'id', 'type': 'function', 'function'}}, got {call!r}")
        extra = sorted(set(call) - {"id", "type", "function"})
        if extra:
            raise FieldError(f"{cat}.{extra[0]}", f"{cat}.{extra[0]} is not a field of a tool call", errors.UNKNOWN)
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise FieldError(f"{cat}.id", f"{cat}.id must be a non-empty string, got {call.get('id')!r}")
        if call.get("type", "function") != "function":
            raise FieldError(f"{cat}.type", f"{cat}.type must be 'function', got {call.get('type')!r}")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise FieldError(f"{cat}.function", f"{cat}.function must be an object {{'name', 'arguments'}}, got {fn!r}")
        extra = sorted(set(fn) - {"name", "arguments"})
        if extra:
            raise FieldError(f"{cat}.function.{extra[0]}", f"{cat}.function.{extra[0]} is not a field", errors.UNKNOWN)
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise FieldError(f"{cat}.function.name", f"{cat}.function.name must be a non-empty string")
        args, where = fn.get("arguments"), f"{cat}.function.arguments"
        if not isinstance(args, str):
            raise FieldError(where, f"{where} must be the JSON text of an object (a string), got {type(args).__name__}")
        try:
            parsed = json.loads(args)
        except ValueError:
            raise FieldError(where, f"{where} is not valid JSON: {args[:80]!r}") from None
        if not isinstance(parsed, dict):
            raise FieldError(where, f"{where} must be the JSON text of an object, got {args[:80]!r}")
    return calls


def check_tool_call_id(at: str, message: dict, call_ids: set[str]) -> None:
    """A tool message answers a call an earlier assistant message made; no other role names one."""
    cid = message.get("tool_call_id")
    if message["role"] != "tool":
        if cid is not None:
            raise FieldError(f"{at}.tool_call_id", f"{at}.tool_call_id: only tool messages answer a call")
        return
    if not isinstance(cid, str) or not cid:
        raise FieldError(
            f"{at}.tool_call_id", f"{at}.tool_call_id must be the id of an earlier tool call", errors.MISSING
        )
    if cid not in call_ids:
        raise FieldError(f"{at}.tool_call_id", f"{at}.tool_call_id {cid[:80]!r} is the id of no earlier tool call")


def _token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def parse_generate(kwargs: dict) -> GenerateSpec:
    _unknown(kwargs, GENERATE_FIELDS, "tandem.generate")
    prompt, messages = kwargs.get("prompt"), kwargs.get("messages")
    if (prompt is None) == (messages is None):
        raise FieldError(
            "prompt" if prompt is not None or messages is None else "messages",
            "prompt or messages: give exactly one (a prompt string or token ids, or chat messages)",
            errors.CONFLICT if prompt is not None else errors.MISSING,
        )
    if messages is not None:
        body: str | list = check_chat_messages(messages)
    elif isinstance(prompt, str) and prompt:
        body = prompt
    elif isinstance(prompt, list) and prompt and all(_token_id(t) for t in prompt):
        body = prompt
    else:
        raise FieldError(
            "prompt", f"prompt must be a non-empty string or a non-empty list of token ids, got {prompt!r}"
        )
    params = SamplingParams(**{k: kwargs[k] for k in SAMPLING_FIELDS if k in kwargs})
    priority, deadline = _common(kwargs)
    tools = ToolJob.from_kwargs(kwargs)
    if tools is not None:
        tools.check_params(params)
    tenant, tier = check_tenancy(kwargs)
    return GenerateSpec(body, params, priority, deadline, tools, tenant, tier)


def check_tenancy(kwargs: dict) -> tuple[str, str]:
    """A generate job's (tenant, tier): tenant 1-64 characters of [A-Za-z0-9._:@-] (default
    DEFAULT_TENANT), tier one of TIERS (default interactive)."""
    tenant = kwargs.get("tenant", DEFAULT_TENANT)
    if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
        raise FieldError("tenant", f"tenant must be 1-64 characters of [A-Za-z0-9._:@-], got {tenant!r}")
    tier = kwargs.get("tier", "interactive")
    if tier not in TIERS:
        raise FieldError("tier", f"tier must be one of {list(TIERS)}, got {tier!r}")
    return tenant, tier


BATCH_QUEUE_PRIORITY = 10  # store.broker_priority's last list: polled after every other


def queue_priority(priority: int, tier: str) -> int:
    """The priority a job waits in Redis under: its own, or for a batch job no better than
    BATCH_QUEUE_PRIORITY, so that a worker takes the interactive jobs queued behind a batch
    backlog first (the engine then orders the tiers itself: schedulers/continuous.py)."""
    return max(priority, BATCH_QUEUE_PRIORITY) if tier == "batch" else priority


def tenancy_kwargs(tenant: str, tier: str) -> dict:
    """Runtime.submit_generate's tenant and tier keywords for a job's: none for the defaults
    (DEFAULT_TENANT is the engine's anonymous tenant, ""), so a default job asks nothing new of
    the Runtime."""
    out = {}
    if tenant != DEFAULT_TENANT:
        out["tenant"] = tenant
    if tier != "interactive":
        out["tier"] = tier
    return out


def parse_detect(kwargs: dict) -> DetectSpec:
    _unknown(kwargs, DETECT_FIELDS, "tandem.detect")
    given = [k for k in ("image", "url", "path") if kwargs.get(k) is not None]
    if len(given) != 1:
        raise FieldError(
            given[1] if given else "image",
            f"image, url or path: give exactly one, got {given or 'none'}",
            errors.CONFLICT if given else errors.MISSING,
        )
    kind = given[0]
    value = kwargs[kind]
    if not isinstance(value, str) or not value:
        raise FieldError(kind, f"{kind} must be a non-empty string, got {type(value).__name__}")
    priority, deadline = _common(kwargs)
    return DetectSpec(kind, value, priority, deadline)


def decode_image_b64(value: str) -> bytes:
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise FieldError("image", "image must be base64-encoded image bytes") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise FieldError("image", f"image must be at most {MAX_IMAGE_BYTES} bytes, got {len(data)}", errors.TOO_LONG)
    return data


def allowed_path(path: str, roots: tuple[str, ...]) -> str:
    """The real path of `path` if it lies under one of `roots` (after resolving symlinks and
    '..'), else ValueError. With no roots configured no path is allowed."""
    if not roots:
        raise FieldError(
            "path", "path: this worker allows no file paths (set TANDEM_ALLOWED_ROOTS)", errors.UNSUPPORTED
        )
    real = os.path.realpath(path)
    for root in roots:
        if os.path.commonpath([real, root]) == root:
            return real
    raise FieldError("path", f"path {path!r} is outside the allowed roots (TANDEM_ALLOWED_ROOTS)")


def allowed_url(url: str, prefixes: tuple[str, ...]) -> str:
    """`url` normalised (percent-decoded, dot segments removed) if it is a plain http(s) URL
    under one of `prefixes`, else ValueError naming url. Only the text is checked here (no DNS):
    workers.urlguard.fetch checks the addresses, where the connection is made."""
    return parse_url(url, UrlPolicy(prefixes=prefixes)).url
