"""mAP of plain-data predictions (runtime/vision/evaluate.py) on a generated labeled split.

Predictions built from the labels themselves must score Ultralytics' ceiling, moved boxes and
swapped classes must score lower, the JSON format must round-trip, and the matching rule must
agree with Ultralytics' own validator. One test runs the VisionEngine over the split end to
end (random weights: it checks the plumbing, not the accuracy).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from runtime.vision import evaluate as ev
from runtime.vision.synthetic import CLASSES, write_test_set

# Ultralytics' AP interpolates precision at 101 recall points between sentinels at recall 0 and
# 1, so a perfect detector scores 0.995, not 1.0: the number its own validator prints for one.
PERFECT = 0.995


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("shapes-test")
    write_test_set(out, 24, 160)
    return str(out)


@pytest.fixture(scope="module")
def labels(split):
    return ev.load_labels(split)


def from_labels(labels, shift=0.0, cls_map=None, conf=0.9):
    out = {}
    for key, (cls, boxes) in labels.items():
        c = np.array([cls_map.get(int(v), int(v)) for v in cls]) if cls_map else cls
        out[key] = {"boxes": boxes + shift, "conf": np.full(len(cls), conf), "cls": c}
    return out


def test_labels_are_read_in_pixels(split, labels):
    assert len(labels) == 24 and all(len(c) >= 1 for c, _ in labels.values())
    cls, boxes = labels["00000.jpg"]
    assert boxes.shape == (len(cls), 4) and set(cls) <= set(range(len(CLASSES)))
    assert np.all(boxes[:, 2] > boxes[:, 0]) and boxes.max() <= 160 + 1e-3 and boxes.min() >= -1e-3


def test_perfect_predictions_score_the_ceiling(split, labels):
    r = ev.evaluate(from_labels(labels), split, names=dict(enumerate(CLASSES)))
    assert r["map50_95"] == pytest.approx(PERFECT) and r["map50"] == pytest.approx(PERFECT)
    assert r["images"] == 24 and r["instances"] == r["predictions"] == sum(len(c) for c, _ in labels.values())
    assert set(r["per_class"]) == set(CLASSES)
    assert all(v["map50_95"] == pytest.approx(PERFECT) for v in r["per_class"].values())


def test_shifted_boxes_score_lower(split, labels):
    small = ev.evaluate(from_labels(labels, shift=2.0), split)
    large = ev.evaluate(from_labels(labels, shift=8.0), split)
    assert large["map50_95"] < small["map50_95"] < PERFECT - 0.05
    assert small["map50"] == pytest.approx(PERFECT)  # still above IoU 0.5 everywhere


def test_extra_low_confidence_false_positives_cost_little(split, labels):
    preds = from_labels(labels)
    for p in preds.values():  # one stray box per image, below every true one
        p["boxes"] = np.vstack([p["boxes"], [[0, 0, 5, 5]]])
        p["conf"] = np.append(p["conf"], 0.01)
        p["cls"] = np.append(p["cls"], 0)
    r = ev.evaluate(preds, split)
    assert r["map50_95"] == pytest.approx(PERFECT, abs=1e-3)


def test_class_swap_zeroes_those_classes(split, labels):
    r = ev.evaluate(from_labels(labels, cls_map={0: 1, 1: 0}), split, names=dict(enumerate(CLASSES)))
    # Not exactly 0: the curve's sentinel point (recall 0, precision 1) leaves a sliver of area
    # in Ultralytics' 101-point interpolation, which its validator reports the same way.
    assert r["per_class"]["circle"]["map50_95"] < 0.01 and r["per_class"]["square"]["map50_95"] < 0.01
    assert r["per_class"]["triangle"]["map50_95"] == pytest.approx(PERFECT)
    assert r["map50_95"] == pytest.approx(PERFECT / 3, abs=0.01)


def test_predictions_json_round_trip(split, labels, tmp_path):
    rng = np.random.default_rng(0)
    preds = {
        k: {"boxes": b + rng.normal(0, 3, b.shape), "conf": rng.uniform(0.001, 1, len(c)), "cls": c}
        for k, (c, b) in labels.items()
    }
    path = tmp_path / "preds.json"
    ev.save_predictions(preds, path)
    back = ev.load_predictions(path)
    assert set(back) == set(preds)
    for k, p in preds.items():
        np.testing.assert_allclose(back[k].boxes, p["boxes"], atol=1e-3)
        np.testing.assert_allclose(back[k].conf, p["conf"], atol=1e-6)
        assert back[k].cls.tolist() == p["cls"].tolist()
    assert ev.evaluate(back, split)["map50_95"] == pytest.approx(ev.evaluate(preds, split)["map50_95"], abs=1e-4)
    with pytest.raises(ValueError, match="predictions record"):
        ev.predictions_from_dict({"images": {}})


def test_every_image_needs_an_entry(split, labels):
    preds = from_labels(labels)
    preds.pop("00003.jpg")
    with pytest.raises(ValueError, match="1 missing"):
        ev.evaluate(preds, split)
    preds = from_labels(labels)
    preds["00003.jpg"] = {"boxes": [], "conf": [], "cls": []}  # no detections is an entry
    assert ev.evaluate(preds, split)["map50_95"] < PERFECT


def test_matching_agrees_with_ultralytics_validator():
    from ultralytics.engine.validator import BaseValidator

    thresholds = ev.iou_thresholds()
    stub = types.SimpleNamespace(iouv=torch.linspace(0.5, 0.95, 10))
    rng = np.random.default_rng(1)
    for _ in range(30):
        m, n = int(rng.integers(1, 6)), int(rng.integers(1, 25))
        xy = rng.uniform(0, 80, (m, 2))
        gt = np.hstack([xy, xy + rng.uniform(10, 40, (m, 2))])
        gt_cls = rng.integers(0, 2, m)
        src = rng.integers(0, m, n)  # each prediction jitters some label, often overlapping others
        boxes = gt[src] + rng.normal(0, 4, (n, 4))
        pred = ev.ImagePredictions.of({"boxes": boxes, "conf": rng.uniform(0, 1, n), "cls": rng.integers(0, 2, n)})
        order = np.argsort(-pred.conf, kind="stable")  # Ultralytics expects descending confidence
        pred = ev.ImagePredictions(pred.boxes[order], pred.conf[order], pred.cls[order])
        ours = ev.match(pred, gt_cls, gt, thresholds)
        iou = torch.from_numpy(ev.box_iou(gt, pred.boxes))
        theirs = BaseValidator.match_predictions(stub, torch.from_numpy(pred.cls), torch.from_numpy(gt_cls), iou)
        np.testing.assert_array_equal(ours, theirs.numpy())


def scoring_yolo():
    """Random yolo26n weights with every class logit's bias raised: random weights alone score
    ~1e-4 everywhere, under even conf 0.001, and leave nothing to score."""
    from ultralytics import YOLO

    torch.manual_seed(0)
    net = YOLO("yolo26n.yaml").model
    head = net.model[-1]
    for branch in (head.cv3, head.one2one_cv3):
        for seq in branch:
            seq[-1].bias.data.fill_(-2.0)  # sigmoid: ~0.12, spread by the random weights
    return net


def test_engine_over_the_split(split, tmp_path):
    import dataclasses

    from runtime.vision.config import VisionConfig
    from runtime.vision.engine import VisionEngine
    from runtime.vision.runner import YoloRunner

    config = VisionConfig(model="yolo26n.yaml", imgsz=160, jit=False, profile=False, workers=1)
    r = ev.evaluate_engine(config, split)  # run at conf 0.001 in an engine of its own
    assert r["images"] == 24 and 0.0 <= r["map50_95"] <= r["map50"] <= 1.0
    net = scoring_yolo()
    with pytest.raises(ValueError, match="conf"):  # conf 0.25, a serving engine's: too selective to score
        ev.evaluate_engine(YoloRunner(config, module=net), split)
    low = dataclasses.replace(config, conf=ev.EVAL_CONF)
    small = write_test_set(tmp_path, 3, 160).parent  # the runner runs on this thread: kept short
    with VisionEngine(low, module=net) as engine:
        assert ev.evaluate_engine(engine, split)["images"] == 24
        by_engine = ev.engine_predictions(engine, small)
    by_runner = ev.engine_predictions(YoloRunner(low, module=net), small)
    assert sum(len(p.conf) for p in by_engine.values()) > 3
    for key, p in by_engine.items():  # the engine's batches give the runner's detections
        np.testing.assert_allclose(p.boxes, by_runner[key].boxes, atol=1e-3)
        np.testing.assert_allclose(p.conf, by_runner[key].conf, atol=1e-5)


def test_scores_the_validators_own_predictions_as_it_does(split, monkeypatch, tmp_path):
    """Ultralytics' validator on the split with the shipped detector, its per-image predictions
    captured and scored by evaluate(): the same mAP, to float rounding. (Its own predictions,
    not predict()'s: the two pipelines differ in the last float bits, which reorders the many
    conf-0.001 boxes.) Random weights score 0 either way, which would prove nothing."""
    from pathlib import Path

    from ultralytics import YOLO
    from ultralytics.models.yolo.detect import DetectionValidator

    from runtime.vision import detector

    assert detector.WEIGHTS.is_file(), f"the shipped detector is missing: {detector.WEIGHTS}"
    captured = {}
    update = DetectionValidator.update_metrics

    def capture(self, preds, batch):
        for i, p in enumerate(preds):
            assert batch["img"].shape[-2:] == (160, 160)  # square inputs: boxes are in image pixels
            captured[Path(batch["im_file"][i]).name] = {
                "boxes": p["bboxes"].cpu().numpy().copy(),
                "conf": p["conf"].cpu().numpy().copy(),
                "cls": p["cls"].cpu().numpy().copy(),
            }
        return update(self, preds, batch)

    monkeypatch.setattr(DetectionValidator, "update_metrics", capture)
    metrics = YOLO(str(detector.WEIGHTS)).val(
        data=f"{split}/data.yaml",
        imgsz=160,
        batch=1,
        conf=ev.EVAL_CONF,
        nms=False,
        rect=False,
        plots=False,
        verbose=False,
        project=str(tmp_path),
        name="val",
        exist_ok=True,
    )
    assert len(captured) == 24 and float(metrics.box.map) > 0.02
    ours = ev.evaluate(captured, split)
    assert ours["map50_95"] == pytest.approx(float(metrics.box.map), abs=1e-9)
    assert ours["map50"] == pytest.approx(float(metrics.box.map50), abs=1e-9)


def test_peer_script_writes_what_the_evaluator_reads(split):
    """benchmarks/vision_peers.py runs under a peer's Python and cannot import Tandem: its
    predictions record must still be the format evaluate.py reads, one entry per image."""
    import argparse

    from benchmarks import vision_peers as bench_peers

    args = argparse.Namespace(imgsz=160, device="cpu", eval_dir=split, eval_split="test")
    record = bench_peers.predictions("yolo26n.yaml", args)
    assert record["format"] == ev.FORMAT
    preds = ev.predictions_from_dict(record)
    assert set(preds) == set(ev.load_labels(split))
    assert ev.evaluate(preds, split)["images"] == 24
