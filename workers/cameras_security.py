"""Who may drive `tandem streams` and what it tells them: the API keys and the Host names it
answers to (Security), and a camera's error reduced to a class (public_error), so the control
API is neither open to a browser page nor a port scanner of what the service can reach."""

from __future__ import annotations

import re

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
KEY_COOKIE = "tandem_streams_key"


def is_loopback(host: str) -> bool:
    import ipaddress

    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Security:
    """Who may drive the service: `api_keys` (none: no key, which run_streams allows on a
    loopback host only) and the names it answers to in the Host header: the bound host, the
    loopback names when bound to loopback, `allowed_hosts`, and the address a request came in
    on (an IP literal is no DNS rebinding: that needs a name the attacker controls)."""

    def __init__(self, api_keys=(), host: str = "127.0.0.1", allowed_hosts=()) -> None:
        self.api_keys = tuple(k for k in api_keys if k)
        names = {host.strip("[]").lower(), *(h.strip().strip("[]").lower() for h in allowed_hosts if h.strip())}
        if is_loopback(host):
            names.update(LOOPBACK_NAMES)
        self.hosts = frozenset(names)

    def host_ok(self, header: str | None, local_address: str | None) -> bool:
        if not header:
            return False
        name = header.strip().lower()
        if name.startswith("["):
            name = name[1 : name.find("]")] if "]" in name else name
        elif name.count(":") == 1:
            name = name.split(":", 1)[0]
        return name in self.hosts or (local_address is not None and name == local_address.lower())

    def key_ok(self, request) -> bool:
        import hmac

        if not self.api_keys:
            return True
        auth = request.headers.get("authorization", "")
        presented = auth[7:].strip() if auth[:7].lower() == "bearer " else request.cookies.get(KEY_COOKIE, "")
        presented_b = presented.encode("utf-8", "replace")
        # Every key compared, each in constant time: the timing says nothing of a guess.
        return any([hmac.compare_digest(presented_b, k.encode()) for k in self.api_keys])


def public_error(text: str | None) -> str | None:
    """A camera's error as a class, never what the target answered: GET /cameras must not tell a
    caller what answers on an internal address (an HTTP reason, a Content-Type, a banner read as
    a status line). The full text goes to the log."""
    if text is None:
        return None
    low = text.split("): ", 1)[-1].lower()  # past "camera ID (URL): ": the URL is the caller's own text
    limit = re.search(r"over the limit of ([0-9.]+ mpx) \(max_image_pixels\)", low)
    if limit:  # the operator's own limit is no answer of the target's: name it (not the frame's size)
        return f"frame too large: over the limit of {limit[1].replace('mpx', 'Mpx')} (max_image_pixels)"
    for needle, label in (
        ("valueerror: url", "refused by the URL policy"),
        ("timed out", "timed out"),
        ("timeout", "timed out"),
        ("connection refused", "connection refused"),
        ("refused", "connection refused"),
        ("too large", "frame too large"),
        ("imagetoolarge", "frame too large"),
        ("not multipart mjpeg", "not a video stream"),
        ("not a video", "not a video stream"),
        ("http 4", "HTTP client error (4xx)"),
        ("http 5", "HTTP server error (5xx)"),
        ("ended", "the stream ended"),
        ("resolve", "name not resolved"),
        ("name or service", "name not resolved"),
    ):
        if needle in low:
            return label
    return "not a video stream"


def public_row(row: dict) -> dict:
    """A camera row as the control API shows it: its error as a class (public_error)."""
    return {**row, "last_error": public_error(row.get("last_error"))}
