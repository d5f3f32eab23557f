"""`tandem streams`' control is safe to expose: an API key on the control and the views, JSON
only as application/json, the Host header checked (no DNS rebinding), camera URLs refused by
default for file:// and loopback/private addresses, and a camera's error text that says what
kind of failure it was, never what an internal target answered (no port scanner).

The service here has a stub Runtime: no camera in these tests delivers a frame to detect, so
nothing loads a model; the URL guard and the readers are the real ones.
"""

from __future__ import annotations

import socket
import threading

import pytest
from fastapi.testclient import TestClient
from test_jobs_support import wait_for

from server.streams_app import create_app
from sources.loopback import dead_url
from sources.stream_reader import StreamConfig
from tandem.streams_cli import main
from workers.cameras import CameraService, camera_policy
from workers.cameras_security import KEY_COOKIE, Security

SAFETY_S = 30
FAST = StreamConfig(open_timeout_s=0.5, read_timeout_s=0.5, stall_after_s=0.5, backoff_initial_s=0.1, backoff_max_s=0.4)
CAMERA = {"camera": "door", "url": "rtsp://203.0.113.7/live"}  # TEST-NET-3: documentation only, nothing answers
TEST_NET = ("203.0.113.0/24",)  # Python counts it private: allowed for CAMERA, as an operator would a LAN


class StubRuntime:
    vision = None

    def metrics_snapshot(self) -> dict:
        return {}


@pytest.fixture
def service(tmp_path):
    services = []

    def make(policy=None) -> CameraService:
        jsonl = open(tmp_path / f"records{len(services)}.jsonl", "a")
        kw = {"stream_config": FAST, "publish_interval_s": 0.2, "jsonl": jsonl}
        services.append(
            (
                CameraService(StubRuntime(), None, url_policy=policy or camera_policy(allowed_networks=TEST_NET), **kw),
                jsonl,
            )
        )
        return services[-1][0]

    yield make
    for s, jsonl in services:
        s.close()
        jsonl.close()


def _client(service, keys=(), host="127.0.0.1", allowed=(), base_url="http://127.0.0.1") -> TestClient:
    return TestClient(create_app(service, Security(keys, host, allowed)), base_url=base_url)


def _param(resp) -> str | None:
    return resp.json()["error"]["param"]


def test_the_api_key_is_required_on_the_control_and_the_views(service):
    svc = service()
    client = _client(svc, keys=("k1", "k2"))
    for method, path in (("GET", "/cameras"), ("GET", "/"), ("GET", "/metrics"), ("DELETE", "/cameras/x")):
        resp = client.request(method, path)
        assert resp.status_code == 401, (method, path, resp.text)
        err = resp.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == 401 and "Bearer" in err["message"]
    assert client.post("/cameras", json=CAMERA).status_code == 401
    assert svc.cameras() == []  # refused before it touched the service
    wrong = client.get("/cameras", headers={"Authorization": "Bearer k3"})
    assert wrong.status_code == 401
    assert client.get("/health").status_code == 200  # probes need no key, as serve's
    # Either key, as a Bearer header.
    for key in ("k1", "k2"):
        assert client.get("/cameras", headers={"Authorization": f"Bearer {key}"}).json() == {"cameras": []}
    added = client.post("/cameras", json=CAMERA, headers={"Authorization": "Bearer k2"})
    assert added.status_code == 201, added.text
    view = client.get("/cameras/nope/view", headers={"Authorization": "Bearer k1"})
    assert view.status_code == 404 and _param(view) == "camera"
    assert client.get("/cameras/door/view").status_code == 401
    # The page's login: ?key= sets an HttpOnly SameSite=Strict cookie, which then opens the views.
    assert client.get("/?key=nope", follow_redirects=False).status_code == 401
    login = client.get("/?key=k1", follow_redirects=False)
    assert login.status_code == 303
    cookie = login.headers["set-cookie"].lower()
    assert f"{KEY_COOKIE}=k1" in cookie and "httponly" in cookie and "samesite=strict" in cookie
    page = client.get("/")  # the client keeps the cookie
    assert page.status_code == 200 and "cameras/" in page.text


