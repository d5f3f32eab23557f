"""A mixed workload, the one Tandem exists for: chat requests arriving at random (Poisson)
while cameras send frames at a fixed rate, each request with a deadline. Used by `tandem demo`
and `tandem bench mixed`.

`drive(llm, vision, workload)` plays the workload against anything with the Runtime's entry
points (`submit_generate`, `submit_detect`): one Runtime, or two separate engines. The load
generator paces arrivals by the clock (that is what a camera does); everything it measures
comes from the handles and futures the runtime resolves.
"""

from __future__ import annotations

import math
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "Write a haiku about autumn.",
    "What is the boiling point of water in Celsius?",
    "Explain in one sentence what a GPU is.",
    "Name two planets larger than Earth.",
    "Why is the sky blue?",
    "Suggest a name for a bakery.",
]


@dataclass(slots=True)
class MixedWorkload:
    num_requests: int = 16
    request_rate: float = 1.0  # LLM requests per second (Poisson arrivals)
    max_tokens: int = 48
    repetition_penalty: float = 1.0  # >1 keeps a small model's greedy answers from looping
    llm_deadline_s: float = 20.0  # end to end, per request
    num_streams: int = 2
    fps: float = 4.0  # per stream
    frame_deadline_s: float = 0.5  # from the frame's arrival to its detections
    duration_s: float | None = None  # cameras run this long; None: until the last LLM request ends
    seed: int = 0


@dataclass(slots=True)
class MixedReport:
    wall_s: float = 0.0
    llm: dict = field(default_factory=dict)
    vision: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(math.ceil(q * len(s))) - 1)]


def _summary_ms(values: list[float]) -> dict:
    return {
        "p50": _pct([v * 1000 for v in values], 0.5),
        "p99": _pct([v * 1000 for v in values], 0.99),
        "n": len(values),
    }


def camera_frames(num_streams: int, seed: int = 0) -> list[list]:
    """A few distinct synthetic frames per camera (moving shapes), 320x240 BGR."""
    from sources.loopback import synthetic_frames

    return [synthetic_frames(8, seed=seed + k) for k in range(num_streams)]


