"""Lines and zones over a camera's tracks (runtime/vision/analytics.py, issue 32): crossings
counted once with their direction, zone entries, exits, occupancy and dwell, and the options
that ask for them (`.streams` lines, analytics= files, HTTP/Redis commands).

The geometry runs on synthetic tracks whose crossings are known by construction; one test runs
a generated scene through the real path (the shipped detector, Ultralytics' ByteTrack, the
camera service's publisher) and checks the records' events, the row's counts and /metrics.
"""

from __future__ import annotations

import json
import math
import os

import cv2
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from runtime.vision.analytics import CameraAnalytics, parse_lines, parse_zones
from server.metrics import render
from sources import SourceError
from workers.camera_checks import CameraError, CameraOptions
from workers.cameras_control import apply
from workers.streams_file import StreamsFile, parse

SIZE = (320, 240)  # width, height of the synthetic tracks' image
FPS = 10.0


def run(analytics: CameraAnalytics, tracks: dict[int, list], cls: str = "circle") -> list[dict]:
    """Feed `tracks` {id: [(x, y) bottom centre in fractions, or None when unseen] per frame}
    as 20-pixel boxes; every event, in order."""
    w, h = SIZE
    events = []
    for t in range(max(len(p) for p in tracks.values())):
        boxes, ids = [], []
        for track_id, path in tracks.items():
            if t < len(path) and path[t] is not None:
                x, y = path[t][0] * w, path[t][1] * h
                boxes.append([x - 10, y - 20, x + 10, y])
                ids.append(track_id)
        events += analytics.update(boxes, [cls] * len(ids), ids, t / FPS, SIZE)
    return events


def path(start, end, n: int) -> list[tuple[float, float]]:
    return [
        (start[0] + (end[0] - start[0]) * k / (n - 1), start[1] + (end[1] - start[1]) * k / (n - 1)) for k in range(n)
    ]


def crossings(events: list[dict]) -> list[tuple]:
    return [(e["line"], e["track_id"], e["direction"]) for e in events if e["type"] == "line_cross"]


# ---- lines -------------------------------------------------------------------------------------


def test_line_counts_and_directions_are_exact():
    # A line from top to bottom at x = 0.5: walking it so, "in" is on the right hand, i.e. the
    # image's left (docs: runtime/vision/analytics.py).
    a = CameraAnalytics(parse_lines("door:0.5,0.1,0.5,0.9"))
    tracks = {
        1: path((0.1, 0.5), (0.9, 0.5), 20),  # left to right: out
        2: path((0.9, 0.3), (0.1, 0.3), 12),  # right to left: in
        3: path((0.9, 0.6), (0.1, 0.7), 30) + path((0.1, 0.7), (0.9, 0.7), 30),  # in, then back out
        4: path((0.2, 0.95), (0.8, 0.95), 20),  # below the segment's end: round it, not through
        5: path((0.1, 0.2), (0.4, 0.2), 10),  # never reaches it
    }
    events = run(a, tracks)
    assert sorted(crossings(events)) == [("door", 1, "out"), ("door", 2, "in"), ("door", 3, "in"), ("door", 3, "out")]
    assert a.counts["lines"] == {"door": {"in": 2, "out": 2}}
    first = next(e for e in events if e["track_id"] == 1)
    assert first["cls"] == "circle" and first["point"][0] > 0.5 and first["at"] > 0


def test_the_in_side_follows_the_points_order():
    down = CameraAnalytics(parse_lines("door:0,0.5,1,0.5"))  # left to right: moving down is in
    up = CameraAnalytics(parse_lines("door:1,0.5,0,0.5"))  # swapped: moving down is out
    track = {7: path((0.5, 0.2), (0.5, 0.8), 10)}
    assert crossings(run(down, track)) == [("door", 7, "in")]
    assert crossings(run(up, track)) == [("door", 7, "out")]


def stops_on_the_line() -> list[tuple[float, float]]:
    """Left to right across x = 0.5, stopping on it for 30 frames while its box jitters 1% of the
    image either side of it (a detector's noise), then going on."""
    stay = [(0.5 + 0.01 * (-1) ** k, 0.5) for k in range(30)]
    return path((0.2, 0.5), (0.5, 0.5), 10) + stay + path((0.5, 0.5), (0.8, 0.5), 10)[1:]