def test_a_post_that_is_not_application_json_is_refused(service):
    svc = service()
    client = _client(svc)
    import json

    body = json.dumps(CAMERA)
    # What a web page may send cross-origin without a preflight: text/plain, a form, no type.
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {} if ctype is None else {"Content-Type": ctype}
        resp = client.post("/cameras", content=body, headers=headers)
        assert resp.status_code == 415, (ctype, resp.text)
        assert resp.json()["error"]["param"] == "content-type" and resp.json()["error"]["code"] == 415
    assert svc.cameras() == []
    ok = client.post("/cameras", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 201, ok.text


def test_a_host_header_the_service_does_not_answer_to_is_refused(service):
    svc = service()
    client = _client(svc, allowed=("cams.example.org",))
    # DNS rebinding: an attacker's name that now resolves to 127.0.0.1 still says its own name.
    for host in ("evil.example", "evil.example:8100", "127.0.0.1.evil.example", "localhost.", ""):
        resp = client.get("/cameras", headers={"Host": host})
        assert resp.status_code == 421, (host, resp.text)
        assert resp.json()["error"]["param"] == "host"
    assert client.post("/cameras", json=CAMERA, headers={"Host": "evil.example"}).status_code == 421
    assert svc.cameras() == []
    for host in ("127.0.0.1:8100", "localhost:8100", "[::1]:8100", "localhost", "cams.example.org:443"):
        assert client.get("/cameras", headers={"Host": host}).status_code == 200, host
    # Bound elsewhere: the loopback names are not this service's.
    public = _client(svc, keys=("k",), host="192.0.2.10")
    auth = {"Authorization": "Bearer k"}
    assert public.get("/cameras", headers={**auth, "Host": "localhost:8100"}).status_code == 421
    assert public.get("/cameras", headers={**auth, "Host": "192.0.2.10:8100"}).status_code == 200


def test_file_and_loopback_camera_urls_are_refused_by_default(service):
    svc = service(camera_policy())  # no overrides: what `tandem streams` starts with
    client = _client(svc)
    for url, words in (
        ("file:///etc/passwd", "stream URL"),
        ("file://localhost/etc/passwd", "stream URL"),
        ("/etc/passwd", "stream URL"),
        ("0", "stream URL"),  # a webcam index
        ("rtsp://127.0.0.1:6379/FLUSHALL", "loopback"),
        ("http://localhost:6379/", "loopback"),
        ("tcp://[::1]:6379", "loopback"),
        ("rtsp://10.0.0.7/live", "private"),
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
    ):
        resp = client.post("/cameras", json={"camera": "x", "url": url})
        assert resp.status_code == 400 and _param(resp) == "url", (url, resp.text)
        assert words in resp.json()["error"]["message"], (url, resp.text)
    assert svc.cameras() == []


def test_a_camera_error_never_reports_what_an_internal_target_answered(service, tmp_path):
    """The operator allowed loopback; a camera pointed at a port that speaks something else
    (Redis, SSH, an admin page) reports only the kind of failure."""
    banner = b"-ERR secret-banner-7f3a unknown command\r\nHTTP/1.1 200 OK\r\nContent-Type: text/x-secret-7f3a\r\n\r\n"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    stop = threading.Event()

    def answer():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(banner)

    threading.Thread(target=answer, daemon=True).start()
    try:
        svc = service(camera_policy(allowed_networks=("127.0.0.1/32",)))
        client = _client(svc)
        port = listener.getsockname()[1]
        for name, url in (("banner", f"http://127.0.0.1:{port}/"), ("refused", dead_url())):
            assert client.post("/cameras", json={"camera": name, "url": url}).status_code == 201

        def errors() -> dict:
            return {c["camera"]: c["last_error"] for c in client.get("/cameras").json()["cameras"]}

        seen = wait_for(lambda: e if all((e := errors()).values()) else None, SAFETY_S, "both cameras down")
        internal = next(c for c in svc.cameras() if c["camera"] == "banner")["last_error"]
        assert "7f3a" in internal  # the service itself knew (and logged) what answered...
        assert "7f3a" not in client.get("/cameras").text  # ...the API does not say it
        assert seen["banner"] == "not a video stream" and seen["refused"] == "connection refused", seen
        svc.close()  # its records are all written
        records = (tmp_path / "records0.jsonl").read_text()
        assert '"camera": "banner"' in records and "7f3a" not in records  # nor do its records
    finally:
        stop.set()
        listener.close()


def test_without_a_key_the_cli_refuses_a_host_other_machines_reach(capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_STREAMS_API_KEY", raising=False)
    base = ["rtsp://203.0.113.7/x", "--no-redis", "--jsonl", "-"]
    assert main([*base, "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err
    assert main([*base, "--host", "0.0.0.0", "--no-auth"]) == 2  # --no-auth is for loopback only
    assert "reachable from other machines" in capsys.readouterr().err
    assert main(base) == 2  # loopback too: no key only when asked for
    err = capsys.readouterr().err
    assert "--api-key" in err and "--no-auth" in err
    assert main([*base, "--no-auth", "--api-key", "k"]) == 2 and "contradict" in capsys.readouterr().err
