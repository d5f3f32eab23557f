"""Errors that carry the field they are about as data, not only in their message.

A `FieldError` is a ValueError (every caller that catches ValueError still does), with
`.field`, the path of the bad field as the request spelled it (`max_tokens`,
`messages[2].tool_calls[0].function.arguments`), and `.code`, what is wrong with it (one of
CODES). The HTTP layer answers from these (400 with `param` = field), never from the message's
words: the message is for people, and still starts with the field's name.

Pure Python: no torch, no Redis; every floor above may raise or catch it.
"""

from __future__ import annotations

INVALID = "invalid"  # the wrong type or shape, or a value the field does not take
OUT_OF_RANGE = "out_of_range"  # a number (or a length) outside the allowed range
MISSING = "missing"  # a field that must be given was not
UNKNOWN = "unknown"  # no such field
UNSUPPORTED = "unsupported"  # a real field (OpenAI's, vLLM's) that this server does not implement
CONFLICT = "conflict"  # fields that exclude each other (give one, not both)
TOO_LONG = "too_long"  # more than the model's context holds
CODES = (INVALID, OUT_OF_RANGE, MISSING, UNKNOWN, UNSUPPORTED, CONFLICT, TOO_LONG)


class FieldError(ValueError):
    """A bad value of one field. `str(exc)` is the message; `field` and `code` are its data."""

    def __init__(self, field: str, message: str, code: str = INVALID) -> None:
        if not isinstance(field, str) or not field:
            raise TypeError(f"field must be a non-empty string, got {field!r}")
        if code not in CODES:
            raise TypeError(f"code must be one of {CODES}, got {code!r}")
        super().__init__(message)
        self.field = field
        self.code = code

    def __reduce__(self):
        # Pickled across threads and processes (Celery, concurrent.futures): keep the data.
        return (type(self), (self.field, str(self), self.code))

    def to_dict(self) -> dict:
        """The JSON that crosses Redis with a failed job (workers) and comes back as from_dict."""
        return {"message": str(self), "field": self.field, "code": self.code}

    @classmethod
    def from_dict(cls, data: dict) -> FieldError:
        return cls(data["field"], data["message"], data.get("code", INVALID))

    def under(self, prefix: str) -> FieldError:
        """The same error seen from an enclosing field: `tools[1]` + `.function.name`."""
        sep = "" if self.field.startswith("[") else "."
        field = f"{prefix}{sep}{self.field}"
        message = str(self)
        if message.startswith(self.field):
            message = field + message[len(self.field) :]
        return FieldError(field, message, self.code)
