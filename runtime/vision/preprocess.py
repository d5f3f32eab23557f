"""Letterboxing, the way Ultralytics' predict does it, into reusable batch buffers.

The letterbox arithmetic (rounding of the resized size, the -0.1/+0.1 split of the padding,
the minimum-rectangle stride padding) is what Ultralytics' LetterBox and scale_boxes do: any
difference moves every box. Images are letterboxed straight into a preallocated uint8
buffer (page-locked on CUDA), so a batch costs no allocation after the first one of its shape.
"""

from __future__ import annotations

import threading
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
    resized = (
        image
        if (image.shape[1], image.shape[0]) == box.resized
        else cv2.resize(image, box.resized, interpolation=cv2.INTER_LINEAR)
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
    """One uint8 NHWC staging buffer per input shape, grown to the largest batch seen, kept per
    thread: the Runtime's vision workers prepare batches side by side on one runner, and two
    of them letterboxing into one shared buffer would mix their images.

    pin_memory=True (CUDA): the buffers are page-locked host memory, allocated once per shape
    like the plain ones, so that the host-to-device copy is a DMA the GPU runs on its own
    (non_blocking) instead of a staged copy the CPU waits for, and no page-locking (slow, a
    driver call) happens per batch. Such a copy is still reading the buffer after the call that
    issued it returns, so the caller hands in a fence (a CUDA event recorded after the copy) and
    the next `get` of that shape waits for it before the buffer is written again; that wait is
    for a copy of a few MB on a stream of its own, not for the forward pass.
    """

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._local = threading.local()

    def _state(self) -> tuple[dict, dict, dict]:
        """This thread's (numpy buffers, pinned tensors, fences) by shape."""
        st = getattr(self._local, "state", None)
        if st is None:
            st = self._local.state = ({}, {}, {})
        return st

    def get(self, shape: tuple[int, int], n: int) -> np.ndarray:
        buffers, pinned, fences = self._state()
        fence = fences.pop(shape, None)
        if fence is not None:
            fence.synchronize()  # the last copy out of this buffer has to finish before we overwrite it
        buf = buffers.get(shape)
        if buf is None or buf.shape[0] < n:
            if self.pin_memory:
                t = torch.empty((n, shape[0], shape[1], 3), dtype=torch.uint8, pin_memory=True)
                pinned[shape], buf = t, t.numpy()  # one memory: letterbox writes the array, the copy reads the tensor
            else:
                buf = np.empty((n, shape[0], shape[1], 3), np.uint8)
            buffers[shape] = buf
        return buf[:n]

    def pinned(self, shape: tuple[int, int], n: int) -> torch.Tensor | None:
        """The page-locked tensor behind this thread's `get(shape, n)`, None when not pinned.
        Copy from it rather than from torch.from_numpy(array): then torch's pinned-memory
        allocator, which owns the memory, knows of the copy and keeps the memory until it ends
        even if the buffer is replaced meanwhile."""
        t = self._state()[1].get(shape)
        return None if t is None else t[:n]

    def fence(self, shape: tuple[int, int], event: object) -> None:
        """`event` (anything with .synchronize(), a torch.cuda.Event) marks the end of the copy
        that reads this thread's `shape` buffer; the next `get(shape)` waits for it."""
        self._state()[2][shape] = event

    @property
    def nbytes(self) -> int:
        """Bytes of the calling thread's buffers."""
        return sum(b.nbytes for b in self._state()[0].values())


def to_tensor(
    batch_hwc: np.ndarray, device: torch.device, dtype: torch.dtype = torch.float32, pinned: torch.Tensor | None = None
) -> torch.Tensor:
    """uint8 BGR NHWC -> RGB NCHW of `dtype` in [0, 1], in the same operation order as Ultralytics
    (transfer as uint8, flip channels, cast, then divide) so the input is bit-identical; on CUDA
    the cast goes straight to the model's dtype, as Ultralytics' `im.half()` does.

    The channels are flipped before the NHWC -> NCHW permute, so the tensor comes out
    channels_last in memory: the layout the model runs in, with no further copy.
    `pinned`: the same bytes as page-locked memory (BatchBuffers.pinned), copied from instead
    of `batch_hwc` so the copy runs asynchronously."""
    t = (pinned if pinned is not None else torch.from_numpy(batch_hwc)).to(device, non_blocking=True)
    t = t.flip(3).permute(0, 3, 1, 2)
    return t.to(dtype).div_(255)
