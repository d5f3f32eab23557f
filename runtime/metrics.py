"""Serving metrics: plain-Python counters and histograms, kept by whoever serves (a Runtime, a
camera service) and snapshotted as JSON, under vLLM's names (`time_to_first_token_seconds`,
`num_requests_running`, ...).

Why JSON snapshots and not prometheus_client objects in each process: a fleet is many
processes (workers, camera services) behind one `tandem serve`. Each publishes its snapshot to
Redis at every heartbeat (workers/fleet_metrics.py), and the server's `/metrics` renders all of
them (server/metrics.py), each under its own `tandem_instance` label: one scrape sees the whole
fleet. This room only counts: it imports neither redis nor prometheus_client
(tests/test_layers.py), so an engine never waits on a scrape or a network round trip.

    m = ServingMetrics()
    m.observe_request(output)                      # a finished RequestOutput (loop thread)
    m.observe_vision_batch(size, queue_delays_s)   # a vision batch (worker thread)
    snap = m.snapshot(gauges={"num_requests_running": 3, "kv_cache_usage_perc": 0.4})
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from typing import Any

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
# name -> help; plain counters (rendering adds a `_total` suffix).
COUNTERS = {
    "prompt_tokens": "Prompt tokens of finished requests.",
    "generation_tokens": "Generated tokens of finished requests (every choice of an n > 1 request).",
    # The engine's SchedulerStats.num_computed_prompt_tokens, as num_preemptions is fed.
    "prompt_tokens_computed": "Prompt tokens whose KV was computed (not served by the prefix cache, "
    "nor shared by the choices of an n > 1 request).",
    "vision_images": "Images detected.",
    "vision_batches": "Vision forward passes.",
    "num_preemptions": "Requests preempted (KV blocks taken back, recomputed later).",
    # Speculative decoding (vLLM's names), fed from SchedulerStats as num_preemptions is.
    "spec_decode_num_drafts": "Verification rounds: a request's drafts checked in one step.",
    "spec_decode_num_draft_tokens": "Draft tokens proposed and verified.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
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
            choices = getattr(out, "completions", None)  # n > 1: every choice's tokens count
            self.counters["generation_tokens"] += (
                sum(len(c.token_ids) for c in choices) if choices else len(out.token_ids)
            )
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
