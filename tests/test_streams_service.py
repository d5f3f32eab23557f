"""`tandem streams`: cameras as a service on a real Runtime, real redis-server and loopback MJPEG
cameras (two live, one refusing connections, one that connects and never sends a frame).

Every wait is on a condition (records in Redis, a camera's counters, a reply, a process exit)
with a timeout as the safety limit; none waits for time to pass except the rate-cap test,
whose subject is time.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_jobs_support import REPO, RedisServer, wait_for

from server.metrics import render
from server.streams_app import create_app
from sources.loopback import MjpegServer, dead_url, synthetic_frames
from sources.stream_reader import StreamConfig
from tandem.streams_cli import main
from workers import fleet_metrics
from workers.cameras import (
    CONTROL_KEY,
    STREAM_KEY,
    CameraError,
    CameraService,
    CameraServiceConfig,
    camera_policy,
)
from workers.store import connect

SAFETY_S = 30
LOOPBACK = ("127.0.0.1/32",)
NODE_ENTRIES = 8  # stream-node-max-entries of the test Redis: how far `MAXLEN ~` may overshoot
BATCHING = {"max_batch_size": 4, "max_queue_delay_ms": 5.0}
VISION = {"model": "yolo26n.yaml", "imgsz": 160, "conf": 0.0, "max_det": 3, "profile": False, "batching": BATCHING}
# Fast failure detection and retries, so a dead camera is retried several times within a test.
FAST = StreamConfig(open_timeout_s=0.5, read_timeout_s=0.5, stall_after_s=0.5, backoff_initial_s=0.1, backoff_max_s=0.4)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    with connect(server.url) as r:
        r.config_set("stream-node-max-entries", NODE_ENTRIES)
    yield server
    server.stop()


@pytest.fixture
def r(redis_server):
    client = connect(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="module")
def runtime():
    from runtime.runtime import Runtime

    with Runtime(vision=VISION, profile=False) as rt:
        yield rt


@pytest.fixture(scope="module")
def cams():
    """Two live cameras at 30 fps, a stalled one, and a URL nothing listens on."""
    a, b = MjpegServer(synthetic_frames(15, seed=1), fps=30), MjpegServer(synthetic_frames(15, seed=2), fps=30)
    stalled = MjpegServer(stall=True)
    yield {"a": a.url, "b": b.url, "stalled": stalled.url, "dead": dead_url()}
    for s in (a, b, stalled):
        s.close()


@pytest.fixture
def make_service(runtime):
    services = []

    def make(redis_client, **kw) -> CameraService:
        # The loopback cameras are private addresses, which the URL guard refuses unless allowed.
        policy = camera_policy(kw.pop("allowed_url_prefixes", ()), allowed_networks=kw.pop("networks", LOOPBACK))
        kw = {"stream_config": FAST, "publish_interval_s": 0.2, "url_policy": policy, **kw}
        services.append(CameraService(runtime, redis_client, **kw))
        return services[-1]

    yield make
    for s in services:
        s.close()
        assert not any(t.is_alive() for t in s._threads[:2]), "dispatcher and publisher end with close()"


def _records(r, camera: str) -> list[dict]:
    return [json.loads(fields["data"]) for _, fields in r.xrange(STREAM_KEY + camera)]


def _row(service: CameraService, camera: str) -> dict:
    return next(c for c in service.cameras() if c["camera"] == camera)


def _scrape(text: str) -> dict[tuple[str, str], tuple[float, dict]]:
    """(sample name, camera) -> (value, labels) of the camera samples of a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "camera" in s.labels:
                out[(s.name, s.labels["camera"])] = (s.value, s.labels)
    return out


