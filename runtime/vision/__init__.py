"""The vision path: YOLO detection with request-level dynamic batching.

    from runtime.vision import VisionConfig, VisionEngine
    with VisionEngine(VisionConfig(model="yolo26n.yaml", imgsz=640)) as engine:
        detections = engine.submit("bus.jpg").result()

torch and ultralytics load on first use, so `runtime.vision.cli`'s argument parser stays cheap.
"""

from __future__ import annotations

from runtime.lazy import lazy_getattr

_LAZY = {
    "VisionConfig": "runtime.vision.config",
    "VisionEngine": "runtime.vision.engine",
    "vision_batching": "runtime.vision.config",
    "VisionInputError": "runtime.vision.batch",
    "EngineClosedError": "runtime.vision.engine",
    "YoloRunner": "runtime.vision.runner",
    "Detections": "runtime.vision.postprocess",
}

__all__ = list(_LAZY)
__getattr__ = lazy_getattr("runtime.vision", _LAZY)
