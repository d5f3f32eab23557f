"""The detection record, one format everywhere: a line of `tandem detect`, a detect job's result,
a `/v1/detect` answer, a camera's record in Redis. Plain JSON types only; importing this loads
no torch, so workers and the server build records without the model's stack.

    {"source": ..., "frame": ..., "boxes": [[x1, y1, x2, y2], ...], "conf": [...], "cls": [...],
     "names": [...], "error": None or why this input failed}
"""

from __future__ import annotations

from typing import Any


def detection_record(source: str, frame: int | None, det: Any = None, error: str | None = None) -> dict:
    """The record of one input: `det` is its Detections (runtime/vision/postprocess.py), or None
    when it failed (`error` says why) or had no result."""
    out: dict[str, Any] = {"source": source, "frame": frame}
    out.update(det.to_dict() if det is not None else {"boxes": [], "conf": [], "cls": [], "names": []})
    out["error"] = error
    return out
