"""What the detector sees: an annotated MJPEG stream per camera and one HTML page of them all,
for `tandem streams` (server/streams_app.py mounts them behind its API key and Host check).

    GET /cameras/{id}/view   multipart/x-mixed-replace JPEGs of service.latest(id): boxes, and the
                             camera's lines (with an arrow to their "in" side) and zones (filled,
                             with their occupancy), with their running counts
    GET /                    every camera's live view, health, fps, drops and latency, the counts
                             of its lines and zones, and its last events, each with a link to its
                             clip (workers/camera_clips.py) that plays on the page
    GET /clips/{name}        one clip's MP4 (clip_file() says which files it may be)
    GET /clips/{name}/play   the same clip replayed as MJPEG (replay()), for browsers that cannot
                             decode its codec
"""

from __future__ import annotations

import asyncio
import html
import math
import os
import stat
import threading
import time
from dataclasses import dataclass

import numpy as np

BOUNDARY = "tandemframe"
DEFAULT_VIEW_FPS = 10.0
MAX_VIEWERS = 16  # each viewer costs a JPEG encode per frame: bounded, so views cannot starve detection
# A view re-reads its camera's lines, zones and counts this often (the page's own refresh): a
# camera row costs the muxer's lock and every camera's latency sort, too much for every frame.
OVERLAY_EVERY_S = 1.0
MAX_REPLAY_FPS = 30.0


@dataclass(slots=True, frozen=True)
class Overlay:
    """What a view draws over the detections: a camera's lines and zones (LineSpec, ZoneSpec) and
    their running counts (CameraAnalytics.counts, or None)."""

    lines: tuple = ()
    zones: tuple = ()
    counts: dict | None = None


def overlay_of(row: dict) -> Overlay | None:
    """A camera row's lines, zones and counts (None: it has neither lines nor zones)."""
    from runtime.vision.analytics import parse_lines, parse_zones

    lines, zones = row.get("lines") or [], row.get("zones") or []
    if not (lines or zones):
        return None
    return Overlay(parse_lines(lines), parse_zones(zones), row.get("counts"))


def detections_of(record: dict, shape: tuple[int, int]):
    from runtime.vision.postprocess import Detections

    boxes = np.asarray(record.get("boxes") or [], dtype=np.float32).reshape(-1, 4)
    return Detections(
        boxes=boxes,
        conf=np.asarray(record.get("conf") or [], dtype=np.float32),
        cls=np.asarray(record.get("cls") or [], dtype=np.int64),
        names=list(record.get("names") or []),
        orig_shape=shape,
    )


