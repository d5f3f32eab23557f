"""Event clips with pre-roll (workers/camera_clips.py, issue 32 part 2): the ring stays in its
bounds, pruning keeps the clips dir in its, and through the real streams pipeline (a loopback
MJPEG camera whose frames carry their number, the reader, the muxer, the detector and the
publisher) an event gives an MP4 that starts clip_pre_s before it, while a writer stuck on its
disk leaves the records flowing. The tracker and the analytics are stand-ins that fire events at
chosen frames: the analytics themselves are tests/test_camera_analytics.py's."""

from __future__ import annotations

import os
import sys
import threading
import time

import cv2
import numpy as np
import pytest
from camera_helpers import FAST, POLICY, SAFETY_S, VISION, Lines, frames_of

from server.metrics import render
from sources.base import Frame
from sources.loopback import MjpegServer, encode, read_stamp, stamp, synthetic_frames
from workers import camera_clips
from workers.camera_checks import CameraError, CameraOptions
from workers.camera_clips import ClipConfig, ClipRing, ClipWriter, prune_clips

FPS = 20.0
PRE_S, POST_S = 1.0, 0.5


@pytest.fixture(scope="module")
def runtime():
    from runtime.runtime import Runtime

    with Runtime(vision=VISION, profile=False) as rt:
        yield rt


@pytest.fixture(scope="module")
def camera():
    """A 20 fps camera whose frame i, sent at i / 20 s on its clock, carries i mod 256 in its
    stamp (sources/loopback.py). Live: one that falls behind skips frames, as a camera does,
    instead of sending a burst, so stamps measure the camera's time."""
    frames = [stamp(f, 0, i) for i, f in enumerate(synthetic_frames(256, seed=3))]
    with MjpegServer(jpegs=encode(frames), fps=FPS, live=True) as server:
        yield server.url


class Stamps:
    """What the ring was given: (Frame.timestamp, stamp) of every frame, in order."""

    def __init__(self, monkeypatch) -> None:
        self.lock = threading.Lock()
        self.log: list[tuple[float, int]] = []
        add = ClipRing.add

        def logged(ring, frame, encoded):
            with self.lock:
                self.log.append((frame.timestamp, read_stamp(frame.image)[1]))
            add(ring, frame, encoded)

        monkeypatch.setattr(ClipRing, "add", logged)

    def at(self, n: int) -> float:
        """When the newest frame stamped `n` was read."""
        with self.lock:
            return next(t for t, s in reversed(self.log) if s == n)

    def span(self) -> float:
        with self.lock:
            return self.log[-1][0] - self.log[0][0] if self.log else 0.0


class Scripted:
    """The camera's tracker and analytics: the tracker reads each published frame's stamp, and
    the analytics fire a line crossing at the frames `fire(stamp, published)` picks."""

    def __init__(self, fire) -> None:
        self.fire, self.stamp, self.published = fire, None, 0
        self.fired: list[int] = []
        self.counts = {"lines": {"door": {"in": 0, "out": 0}}, "zones": {}}

    def update(self, *args):
        if len(args) == 2:  # tracker.update(det, image)
            self.stamp = read_stamp(args[1])[1]
            return [1] * len(args[0].boxes)
        self.published += 1  # analytics.update(boxes, names, track_ids, t, size)
        if not self.fire(self.stamp, self.published):
            return []
        self.fired.append(self.stamp)
        return [{"type": "line_cross", "line": "door", "direction": "in", "track_id": 1, "at": args[3]}]


def start(runtime, url, tmp_path, script, **options):
    from workers.cameras import CameraService

    lines = Lines()
    service = CameraService(
        runtime,
        None,
        stream_config=FAST,
        url_policy=POLICY,
        control=False,
        clips=ClipConfig(str(tmp_path)),
        jsonl=lines,
    )
    kw = {"tracker": "bytetrack", "lines": "door:0,0.5,1,0.5", "clip_pre_s": PRE_S, "clip_post_s": POST_S}
    service.add("door", url, **{**kw, **options})
    with service.muxer.cond:
        cam = service.muxer.cameras["door"]
        cam.tracker = cam.analytics = script
    return service, lines


def events_of(records: list[dict]) -> list[dict]:
    return [e for r in frames_of(records, "door") for e in r.get("events") or ()]


