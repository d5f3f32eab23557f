"""Letterboxing, the way Ultralytics' predict does it, into reusable batch buffers.

The letterbox arithmetic (rounding of the resized size, the -0.1/+0.1 split of the padding,
the minimum-rectangle stride padding) is what Ultralytics' LetterBox and scale_boxes do: any
difference moves every box. Images are letterboxed straight into a preallocated uint8
buffer, so a batch costs no allocation after the first one of its shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np
import torch

PAD_VALUE = 114


@dataclass(slots=True, frozen=True)
class Letterbox:
    """Where an original (h, w) image lands inside the network input."""

    orig_shape: tuple[int, int]  # h, w
    input_shape: tuple[int, int]  # h, w of the network input
    resized: tuple[int, int]  # w, h after resizing (cv2 order)
    top: int
    bottom: int
    left: int
    right: int

    @property
    def gain(self) -> tuple[float, float]:
        """(x, y) scale from original to resized pixels, per side, after LetterBox's rounding."""
        return self.resized[0] / self.orig_shape[1], self.resized[1] / self.orig_shape[0]


def plan_letterbox(orig_shape: tuple[int, int], imgsz: int, stride: int, rect: bool) -> Letterbox:
    h, w = orig_shape
    r = min(imgsz / h, imgsz / w)
    new_w, new_h = max(round(w * r), 1), max(round(h * r), 1)
    dw, dh = imgsz - new_w, imgsz - new_h
    if rect:  # minimum rectangle: pad only up to the next multiple of the stride
        dw, dh = dw % stride, dh % stride
    dw, dh = dw / 2, dh / 2
    top, bottom = round(dh - 0.1), round(dh + 0.1)
    left, right = round(dw - 0.1), round(dw + 0.1)
    return Letterbox((h, w), (new_h + top + bottom, new_w + left + right), (new_w, new_h), top, bottom, left, right)


def letterbox_into(image: np.ndarray, box: Letterbox, out: np.ndarray) -> None:
    """Write the letterboxed `image` into `out` (H x W x 3 uint8, the network input shape)."""
    resized = image if (image.shape[1], image.shape[0]) == box.resized else cv2.resize(
        image, box.resized, interpolation=cv2.INTER_LINEAR
    )
    h, w = box.resized[1], box.resized[0]
    # Pad only the borders: filling the whole buffer would double the memory traffic.
    if box.top:
        out[: box.top] = PAD_VALUE
    if box.bottom:
        out[box.top + h :] = PAD_VALUE
    if box.left:
        out[box.top : box.top + h, : box.left] = PAD_VALUE
    if box.right:
        out[box.top : box.top + h, box.left + w :] = PAD_VALUE
    out[box.top : box.top + h, box.left : box.left + w] = resized


class BatchBuffers:
    """One uint8 NHWC staging buffer per input shape, grown to the largest batch seen."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], np.ndarray] = {}

    def get(self, shape: tuple[int, int], n: int) -> np.ndarray:
        buf = self._buffers.get(shape)
        if buf is None or buf.shape[0] < n:
            buf = np.empty((n, shape[0], shape[1], 3), np.uint8)
            self._buffers[shape] = buf
        return buf[:n]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


def to_tensor(batch_hwc: np.ndarray, device: torch.device) -> torch.Tensor:
    """uint8 BGR NHWC -> float RGB NCHW in [0, 1], in the same operation order as Ultralytics
    (transfer as uint8, flip channels, then divide) so the input is bit-identical.

    The channels are flipped before the NHWC -> NCHW permute, so the float tensor comes out
    channels_last in memory: the layout the model runs in, with no further copy."""
    t = torch.from_numpy(batch_hwc).to(device, non_blocking=True)
    t = t.flip(3).permute(0, 3, 1, 2)
    return t.float().div_(255)