def test_live_cameras_deliver_to_redis_while_dead_and_stalled_ones_are_retried(r, make_service, cams):
    from fastapi.testclient import TestClient

    service = make_service(r, instance="svc-main")
    for name in ("a", "b", "dead", "stalled"):
        service.add(name, cams[name])
    client = TestClient(create_app(service))

    wait_for(lambda: min(r.xlen(STREAM_KEY + "a"), r.xlen(STREAM_KEY + "b")) >= 5, SAFETY_S, "records of both")
    first = _records(r, "a")[0]
    assert first["camera"] == "a" and first["source"] == cams["a"] and first["error"] is None
    assert isinstance(first["frame"], int) and first["seq"] == 1
    assert len(first["boxes"]) == len(first["conf"]) == len(first["cls"]) == len(first["names"]) == 3  # max_det
    assert first["captured_at"] <= first["finished_at"] and first["latency_ms"] >= 0 and first["batch_size"] >= 1
    seqs = [rec["seq"] for rec in _records(r, "b")]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    # The dead and the stalled camera are retried with backoff, each reported down once.
    def retried() -> bool:
        return _row(service, "dead")["reconnects"] >= 3 and _row(service, "stalled")["reconnects"] >= 2

    wait_for(retried, SAFETY_S, "the dead and stalled cameras to be retried")
    (down,) = _records(r, "dead")
    assert down["frame"] is None and "refused" in down["error"].lower() and down["boxes"] == []
    (stall,) = _records(r, "stalled")
    assert "timed out" in stall["error"].lower()

    page = client.get("/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    samples = _scrape(page.text)
    for name in ("dead", "stalled"):
        value, labels = samples[("tandem:camera_up", name)]
        assert value == 0 and labels["state"] in ("connecting", "retrying") and labels["tandem_instance"] == "svc-main"
        assert samples[("tandem:camera_reconnects_total", name)][0] >= 2
        assert samples[("tandem:camera_frames_total", name)][0] == 0
    for name in ("a", "b"):
        value, labels = samples[("tandem:camera_up", name)]
        assert value == 1 and labels["state"] == "live"
        assert samples[("tandem:camera_frames_total", name)][0] >= 5
        assert samples[("tandem:camera_detections_total", name)][0] >= 15
        assert samples[("tandem:camera_fps", name)][0] > 0

    # The others never wait for them: both live cameras keep delivering while the dead retry.
    done = {name: _row(service, name)["frames"] for name in ("a", "b")}
    retries = _row(service, "dead")["reconnects"]

    def more() -> bool:
        frames = all(_row(service, n)["frames"] >= done[n] + 10 for n in done)
        return frames and _row(service, "dead")["reconnects"] > retries

    wait_for(more, SAFETY_S, "more frames of both while the dead camera retries")
    assert len(_records(r, "dead")) == 1  # down is reported once per outage, not at every retry
    # Waited for, not read once: these loopback cameras share the test's process, and on a busy
    # machine one can go silent past its 0.5 s read timeout and reconnect for a moment (seen
    # under `make test-busy`: cameras_up 1, camera b "timed out").
    want = {"status": "ok", "failure": None, "instance": "svc-main", "cameras": 4, "cameras_up": 2}
    wait_for(lambda: client.get("/health").json() == want, SAFETY_S, f"/health to say {want}")

    # `tandem serve` (another process) sees the same cameras through the payload in Redis.
    def published():
        mine = [p for p in fleet_metrics.gather(r) if p["instance"] == "svc-main"]
        up = mine and {c["camera"]: c["up"] for c in mine[0]["cameras"]}
        return up == {"a": 1, "b": 1, "dead": 0, "stalled": 0} and mine[0]

    payload = wait_for(published, SAFETY_S, "the service's payload in Redis")
    assert payload["kind"] == "cameras" and payload["metrics"]["counters"]["vision_images"] > 0
    assert b'tandem:camera_up{camera="dead"' in render([payload])
    service.close()
    assert not [p for p in fleet_metrics.gather(r) if p["instance"] == "svc-main"], "close() withdraws the payload"


def test_maxlen_bounds_each_camera_stream(r, make_service, cams):
    service = make_service(r, maxlen=12)
    service.add("a", cams["a"])
    wait_for(lambda: service.publisher.counts["records"] >= 60, SAFETY_S, "60 records published")
    length = r.xlen(STREAM_KEY + "a")
    assert 12 <= length < 12 + NODE_ENTRIES  # approximate trimming drops whole nodes only
    assert _records(r, "a")[-1]["seq"] >= 60  # the newest are the ones kept


def test_without_redis_the_records_go_to_json_lines(make_service, cams):
    import io

    out = io.StringIO()
    service = make_service(None, jsonl=out)
    service.add("a", cams["a"])
    wait_for(lambda: out.getvalue().count("\n") >= 3, SAFETY_S, "three JSON lines")
    records = [json.loads(line) for line in out.getvalue().splitlines()[:3]]
    assert [(rec["camera"], rec["seq"]) for rec in records] == [("a", 1), ("a", 2), ("a", 3)]
    assert service.failure is None and service.publisher.counts["records"] == 0  # nothing went to Redis


def test_a_camera_rate_cap_holds_and_skipped_frames_count_as_drops(r, make_service, cams):
    service = make_service(r)
    start = time.monotonic()
    service.add("capped", cams["a"], max_fps=4)
    service.add("free", cams["b"])
    # The subject is a rate over time: run until 2.5 s have passed and the uncapped one shows volume.
    wait_for(lambda: time.monotonic() - start >= 2.5 and _row(service, "free")["frames"] >= 40, SAFETY_S, "2.5 s")
    capped, free = _row(service, "capped"), _row(service, "free")
    elapsed = time.monotonic() - start
    assert capped["frames"] <= 4 * elapsed + 1, (capped, elapsed)  # no window holds more than rate x time + 1
    assert capped["frames"] >= 4 and capped["max_fps"] == 4.0 and free["max_fps"] is None
    assert capped["drops"] >= capped["frames_read"] - capped["frames"] - capped["in_flight"] - 1 > 0
    assert free["frames"] > 2 * capped["frames"]


def test_cameras_are_added_and_removed_over_http_while_it_runs(r, make_service, cams):
    from fastapi.testclient import TestClient

    service = make_service(r)
    service.add("first", cams["a"])
    client = TestClient(create_app(service))
    resp = client.post("/cameras", json={"camera": "second", "url": cams["b"], "max_fps": 10})
    assert resp.status_code == 201, resp.text
    assert resp.json()["camera"]["camera"] == "second" and resp.json()["camera"]["max_fps"] == 10.0
    assert [c["camera"] for c in client.get("/cameras").json()["cameras"]] == ["first", "second"]
    wait_for(lambda: r.xlen(STREAM_KEY + "second") >= 3, SAFETY_S, "records of the camera added over HTTP")

    resp = client.delete("/cameras/second")
    assert resp.status_code == 200 and resp.json()["camera"]["camera"] == "second"
    kept = r.xlen(STREAM_KEY + "second")
    assert [c["camera"] for c in client.get("/cameras").json()["cameras"]] == ["first"]
    first = _row(service, "first")["frames"]
    wait_for(lambda: _row(service, "first")["frames"] >= first + 10, SAFETY_S, "more frames of the camera left")
    assert r.xlen(STREAM_KEY + "second") <= kept + service.config.max_in_flight  # only frames already in the detector
    again = client.post("/cameras", json={"camera": "second", "url": cams["b"]})
    assert again.status_code == 201  # the id is free again
    assert client.delete("/cameras/second").status_code == 200


BAD_BODIES = [
    ({"camera": "no spaces", "url": "CAM"}, "camera"),
    ({"camera": "x" * 65, "url": "CAM"}, "camera"),
    ({"camera": 7, "url": "CAM"}, "camera"),
    ({"url": "CAM"}, "camera"),
    ({"camera": "c"}, "url"),
    ({"camera": "c", "url": "/etc/passwd"}, "url"),  # local paths only from the .streams file
    ({"camera": "c", "url": "file:///etc/passwd"}, "url"),
    ({"camera": "c", "url": "0"}, "url"),  # nor webcams
    ({"camera": "c", "url": "http://"}, "url"),
    ({"camera": "c", "url": "rtsp://host:port/x"}, "url"),
    ({"camera": "c", "url": "http://host/a b"}, "url"),
    ({"camera": "c", "url": ["CAM"]}, "url"),
    ({"camera": "c", "url": "CAM", "max_fps": 0}, "max_fps"),
    ({"camera": "c", "url": "CAM", "max_fps": "5"}, "max_fps"),
    ({"camera": "c", "url": "CAM", "max_fps": True}, "max_fps"),
    ({"camera": "c", "url": "CAM", "max_fps": 5000}, "max_fps"),
    ({"camera": "c", "url": "CAM", "colour": "red"}, "colour"),
    ({"camera": "c", "url": "CAM", "op": "remove"}, "op"),
]


def error(resp) -> dict:
    """The error of an HTTP answer, in serve's (OpenAI's) shape."""
    return resp.json()["error"]


def test_bad_input_over_http_is_refused_naming_the_field(r, make_service, cams):
    from fastapi.testclient import TestClient

    service = make_service(r, max_cameras=2, networks=(*LOOPBACK, "10.0.0.0/8"))
    client = TestClient(create_app(service))
    for body, field in BAD_BODIES:
        body = {k: cams["a"] if v == "CAM" else v for k, v in body.items()}
        resp = client.post("/cameras", json=body)
        assert resp.status_code == 400 and error(resp)["param"] == field, (body, resp.text)
        assert field in error(resp)["message"], resp.text
    for raw in (b"not json", b"[1, 2]", b"\xff"):
        resp = client.post("/cameras", content=raw, headers={"Content-Type": "application/json"})
        assert resp.status_code == 400 and error(resp)["param"] == "body", resp.text
    assert client.get("/cameras").json() == {"cameras": []}  # nothing half-added
    resp = client.post("/cameras", json={"camera": "user", "url": "rtsp://admin:hunter2@10.0.0.7:1/x"})
    assert resp.status_code == 201 and "hunter2" not in resp.text and "admin:***@" in resp.text
    assert client.post("/cameras", json={"camera": "c", "url": cams["a"]}).status_code == 201
    dup = client.post("/cameras", json={"camera": "c", "url": cams["b"]})
    assert dup.status_code == 409 and error(dup)["param"] == "camera" and "exists" in error(dup)["message"]
    full = client.post("/cameras", json={"camera": "third", "url": cams["b"]})
    assert full.status_code == 409 and "max_cameras" in error(full)["message"]
    missing = client.delete("/cameras/nope")
    assert missing.status_code == 404 and error(missing)["param"] == "camera" and "nope" in error(missing)["message"]


def test_remote_cameras_must_start_with_an_allowed_prefix_when_prefixes_are_set(r, make_service, cams):
    from fastapi.testclient import TestClient

    allowed = cams["a"].rsplit("/", 1)[0] + "/"
    client = TestClient(create_app(make_service(r, allowed_url_prefixes=(allowed,))))
    refused = client.post("/cameras", json={"camera": "elsewhere", "url": "rtsp://10.0.0.7/live"})
    assert refused.status_code == 400 and error(refused)["param"] == "url" and "allowed prefix" in refused.text
    assert client.post("/cameras", json={"camera": "ok", "url": cams["a"]}).status_code == 201


def test_remote_cameras_pass_the_url_guard_when_added_and_at_every_connect(r, make_service, cams):
    service = make_service(r, networks=())  # the default: public addresses only
    for url, kind in (
        (cams["a"], "loopback"),
        ("rtsp://admin:hunter2@10.0.0.7:1/x", "private"),
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("rtsp://2130706433/x", "non-canonical"),
    ):
        with pytest.raises(CameraError) as exc:
            service.add("c", url)
        assert exc.value.field == "url" and kind in str(exc.value) and "hunter2" not in str(exc.value)
    assert service.cameras() == []
    # A name the guard resolves (only the injected resolver knows it): the reader dials the
    # checked address; when the name later answers with a refused one, the reconnect is refused.
    answers = {"cam.test": ["127.0.0.1"]}
    policy = camera_policy(allowed_networks=LOOPBACK, resolver=lambda host, port: answers[host])
    named = make_service(r, url_policy=policy)
    url = cams["a"].replace("127.0.0.1", "cam.test")
    named.add("named", url)
    wait_for(lambda: _row(named, "named")["frames"] >= 3, SAFETY_S, "frames of a camera dialled at its checked address")
    # A name that answers loopback to add()'s check and a private address after (rebinding):
    # the reader's own check at connect refuses it, and the camera shows down, naming why.
    calls = []

    def rebinding_resolver(host: str, port: int) -> list[str]:
        calls.append(host)
        return ["127.0.0.1"] if len(calls) == 1 else ["10.0.0.9"]

    rebinding = camera_policy(allowed_networks=LOOPBACK, resolver=rebinding_resolver)
    moved = make_service(r, url_policy=rebinding)
    moved.add("moved", url)
    wait_for(lambda: "10.0.0.9, a private address" in (_row(moved, "moved")["last_error"] or ""), SAFETY_S, "refusal")
    assert _row(moved, "moved")["frames"] == 0 and _row(moved, "moved")["up"] == 0


def test_a_remote_http_camera_is_requested_at_the_path_the_guard_checked(r, make_service):
    # nginx (merge_slashes) serves GET /cams//../admin as /admin, while the guard normalises
    # it to /cams/admin, under the prefix: so the reader must send the normalised path.
    paths: list[str] = []
    requested = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            paths.append(self.path)
            requested.set()
            self.send_response(404)
            self.end_headers()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        service = make_service(r, allowed_url_prefixes=(base + "/cams/",))
        service.add("nested", base + "/cams//../admin")
        assert requested.wait(SAFETY_S), "the camera's reader never connected"
        assert paths[0] == "/cams/admin"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_cameras_are_added_and_removed_through_the_redis_control_list(r, make_service, cams):
    service = make_service(r, instance="svc-ctl")
    key = CONTROL_KEY + "svc-ctl"

    def command(cmd: dict) -> dict:
        r.rpush(key, json.dumps(cmd))
        reply = r.blpop([f"{key}:reply:{cmd['id']}"], timeout=SAFETY_S)
        assert reply is not None, f"no reply to {cmd}"
        return json.loads(reply[1])

    added = command({"op": "add", "camera": "remote", "url": cams["a"], "max_fps": 20, "id": "c1"})
    assert added["ok"] and added["camera"]["camera"] == "remote" and added["camera"]["max_fps"] == 20.0
    wait_for(lambda: r.xlen(STREAM_KEY + "remote") >= 3, SAFETY_S, "records of the camera added through Redis")
    assert command({"op": "remove", "camera": "remote", "id": "c2"})["ok"]
    assert service.cameras() == []
    refused = command({"op": "add", "camera": "local", "url": "/etc/passwd", "id": "c3"})
    assert not refused["ok"] and refused["field"] == "url"
    assert command({"op": "explode", "id": "c4"})["field"] == "op"
    assert command({"op": "remove", "camera": "remote", "id": "c5"})["field"] == "camera"  # gone already
    r.rpush(key, "not json")  # no id: nobody to answer, and the service goes on
    assert command({"op": "add", "camera": "again", "url": cams["b"], "id": "c6"})["ok"]


def test_a_runtime_that_refuses_frames_fails_the_health_check(r, cams):
    from fastapi.testclient import TestClient

    from runtime.runtime import Runtime

    rt = Runtime(vision={**VISION, "imgsz": 64, "jit": False}, profile=False)
    policy = camera_policy(allowed_networks=LOOPBACK)
    service = CameraService(rt, r, stream_config=FAST, publish_interval_s=0.2, url_policy=policy)
    try:
        service.add("a", cams["a"])
        wait_for(lambda: _row(service, "a")["frames"] >= 1, SAFETY_S, "a first frame")
        client = TestClient(create_app(service))
        assert client.get("/health").status_code == 200
        rt.close()
        wait_for(lambda: service.failure, SAFETY_S, "the service to see the Runtime refuse frames")
        resp = client.get("/health")
        assert resp.status_code == 503 and resp.json()["status"] == "failing" and "closed" in resp.json()["failure"]
        assert _row(service, "a")["drops"] >= 1  # the refused frame counts as dropped
    finally:
        service.close()
        rt.close()


def _ready_url(proc: subprocess.Popen, lines: list[str], log) -> str | None:
    """The control URL of the ready line, once printed; fails with the log if the process ends."""
    for line in lines:
        if m := re.search(r"http://[0-9.]+:[0-9]+", line):
            return m.group(0)
    if proc.poll() is not None:
        pytest.fail(f"tandem streams exited {proc.returncode}: {log.read_text()}")
    return None


def test_cli_serves_a_streams_file_for_its_duration(r, redis_server, cams, tmp_path):
    import httpx

    streams = tmp_path / "cams.streams"
    streams.write_text(f"# two live, one dead\n{cams['a']}\n{cams['b']}\n{cams['dead']}\n")
    out = tmp_path / "records.jsonl"
    args = f"{streams} --redis-url {redis_server.url} --port 0 --duration 5 --imgsz 160 --conf 0 --no-profile "
    args += f"--max-fps 10 --jsonl {out} --instance cli-test --no-auth"
    command = [sys.executable, "-m", "tandem.streams_cli", *args.split()]
    log = tmp_path / "streams.log"  # a file, not a pipe nobody reads while waiting: no deadlock on a full pipe
    with open(log, "w") as err:
        proc = subprocess.Popen(command, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=err)
    try:
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
        url = wait_for(lambda: _ready_url(proc, lines, log), 120, "the ready line")
        assert httpx.get(f"{url}/health").json()["cameras"] == 3

        def up() -> dict:
            samples = _scrape(httpx.get(f"{url}/metrics").text)
            return {cam: samples[("tandem:camera_up", cam)][0] for cam in ("cam0", "cam1", "cam2")}

        wait_for(lambda: up() == {"cam0": 1, "cam1": 1, "cam2": 0}, SAFETY_S, "/metrics: two cameras up, one down")
        assert proc.wait(SAFETY_S) == 0, log.read_text()  # --duration ends it
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    for cam in ("cam0", "cam1"):
        records = _records(r, cam)
        assert len(records) >= 3 and all(rec["error"] is None for rec in records)
        assert [rec for rec in lines if rec["camera"] == cam] == records  # the same records as JSON lines
        # --max-fps 10: each frame went to the detector between its capture and its result.
        assert len(records) <= 10 * (records[-1]["finished_at"] - records[0]["captured_at"]) + 1
    assert _records(r, "cam2")[0]["error"]
    assert not [p for p in fleet_metrics.gather(r) if p["instance"] == "cli-test"], "the payload is withdrawn at exit"


def test_cli_stops_cleanly_on_sigint(redis_server, r, cams, capsys):
    """In this process, on the main thread as from a shell: the signal arrives once records
    show the service is up (its handler is in place by then) and it exits 0, closed."""
    import os

    def interrupt_when_serving():
        wait_for(lambda: r.xlen(STREAM_KEY + "cam0") >= 3, SAFETY_S, "records before the interrupt")
        os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    threading.Thread(target=interrupt_when_serving, daemon=True).start()
    args = f"{cams['a']} --redis-url {redis_server.url} --port 0 --imgsz 160 --no-profile --jsonl - --instance sigint"
    args += " --no-auth"
    code = main(args.split())
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]  # with --jsonl -, stdout holds only records
    assert len(lines) >= 3 and {rec["camera"] for rec in lines} == {"cam0"}
    assert "ready, control http://127.0.0.1:" in err and "stopped;" in err
    assert signal.getsignal(signal.SIGINT) is before  # the handler is given back


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("maxlen", 0),
        ("max_in_flight", True),
        ("max_cameras", 1.5),
        ("max_fps", 0),
        ("batch_timeout_ms", 1001),
        ("publish_interval_s", 0),
        ("instance", "no spaces"),
    ],
)
def test_the_service_config_names_the_field_it_refuses(field, bad):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        CameraServiceConfig(**{field: bad})


