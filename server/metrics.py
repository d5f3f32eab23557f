"""Prometheus text for `/metrics`: the fleet's JSON payloads (runtime/metrics.py's snapshots,
a camera service's rows and muxer) rendered under vLLM's names with a `tandem:` prefix, each
process under its own `tandem_instance` label. Rendered per scrape, so nothing imports
prometheus_client until one comes. `tandem serve` renders what workers/fleet_metrics.py
gathers; `tandem streams` renders its own payload (server/streams_app.py).

    text = render([{"instance": "w1", "kind": "runtime", "metrics": snapshot}])
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from runtime.metrics import COUNTERS, GAUGES, HISTOGRAMS

PREFIX = "tandem:"

# Series that describe the vision model's work: labelled with its name, not the LLM's.
VISION_SERIES = frozenset(
    {"vision_images", "vision_batches", "vision_queue_depth", "vision_batch_size", "vision_queue_delay_seconds"}
)


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
    yield from _tenant_families(payloads)


def _tenant_families(payloads: list[dict]) -> Iterator[Any]:
    """Per tenant of `tandem serve` (server/admission.py's payload, under "tenants"): tokens
    served, queue time and TTFT as the server saw them (admission to the first event, to the
    first token), rejections by the limit passed, requests in flight, weight and current share
    (its part of the tokens served, weighted to the last half-minute)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels = ["tandem_instance", "tenant"]
    tokens = {
        "prompt_tokens": CounterMetricFamily(
            PREFIX + "tenant_prompt_tokens", "Prompt tokens served to the tenant's requests.", labels=labels
        ),
        "completion_tokens": CounterMetricFamily(
            PREFIX + "tenant_generation_tokens", "Tokens generated for the tenant's requests.", labels=labels
        ),
    }
    gauges = {
        "share": GaugeMetricFamily(
            PREFIX + "tenant_share",
            "The tenant's part of the tokens served recently (0 to 1; half-life 30 s).",
            labels=labels,
        ),
        "weight": GaugeMetricFamily(PREFIX + "tenant_weight", "The tenant's weight (--tenants).", labels=labels),
        "running": GaugeMetricFamily(
            PREFIX + "tenant_requests_running", "The tenant's requests in flight (max_concurrent).", labels=labels
        ),
        "queued": GaugeMetricFamily(
            PREFIX + "tenant_requests_waiting",
            "The tenant's requests in flight with no output yet (max_queued).",
            labels=labels,
        ),
    }
    rejections = CounterMetricFamily(
        PREFIX + "tenant_rejections",
        "The tenant's requests refused with 429, by the limit passed.",
        labels=[*labels, "reason"],
    )
    histograms = {
        "queue_time": HistogramMetricFamily(
            PREFIX + "tenant_queue_time_seconds",
            "Admission to the first output of the tenant's requests, as the server sees it.",
            labels=labels,
        ),
        "ttft": HistogramMetricFamily(
            PREFIX + "tenant_time_to_first_token_seconds",
            "Admission to the first token of the tenant's requests, as the server sees it.",
            labels=labels,
        ),
    }
    for p in payloads:
        for tenant, t in sorted((p.get("tenants") or {}).items()):
            lv = [str(p.get("instance", "")), str(tenant)]
            for name, fam in tokens.items():
                fam.add_metric(lv, float(t.get(name, 0)))
            for name, fam in gauges.items():
                fam.add_metric(lv, float(t.get(name, 0)))
            for reason, n in sorted((t.get("rejections") or {}).items()):
                rejections.add_metric([*lv, str(reason)], float(n))
            for name, fam in histograms.items():
                d = t.get(name)
                if not d:
                    continue
                cumulative, buckets = 0, []
                for bound, n in zip([*d["buckets"], float("inf")], d["counts"]):
                    cumulative += n
                    buckets.append((_le(bound), cumulative))
                fam.add_metric(lv, buckets, d["sum"])
    yield from tokens.values()
    yield from gauges.values()
    yield rejections
    yield from histograms.values()


# Bounds of the camera muxer's batch size histogram (cameras per group).
MUX_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _camera_families(payloads: list[dict]) -> Iterator[Any]:
    """Per camera: {"camera", "url", "up" (0/1), "fps", "frames", "drops", "detections",
    "reconnects", "state", "drops_by_reason", "carried_over", "latency_ms_p50",
    "latency_ms_p99", "batch_size_mean", "counts" (of its lines and zones), "clips" (its clip
    ring), "push" (its events per push sink)} as a camera service lists them under "cameras";
    per service, its push sinks under "push" (_push_families), its muxer under
    "batching" ({"window_ms", "batch_sizes": {size: groups}, "closed": {"complete"|"timeout":
    groups}})."""
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
    crossings = CounterMetricFamily(
        PREFIX + "camera_line_crossings",
        "Tracks that crossed a camera's line, by direction (runtime/vision/analytics.py).",
        labels=[*labels, "line", "direction"],
    )
    occupancy = GaugeMetricFamily(
        PREFIX + "camera_zone_occupancy", "Tracks in a camera's zone now.", labels=[*labels, "zone"]
    )
    zone_moves = {
        "entries": CounterMetricFamily(
            PREFIX + "camera_zone_entries", "Tracks that entered a zone.", labels=[*labels, "zone"]
        ),
        "exits": CounterMetricFamily(
            PREFIX + "camera_zone_exits", "Tracks that left a zone.", labels=[*labels, "zone"]
        ),
    }
    clip_buffer = GaugeMetricFamily(
        PREFIX + "camera_clip_buffer_bytes",
        "JPEGs the camera's clip ring holds now, for event clips' pre-roll (workers/camera_clips.py).",
        labels=labels,
    )
    pushed = CounterMetricFamily(
        PREFIX + "camera_push_events",
        "A camera's line and zone events per push sink (a webhook or the MQTT broker), by outcome: sent, "
        "failed, dropped (the sink's queue was full), suppressed (the webhook cooldown) (workers/camera_push.py).",
        labels=[*labels, "sink", "outcome"],
    )
    for instance, cam in cams:
        lv = [instance, str(cam.get("camera", ""))]
        for sink, outcomes in sorted((cam.get("push") or {}).items()):
            for outcome, n in sorted(outcomes.items()):
                pushed.add_metric([*lv, str(sink), str(outcome)], float(n))
        if cam.get("clips"):
            clip_buffer.add_metric(lv, float(cam["clips"].get("buffer_bytes", 0)))
        counts = cam.get("counts") or {}
        for line, by_direction in sorted((counts.get("lines") or {}).items()):
            for direction, n in sorted(by_direction.items()):
                crossings.add_metric([*lv, str(line), str(direction)], float(n))
        for zone, z in sorted((counts.get("zones") or {}).items()):
            occupancy.add_metric([*lv, str(zone)], float(z.get("occupancy", 0)))
            for name, fam in zone_moves.items():
                fam.add_metric([*lv, str(zone)], float(z.get(name, 0)))
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
    yield crossings
    yield occupancy
    yield from zone_moves.values()
    yield clip_buffer
    yield pushed
    yield from _push_families(payloads)
    yield from _mux_families(payloads)


def _push_families(payloads: list[dict]) -> Iterator[Any]:
    """Per push sink of a camera service, from its payload's "push" ([{"sink", "sent",
    "failed", "dropped", "queued", "connected"?}], workers/camera_push.py): what waits in its
    queue now, and whether the MQTT broker is connected."""
    from prometheus_client.core import GaugeMetricFamily

    labels = ["tandem_instance", "sink"]
    queued = GaugeMetricFamily(
        PREFIX + "push_queued", "Events waiting in a push sink's queue for a slow receiver.", labels=labels
    )
    connected = GaugeMetricFamily(PREFIX + "push_connected", "1 while the MQTT broker is connected.", labels=labels)
    for p in payloads:
        for sink in p.get("push") or ():
            lv = [str(p.get("instance", "")), str(sink.get("sink", ""))]
            queued.add_metric(lv, float(sink.get("queued") or 0))
            if "connected" in sink:
                connected.add_metric(lv, float(sink["connected"]))
    yield queued
    yield connected


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