def read_clip(path: str) -> tuple[list[int], float, int]:
    """(the stamps of its frames, its fps, its frame count) as OpenCV reads the MP4 back."""
    cap = cv2.VideoCapture(path)
    stamps = []
    while True:
        ok, image = cap.read()
        if not ok:
            break
        stamps.append(read_stamp(image)[1])
    fps, count = cap.get(cv2.CAP_PROP_FPS), int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    cap.release()
    return stamps, fps, count


def test_an_event_gives_an_mp4_from_pre_s_before_it_and_a_second_event_extends_it(
    runtime, camera, tmp_path, monkeypatch
):
    pytest.importorskip("lap")
    ring = Stamps(monkeypatch)
    # Fire once the ring holds more than the pre-roll, then again 5 frames later (inside the
    # first clip's post window: it extends that clip).
    first = []

    def fire(n, published):
        if not first and ring.span() > PRE_S + 0.5:
            first.append(n)
            return True
        return bool(first) and (n - first[0]) % 256 >= 5 and len(script.fired) == 1

    script = Scripted(fire)
    # A post window wider than a camera stall: on a busy machine the loopback camera's read can
    # time out (0.5 s) and reconnect between the two events, and with the module's 0.5 s window
    # the second event then rightly started a clip of its own.
    post_s = 2.0
    service, lines = start(runtime, camera, tmp_path, script, clip_post_s=post_s)
    try:
        lines.wait(lambda rs: service.cameras()[0]["clips"]["written"] >= 1)
        row = service.cameras()[0]
        page = render([{**service.payload(), "instance": "s"}]).decode()
    finally:
        service.close()
    events = events_of(lines.records)
    assert len(events) == 2 and events[0]["clip"] == events[1]["clip"], events
    assert os.listdir(tmp_path) == [os.path.basename(events[0]["clip"])], "overlapping events make one clip"
    assert [e["clip"] for e in row["last_events"]] == [events[0]["clip"]] * 2
    assert 0 < row["clips"]["buffer_bytes"] <= row["clips"]["buffer_max_bytes"]
    assert 'tandem:camera_clip_buffer_bytes{camera="door",tandem_instance="s"}' in page

    t1, t2 = ring.at(script.fired[0]), ring.at(script.fired[1])
    with ring.lock:
        times, log = [t for t, _ in ring.log], [n for _, n in ring.log]
    first = next(k for k, t in enumerate(times) if t >= t1 - PRE_S)  # the frames read in [pre_s before,
    last = max(k for k, t in enumerate(times) if t <= t2 + post_s)  # post_s after]: what the clip wants
    stamps, fps, count = read_clip(events[0]["clip"])
    assert count == len(stamps) > 0, (count, stamps)
    # The clip is those frames, within one frame at either end, none missing in between.
    at = next((k for k in (first, first - 1, first + 1) if log[k] == stamps[0]), None)
    assert at is not None, f"first frame {stamps[0]}, wanted {log[first]}"
    assert stamps == log[at : at + len(stamps)], (stamps, log[first : last + 1])
    assert abs(at + len(stamps) - 1 - last) <= 1, (stamps, log[first : last + 1])
    rate = (last - first) / (times[last] - times[first])
    assert abs(fps - rate) < 0.3 * rate, f"the MP4 plays at {fps} fps, the camera sent {rate:.1f}"
    # On the camera's clock too: stamps are its time in frames; a busy machine's late reads
    # move the cut by a frame or two.
    assert abs((script.fired[0] - stamps[0]) % 256 - PRE_S * FPS) <= 3, (script.fired[0], stamps[0])


