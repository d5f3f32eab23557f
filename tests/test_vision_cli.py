"""`tandem detect` through run_detect: JSON lines for every source kind, --save, bad sources."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import cv2
import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ultralytics.utils import ASSETS

from runtime.vision.cli import add_detect_arguments, run_detect
from sources.loopback import MjpegServer, dead_url


def _run(capsys, *argv):
    parser = argparse.ArgumentParser()
    add_detect_arguments(parser)
    args = parser.parse_args([*argv, "--imgsz", "160", "--conf", "0.0001", "--no-profile"])
    code = run_detect(args)
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


@pytest.fixture()
def folder(tmp_path):
    for name in ("bus.jpg", "zidane.jpg"):
        shutil.copy(ASSETS / name, tmp_path / name)
    (tmp_path / "broken.png").write_bytes(b"not a png")
    writer = cv2.VideoWriter(str(tmp_path / "clip.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 10, (96, 64))
    for i in range(5):
        writer.write(np.full((64, 96, 3), 40 * i, np.uint8))
    writer.release()
    return tmp_path


def test_directory_with_video_and_a_broken_file(capsys, folder, tmp_path_factory):
    save = tmp_path_factory.mktemp("save")
    code, lines, err = _run(capsys, str(folder), "--vid-stride", "2", "--save", str(save), "--model", "yolo26n.yaml")
    assert code == 3 and "RANDOM weights" in err
    assert [(os.path.basename(x["source"]), x["frame"]) for x in lines] == [
        ("broken.png", 0),
        ("bus.jpg", 0),
        ("clip.mp4", 0),
        ("clip.mp4", 2),
        ("clip.mp4", 4),
        ("zidane.jpg", 0),
    ]
    assert "cannot decode" in lines[0]["error"] and lines[0]["boxes"] == []
    for x in lines[1:]:
        assert x["error"] is None and len(x["boxes"]) == len(x["conf"]) == len(x["cls"]) == len(x["names"]) > 0
        assert all(len(b) == 4 for b in x["boxes"])
    assert sorted(os.listdir(save)) == ["bus.jpg", "clip.mp4", "zidane.jpg"]
    assert cv2.imread(str(save / "bus.jpg")).shape == cv2.imread(str(folder / "bus.jpg")).shape


def test_batching_flags_reach_the_engine(capsys, folder, monkeypatch):
    from runtime.vision import engine as engine_module

    seen = []

    class Spy(engine_module.VisionEngine):
        def __init__(self, config, *args, **kwargs):
            seen.append(config.batching)
            super().__init__(config, *args, **kwargs)

    monkeypatch.setattr(engine_module, "VisionEngine", Spy)
    code, lines, _ = _run(capsys, str(folder / "bus.jpg"), "--max-batch-size", "3", "--max-queue-delay-ms", "7.5")
    assert code == 0 and len(lines) == 1
    assert (seen[0].max_batch_size, seen[0].max_queue_delay_ms, seen[0].priority_levels) == (3, 7.5, 2)


def test_glob_txt_list_and_single_image(capsys, folder):
    (folder / "list.txt").write_text("bus.jpg\nmissing.jpg\n")
    code, lines, _ = _run(capsys, str(folder / "list.txt"))
    assert code == 3 and lines[0]["error"] is None and "line 2" in lines[1]["error"]
    code, lines, _ = _run(capsys, str(folder / "*.jpg"), "--max-frames", "1")
    assert code == 0 and len(lines) == 1
    code, lines, _ = _run(capsys, str(folder / "broken.png"))
    assert code == 1 and lines[0]["error"]  # every input failed


def test_streams_with_a_dead_one_and_max_frames(capsys, tmp_path):
    with MjpegServer(fps=20) as a, MjpegServer(fps=20) as b:
        f = tmp_path / "cams.streams"
        f.write_text(f"{a.url}\n{dead_url()}\n{b.url}\n")
        code, lines, _ = _run(capsys, str(f), "--max-frames", "12")
    assert code == 3 and len(lines) == 12
    errors = [x for x in lines if x["error"]]
    assert len(errors) == 1 and "refused" in errors[0]["error"].lower()
    assert {x["source"] for x in lines if not x["error"]} == {a.url, b.url}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["/no/such/dir"], "source not found"),
        (["bus.jpg", "--imgsz", "100"], "multiple of 32"),
        (["bus.jpg", "--max-batch-size", "0"], "max_batch_size must be an integer >= 1"),
        (["bus.jpg", "--max-queue-delay-ms", "-1"], "max_queue_delay_ms must be a number >= 0"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_error(capsys, argv, message):
    parser = argparse.ArgumentParser()
    add_detect_arguments(parser)
    assert run_detect(parser.parse_args(argv)) == 2
    assert message in capsys.readouterr().err


def test_max_image_pixels_refuses_a_larger_image_naming_the_limit_and_keeps_the_others(capsys, folder, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    cv2.imwrite(str(small / "a_small.png"), np.zeros((16, 16, 3), np.uint8))  # 256 px: under the limit
    shutil.copy(folder / "bus.jpg", small / "bus.jpg")  # 810 x 1080: over it
    code, lines, _ = _run(capsys, str(small), "--max-image-pixels", "10000", "--model", "yolo26n.yaml")
    by_name = {os.path.basename(line["source"]): line for line in lines}
    assert code == 3 and by_name["a_small.png"]["error"] is None
    assert "810x1080" in by_name["bus.jpg"]["error"] and "max_image_pixels" in by_name["bus.jpg"]["error"]


def test_the_worker_takes_max_image_pixels_into_its_vision_config():
    from workers.worker import add_worker_arguments, worker_plan

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    runtime, _, _ = worker_plan(parser.parse_args(["--queues", "vision", "--max-image-pixels", "4096"]))
    assert runtime["vision"]["max_image_pixels"] == 4096
    with pytest.raises(ValueError, match="--max-image-pixels"):
        worker_plan(parser.parse_args(["--queues", "vision", "--max-image-pixels", "0"]))
