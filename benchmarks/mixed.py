"""`tandem bench mixed`: chat requests (Poisson arrivals) beside N cameras at F frames/s,
served (a) by one Runtime and (b) by the same two workloads in two separate processes that
share the cores, as a user without Tandem would run them: an LLM engine in one process, a
vision engine in the other, each with its own thread pools. Both setups play the same
workload from the same clock; deadlines are judged the same way for both (runtime/mixed.py).

Reported: LLM time to first token and inter-token latency (p50, p99), frame-to-result
latency (p50, p99), both throughputs, and the share of requests that met their deadlines.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from dataclasses import asdict
from pathlib import Path

from runtime.mixed import MixedReport, MixedWorkload, share_met


def add_bench_arguments(p) -> None:
    p.add_argument("--model", default=None, help="LLM (default SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=1.0, help="LLM requests per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--llm-deadline", type=float, default=15.0, help="seconds, end to end")
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--fps", type=float, default=4.0, help="frames per second per stream")
    p.add_argument("--frame-deadline", type=float, default=0.5, help="seconds from frame to result")
    p.add_argument("--duration", type=float, default=30.0, help="seconds the cameras run")
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vision-only",
        action="store_true",
        help="instead: images/s of a vision-only Runtime against the standalone VisionEngine",
    )
    p.add_argument("--rounds", type=int, default=5, help="--vision-only: alternating rounds of each")


def _llm_config(args) -> dict:
    return {"model": args.model, "dtype": args.dtype, "device": "cpu", "max_num_seqs": args.max_num_seqs}


def _vision_config(args) -> dict:
    return {"imgsz": args.imgsz, "device": "cpu", "batching": {"max_batch_size": 4, "max_queue_delay_ms": 5.0}}


def _workload(args) -> MixedWorkload:
    return MixedWorkload(
        num_requests=args.num_requests,
        request_rate=args.rate,
        max_tokens=args.max_tokens,
        llm_deadline_s=args.llm_deadline,
        num_streams=args.streams,
        fps=args.fps,
        frame_deadline_s=args.frame_deadline,
        duration_s=args.duration,
        seed=args.seed,
    )


class _EngineAdapter:
    """A standalone VisionEngine behind the Runtime's submit_detect signature."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def submit_detect(self, item, deadline_s=None):
        return self.engine.submit(item, deadline_s=deadline_s)


def _separate_process(kind: str, args, ready, start, results) -> None:
    """One half of setup (b): load, say ready, wait for the shared start, play, report."""
    from runtime.vision.ultralytics_import import import_ultralytics

    import_ultralytics()
    w = _workload(args)
    if kind == "llm":
        from runtime.runtime import Runtime

        with Runtime(llm=_llm_config(args)) as rt:
            ready.put(kind)
            report = _play(rt, None, w, start.get())
    else:
        from runtime.vision.config import VisionConfig
        from runtime.vision.engine import VisionEngine

        with VisionEngine(VisionConfig.from_dict(_vision_config(args))) as engine:
            ready.put(kind)
            report = _play(None, _EngineAdapter(engine), w, start.get())
    results.put((kind, report.as_dict()))


def _play(llm, vision, w: MixedWorkload, start_at: float) -> MixedReport:
    from runtime.mixed import drive

    return drive(llm, vision, w, start_at=start_at)


