"""One guard for every URL this runtime dials on a caller's behalf: `tandem.detect`'s `url` and
the cameras a remote caller adds to `tandem streams`.

A URL a caller sends is a request to reach into the network this server sits in (server-side
request forgery: vLLM's CVE-2025-6242, SGLang #17269). So, in order:

    1. the text: an absolute URL of an allowed scheme, ASCII, no spaces, CR/LF or other control
       characters, no backslash, no user:password@ (cameras excepted, see below), a host and
       a port that parse, an IPv4 literal only in its dotted a.b.c.d form (`127.1`,
       `0x7f000001` and `2130706433` are 127.0.0.1 to the C resolver and to FFmpeg, so they
       are refused instead of guessed at);
    2. the path, normalised before it is matched: percent-decoded, dot segments removed; an
       encoded '/', '\\' or '.' (%2F, %5C, %2E, and the same encoded twice) is refused, since a
       server that decodes it would see a different path from the one matched, and so is a dot
       segment with ';' parameters ('..;/', a '..' to Tomcat, Jetty and Spring). The normalised
       path is the one requested, never the caller's text (nginx merges '//' in /a//../b);
    3. the allow-list: under one of the prefixes (same scheme, host and port, and the path at a
       segment boundary: `http://h/img` allows /img and /img/..., not /img2), or any host when
       the policy says so (cameras without --allowed-url-prefixes);
    4. the addresses: the host resolved once, and every answer checked. Loopback, private
       (RFC 1918, fc00::/7), link-local (169.254.0.0/16, fe80::/10), CGNAT (100.64.0.0/10),
       reserved and other non-global ranges, and the IPv4-mapped / NAT64 / 6to4 forms of
       them, are refused unless the operator allows private addresses (all of them, or the
       listed networks). Unspecified (0.0.0.0 reaches this host), multicast, and the cloud
       metadata services (169.254.169.254 and friends, metadata.google.internal, ...) are
       refused even then, unless their address lies in a listed network;
    5. the fetch dials the checked address (Host header and TLS SNI from the name; https
       verifies the certificate against the name), so a second DNS answer cannot swap the
       target in between (DNS rebinding). Each redirect (at most `max_redirects`) goes through
       1-5 again; the body is streamed and stopped past `max_bytes`; one deadline of
       `timeout_s` covers every hop from connecting to the last byte. An answer that is no
       2xx is a ValueError naming url ("url: the server answered 404 Not Found").

Every refusal is a ValueError whose message starts with "url", so `tandem serve` answers 400.

Environment (UrlPolicy.from_env; `tandem.detect` and `tandem streams` read the same ones):

    TANDEM_ALLOWED_URL_PREFIXES    comma-separated prefixes `tandem.detect` may fetch ("" = none)
    TANDEM_ALLOW_PRIVATE_URLS      1: allow loopback, private, link-local and CGNAT addresses (0)
    TANDEM_ALLOWED_URL_NETWORKS    comma-separated CIDRs (or single addresses) allowed even when
                                   private, e.g. 10.0.0.0/8,192.168.1.20 (""); the only way to
                                   reach a metadata address
    TANDEM_URL_MAX_BYTES           most bytes one fetch reads (33554432 = 32 MiB)
    TANDEM_URL_TIMEOUT_S           one fetch's deadline, all hops together, in seconds (10)
    TANDEM_URL_MAX_REDIRECTS       redirects one fetch follows, each checked (3)

Cameras (workers/cameras.py) use CAMERA_SCHEMES and allow user:password@, which RTSP cameras
need and FFmpeg only reads from the URL; the host checked is the one Python parses, and the
URL FFmpeg opens carries the checked IP in place of the name, so the two cannot disagree.
Not covered: the time getaddrinfo itself takes (the system resolver's own timeouts bound it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import ipaddress
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from workers.settings import env_numbers

DETECT_SCHEMES = ("http", "https")
CAMERA_SCHEMES = ("rtsp", "rtsps", "rtmp", "http", "https", "tcp", "udp")
DEFAULT_PORTS = {"http": 80, "https": 443, "rtsp": 554, "rtsps": 322, "rtmp": 1935}
MAX_URL = 2048
REDIRECTS = (301, 302, 303, 307, 308)
# Cloud instance metadata: credentials live there. Names and addresses of AWS, GCP, Azure,
# Oracle, DigitalOcean (169.254.169.254), AWS ECS task metadata (169.254.170.2), AWS IPv6
# (fd00:ec2::254) and Alibaba (100.100.100.200).
METADATA_HOSTS = frozenset(
    {"metadata", "metadata.google.internal", "metadata.goog", "instance-data", "instance-data.ec2.internal"}
)
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200")
)
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")
_NUMERIC_LABEL = re.compile(r"(0x[0-9a-f]*|[0-9]+)")
_BAD_ESCAPES = re.compile(r"%(2e|2f|5c|0[0-9a-f]|1[0-9a-f]|7f)", re.IGNORECASE)
_PATH_SAFE = "/!$&'()*+,;=:@-._~"  # RFC 3986 pchar minus '%': what stays unescaped when re-quoted

Resolver = Callable[[str, int], list[str]]


def resolve(host: str, port: int) -> list[str]:
    """The host's addresses, as the system resolver answers (the default UrlPolicy.resolver)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"url: cannot resolve host {host!r}: {exc}") from None
    return list(dict.fromkeys(info[4][0] for info in infos))  # in order, each once


