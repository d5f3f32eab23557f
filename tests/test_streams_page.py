"""The camera page of `tandem streams` in a real headless Chromium: the page loads behind the API
key (given once as /?key=, kept as an HttpOnly cookie), each live camera's annotated MJPEG view
updates, and a dead camera shows as down.

The app is the real one (create_app behind uvicorn on a free port) on a real Runtime with the
shipped detector, fed by loopback MJPEG cameras. Every wait is WebDriverWait on a condition.
A screenshot goes to /tmp/streams_page.png.
"""

from __future__ import annotations

import hashlib
import os

import pytest
from test_jobs_support import wait_for

from server.streams_app import ControlServer, create_app
from sources.loopback import MjpegServer, dead_url, synthetic_frames
from sources.stream_reader import StreamConfig
from workers.cameras import CameraService, camera_policy
from workers.cameras_security import Security

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SAFETY_S = 60
KEY = "page-test-key"
SCREENSHOT = "/tmp/streams_page.png"
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
    cams = [MjpegServer(synthetic_frames(15, seed=s), fps=15, live=True) for s in (1, 2)]
    jsonl = open(tmp_path_factory.mktemp("page") / "records.jsonl", "a")
    with Runtime(vision=vision, profile=False) as runtime:
        policy = camera_policy(allowed_networks=("127.0.0.1/32",))
        service = CameraService(runtime, None, jsonl=jsonl, max_fps=8, stream_config=FAST, url_policy=policy)
        service.add("front", cams[0].url)
        service.add("yard", cams[1].url)
        service.add("gone", dead_url())
        server = ControlServer("127.0.0.1", 0)
        server.start(create_app(service, Security((KEY,), "127.0.0.1"), server.stop))
        try:
            yield server.url, service
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

    url, service = served
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
