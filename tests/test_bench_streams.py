"""`tandem bench streams --tiny`: the cameras-per-machine bench end to end, in seconds.

The Tandem side always runs (the shipped detector on a CPU Runtime, loopback cameras in a
process of their own); the Ultralytics peer runs when its side environment exists, and the
report says why it did not otherwise."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import cli
from benchmarks.streams import LOOP_FRAMES, PEER_PYTHON, score

ROW_FIELDS = {
    "cameras",
    "frames_sent",
    "results",
    "drop_fraction",
    "latency_ms_p50",
    "latency_ms_p99",
    "results_per_s",
    "boxes_per_result",
    "passed",
}


def test_score_matches_each_result_to_the_newest_frame_with_its_stamp():
    # frame 0 and frame LOOP_FRAMES share stamp 0: a result arriving after both is of the later one
    sends = {0: [(10.0, 0), (10.2, 1), (20.0, LOOP_FRAMES)]}
    results = [(0, 0, 10.05, 3), (0, 0, 20.1, 3)]
    row = score(sends, results, 9.0, 21.0)
    assert row["frames_sent"] == 3 and row["results"] == 2
    assert row["drop_fraction"] == round(1 - 2 / 3, 4), "frame 1 never got a result"
    assert row["latency_ms_p50"] == 75.0 and row["latency_ms_p99"] <= 100.0


def test_tiny_bench_reports_both_sides_and_plots(tmp_path, capsys):
    # The bench in this process (its cameras keep their own): a second Python importing torch
    # and the Runtime only to run it cost more than its measured windows.
    out = tmp_path / "streams"
    assert cli.main(["streams", "--tiny", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "flags:" in stdout and "largest N" in stdout
    report = json.loads((out / "streams.json").read_text())
    assert report["cpu"]["flags"] and report["cpu"]["cores"] >= 1
    assert report["config"]["cameras"] == [1, 2] and report["config"]["bound_ms"] == 250.0
    tandem = report["tandem"]
    assert [r["cameras"] for r in tandem["rows"]][:1] == [1]
    for row in tandem["rows"]:
        assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
        assert row["frames_sent"] > 0 and row["results"] > 0, "Tandem must run, not skip"
        assert row["boxes_per_result"] >= 1, "the detector finds the scene's shapes"
        assert row["latency_ms_p99"] >= row["latency_ms_p50"] > 0
    assert tandem["max_cameras"] >= 1, "one 5 fps camera fits within 250 ms anywhere"
    peer = report["peer"]
    if Path(PEER_PYTHON).exists():
        assert peer["rows"] and ROW_FIELDS <= set(peer["rows"][0])
        assert peer["rows"][0]["results"] > 0
        assert report["ratio"] == round(tandem["max_cameras"] / peer["max_cameras"], 3)
    else:
        assert "no side environment" in peer["skipped"] and report["ratio"] is None
    assert (out / "streams.png").stat().st_size > 1000


def test_analytics_gives_every_camera_a_line_a_zone_and_clips(tmp_path):
    # One camera, a short window: what --analytics turns on is seen to work (events in the
    # records, clips on disk that OpenCV reads back); the cost is the lead's full run to measure.
    import argparse

    import cv2

    from benchmarks.streams import run_tandem
    from runtime.runtime import Runtime
    from runtime.vision.detector import WEIGHTS

    args = argparse.Namespace(fps=5.0, warmup_s=0.5, duration_s=2.0, bound_ms=250.0, analytics="clips")
    with Runtime(vision={"model": str(WEIGHTS), "imgsz": 320, "device": "cpu"}) as runtime:
        row = run_tandem(runtime, 1, args, tmp_path)
    assert row["results"] > 0, "Tandem must run, not skip"
    assert row["events"] >= 1, "the scene's shapes cross the line or enter the zone"
    assert row["clips"] >= 1 and row["clip_bytes"] > 0, row
    clip = next((tmp_path / "clips_1").glob("*.mp4"))
    cap = cv2.VideoCapture(str(clip))
    ok, image = cap.read()
    cap.release()
    assert ok and image.shape[:2] == (240, 320), "a clip of the camera's frames"
