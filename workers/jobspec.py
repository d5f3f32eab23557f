"""What a task's JSON keyword arguments may hold, checked field by field. Clients run the same
checks before they submit; workers run them again, since any Celery client can send anything.
A bad field raises FieldError (a ValueError) naming it, as data and in its message. No torch
here: clients import this."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
from dataclasses import dataclass

from runtime import errors
from runtime.errors import FieldError
from runtime.llm.sampling_params import SamplingParams
from workers.urlguard import UrlPolicy, parse_url

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
GENERATE_FIELDS = ("prompt", "messages", "priority", "deadline_s", *SAMPLING_FIELDS)
DETECT_FIELDS = ("image", "url", "path", "priority", "deadline_s")
MAX_IMAGE_BYTES = 32 << 20


@dataclass(slots=True)
class GenerateSpec:
    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages
    params: SamplingParams
    priority: int = 0
    deadline_s: float | None = None  # from submission


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


def _messages(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise FieldError(
            "messages", f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise FieldError(
                f"messages[{i}]", f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}"
            )
    return messages


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
        body: str | list = _messages(messages)
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
    return GenerateSpec(body, params, priority, deadline)


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