def test_a_blocked_writer_does_not_slow_detection_and_its_full_queue_drops_clips_counted(
    runtime, camera, tmp_path, monkeypatch
):
    pytest.importorskip("lap")
    entered, release = threading.Event(), threading.Event()
    write = ClipWriter._write

    def stuck(self, clip, entry):  # a disk that stopped answering
        entered.set()
        release.wait(SAFETY_S)
        return write(self, clip, entry)

    monkeypatch.setattr(ClipWriter, "_write", stuck)
    # clip_post_s 0 and an event on every frame from the 10th: each starts a clip of its own.
    script = Scripted(lambda n, published: published >= 10)
    service, lines = start(runtime, camera, tmp_path, script, clip_post_s=0.0, max_fps=10)
    try:
        n0 = len(lines.wait(lambda rs: len(frames_of(rs, "door")) >= 5))
        t0 = time.monotonic()
        lines.wait(lambda rs: len(frames_of(rs, "door")) >= n0 + 15)
        before = 15 / (time.monotonic() - t0)
        assert entered.wait(SAFETY_S), "the writer reached its first frame"
        n1 = len(frames_of(lines.records, "door"))
        t1 = time.monotonic()
        lines.wait(lambda rs: len(frames_of(rs, "door")) >= n1 + 15)
        during = 15 / (time.monotonic() - t1)
        row = service.cameras()[0]
        assert row["clips"]["dropped"] > 0, row["clips"]
    finally:
        release.set()
        service.close()
    assert during >= 0.5 * before, f"{during:.1f} records/s with the writer stuck, {before:.1f} before"
    events = events_of(lines.records)
    assert any(e["clip"] is None for e in events), "a clip the full queue dropped has no path"
    assert len({e["clip"] for e in events if e["clip"]}) <= camera_clips.MAX_PENDING + 1


def test_the_ring_stays_within_its_bytes_and_seconds():
    ring = ClipRing(seconds=1.0, max_bytes=100_000)
    for i in range(200):
        ring.add(Frame("x", i, timestamp=i * 0.01), bytes(7_000))
        nbytes, frames, seconds = ring.stats()
        assert nbytes <= 100_000 and nbytes == frames * 7_000
    assert frames == 14 and seconds < 1.0
    ring = ClipRing(seconds=1.0, max_bytes=10**9)
    for i in range(200):
        ring.add(Frame("x", i, timestamp=i * 0.05), bytes(10))
    _, frames, seconds = ring.stats()
    assert frames in (20, 21) and seconds <= 1.0 + 1e-9
    assert [e.seq for e in ring.after(198)] == [199, 200] and ring.since(9.9)[0].seq == 199
    big = ClipRing(seconds=1.0, max_bytes=1_000)
    big.add(Frame("x", 0, timestamp=0.0), bytes(1_001))  # larger than the whole bound: not kept
    assert big.stats()[:2] == (0, 0) and big.skipped == 1


def test_a_decoded_only_frame_is_kept_as_a_jpeg():
    ring = ClipRing(seconds=1.0, max_bytes=10**6)
    image = np.zeros((240, 320, 3), np.uint8)
    ring.add(Frame("rtsp://x", 0, image=image, timestamp=0.0), None)
    (entry,) = ring.since(0.0)
    assert entry.jpeg[:2] == b"\xff\xd8" and len(entry.jpeg) < image.nbytes / 10


def test_pruning_removes_old_clips_then_the_oldest_past_the_size_bound(tmp_path):
    now = time.time()

    def clip(name: str, age_s: float, size: int) -> str:
        path = tmp_path / name
        path.write_bytes(bytes(size))
        os.utime(path, (now - age_s, now - age_s))
        return str(path)

    ancient = clip("door-1.000000-aaaaaa.mp4", 10 * 86400, 10)
    old = clip("door-2.000000-bbbbbb.mp4", 300, 400)
    mid = clip("door-3.000000-cccccc.mp4", 200, 400)
    new = clip("door-4.000000-dddddd.mp4", 100, 400)
    kept = clip("door-5.000000-eeeeee.mp4", 400, 400)  # being written
    other = clip("notes.mp4", 20 * 86400, 10)  # not a clip's name: never touched
    removed = prune_clips(str(tmp_path), 900, 86400.0, keep={kept}, now=now)
    assert removed == [ancient, old]
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (mid, new, kept, other))
    assert prune_clips(str(tmp_path), None, None, now=now) == []


def test_clip_options_are_checked_naming_the_field(tmp_path):
    assert CameraOptions(clips="off").check().clips is False
    for options, field in (({"clips": "maybe"}, "clips"), ({"clip_pre_s": 61}, "clip_pre_s")):
        with pytest.raises(CameraError) as err:
            CameraOptions(**options).check()
        assert err.value.field == field
    with pytest.raises(CameraError) as err:
        CameraOptions(clip_post_s=-1).check()
    assert err.value.field == "clip_post_s"
    for bad, says in (({"max_bytes": 10}, "clips_max_bytes"), ({"buffer_bytes": 0}, "clips_buffer_bytes")):
        with pytest.raises(ValueError, match=says):
            ClipConfig(str(tmp_path), **bad)


