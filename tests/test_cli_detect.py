"""`tandem detect` as a user meets it: `.streams` runs that print as they go and end by
themselves, exit codes with a summary on stderr, a bad --device caught before loading, and
--save run folders that never overwrite."""

from __future__ import annotations

import argparse
import copy
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
    # torch only: "auto" (the default) would time three backends (tests/test_vision_backends.py)
    argv = [str(images / "bus.jpg"), "--conf", "0.0001", "--max-batch-size", "2", "--backend", "torch"]

    def detect(imgsz):
        parser = argparse.ArgumentParser()
        add_detect_arguments(parser)
        code = run_detect(parser.parse_args([*argv, "--imgsz", str(imgsz)]))
        err = capsys.readouterr().err
        return code, err.split("preferred batch sizes ")[1].split("\n")[0]

    first = detect(160)
    assert detect(160) == first and measured == [(160, (1, 2))]  # the second run reused the profile
    assert detect(128)[0] == 0 and measured == [(160, (1, 2)), (128, (1, 2))]  # a new input size: measured


@pytest.mark.parametrize("cuda, expected", [(True, "cuda"), (False, "cpu")])
def test_device_defaults_to_cuda_where_torch_sees_one_as_the_llm_does(capsys, monkeypatch, images, cuda, expected):
    import torch

    from runtime.vision import engine as engine_module

    seen = []

    def spy(config, *args, **kwargs):
        seen.append(config.device)
        raise ValueError("stop here: the device was chosen")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(cuda))
    monkeypatch.setattr(engine_module, "VisionEngine", spy)
    code, _, err = _run(capsys, str(images / "bus.jpg"))
    assert code == 2 and "stop here" in err and seen == [expected]


# ---- --save: annotated videos ----------------------------------------------------------


@pytest.mark.parametrize("vid_stride, fps", [(1, 10.0), (2, 5.0)])
def test_annotated_video_plays_at_the_source_fps(capsys, tmp_path, vid_stride, fps):
    clip = _clip(tmp_path / "clip.mp4", 6, 10)
    save = tmp_path / "out"
    code, lines, _ = _run(capsys, str(clip), "--save", str(save), "--vid-stride", str(vid_stride))
    assert code == 0 and len(lines) == 6 // vid_stride
    cap = cv2.VideoCapture(str(save / "clip.mp4"))
    try:
        written_fps, num_frames = cap.get(cv2.CAP_PROP_FPS), int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
    finally:
        cap.release()
    assert (written_fps, num_frames) == (fps, 6 // vid_stride)


# ---- --classes and --nms on the shipped detector ---------------------------------------


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """Generated shapes images (runtime/vision/synthetic.py), which the shipped detector knows."""
    from runtime.vision.synthetic import draw_image

    out = tmp_path_factory.mktemp("shapes")
    rng = np.random.default_rng(7)
    for i in range(8):
        cv2.imwrite(str(out / f"{i}.png"), draw_image(rng, 320)[0])
    return out


# The lines of each argv _shipped ran: a float32 run with no profile on the same files gives
# the same lines, and three tests below ask for the plain run, two for the --nms one (each run
# loads and traces the detector again: about 0.7 s on two cores).
_SHIPPED_RUNS: dict[tuple[str, ...], list[dict]] = {}


def _shipped(capsys, *argv):
    """The shipped detector at its own size and the default conf (not FAST's)."""
    if argv not in _SHIPPED_RUNS:
        parser = argparse.ArgumentParser()
        add_detect_arguments(parser)
        code = run_detect(parser.parse_args([*argv, "--no-profile", "--dtype", "float32"]))
        out, _ = capsys.readouterr()
        assert code == 0
        _SHIPPED_RUNS[argv] = [json.loads(line) for line in out.splitlines()]
    return copy.deepcopy(_SHIPPED_RUNS[argv])


def _kept(lines, classes):
    return [[(c, b) for c, b in zip(x["cls"], x["boxes"]) if c in classes] for x in lines]


@pytest.mark.parametrize("head", [[], ["--nms"]], ids=["end2end", "nms"])
def test_classes_keeps_only_those_classes_and_leaves_their_boxes_as_they_were(capsys, shapes, head):
    every = _shipped(capsys, str(shapes), *head)
    only = _shipped(capsys, str(shapes), *head, "--classes", "0,2")
    assert {c for x in every for c in x["cls"]} == {0, 1, 2}  # the filter has something to drop
    assert {c for x in only for c in x["cls"]} <= {0, 2}
    assert _kept(only, {0, 2}) == _kept(every, {0, 2})


@pytest.mark.parametrize("value", ["a,b", "0,-1", ""])
def test_bad_classes_is_a_usage_error_naming_the_flag(capsys, value):
    parser = argparse.ArgumentParser()
    add_detect_arguments(parser)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["x.jpg", "--classes", value])
    assert exc.value.code == 2 and "--classes" in capsys.readouterr().err


