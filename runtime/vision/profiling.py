"""How fast the vision runner is at each batch size, measured once per model, input size and
machine and kept in a small JSON cache (TANDEM_CACHE_DIR, or ~/.cache/tandem), and the
preferred batch size it gives the dynamic batcher; with backend "auto", also the backend it
runs on (the fastest of those that hold the mAP rule), chosen the same way.

What the start-up chose and what choosing cost (exports, timing) is a `BackendChoice` on the
runner, which the front-end logs and reports in its stats. Measured on the shipped detector at
320, 2-core AMD EPYC under load, a clean cache: the engine's start-up with "auto" took 10.8 s
(two exports 6.9 s, three backends timed 2.8 s; `tandem detect bus.jpg` 16 s in all against
torch's 4.5 s); the next start read the rates, loaded only the backend chosen and took 0.5 s.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import torch

from runtime.threads import run_in_thread
from runtime.vision import backends
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


def _load_rates(key: str) -> dict[int, float] | None:
    """The rates the profile cache holds for `key`, or None (a miss, or an unreadable cache)."""
    import json

    try:
        with open(_profile_cache_path()) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        return None
    hit = cache.get(key) if isinstance(cache, dict) else None
    if isinstance(hit, dict) and hit:
        try:
            return {int(k): float(v) for k, v in hit.items()}
        except (TypeError, ValueError):
            pass
    return None


def _store_rates(key: str, rates: dict[int, float]) -> None:
    """Add `rates` under `key` to the profile cache (a read-only home: profile again next time)."""
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
    cache[key] = {str(k): v for k, v in rates.items()}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".profiles-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


def _rates(key: str, cache: bool, measure: Callable[[], dict[int, float]], prepare=None) -> tuple[dict, float]:
    """(rates, seconds spent measuring them): from the profile cache when `cache` and it holds
    them (0.0 s), else `prepare()` (say, loading a backend; not timed) and measured, then stored.
    Half of `tandem detect image.jpg` was this profiling (6 of 13 s); a cache miss or an
    unreadable cache only costs that."""
    rates = _load_rates(key) if cache else None
    if rates is not None:
        return rates, 0.0
    if prepare is not None:
        prepare()
    t0 = time.perf_counter()
    rates = measure()
    seconds = time.perf_counter() - t0
    if cache:
        _store_rates(key, rates)
    return rates, seconds


# A measure function: the runner's images/s at each batch size, on the backend it runs now.
Measure = Callable[[YoloRunner, list[int]], dict[int, float]]


@dataclasses.dataclass(slots=True)
class BackendChoice:
    """What the start-up runs the forward on, why, and what finding out cost."""

    requested: str  # config.backend
    backend: str  # what runs
    why: str
    export_s: float = 0.0  # exports made at this start (0.0: none needed, or all cached)
    profile_s: float = 0.0  # timing forwards (0.0: the rates were cached, or no profile)
    rates: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)  # by candidate, by batch size
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # candidate: why it was not measured

    def summary(self) -> dict:
        """The plain-data record stats() reports."""
        return {
            "requested": self.requested,
            "backend": self.backend,
            "why": self.why,
            "export_s": round(self.export_s, 2),
            "profile_s": round(self.profile_s, 2),
            "images_per_s": {name: round(max(r.values()), 2) for name, r in self.rates.items() if r},
            "skipped": dict(self.skipped),
        }


def profiled_batching(
    runner: YoloRunner,
    config: VisionConfig,
    threads: int | None,
    cache: bool = False,
    measure: Measure | None = None,
) -> tuple[DynamicBatchConfig, dict[int, float]]:
    """config.batching, with the size profiling finds fastest as the preferred batch size when
    none is configured (and config.profile); and the measured images/s by batch size. With
    backend "auto" the runner is left on the fastest candidate. `cache`: reuse rates measured
    before for the same model, input size and machine. `measure`: how rates are taken
    (default: runner.profile on a thread of `threads` torch threads, as a worker runs).
    What was chosen, and what it cost, is left in runner.choice."""
    batching = config.batching
    if measure is None:
        measure = lambda r, sizes: run_in_thread(lambda: r.profile(sizes), threads)  # noqa: E731
    auto = config.backend == "auto"
    if not config.profile or (batching.preferred_batch_sizes and not auto):
        why = "configured" if not auto else "auto without the start-up profile (profile=False / --no-profile): torch"
        runner.choice = BackendChoice(config.backend, runner.backend, why, sum(runner.export_s.values()))
        return batching, {}
    if batching.preferred_batch_sizes:  # "auto" with sizes given: the backends are timed at those
        sizes = sorted(set(batching.preferred_batch_sizes))
    else:
        top = batching.max_batch_size
        sizes = sorted({b for b in PROFILE_SIZES if b <= top} | {top})
    if auto:
        rates = _auto_backend(runner, config, threads, sizes, cache, measure)
    else:
        key = _profile_key(config, sizes, threads, runner.backend)
        rates, profile_s = _rates(key, cache, lambda: measure(runner, sizes))
        runner.choice = BackendChoice(
            config.backend,
            runner.backend,
            "configured",
            sum(runner.export_s.values()),
            profile_s,
            {runner.backend: rates},
        )
    if batching.preferred_batch_sizes:
        return batching, rates
    return dataclasses.replace(batching, preferred_batch_sizes=(runner.best_batch_size(rates),)), rates


# What backend "auto" chooses among: the exports, whose mAP on the shipped detector's held-out
# set is held within 0.5 points of torch float32 by tests/test_vision_backends.py (in float32 and
# in the precision the default dtype gives them; their outputs agree with torch to ~3e-5), and
# torch in the dtype the accuracy rule resolves (tests/test_vision_accuracy.py). int8 (backend
# "onnxruntime-int8") is not among them: see backends.py for its measured mAP and speed.
AUTO_CANDIDATES = ("torch", "onnxruntime", "openvino")
AUTO_MARGIN = 1.05  # another backend must beat torch by 5% (timer noise): torch is the parity path


def _auto_backend(runner, config, threads, sizes, cache, measure) -> dict[int, float]:
    """Backend "auto": each candidate's rates (cached like torch's: a warm start loads only the
    one chosen), then the backend with the most images/s at its best batch size. A candidate
    that is not installed, or that fails to export this model, is skipped and named."""
    results: dict[str, dict[int, float]] = {}
    skipped: dict[str, str] = {}
    profile_s = 0.0
    for name in AUTO_CANDIDATES:
        why_not = backends.unavailable(name, config.device)
        if why_not:
            skipped[name] = why_not
            continue
        key = _profile_key(config, sizes, threads, name)
        try:
            rates, seconds = _rates(
                key, cache, lambda: measure(runner, sizes), functools.partial(runner.use_backend, name)
            )
        except Exception as exc:  # an exporter that cannot take this model: torch and the others remain
            if name == "torch":
                raise
            skipped[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
            continue
        results[name], profile_s = rates, profile_s + seconds
    best = "torch"
    for name, rates in results.items():
        if max(rates.values()) > max(results[best].values()) * AUTO_MARGIN:
            best = name
    if runner.backend != best:
        runner.use_backend(best)
    runner.choice = BackendChoice(
        "auto", best, _why(best, results, skipped), sum(runner.export_s.values()), profile_s, results, skipped
    )
    return results[best]


def _why(best: str, results: dict[str, dict[int, float]], skipped: dict[str, str]) -> str:
    """'auto: openvino 412 images/s at batch 1, torch 301, onnxruntime 350; ...' (each at its best size)."""
    peak = {name: max(rates.values()) for name, rates in results.items()}
    top = max(results[best], key=results[best].get)
    text = f"auto: {best} {peak[best]:.0f} images/s at batch {top}"
    text += "".join(f", {name} {peak[name]:.0f}" for name in results if name != best)
    if best == "torch" and len(results) > 1:
        text += f"; another backend must beat torch by {AUTO_MARGIN - 1:.0%}"
    for name, reason in skipped.items():
        text += f"; {name} not tried: {reason}"
    return text