def test_the_service_takes_its_settings_once():
    with pytest.raises(ValueError, match="allowed_url_prefixes"):
        CameraServiceConfig(allowed_url_prefixes=("rtsp://cams.example/",), url_policy=camera_policy())
    with pytest.raises(TypeError, match="not both"):  # before anything starts: no Runtime needed
        CameraService(None, None, CameraServiceConfig(), maxlen=3)


BAD_ARGS = [
    (["--maxlen", "0"], "--maxlen"),
    (["--max-fps", "0"], "--max-fps"),
    (["--batch-timeout-ms", "-1"], "--batch-timeout-ms"),
    (["--classes", "a"], "--classes"),
    (["--backend", "tensorflow"], "--backend"),
    (["--port", "70000"], "--port"),
    (["--duration", "-1"], "--duration"),
    (["--imgsz", "100"], "imgsz"),
    (["--no-redis"], "--jsonl"),
    (["--instance", "no spaces"], "--instance"),
    (["--vision-model", ""], "model"),
]


@pytest.mark.parametrize(("args", "names"), BAD_ARGS)
def test_cli_refuses_bad_arguments_with_exit_code_2(cams, capsys, args, names):
    assert main([cams["a"], "--redis-url", "redis://127.0.0.1:1/0", *args]) == 2
    assert names in capsys.readouterr().err


def test_cli_refuses_a_bad_source_or_unreachable_redis(tmp_path, capsys):
    bad = tmp_path / "bad.streams"
    bad.write_text("rtsp://ok/stream\nnot a camera\n")
    assert main([str(bad)]) == 2 and "line 2" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.streams")]) == 2 and "not found" in capsys.readouterr().err
    assert main(["ftp://host/x"]) == 2 and "source must be" in capsys.readouterr().err
    from test_jobs_support import free_port

    assert main(["rtsp://host/x", "--no-auth", "--redis-url", f"redis://127.0.0.1:{free_port()}/0"]) == 1
    assert "cannot reach Redis" in capsys.readouterr().err
