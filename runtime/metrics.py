"""Serving metrics: plain-Python counters and histograms, kept by whoever serves (a Runtime, a
camera service), snapshotted as JSON, and rendered for Prometheus under vLLM's names with a
`tandem:` prefix (`tandem:time_to_first_token_seconds`, `tandem:num_requests_running`, ...).

Why JSON snapshots and not prometheus_client objects in each process: a fleet is many
processes (workers, camera services) behind one `tandem serve`. Each publishes its snapshot to
Redis at every heartbeat (`publish`), and the server's `/metrics` renders all of them
(`render`), each under its own `tandem_instance` label: one scrape sees the whole fleet, and nothing
here imports torch or prometheus_client until a scrape renders.

    m = ServingMetrics()
    m.observe_request(output)                      # a finished RequestOutput (loop thread)
    m.observe_vision_batch(size, queue_delays_s)   # a vision batch (worker thread)
    snap = m.snapshot(gauges={"num_requests_running": 3, "kv_cache_usage_perc": 0.4})
    text = render([{"instance": "w1", "kind": "runtime", "metrics": snap}])
"""

from __future__ import annotations

import bisect
import json
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

PREFIX = "tandem:"
METRICS_INDEX = "tandem:metrics"  # Redis zset: instance id -> last publish time
METRICS_KEY = "tandem:metrics:"  # + instance id: its JSON payload, expiring

# Buckets as vLLM's (seconds), so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
VISION_DELAY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.033, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# name -> (help, buckets); every histogram a ServingMetrics keeps.
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time to first token: arrival to first generated token.", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Time between successive generated tokens of a request.", ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Arrival to finish of a request.", LATENCY_BUCKETS),
    "request_queue_time_seconds": ("Arrival to first scheduled step of a request.", LATENCY_BUCKETS),
    "vision_batch_size": ("Images per vision forward pass.", BATCH_SIZE_BUCKETS),
    "vision_queue_delay_seconds": ("Arrival of an image to the start of its batch.", VISION_DELAY_BUCKETS),
}
# name -> help; plain counters (a `_total` suffix is added on rendering).
COUNTERS = {
    "prompt_tokens": "Prompt tokens of finished requests.",
    "generation_tokens": "Generated tokens of finished requests.",
    "vision_images": "Images detected.",
    "vision_batches": "Vision forward passes.",
    "num_preemptions": "Requests preempted (KV blocks taken back, recomputed later).",
}
# name -> help; gauges a snapshot carries (read from the engines when it is taken).
GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV cache blocks in use (1 = full).",
    "vision_queue_depth": "Images queued for detection.",
}


class Histogram:
    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum, "count": self.count}


class ServingMetrics:
    """Thread-safe: the loop thread observes requests, vision workers observe batches, and a
    heartbeat or scrape thread takes snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.histograms = {name: Histogram(buckets) for name, (_, buckets) in HISTOGRAMS.items()}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.finished: dict[str, int] = {}  # finished_reason -> requests

    def observe_request(self, out: Any) -> None:
        """A finished RequestOutput: its latencies, its tokens and why it finished. Requests
        that failed before their first step (a queue timeout) count by reason only."""
        m = out.metrics
        reason = out.finish_reason or "abort"
        if out.error_code:
            reason = out.error_code if reason == "abort" else reason
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.counters["prompt_tokens"] += len(out.prompt_token_ids)
            self.counters["generation_tokens"] += len(out.token_ids)
            h = self.histograms
            if m.first_scheduled_time is not None:
                h["request_queue_time_seconds"].observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                h["time_to_first_token_seconds"].observe(m.first_token_time - m.arrival_time)
            if m.finished_time is not None:
                h["e2e_request_latency_seconds"].observe(m.finished_time - m.arrival_time)
            t = m.token_times
            itl = h["inter_token_latency_seconds"]
            for a, b in zip(t, t[1:]):  # once per finished request, not per step
                itl.observe(b - a)

    def observe_vision_batch(self, size: int, queue_delays_s: Iterable[float] = ()) -> None:
        with self._lock:
            self.counters["vision_batches"] += 1
            self.counters["vision_images"] += size
            self.histograms["vision_batch_size"].observe(size)
            delay = self.histograms["vision_queue_delay_seconds"]
            for d in queue_delays_s:
                delay.observe(max(0.0, d))

    def add(self, counter: str, n: int) -> None:
        with self._lock:
            self.counters[counter] += n

    def snapshot(self, gauges: dict[str, float] | None = None) -> dict:
        """JSON-ready: {"counters", "finished", "histograms", "gauges"}."""
        with self._lock:
            return {
                "counters": dict(self.counters),
                "finished": dict(self.finished),
                "histograms": {name: h.to_dict() for name, h in self.histograms.items()},
                "gauges": dict(gauges or {}),
            }


def runtime_payload(runtime: Any, model_name: str | None) -> dict:
    """What a process serving a Runtime publishes (a worker) or renders itself (`tandem serve
    --embedded`): what it serves, its model, and its metrics snapshot."""
    payload: dict[str, Any] = {"kind": "runtime", "serves": [], "metrics": runtime.metrics_snapshot()}
    if runtime.llm is not None:
        payload.update(serves=["llm"], model_name=model_name, max_model_len=runtime.max_model_len)
        # What `tandem serve` lists and routes to (server/routes/models.py): one entry per model.
        payload["models"] = [{"name": model_name, "max_model_len": runtime.max_model_len}]
    if runtime.vision is not None:
        payload["serves"].append("vision")
        payload["vision_model_name"] = vision_model_name(runtime.vision)
    return payload


def vision_model_name(vision: Any) -> str:
    """The detector's name for the model_name label: its weights' file name without suffix."""
    import os

    model = str(getattr(getattr(vision, "config", None), "model", "") or "")
    return os.path.splitext(os.path.basename(model))[0] or "vision"


# Series that describe the vision model's work: labelled with its name, not the LLM's.
VISION_SERIES = frozenset(
    {"vision_images", "vision_batches", "vision_queue_depth", "vision_batch_size", "vision_queue_delay_seconds"}
)


# ---- fleet: publish to Redis, read back --------------------------------------------------------


def publish(redis_client, instance: str, payload: dict, ttl_s: float) -> None:
    """Store one process's payload ({"kind": "runtime" | "cameras", "metrics": snapshot, ...})
    for `ttl_s`; a process that stops publishing drops out of the scrape when it expires."""
    body = json.dumps({**payload, "instance": instance, "published_at": time.time()})
    pipe = redis_client.pipeline(transaction=False)
    pipe.set(METRICS_KEY + instance, body, px=max(1, int(ttl_s * 1000)))
    pipe.zadd(METRICS_INDEX, {instance: time.time()})
    pipe.zremrangebyscore(METRICS_INDEX, 0, time.time() - max(60.0, 10 * ttl_s))  # long gone
    pipe.execute()


def withdraw(redis_client, instance: str) -> None:
    pipe = redis_client.pipeline(transaction=False)
    pipe.delete(METRICS_KEY + instance)
    pipe.zrem(METRICS_INDEX, instance)
    pipe.execute()


def gather(redis_client) -> list[dict]:
    """Every live process's payload."""
    instances = redis_client.zrange(METRICS_INDEX, 0, -1)
    if not instances:
        return []
    bodies = redis_client.mget([METRICS_KEY + i for i in instances])
    return [json.loads(b) for b in bodies if b]


