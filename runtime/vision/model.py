"""Loading a YOLO detection model from a .yaml (random weights), a .pt checkpoint or a module.

The module is prepared the way Ultralytics' AutoBackend prepares a .pt model (Conv+BN
fused, eval, float, no grads, the head's mode chosen before fusion drops the other head),
which is what makes our detections match `YOLO(...).predict(...)` to float rounding.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
from torch import nn

from runtime.vision.config import VisionConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    module: nn.Module
    names: dict[int, str]
    stride: int
    end2end: bool  # True: the head emits (B, k, 6) [x1, y1, x2, y2, score, class]; False: (B, 4 + nc, anchors) for NMS
    random_weights: bool
    description: str
    device: torch.device
    dtype: torch.dtype
    channels_last: bool

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Raw head output for a (B, 3, H, W) float batch in [0, 1]."""
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        out = self.module(images.to(self.dtype))
        out = out[0] if isinstance(out, (tuple, list)) else out  # eval mode returns (decoded, raw head dict)
        return out.float()


def _build(config: VisionConfig, module: nn.Module | None) -> tuple[nn.Module, bool, str]:
    if module is not None:
        # Our own copy: fusing and casting work in place, and the caller's module stays theirs.
        return copy.deepcopy(module), False, f"{type(module).__name__} (given module)"
    path = config.model
    if path.endswith((".yaml", ".yml")):
        from ultralytics import YOLO

        with torch.random.fork_rng(devices=[]):  # seeded build, without touching the caller's RNG
            torch.manual_seed(config.seed)
            model = YOLO(path, task="detect").model
        return model, True, f"{path} (RANDOM weights, seed {config.seed}: detections are meaningless)"
    if not path.endswith(".pt"):
        raise ValueError(f"model must be a .yaml model config or a .pt checkpoint, got {path!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model checkpoint not found: {path} (this runtime never downloads weights)")
    from ultralytics.nn.tasks import load_checkpoint

    model, _ = load_checkpoint(path, device="cpu")
    return model, False, path


def load_model(config: VisionConfig, module: nn.Module | None = None) -> LoadedModel:
    """The model of `config.model` (or a copy of `module`), ready for inference."""
    model, random_weights, description = _build(config, module)
    head = model.model[-1] if hasattr(model, "model") else None
    if head is None or not hasattr(head, "nc") or not hasattr(head, "stride"):
        raise ValueError(f"{description} is not a YOLO detection model (no Detect head)")
    # None: the end-to-end (NMS-free) head wherever the model has one (YOLO26, YOLOv10), which
    # is Ultralytics' predict(nms=False); False: the one-to-many head + NMS, its predict() default.
    want = config.end2end if config.end2end is not None else getattr(head, "one2one_cv2", None) is not None
    if hasattr(model, "end2end"):
        model.end2end = want  # before fuse(): fusion drops the head we do not use
    if hasattr(model, "fuse"):
        model = model.fuse(verbose=False)
    end2end = bool(getattr(model, "end2end", False))
    if end2end:
        # The head keeps its top-k before our confidence filter; at least 300, as Ultralytics does.
        head.max_det = max(config.max_det, 300)
    device = torch.device(config.device)
    dtype = TORCH_DTYPES[config.dtype]
    model = model.to(device).eval()
    model = model.to(dtype) if dtype != torch.float32 else model.float()
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    for p in model.parameters():
        p.requires_grad_(False)
    names = getattr(model, "names", None) or {i: str(i) for i in range(head.nc)}
    if isinstance(names, (list, tuple)):
        names = dict(enumerate(names))
    stride = max(int(head.stride.max()), 32)
    return LoadedModel(model, dict(names), stride, end2end, random_weights, description, device, dtype,
                       config.channels_last)  # fmt: skip
