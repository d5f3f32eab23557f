"""How fast the vision runner is at each batch size, measured once per model, input size and
machine and kept in a small JSON cache (TANDEM_CACHE_DIR, or ~/.cache/tandem), and the
preferred batch size it gives the dynamic batcher."""

from __future__ import annotations

import dataclasses

import torch

from runtime.threads import run_in_thread
from runtime.vision.config import VisionConfig
from runtime.vision.runner import YoloRunner
from schedulers import DynamicBatchConfig

PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _profile_key(config: VisionConfig, sizes: list[int], threads: int | None, backend: str = "torch") -> str:
    """What the rates depend on: the model (and its file's size and time), the input size, the
    numeric settings, the threads and the machine (CPU model, cores, torch, GPU)."""
    import hashlib
    import json
    import os
    import platform

    model = config.model
    stamp = None
    if os.path.isfile(model):
        st = os.stat(model)
        model, stamp = os.path.abspath(model), [st.st_size, st.st_mtime_ns]
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    gpu = torch.cuda.get_device_name(torch.device(config.device)) if config.device.startswith("cuda") else None
    key = {
        "model": model,
        "stamp": stamp,
        "imgsz": config.imgsz,
        "dtype": config.resolved_dtype(),
        "device": config.device,
        "channels_last": config.channels_last,
        "jit": config.jit,
        "end2end": config.end2end,
        "sizes": sizes,
        "iters": config.profile_iters,
        "workers": config.threads()[0],
        "threads": threads,
        "host": platform.node(),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "gpu": gpu,
        **({} if backend == "torch" else {"backend": backend}),  # torch keeps the keys cached before backends
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _profile_cache_path() -> str:
    import os

    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    return os.path.join(root, "vision_profiles.json")


def _cached_rates(key: str, measure) -> dict[int, float]:
    """Rates from the profile cache, or measured and stored. Half of `tandem detect image.jpg`
    was this profiling (6 of 13 s); a cache miss or an unreadable cache only costs that."""
    import json
    import os
    import tempfile

    path = _profile_cache_path()
    try:
        with open(path) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    if not isinstance(cache, dict):
        cache = {}
    hit = cache.get(key)
    if isinstance(hit, dict) and hit:
        try:
            return {int(k): float(v) for k, v in hit.items()}
        except (TypeError, ValueError):
            pass
    rates = measure()
    cache[key] = {str(k): v for k, v in rates.items()}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".profiles-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: profile again next time
    return rates


def profiled_batching(
    runner: YoloRunner, config: VisionConfig, threads: int | None, cache: bool = False
) -> tuple[DynamicBatchConfig, dict[int, float]]:
    """config.batching, with the size profiling finds fastest as the preferred batch size when
    none is configured (and config.profile); and the measured images/s by batch size.
    `cache`: reuse rates measured before for the same model, input size and machine."""
    batching = config.batching
    if batching.preferred_batch_sizes or not config.profile:
        return batching, {}
    top = batching.max_batch_size
    sizes = sorted({b for b in PROFILE_SIZES if b <= top} | {top})

    # One worker's rates, measured the way a worker runs (its own thread and thread count).
    def measure() -> dict[int, float]:
        return run_in_thread(lambda: runner.profile(sizes), threads)

    if config.backend == "auto":
        return _auto_backend(runner, config, threads, sizes, cache, measure)
    rates = _cached_rates(_profile_key(config, sizes, threads), measure) if cache else measure()
    return dataclasses.replace(batching, preferred_batch_sizes=(runner.best_batch_size(rates),)), rates


# What backend "auto" chooses among: the float32 exports, whose mAP on the shipped detector's
# held-out set is held within 0.5 points of torch float32 by tests/test_vision_backends.py (their
# outputs agree with torch to ~3e-5), and torch in the dtype the accuracy rule resolves
# (tests/test_vision_accuracy.py). int8 (backends "onnxruntime-int8") is not among them: see
# backends.py for its measured mAP and speed.
AUTO_CANDIDATES = ("torch", "onnxruntime", "openvino")


def _auto_backend(runner, config, threads, sizes, cache, measure):
    """Backend "auto": each candidate's rates (cached like torch's), then the (backend, batch
    size) with the most images/s; another backend must beat torch by 5% (timer noise)."""
    import importlib.util

    results: dict[str, dict[int, float]] = {}
    for name in AUTO_CANDIDATES:
        if name != "torch" and (config.device != "cpu" or importlib.util.find_spec(name) is None):
            continue
        runner.use_backend(name)
        key = _profile_key(config, sizes, threads, name)
        results[name] = _cached_rates(key, measure) if cache else measure()
    best = "torch"
    for name, rates in results.items():
        if max(rates.values()) > max(results[best].values()) * 1.05:
            best = name
    runner.use_backend(best)
    runner.backend_rates = {k: dict(v) for k, v in results.items()}
    rates = results[best]
    return dataclasses.replace(config.batching, preferred_batch_sizes=(runner.best_batch_size(rates),)), rates
