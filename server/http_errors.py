"""The HTTP error shape every Tandem service answers with, OpenAI's:
{"error": {"message", "type", "param", "code"}}.

Both HTTP apps use it, `tandem serve` (server/protocol.py) and `tandem streams`
(server/streams_app.py): one shape, so a client handles both services' errors alike.
Pure Python: no FastAPI, no torch.
"""

from __future__ import annotations

MAX_MESSAGE = 320  # characters of an error message at most (its own text plus what it repeats)


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
        message, param = _text(message), None if param is None else _text(param)
        if len(message) > MAX_MESSAGE:  # a check deeper down repeated its whole input (stop=[...] x 10,000)
            message = message[:MAX_MESSAGE] + "... (cut)"
        if param is not None and len(param) > 100:
            param = param[:100]
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def _text(s: str) -> str:
    """`s` with any lone surrogate escaped: the answer is JSON in UTF-8, which cannot carry one."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    408: "timeout",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",  # a tenant past a limit (server/admission.py): with Retry-After
    503: "service_unavailable",
    504: "timeout",
}
