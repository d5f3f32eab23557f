"""Parity with Ultralytics' predict on the same weights and images, and batched == single.

A freshly built model has degenerate outputs (every score ~1e-4, all alike), which would make
any comparison vacuous. So the shared model is calibrated (runtime.vision.calibrate): BatchNorm
statistics from the test images, class logits rescaled to a spread, which gives hundreds of
distinct boxes and scores per image to compare, with no weights downloaded.
"""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from conftest import VISION_IMGSZ, calibrated_yolo
from ultralytics import YOLO
from ultralytics.utils import ASSETS

from runtime.vision.config import VisionConfig
from runtime.vision.runner import YoloRunner

IMGSZ = VISION_IMGSZ
CONF = 0.05
PATHS = [str(ASSETS / "bus.jpg"), str(ASSETS / "zidane.jpg")]


@pytest.fixture(scope="module")
def yolo():
    return calibrated_yolo()


def _compare(ours, ref):
    b = ref.boxes
    assert len(ours) == len(b) > 20, (len(ours), len(b))
    order_ours, order_ref = np.argsort(-ours.conf, kind="stable"), np.argsort(-b.conf.numpy(), kind="stable")
    assert np.abs(ours.conf[order_ours] - b.conf.numpy()[order_ref]).max() <= 1e-4
    assert np.array_equal(ours.cls[order_ours], b.cls.numpy()[order_ref].astype(np.int64))
    assert np.abs(ours.boxes[order_ours] - b.xyxy.numpy()[order_ref]).max() <= 1e-3
    assert ours.names == [ref.names[int(c)] for c in ours.cls]


@pytest.mark.parametrize("end2end", [True, False])
def test_detections_match_ultralytics_predict(yolo, end2end):
    """end2end=True is predict(nms=False) (YOLO26's NMS-free head); False is predict()'s
    default one-to-many head with NMS."""
    runner = YoloRunner(VisionConfig(dtype="float32", imgsz=IMGSZ, conf=CONF, end2end=end2end), module=yolo.model)
    assert runner.model.end2end is end2end
    assert runner.model.graph is not None  # the default CPU path, the traced TorchScript graph
    images = [cv2.imread(p) for p in PATHS]
    for image, path in zip(images, PATHS):
        (ref,) = yolo.predict(path, imgsz=IMGSZ, conf=CONF, verbose=False, nms=None if not end2end else False)
        (ours,) = runner.predict([image])
        assert ours.orig_shape == ref.orig_shape
        _compare(ours, ref)


def test_raw_head_outputs_match(yolo):
    runner = YoloRunner(
        VisionConfig(dtype="float32", imgsz=IMGSZ, end2end=False, channels_last=True), module=yolo.model
    )
    (ref,) = yolo.predict(PATHS[0], imgsz=IMGSZ, verbose=False)  # sets up predictor.model (fused copy)
    image = cv2.imread(PATHS[0])
    x = yolo.predictor.preprocess([image])
    with torch.inference_mode():
        expected = yolo.predictor.model(x)
    expected = expected[0] if isinstance(expected, (list, tuple)) else expected
    (ours,) = runner.raw([image])
    assert ours.shape == expected[0].shape
    assert torch.allclose(ours, expected[0], atol=1e-3, rtol=1e-4)


def test_batched_results_equal_one_at_a_time(yolo):
    runner = YoloRunner(VisionConfig(dtype="float32", imgsz=IMGSZ, conf=CONF), module=yolo.model)
    bus, zidane = (cv2.imread(p) for p in PATHS)
    images = [bus, zidane, cv2.flip(bus, 1), zidane[:, ::-1].copy()]  # two shapes, two of each
    batched = runner.predict(images)
    assert [d.batch_size for d in batched] == [4] * 4
    for image, d in zip(images, batched):
        (single,) = runner.predict([image])
        assert len(d) == len(single) > 20
        # oneDNN picks its convolution algorithm per batch size, so float32 sums differ in the
        # last bits (a few 1e-3 px at the 320 px input, x3.4 back in bus.jpg's pixels) and
        # near-tied scores may swap places: match each detection to its counterpart.
        tol = 3e-5 * max(d.orig_shape)
        box_err = np.abs(d.boxes[:, None, :] - single.boxes[None, :, :]).max(-1)
        same = (box_err <= tol) & (np.abs(d.conf[:, None] - single.conf[None, :]) <= 1e-4)
        same &= d.cls[:, None] == single.cls[None, :]
        assert same.any(1).all() and same.any(0).all()
        assert set(d.timings) == {"preprocess", "inference", "postprocess"}


def test_the_caller_module_is_not_modified(yolo):
    before = sum(1 for _ in yolo.model.modules())
    YoloRunner(VisionConfig(dtype="float32", imgsz=IMGSZ, jit=False), module=yolo.model)  # tracing is tested elsewhere
    assert sum(1 for _ in yolo.model.modules()) == before  # fusion happened on our copy


def test_pt_checkpoint_and_yaml_build(tmp_path, yolo):
    path = tmp_path / "calibrated.pt"
    yolo.save(str(path))
    runner = YoloRunner(VisionConfig(model=str(path), dtype="float32", imgsz=IMGSZ, conf=CONF))
    # Ultralytics saves checkpoints in float16, so the reference loads the same file.
    (ref,) = YOLO(str(path)).predict(PATHS[1], imgsz=IMGSZ, conf=CONF, verbose=False, nms=False)
    (ours,) = runner.predict([cv2.imread(PATHS[1])])
    _compare(ours, ref)
    assert not runner.model.random_weights
    fresh = YoloRunner(VisionConfig(dtype="float32", imgsz=160))
    assert fresh.model.random_weights and "RANDOM weights" in fresh.description
    with pytest.raises(FileNotFoundError, match="never downloads"):
        YoloRunner(VisionConfig(model=str(tmp_path / "missing.pt")))