def run_two_processes(args) -> MixedReport:
    ctx = mp.get_context("spawn")  # a fresh interpreter each: no torch state shared
    ready, start, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_separate_process, args=(k, args, ready, start, results)) for k in ("llm", "vision")]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=600)
    t0 = time.monotonic() + 1.0  # CLOCK_MONOTONIC is one clock for every process on the machine
    for _ in procs:
        start.put(t0)
    halves = dict(results.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join(60)
    return MixedReport(
        wall_s=max(h["wall_s"] for h in halves.values()), llm=halves["llm"]["llm"], vision=halves["vision"]["vision"]
    )


def run_one_runtime(args) -> MixedReport:
    from runtime.runtime import Runtime

    with Runtime(llm=_llm_config(args), vision=_vision_config(args)) as rt:
        report = _play(rt, rt, _workload(args), time.monotonic() + 0.5)
        report.llm["arbiter"] = rt.stats()["arbiter"]
    return report


def _row(name: str, r: MixedReport) -> dict:
    return {
        "setup": name,
        "ttft_p50_ms": r.llm["ttft_ms"]["p50"],
        "ttft_p99_ms": r.llm["ttft_ms"]["p99"],
        "itl_p50_ms": r.llm["itl_ms"]["p50"],
        "itl_p99_ms": r.llm["itl_ms"]["p99"],
        "frame_p50_ms": r.vision["latency_ms"]["p50"],
        "frame_p99_ms": r.vision["latency_ms"]["p99"],
        "llm_tokens_per_s": r.llm["tokens_per_s"],
        "frames_per_s": r.vision["frames_per_s"],
        "llm_deadline_met": r.llm["deadline_met"],
        "frame_deadline_met": r.vision["deadline_met"],
        "all_deadline_met": share_met(r),
    }


def run_vision_only(args) -> int:
    """A vision-only Runtime must keep the standalone VisionEngine's images/s (within 5%):
    the same images, all submitted at once, rounds alternating between the two, medians."""
    import statistics

    from benchmarks.vision import bench_images, throughput
    from runtime.runtime import Runtime
    from runtime.vision.config import VisionConfig
    from runtime.vision.engine import VisionEngine

    out = Path(args.out)
    paths = bench_images(str(out / "bench_images"), 64)
    config = {"imgsz": 640, "device": "cpu", "batching": {"max_batch_size": 8}}
    engine = VisionEngine(VisionConfig.from_dict(config))
    runtime = Runtime(vision=config)

    class _Submit:  # the Runtime behind the engine's submit(), for throughput
        submit = staticmethod(runtime.submit_detect)

    rates: dict[str, list[float]] = {"VisionEngine": [], "Runtime (vision only)": []}
    try:
        for k in range(args.rounds):
            rates["VisionEngine"].append(throughput(engine, paths))
            rates["Runtime (vision only)"].append(throughput(_Submit, paths))
            print(
                f"round {k + 1}: VisionEngine {rates['VisionEngine'][-1]:.2f}, Runtime "
                f"{rates['Runtime (vision only)'][-1]:.2f} images/s",
                flush=True,
            )
    finally:
        engine.close()
        runtime.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["Runtime (vision only)"] / med["VisionEngine"]
    print(
        f"median images/s: VisionEngine {med['VisionEngine']:.2f}, Runtime {med['Runtime (vision only)']:.2f}: "
        f"{ratio:.3f}x (target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "vision_only.json").write_text(json.dumps({"rates": rates, "median": med, "ratio": ratio}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in rates.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=f"{name} (median {med[name]:.1f})")
    ax.set_xlabel("round")
    ax.set_ylabel("images/s")
    ax.set_title(f"vision only: Runtime / VisionEngine = {ratio:.3f}x")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "vision_only.png", dpi=100)
    print(f"wrote {out / 'vision_only.json'} and {out / 'vision_only.png'}")
    return 0


def run_bench(args) -> int:
    from runtime.vision.ultralytics_import import import_ultralytics

    import_ultralytics()
    if args.vision_only:
        return run_vision_only(args)
    w = _workload(args)
    print(
        f"workload: {w.num_requests} chat requests at {w.request_rate}/s (max {w.max_tokens} tokens, deadline "
        f"{w.llm_deadline_s} s) + {w.num_streams} cameras at {w.fps} fps for {w.duration_s} s (deadline "
        f"{w.frame_deadline_s * 1000:.0f} ms), {args.dtype}"
    )
    print("(a) one Runtime ...", flush=True)
    one = run_one_runtime(args)
    print("(b) two processes sharing the cores ...", flush=True)
    two = run_two_processes(args)
    rows = [_row("one Runtime", one), _row("two processes", two)]
    _print(rows)
    for name, r in (("one Runtime", one), ("two processes", two)):
        stages = ", ".join(f"{k} {v:.1f}" for k, v in r.vision.get("stage_ms_p50", {}).items() if v is not None)
        print(f"{name}: frame stages p50 (ms): {stages}")
    a, b = rows
    verdict = {
        "more_deadlines_met": (a["all_deadline_met"] or 0) > (b["all_deadline_met"] or 0),
        "llm_throughput_ratio": a["llm_tokens_per_s"] / b["llm_tokens_per_s"] if b["llm_tokens_per_s"] else None,
        "vision_throughput_ratio": a["frames_per_s"] / b["frames_per_s"] if b["frames_per_s"] else None,
    }
    print(
        f"target: the Runtime meets more deadlines ({a['all_deadline_met']:.1%} vs {b['all_deadline_met']:.1%}: "
        f"{'met' if verdict['more_deadlines_met'] else 'NOT met'}) with at least their throughput "
        f"(LLM {verdict['llm_throughput_ratio']:.2f}x, vision {verdict['vision_throughput_ratio']:.2f}x)"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "args": vars(args),
        "workload": asdict(w),
        "rows": rows,
        "verdict": verdict,
        "raw": {"one_runtime": one.as_dict(), "two_processes": two.as_dict()},
    }
    (out / "mixed.json").write_text(json.dumps(report, indent=2, default=str))
    _plot(rows, out / "mixed.png")
    print(f"wrote {out / 'mixed.json'} and {out / 'mixed.png'}")
    return 0


def _print(rows: list[dict]) -> None:
    cols = [
        ("setup", "{:<14}"),
        ("ttft_p50_ms", "{:>9.0f}"),
        ("ttft_p99_ms", "{:>9.0f}"),
        ("itl_p50_ms", "{:>8.0f}"),
        ("itl_p99_ms", "{:>8.0f}"),
        ("frame_p50_ms", "{:>9.0f}"),
        ("frame_p99_ms", "{:>9.0f}"),
        ("llm_tokens_per_s", "{:>8.1f}"),
        ("frames_per_s", "{:>7.2f}"),
        ("llm_deadline_met", "{:>7.0%}"),
        ("frame_deadline_met", "{:>7.0%}"),
        ("all_deadline_met", "{:>7.0%}"),
    ]
    print(
        "setup           TTFT p50  TTFT p99  ITL p50  ITL p99  frame p50 frame p99   tok/s  frames/s  LLM ok frame ok  all ok"
    )
    for r in rows:
        print(" ".join(fmt.format(r[k]) if r[k] is not None else f"{'-':>8}" for k, fmt in cols))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [r["setup"] for r in rows]
    panels = [
        (
            "latency p50 / p99 (ms)",
            ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "frame_p50_ms", "frame_p99_ms"],
        ),
        ("throughput", ["llm_tokens_per_s", "frames_per_s"]),
        ("deadlines met", ["llm_deadline_met", "frame_deadline_met", "all_deadline_met"]),
    ]
    for ax, (title, keys) in zip(axes, panels):
        width = 0.8 / len(rows)
        for i, r in enumerate(rows):
            ax.bar([k + i * width for k in range(len(keys))], [r[k] or 0 for k in keys], width, label=names[i])
        ax.set_xticks(
            [k + width / 2 for k in range(len(keys))],
            [k.replace("_", " ") for k in keys],
            rotation=30,
            ha="right",
            fontsize=7,
        )
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle("tandem bench mixed: one Runtime vs two processes sharing the cores")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