def redact(url: str) -> str:
    """`url` with the password of its userinfo masked, for messages."""
    return re.sub(r"(://[^/\s:@]*):[^/\s@]*@", r"\1:***@", url)


@dataclass(frozen=True, slots=True)
class CheckedUrl:
    """A URL that passed the guard. `url` is the normalised form (the one requested); the
    connection goes to one of `addresses`, each of which was checked."""

    url: str
    scheme: str
    host: str  # lower case, an IPv6 literal without brackets
    port: int
    target: str  # normalised path plus ?query: the request line's target
    userinfo: str | None
    addresses: tuple[str, ...] = ()

    def pinned(self, address: str | None = None) -> str:
        """The URL with `address` (default: the first checked one) in place of the host, for
        clients that dial by themselves (FFmpeg): they then connect where the guard looked."""
        ip = address or self.addresses[0]
        host = f"[{ip}]" if ":" in ip else ip
        auth = f"{self.userinfo}@" if self.userinfo is not None else ""
        return f"{self.scheme}://{auth}{host}:{self.port}{self.target}"


@dataclass(slots=True)
class UrlPolicy:
    """What a URL may be and reach. `prefixes` empty and `any_host` False: no URL at all (the
    worker's default). `allowed_networks`: CIDRs reachable even when private. `resolver`
    (host, port) -> addresses and `ssl_context` are injectable, for tests."""

    schemes: tuple[str, ...] = DETECT_SCHEMES
    prefixes: tuple[str, ...] = ()
    any_host: bool = False
    allow_private: bool = False
    allowed_networks: tuple[str, ...] = ()
    allow_userinfo: bool = False
    max_bytes: int = 32 << 20
    timeout_s: float = 10.0
    max_redirects: int = 3
    resolver: Resolver = field(default=resolve, repr=False, compare=False)
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    _prefixes: tuple[CheckedUrl, ...] = field(init=False, repr=False, compare=False, default=())
    _networks: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        self.schemes = tuple(self.schemes)
        bad = [s for s in self.schemes if s not in CAMERA_SCHEMES]
        if not self.schemes or bad:
            raise ValueError(f"schemes must be some of {list(CAMERA_SCHEMES)}, got {list(self.schemes)}")
        for name in ("any_host", "allow_private", "allow_userinfo"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        mb = self.max_bytes
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise ValueError(f"max_bytes must be an integer >= 1, got {mb!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise ValueError(f"timeout_s must be a number in (0, 3600] seconds, got {t!r}")
        r = self.max_redirects
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= 10:
            raise ValueError(f"max_redirects must be an integer in [0, 10], got {r!r}")
        self.prefixes = tuple(p.strip() for p in self.prefixes if p and p.strip())
        parsed = []
        for p in self.prefixes:
            try:
                parsed.append(_parse(p, self.schemes, allow_userinfo=False))
            except ValueError as exc:
                raise ValueError(f"prefixes: {p!r} is no valid URL prefix ({exc})") from None
        self._prefixes = tuple(parsed)
        nets = []
        for n in self.allowed_networks:
            try:
                nets.append(ipaddress.ip_network(n.strip(), strict=False))
            except ValueError:
                raise ValueError(f"allowed_networks must be CIDRs like 10.0.0.0/8 or addresses, got {n!r}") from None
        self._networks = tuple(nets)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> UrlPolicy:
        """The policy the environment sets (see the module docstring); `overrides` (e.g.
        prefixes from a flag, schemes for cameras) win over it. A bad value names its variable."""
        env = os.environ if env is None else env
        kw: dict = {}
        if env.get("TANDEM_ALLOWED_URL_PREFIXES"):
            kw["prefixes"] = tuple(p.strip() for p in env["TANDEM_ALLOWED_URL_PREFIXES"].split(","))
        flag = env.get("TANDEM_ALLOW_PRIVATE_URLS", "").strip().lower()
        if flag not in ("", "0", "1", "true", "false", "yes", "no"):
            raise ValueError(f"TANDEM_ALLOW_PRIVATE_URLS must be 1 or 0, got {env['TANDEM_ALLOW_PRIVATE_URLS']!r}")
        kw["allow_private"] = flag in ("1", "true", "yes")
        if env.get("TANDEM_ALLOWED_URL_NETWORKS", "").strip():
            kw["allowed_networks"] = tuple(n for n in env["TANDEM_ALLOWED_URL_NETWORKS"].split(",") if n.strip())
        kw |= env_numbers(
            env,
            ("max_bytes", "TANDEM_URL_MAX_BYTES", int),
            ("timeout_s", "TANDEM_URL_TIMEOUT_S", float),
            ("max_redirects", "TANDEM_URL_MAX_REDIRECTS", int),
        )
        kw.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**kw)
        except ValueError as exc:
            if "allowed_networks" in str(exc):
                raise ValueError(f"TANDEM_ALLOWED_URL_NETWORKS: {exc}") from None
            raise


# ---- 1-3: the text, the path, the allow-list (no I/O) --------------------------------------------


def parse_url(url: object, policy: UrlPolicy) -> CheckedUrl:
    """The normalised URL if its text, path and allow-list pass (1-3 above), without resolving
    it: what a client or the server checks before a job is queued."""
    checked = _parse(url, policy.schemes, policy.allow_userinfo)
    if policy._prefixes:
        if not any(_under(checked, p) for p in policy._prefixes):
            raise ValueError(
                f"url {redact(checked.url)!r} is not under an allowed prefix "
                "(TANDEM_ALLOWED_URL_PREFIXES, --allowed-url-prefixes)"
            )
    elif not policy.any_host:
        raise ValueError("url: this server fetches no URLs (set TANDEM_ALLOWED_URL_PREFIXES to allow some)")
    return checked


def _parse(url: object, schemes: tuple[str, ...], allow_userinfo: bool) -> CheckedUrl:
    if not isinstance(url, str) or not url:
        raise ValueError(f"url must be a non-empty string, got {type(url).__name__}")
    if len(url) > MAX_URL:
        raise ValueError(f"url must be at most {MAX_URL} characters, got {len(url)}")
    if any(ord(c) <= 32 or ord(c) >= 127 for c in url) or "\\" in url:
        # CR/LF would split the request line (header injection); a backslash is '/' to browsers
        # and some servers but not to urlsplit; non-ASCII hosts have an ASCII (punycode) form.
        raise ValueError("url must be ASCII without spaces, control characters (CR, LF, tab, ...) or backslashes")
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        shown = f"scheme {scheme + '://'!r}" if scheme else "no scheme"
        raise ValueError(f"url must be an absolute {', '.join(s + '://' for s in schemes)} URL, got {shown}")
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if at and not allow_userinfo:
        raise ValueError("url must not carry user:password@ (userinfo)")
    if "@" in userinfo:
        raise ValueError("url must have at most one '@' (user:password@host)")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise ValueError(f"url has no host: {redact(url)!r}")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"url has a malformed port ({exc})") from None
    host = _check_host(host, hostport)
    if port is None:
        port = DEFAULT_PORTS.get(scheme)
        if port is None:
            raise ValueError(f"url: a {scheme}:// URL needs a port")
    if port == 0:
        raise ValueError("url port must be in [1, 65535], got 0")
    path = _normalise_path(parts.path) if scheme in ("http", "https", "rtsp", "rtsps") else parts.path or ""
    if scheme in ("http", "https", "rtsp", "rtsps"):
        path = path or "/"
    target = path + (f"?{parts.query}" if parts.query else "")
    shown_host = f"[{host}]" if ":" in host else host
    default = DEFAULT_PORTS.get(scheme) == port
    auth = f"{userinfo}@" if at else ""
    normal = f"{scheme}://{auth}{shown_host}{'' if default else f':{port}'}{target}"
    return CheckedUrl(normal, scheme, host, port, target, userinfo if at else None)


