"""What the detector sees: an annotated MJPEG stream per camera and one HTML page of them all,
for `tandem streams` (server/streams_app.py mounts them behind its API key and Host check).

    GET /cameras/{id}/view   multipart/x-mixed-replace JPEGs of service.latest(id), boxes drawn
    GET /                    every camera's live view, health, fps, drops and latency, the
                             counts of its lines and zones, and its last events with their
                             clips' file names (workers/camera_clips.py; not served over HTTP)
"""

from __future__ import annotations

import asyncio
import html
import threading

import numpy as np

BOUNDARY = "tandemframe"
DEFAULT_VIEW_FPS = 10.0
MAX_VIEWERS = 16  # each viewer costs a JPEG encode per frame: bounded, so views cannot starve detection


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


def annotated_jpeg(image: np.ndarray, record: dict, quality: int = 80) -> bytes:
    import cv2

    from runtime.vision.annotate import draw

    out = draw(image, detections_of(record, image.shape[:2]))
    ok, buf = cv2.imencode(".jpg", out, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError("JPEG encoding failed")
    return buf.tobytes()


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
    try:
        while not stop.is_set():
            latest = service.latest(camera_id)
            if latest is None and camera_id not in {c["camera"] for c in service.cameras()}:
                return  # removed
            if latest is not None:
                image, record = latest
                key = (record.get("seq"), record.get("frame"), id(image))
                if key != last_key:
                    last_key = key
                    jpeg = await asyncio.to_thread(annotated_jpeg, image, record)
                    head = f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(jpeg)}\r\n\r\n"
                    yield head.encode() + jpeg + b"\r\n"
            await asyncio.sleep(period)  # the view's rate cap (its subject is time)
    finally:
        viewers.release()


PAGE = """<!doctype html>
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
function counts(c) {  // lines and zones (runtime/vision/analytics.py), null without them
  if (!c) return "";
  const parts = Object.entries(c.lines).map(([name, n]) => name + ": in " + n.in + ", out " + n.out);
  for (const [name, z] of Object.entries(c.zones)) parts.push(name + ": " + z.occupancy + " now, " + z.entries + " entered");
  return parts.join(" · ");
}
function events(list) {  // the newest three, with the file name of the clip each is in
  return (list || []).slice(-3).reverse().map((e) => {
    const when = new Date(e.at * 1000).toLocaleTimeString();
    const what = e.type === "line_cross" ? e.line + " " + e.direction : e.type.replace("zone_", "") + " " + e.zone;
    return when + " " + what + (e.clip ? " (" + e.clip.split("/").pop() + ")" : "");
  }).join(" · ");
}
function card(row) {
  const el = document.createElement("div");
  el.className = "cam";
  el.dataset.camera = row.camera;
  el.innerHTML = '<div class="head"><span class="name"></span><span class="state"></span></div>' +
    '<img alt=""><div class="stats"></div><div class="counts"></div><div class="events"></div><div class="err"></div>';
  el.querySelector(".name").textContent = row.camera;
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
    el.querySelector(".counts").textContent = counts(row.counts);
    el.querySelector(".events").textContent = events(row.last_events);
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
