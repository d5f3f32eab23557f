"""The camera page of `tandem streams` in a real headless Chromium: the page loads behind the API
key (given once as /?key=, kept as an HttpOnly cookie), each live camera's annotated MJPEG view
updates, and a dead camera shows as down. A camera with a line and a zone has them drawn on its
view, its counts and last events beside it, and its events' clips open in the page's player.

The app is the real one (create_app behind uvicorn on a free port) on a real Runtime with the
shipped detector, fed by loopback MJPEG cameras. Every wait is WebDriverWait on a condition.
Screenshots go to /tmp/streams_page.png and $TANDEM_PAGE_SCREENSHOT (default
/tmp/streams_page_analytics.png).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
from urllib.parse import urlsplit

import numpy as np
import pytest
from test_jobs_support import wait_for

from runtime.vision.annotate import LINE_COLOR, ZONE_COLOR
from server.streams_app import ControlServer, create_app
from sources.loopback import MjpegServer, dead_url, synthetic_frames
from sources.scene import moving_scene
from sources.stream_reader import StreamConfig
from workers.camera_clips import ClipConfig
from workers.cameras import CameraService, camera_policy
from workers.cameras_security import Security

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SAFETY_S = 60
KEY = "page-test-key"
SCREENSHOT = "/tmp/streams_page.png"
BROWSER_CODECS = {"avc1", "H264", "VP80", "VP90", "av01", "AV01"}  # what OpenCV reads back of H.264, VP8, VP9, AV1
ANALYTICS_SCREENSHOT = os.environ.get("TANDEM_PAGE_SCREENSHOT", "/tmp/streams_page_analytics.png")
# "front" is tracked, with a line across the middle and a zone over the left half: the scene's
# shapes bounce across both every few seconds. Short clips, so one is written within the test.
FRONT = {
    "tracker": "bytetrack",
    "lines": "door:0,0.5,1,0.5",
    "zones": "bay:0.05,0.05,0.5,0.05,0.5,0.95,0.05,0.95",
    "clips": True,
    "clip_pre_s": 1.0,
    "clip_post_s": 1.0,
}
FAST = StreamConfig(open_timeout_s=0.5, read_timeout_s=0.5, stall_after_s=0.5, backoff_initial_s=0.1, backoff_max_s=0.4)

pytestmark = pytest.mark.skipif(
    not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
    reason="needs Debian chromium and chromium-driver (make test installs them)",
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from runtime.runtime import Runtime
    from runtime.vision.detector import WEIGHTS, default_imgsz

    vision = {"model": str(WEIGHTS), "imgsz": default_imgsz(str(WEIGHTS)), "profile": False}
    cams = [
        MjpegServer(moving_scene(90, seed=1), fps=15, live=True),
        MjpegServer(synthetic_frames(15, seed=2), fps=15, live=True),
    ]
    work = tmp_path_factory.mktemp("page")
    jsonl = open(work / "records.jsonl", "a")
    with Runtime(vision=vision, profile=False) as runtime:
        policy = camera_policy(allowed_networks=("127.0.0.1/32",))
        clips = ClipConfig(str(work / "clips"))
        kw = {"jsonl": jsonl, "max_fps": 8, "stream_config": FAST, "url_policy": policy, "clips": clips}
        service = CameraService(runtime, None, **kw)
        service.add("front", cams[0].url, **FRONT)
        service.add("yard", cams[1].url)
        service.add("gone", dead_url())
        server = ControlServer("127.0.0.1", 0)
        server.start(create_app(service, Security((KEY,), "127.0.0.1"), server.stop))
        try:
            yield server.url, service, work / "records.jsonl"
        finally:
            server.close()
            service.close()
            jsonl.close()
            for c in cams:
                c.close()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


# The frame an <img> shows now, as a digest of its pixels (same origin: the canvas is not tainted).
_PIXELS = """
const img = document.querySelector(`.cam[data-camera="${arguments[0]}"] img`);
if (!img || !img.complete || !img.naturalWidth) return null;
const c = document.createElement("canvas");
c.width = img.naturalWidth; c.height = img.naturalHeight;
const ctx = c.getContext("2d");
ctx.drawImage(img, 0, 0);
return Array.from(ctx.getImageData(0, 0, c.width, c.height).data.filter((_, i) => i % 97 == 0)).join(",");
"""


def test_the_page_shows_every_camera_live_views_update_and_a_dead_one_is_down(served, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, service, _ = served
    wait = WebDriverWait(browser, SAFETY_S, poll_frequency=0.1)
    wait_for(lambda: all(service.latest(c) for c in ("front", "yard")), SAFETY_S, "detected frames of both cameras")

    browser.get(f"{url}/")  # no key yet: the API answers 401 and the page draws nothing
    assert "missing or invalid API key" in browser.page_source
    browser.get(f"{url}/?key={KEY}")  # the login: a cookie, then the page itself
    assert browser.current_url.rstrip("/") == url
    assert "?key" not in browser.current_url  # the key left the address bar
    assert "tandem_streams_key" not in browser.execute_script("return document.cookie")  # HttpOnly

    cards = wait.until(lambda d: c if len(c := d.find_elements(By.CSS_SELECTOR, ".cam")) == 3 else None)
    assert sorted(c.get_attribute("data-camera") for c in cards) == ["front", "gone", "yard"]

    def card(name):
        return browser.find_element(By.CSS_SELECTOR, f'.cam[data-camera="{name}"]')

    wait.until(lambda _: card("gone").get_attribute("data-state") == "down", "the dead camera shows down")
    gone = card("gone")
    assert "down" in gone.find_element(By.CSS_SELECTOR, ".state").text
    assert "connection refused" in gone.find_element(By.CSS_SELECTOR, ".err").text
    for name in ("front", "yard"):
        wait.until(lambda _, n=name: card(n).get_attribute("data-state") == "up", f"{name} shows live")
        stats = card(name).find_element(By.CSS_SELECTOR, ".stats")
        wait.until(lambda _, s=stats: "fps " in s.text and "latency p50 " in s.text and "- ms" not in s.text)
        # The image updates: two different frames seen in the same <img>, over its one MJPEG view.
        first = wait.until(lambda d, n=name: d.execute_script(_PIXELS, n), f"{name}'s first frame")
        wait.until(lambda d, n=name, f=first: (p := d.execute_script(_PIXELS, n)) and p != f, f"{name} updates")
    browser.save_screenshot(SCREENSHOT)
    digest = hashlib.sha256(open(SCREENSHOT, "rb").read()).hexdigest()[:12]
    print(f"screenshot {SCREENSHOT} ({digest})")


def view_frame(url: str, camera: str) -> np.ndarray:
    """The first JPEG of a camera's MJPEG view, as served, decoded."""
    import cv2

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=SAFETY_S)
    try:
        conn.request("GET", f"/cameras/{camera}/view", headers={"Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.status
        buf = b""
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += resp.read1(65536)
        length = int(
            next(h for h in buf[:end].split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1]
        )
        while len(buf) < end + 4 + length:
            buf += resp.read1(65536)
    finally:
        conn.close()
    return cv2.imdecode(np.frombuffer(buf[end + 4 : end + 4 + length], np.uint8), cv2.IMREAD_COLOR)


def share_near(image: np.ndarray, points, color, tolerance: int = 70) -> float:
    """The share of `points` (x, y pixels) whose colour is within `tolerance` of `color` in every
    channel (JPEG blurs a thin line's colour into its neighbours)."""
    near = [int(np.abs(image[y, x].astype(int) - color).max() <= tolerance) for x, y in points]
    return sum(near) / len(near)


def test_a_camera_with_a_line_and_a_zone_shows_them_with_its_counts_events_and_clips(served, browser):
    import cv2
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, service, records = served
    wait = WebDriverWait(browser, SAFETY_S, poll_frequency=0.1)

    def front():
        return next(r for r in service.cameras() if r["camera"] == "front")

    # Events and a written clip first: the page shows a clip once the camera's last clip reaches it.
    wait_for(lambda: front()["clips"]["last_clip"], SAFETY_S * 2, "a clip of front's events written")

    # The served view: the line (amber) across the middle, the zone's edge (blue) at x = 0.5.
    image = view_frame(url, "front")
    h, w = image.shape[:2]
    y = round(0.5 * h)
    along_line = [(x, y) for x in range(round(0.2 * w), round(0.95 * w), 3) if not 0.4 * w <= x <= 0.62 * w]
    assert share_near(image, along_line, LINE_COLOR) >= 0.8, "the line is drawn along its whole length"
    zone_edge = [(round(0.5 * w), y) for y in range(round(0.15 * h), round(0.4 * h), 3)]
    assert share_near(image, zone_edge, ZONE_COLOR) >= 0.8, "the zone's edge is drawn"
    beside = [(x, y + dy) for x in range(round(0.65 * w), round(0.95 * w), 3) for dy in (-10, 10)]
    assert share_near(image, beside, LINE_COLOR) < 0.2, "a line, not an amber band"  # (the scene: no amber)

    browser.get(f"{url}/?key={KEY}")
    card = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, '.cam[data-camera="front"]'))

    # Read in one script: the page rebuilds these elements as counts and events change.
    read = """const card = arguments[0], attrs = (el) => el && Object.assign({}, el.dataset);
    return {line: attrs(card.querySelector('.count.line[data-line="door"]')),
            zone: attrs(card.querySelector('.count.zone[data-zone="bay"]')),
            events: Array.from(card.querySelectorAll(".events li.event"), (li) => [li.dataset.type, li.dataset.track])};"""

    def seen(page):
        line, zone = page["line"], page["zone"]
        return line and zone and int(line["in"]) + int(line["out"]) + int(zone["entries"]) >= 1 and page["events"]

    page = wait.until(lambda d: (p := d.execute_script(read, card)) and seen(p) and p, "counts and events on the page")
    line = {k: int(page["line"][k]) for k in ("in", "out")}
    zone = {k: int(page["zone"][k]) for k in ("occupancy", "entries", "exits")}
    now = front()["counts"]  # read after the page's: counts only grow, so the page's are at most these
    assert line["in"] <= now["lines"]["door"]["in"] and line["out"] <= now["lines"]["door"]["out"]
    assert zone["entries"] <= now["zones"]["bay"]["entries"] and zone["exits"] <= now["zones"]["bay"]["exits"]
    assert "door: in " in card.find_element(By.CSS_SELECTOR, ".count.line").text

    # The last events, each with what happened, and a link to its clip once the clip is written.
    shown = {tuple(e) for e in page["events"]}

    def happened():
        lines = records.read_text().splitlines()
        return {(e["type"], str(e["track_id"])) for r in map(json.loads, lines) for e in r.get("events") or ()}

    wait_for(lambda: shown <= happened(), SAFETY_S, f"the events shown, {shown}, in the records")
    # Clicked in the page's own thread: the list is rebuilt at each new event, so a link found
    # first and clicked after may be gone by then.
    click = (
        'const a = arguments[0].querySelector(".events li.event a.clip"); if (a) a.click(); return a && a.dataset.clip;'
    )
    name = wait.until(lambda d: d.execute_script(click, card), "an event's clip link")
    clips_dir = service.clips.clips_dir
    assert os.path.isfile(os.path.join(clips_dir, name)), name
    assert card.find_element(By.CSS_SELECTOR, ".player").is_displayed()
    cap = cv2.VideoCapture(os.path.join(clips_dir, name))
    fourcc = int(cap.get(cv2.CAP_PROP_FOURCC)).to_bytes(4, "little").decode("ascii", "replace")
    size = [int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))]
    cap.release()
    if fourcc not in BROWSER_CODECS:
        # OpenCV's mp4v (MPEG-4 Part 2, read back as FMP4), which no browser's <video> decodes: the
        # player says so and replays the clip frame by frame (GET /clips/NAME/play).
        state = wait.until(lambda d: d.execute_script(_PLAYER, card), "the clip replayed")
        assert state["video"] == {"error": 4} and state["size"] == size, state
        assert state["src"].split("?")[0].endswith(f"/clips/{name}/play"), state
        assert "do not decode" in card.find_element(By.CSS_SELECTOR, ".player .why").text
        # It plays on: from the start again (the clip may have ended before the first look), a frame
        # other than the one seen first.
        browser.execute_script('arguments[0].querySelector(".player a.again").click()', card)
        wait.until(lambda d: (p := d.execute_script(_PLAYER, card)) and p["pixels"] != state["pixels"], "it plays on")
    else:  # a codec the browser decodes: the <video> plays it
        state = wait.until(lambda d: (p := d.execute_script(_PLAYER, card)) and "size" in p["video"] and p)
        assert state["video"]["size"] == size, state
    browser.set_window_size(1400, 1400)  # the whole card, its player included
    browser.save_screenshot(ANALYTICS_SCREENSHOT)
    print(f"screenshot {ANALYTICS_SCREENSHOT}; clip {name}: {fourcc} {size}; the player: {state['video']}")


# The card's player: its <video>'s state, and the replay <img>'s source, size and a digest of its pixels.
_PLAYER = """
const player = arguments[0].querySelector(".player"), v = player.querySelector("video"), img = player.querySelector("img");
const video = v.error ? {error: v.error.code} : v.readyState >= 2 ? {size: [v.videoWidth, v.videoHeight]} : null;
if (!video) return null;
if (img.hidden || !img.complete || !img.naturalWidth) return video.size ? {video} : null;
const c = document.createElement("canvas");
c.width = img.naturalWidth; c.height = img.naturalHeight;
const ctx = c.getContext("2d");
ctx.drawImage(img, 0, 0);
const pixels = Array.from(ctx.getImageData(0, 0, c.width, c.height).data.filter((_, i) => i % 97 == 0)).join(",");
return {video, src: img.src, size: [img.naturalWidth, img.naturalHeight], pixels};
"""