def _check_host(host: str, hostport: str) -> str:
    if hostport.startswith("["):  # an IPv6 literal: urlsplit took what is inside the brackets
        try:
            if "%" in host:  # a zone id (fe80::1%eth0) picks an interface: never a caller's choice
                raise ValueError
            ip = ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"url host [{host}] is no IPv6 address") from None
        return str(ip)
    if not _HOST_NAME.fullmatch(host):
        raise ValueError(f"url host {host!r} is no valid host name (letters, digits, '-', '.'; punycode)")
    if _NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]):
        # A host ending in a number is an IPv4 address to every URL parser that matters
        # (WHATWG, inet_aton, FFmpeg): 127.1, 0x7f000001, 2130706433 and 0177.0.0.1 all reach
        # 127.0.0.1. Only the one form that reads the same everywhere is accepted.
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise ValueError(f"url host {host!r} is an IPv4 address in a non-canonical form; write a.b.c.d") from None
    return host


def _normalise_path(raw: str) -> str:
    """`raw` percent-decoded and without dot segments, re-quoted; refuses escapes whose
    decoding would change what the path means (%2F, %5C, %2E, control characters, %25xx)."""
    if re.search(r"%(?![0-9a-fA-F]{2})", raw):
        raise ValueError("url path has a '%' that is no %XX escape")
    if _BAD_ESCAPES.search(raw):
        raise ValueError("url path must not percent-encode '/', '\\', '.' or control characters (%2F, %5C, %2E, ...)")
    decoded = urllib.parse.unquote(raw, errors="strict")
    if ("%" in decoded and _BAD_ESCAPES.search(decoded)) or "\\" in decoded:
        raise ValueError("url path is encoded twice (%25...) to hide '/', '\\' or '.'")
    if any(ord(c) < 32 or ord(c) == 127 for c in decoded):
        raise ValueError("url path must not encode control characters")
    if any(seg.split(";", 1)[0] in (".", "..") for seg in decoded.split("/") if ";" in seg):
        # Tomcat, Jetty and Spring drop a segment's ";params" before resolving dot segments, so
        # /img/..;/admin is /admin to them while RFC 3986 (and this guard) keeps "..;" as a name.
        # Refused rather than resolved: the servers disagree on what such a segment is.
        raise ValueError("url path must not put ';' parameters on a '.' or '..' segment (e.g. '..;/')")
    return urllib.parse.quote(_remove_dot_segments(decoded), safe=_PATH_SAFE)


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 section 5.2.4 on a path split at '/': '.' goes, '..' takes the segment before."""
    out: list[str] = []
    segments = path.split("/")
    for i, seg in enumerate(segments):
        if seg == ".":
            if i == len(segments) - 1:
                out.append("")  # "/a/." is "/a/"
        elif seg == "..":
            if len(out) > 1:
                out.pop()
            if i == len(segments) - 1:
                out.append("")
        else:
            out.append(seg)
    joined = "/".join(out)
    return joined if not path.startswith("/") or joined.startswith("/") else "/" + joined


def _under(url: CheckedUrl, prefix: CheckedUrl) -> bool:
    if (url.scheme, url.host, url.port) != (prefix.scheme, prefix.host, prefix.port):
        return False
    base = prefix.target.split("?", 1)[0]
    path = url.target.split("?", 1)[0]
    return path == base or path.startswith(base if base.endswith("/") else base + "/")


# ---- 4: the addresses ------------------------------------------------------------------------------


def address_kind(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why `ip` is no public unicast address (e.g. "a loopback address"), or None if it is."""
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if ip.version == 6:
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            kind = address_kind(embedded)
            return f"{kind} (as {ip})" if kind else None
    if ip.is_unspecified:
        return "the unspecified address (it reaches this host)"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.version == 4 and ip in _CGNAT:
        return "a CGNAT (100.64.0.0/10) address"
    if ip.is_reserved:  # before is_private, which also holds 240.0.0.0/4
        return "a reserved address"
    if ip.is_private:
        return "a private address"
    if not ip.is_global:
        return "a reserved, non-public address"
    return None