def test_backend_reaches_the_runner_and_keeps_the_boxes(capsys, shapes, tmp_path, monkeypatch):
    """--backend is not accepted and ignored: onnxruntime runs the export (the summary names
    it) and gives torch float32's boxes."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    torch_lines = _shipped(capsys, str(shapes))
    ort_lines = _shipped(capsys, str(shapes), "--backend", "onnxruntime")
    assert list((tmp_path / "cache").rglob("*.onnx")), "an ONNX export was made and run"
    assert [x["cls"] for x in ort_lines] == [x["cls"] for x in torch_lines]
    for a, b in zip(ort_lines, torch_lines):
        assert np.allclose(np.array(a["boxes"]), np.array(b["boxes"]), atol=0.5)


def test_the_default_backend_is_auto_and_the_start_up_line_says_what_ran_and_why(capsys, images):
    """No --backend: "auto"; with --no-profile there are no rates to choose by, so torch runs,
    and the start-up line says so (tests/test_vision_backends.py: the choice with a profile)."""
    parser = argparse.ArgumentParser()
    add_detect_arguments(parser)
    assert parser.parse_args(["x.jpg"]).backend == "auto"
    code, lines, err = _run(capsys, str(images / "bus.jpg"))
    assert code == 0 and len(lines) == 1
    line = next(x for x in err.splitlines() if x.startswith("tandem detect: vision backend "))
    assert line.startswith("tandem detect: vision backend torch (auto without the start-up profile")
    assert "exports 0.0 s, profile 0.0 s" in line


def test_bad_backend_is_a_usage_error_naming_the_flag(capsys, shapes):
    code, _, err = _run(capsys, str(shapes), "--backend", "tensorflow")
    assert code == 2 and "backend must be one of" in err


def _duplicates(lines, iou):
    """(image, box, box) triples of same-class boxes overlapping more than iou."""
    from runtime.vision.evaluate import box_iou

    found = []
    for n, x in enumerate(lines):
        boxes, cls = np.array(x["boxes"]).reshape(-1, 4), np.array(x["cls"])
        overlap = np.triu(box_iou(boxes, boxes), 1) * (cls[:, None] == cls[None, :])
        found += [(n, i, j) for i, j in zip(*np.nonzero(overlap > iou))]
    return found


def test_nms_flag_removes_the_end2end_heads_duplicate_boxes_and_honours_iou(capsys, shapes):
    assert _duplicates(_shipped(capsys, str(shapes)), 0.7), "the end-to-end head's duplicates are gone: update --nms"
    assert not _duplicates(_shipped(capsys, str(shapes), "--nms"), 0.7)
    assert not _duplicates(_shipped(capsys, str(shapes), "--nms", "--iou", "0.3"), 0.3)


# ---- --track ---------------------------------------------------------------------------


def _moving_circles(path, n=20, fps=10):
    """Two circles on a noisy background, one along the top going right, one along the
    bottom going left; from frame n // 2 on a third one stands in the middle."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (320, 320))
    for t in range(n):
        img = np.clip(np.array([90, 110, 100]) + np.random.default_rng(t).normal(0, 18, (320, 320, 3)), 0, 255)
        img = img.astype(np.uint8)
        cv2.circle(img, (40 + 6 * t, 80), 24, (30, 30, 230), -1, cv2.LINE_AA)
        cv2.circle(img, (280 - 6 * t, 240), 24, (230, 200, 30), -1, cv2.LINE_AA)
        if t >= n // 2:
            cv2.circle(img, (160, 160), 24, (40, 220, 40), -1, cv2.LINE_AA)
        writer.write(img)
    writer.release()
    return path


def test_track_gives_each_object_of_a_video_one_id_and_still_images_none(capsys, tmp_path):
    clip = _moving_circles(tmp_path / "clip.mp4")
    shutil.copy(ASSETS / "bus.jpg", tmp_path / "bus.jpg")
    lines = _shipped(capsys, str(tmp_path), "--nms", "--track", "bytetrack")
    still = [x for x in lines if x["source"].endswith("bus.jpg")]
    video = [x for x in lines if x["source"] == str(clip)]
    assert len(still) == 1 and still[0]["track_ids"] is None and len(video) == 20
    rows = {"top": [], "middle": [], "bottom": []}  # per frame, the ids of that row's circle
    for x in video:
        assert len(x["track_ids"]) == len(x["boxes"])
        seen = {}
        for (_, y1, _, y2), track_id, conf in zip(x["boxes"], x["track_ids"], x["conf"]):
            if conf > 0.5:  # the circles, not a weak stray box
                cy = (y1 + y2) / 2
                seen["top" if cy < 120 else "bottom" if cy > 200 else "middle"] = track_id
        for row, ids in rows.items():
            ids.append(seen.get(row, "missing"))
    # First-frame ids go in the boxes' (confidence) order, so which circle is 1 is not fixed.
    assert len(set(rows["top"])) == len(set(rows["bottom"])) == 1, rows
    assert {rows["top"][0], rows["bottom"][0]} == {1, 2}, rows
    # The tracker lives on between frames: a newcomer waits a frame for confirmation, then is 3.
    assert rows["middle"] == ["missing"] * 10 + [None] + [3] * 9, rows
