"""A traced TorchScript graph of the prepared YOLO module, for CPU inference.

Why: on a few CPU cores an eager YOLO-n forward spends a large share of its time outside the
convolutions, in Python (module calls, the head's dict plumbing) and in dispatching ~300
small ops one at a time. `torch.jit.trace` records the ops once, which removes that overhead
while running the very same oneDNN kernels: on the shapes checked here the output is
bit-identical to eager.

What is traced is a function that calls the module, not the module: the weights are then
recorded as constants that share the module's storage (no copy), which is what
`torch.jit.freeze` would give, while building takes ~0.2 s instead of ~0.65 s (scripting
the ~370 submodules of a traced module is most of that). Measured on a 2-core AVX-512 Xeon,
yolo26n at 640: a frozen module ran no faster than the traced function;
`torch.jit.optimize_for_inference` (MKLDNN tensors) was slower with channels_last; oneDNN
Graph fusion (`torch.jit.enable_onednn_fusion`) gave no steady-state gain but recompiled for
every new input shape (~0.3 s each) and is a process-wide switch.

One graph serves every input shape: the head computes its anchors from the feature-map
sizes, which the trace records as operations on the input's size. Two things it records as
constants instead, both handled here: the anchors the head may have cached for the tracing
shape (the cache is cleared before tracing), and an end-to-end head's top-k size
min(max_det, anchors) (inputs with fewer anchors run eager). The graph is then checked
against eager on a second shape and batch size; any mismatch or tracing error keeps the
model eager, with a warning.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Hashable

import torch
from torch import nn

from runtime.vision.config import VisionConfig
from runtime.vision.model import LoadedModel, anchors, head_output, load_model

# Graph vs eager on the check input. float32: the raw-output tolerance of the Ultralytics parity
# test (observed: 0). bfloat16 keeps ~3 significant digits, so only a gross error (a shape
# baked into the trace) should fail it.
CHECK_TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (2e-2, 2e-1)}  # (rtol, atol)

# Verified graphs of seeded .yaml builds, whose weights the key determines: a process that
# builds the same model again (tests, a second engine) skips tracing and the check. A traced
# function holds no state between calls and is safe to call from several threads.
_CACHE: OrderedDict[Hashable, tuple[torch.jit.ScriptFunction, int]] = OrderedDict()
CACHE_SIZE = 4


class _HeadTensor(nn.Module):
    """The module as a tensor-in, tensor-out function (tracing cannot return the head's dict)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return head_output(self.module(images.to(self.dtype)))


def _check_shape(imgsz: int, stride: int, strides: tuple[int, ...], min_anchors: int) -> tuple[int, ...]:
    """A batch-2 rect input (a different batch size, height and width ratio than the trace's
    square batch 1), so that a size baked into the graph shows up as a mismatch; square when
    the rect one has too few anchors for an end-to-end graph (very small imgsz)."""
    h = max(stride, imgsz * 3 // 4 // stride * stride)
    return (2, 3, h if anchors((h, imgsz), strides) >= min_anchors else imgsz, imgsz)


def build_graph(model: LoadedModel, imgsz: int, cache_key: Hashable | None = None) -> bool:
    """Set model.graph to a verified traced graph; False (and a warning) where it cannot be.
    cache_key: only where it identifies the weights (a seeded build), see _CACHE."""
    if cache_key is not None and cache_key in _CACHE:
        _CACHE.move_to_end(cache_key)
        model.graph, model.graph_min_anchors = _CACHE[cache_key]
        return True
    memory_format = torch.channels_last if model.channels_last else torch.contiguous_format
    square = torch.full((1, 3, imgsz, imgsz), 114 / 255, device=model.device).contiguous(memory_format=memory_format)
    head = model.module.model[-1]
    min_anchors = min(int(head.max_det), anchors((imgsz, imgsz), model.strides)) if model.end2end else 0
    shape = _check_shape(imgsz, model.stride, model.strides, min_anchors)
    check = torch.rand(shape, generator=torch.Generator().manual_seed(0))
    check = check.to(model.device).contiguous(memory_format=memory_format)
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings about Python-side branches, handled above
            head.shape = None  # recompute (and so record) the anchors instead of baking a cache in
            wrapper = _HeadTensor(model.module, model.dtype).eval()
            graph = torch.jit.trace(lambda x: wrapper(x), square, check_trace=False)
            expected = model.forward(check, eager=True)
            for _ in range(2):  # the first two calls of a graph profile and optimise it
                got = graph(check)
    except Exception as exc:  # noqa: BLE001 - any model the tracer cannot handle still runs eager
        warnings.warn(f"TorchScript tracing failed, running eager: {exc}", RuntimeWarning, stacklevel=2)
        return False
    rtol, atol = CHECK_TOLERANCE.get(model.dtype, CHECK_TOLERANCE[torch.bfloat16])
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=rtol, atol=atol):
        warnings.warn(
            "the traced graph disagrees with the eager model on a second input shape; running eager",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    model.graph, model.graph_min_anchors = graph, min_anchors
    if cache_key is not None:
        _CACHE[cache_key] = (graph, min_anchors)
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return True


def load_model_traced(config: VisionConfig, module: nn.Module | None = None) -> LoadedModel:
    """`load_model`, plus the traced graph where `config.jit` asks for one (on CPU, where the
    dispatch overhead it removes is the cost)."""
    loaded = load_model(config, module)
    if config.jit and loaded.device.type == "cpu":
        key = None
        if loaded.random_weights:  # the .yaml and the seed determine the weights
            head = loaded.module.model[-1]
            key = (
                config.model,
                config.seed,
                config.imgsz,
                config.resolved_dtype(),
                config.channels_last,
                loaded.end2end,
                int(getattr(head, "max_det", 0)),
                config.device,
            )
        build_graph(loaded, config.imgsz, key)
    return loaded