def drive(
    llm, vision, workload: MixedWorkload, start_at: float | None = None, quiet: bool = True, on_answer=None
) -> MixedReport:
    """Play `workload`: LLM requests through `llm.submit_generate`, frames through
    `vision.submit_detect` (either may be None to play only the other half)."""
    from runtime.llm.sampling_params import SamplingParams

    w = workload
    rng = random.Random(w.seed)
    arrivals, t = [], 0.0
    for _ in range(w.num_requests if llm is not None else 0):
        t += rng.expovariate(w.request_rate)
        arrivals.append(t)
    t0 = start_at if start_at is not None else time.monotonic()
    handles: list = []
    frames: list[tuple[dict, object]] = []  # ({"submitted", "done"}, future)
    stop = threading.Event()
    errors: list[BaseException] = []

    def llm_client() -> None:
        params = SamplingParams(max_tokens=w.max_tokens, temperature=0, repetition_penalty=w.repetition_penalty)
        try:
            for i, at in enumerate(arrivals):
                delay = t0 + at - time.monotonic()
                if delay > 0 and stop.wait(delay):
                    return
                messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
                handles.append(
                    (i, time.monotonic(), llm.submit_generate(messages, params, deadline_s=w.llm_deadline_s))
                )
        except BaseException as exc:  # noqa: BLE001 - reported by drive()
            errors.append(exc)

    def camera(k: int, images: list) -> None:
        period = 1.0 / w.fps
        n = 0
        try:
            while not stop.is_set():
                due = t0 + n * period + k * period / max(1, w.num_streams)  # cameras out of phase
                if w.duration_s is not None and due >= t0 + w.duration_s:
                    return
                delay = due - time.monotonic()
                if delay > 0 and stop.wait(delay):
                    return
                record = {"submitted": time.monotonic(), "done": None}
                try:
                    future = vision.submit_detect(images[n % len(images)], deadline_s=w.frame_deadline_s)
                except (RuntimeError, ValueError) as exc:  # a full queue: this frame is dropped
                    future = Future()
                    future.set_exception(exc)
                future.add_done_callback(lambda f, r=record: r.__setitem__("done", time.monotonic()))
                frames.append((record, future))
                n += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    delay = t0 - time.monotonic()
    if delay > 0:
        time.sleep(delay)  # a shared start for two processes
    threads = [threading.Thread(target=llm_client, daemon=True)] if llm is not None else []
    if vision is not None:
        threads += [
            threading.Thread(target=camera, args=(k, imgs), daemon=True)
            for k, imgs in enumerate(camera_frames(w.num_streams, w.seed))
        ]
    for th in threads:
        th.start()
    llm_end = None
    if llm is not None:
        threads[0].join()
        for i, _, h in handles:
            try:
                out = h.result()
                if on_answer is not None:
                    on_answer(i, QUESTIONS[i % len(QUESTIONS)], out)
            except Exception:  # noqa: BLE001 - counted as a missed deadline below
                pass
        llm_end = time.monotonic()
    if w.duration_s is None:
        stop.set()  # cameras run while the LLM requests do
    for th in threads:
        th.join()
    end = time.monotonic()
    for _, f in frames:
        try:
            f.result()
        except Exception:  # noqa: BLE001 - counted below
            pass
    if errors:
        raise errors[0]
    report = MixedReport(wall_s=end - t0)
    if llm is not None:
        report.llm = _llm_summary(handles, llm_end - t0, w.llm_deadline_s)
    if vision is not None:
        camera_s = min(end - t0, w.duration_s) if w.duration_s is not None else end - t0
        report.vision = vision_summary(frames, camera_s, w.frame_deadline_s)
    return report


def _llm_summary(handles: list, wall: float, deadline_s: float) -> dict:
    """Deadlines are judged here, the same way for every setup: finished within deadline_s."""
    ttft, itl, met, tokens = [], [], 0, 0
    for _, _, h in handles:
        try:
            out = h.result()
        except Exception:  # noqa: BLE001 - rejected: missed its deadline
            continue
        m = out.metrics
        tokens += len(out.token_ids)
        if m.time_to_first_token is not None:
            ttft.append(m.time_to_first_token)
        itl.extend(m.inter_token_latencies)
        met += out.error is None and m.e2e_latency is not None and m.e2e_latency <= deadline_s
    n = len(handles)
    return {
        "requests": n,
        "ttft_ms": _summary_ms(ttft),
        "itl_ms": _summary_ms(itl),
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "deadline_met": met / n if n else None,
    }


def vision_summary(frames: list, wall: float, deadline_s: float) -> dict:
    latency, met = [], 0
    stages: dict[str, list[float]] = {}
    for record, f in frames:
        if f.exception() is not None or record["done"] is None:
            continue
        seconds = record["done"] - record["submitted"]
        latency.append(seconds)
        met += seconds <= deadline_s
        for stage, ms in f.result().timings.items():
            stages.setdefault(stage, []).append(ms / 1000)
    n = len(frames)
    return {
        "frames": n,
        "completed": len(latency),
        "latency_ms": _summary_ms(latency),
        "stage_ms_p50": {k: _summary_ms(v)["p50"] for k, v in stages.items()},
        "frames_per_s": len(latency) / wall if wall else 0.0,
        "deadline_met": met / n if n else None,
    }


def share_met(report: MixedReport) -> float | None:
    """Deadlines met over all requests of both kinds."""
    n = report.llm.get("requests", 0) + report.vision.get("frames", 0)
    met = (report.llm.get("deadline_met") or 0) * report.llm.get("requests", 0) + (
        report.vision.get("deadline_met") or 0
    ) * report.vision.get("frames", 0)
    return met / n if n else None