def test_a_track_that_stops_on_the_line_jittering_across_it_is_counted_once():
    a = CameraAnalytics(parse_lines("door:0.5,0.9,0.5,0.1"))  # bottom to top: moving right is in
    assert crossings(run(a, {3: stops_on_the_line()})) == [("door", 3, "in")]


def test_without_the_hysteresis_the_same_jitter_is_counted_many_times():
    """What the margin band prevents: with margin 0 every jitter across the line counts."""
    line = parse_lines([{"name": "door", "points": [[0.5, 0.9], [0.5, 0.1]], "margin": 0}])
    counted = crossings(run(CameraAnalytics(line), {3: stops_on_the_line()}))
    assert len(counted) > 20 and {d for _, _, d in counted} == {"in", "out"}


def test_a_track_must_leave_the_band_on_the_other_side_before_crossing_back():
    a = CameraAnalytics(parse_lines("door:0.5,0.9,0.5,0.1"))
    # Crosses (in), comes back into the band but not beyond it, goes on: one crossing only.
    track = path((0.3, 0.5), (0.6, 0.5), 10) + path((0.6, 0.5), (0.49, 0.5), 5) + path((0.49, 0.5), (0.7, 0.5), 5)
    assert crossings(run(a, {1: track})) == [("door", 1, "in")]


def test_a_class_filter_counts_only_those_classes():
    a = CameraAnalytics(parse_lines("door:0.5,0,0.5,1:square,triangle"))
    assert crossings(run(a, {1: path((0.1, 0.5), (0.9, 0.5), 10)}, cls="circle")) == []
    assert crossings(run(a, {2: path((0.1, 0.5), (0.9, 0.5), 10)}, cls="square")) == [("door", 2, "out")]


# ---- zones -------------------------------------------------------------------------------------


def test_zone_occupancy_entries_exits_and_dwell_within_one_frame_period():
    a = CameraAnalytics(zones=parse_zones("bay:0.3,0.2,0.7,0.2,0.7,0.8,0.3,0.8"))
    # Track 1 moves at 0.013 per frame through x in [0.3, 0.7]: 0.4 / 0.013 frames inside.
    speed = 0.013
    one = [(0.05 + speed * k, 0.5) for k in range(60)]
    # Track 2 enters and stays (occupancy 1 at the end); track 3 passes above the zone.
    two = path((0.1, 0.4), (0.5, 0.4), 20) + [(0.5, 0.4)] * 40
    three = path((0.1, 0.1), (0.9, 0.1), 60)
    events = run(a, {1: one, 2: two, 3: three})
    exits = [e for e in events if e["type"] == "zone_exit"]
    assert [e["track_id"] for e in exits] == [1]
    truth = 0.4 / speed / FPS
    assert abs(exits[0]["dwell_s"] - truth) <= 1 / FPS, (exits[0]["dwell_s"], truth)
    assert sorted(e["track_id"] for e in events if e["type"] == "zone_enter") == [1, 2]
    assert a.counts["zones"] == {"bay": {"occupancy": 1, "entries": 2, "exits": 1}}


def test_a_lost_track_leaves_the_zone_when_it_was_last_seen():
    a = CameraAnalytics(zones=parse_zones("bay:0.2,0.2,0.8,0.2,0.8,0.8,0.2,0.8"), lost_s=1.0)
    inside = [(0.5, 0.5)] * 10 + [None] * 15  # seen 1 s in the zone, then gone
    events = run(a, {4: inside, 5: [(0.05, 0.05)] * 25})  # track 5 keeps frames coming
    exit_ = [e for e in events if e["type"] == "zone_exit"]
    assert exit_ == [
        {"type": "zone_exit", "zone": "bay", "track_id": 4, "cls": "circle", "dwell_s": 0.9, "lost": True, "at": 0.9}
    ]
    assert a.counts["zones"]["bay"]["occupancy"] == 0


def test_a_zone_class_filter_ignores_other_classes():
    a = CameraAnalytics(zones=parse_zones("bay:0.2,0.2,0.8,0.2,0.8,0.8,0.2,0.8:square"))
    run(a, {1: path((0.1, 0.5), (0.5, 0.5), 10)}, cls="circle")
    assert a.counts["zones"]["bay"] == {"occupancy": 0, "entries": 0, "exits": 0}


