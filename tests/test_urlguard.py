"""workers/urlguard.py: every URL a caller gives is checked before anything dials it, and the
fetch dials the checked address. Live fetches go to real loopback HTTP(S) servers (127.0.0.1
and 127.0.0.2, both on lo) that the policy allows by network; names resolve through an
injected resolver, so a test can make a name answer with any address without touching DNS."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from workers.jobspec import allowed_url
from workers.urlguard import UrlPolicy, check_url, fetch, parse_url

PNG = b"\x89PNG\r\n\x1a\n" + b"x" * 100
ANY = UrlPolicy(any_host=True)  # any host, the default address rules


class Server:
    """A loopback HTTP server: /img/... and /secret.png answer bytes, /to?<url> redirects
    there, /status/<n> answers n, /big streams 1 MiB without Content-Length, /drip sends a
    byte every 0.1 s. `hits` holds (path, Host header) of every request."""

    def __init__(self, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> None:
        hits = self.hits = []
        self.stop = threading.Event()
        stop = self.stop

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hits.append((self.path, self.headers.get("Host")))
                path, _, query = self.path.partition("?")
                if path == "/to":
                    self.send_response(302)
                    self.send_header("Location", query)
                    self.end_headers()
                elif path.startswith("/status/"):
                    self.send_response(int(path.rsplit("/", 1)[1]))
                    self.end_headers()
                elif path == "/big":
                    self.send_response(200)
                    self.end_headers()
                    for _ in range(16):
                        self.wfile.write(b"x" * (64 << 10))
                elif path == "/drip":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    while not stop.wait(0.1):  # the subject is a slow server: it drips on a clock
                        try:
                            self.wfile.write(b"x")
                            self.wfile.flush()
                        except OSError:
                            return
                else:
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(PNG)))
                    self.end_headers()
                    self.wfile.write(PNG)

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.url = f"{'https' if tls else 'http'}://{host}:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def a():
    s = Server("127.0.0.1")
    yield s
    s.close()


@pytest.fixture(scope="module")
def b():
    s = Server("127.0.0.2")  # the "internal" server nothing may reach through a redirect
    yield s
    s.close()


def only(net: str, **kw) -> UrlPolicy:
    """A policy that allows exactly `net` of the private ranges, and any host."""
    return UrlPolicy(any_host=True, allowed_networks=(net,), **kw)


def names(table: dict[str, list[str]]):
    def resolver(host: str, port: int) -> list[str]:
        if host not in table:
            raise ValueError(f"url: cannot resolve host {host!r}")
        return table[host]

    return resolver


def refused(url: str, policy: UrlPolicy, match: str = "") -> str:
    with pytest.raises(ValueError) as exc:
        check_url(url, policy)
    message = str(exc.value)
    assert message.startswith("url"), message
    assert match in message, message
    return message


# ---- the addresses ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x.png",
        "http://127.8.9.10/",
        "http://[::1]/",
        "http://localhost/",
        "http://LOCALHOST./",
        "http://127.1/",
        "http://0x7f000001/",
        "http://2130706433/",
        "http://0177.0.0.1/",
        "http://[::ffff:127.0.0.1]/",
        "http://[::ffff:7f00:1]/",
        "http://[2002:7f00:1::]/",  # 6to4 of 127.0.0.1
    ],
)
def test_loopback_in_every_spelling_is_refused(url):
    refused(url, ANY)


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("http://10.1.2.3/", "private"),
        ("http://172.16.0.1/", "private"),
        ("http://192.168.1.1/", "private"),
        ("http://[fc00::1]/", "private"),
        ("http://[fd12:3456::1]/", "private"),
        ("http://[::ffff:10.0.0.1]/", "private"),
        ("http://[64:ff9b::a00:1]/", "private"),  # NAT64 of 10.0.0.1
        ("http://169.254.1.1/", "link-local"),
        ("http://[fe80::1]/", "link-local"),
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://[::ffff:169.254.169.254]/", "metadata"),
        ("http://[fd00:ec2::254]/", "metadata"),
        ("http://100.64.0.1/", "CGNAT"),
        ("http://0.0.0.0/", "unspecified"),
        ("http://[::]/", "unspecified"),
        ("http://224.0.0.1/", "multicast"),
        ("http://240.0.0.1/", "reserved"),
        ("http://255.255.255.255/", "reserved"),
    ],
)
def test_non_public_addresses_are_refused_naming_the_kind(url, kind):
    refused(url, ANY, kind)


def test_metadata_hostnames_and_addresses_stay_refused_when_private_ones_are_allowed():
    lax = UrlPolicy(any_host=True, allow_private=True)
    assert check_url("http://10.1.2.3/", lax).addresses == ("10.1.2.3",)
    assert check_url("http://127.0.0.1/", lax).addresses == ("127.0.0.1",)
    refused("http://metadata.google.internal/computeMetadata/v1/", lax, "metadata")
    refused("http://169.254.169.254/", lax, "metadata")
    refused("http://0.0.0.0/", lax, "unspecified")
    listed = only("169.254.169.254/32")  # only a listed network reaches it
    assert check_url("http://169.254.169.254/", listed).addresses == ("169.254.169.254",)


def test_a_name_that_resolves_to_a_private_address_is_refused():
    resolver = names({"img.example": ["10.0.0.5"], "mixed.example": ["8.8.8.8", "192.168.0.9"]})
    policy = UrlPolicy(any_host=True, resolver=resolver)
    message = refused("http://img.example/a.png", policy, "private")
    assert "'img.example' resolves to 10.0.0.5" in message
    refused("http://mixed.example/a.png", policy, "192.168.0.9")  # every answer is checked
    good = UrlPolicy(any_host=True, resolver=names({"cdn.example": ["8.8.8.8", "2001:4860:4860::8888"]}))
    assert check_url("http://cdn.example/a.png", good).addresses == ("8.8.8.8", "2001:4860:4860::8888")


# ---- the text and the path ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("file:///etc/passwd", "scheme 'file://'"),
        ("gopher://8.8.8.8:70/_GET", "scheme 'gopher://'"),
        ("ftp://8.8.8.8/x", "scheme 'ftp://'"),
        ("dict://8.8.8.8:11211/stat", "scheme"),
        ("//8.8.8.8/x.png", "no scheme"),
        ("http://user:pw@8.8.8.8/x.png", "userinfo"),
        ("http://8.8.8.8@127.0.0.1/x.png", "userinfo"),
        ("http://8.8.8.8/x.png\r\nX-Injected: 1", "control characters"),
        ("http://8.8.8.8/x.png%0d%0aX-Injected:%201", "control characters"),
        ("http://8.8.8.8/a b.png", "spaces"),
        ("http://8.8.8.8\\@127.0.0.1/", "backslash"),
        ("http://ex\u00e4mple.com/", "ASCII"),
        ("http://8.8.8.8:99999/", "port"),
        ("http:///x.png", "no host"),
        ("http://[fe80::1%25eth0]/", "IPv6"),
        ("http://8.8.8.8/a%zz", "%XX"),
    ],
)
def test_bad_text_is_refused_naming_url(url, match):
    refused(url, ANY, match)


PREFIX = UrlPolicy(prefixes=("http://img.example/img/",), resolver=names({"img.example": ["8.8.8.8"]}))


@pytest.mark.parametrize(
    "url",
    [
        "http://img.example/img/../secret.png",
        "http://img.example/img/./../secret.png",
        "http://img.example/img/%2e%2e/secret.png",
        "http://img.example/img/%2E%2E/secret.png",
        "http://img.example/img/.%2e/secret.png",
        "http://img.example/img/%252e%252e/secret.png",
        "http://img.example/img/..%2fsecret.png",
        "http://img.example/img/..%5csecret.png",
        "http://img.example/img2/a.png",  # a prefix ends at a segment boundary
        "http://img.example:8080/img/a.png",  # another port
        "https://img.example/img/a.png",  # another scheme
        "http://img.example.evil.test/img/a.png",
    ],
)
def test_paths_are_matched_after_normalising_and_escapes_that_hide_segments_are_refused(url):
    refused(url, PREFIX)


@pytest.mark.parametrize(
    "path",
    [
        "/img/..;/secret.png",  # Tomcat, Jetty and Spring drop ";params": this is /secret.png to them
        "/img/.;x/../secret.png",
        "/img/..;jsessionid=1/secret.png",
        "/img/%2e%2e;x/secret.png",
        "/img/..%3Bx/secret.png",  # ';' encoded: decoded, it is the same segment
        "/img/a/..;",
    ],
)
def test_dot_segments_with_path_parameters_are_refused(path):
    message = refused("http://img.example" + path, PREFIX)
    assert message.startswith("url path"), message


def test_path_parameters_on_other_segments_pass():
    assert check_url("http://img.example/img/a;v=1/b.png", PREFIX).target == "/img/a;v=1/b.png"
    assert check_url("http://img.example/img/...;x/b.png", PREFIX).target == "/img/...;x/b.png"


def test_normalised_urls_under_a_prefix_pass_and_are_what_is_requested():
    assert check_url("http://IMG.example/img/a/../b.png?x=1#f", PREFIX).url == "http://img.example/img/b.png?x=1"
    assert check_url("http://img.example/img/caf%C3%A9%20x.png", PREFIX).target == "/img/caf%C3%A9%20x.png"
    assert check_url("http://img.example:80/img/", PREFIX).url == "http://img.example/img/"
    with pytest.raises(ValueError, match="^url: this server fetches no URLs"):
        parse_url("http://8.8.8.8/x.png", UrlPolicy())  # no prefixes: nothing, as before


def test_jobspec_allowed_url_normalises_and_refuses_the_traversal_the_string_prefix_let_through():
    prefixes = ("http://img.example/img/",)
    assert allowed_url("http://img.example/img/x/../a.png", prefixes) == "http://img.example/img/a.png"
    for bad in ("http://img.example/img/../secret.png", "http://img.example/img/%2e%2e/secret.png"):
        assert bad.startswith(prefixes[0])  # the old str.startswith check passed these
        with pytest.raises(ValueError, match="^url"):
            allowed_url(bad, prefixes)
    with pytest.raises(ValueError, match="^url.*CR, LF"):
        allowed_url("http://img.example/img/a.png\r\nHost: x", prefixes)


# ---- the fetch ---------------------------------------------------------------------------------------


def test_a_loopback_fetch_succeeds_only_when_the_policy_allows_loopback(a):
    with pytest.raises(ValueError, match="loopback"):
        fetch(a.url + "/img/a.png", ANY)
    assert fetch(a.url + "/img/a.png", UrlPolicy(any_host=True, allow_private=True)) == PNG
    assert fetch(a.url + "/img/a.png", only("127.0.0.1/32")) == PNG


def test_the_checked_address_is_dialled_and_the_name_goes_in_host(a):
    # "img.test" exists only in the injected resolver: the fetch can only have reached the
    # server by dialling the address the guard checked.
    policy = only("127.0.0.1/32", resolver=names({"img.test": ["127.0.0.1"]}))
    n = len(a.hits)
    assert fetch(f"http://img.test:{a.port}/img/../img/b.png", policy) == PNG
    assert a.hits[n:] == [("/img/b.png", f"img.test:{a.port}")]  # normalised path, the name in Host


def test_the_fetch_sends_the_normalised_path_the_prefix_was_matched_against(a):
    # nginx (merge_slashes) would serve a raw GET /cams//../admin as /admin.
    policy = UrlPolicy(prefixes=(a.url + "/cams/",), allowed_networks=("127.0.0.1/32",))
    n = len(a.hits)
    assert fetch(a.url + "/cams//../admin", policy) == PNG
    assert [path for path, _ in a.hits[n:]] == ["/cams/admin"]


def test_traversal_never_reaches_the_server(a):
    policy = UrlPolicy(prefixes=(a.url + "/img/",), allowed_networks=("127.0.0.1/32",))
    assert fetch(a.url + "/img/a.png", policy) == PNG
    n = len(a.hits)
    for bad in ("/img/../secret.png", "/img/%2e%2e/secret.png"):
        with pytest.raises(ValueError, match="^url"):
            fetch(a.url + bad, policy)
    assert a.hits[n:] == []


def test_a_redirect_to_an_address_the_policy_refuses_is_not_followed(a, b):
    policy = only("127.0.0.1/32")  # a's address, not b's (127.0.0.2)
    assert fetch(f"{a.url}/to?/img/c.png", policy) == PNG  # a hop that passes is followed
    for target in (b.url + "/secret.png", "http://169.254.169.254/latest/meta-data/", "file:///etc/passwd"):
        with pytest.raises(ValueError, match="^url: redirected to .* which is refused"):
            fetch(f"{a.url}/to?{target}", policy)
    assert b.hits == []  # the internal server saw nothing
    named = only("127.0.0.1/32", resolver=names({"inner.test": ["10.0.0.7"]}))
    with pytest.raises(ValueError, match="inner.test' resolves to 10.0.0.7, a private address"):
        fetch(f"{a.url}/to?http://inner.test/x", named)


def test_redirects_are_counted(a):
    policy = only("127.0.0.1/32", max_redirects=2)
    two = f"{a.url}/to?{a.url}/to?{a.url}/img/d.png"
    assert fetch(two, policy) == PNG
    with pytest.raises(ValueError, match="^url: more than 2 redirects"):
        fetch(f"{a.url}/to?{two}", policy)


def test_upstream_errors_are_value_errors_naming_url(a):
    policy = only("127.0.0.1/32")
    with pytest.raises(ValueError, match="^url: the server answered 404 Not Found$"):
        fetch(a.url + "/status/404", policy)
    with pytest.raises(ValueError, match="^url: the server answered 500"):
        fetch(a.url + "/status/500", policy)
    dead = Server("127.0.0.1")
    dead.close()
    with pytest.raises(ValueError, match="^url: fetching from '127.0.0.1' failed: ConnectionRefusedError"):
        fetch(dead.url + "/x.png", policy)


def test_the_size_limit_stops_the_read(a):
    with pytest.raises(ValueError, match=r"^url: the answer is larger than 50 bytes \(Content-Length"):
        fetch(a.url + "/img/a.png", only("127.0.0.1/32", max_bytes=50))
    with pytest.raises(ValueError, match="^url: the answer is larger than 100000 bytes$"):
        fetch(a.url + "/big", only("127.0.0.1/32", max_bytes=100_000))  # no Content-Length: streamed
    assert len(fetch(a.url + "/big", only("127.0.0.1/32"))) == 1 << 20


def test_one_deadline_covers_a_server_that_drips(a):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^url: no complete answer within 0.5 s \(timed out\)"):
        fetch(a.url + "/drip", only("127.0.0.1/32", timeout_s=0.5))
    # Each byte comes well within a socket timeout; only the total deadline ends it.
    assert time.monotonic() - start < 2.0


# ---- https: the address pinned, the certificate checked against the name ----------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=img.test"]
        + ["-addext", "subjectAltName=DNS:img.test", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
        check=True,
        capture_output=True,
    )
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    s = Server("127.0.0.1", tls=server_ctx)
    yield s, ssl.create_default_context(cafile=str(d / "cert.pem"))
    s.close()


def test_https_dials_the_checked_address_and_verifies_the_name(tls):
    server, client_ctx = tls
    table = names({"img.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    policy = only("127.0.0.1/32", resolver=table, ssl_context=client_ctx)
    assert fetch(f"https://img.test:{server.port}/img/a.png", policy) == PNG  # SNI and certificate: img.test
    with pytest.raises(ValueError, match="^url: TLS with 'other.test' failed"):
        fetch(f"https://other.test:{server.port}/img/a.png", policy)  # same address, a name the cert lacks


# ---- the environment ---------------------------------------------------------------------------------


def test_the_policy_reads_the_environment_and_names_a_bad_variable():
    env = {
        "TANDEM_ALLOWED_URL_PREFIXES": "http://img.example/img/, https://cdn.example/",
        "TANDEM_ALLOW_PRIVATE_URLS": "1",
        "TANDEM_ALLOWED_URL_NETWORKS": "169.254.169.254/32",
        "TANDEM_URL_MAX_BYTES": "1000",
        "TANDEM_URL_TIMEOUT_S": "2.5",
        "TANDEM_URL_MAX_REDIRECTS": "1",
    }
    p = UrlPolicy.from_env(env)
    assert p.prefixes == ("http://img.example/img/", "https://cdn.example/") and p.allow_private
    assert (p.max_bytes, p.timeout_s, p.max_redirects) == (1000, 2.5, 1)
    assert not UrlPolicy.from_env({}).allow_private and UrlPolicy.from_env({}).prefixes == ()
    for key, value in (
        ("TANDEM_ALLOW_PRIVATE_URLS", "maybe"),
        ("TANDEM_ALLOWED_URL_NETWORKS", "10.0.0.0/33"),
        ("TANDEM_URL_MAX_BYTES", "lots"),
    ):
        with pytest.raises(ValueError, match=f"^{key}"):
            UrlPolicy.from_env({key: value})
    with pytest.raises(ValueError, match="^prefixes"):
        UrlPolicy(prefixes=("http://img.example/%2e%2e/",))
    with pytest.raises(ValueError, match="^max_bytes"):
        UrlPolicy(max_bytes=0)