def annotated_jpeg(image: np.ndarray, record: dict, quality: int = 80, overlay: Overlay | None = None) -> bytes:
    import cv2

    from runtime.vision.annotate import draw, draw_analytics

    out = draw(image, detections_of(record, image.shape[:2]))
    if overlay is not None:
        draw_analytics(out, overlay.lines, overlay.zones, overlay.counts)
    ok, buf = cv2.imencode(".jpg", out, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError("JPEG encoding failed")
    return buf.tobytes()


def clip_file(clips_dir: str, name: str) -> str | None:
    """The path of the clip called `name` in `clips_dir`, or None where GET /clips/{name} must not
    serve it: `name` is no clip's own file name (camera_clips.CLIP_NAME: no separator, so no
    "../" and no absolute path), the file is missing, or it is not a regular file (a symlink,
    which could lead anywhere, a directory, a FIFO)."""
    from workers.camera_clips import CLIP_NAME

    if not isinstance(name, str) or not CLIP_NAME.fullmatch(name):
        return None
    root = os.path.realpath(clips_dir)
    path = os.path.join(root, name)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or os.path.dirname(os.path.realpath(path)) != root:
        return None
    return path


class Viewers:
    """How many views stream now, bounded by MAX_VIEWERS."""

    def __init__(self, limit: int = MAX_VIEWERS) -> None:
        self.limit = limit
        self.count = 0
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        with self._lock:
            if self.count >= self.limit:
                return False
            self.count += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.count -= 1


async def mjpeg(service, camera_id: str, fps: float, stop: threading.Event, viewers: Viewers):
    """The parts of one camera's view: a new JPEG whenever a newer record is published, at most
    `fps` a second; ends when the camera is removed or the server stops."""
    period = 1.0 / fps
    last_key = None
    overlay, overlay_at = None, -math.inf
    try:
        while not stop.is_set():
            latest = service.latest(camera_id)
            now = time.monotonic()
            if latest is None or now - overlay_at >= OVERLAY_EVERY_S:
                row = next((r for r in service.cameras() if r["camera"] == camera_id), None)
                if row is None:
                    return  # removed
                overlay, overlay_at = overlay_of(row), now
            if latest is not None:
                image, record = latest
                key = (record.get("seq"), record.get("frame"), id(image), overlay)  # new counts: a new part
                if key != last_key:
                    last_key = key
                    jpeg = await asyncio.to_thread(annotated_jpeg, image, record, overlay=overlay)
                    yield _part(jpeg)
            await asyncio.sleep(period)  # the view's rate cap (its subject is time)
    finally:
        viewers.release()


async def replay(path: str, stop: threading.Event, viewers: Viewers):
    """A clip's frames as MJPEG parts at the clip's own rate, once through. The page plays clips
    this way where the browser's <video> cannot decode them: clips are MJPEG in MP4 (the
    camera's own JPEGs, workers/camera_clips.py; MPEG-4 Part 2 "mp4v" with an older OpenCV),
    which no browser plays, and the codecs they do play cost far more to encode here
    (VP9 about 60 times mp4v's CPU a frame, VP8 about 9 times, measured at 640x480; the
    opencv-python wheels have no H.264 encoder). A replay costs a decode and a JPEG encode a
    frame, only while someone watches, within the views' bound."""
    import cv2

    clip = _Clip(await asyncio.to_thread(cv2.VideoCapture, path))
    try:
        fps = clip.cap.get(cv2.CAP_PROP_FPS)
        period = 1.0 / min(MAX_REPLAY_FPS, fps if fps and fps == fps and fps > 0 else 10.0)
        due = time.monotonic()
        while not stop.is_set():
            jpeg = await asyncio.to_thread(clip.next_jpeg)
            if jpeg is None:
                return  # the clip's end: the page keeps showing its last frame
            yield _part(jpeg)
            due += period
            await asyncio.sleep(max(0.0, due - time.monotonic()))  # the clip's own pace (its subject is time)
    finally:
        clip.close()
        viewers.release()


class _Clip:
    """A clip's VideoCapture, read on worker threads and released from the event loop.

    Why the lock: a viewer who leaves cancels the replay while `asyncio.to_thread` is still
    reading a frame (the thread is not cancelled with its awaiting task), and releasing the
    capture under that read freed FFmpeg's context beneath it: a segfault of the whole server,
    seen once under a busy machine's test run. The release now waits for the read in flight (a
    frame's decode and encode, milliseconds), and a read that comes after it reads nothing."""

    def __init__(self, cap) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._closed = False

    def next_jpeg(self) -> bytes | None:
        import cv2

        with self._lock:
            if self._closed:
                return None
            ok, image = self.cap.read()
        if not ok:
            return None
        ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 80])
        return buf.tobytes() if ok else None

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.cap.release()


def _part(jpeg: bytes) -> bytes:
    head = f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(jpeg)}\r\n\r\n"
    return head.encode() + jpeg + b"\r\n"


PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tandem streams: __INSTANCE__</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font-family: system-ui, sans-serif; margin: 1rem; background: #111; color: #eee; }
h1 { font-size: 1.1rem; font-weight: 600; }
#grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(340px, 1fr)); gap: 1rem; }
.cam { background: #1c1c1c; border: 2px solid #2e7d32; border-radius: 6px; padding: .5rem; }
.cam.down { border-color: #c62828; }
.cam img { width: 100%; aspect-ratio: 4 / 3; object-fit: contain; background: #000; display: block; }
.cam.down img { opacity: .25; }
.head { display: flex; justify-content: space-between; align-items: baseline; margin-bottom: .3rem; }
.name { font-weight: 600; }
.state { font-size: .8rem; padding: 0 .4rem; border-radius: 3px; background: #2e7d32; }
.cam.down .state { background: #c62828; }
.stats, .counts, .events { font-size: .8rem; color: #bbb; margin-top: .3rem; font-variant-numeric: tabular-nums; }
.count { display: inline-block; margin-right: .8rem; }
.count.line { color: #ffd54f; }
.count.zone { color: #64b5f6; }
.events { list-style: none; padding: 0; margin-bottom: 0; }
.events li { margin: .1rem 0; }
.events a, .player a { color: #90caf9; }
.player { margin-top: .4rem; font-size: .8rem; color: #bbb; }
.player video, .player img { width: 100%; aspect-ratio: 4 / 3; background: #000; display: block; margin-bottom: .2rem; }
.player [hidden] { display: none; }
.player .why { color: #ef9a9a; }
.err { font-size: .75rem; color: #ef9a9a; min-height: 1em; }
#status { font-size: .8rem; color: #bbb; }
</style></head><body>
<h1>tandem streams: __INSTANCE__ <span id="status"></span></h1>
<div id="grid"></div>
<script>
"use strict";
const grid = document.getElementById("grid");
const cards = new Map();
function fmt(v, unit) { return v === null || v === undefined ? "-" : (+v).toFixed(v < 10 ? 1 : 0) + (unit || ""); }
function countsOf(box, c) {  // lines and zones (runtime/vision/analytics.py); c is null without them
  const key = JSON.stringify(c);
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  box.replaceChildren();
  if (!c) return;
  for (const [name, n] of Object.entries(c.lines)) {
    box.append(item("count line", name + ": in " + n.in + " · out " + n.out, {line: name, in: n.in, out: n.out}));
  }
  for (const [name, z] of Object.entries(c.zones)) {
    const text = name + ": " + z.occupancy + " now · " + z.entries + " entered · " + z.exits + " left";
    box.append(item("count zone", text, {zone: name, occupancy: z.occupancy, entries: z.entries, exits: z.exits}));
  }
}
function item(cls, text, data, tag) {
  const el = document.createElement(tag || "span");
  el.className = cls;
  el.textContent = text;
  Object.assign(el.dataset, data);
  return el;
}
function clipTime(path) {  // a clip's Unix time, from its name CAMERA-TIME-ID.mp4 (workers/camera_clips.py)
  const m = /-(\d+\.\d{6})-[a-z0-9]{6}\.mp4$/.exec(path || "");
  return m ? +m[1] : null;
}
function eventsOf(list, row) {  // the newest five; a clip is a link once written, to the camera's last clip
  const box = document.createElement("ul");
  box.className = "events";
  const last = clipTime(row.clips && row.clips.last_clip);
  for (const e of (list || []).slice(-5).reverse()) {
    const what = e.type === "line_cross" ? e.line + " " + e.direction : e.type.replace("zone_", "") + " " + e.zone;
    const dwell = e.dwell_s === undefined ? "" : " after " + e.dwell_s.toFixed(1) + " s";
    const li = item("event", new Date(e.at * 1000).toLocaleTimeString() + " " + what + dwell +
      " (" + e.cls + " #" + e.track_id + ") ", {type: e.type, track: e.track_id}, "li");
    const name = e.clip ? e.clip.split("/").pop() : null;
    if (name && last !== null && clipTime(name) <= last) {
      const a = item("clip", "play clip", {clip: name}, "a");
      a.href = "clips/" + encodeURIComponent(name);
      li.append(a);
    } else if (name) {
      li.append(item("recording", "clip recording…", {clip: name}));
    }
    box.append(li);
  }
  return box;
}
function play(el, a) {  // the card's player: <video> of GET /clips/NAME, same cookie; replay() if it cannot
  const player = el.querySelector(".player");
  const video = player.querySelector("video"), img = player.querySelector("img");
  player.hidden = false;
  player.dataset.href = a.href;
  player.querySelector(".why").textContent = "";
  player.querySelector(".clipname").textContent = a.dataset.clip + " ";
  player.querySelector(".download").href = a.href;
  img.hidden = true;
  img.removeAttribute("src");
  video.hidden = false;
  video.src = a.href;
  video.play().catch(() => {});  // autoplay may be refused: the controls remain
}
function replay(el) {  // the clip's frames as MJPEG (GET /clips/NAME/play), once through
  const player = el.querySelector(".player"), img = player.querySelector("img");
  img.hidden = false;
  img.src = player.dataset.href + "/play?t=" + Date.now();
}
function card(row) {
  const el = document.createElement("div");
  el.className = "cam";
  el.dataset.camera = row.camera;
  el.innerHTML = '<div class="head"><span class="name"></span><span class="state"></span></div>' +
    '<img alt=""><div class="stats"></div><div class="counts"></div><ul class="events"></ul><div class="err"></div>' +
    '<div class="player" hidden><video controls muted playsinline preload="metadata"></video><img alt="clip" hidden>' +
    '<span class="clipname"></span><a class="download" download>download</a> · <a class="again" href="#">again</a>' +
    ' · <a class="close" href="#">close</a> <span class="why"></span></div>';
  el.querySelector(".name").textContent = row.camera;
  const video = el.querySelector("video");
  video.addEventListener("error", () => {
    if (!video.getAttribute("src")) return;  // closed
    const code = video.error ? video.error.code : 0;
    if (code !== 4) {
      el.querySelector(".why").textContent = "the clip did not load (error " + code + ")";
      return;
    }
    // MEDIA_ERR_SRC_NOT_SUPPORTED: the clip's codec (mp4v) is none a browser decodes.
    video.removeAttribute("src");
    video.hidden = true;
    el.querySelector(".why").textContent = "replayed frame by frame: browsers do not decode this clip's codec";
    replay(el);
  });
  el.addEventListener("click", (ev) => {
    const a = ev.target.closest("a.clip, a.again, a.close");
    if (!a) return;
    ev.preventDefault();
    if (a.classList.contains("clip")) { play(el, a); return; }
    if (a.classList.contains("again")) {
      if (video.hidden) replay(el); else { video.currentTime = 0; video.play().catch(() => {}); }
      return;
    }
    video.pause();
    video.removeAttribute("src");
    el.querySelector(".player img").removeAttribute("src");  // ends its replay stream
    el.querySelector(".player").hidden = true;
  });
  const img = el.querySelector("img");
  img.alt = "camera " + row.camera;
  img.src = "cameras/" + encodeURIComponent(row.camera) + "/view";
  grid.appendChild(el);
  return el;
}
function update(rows) {
  const seen = new Set();
  for (const row of rows) {
    seen.add(row.camera);
    const el = cards.get(row.camera) || card(row);
    cards.set(row.camera, el);
    const down = !row.up;
    el.classList.toggle("down", down);
    el.dataset.state = down ? "down" : "up";
    el.querySelector(".state").textContent = down ? "down (" + row.state + ")" : "live";
    el.querySelector(".stats").textContent = "fps " + fmt(row.fps) + " · frames " + row.frames +
      " · drops " + row.drops + " · latency p50 " + fmt(row.latency_ms_p50, " ms") +
      " p99 " + fmt(row.latency_ms_p99, " ms") + " · detections " + row.detections;
    el.querySelector(".err").textContent = down && row.last_error ? row.last_error : "";
    countsOf(el.querySelector(".counts"), row.counts);
    const events = el.querySelector(".events");
    const key = JSON.stringify([row.last_events, row.clips && row.clips.last_clip]);
    if (events.dataset.key !== key) {  // rebuilt only when it changed: a link stays put under the pointer
      const fresh = eventsOf(row.last_events, row);
      fresh.dataset.key = key;
      events.replaceWith(fresh);
    }
    const img = el.querySelector("img");
    if (!down && img.dataset.was === "down") {  // back up: reconnect its view
      img.src = "cameras/" + encodeURIComponent(row.camera) + "/view?t=" + Date.now();
    }
    img.dataset.was = down ? "down" : "up";
  }
  for (const [name, el] of cards) {
    if (!seen.has(name)) { el.remove(); cards.delete(name); }
  }
}
async function refresh() {
  try {
    const resp = await fetch("cameras", {credentials: "same-origin", headers: {"Accept": "application/json"}});
    if (!resp.ok) throw new Error("GET /cameras: HTTP " + resp.status);
    update((await resp.json()).cameras);
    document.getElementById("status").textContent = "";
  } catch (e) {
    document.getElementById("status").textContent = "(" + e.message + ")";
  }
}
refresh();
setInterval(refresh, __REFRESH_MS__);
</script></body></html>
"""


def page(instance: str, refresh_ms: int = 1000) -> str:
    return PAGE.replace("__INSTANCE__", html.escape(instance)).replace("__REFRESH_MS__", str(int(refresh_ms)))
