"""Loading a YOLO detection model from a .yaml (random weights), a .pt checkpoint or a module.

The module is prepared the way Ultralytics' AutoBackend prepares a .pt model (Conv+BN
fused, eval, float, no grads, the head's mode chosen before fusion drops the other head),
which is what makes our detections match `YOLO(...).predict(...)` to float rounding.

On CPU the prepared module is then traced once into a TorchScript graph (`config.jit`, see
runtime.vision.jit): the same operations without Python's per-layer dispatch, which changes
no result bit on the shapes it is verified on.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from runtime.vision.config import VisionConfig
from runtime.vision.ultralytics_import import import_ultralytics

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
    strides: tuple[int, ...] = (8, 16, 32)  # the head's, for counting anchors
    # The traced TorchScript graph (runtime.vision.jit) and the fewest head anchors an input
    # must give for it: an end-to-end head's top-k size is a constant in the graph.
    graph: Callable[[torch.Tensor], torch.Tensor] | None = None
    graph_min_anchors: int = 0
    # The eager head caches its anchors on itself per input shape, so two threads running
    # different shapes at once would swap anchors: eager forwards take turns.
    eager_lock: threading.Lock = field(default_factory=threading.Lock)

    @torch.inference_mode()
    def forward(self, images: torch.Tensor, eager: bool = False) -> torch.Tensor:
        """Raw head output for a (B, 3, H, W) float batch in [0, 1]; eager=True skips the
        traced graph (forward hooks, which the graph does not call, need that)."""
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if self.graph is not None and not eager and anchors(images.shape[-2:], self.strides) >= self.graph_min_anchors:
            return self.graph(images)
        with self.eager_lock:
            return head_output(self.module(images.to(self.dtype)))


def head_output(out: object) -> torch.Tensor:
    """The decoded head tensor in float32 (eval mode returns (decoded, raw head dict))."""
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.float()  # type: ignore[union-attr]


def anchors(hw: tuple[int, int] | torch.Size, strides: tuple[int, ...] = (8, 16, 32)) -> int:
    """How many anchor points the head has for an (h, w) input (one per cell per stride)."""
    return sum((hw[0] // s) * (hw[1] // s) for s in strides)


def _input_to_float32(module: nn.Module, args: tuple) -> tuple:
    return (args[0].float(),)


def box_convs_in_float32(head: nn.Module) -> int:
    """Run the head's last box-regression convolutions (the 1x1 convs that emit the box
    distances, one per stride) in float32 in a bfloat16 model; returns how many.

    Why: those outputs, in grid units, are multiplied by the stride (up to 32) to give pixels,
    and bfloat16 keeps 8 significant bits: a distance of ~10 rounds in steps of 1/16 of a cell,
    up to 2 px, so every box moved. Measured on the shipped detector's 200 held-out images:
    bfloat16 mAP50-95 0.7792 with them in bfloat16, 0.7836 in float32 (float32 throughout:
    0.7830), and no measurable cost (3 tiny convs; the forward at batch 8 ran 8.3 to 8.7 ms an
    image either way). The class scores stay bfloat16: a sigmoid's rounding moves no box.
    `torch.cat` of the float32 boxes with the bfloat16 scores promotes the rest to float32."""
    n = 0
    for name in ("one2one_cv2", "cv2"):  # end-to-end heads keep only one2one_* after fuse()
        for branch in getattr(head, name, None) or []:
            last = branch[-1] if isinstance(branch, nn.Sequential) else None
            if isinstance(last, nn.Conv2d):
                last.float()
                last.register_forward_pre_hook(_input_to_float32)
                n += 1
    return n


def _build(config: VisionConfig, module: nn.Module | None) -> tuple[nn.Module, bool, str]:
    if module is not None:
        # Our own copy: fusing and casting work in place, and the caller's module stays theirs.
        return copy.deepcopy(module), False, f"{type(module).__name__} (given module)"
    path = config.model
    if path.endswith((".yaml", ".yml")):
        import_ultralytics()
        from ultralytics import YOLO

        with torch.random.fork_rng(devices=[]):  # seeded build, without touching the caller's RNG
            torch.manual_seed(config.seed)
            model = YOLO(path, task="detect").model
        return model, True, f"{path} (RANDOM weights, seed {config.seed}: detections are meaningless)"
    if not path.endswith(".pt"):
        raise ValueError(f"model must be a .yaml model config or a .pt checkpoint, got {path!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model checkpoint not found: {path} (this runtime never downloads weights)")
    import_ultralytics()
    from ultralytics.nn.tasks import load_checkpoint

    model, _ = load_checkpoint(path, device="cpu")
    return model, False, path


def load_model(config: VisionConfig, module: nn.Module | None = None) -> LoadedModel:
    """The model of `config.model` (or a copy of `module`), ready for eager inference;
    runtime.vision.jit.load_model_traced adds the traced graph that `config.jit` asks for."""
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
    dtype = TORCH_DTYPES[config.resolved_dtype()]
    model = model.to(device).eval()
    model = model.to(dtype) if dtype != torch.float32 else model.float()
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if dtype == torch.bfloat16:
        box_convs_in_float32(model.model[-1])
    for p in model.parameters():
        p.requires_grad_(False)
    names = getattr(model, "names", None) or {i: str(i) for i in range(head.nc)}
    if isinstance(names, (list, tuple)):
        names = dict(enumerate(names))
    stride = max(int(head.stride.max()), 32)
    loaded = LoadedModel(
        model,
        dict(names),
        stride,
        end2end,
        random_weights,
        description,
        device,
        dtype,
        config.channels_last,
        tuple(int(v) for v in head.stride),
    )
    return loaded