def test_a_camera_asking_for_clips_needs_events_and_a_clips_dir(tmp_path):
    from sources.loopback import dead_url
    from workers.cameras import CameraService

    class Runtime:  # no frame reaches it: the camera is dead
        def metrics_snapshot(self):
            return {}

    for config, kw, says in (
        ({}, {"tracker": "bytetrack", "lines": "door:0,0.5,1,0.5", "clips": "on"}, "--clips-dir"),
        ({"clips": ClipConfig(str(tmp_path))}, {"clips": True}, "lines= or zones="),
    ):
        service = CameraService(Runtime(), None, control=False, **config)
        try:
            with pytest.raises(CameraError, match=says) as err:
                service.add("c", dead_url(), allow_local=True, **kw)
            assert err.value.field == "clips"
        finally:
            service.close()


def test_a_streams_file_takes_the_clip_options(tmp_path):
    from workers.streams_file import parse

    path = tmp_path / "cams.streams"
    path.write_text("rtsp://x.example/1 id=door tracker=bytetrack lines=door:0,0.5,1,0.5 clip_pre_s=2 clips=off\n")
    (line,) = parse(str(path))
    assert line.options["clip_pre_s"] == 2.0 and line.options["clips"] == "off"


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--clips-max-bytes", "10"], "--clips-max-bytes"),
        (["--clips-buffer-bytes", "1K"], "--clips-buffer-bytes"),
        (["--clips-max-age-s", "-1"], "--clips-max-age-s"),
    ],
)
def test_the_cli_refuses_bad_clip_flags_naming_them(tmp_path, capsys, args, names):
    from tandem.streams_cli import main

    assert main(["rtsp://x.example/1", "--no-redis", "--jsonl", "-", "--clips-dir", str(tmp_path), *args]) == 2
    assert names in capsys.readouterr().err


def _filled_ring_writer(clips_dir: str) -> tuple[ClipWriter, camera_clips.CameraClips, float]:
    """A writer and a camera whose ring holds the last 2 s of a 20 fps camera, stamped."""
    writer = ClipWriter(ClipConfig(clips_dir))
    cam = writer.camera("c", 0.5, 0.2)
    now = time.monotonic()
    jpegs = encode([stamp(f, 0, i) for i, f in enumerate(synthetic_frames(40, seed=4))])
    for i, jpeg in enumerate(jpegs):
        cam.ring.add(Frame("x", i, timestamp=now - 2.0 + i / FPS), jpeg)
    return writer, cam, now


def test_the_writer_cuts_the_clip_from_the_ring_by_capture_time(tmp_path):
    writer, cam, now = _filled_ring_writer(str(tmp_path))
    t = now - 2.0 + 20 / FPS - 0.01  # the event is in frame 20 (read 10 ms after it: no float ties)
    path = writer.trigger(cam, t, time.time())
    assert writer.trigger(cam, t + 0.1, time.time()) == path  # inside its post window: the same clip
    thread = threading.Thread(target=writer.run)
    thread.start()
    writer.close()
    thread.join(SAFETY_S)
    stamps, fps, _ = read_clip(path)
    assert stamps == list(range(10, 26)) and abs(fps - FPS) < 1  # 0.5 s before it, 0.2 s after the second
    assert cam.written == 1 and cam.failed == 0 and cam.active is None


def test_a_clip_that_cannot_be_written_is_counted_and_the_writer_goes_on(tmp_path):
    writer, cam, now = _filled_ring_writer(str(tmp_path))
    writer.clips_dir = str(tmp_path / "gone" / "deeper")  # nothing can be written there
    writer.trigger(cam, now - 1.0, time.time())
    thread = threading.Thread(target=writer.run)
    thread.start()
    writer.close()
    thread.join(SAFETY_S)
    assert not thread.is_alive() and cam.failed == 1 and cam.written == 0


def _write_clip(tmp_path, jpegs: list[bytes]) -> tuple[str, camera_clips.CameraClips]:
    """A clip of `jpegs` (a 20 fps camera's last frames) written by a writer thread; its path."""
    writer = ClipWriter(ClipConfig(str(tmp_path)))
    cam = writer.camera("c", 10.0, 0.0)
    now = time.monotonic()
    for i, jpeg in enumerate(jpegs):
        cam.ring.add(Frame("x", i, timestamp=now - len(jpegs) / FPS + i / FPS), jpeg)
    path = writer.trigger(cam, now, time.time())
    thread = threading.Thread(target=writer.run)
    thread.start()
    writer.close()
    thread.join(SAFETY_S)
    assert not thread.is_alive() and cam.written == 1 and cam.failed == 0, cam.stats()
    return path, cam


