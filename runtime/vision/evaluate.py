"""Accuracy of any detector on a labeled split: mAP50-95 and mAP50, scored as Ultralytics does.

The split is in Ultralytics' layout (`DIR/images/<split>/*.jpg`, `DIR/labels/<split>/*.txt`
with `class cx cy w h` normalised per line), e.g. the held-out shapes test set of
`runtime.vision.synthetic.write_test_set`. Predictions are plain data, so that a detector
running in another Python (an exported model in a peer's virtualenv) is scored by this same
code from a JSON file:

    {"format": "tandem-predictions/1",
     "images": {"00000.jpg": {"boxes": [[x1, y1, x2, y2], ...],   # original-image pixels
                              "conf": [0.93, ...], "cls": [2, ...]}, ...}}

keyed by each image's path under `images/<split>/` ('/'-separated). Predict at a low
confidence (EVAL_CONF, as Ultralytics' validator does), or the precision-recall curve is cut
short and mAP comes out low.

Scoring follows Ultralytics' DetectionValidator: per image, predictions in descending
confidence take, at each IoU threshold 0.50:0.95 (step 0.05), the unclaimed same-class label
they overlap most, if the overlap reaches the threshold; then `ultralytics.utils.metrics.
ap_per_class` over the whole split gives AP per class and threshold. mAP50-95 is the mean over
classes and thresholds, mAP50 the mean over classes at 0.50; classes without labels in the split
do not count. Its AP interpolates 101 recall points between sentinels, so a perfect detector
scores 0.995 (as `yolo val` prints for one), and a class never predicted right a sliver above 0.
On its own predictions, this gives the validator's mAP to the last digit
(tests/test_vision_evaluate.py).

    python -m runtime.vision.evaluate DATA_DIR --model runtime/vision/weights/shapes_yolo26n.pt --imgsz 320
    python -m runtime.vision.evaluate DATA_DIR --predictions peer_onnx.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "tandem-predictions/1"
EVAL_CONF = 0.001  # Ultralytics' validation default: the whole precision-recall curve counts
SUBMIT_WINDOW = 128  # images queued on an engine at once: its queue is bounded (256 by default)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def iou_thresholds() -> np.ndarray:
    """0.50, 0.55, ..., 0.95 as Ultralytics' validator builds them (float32 torch.linspace), so a
    borderline IoU falls on the same side of a threshold in both."""
    import torch

    return torch.linspace(0.5, 0.95, 10).numpy()


@dataclass(slots=True)
class ImagePredictions:
    """One image's detections: xyxy boxes in original-image pixels, confidences, classes."""

    boxes: np.ndarray  # (N, 4) float
    conf: np.ndarray  # (N,) float
    cls: np.ndarray  # (N,) int

    @classmethod
    def of(cls, value: Any) -> ImagePredictions:
        """From an ImagePredictions, a dict with boxes/conf/cls (lists or arrays), or any object
        with those attributes (runtime.vision.postprocess.Detections)."""
        if isinstance(value, ImagePredictions):
            return value
        get = value.get if isinstance(value, dict) else lambda k: getattr(value, k)
        boxes = np.asarray(get("boxes"), dtype=np.float64).reshape(-1, 4)
        conf = np.asarray(get("conf"), dtype=np.float64).reshape(-1)
        classes = np.asarray(get("cls"), dtype=np.float64).reshape(-1)
        if not len(boxes) == len(conf) == len(classes):
            raise ValueError(f"boxes, conf and cls differ in length: {len(boxes)}, {len(conf)}, {len(classes)}")
        if len(classes) and (np.any(classes != np.round(classes)) or classes.min() < 0):
            raise ValueError("cls must hold non-negative integer class ids")
        return cls(boxes, conf, classes.astype(np.int64))

    def to_dict(self) -> dict[str, list]:
        return {
            # unrounded: rounding moves borderline IoUs across a threshold and ties confidences
            "boxes": [[float(v) for v in b] for b in self.boxes],
            "conf": [float(c) for c in self.conf],
            "cls": [int(c) for c in self.cls],
        }


Predictions = dict[str, ImagePredictions]


# -- the split --
def image_files(data_dir: str | Path, split: str = "test") -> list[Path]:
    """The split's images, sorted."""
    root = Path(data_dir) / "images" / split
    if not root.is_dir():
        raise FileNotFoundError(f"no images/{split} folder under {data_dir}")
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)


def image_key(data_dir: str | Path, split: str, path: str | Path) -> str:
    """How predictions name an image: its path under images/<split>/."""
    return Path(path).relative_to(Path(data_dir) / "images" / split).as_posix()


def _image_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:  # reads the header only
        return im.size  # (w, h)