# ---- rendering --------------------------------------------------------------------------------


def families(payloads: list[dict]) -> Iterator[Any]:
    """prometheus_client metric families for `payloads` (each with an "instance"): runtime
    metrics from "metrics", camera metrics from "cameras"."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    runtimes = [p for p in payloads if p.get("metrics")]
    # Not "instance": Prometheus sets that label on every target it scrapes (ours would be
    # renamed exported_instance), while this one names the fleet's process behind the server.
    labels = ["tandem_instance", "model_name"]

    def key(p: dict, name: str = "") -> list[str]:
        model = p.get("vision_model_name", p.get("model_name")) if name in VISION_SERIES else p.get("model_name")
        return [str(p.get("instance", "")), str(model or "")]

    def has(p: dict, name: str) -> bool:
        """Does `p` serve the workload `name` measures? (payloads that do not say: both)"""
        serves = p.get("serves")
        return serves is None or ("vision" if name in VISION_SERIES else "llm") in serves

    for name, help_text in GAUGES.items():
        g = GaugeMetricFamily(PREFIX + name, help_text, labels=labels)
        for p in runtimes:
            value = p["metrics"].get("gauges", {}).get(name)
            if value is not None and has(p, name):
                g.add_metric(key(p, name), float(value))
        yield g
    for name, help_text in COUNTERS.items():
        c = CounterMetricFamily(PREFIX + name, help_text, labels=labels)
        for p in runtimes:
            if has(p, name):
                c.add_metric(key(p, name), float(p["metrics"].get("counters", {}).get(name, 0)))
        yield c
    c = CounterMetricFamily(
        PREFIX + "request_success", "Finished requests by finished_reason.", labels=[*labels, "finished_reason"]
    )
    for p in runtimes:
        for reason, n in sorted(p["metrics"].get("finished", {}).items()):
            c.add_metric([*key(p), reason], float(n))
    yield c
    for name, (help_text, _) in HISTOGRAMS.items():
        h = HistogramMetricFamily(PREFIX + name, help_text, labels=labels)
        for p in runtimes:
            d = p["metrics"].get("histograms", {}).get(name)
            if not has(p, name):
                continue
            if not d:
                continue
            cumulative, buckets = 0, []
            for bound, n in zip([*d["buckets"], float("inf")], d["counts"]):
                cumulative += n
                buckets.append((_le(bound), cumulative))
            h.add_metric(key(p, name), buckets, d["sum"])
        yield h
    yield from _camera_families(payloads)


# Bounds of the camera muxer's batch size histogram (cameras per group).
MUX_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _camera_families(payloads: list[dict]) -> Iterator[Any]:
    """Per camera: {"camera", "url", "up" (0/1), "fps", "frames", "drops", "detections",
    "reconnects", "state", "drops_by_reason", "carried_over", "latency_ms_p50",
    "latency_ms_p99", "batch_size_mean"} as a camera service lists them under "cameras"; per
    service, its muxer under "batching" ({"window_ms", "batch_sizes": {size: groups},
    "closed": {"complete"|"timeout": groups}})."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["tandem_instance", "camera"]
    cams = [(str(p.get("instance", "")), c) for p in payloads for c in p.get("cameras", ())]
    up = GaugeMetricFamily(
        PREFIX + "camera_up", "1 while the camera delivers frames, else 0.", labels=[*labels, "state"]
    )
    fps = GaugeMetricFamily(PREFIX + "camera_fps", "Frames per second detected, recent.", labels=labels)
    counters = {
        "frames": CounterMetricFamily(PREFIX + "camera_frames", "Frames detected.", labels=labels),
        "drops": CounterMetricFamily(
            PREFIX + "camera_frames_dropped",
            "Frames read but never detected (a newer one replaced them, or the rate cap skipped them).",
            labels=labels,
        ),
        "detections": CounterMetricFamily(PREFIX + "camera_detections", "Objects detected.", labels=labels),
        "reconnects": CounterMetricFamily(
            PREFIX + "camera_reconnects", "Times the camera was reopened.", labels=labels
        ),
    }
    counters["carried_over"] = CounterMetricFamily(
        PREFIX + "camera_frames_carried_over",
        "Frames the motion gate kept from the detector (their record repeats the last detections).",
        labels=labels,
    )
    by_reason = CounterMetricFamily(
        PREFIX + "camera_frames_dropped_by_reason",
        "Frames read but never detected, by reason (replaced, rate_cap, queue_full, stale, runtime_refused, failed).",
        labels=[*labels, "reason"],
    )
    latency = GaugeMetricFamily(
        PREFIX + "camera_frame_latency_seconds",
        "Frame-to-result latency over the camera's recent frames, at a quantile (0.5, 0.99).",
        labels=[*labels, "quantile"],
    )
    batch_mean = GaugeMetricFamily(
        PREFIX + "camera_batch_size_mean", "Mean forward-pass batch size of the camera's recent frames.", labels=labels
    )
    for instance, cam in cams:
        lv = [instance, str(cam.get("camera", ""))]
        up.add_metric([*lv, str(cam.get("state", ""))], float(bool(cam.get("up"))))
        fps.add_metric(lv, float(cam.get("fps") or 0.0))
        for name, fam in counters.items():
            fam.add_metric(lv, float(cam.get(name) or 0))
        for reason, n in sorted((cam.get("drops_by_reason") or {}).items()):
            by_reason.add_metric([*lv, str(reason)], float(n))
        for q, name in (("0.5", "latency_ms_p50"), ("0.99", "latency_ms_p99")):
            if cam.get(name) is not None:
                latency.add_metric([*lv, q], float(cam[name]) / 1000.0)
        if cam.get("batch_size_mean") is not None:
            batch_mean.add_metric(lv, float(cam["batch_size_mean"]))
    yield up
    yield fps
    yield from counters.values()
    yield by_reason
    yield latency
    yield batch_mean
    yield from _mux_families(payloads)


