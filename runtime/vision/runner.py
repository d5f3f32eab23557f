"""YoloRunner: a batch of BGR images in, one `Detections` per image out.

Work is split into `prepare` (letterbox into staging buffers, to a float tensor) and `infer`
(forward and postprocess) so the engine can prepare the next batch on one thread while the
current one runs on another. The runner keeps no per-call state on itself: everything a
call needs travels in the `Prepared` it returns, which is what makes that overlap safe.

Given a DeviceMemoryManager, a runner claims one instance name (`memory_owner`: "vision", a
second runner on the device "vision#2") and reserves its weights, batch buffers and activation
peak under it; `release_memory` gives all of them back at once.

On CUDA the two halves meet on the device, not on the host:

- `prepare` letterboxes into page-locked staging buffers (one per input shape, reused: see
  preprocess.BatchBuffers) and issues the uint8 copy and the cast to the model's dtype on a
  copy stream of the runner's own, then records an event. It returns without waiting, so the
  engine's batcher thread goes on to decode the next batch while the copy runs beside the
  forward pass of the batch before (on the default stream the copy would queue behind it).
- `infer` makes its stream wait for that event (on the device: the host does not block) and
  waits on the host once, where the results are read back.
- The per-image host work of a batch (decoding in runtime/vision/batch.py, letterboxing here)
  runs on a thread pool (`host_pool`). Measured on an H200 machine (16 cores), yolo26n at 640,
  960x960 JPEGs: the forward took ~0.4 ms per image at batch 32 while one thread decoding and
  letterboxing took ~14, so the engine ran at ~80 images/s at every batch size, a third of
  Ultralytics' predict (which decodes a batch on a thread pool). OpenCV and numpy release the
  GIL, so the threads decode side by side: with the pool (imgsz 320, 480x480 JPEGs, same
  machine) the engine ran 1,212 images/s in float32 and 1,460 in float16 at batch 32, against
  Ultralytics' 720 and 1,029. On CPU the cores belong to the inference workers, and that work
  stays on the calling thread, as before.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from runtime.memory import DeviceMemoryManager
from runtime.vision import backends
from runtime.vision.config import VisionConfig
from runtime.vision.jit import load_model_traced
from runtime.vision.postprocess import Detections, detections, head_rows, to_original
from runtime.vision.preprocess import BatchBuffers, Letterbox, letterbox_into, plan_letterbox, to_tensor

_HOST_POOL: ThreadPoolExecutor | None = None
_HOST_POOL_LOCK = threading.Lock()


def host_pool() -> ThreadPoolExecutor:
    """The process's thread pool for per-image host work of CUDA runners (one for all of them:
    they share the host's cores), created on first use, one core left to the forward's thread."""
    global _HOST_POOL
    with _HOST_POOL_LOCK:
        if _HOST_POOL is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            _HOST_POOL = ThreadPoolExecutor(max(1, min(16, cores - 1)), thread_name_prefix="vision-host")
        return _HOST_POOL


@dataclass(slots=True)
class Prepared:
    """A batch ready for the model: one tensor per input shape (rect letterboxing gives
    images of different aspect different shapes), with where each image landed."""

    groups: list[tuple[list[int], torch.Tensor, list[Letterbox]]]  # (batch positions, tensor, boxes)
    size: int
    preprocess_ms: float
    ready: torch.cuda.Event | None = None  # CUDA: recorded on the copy stream once the tensors are complete


class YoloRunner:
    def __init__(
        self,
        config: VisionConfig | None = None,
        module: nn.Module | None = None,
        memory: DeviceMemoryManager | None = None,
        workers: int = 1,
    ) -> None:
        """workers: how many batches run at once (the engine's inference workers), for the
        memory reservation; the runner itself is safe to call from that many threads.
        config.num_threads, when set, applies to the calling thread (torch's setting is per thread)."""
        self.config = config or VisionConfig()
        self.workers = workers
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        self.model = load_model_traced(self.config, module)
        self.names = self.model.names
        # The forward's engine (runtime/vision/backends.py); "auto" runs torch until the
        # start-up profile (profiling.py) picks one with use_backend.
        self.backend = "torch"
        self.export_s: dict[str, float] = {}  # seconds each backend loaded here spent exporting (0.0: cached)
        self.choice = None  # profiling.BackendChoice: what the start-up chose and what it cost
        self._forward = self.model.forward
        if self.config.backend not in ("auto", "torch"):
            self.use_backend(self.config.backend)
        cuda = self.model.device.type == "cuda"
        self._buffers = BatchBuffers(pin_memory=cuda)
        self._copy_stream = torch.cuda.Stream(self.model.device) if cuda else None
        # Decoding and letterboxing of a batch's images side by side (see the module docstring);
        # None: one after the other on the calling thread.
        self.host_pool: ThreadPoolExecutor | None = host_pool() if cuda else None
        self.memory = memory  # None once released
        self.memory_owner: str | None = None  # this runner's instance name ("vision", "vision#2", ...)
        if memory is not None:
            self.memory_owner = memory.claim("vision")
            try:
                self._reserve_memory(memory, self.memory_owner)
            except BaseException:
                self.release_memory()  # a reservation that does not fit leaves nothing behind
                raise

    @property
    def description(self) -> str:
        if self.backend == "torch":
            return self.model.description
        return f"{self.model.description} [{self.backend}]"

    def use_backend(self, name: str) -> None:
        """Run the forward on `name` (one of backends.BACKENDS), exported from this runner's
        weights (cached, see backends.py); the letterbox and the postprocess stay the same."""
        if name not in backends.BACKENDS:
            raise ValueError(f"backend must be one of {backends.BACKENDS}, got {name!r}")
        if name == "torch":
            self.backend, self._forward = name, self.model.forward
            return
        head = self.model.module.model[-1]
        max_det = int(getattr(head, "max_det", self.config.max_det))
        threads = self.config.num_threads or self.config.threads()[1]
        forward, export_s = backends.load_forward(self.config, name, self.model.end2end, max_det, self.workers, threads)
        self.export_s[name] = self.export_s.get(name, 0.0) + export_s
        self.backend, self._forward = name, forward

    # -- the two halves of a batch --
    def prepare(self, images: list[np.ndarray]) -> Prepared:
        t0 = time.perf_counter()
        c = self.config
        boxes = [plan_letterbox(im.shape[:2], c.imgsz, self.model.stride, c.rect) for im in images]
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, box in enumerate(boxes):
            by_shape.setdefault(box.input_shape, []).append(i)
        groups = []
        stream = self._copy_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for shape, idx in by_shape.items():
                staging = self._buffers.get(shape, len(idx))
                if self.host_pool is not None and len(idx) > 1:  # each image into its own row, side by side
                    rows = [(images[i], boxes[i], staging[row]) for row, i in enumerate(idx)]
                    list(self.host_pool.map(lambda args: letterbox_into(*args), rows))
                else:
                    for row, i in enumerate(idx):
                        letterbox_into(images[i], boxes[i], staging[row])
                if stream is None:
                    tensor = to_tensor(staging, self.model.device)
                else:  # issued, not waited for: the next group is letterboxed while this one copies
                    tensor = to_tensor(
                        staging, self.model.device, self.model.dtype, self._buffers.pinned(shape, len(idx))
                    )
                groups.append((idx, tensor, [boxes[i] for i in idx]))
            ready = None
            if stream is not None:
                ready = torch.cuda.Event()
                ready.record(stream)
                for shape in by_shape:
                    self._buffers.fence(shape, ready)  # the staging buffer is free once the copy is done
        return Prepared(groups, len(images), (time.perf_counter() - t0) * 1000, ready)

    def _await_inputs(self, prepared: Prepared) -> None:
        """CUDA: order this thread's stream after the copy stream's work for `prepared`, on the
        device (the host goes on). record_stream: the tensors were allocated on the copy
        stream, and the caching allocator must not give their memory back to it before this
        stream is done reading them."""
        if prepared.ready is None:
            return
        stream = torch.cuda.current_stream(self.model.device)
        stream.wait_event(prepared.ready)
        for _, tensor, _ in prepared.groups:
            tensor.record_stream(stream)

    def infer(self, prepared: Prepared, conf: float | None = None) -> list[Detections]:
        """conf: the confidence threshold instead of config.conf (mAP checks predict at 0.001)."""
        c = self.config
        conf = c.conf if conf is None else conf
        out: list[Detections | None] = [None] * prepared.size
        infer_ms = post_ms = 0.0
        self._await_inputs(prepared)
        for idx, tensor, boxes in prepared.groups:
            t0 = time.perf_counter()
            raw = self._forward(tensor)
            if raw.device.type == "cuda":
                # The batch's one host wait, for this stream only (the copy stream may be busy
                # with the next batch). An end-to-end head's output is small (B x k x 6): read it
                # back whole, so filtering it costs no device round trip per image.
                if self.model.end2end:
                    raw = raw.cpu()
                else:
                    torch.cuda.current_stream(raw.device).synchronize()
            t1 = time.perf_counter()
            rows = head_rows(raw, self.model.end2end, conf, c)
            for i, r, box in zip(idx, rows, boxes):
                out[i] = detections(to_original(r, box), self.names, box)
            infer_ms += (t1 - t0) * 1000
            post_ms += (time.perf_counter() - t1) * 1000
        n = prepared.size
        for d in out:  # per-image share of the batch's stage times, as Ultralytics reports speed
            d.batch_size = n
            d.timings = {
                "preprocess": prepared.preprocess_ms / n,
                "inference": infer_ms / n,
                "postprocess": post_ms / n,
            }
        return out  # type: ignore[return-value]

    def predict(self, images: list[np.ndarray], conf: float | None = None) -> list[Detections]:
        """Detections for each image, in one forward pass per input shape."""
        return self.infer(self.prepare(images), conf) if images else []

    def raw(self, images: list[np.ndarray]) -> list[torch.Tensor]:
        """The head's raw outputs per image (for parity checks against Ultralytics)."""
        prepared = self.prepare(images)
        self._await_inputs(prepared)
        out: list[torch.Tensor | None] = [None] * len(images)
        for idx, tensor, _ in prepared.groups:
            for i, r in zip(idx, self._forward(tensor)):
                out[i] = r
        return out  # type: ignore[return-value]

    # -- start-up measurements --
    def profile(self, batch_sizes: list[int], iters: int | None = None) -> dict[int, float]:
        """Images per second of the current backend's forward at each batch size (square imgsz input)."""
        iters = iters or self.config.profile_iters
        s = self.config.imgsz
        rates = {}
        cuda = self.model.device.type == "cuda"
        for bs in batch_sizes:
            # On CUDA the input arrives in the model's dtype (prepare casts on the copy stream).
            x = torch.full((bs, 3, s, s), 114 / 255, device=self.model.device, dtype=self.model.dtype if cuda else None)
            self._forward(x)  # warm-up: first calls pick kernels and allocate
            if cuda:
                torch.cuda.synchronize(x.device)  # the warm-up's kernels must not run into the timed ones
            t0 = time.perf_counter()
            for _ in range(iters):
                self._forward(x)
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            rates[bs] = bs * iters / (time.perf_counter() - t0)
        return rates

    def best_batch_size(self, rates: dict[int, float]) -> int:
        """The fastest size; a larger one must win by 5% to beat a smaller (timer noise)."""
        best = min(rates)
        for bs in sorted(rates):
            if rates[bs] > rates[best] * 1.05:
                best = bs
        return best

    def activation_bytes(self, batch_size: int) -> int:
        """Peak activation memory of a forward at `batch_size`.

        On CUDA this is measured (the allocator's peak around a forward). On CPU there is no
        allocator to ask, so it is estimated from one forward at batch 1: the largest
        input + output of any layer plus every output the model keeps for later layers
        (Ultralytics' `save` list), scaled by the batch size.
        """
        s = self.config.imgsz
        dev = self.model.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            self.model.forward(torch.zeros((batch_size, 3, s, s), device=dev))
            return int(torch.cuda.max_memory_allocated(dev) - base)
        layers = getattr(self.model.module, "model", None)
        saved = set(getattr(self.model.module, "save", []))
        sizes: list[tuple[int, int, int]] = []  # (index, input bytes, output bytes)

        def nbytes(t: object) -> int:
            if isinstance(t, torch.Tensor):
                return t.numel() * t.element_size()
            if isinstance(t, (list, tuple)):
                return sum(nbytes(v) for v in t)
            if isinstance(t, dict):
                return sum(nbytes(v) for v in t.values())
            return 0

        hooks = [
            m.register_forward_hook(lambda m, i, o, k=k: sizes.append((k, nbytes(i), nbytes(o))))
            for k, m in enumerate(layers or [])
        ]
        try:
            self.model.forward(torch.zeros((1, 3, s, s), device=dev), eager=True)  # the graph calls no hooks
        finally:
            for h in hooks:
                h.remove()
        if not sizes:
            return 0
        kept = sum(o for k, _, o in sizes if k in saved)
        return int((max(i + o for _, i, o in sizes) + kept) * batch_size)

    def _reserve_memory(self, memory: DeviceMemoryManager, owner: str) -> dict[str, int]:
        """Reserve weights, staging + input buffers for workers + 1 batches (one being prepared
        while each worker runs one) and an activation peak at max_batch_size per worker, under
        `owner`; MemoryError if they do not fit."""
        c = self.config
        top = c.batching.max_batch_size
        elem = torch.tensor([], dtype=self.model.dtype).element_size()
        per_image = c.imgsz * c.imgsz * 3 * (1 + 4 + (elem if elem != 4 else 0))  # uint8 staging, float32, cast
        amounts = {
            f"{owner}.weights": sum(p.numel() * p.element_size() for p in self.model.module.parameters()),
            f"{owner}.batch_buffers": (self.workers + 1) * top * per_image,
            f"{owner}.activations": self.workers * self.activation_bytes(top),
        }
        for name, n in amounts.items():
            memory.reserve(name, n)
        return amounts

    def release_memory(self) -> None:
        """Give back everything reserved under this runner's owner name; a second call does nothing
        (the name may belong to another engine by then)."""
        memory, self.memory = self.memory, None
        if memory is not None and self.memory_owner is not None:
            memory.release(self.memory_owner)