def load_labels(data_dir: str | Path, split: str = "test") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per image key: (classes (M,), xyxy boxes (M, 4) in pixels, float32). An image without a label
    file, or with an empty one, has no objects (every prediction on it is a false positive)."""
    data_dir = Path(data_dir)
    out = {}
    for path in image_files(data_dir, split):
        key = image_key(data_dir, split, path)
        label = (data_dir / "labels" / split / key).with_suffix(".txt")
        rows = np.zeros((0, 5), dtype=np.float32)
        if label.is_file():
            lines = [line.split() for line in label.read_text().splitlines() if line.strip()]
            if any(len(v) != 5 for v in lines):
                raise ValueError(f"{label}: expected 'class cx cy w h' per line (boxes, not segments)")
            if lines:
                rows = np.array(lines, dtype=np.float32)  # as Ultralytics' label cache holds them
        w, h = _image_size(path)
        centre, half = rows[:, 1:3], rows[:, 3:5] / 2  # corners first, then pixels: the validator's order
        boxes = np.hstack([centre - half, centre + half]) * np.array([w, h, w, h], dtype=np.float32)
        out[key] = (rows[:, 0].astype(np.int64), boxes)
    if not out:
        raise FileNotFoundError(f"no images in {data_dir / 'images' / split}")
    return out


# -- the predictions file --
def predictions_to_dict(predictions: dict[str, Any]) -> dict:
    return {"format": FORMAT, "images": {k: ImagePredictions.of(v).to_dict() for k, v in predictions.items()}}


def predictions_from_dict(d: dict) -> Predictions:
    if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("images"), dict):
        raise ValueError(f"not a predictions record: expected {{'format': {FORMAT!r}, 'images': {{...}}}}")
    return {k: ImagePredictions.of(v) for k, v in d["images"].items()}


def save_predictions(predictions: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(predictions_to_dict(predictions)))


def load_predictions(path: str | Path) -> Predictions:
    return predictions_from_dict(json.loads(Path(path).read_text()))


# -- scoring --
def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(M, 4) x (N, 4) xyxy -> (M, N) IoU, via Ultralytics' own box_iou (float32, its eps)."""
    import torch

    from runtime.vision.ultralytics_import import import_ultralytics

    import_ultralytics()
    from ultralytics.utils.metrics import box_iou as ul_box_iou

    return ul_box_iou(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)).numpy()


def match(
    pred: ImagePredictions, label_cls: np.ndarray, label_boxes: np.ndarray, thresholds: np.ndarray | None = None
) -> np.ndarray:
    """(N, T) bool: whether each prediction (in pred's order) is a true positive at each IoU
    threshold. Predictions go in descending confidence; each takes the unclaimed label of its
    class it overlaps most, when that overlap reaches the threshold. Same rule as Ultralytics'
    BaseValidator.match_predictions (greedy, not its optional Hungarian matching)."""
    thresholds = iou_thresholds() if thresholds is None else thresholds
    n, m = len(pred.conf), len(label_cls)
    correct = np.zeros((n, len(thresholds)), dtype=bool)
    if not n or not m:
        return correct
    iou = box_iou(label_boxes, pred.boxes)  # (M, N)
    iou = np.where(label_cls[:, None] == pred.cls[None, :], iou, 0.0)
    order = np.argsort(-pred.conf, kind="stable")
    order = order[iou[:, order].max(0) >= thresholds.min()]  # the rest match at no threshold
    for t, threshold in enumerate(thresholds):
        free = np.ones(m, dtype=bool)
        for j in order:
            overlap = np.where(free, iou[:, j], 0.0)
            k = int(overlap.argmax())
            if overlap[k] >= threshold:
                correct[j, t] = True
                free[k] = False
    return correct


def evaluate(
    predictions: dict[str, Any], data_dir: str | Path, split: str = "test", names: dict[int, str] | None = None
) -> dict[str, Any]:
    """Score `predictions` (image key -> boxes/conf/cls, see the module docstring) on the split.

    Returns {"map50_95", "map50", "images", "instances", "predictions", "per_class": {name:
    {"map50_95", "map50", "instances"}}}. Every image of the split must have an entry (an
    empty one for no detections), and no entry may name an image outside it."""
    from runtime.vision.ultralytics_import import import_ultralytics

    labels = load_labels(data_dir, split)
    preds = {k: ImagePredictions.of(v) for k, v in predictions.items()}
    missing, extra = sorted(set(labels) - set(preds)), sorted(set(preds) - set(labels))
    if missing or extra:
        raise ValueError(
            f"predictions do not cover images/{split} of {data_dir}: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(extra)} unknown (e.g. {extra[:3]})"
        )
    thresholds = iou_thresholds()
    tp, conf, pred_cls, target_cls = [], [], [], []
    for key, (cls, boxes) in labels.items():
        p = preds[key]
        tp.append(match(p, cls, boxes, thresholds))
        conf.append(p.conf)
        pred_cls.append(p.cls)
        target_cls.append(cls)
    import_ultralytics()
    from ultralytics.utils.metrics import ap_per_class

    target = np.concatenate(target_cls)
    result = ap_per_class(np.concatenate(tp), np.concatenate(conf), np.concatenate(pred_cls), target)
    ap, classes = result[5], result[6]  # (C, T) AP per class with labels and threshold; those classes
    names = names or {}
    per_class = {
        names.get(int(c), str(int(c))): {
            "map50_95": float(ap[i].mean()),
            "map50": float(ap[i, 0]),
            "instances": int((target == c).sum()),
        }
        for i, c in enumerate(classes)
    }
    return {
        "map50_95": float(ap.mean()) if len(ap) else 0.0,  # as Ultralytics' Metric.map: 0 without labels
        "map50": float(ap[:, 0].mean()) if len(ap) else 0.0,
        "images": len(labels),
        "instances": int(len(target)),
        "predictions": int(sum(len(c) for c in conf)),
        "per_class": per_class,
    }