# ---- options -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "text", "says"),
    [
        ("lines", "door:0.5,0,0.5", "x,y pairs"),
        ("lines", "door:0.5,0,0.5,1.5", "in [0, 1]"),
        ("lines", "door:0.5,0,0.5,1,0.2,0.2", "two points"),
        ("lines", "door 0.5,0,0.5,1", "NAME:X1,Y1"),
        ("lines", "door:0.5,0,0.5,1;door:0,0,1,1", "given twice"),
        ("zones", "bay:0.1,0.1,0.4,0.1", "3 or more points"),
        ("zones", "bay:0.1,0.1,0.2,0.2,0.3,0.3", "with an area"),
        ("zones", "b@y:0.1,0.1,0.4,0.1,0.4,0.5", "a name must be"),
    ],
)
def test_a_bad_line_or_zone_is_refused_naming_the_option(option, text, says):
    with pytest.raises(CameraError) as err:
        CameraOptions(tracker="bytetrack", **{option: text}).check()
    assert err.value.field == option and str(err.value).startswith(option + ":") and says in str(err.value)


@pytest.mark.parametrize("option", ["lines", "zones"])
def test_a_line_or_zone_without_a_tracker_is_refused_naming_the_option(option):
    text = "door:0.5,0,0.5,1" if option == "lines" else "bay:0.1,0.1,0.4,0.1,0.4,0.5"
    with pytest.raises(CameraError, match="need tracking") as err:
        CameraOptions(**{option: text}).check()
    assert err.value.field == option


def test_the_control_commands_take_lines_and_zones_as_text_or_lists():
    class Cameras:
        def add(self, camera_id, url, max_fps=None, **options):
            self.options = CameraOptions(**options).check()
            return {"camera": camera_id}

    cams = Cameras()
    zone = {"name": "bay", "points": [[0.1, 0.1], [0.4, 0.1], [0.4, 0.5]], "classes": ["square"]}
    cmd = {"op": "add", "camera": "c", "url": "rtsp://x.example/1", "tracker": "bytetrack", "lines": "door:0,0.5,1,0.5"}
    apply(cams, {**cmd, "zones": [zone]})
    assert [s.to_dict() for s in cams.options.zones] == [zone]
    assert cams.options.lines[0].to_dict() == {"name": "door", "points": [[0, 0.5], [1, 0.5]], "classes": []}


def test_the_camera_service_gives_a_camera_its_lines_and_zones_and_the_row_its_counts():
    pytest.importorskip("lap")
    from sources.loopback import dead_url
    from workers.cameras import CameraService

    class Runtime:  # no frame reaches it: the camera is dead
        def metrics_snapshot(self):
            return {}

    service = CameraService(Runtime(), None, control=False)
    try:
        with pytest.raises(CameraError, match="need tracking") as err:
            service.add("plain", dead_url(), allow_local=True, lines="door:0,0.5,1,0.5")
        assert err.value.field == "lines" and service.cameras() == []
        service.add("gate", dead_url(), allow_local=True, tracker="bytetrack", lines="door:0,0.5,1,0.5", zones=ZONE)
        (row,) = service.cameras()
        assert row["counts"] == {
            "lines": {"door": {"in": 0, "out": 0}},
            "zones": {"bay": {"occupancy": 0, "entries": 0, "exits": 0}},
        }
        assert [z["name"] for z in row["zones"]] == ["bay"]
        page = render([{**service.payload(), "instance": "s"}]).decode()
        assert 'tandem:camera_zone_occupancy{camera="gate",tandem_instance="s",zone="bay"} 0.0' in page
    finally:
        service.close()


ZONE = "bay:0.1,0.1,0.4,0.1,0.4,0.5"


def write(path, text: str) -> None:
    st = os.stat(path) if os.path.exists(path) else None
    path.write_text(text)
    if st is not None:  # a new mtime for sure (see test_streams_reload)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


class FakeService:
    def __init__(self) -> None:
        self.cams: dict[str, dict] = {}

    def add(self, camera_id, url, max_fps=None, *, allow_local=False, **options):
        self.cams[camera_id] = options
        return {"camera": camera_id}

    def remove(self, camera_id):
        return {"camera": self.cams.pop(camera_id)}


