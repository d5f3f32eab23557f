"""The vision path: YOLO detection with request-level dynamic batching.

    from runtime.vision import VisionConfig, VisionEngine
    with VisionEngine(VisionConfig(model="yolo26n.yaml", imgsz=640)) as engine:
        detections = engine.submit("bus.jpg").result()

torch and ultralytics load on first use, so `runtime.vision.cli`'s argument parser stays cheap.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "VisionConfig": "runtime.vision.config",
    "VisionEngine": "runtime.vision.engine",
    "VisionInputError": "runtime.vision.engine",
    "EngineClosedError": "runtime.vision.engine",
    "YoloRunner": "runtime.vision.runner",
    "Detections": "runtime.vision.postprocess",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime.vision' has no attribute {name!r}")