def _mux_families(payloads: list[dict]) -> Iterator[Any]:
    """The camera muxer of each camera service: group sizes, its window, what closed groups."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels = ["tandem_instance"]
    sizes = HistogramMetricFamily(
        PREFIX + "camera_mux_batch_size", "Cameras' frames per group the muxer submitted together.", labels=labels
    )
    window = GaugeMetricFamily(
        PREFIX + "camera_mux_window_seconds",
        "How long a group waits for the live cameras still to come (batch_timeout_ms, or derived from their rates).",
        labels=labels,
    )
    closed = CounterMetricFamily(
        PREFIX + "camera_mux_batches_closed",
        "Groups by what closed them: complete (every live camera in) or timeout (the window ran out).",
        labels=[*labels, "how"],
    )
    for p in payloads:
        mux = p.get("batching")
        if not mux:
            continue
        lv = [str(p.get("instance", ""))]
        counts = {int(k): int(v) for k, v in (mux.get("batch_sizes") or {}).items()}
        cumulative, buckets = 0, []
        for bound in (*MUX_BUCKETS, float("inf")):
            cumulative = sum(v for k, v in counts.items() if k <= bound)
            buckets.append((_le(bound), cumulative))
        sizes.add_metric(lv, buckets, float(sum(k * v for k, v in counts.items())))
        if mux.get("window_ms") is not None:
            window.add_metric(lv, float(mux["window_ms"]) / 1000.0)
        for how, n in sorted((mux.get("closed") or {}).items()):
            closed.add_metric([*lv, str(how)], float(n))
    yield sizes
    yield window
    yield closed


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def render(payloads: list[dict]) -> bytes:
    """The Prometheus text exposition of `payloads`."""
    from prometheus_client import CollectorRegistry, generate_latest

    class _Collector:
        def collect(self):
            return families(payloads)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)