_NEVER = ("cloud metadata", "unspecified", "multicast")  # refused even with allow_private


def check_address(address: str, policy: UrlPolicy, host: str) -> None:
    """ValueError naming url unless `policy` lets a connection go to `address` (host's answer)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    forms = [ip] + ([ip.ipv4_mapped] if ip.version == 6 and ip.ipv4_mapped else [])
    if any(f in net for f in forms for net in policy._networks if f.version == net.version):
        return  # listed by the operator: allowed whatever it is
    kind = address_kind(ip)
    if kind is None or (policy.allow_private and not any(n in kind for n in _NEVER)):
        return
    where = f"host {host!r} resolves to {address}" if host != str(ip) else f"host {address}"
    how = "list its network in TANDEM_ALLOWED_URL_NETWORKS"
    if not any(n in kind for n in _NEVER):
        how = "set TANDEM_ALLOW_PRIVATE_URLS=1 or " + how
    raise ValueError(f"url: {where}, {kind}; refused ({how} to allow it)")


def check_url(url: object, policy: UrlPolicy) -> CheckedUrl:
    """`url` parsed and normalised (parse_url) with its host resolved once and every address
    checked; the result's `addresses` are the ones a connection may go to."""
    checked = parse_url(url, policy)
    if checked.host in METADATA_HOSTS or checked.host.endswith(".metadata.google.internal"):
        raise ValueError(f"url host {checked.host!r} is a cloud metadata service; refused")
    try:
        literal = ipaddress.ip_address(checked.host)
    except ValueError:
        literal = None
    addresses = [str(literal)] if literal is not None else policy.resolver(checked.host, checked.port)
    if not addresses:
        raise ValueError(f"url: host {checked.host!r} resolves to no address")
    for address in addresses:  # every answer: a name that also resolves privately is refused
        check_address(address, policy, checked.host)
    return dataclasses.replace(checked, addresses=tuple(addresses))


