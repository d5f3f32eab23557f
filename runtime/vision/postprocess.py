"""From raw head outputs to detections in original-image pixels.

End-to-end heads (YOLO26, YOLOv10) are trained to emit one box per object: we only filter by
confidence (and class), and `iou` does not apply. On the shipped detector that head often puts two
near-identical boxes on one object; its one-to-many head with NMS (VisionConfig end2end=False,
`tandem detect --nms`) does not, and scores higher: mAP50-95 0.8065 against 0.7830 on the 200
held-out test images (float32; NMS over the end-to-end head's boxes at 0.7 gave 0.7949).
Other heads (YOLO11, YOLOv8) emit a box per anchor and need class-aware NMS. Both follow
Ultralytics' non_max_suppression rules (strict `> conf`, best class per box, max_nms
candidates, classes separated by a 7680 px offset) so the results match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torchvision

from runtime.vision.preprocess import Letterbox

MAX_NMS = 30000  # candidates per image before NMS
MAX_WH = 7680  # class offset for class-aware NMS in one call


@dataclass(slots=True)
class Detections:
    """One input's detections: xyxy boxes in original pixels, confidences, classes."""

    boxes: np.ndarray  # (N, 4) float32
    conf: np.ndarray  # (N,) float32
    cls: np.ndarray  # (N,) int64
    names: list[str]  # class name of each box
    orig_shape: tuple[int, int]  # h, w
    batch_size: int = 1  # how many inputs shared the forward pass
    timings: dict[str, float] = field(default_factory=dict)  # preprocess/inference/postprocess/queue ms
    deadline_missed: bool = False  # it had a deadline and finished after it

    def __len__(self) -> int:
        return len(self.conf)

    def to_dict(self) -> dict:
        return {
            "boxes": [[round(float(v), 3) for v in b] for b in self.boxes],
            "conf": [round(float(c), 6) for c in self.conf],
            "cls": [int(c) for c in self.cls],
            "names": list(self.names),
        }


def _class_mask(cls: torch.Tensor, classes: tuple[int, ...] | None) -> torch.Tensor | None:
    if classes is None:
        return None
    return torch.isin(cls.long(), torch.tensor(classes, device=cls.device))


def filter_end2end(
    pred: torch.Tensor, conf: float, max_det: int, classes: tuple[int, ...] | None = None
) -> list[torch.Tensor]:
    """(B, k, 6) rows sorted by score -> per image the rows above `conf` (of `classes` only,
    when given), at most max_det. As Ultralytics, the class filter comes before max_det."""
    out = []
    for p in pred:
        keep = p[:, 4] > conf
        wanted = _class_mask(p[:, 5], classes)
        out.append(p[keep if wanted is None else keep & wanted][:max_det])
    return out


def nms(
    pred: torch.Tensor, conf: float, iou: float, max_det: int, classes: tuple[int, ...] | None = None
) -> list[torch.Tensor]:
    """(B, 4 + nc, anchors) with xywh boxes and class scores -> per image (n, 6) xyxy rows
    (of `classes` only, when given: filtered before NMS, as Ultralytics does)."""
    out = []
    for x in pred.transpose(-1, -2):  # (anchors, 4 + nc)
        scores, cls = x[:, 4:].max(1)
        keep = scores > conf
        wanted = _class_mask(cls, classes)
        if wanted is not None:
            keep &= wanted
        x, scores, cls = x[keep], scores[keep], cls[keep]
        if not len(scores):
            out.append(pred.new_zeros((0, 6)))
            continue
        xy, wh = x[:, :2], x[:, 2:4] / 2
        boxes = torch.cat((xy - wh, xy + wh), 1)
        if len(scores) > MAX_NMS:
            top = scores.argsort(descending=True)[:MAX_NMS]
            boxes, scores, cls = boxes[top], scores[top], cls[top]
        keep = torchvision.ops.nms(boxes + cls[:, None].float() * MAX_WH, scores, iou)[:max_det]
        out.append(torch.cat((boxes[keep], scores[keep, None], cls[keep, None].float()), 1))
    return out


def head_rows(raw: torch.Tensor, end2end: bool, conf: float, config) -> list[torch.Tensor]:
    """A batch's raw head output -> per image (n, 6) xyxy rows in network-input pixels, with
    `config`'s (a VisionConfig's) max_det and classes, and its iou for a head that needs NMS."""
    if end2end:
        return filter_end2end(raw, conf, config.max_det, config.classes)
    return nms(raw, conf, config.iou, config.max_det, config.classes)


def to_original(rows: torch.Tensor, box: Letterbox) -> np.ndarray:
    """(n, 6) rows in network-input pixels -> float32 numpy rows with boxes in original pixels."""
    r = rows.cpu().numpy().astype(np.float32, copy=True)
    gx, gy = box.gain
    r[:, [0, 2]] = (r[:, [0, 2]] - box.left) / gx
    r[:, [1, 3]] = (r[:, [1, 3]] - box.top) / gy
    h, w = box.orig_shape
    r[:, [0, 2]] = r[:, [0, 2]].clip(0, w)
    r[:, [1, 3]] = r[:, [1, 3]].clip(0, h)
    return r


def detections(rows: np.ndarray, names: dict[int, str], box: Letterbox) -> Detections:
    cls = rows[:, 5].astype(np.int64)
    return Detections(
        rows[:, :4].copy(), rows[:, 4].copy(), cls, [names.get(int(c), str(c)) for c in cls], box.orig_shape
    )
