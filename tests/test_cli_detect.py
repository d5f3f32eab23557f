"""`tandem detect` as a user meets it: `.streams` runs that print as they go and end by
themselves, exit codes with a summary on stderr, a bad --device caught before loading, and
--save run folders that never overwrite."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import cv2
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ultralytics.utils import ASSETS

from runtime.vision.cli import add_detect_arguments, run_detect
from sources.loopback import MjpegServer, dead_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--imgsz", "160", "--conf", "0.0001", "--no-profile"]


def _run(capsys, *argv):
    parser = argparse.ArgumentParser()
    add_detect_arguments(parser)
    code = run_detect(parser.parse_args([*argv, *FAST]))
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def _clip(path, n, fps):
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (96, 64))
    for i in range(n):
        writer.write(np.full((64, 96, 3), 8 * i, np.uint8))
    writer.release()
    return path


# ---- .streams ---------------------------------------------------------------------------


def test_lines_are_printed_as_frames_are_done_not_held_back(tmp_path):
    # A slow camera: the old CLI printed nothing until 4 x max_batch_size (32) frames waited.
    with MjpegServer(fps=4) as cam:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem", "detect", cam.url, *FAST],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            first = json.loads(proc.stdout.readline())  # blocks until the first line is printed
            sent = cam.frames_sent
            assert proc.poll() is None  # the run is still going: the line was not flushed at exit
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert first["source"] == cam.url and first["error"] is None
    assert sent < 8, f"the first line came only after the camera had sent {sent} frames"


def test_dead_source_is_reported_at_once_and_max_frames_ends_the_run(capsys, tmp_path):
    with MjpegServer(fps=20) as live:
        f = tmp_path / "cams.streams"
        f.write_text(f"{dead_url()}\n{live.url}\n")
        code, lines, err = _run(capsys, str(f), "--max-frames", "10")
    assert len(lines) == 10  # the run ends by itself after 10 lines
    errors = [i for i, x in enumerate(lines) if x["error"]]
    assert len(errors) == 1 and "refused" in lines[errors[0]]["error"].lower()
    assert errors[0] < 3  # reported as it happened, not after the live stream's frames
    assert {x["source"] for x in lines if not x["error"]} == {live.url}
    assert code == 3 and "10 frames, 9 ok, 1 failed" in err  # some inputs failed


def test_every_source_dead_ends_the_run_with_exit_1(capsys, tmp_path):
    f = tmp_path / "cams.streams"
    urls = [dead_url(), dead_url()]
    f.write_text("\n".join(urls) + "\n")
    code, lines, err = _run(capsys, str(f), "--stream-retries", "1")
    assert code == 1 and "0 ok" in err
    assert {x["source"] for x in lines} == set(urls) and all(x["error"] for x in lines)
    # Down once, gave up once: two lines per stream, then the run is over.
    assert len(lines) == 4 and sum("gave up after 1 retries" in x["error"] for x in lines) == 2


def test_a_local_clip_in_a_streams_file_gives_every_frame(capsys, tmp_path):
    # Readers start when the model is ready and a local clip plays at its own fps, so with
    # the default newest-frame-only buffer no frame is lost (before: only frame 29 came out).
    _clip(tmp_path / "clip.mp4", n=20, fps=10)
    (tmp_path / "s.streams").write_text("clip.mp4\n")
    code, lines, err = _run(capsys, str(tmp_path / "s.streams"))
    assert code == 0 and [x["frame"] for x in lines] == list(range(20))


def test_stream_retries_is_checked(capsys):
    code, _, err = _run(capsys, "x.streams", "--stream-retries", "-2")
    assert code == 2 and "--stream-retries must be >= 0" in err


# ---- exit codes ------------------------------------------------------------------------


@pytest.fixture()
def images(tmp_path):
    shutil.copy(ASSETS / "bus.jpg", tmp_path / "bus.jpg")
    shutil.copy(ASSETS / "zidane.jpg", tmp_path / "zidane.jpg")
    return tmp_path


def test_exit_0_when_every_input_succeeds(capsys, images):
    code, lines, err = _run(capsys, str(images))
    assert code == 0 and len(lines) == 2 and "2 frames, 2 ok, 0 failed" in err


def test_exit_3_when_some_inputs_fail(capsys, images):
    (images / "broken.png").write_bytes(b"not a png")
    code, lines, err = _run(capsys, str(images))
    assert code == 3 and "3 frames, 2 ok, 1 failed" in err
    (images / "list.txt").write_text("bus.jpg\nmissing.jpg\n")
    code, lines, err = _run(capsys, str(images / "list.txt"))
    assert code == 3 and "2 frames, 1 ok, 1 failed" in err and "line 2" in lines[1]["error"]


def test_exit_1_when_every_input_fails(capsys, tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    code, lines, err = _run(capsys, str(tmp_path / "broken.png"))
    assert code == 1 and lines[0]["error"] and "1 frames, 0 ok, 1 failed" in err


# ---- --device --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device, message",
    [
        ("gpu", "--device must be cpu, cuda, cuda:N or mps, got 'gpu'"),
        ("cuda:99", "--device cuda:99"),
    ],
)
def test_bad_device_is_one_line_before_anything_loads(capsys, monkeypatch, images, device, message):
    from runtime.vision import engine as engine_module

    def refuse(*args, **kwargs):
        raise AssertionError("the engine must not be built for a bad --device")

    monkeypatch.setattr(engine_module, "VisionEngine", refuse)
    code, lines, err = _run(capsys, str(images / "bus.jpg"), "--device", device)
    assert code == 2 and lines == []
    assert len(err.strip().splitlines()) == 1 and message in err and "this machine has: cpu" in err


# ---- --save ----------------------------------------------------------------------------


def test_save_numbers_run_folders_and_keeps_same_names_apart(capsys, images, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    shutil.copy(ASSETS / "bus.jpg", other / "bus.jpg")
    (images / "list.txt").write_text(f"bus.jpg\n{other / 'bus.jpg'}\n")
    save = tmp_path_factory.mktemp("runs") / "predict"
    code, _, err = _run(capsys, str(images / "list.txt"), "--save", str(save))
    assert code == 0 and sorted(os.listdir(save)) == ["bus.jpg", "bus_2.jpg"]
    code, _, err = _run(capsys, str(images / "zidane.jpg"), "--save", str(save))
    assert code == 0 and f"annotated output in {save}2" in err
    assert sorted(os.listdir(save)) == ["bus.jpg", "bus_2.jpg"] and os.listdir(f"{save}2") == ["zidane.jpg"]


# ---- start-up profile cache -------------------------------------------------------------


def test_start_up_profile_is_cached_per_model_and_input_size(capsys, monkeypatch, images, tmp_path):
    from runtime.vision.runner import YoloRunner

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    measured = []
    real = YoloRunner.profile

    def counted(self, sizes, iters=None):
        measured.append((self.config.imgsz, tuple(sizes)))
        return real(self, sizes, iters)

    monkeypatch.setattr(YoloRunner, "profile", counted)
    argv = [str(images / "bus.jpg"), "--conf", "0.0001", "--max-batch-size", "2"]

    def detect(imgsz):
        parser = argparse.ArgumentParser()
        add_detect_arguments(parser)
        code = run_detect(parser.parse_args([*argv, "--imgsz", str(imgsz)]))
        err = capsys.readouterr().err
        return code, err.split("preferred batch sizes ")[1].split("\n")[0]

    first = detect(160)
    assert detect(160) == first and measured == [(160, (1, 2))]  # the second run reused the profile
    assert detect(128)[0] == 0 and measured == [(160, (1, 2)), (128, (1, 2))]  # a new input size: measured