# -- running a detector over the split --
def predict_split(
    predict: Callable[[list[np.ndarray]], Iterable[Any]], data_dir: str | Path, split: str = "test", batch_size: int = 8
) -> Predictions:
    """Predictions of `predict` (BGR images in, one boxes/conf/cls result per image out) over
    the split, `batch_size` images a call."""
    import cv2

    paths = image_files(data_dir, split)
    out: Predictions = {}
    for i in range(0, len(paths), batch_size):
        chunk = paths[i : i + batch_size]
        results = list(predict([cv2.imread(str(p)) for p in chunk]))
        for p, r in zip(chunk, results, strict=True):
            out[image_key(data_dir, split, p)] = ImagePredictions.of(r)
    return out


def engine_predictions(config_or_engine: Any, data_dir: str | Path, split: str = "test") -> Predictions:
    """Tandem's predictions over the split, through the VisionEngine (dynamic batching, its
    workers, the config's dtype / channels_last / jit).

    A VisionConfig (or a dict of its fields) is run at conf EVAL_CONF in an engine of its own.
    A running VisionEngine, or a YoloRunner, is used as it is, so its conf must already be
    EVAL_CONF or lower: one built for serving (conf 0.25) would cut the curve short."""
    from runtime.vision.config import VisionConfig
    from runtime.vision.engine import VisionEngine
    from runtime.vision.runner import YoloRunner

    if isinstance(config_or_engine, dict):
        config_or_engine = VisionConfig.from_dict(config_or_engine)
    if isinstance(config_or_engine, VisionConfig):
        with VisionEngine(dataclasses.replace(config_or_engine, conf=min(config_or_engine.conf, EVAL_CONF))) as engine:
            return engine_predictions(engine, data_dir, split)
    if not isinstance(config_or_engine, (VisionEngine, YoloRunner)):
        raise ValueError(
            f"expected a VisionConfig, a dict of its fields, a VisionEngine or a YoloRunner, "
            f"got {type(config_or_engine).__name__}"
        )
    if config_or_engine.config.conf > EVAL_CONF:
        raise ValueError(
            f"mAP needs predictions at conf <= {EVAL_CONF}; this engine runs at conf "
            f"{config_or_engine.config.conf} (pass its VisionConfig instead: it is run at {EVAL_CONF})"
        )
    if isinstance(config_or_engine, YoloRunner):
        return predict_split(config_or_engine.predict, data_dir, split, config_or_engine.config.batching.max_batch_size)
    engine = config_or_engine
    out: Predictions = {}
    pending: collections.deque = collections.deque()  # queued together, so the engine batches them
    for path in image_files(data_dir, split):
        if len(pending) >= SUBMIT_WINDOW:
            key, future = pending.popleft()
            out[key] = ImagePredictions.of(future.result())
        pending.append((image_key(data_dir, split, path), engine.submit(str(path))))
    for key, future in pending:
        out[key] = ImagePredictions.of(future.result())
    return out


def evaluate_engine(config_or_engine: Any, data_dir: str | Path, split: str = "test") -> dict[str, Any]:
    """mAP50-95 and mAP50 of Tandem with this config (or engine, see engine_predictions) on the
    split: {"map50_95", "map50", "images", ...} as `evaluate` returns."""
    from runtime.vision.engine import VisionEngine
    from runtime.vision.runner import YoloRunner

    preds = engine_predictions(config_or_engine, data_dir, split)
    names = config_or_engine.names if isinstance(config_or_engine, (VisionEngine, YoloRunner)) else None
    return evaluate(preds, data_dir, split, names=names or _split_names(data_dir))


def _split_names(data_dir: str | Path) -> dict[int, str] | None:
    """Class names from the data YAML beside the split, when there is one."""
    path = Path(data_dir) / "data.yaml"
    if not path.is_file():
        return None
    import yaml

    names = (yaml.safe_load(path.read_text()) or {}).get("names")
    if isinstance(names, list):
        return dict(enumerate(names))
    return {int(k): str(v) for k, v in names.items()} if isinstance(names, dict) else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.vision.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("data_dir", help="dataset root with images/<split> and labels/<split>")
    p.add_argument("--split", default="test")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--predictions", help="a predictions JSON file (see the module docstring)")
    src.add_argument("--model", help="run Tandem's VisionEngine on this .pt")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    if a.predictions:
        result = evaluate(load_predictions(a.predictions), a.data_dir, a.split, names=_split_names(a.data_dir))
    else:
        from runtime.vision.config import VisionConfig

        config = VisionConfig(model=a.model, imgsz=a.imgsz, dtype=a.dtype, device=a.device)
        result = evaluate_engine(config, a.data_dir, a.split)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