def test_a_streams_file_takes_lines_zones_and_an_analytics_file_and_reloads_on_its_edit(tmp_path):
    spec = tmp_path / "door.json"
    write(spec, json.dumps({"zones": [{"name": "bay", "points": [[0.1, 0.1], [0.4, 0.1], [0.4, 0.5]]}]}))
    f = tmp_path / "cams.streams"
    write(f, "rtsp://a.example/1 id=door tracker=bytetrack lines=in:0,0.5,1,0.5 analytics=door.json\n")
    service = FakeService()
    sf = StreamsFile(str(f), service)
    sf.load()
    options = service.cams["door"]
    assert [s.name for s in options["lines"]] == ["in"] and [s.name for s in options["zones"]] == ["bay"]
    assert sf.poll() is None
    # An edit of the JSON file alone reloads the camera with the new zone.
    write(spec, json.dumps({"zones": [{"name": "dock", "points": [[0.5, 0.5], [0.9, 0.5], [0.9, 0.9]]}]}))
    assert sf.poll() == {"added": [], "removed": [], "changed": ["door"], "error": None}
    assert [s.name for s in service.cams["door"]["zones"]] == ["dock"]
    assert sf.poll() is None


def test_a_bad_line_in_a_streams_file_names_the_line_and_the_option(tmp_path):
    f = tmp_path / "cams.streams"
    write(f, "rtsp://a.example/1\nrtsp://b.example/2 tracker=bytetrack zones=bay:0.1,0.1,2,0.1,0.4,0.5\n")
    with pytest.raises(SourceError, match=r"line 2: zones: bay: points must be"):
        parse(str(f))
    (tmp_path / "bad.json").write_text('{"lines": [{"name": "door", "points": [[0, 0]]}]}')
    write(f, "rtsp://a.example/1 tracker=bytetrack analytics=bad.json\n")
    with pytest.raises(SourceError, match=r"line 1: lines: door: a line is two points"):
        parse(str(f))
    write(f, "rtsp://a.example/1 tracker=bytetrack analytics=missing.json\n")
    with pytest.raises(SourceError, match=r"line 1: analytics: cannot read"):
        parse(str(f))


def test_metrics_carry_the_counts():
    row = {
        "camera": "gate",
        "up": 1,
        "state": "live",
        "counts": {
            "lines": {"door": {"in": 3, "out": 1}},
            "zones": {"bay": {"occupancy": 2, "entries": 5, "exits": 3}},
        },
    }
    page = render([{"instance": "i", "cameras": [row]}]).decode()
    line = 'tandem:camera_line_crossings_total{camera="gate",direction="in",line="door",tandem_instance="i"} 3.0'
    assert line in page
    assert 'tandem:camera_zone_occupancy{camera="gate",tandem_instance="i",zone="bay"} 2.0' in page
    assert 'tandem:camera_zone_entries_total{camera="gate",tandem_instance="i",zone="bay"} 5.0' in page


# ---- the real path: detector, tracker, publisher ----------------------------------------------

IMG = 320
NUM_FRAMES = 40


def centres(t: int) -> list[tuple[int, float, float, int]]:
    """(class, x, y, half size) of each shape at frame t: a circle going right across x = 160;
    a square going right that stops on x = 160 for 12 frames, its box jittering 3 px either
    side (under the 6.4 px margin), then goes on; a triangle going left across it."""
    circle = (0, 40.0 + 6 * t, 60.0, 22)
    if t < 12:
        sx = 64.0 + 8 * t
    elif t < 24:
        sx = 160.0 + 3 * (-1) ** t
    else:
        sx = 160.0 + 8 * (t - 24)
    return [circle, (1, sx, 160.0, 24), (2, 280.0 - 6 * t, 250.0, 26)]


