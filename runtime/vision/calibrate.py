"""Meaningful outputs from a randomly initialised YOLO, for parity checks without weights.

A freshly built model has degenerate outputs (every score ~1e-4, all alike), so comparing two
implementations on it proves little. Calibration takes the BatchNorm statistics from real
images and rescales the class logits to a spread, which gives hundreds of distinct boxes and
scores per image to compare, with no weights downloaded. Used by the parity tests and by
`tandem bench vision` to measure the parity error of the fast paths.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from runtime.vision.preprocess import letterbox_into, plan_letterbox, to_tensor


def _inputs(images: list[np.ndarray], imgsz: int) -> list[torch.Tensor]:
    out = []
    for im in images:
        box = plan_letterbox(im.shape[:2], imgsz, 32, True)
        buf = np.empty((1, *box.input_shape, 3), np.uint8)
        letterbox_into(im, box, buf[0])
        out.append(to_tensor(buf, torch.device("cpu")))
    return out


def calibrate(net: nn.Module, images: list[np.ndarray], imgsz: int) -> nn.Module:
    """Calibrate an Ultralytics DetectionModel (in place; returned) on BGR `images`:
    BatchNorm statistics from the images, class logits rescaled to N(-3, 1.5) per class conv."""
    bns = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over the calibration images
    net.train()
    with torch.no_grad():
        for x in _inputs(images, imgsz):
            net(x)
    net.eval()
    head = net.model[-1]
    finals = [seq[-1] for seq in list(head.cv3) + list(getattr(head, "one2one_cv3", None) or [])]
    outs: dict[int, torch.Tensor] = {}
    hooks = [c.register_forward_hook(lambda m, i, o, k=k: outs.setdefault(k, o)) for k, c in enumerate(finals)]
    try:
        with torch.no_grad():
            net(_inputs(images, imgsz)[0])
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for k, conv in enumerate(finals):
            mean, std = outs[k].mean(), outs[k].std()
            conv.weight.mul_(1.5 / std)
            conv.bias.sub_(mean).mul_(1.5 / std).sub_(3.0)
    return net


def match_errors(
    boxes: np.ndarray,
    conf: np.ndarray,
    cls: np.ndarray,
    ref_boxes: np.ndarray,
    ref_conf: np.ndarray,
    ref_cls: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per reference detection: (box error px, confidence error) to the nearest of ours of the
    same class (nearest by largest coordinate difference), inf where we have none of its class.
    Matching rather than comparing in order, so near-tied scores that swap places do not count."""
    if not len(ref_conf):
        return np.zeros(0), np.zeros(0)
    if not len(conf):
        return np.full(len(ref_conf), np.inf), np.full(len(ref_conf), np.inf)
    dist = np.abs(ref_boxes[:, None, :] - boxes[None, :, :]).max(-1)
    dist[ref_cls[:, None] != cls[None, :]] = np.inf
    best = dist.argmin(1)
    box_err = dist[np.arange(len(best)), best]
    conf_err = np.abs(ref_conf - conf[best])
    conf_err[~np.isfinite(box_err)] = np.inf
    return box_err, conf_err