# ---- 5: the fetch ----------------------------------------------------------------------------------


def fetch(url: str, policy: UrlPolicy) -> bytes:
    """The body of a GET of `url`, dialled at the checked address, every redirect re-checked,
    at most policy.max_bytes read, all within policy.timeout_s. ValueError naming url for a
    refusal, a failure to connect, a timeout, and any answer other than 2xx."""
    deadline = time.monotonic() + policy.timeout_s
    current = check_url(url, policy)
    for hop in range(policy.max_redirects + 1):
        if current.scheme not in DETECT_SCHEMES:  # a camera policy lets rtsp:// through; GET speaks http(s)
            raise ValueError(f"url: fetch speaks http:// and https://, not {current.scheme}://")
        status, reason, location, body = _get(current, policy, deadline)
        if status in REDIRECTS:
            if not location:
                raise ValueError(f"url: the server answered {status} {reason} without a Location")
            if hop == policy.max_redirects:
                raise ValueError(f"url: more than {policy.max_redirects} redirects")
            nxt = urllib.parse.urljoin(current.url, location)
            try:
                current = check_url(nxt, policy)
            except ValueError as exc:
                raise ValueError(f"url: redirected to {redact(nxt)!r}, which is refused: {exc}") from None
            continue
        if not 200 <= status < 300:
            raise ValueError(f"url: the server answered {status} {reason}".rstrip())
        return body
    raise AssertionError("unreachable")