def scene(t: int) -> np.ndarray:
    """Frame t, drawn as tests/test_tracking.py draws (runtime/vision/synthetic.py's shapes)."""
    rng = np.random.default_rng(t)
    img = np.clip(np.array([90, 110, 100]) + rng.normal(0, 18, (IMG, IMG, 3)), 0, 255).astype(np.uint8)
    colours = ((30, 30, 230), (230, 200, 30), (40, 220, 40))
    for cls, cx, cy, r in centres(t):
        if cls == 0:
            cv2.circle(img, (round(cx), round(cy)), r, colours[cls], -1, cv2.LINE_AA)
            continue
        n = 4 if cls == 1 else 3
        pts = np.array(
            [
                (cx + r * math.cos(0.3 + 2 * math.pi * k / n), cy + r * math.sin(0.3 + 2 * math.pi * k / n))
                for k in range(n)
            ]
        )
        cv2.fillPoly(img, [np.round(pts).astype(np.int32)], colours[cls], cv2.LINE_AA)
    return img


def test_a_generated_scene_through_the_detector_tracker_and_publisher():
    pytest.importorskip("lap")
    from runtime.vision.config import VisionConfig
    from runtime.vision.detector import IMGSZ, WEIGHTS
    from runtime.vision.runner import YoloRunner
    from runtime.vision.tracking import make_tracker
    from sources.base import Frame
    from sources.stream_reader import StreamHealth
    from workers.cameras_publish import Publisher
    from workers.cameras_state import Camera, Result

    assert IMGSZ == IMG
    runner = YoloRunner(VisionConfig(model=str(WEIGHTS), imgsz=IMGSZ, profile=False, dtype="float32", end2end=False))
    options = CameraOptions(
        tracker="bytetrack",
        lines="door:0.5,1,0.5,0",  # bottom to top: moving right is in
        zones="bay:0.55,0,0.8,0,0.8,0.7,0.55,0.7:circle",
    ).check()

    class Reader:  # the row's reader health, for a camera fed by hand
        def health(self, now):
            return StreamHealth(0, "gen", "live", NUM_FRAMES, 0, 0, None, 0.0)

    # The camera as CameraService.add builds it (workers/cameras.py), fed frames by hand.
    cam = Camera("gen", "gen", "gen", 0.0, Reader(), 0.0, options)
    cam.tracker = make_tracker("bytetrack", frame_rate=FPS)
    cam.analytics = CameraAnalytics(options.lines, options.zones)
    publisher = Publisher(None, None, 100, "gen", 2.0, dict)
    records = []
    t0 = 1_700_000_000.0
    images = [scene(t) for t in range(NUM_FRAMES)]
    dets = [det for k in range(0, NUM_FRAMES, 20) for det in runner.predict(images[k : k + 20])]  # batched: faster
    for t, (img, det) in enumerate(zip(images, dets, strict=True)):
        assert len(det) >= 3, f"frame {t}: the detector missed a shape: the scene, not the analytics, is wrong"
        at = t0 + t / FPS
        records += publisher._build([Result(cam, Frame("gen", t, img), t + 1, det, None, at, at + 0.01)])
    events = [e for r in records for e in r["events"]]
    by_class = {}
    for e in events:
        if e["type"] == "line_cross":
            by_class.setdefault(e["cls"], []).append(e["direction"])
    # Each crossing once, with its direction; the square stopped on the line, jittering, once.
    assert by_class == {"circle": ["in"], "square": ["in"], "triangle": ["out"]}, events
    assert len({e["track_id"] for e in events if e["type"] == "line_cross"}) == 3
    # The circle's time in the bay: its centre passes x = 176 .. 256 px at 6 px a frame.
    zone = [e for e in events if e.get("zone") == "bay"]
    assert [(e["type"], e["cls"]) for e in zone] == [("zone_enter", "circle"), ("zone_exit", "circle")], zone
    truth = (256 - 176) / 6 / FPS
    assert abs(zone[1]["dwell_s"] - truth) <= 1 / FPS, (zone[1]["dwell_s"], truth)
    assert zone[1]["at"] - zone[0]["at"] == pytest.approx(zone[1]["dwell_s"], abs=1e-3)
    row = cam.row(0.0)
    assert row["counts"] == {
        "lines": {"door": {"in": 2, "out": 1}},
        "zones": {"bay": {"occupancy": 0, "entries": 1, "exits": 1}},
    }
    assert row["lines"][0]["name"] == "door" and row["zones"][0]["classes"] == ["circle"]
    page = render([{"instance": "i", "cameras": [row]}]).decode()
    assert 'tandem:camera_line_crossings_total{camera="gen",direction="in",line="door",tandem_instance="i"} 2.0' in page