def clip_packets(path: str) -> list[bytes]:
    """The MP4's frames as stored (no decoding)."""
    cap = cv2.VideoCapture(path)
    cap.set(cv2.CAP_PROP_FORMAT, -1)
    out = []
    while True:
        ok, packet = cap.read()
        if not ok:
            break
        out.append(packet.reshape(-1).tobytes())
    cap.release()
    return out


def test_a_clip_holds_the_cameras_jpegs_as_they_came_without_decoding_them(tmp_path, monkeypatch):
    if getattr(cv2, "VIDEOWRITER_PROP_RAW_VIDEO", None) is None:
        pytest.skip("this OpenCV has no raw video writer: clips are decoded and encoded as mp4v")
    jpegs = encode([stamp(f, 0, i) for i, f in enumerate(synthetic_frames(30, seed=5))])
    decodes = []
    imdecode = cv2.imdecode
    monkeypatch.setattr(cv2, "imdecode", lambda *a: decodes.append(1) or imdecode(*a))
    path, _ = _write_clip(tmp_path, jpegs)
    assert clip_packets(path) == jpegs, "the camera's JPEGs, byte for byte"
    assert not decodes, "no frame was decoded to write the clip"
    assert read_clip(path)[0] == list(range(30))


def test_a_frame_of_another_size_is_resized_into_the_clip(tmp_path):
    frames = [stamp(f, 0, i) for i, f in enumerate(synthetic_frames(12, seed=6))]
    frames[5] = cv2.resize(frames[5], (640, 480), interpolation=cv2.INTER_NEAREST)  # the camera changed resolution
    path, _ = _write_clip(tmp_path, encode(frames))
    cap = cv2.VideoCapture(path)
    sizes = []
    while True:
        ok, image = cap.read()
        if not ok:
            break
        sizes.append(image.shape[:2])
    cap.release()
    assert sizes == [frames[0].shape[:2]] * 12
    assert read_clip(path)[0] == list(range(12))


def test_without_the_raw_writer_clips_are_encoded_as_mp4v(tmp_path, monkeypatch):
    monkeypatch.setattr(camera_clips, "COPY_JPEGS", False)
    path, _ = _write_clip(tmp_path, encode([stamp(f, 0, i) for i, f in enumerate(synthetic_frames(10, seed=7))]))
    cap = cv2.VideoCapture(path)
    fourcc = int(cap.get(cv2.CAP_PROP_FOURCC)).to_bytes(4, "little")
    cap.release()
    assert fourcc in (b"FMP4", b"mp4v"), fourcc  # FFmpeg's name for MPEG-4 part 2, as OpenCV reads it back
    assert read_clip(path)[0] == list(range(10))


def test_jpeg_size_reads_the_header_of_baseline_and_progressive_jpegs():
    from workers.camera_clips import jpeg_size

    for w, h in ((320, 240), (1, 1), (1920, 1080), (4000, 3000)):
        image = np.zeros((h, w, 3), np.uint8)
        for progressive in (0, 1):
            data = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_PROGRESSIVE, progressive])[1].tobytes()
            assert jpeg_size(data) == (w, h), (w, h, progressive)
    good = cv2.imencode(".jpg", np.zeros((48, 64, 3), np.uint8))[1].tobytes()
    for bad in (b"", b"\xff\xd8", b"GIF89a" + good, good[:20], good[:2] + b"\x00" + good[3:]):
        assert jpeg_size(bad) is None, bad[:24]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness is per thread on Linux only")
def test_the_writer_thread_runs_at_a_lower_cpu_priority(tmp_path, monkeypatch):
    seen = []
    write = ClipWriter._write

    def noting(self, clip, entry):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return write(self, clip, entry)

    monkeypatch.setattr(ClipWriter, "_write", noting)
    _write_clip(tmp_path, encode(synthetic_frames(3, seed=8)))
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen and set(seen) == {min(19, mine + camera_clips.BACKGROUND_NICE)}, (seen, mine)
