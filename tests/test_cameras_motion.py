"""Motion gating (runtime/vision/motion.py, workers/cameras.py): a camera with `motion_threshold`
runs the detector only on frames that changed since the last detected one, and re-publishes
the last detections for the others, marked carried over. Off by default.

The scene is generated and still most of the time: a fixed noisy background for 40 frames,
then 10 frames of shapes moving over it, looped. A real Runtime with the test detector and
loopback MJPEG cameras; every wait is on records arriving with a deadline.
"""

from __future__ import annotations

import numpy as np
import pytest
from camera_helpers import FAST, POLICY, VISION, Lines, frames_of

from runtime.vision.motion import MotionGate
from sources.loopback import MjpegServer
from sources.scene import moving_scene
from workers.cameras import CameraService

STILL, MOVING = 40, 10


def mostly_still_scene() -> list[np.ndarray]:
    moving = moving_scene(MOVING + 1, seed=5)
    return [moving[0]] * STILL + moving[1:]  # the first moving frame is the still one


def test_the_gate_passes_motion_and_stops_a_still_or_noisy_frame():
    scene = moving_scene(12, seed=5)
    gate = MotionGate(0.01)
    assert gate.changed(scene[0])  # the first frame always goes
    assert not gate.changed(scene[0].copy())
    noise = np.random.default_rng(0).integers(-3, 4, scene[0].shape)
    assert not gate.changed(np.clip(scene[0] + noise, 0, 255).astype(np.uint8))  # sensor noise, JPEG
    assert gate.changed(scene[10])  # shapes moved
    assert not gate.changed(scene[10])
    # Against the last frame let through, not the previous one: small steps add up.
    steps = [gate.changed(frame) for frame in scene[10:12]]
    assert gate.num_changed >= 2 and len(steps) == 2


def test_the_gate_refuses_a_bad_threshold():
    for bad in (0, -0.1, 1.5, "0.1", True):
        with pytest.raises(ValueError, match="threshold"):
            MotionGate(bad)


def test_a_gated_camera_skips_the_detector_on_a_mostly_still_scene(capsys):
    from runtime.runtime import Runtime

    lines = Lines()
    with (
        Runtime(vision=VISION, profile=False) as runtime,
        MjpegServer(mostly_still_scene(), fps=30) as server,
    ):
        service = CameraService(runtime, None, jsonl=lines, stream_config=FAST, url_policy=POLICY)
        try:
            service.add("gated", server.url, motion_threshold=0.01)
            service.add("plain", server.url)
            n = 2 * (STILL + MOVING)
            records = lines.wait(lambda rs: min(len(frames_of(rs, "gated")), len(frames_of(rs, "plain"))) >= n)
            rows = {row["camera"]: row for row in service.cameras()}
            latest = service.latest("gated")
            assert service.latest("nobody") is None
        finally:
            service.close()

    gated, plain = frames_of(records, "gated"), frames_of(records, "plain")
    carried = [r for r in gated if r["carried_over"]]
    # Off by default: the plain camera's every frame went to the detector.
    assert not any(r["carried_over"] for r in plain) and rows["plain"]["carried_over"] == 0
    assert rows["plain"]["motion_threshold"] is None and rows["gated"]["motion_threshold"] == 0.01
    # The scene is still 40 frames in 50: most of the gated camera's frames skip the detector.
    share = len(carried) / len(gated)
    with capsys.disabled():
        print(f"\nmotion gate: {len(carried)} of {len(gated)} frames carried over ({share:.0%} detector work saved)")
    assert share >= 0.5, share
    assert rows["gated"]["carried_over"] >= len(carried) and rows["gated"]["frames"] < rows["gated"]["carried_over"]
    # A carried-over record repeats the last detected frame's detections, has no batch, and the
    # moving frames are detected again.
    last = None
    for r in gated:
        if r["carried_over"]:
            assert last is not None and r["boxes"] == last["boxes"] and r["cls"] == last["cls"]
            assert r["batch_size"] is None
        else:
            last = r
    assert len(gated) - len(carried) >= 2
    # latest() serves the views the newest frame with its record.
    image, record = latest
    assert image.ndim == 3 and record["camera"] == "gated"
