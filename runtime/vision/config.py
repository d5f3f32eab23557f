"""VisionConfig: the YOLO runner's and the vision engine's knobs, validated without I/O.

Names follow Ultralytics' predict arguments (imgsz, conf, iou, max_det, vid_stride) and
NVIDIA Triton's dynamic batcher (max_batch_size, preferred_batch_sizes, max_queue_delay_ms),
so users find what they know.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MAX_CPU_WORKERS = 8  # each holds a batch of activations: bounds memory on many-core hosts (workers then get more threads)
DTYPES = ("float32", "bfloat16", "float16")


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
    end2end: bool | None = None  # None: the head mode the model was saved with; True/False forces it
    dtype: str = "float32"  # bfloat16/float16 only where parity still holds; float16 only on CUDA
    channels_last: bool = True  # NHWC convolutions: faster with oneDNN on CPU and cuDNN on GPU
    jit: bool = True  # CPU: run a traced TorchScript graph of the model (same results, less overhead)
    # Engine inference threads, each running whole batches with `num_threads` torch threads.
    # None: on CPU one per core (up to 8) with 1 thread each, on GPUs 1. See engine.py for why.
    workers: int | None = None
    num_threads: int | None = None  # torch intra-op threads (per engine worker); None: see workers
    seed: int = 0  # the random weights of a .yaml build, so runs are reproducible
    # Dynamic batching (schedulers.DynamicBatchConfig)
    max_batch_size: int = 8
    preferred_batch_sizes: tuple[int, ...] = ()  # (): use the size that profiling finds fastest
    max_queue_delay_ms: float = 5.0
    max_queue_size: int = 256
    default_timeout_ms: float | None = None
    priority_levels: int = 2
    profile: bool = True  # time each batch size at start-up to choose the preferred one
    profile_iters: int = 2

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
        _check_int("max_batch_size", self.max_batch_size, 1)
        self.preferred_batch_sizes = tuple(sorted(set(self.preferred_batch_sizes)))
        for size in self.preferred_batch_sizes:
            if not isinstance(size, int) or not 1 <= size <= self.max_batch_size:
                raise ValueError(
                    f"preferred_batch_sizes must hold integers in [1, max_batch_size={self.max_batch_size}], got {size!r}"
                )
        if isinstance(self.max_queue_delay_ms, bool) or not self.max_queue_delay_ms >= 0:
            raise ValueError(f"max_queue_delay_ms must be >= 0, got {self.max_queue_delay_ms!r}")
        _check_int("max_queue_size", self.max_queue_size, 1)
        if self.default_timeout_ms is not None and not self.default_timeout_ms > 0:
            raise ValueError(f"default_timeout_ms must be > 0 or None, got {self.default_timeout_ms!r}")
        _check_int("priority_levels", self.priority_levels, 1)
        _check_int("profile_iters", self.profile_iters, 1)
