"""Tandem's shipped detector: yolo26n trained on the generated shapes dataset.

No pretrained detector can be downloaded on the machines Tandem is built on, so the project
trains its own (runtime/vision/train.py on runtime/vision/synthetic.py) and ships the weights
here. It is the default model of the demo and the docs, so that detections mean something, and
its held-out test set (runtime.vision.synthetic.write_test_set) is where every fast path's
accuracy is measured (runtime/vision/evaluate.py).
"""

from __future__ import annotations

from pathlib import Path

WEIGHTS = Path(__file__).resolve().parent / "weights" / "shapes_yolo26n.pt"
IMGSZ = 320  # the size it was trained at; its test images are drawn at this size too
CLASSES = ("circle", "square", "triangle")  # what runtime/vision/synthetic.py draws, in label order


def default_imgsz(model: str | None) -> int:
    """The input size a CLI uses when none is given: the shipped detector's own, else 640
    (Ultralytics' default)."""
    if model is not None and Path(model).resolve() == WEIGHTS:
        return IMGSZ
    return 640
