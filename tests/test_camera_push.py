"""Camera events pushed to webhooks and MQTT (workers/camera_push.py, issue 32 part 3): a local
receiver checks the signature with the secret, the cooldown (an injected clock, no sleeps),
retries after a 500, and that a receiver that hangs costs the publisher no records (its drops
counted instead); a mosquitto the test starts gets the events and the retained counts.

The publisher runs for real (workers/cameras_publish.py) with a stand-in tracker and analytics
that fire a line crossing on every frame: the analytics themselves are
tests/test_camera_analytics.py's."""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import shutil
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from camera_helpers import FAST, POLICY, SAFETY_S, Lines

from sources import SourceError
from sources.base import Frame
from workers.camera_checks import CameraError, CameraOptions
from workers.camera_push import PushConfig, Pusher, parse_webhooks
from workers.streams_file import parse

SECRET = "s3cret-for-the-test"


class Receiver:
    """A webhook receiver on loopback: it answers each POST with the next of `statuses` (then
    200), or holds it until release() while `hang` is set; the test waits on what arrived."""

    def __init__(self, statuses=(), hang: bool = False) -> None:
        self.cond = threading.Condition()
        self.requests: list[tuple[dict, bytes]] = []
        self.statuses = list(statuses)
        self.released = threading.Event()
        if not hang:
            self.released.set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.cond:
                    receiver.requests.append((dict(self.headers), body))
                    receiver.cond.notify_all()
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                receiver.released.wait(SAFETY_S)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook?token=abc"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def wait(self, n: int) -> list[tuple[dict, bytes]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.requests) >= n, SAFETY_S), f"{len(self.requests)} requests"
            return list(self.requests)

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(**kw) -> Receiver:
        made.append(Receiver(**kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def crossing(line: str = "door", n: int = 1, kind: str = "line_cross") -> dict:
    key = "zone" if kind.startswith("zone") else "line"
    return {"type": kind, key: line, "direction": "in", "track_id": n, "cls": "person", "at": 1.7e9 + n}


def counts(n: int) -> dict:
    return {"lines": {"door": {"in": n, "out": 0}}, "zones": {}}


def pusher(url: str, **kw) -> Pusher:
    config = PushConfig(webhook=(url,), webhook_secret=SECRET, webhook_retry_first_s=0.01, **kw)
    return Pusher(config, "test")


# ---- webhooks ------------------------------------------------------------------------------------


def test_a_webhook_gets_each_event_signed_with_the_secret_over_timestamp_and_body(receiver):
    r = receiver()
    p = pusher(r.url)
    cam = p.camera("door", remote=False)
    cam.on_events([crossing(n=7)], counts(1))
    ((headers, body),) = r.wait(1)
    p.close()
    # The receiver's check, written from the docs: HMAC-SHA256(secret, "<timestamp>.<body>").
    timestamp = headers["X-Tandem-Timestamp"]
    expected = "sha256=" + hmac.new(SECRET.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(headers["X-Tandem-Signature"], expected)
    forged = hmac.new(b"another secret", f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    assert headers["X-Tandem-Signature"] != "sha256=" + forged
    assert headers["X-Tandem-Event"] == "line_cross" and headers["Content-Type"] == "application/json"
    event = json.loads(body)
    assert event == {**crossing(n=7), "camera": "door", "counts": counts(1)}
    (row,) = cam.stats().values()
    assert row == {"sent": 1, "failed": 0, "dropped": 0, "suppressed": 0}
    (sink,) = p.stats()
    assert sink["sink"] == f"webhook http://127.0.0.1:{r.server.server_port}/hook"  # no ?token in names
    assert (sink["sent"], sink["queued"]) == (1, 0)


def test_the_cooldown_holds_back_repeats_per_camera_type_and_line(receiver):
    r = receiver()
    clock = Clock()
    p = pusher(r.url, webhook_cooldown_s=10.0, clock=clock)
    door, gate = p.camera("door", remote=False), p.camera("gate", remote=False)
    door.on_events([crossing("door", 1)], counts(1))  # sent
    clock.t += 5
    door.on_events([crossing("door", 2)], counts(2))  # same camera, type, line within 10 s: held back
    door.on_events([crossing("exit", 3)], counts(2))  # another line: sent
    door.on_events([crossing("bay", 4, "zone_enter")], counts(2))  # another type: sent
    gate.on_events([crossing("door", 5)], counts(1))  # another camera: sent
    clock.t += 5.01
    door.on_events([crossing("door", 6)], counts(3))  # 10.01 s after the last one sent: sent
    r.wait(5)
    p.close()
    sent = [(json.loads(b)["camera"], json.loads(b)["track_id"]) for _, b in r.requests]
    assert sorted(sent) == [("door", 1), ("door", 3), ("door", 4), ("door", 6), ("gate", 5)]
    (stats,) = door.stats().values()
    assert (stats["sent"], stats["suppressed"]) == (4, 1)


def test_a_webhook_is_retried_after_a_500_and_not_after_a_400(receiver):
    r = receiver(statuses=[500, 503, 200, 400])
    p = pusher(r.url)
    cam = p.camera("door", remote=False)
    cam.on_events([crossing(n=1)], counts(1))
    tries = r.wait(3)
    assert [json.loads(b)["track_id"] for _, b in tries] == [1, 1, 1]  # the same event, tried again
    cam.on_events([crossing(n=2)], counts(2))
    r.wait(4)
    p.close()
    assert len(r.requests) == 4  # the 400 is final: not tried again
    (stats,) = cam.stats().values()
    assert (stats["sent"], stats["failed"]) == (1, 1)


def test_a_remote_callers_webhook_passes_the_url_guard_and_a_cameras_own_sink_ends_with_it():
    pytest.importorskip("lap")
    from sources.loopback import dead_url
    from workers.cameras import CameraService
    from workers.urlguard import DETECT_SCHEMES, UrlPolicy

    class Runtime:
        def metrics_snapshot(self):
            return {}

    kw = {"tracker": "bytetrack", "lines": "door:0,0.5,1,0.5", "webhook": "http://127.0.0.1:9/hook"}
    service = CameraService(Runtime(), None, control=False, url_policy=POLICY, stream_config=FAST)
    try:
        with pytest.raises(CameraError, match="webhook: url: host 127.0.0.1, a loopback address") as err:
            service.add("door", "rtsp://127.0.0.1:9/live", **kw)
        assert err.value.field == "webhook" and service.cameras() == []
        service.add("local", dead_url(), allow_local=True, **kw)  # the operator's (.streams): any host
        (row,) = service.cameras()
        assert row["webhooks"] == [{"url": "http://127.0.0.1:9/hook", "events": []}]
        assert list(row["push"]) == ["webhook http://127.0.0.1:9/hook"]
        assert [s["sink"] for s in service.payload()["push"]] == ["webhook http://127.0.0.1:9/hook"]
        service.remove("local")  # its webhook's sink (its thread) goes with the last camera using it
        assert service.payload()["push"] == []
    finally:
        service.close()
    allowed = UrlPolicy(schemes=DETECT_SCHEMES, any_host=True, allowed_networks=("127.0.0.1/32",))
    push = PushConfig(remote_policy=allowed)
    service = CameraService(Runtime(), None, control=False, url_policy=POLICY, stream_config=FAST, push=push)
    try:
        service.add("door", "rtsp://127.0.0.1:9/live", **kw)  # its network allowed: accepted
    finally:
        service.close()


# ---- a receiver that hangs never slows the publisher ---------------------------------------------

NUM_FRAMES = 200
QUEUE = 16


class Scripted:
    """The camera's tracker and analytics: one track, crossing the door on every frame."""

    def __init__(self) -> None:
        self.n = 0
        self.counts = counts(0)

    def update(self, *args):
        if len(args) == 2:  # tracker.update(det, image)
            return [1] * len(args[0].boxes)
        self.n += 1  # analytics.update(boxes, names, track_ids, t, size)
        self.counts = counts(self.n)
        return [crossing(n=self.n)]


class Det:
    boxes = [[10.0, 10.0, 20.0, 20.0]]
    names = ["person"]
    batch_size = 1

    def to_dict(self) -> dict:
        return {"boxes": self.boxes, "conf": [0.9], "cls": [0], "names": self.names}


def publish_frames(p: Pusher) -> tuple[list[dict], object]:
    """NUM_FRAMES results through the camera service's publisher thread, every one with an event
    pushed to `p`: (the records it wrote, the camera's push part)."""
    from workers.cameras_publish import Publisher
    from workers.cameras_state import Camera, Result

    options = CameraOptions(tracker="bytetrack", lines="door:0,0.5,1,0.5")
    cam = Camera("door", "door", "door", 0.0, None, 0.0, options)
    cam.tracker = cam.analytics = Scripted()
    cam.push = p.camera("door", remote=False)
    lines = Lines()
    publisher = Publisher(None, lines, 100, "test", 2.0, dict)
    thread = threading.Thread(target=publisher.run, daemon=True)
    thread.start()
    image = np.zeros((32, 32, 3), np.uint8)
    for i in range(NUM_FRAMES):
        publisher.queue(Result(cam, Frame("door", i, image), i + 1, Det(), None, 1.7e9 + i, 1.7e9 + i + 0.01))
    records = lines.wait(lambda rs: len(rs) >= NUM_FRAMES)  # while the receiver may still hang
    publisher.close()
    thread.join(SAFETY_S)
    return records, cam.push


def test_a_receiver_that_hangs_costs_no_records_its_events_are_dropped_and_counted(receiver):
    fast = receiver()
    p = pusher(fast.url, push_queue=NUM_FRAMES)  # room for the publisher's burst: every event sent
    records, push = publish_frames(p)
    fast.wait(NUM_FRAMES)
    p.close()
    assert len(records) == NUM_FRAMES and all(len(r["events"]) == 1 for r in records)
    (fast_stats,) = push.stats().values()
    assert fast_stats == {"sent": NUM_FRAMES, "failed": 0, "dropped": 0, "suppressed": 0}

    hung = receiver(hang=True)
    p = pusher(hung.url, push_queue=QUEUE, webhook_timeout_s=SAFETY_S)
    records, push = publish_frames(p)  # returns with every record while the receiver holds its first POST
    (stats,) = push.stats().values()
    assert len(records) == NUM_FRAMES and all(len(r["events"]) == 1 for r in records)
    assert stats["sent"] == 0
    # One POST held by the receiver, QUEUE waiting behind it, the rest dropped (the oldest first).
    assert NUM_FRAMES - QUEUE - 1 <= stats["dropped"] <= NUM_FRAMES - QUEUE, stats
    hung.released.set()
    p.close(timeout=SAFETY_S)
    (stats,) = push.stats().values()
    assert stats["sent"] + stats["failed"] + stats["dropped"] == NUM_FRAMES, stats  # every event accounted for


# ---- MQTT ----------------------------------------------------------------------------------------


def mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto",) if os.access(p, os.X_OK)), None)


@pytest.fixture
def broker(tmp_path):
    """A mosquitto on a free loopback port, ready when it says it is running."""
    binary = mosquitto_binary()
    if binary is None:
        pytest.skip("Debian's mosquitto is not installed (make test installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nlog_dest stderr\n")
    proc = subprocess.Popen([binary, "-c", str(conf)], stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stderr:  # ends if it exits
            seen.append(line)
            if " running" in line:
                break
        else:
            pytest.fail(f"mosquitto did not start: {''.join(seen)}")
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
        yield port
    finally:
        proc.terminate()
        proc.wait(SAFETY_S)


class Subscriber:
    """A paho client subscribed to `topic`; the test waits on the messages."""

    def __init__(self, port: int, topic: str) -> None:
        import paho.mqtt.client as mqtt

        self.cond = threading.Condition()
        self.messages: list = []
        self.subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        self.client.on_connect = lambda c, *a: c.subscribe(topic, qos=1)
        self.client.on_subscribe = lambda *a: self.subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert self.subscribed.wait(SAFETY_S)

    def _on_message(self, client, userdata, msg) -> None:
        with self.cond:
            self.messages.append((msg.topic, json.loads(msg.payload), msg.retain))
            self.cond.notify_all()

    def wait(self, predicate) -> list:
        with self.cond:
            assert self.cond.wait_for(lambda: predicate(self.messages), SAFETY_S), self.messages
            return list(self.messages)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_mqtt_gets_each_event_and_the_counts_retained_at_most_once_an_interval(broker):
    sub = Subscriber(broker, "tandem/door/#")
    # An interval longer than the test: the first counts go at once, later changes wait and merge,
    # and close() sends the newest.
    p = Pusher(PushConfig(mqtt=f"127.0.0.1:{broker}", mqtt_counts_interval_s=3600.0), "test")
    try:
        cam = p.camera("door", remote=False)
        cam.on_events([crossing(n=1)], counts(1))
        sub.wait(lambda ms: ("tandem/door/counts", counts(1), False) in ms)  # the first counts: at once
        for n in (2, 3):  # within the interval: merged, the newest sent at close
            cam.on_events([crossing(n=n)], counts(n))
        sub.wait(lambda ms: sum(t.endswith("/events") for t, _, _ in ms) == 3)
    finally:
        p.close(timeout=SAFETY_S)
    messages = sub.wait(lambda ms: len(ms) == 5)
    sub.close()
    events = [m for t, m, _ in messages if t == "tandem/door/events"]
    assert [e["track_id"] for e in events] == [1, 2, 3] and events[0]["camera"] == "door"
    assert [m for t, m, _ in messages if t == "tandem/door/counts"] == [counts(1), counts(3)]
    (stats,) = cam.stats().values()
    assert stats == {"sent": 5, "failed": 0, "dropped": 0, "suppressed": 0}
    late = Subscriber(broker, "tandem/door/counts")  # retained: a newcomer gets the newest counts
    try:
        assert late.wait(lambda ms: len(ms) == 1) == [("tandem/door/counts", counts(3), True)]
    finally:
        late.close()


# ---- options -----------------------------------------------------------------------------------


def test_webhook_options_name_the_option(tmp_path):
    (hook,) = parse_webhooks("line_cross,zone_enter=https://h.example/x?a=b")
    assert hook.url == "https://h.example/x?a=b" and hook.events == {"line_cross", "zone_enter"}
    for bad, says in [
        ("crossing=https://h.example/x", "event type 'crossing'"),
        ("ftp://h.example/x", "http://, https://"),
        ("https://user:pw@h.example/x", "user:password@"),
    ]:
        with pytest.raises(CameraError, match=says) as err:
            CameraOptions(tracker="bytetrack", lines="door:0,0.5,1,0.5", webhook=bad).check()
        assert err.value.field == "webhook" and str(err.value).startswith("webhook:")
    with pytest.raises(CameraError, match="add lines= or zones=") as err:
        CameraOptions(webhook="https://h.example/x").check()
    assert err.value.field == "webhook"
    with pytest.raises(CameraError) as err:
        CameraOptions(tracker="bytetrack", lines="door:0,0.5,1,0.5", webhook_cooldown_s=-1).check()
    assert err.value.field == "webhook_cooldown_s"
    f = tmp_path / "cams.streams"
    f.write_text(
        "rtsp://a.example/1 id=door tracker=bytetrack lines=door:0,0.5,1,0.5 "
        "webhook=line_cross=http://ha.local:8123/api/webhook/door webhook_cooldown_s=30\n"
    )
    (line,) = parse(str(f))
    assert [w.to_dict() for w in line.options["webhook"]] == [
        {"url": "http://ha.local:8123/api/webhook/door", "events": ["line_cross"]}
    ]
    assert line.options["webhook_cooldown_s"] == 30.0
    f.write_text("rtsp://a.example/1 tracker=bytetrack lines=door:0,0.5,1,0.5 webhook=door=http://h.example/x\n")
    with pytest.raises(SourceError, match=r"line 1: webhook: event type 'door'"):
        parse(str(f))


def test_the_push_flags_name_the_flag():
    from tandem.streams_cli import add_streams_arguments, service_config

    p = argparse.ArgumentParser()
    add_streams_arguments(p)
    base = ["cams.streams", "--webhook", "https://h.example/hook", "--mqtt", "127.0.0.1:1883"]
    config = service_config(p.parse_args([*base, "--webhook-cooldown-s", "30"])).push
    assert config.webhook[0].url == "https://h.example/hook" and config.webhook_cooldown_s == 30.0
    assert config.mqtt == "127.0.0.1:1883"
    for extra, says in [
        (["--webhook-timeout-s", "0"], "--webhook-timeout-s must be"),
        (["--mqtt", "host:99999"], "--mqtt must be HOST[:PORT]"),
        (["--webhook", "ftp://h.example/x"], "--webhook: url must be"),
        (["--mqtt-topic-prefix", "a b"], "--mqtt-topic-prefix must be"),
    ]:
        with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
            service_config(p.parse_args([*base, *extra]))


def test_metrics_render_each_sinks_outcomes_and_the_brokers_connection():
    """/metrics (server/metrics.py) from a camera service's payload: a camera's events per sink
    and outcome, and per service what waits in each sink's queue and whether MQTT is up."""
    from server.metrics import render

    row = {"camera": "door", "up": 1, "state": "live", "push": {"mqtt h:1883": {"sent": 4, "failed": 0, "dropped": 1}}}
    sinks = [{"sink": "mqtt h:1883", "sent": 4, "failed": 0, "dropped": 1, "queued": 2, "connected": 1}]
    page = render([{"instance": "i", "cameras": [row], "push": sinks}]).decode()
    want = 'tandem:camera_push_events_total{camera="door",outcome="dropped",sink="mqtt h:1883",tandem_instance="i"} 1.0'
    assert want in page
    assert 'tandem:push_queued{sink="mqtt h:1883",tandem_instance="i"} 2.0' in page
    assert 'tandem:push_connected{sink="mqtt h:1883",tandem_instance="i"} 1.0' in page
