"""VisionConfig: the YOLO runner's and the vision engine's knobs, validated without I/O.

Names follow Ultralytics' predict arguments (imgsz, conf, iou, max_det, vid_stride); the
request batching is one embedded `schedulers.DynamicBatchConfig` (NVIDIA Triton's names:
max_batch_size, preferred_batch_sizes, max_queue_delay_ms), validated there, once.

    VisionConfig(imgsz=320, batching=vision_batching(max_batch_size=4))
    VisionConfig.from_dict({"model": "yolo26n.yaml", "batching": {"max_batch_size": 4}})
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from schedulers.config import DynamicBatchConfig
from sources.base import DEFAULT_MAX_IMAGE_PIXELS, check_max_pixels

MAX_CPU_WORKERS = (
    8  # each holds a batch of activations: bounds memory on many-core hosts (workers then get more threads)
)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The forward's engine (runtime/vision/backends.py): torch is the exact Ultralytics parity path;
# the others run Ultralytics' own ONNX / OpenVINO export of the same weights; "auto" lets the
# start-up profile pick among those that hold mAP (see profiling.py).
BACKENDS = ("auto", "torch", "onnxruntime", "openvino")


# Where vision differs from the scheduler's defaults: a queued payload may be a decoded frame
# (a 1080p BGR frame is ~6 MB), so the queue is bounded tighter, and two priority levels let
# live streams (0) go before bulk jobs (1).
VISION_BATCHING = {"max_queue_size": 256, "priority_levels": 2}


def vision_batching(**overrides: Any) -> DynamicBatchConfig:
    """A DynamicBatchConfig with the vision defaults, `overrides` replacing them."""
    return DynamicBatchConfig(**{**VISION_BATCHING, **overrides})


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_unit(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


@dataclass(slots=True)
class VisionConfig:
    model: str = "yolo26n.yaml"  # a model .yaml (random weights) or a .pt checkpoint
    imgsz: int = 640  # letterbox target, a multiple of the model stride (32)
    conf: float = 0.25  # Ultralytics' predict default
    iou: float = 0.7  # NMS IoU (models without an end-to-end head)
    max_det: int = 300
    device: str = "cpu"
    rect: bool = True  # minimum-rectangle letterbox, as Ultralytics' predict does
    # None: the end-to-end (NMS-free) head where the model has one (YOLO26, YOLOv10: Ultralytics'
    # predict(nms=False)), else the one-to-many head + NMS; True/False forces it.
    end2end: bool | None = None
    # "auto": the fast path measured to keep accuracy (see resolved_dtype); "float32" keeps exact
    # parity with Ultralytics; float16 only on CUDA.
    dtype: str = "auto"
    channels_last: bool = True  # NHWC convolutions: faster with oneDNN on CPU and cuDNN on GPU
    jit: bool = True  # CPU: run a traced TorchScript graph of the model (same results, less overhead)
    # Engine inference threads, each running whole batches with `num_threads` torch threads.
    # None: on CPU one per core (up to 8) with 1 thread each, on GPUs 1. See engine.py for why.
    workers: int | None = None
    num_threads: int | None = None  # torch intra-op threads (per engine worker); None: see workers
    seed: int = 0  # the random weights of a .yaml build, so runs are reproducible
    # Request batching; preferred_batch_sizes (): use the size that profiling finds fastest.
    batching: DynamicBatchConfig = field(default_factory=vision_batching)
    profile: bool = True  # time each batch size at start-up to choose the preferred one
    profile_iters: int = 2
    # The most pixels (width x height) an input may have: encoded images are sized from their
    # header and refused before decoding (paths here; bytes and URLs in the workers and the
    # server, stream frames in the camera service, all with this value); decoded arrays over
    # it are refused too. 8192 x 8192 = 67.1 Mpx, 8x 4K: see sources.base.DEFAULT_MAX_IMAGE_PIXELS.
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    # Only these class ids are kept (Ultralytics' predict `classes`); None keeps every class.
    classes: tuple[int, ...] | None = None
    # torch here, "auto" on the CLI (runtime/vision/flags.py): the Python API keeps Ultralytics'
    # exact results by default, and an engine built in a test or a bench pays no exports.
    backend: str = "torch"

    def threads(self) -> tuple[int, int | None]:
        """(inference workers, torch threads per worker; None: torch's default)."""
        if not self.device.startswith("cpu"):
            return self.workers or 1, self.num_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = self.workers or min(cores, MAX_CPU_WORKERS)
        return workers, self.num_threads or max(1, cores // workers)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path or model name, got {self.model!r}")
        _check_int("imgsz", self.imgsz, 32)
        if self.imgsz % 32:
            raise ValueError(f"imgsz must be a multiple of 32 (the model stride), got {self.imgsz}")
        _check_unit("conf", self.conf)
        _check_unit("iou", self.iou)
        _check_int("max_det", self.max_det, 1)
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.startswith(("cuda", "mps"))):
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.dtype == "float16" and not self.device.startswith("cuda"):
            raise ValueError(f"dtype 'float16' needs a CUDA device, got device {self.device!r}")
        if self.num_threads is not None:
            _check_int("num_threads", self.num_threads, 1)
        if self.workers is not None:
            _check_int("workers", self.workers, 1)
        if not isinstance(self.batching, DynamicBatchConfig):
            raise ValueError(
                f"batching must be a schedulers.DynamicBatchConfig (VisionConfig.from_dict takes a dict), "
                f"got {type(self.batching).__name__}"
            )
        _check_int("profile_iters", self.profile_iters, 1)
        check_max_pixels(self.max_image_pixels)
        if self.classes is not None:
            if isinstance(self.classes, list):
                self.classes = tuple(self.classes)
            if not isinstance(self.classes, tuple) or not self.classes:
                raise ValueError(f"classes must be a non-empty list of class ids (integers >= 0), got {self.classes!r}")
            for c in self.classes:
                if not isinstance(c, int) or isinstance(c, bool) or c < 0:
                    raise ValueError(f"classes must hold integers >= 0, got {c!r} in {self.classes!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    def resolved_dtype(self) -> str:
        """The dtype "auto" stands for on this machine: bfloat16 on CPUs that compute it natively
        (AMX / AVX512-BF16, as oneDNN reports), float16 on CUDA GPUs, float32 elsewhere.

        Each is the default only because its accuracy was measured on the shipped detector's
        200 held-out test images (runtime/vision/evaluate.py), mAP50-95 against float32:
        bfloat16 on CPU (box-regression convs kept in float32, see
        model.box_convs_in_float32) 0.7836 vs 0.7830 with the end-to-end head and 0.8054 vs
        0.8065 with the NMS head (tests/test_vision_accuracy.py holds both within 0.5 points);
        float16 on an H200 0.7829 vs 0.7830 (benchmarks.gpu_vision). Ask for "float32" for
        results identical to Ultralytics'.
        """
        if self.dtype != "auto":
            return self.dtype
        from runtime.dtypes import cpu_has_native_bf16

        if self.device.startswith("cuda"):
            return "float16"
        if self.device == "cpu" and cpu_has_native_bf16():
            return "bfloat16"
        return "float32"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        """A config from plain fields, `batching` as a nested dict (over the vision defaults);
        unknown keys are named in the ValueError, nested ones as "batching.<key>"."""
        if not isinstance(d, dict):
            raise ValueError(f"a VisionConfig is built from a dict of fields, got {type(d).__name__}")
        d = dict(d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            moved = sorted(set(unknown) & {f.name for f in fields(DynamicBatchConfig)})
            hint = f" (batching fields go under 'batching': {', '.join(moved)})" if moved else ""
            raise ValueError(f"unknown VisionConfig field(s) {', '.join(map(repr, unknown))}{hint}")
        batching = d.get("batching")
        if isinstance(batching, dict):
            allowed = {f.name for f in fields(DynamicBatchConfig)}
            unknown = sorted(set(batching) - allowed)
            if unknown:
                raise ValueError(f"unknown batching field(s) {', '.join(repr(f'batching.{k}') for k in unknown)}")
            try:
                d["batching"] = vision_batching(**batching)
            except ValueError as exc:
                raise ValueError(f"batching.{exc}") from None
        return cls(**d)