def _get(url: CheckedUrl, policy: UrlPolicy, deadline: float) -> tuple[int, str, str | None, bytes]:
    """One GET: (status, reason, Location, body). The body is read only for a 2xx."""
    expired = threading.Event()
    try:
        with pinned_connection(url, deadline, policy.ssl_context, expired) as conn:
            headers = {"User-Agent": "tandem", "Accept": "image/*, */*;q=0.5", "Connection": "close"}
            conn.request("GET", url.target, headers=headers)
            resp = conn.getresponse()
            status, reason = resp.status, resp.reason
            if not 200 <= status < 300:
                return status, reason, resp.getheader("Location"), b""
            length = resp.getheader("Content-Length")
            if length and length.strip().isdigit() and int(length) > policy.max_bytes:
                raise ValueError(f"url: the answer is larger than {policy.max_bytes} bytes (Content-Length {length})")
            chunks, total = [], 0
            while chunk := resp.read1(64 << 10):
                total += len(chunk)
                if total > policy.max_bytes:
                    raise ValueError(f"url: the answer is larger than {policy.max_bytes} bytes")
                chunks.append(chunk)
            if expired.is_set() or resp.length:  # cut by the deadline, or short of its Content-Length
                raise TimeoutError if expired.is_set() else http.client.IncompleteRead(b"", resp.length)
            return status, reason, None, b"".join(chunks)
    except TimeoutError:
        raise ValueError(f"url: no complete answer within {policy.timeout_s:g} s (timed out)") from None
    except ssl.SSLError as exc:  # a certificate that does not match the name lands here
        raise ValueError(f"url: TLS with {url.host!r} failed: {exc}") from None
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set():
            raise ValueError(f"url: no complete answer within {policy.timeout_s:g} s (timed out)") from None
        raise ValueError(f"url: fetching from {url.host!r} failed: {type(exc).__name__}: {exc}") from None


@contextlib.contextmanager
def pinned_connection(
    url: CheckedUrl, deadline: float, context: ssl.SSLContext | None, expired: threading.Event
) -> Iterator[http.client.HTTPConnection]:
    """An http.client connection to the addresses check_url checked, connected, with one
    deadline (time.monotonic()) for everything from dialling to the last byte; closed on exit.
    TimeoutError if the deadline passes before it connects.

    http.client dials through `_create_connection` (HTTPSConnection wraps the socket it returns
    with SNI and certificate checks for url.host): aimed at the checked addresses, the name still
    goes into Host and TLS, and no second lookup happens. Proxies in the environment are not
    used (http.client never reads them). Past the deadline the socket is shut down, which ends
    any blocked read, and `expired` is set: a server that drips a byte per socket timeout would
    otherwise hold the caller for ever. socket.socket.shutdown, not SSLSocket's, which drops its
    TLS state under the reading thread."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if url.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            url.host, url.port, timeout=left, context=context or ssl.create_default_context()
        )
    else:
        conn = http.client.HTTPConnection(url.host, url.port, timeout=left)
    conn._create_connection = lambda _addr, t=None, src=None: _dial(url, deadline)
    timer = None
    try:
        conn.connect()
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), _expire, (conn.sock, expired))
        timer.daemon = True
        timer.start()
        yield conn
    finally:
        if timer is not None:
            timer.cancel()
        conn.close()


def _dial(url: CheckedUrl, deadline: float) -> socket.socket:
    """A TCP connection to the first of url.addresses that answers."""
    error: OSError | None = None
    for address in url.addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        try:
            return socket.create_connection((address, url.port), timeout=left)
        except OSError as exc:
            error = exc
    raise error or OSError("no address")


def _expire(sock: socket.socket, expired: threading.Event) -> None:
    expired.set()
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # closed meanwhile
