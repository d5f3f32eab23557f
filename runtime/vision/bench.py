"""`tandem bench vision`: throughput against Ultralytics, latency under load, live streams.

All in one run, on the same model (seeded random weights unless --model is a .pt) and the
same images: generated 480x640 JPEGs plus Ultralytics' bus.jpg and zidane.jpg.
  1. images/s over a directory: Ultralytics predict at batch 1 and at its best batch vs ours
     (--dtype, float32 by default), and on CPU ours in bfloat16 as a separate, opt-in row.
  2. parity: our detections against Ultralytics' float32 predict on the same weights
     (calibrated when random, see runtime.vision.calibrate), for float32 and bfloat16.
  3. latency p50/p99 under Poisson arrivals at 50% and 90% of our capacity, with dynamic
     batching (profiled preferred size, max_batch_size) and without (batch 1).
  4. 8 loopback MJPEG streams at 15 fps: frame-to-result latency p50/p99, frames dropped.
Writes bench_vision.json and bench_vision.png to --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from runtime.vision.ultralytics_import import import_ultralytics


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_out", help="directory for bench_vision.json / .png")
    parser.add_argument("--model", default="yolo26n.yaml")
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="our engine's dtype (float32 keeps parity with Ultralytics)")
    parser.add_argument("--num-images", type=int, default=64, help="generated 480x640 images (+ bus, zidane)")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-fps", type=float, default=15.0)
    parser.add_argument("--quick", action="store_true", help="fewer images, requests and seconds")


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def _images(folder: str, n: int) -> list[str]:
    import cv2
    import numpy as np

    import_ultralytics()
    from ultralytics.utils import ASSETS

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        img = cv2.GaussianBlur(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8), (7, 7), 0)
        for _ in range(4):
            x, y = int(rng.integers(0, 560)), int(rng.integers(0, 400))
            cv2.rectangle(img, (x, y), (x + 80, y + 80), tuple(int(c) for c in rng.integers(0, 255, 3)), -1)
        cv2.imwrite(os.path.join(folder, f"img{i:03d}.jpg"), img)
    for name in ("bus.jpg", "zidane.jpg"):
        shutil.copy(ASSETS / name, os.path.join(folder, name))
    return sorted(os.path.join(folder, f) for f in os.listdir(folder))


def _ultralytics(model_path: str, folder: str, imgsz: int, device: str, batches: list[int]) -> dict[str, float]:
    """Ultralytics predict, images/s by "b<batch> t<threads>". On CPU its select_device() sets
    torch to cpu_count - 1 threads (1 on a 2-core machine), so it is measured both as shipped
    and with every core, and the best of all is the peer to beat."""
    import torch

    import_ultralytics()
    import ultralytics.utils.torch_utils as ul_torch
    from ultralytics import YOLO

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the same random weights our runner builds from the same .yaml
        model = YOLO(model_path)
    n = len(os.listdir(folder))
    shipped = ul_torch.NUM_THREADS
    thread_counts = [shipped] if device != "cpu" else sorted({shipped, os.cpu_count() or 1})
    rates = {}
    caller_threads = torch.get_num_threads()
    try:
        for threads in thread_counts:
            ul_torch.NUM_THREADS = threads  # what select_device() sets torch to on CPU
            for bs in batches:
                # nms=False: the end-to-end head, the same work our default does for YOLO26
                kw = dict(imgsz=imgsz, device=device, batch=bs, verbose=False, stream=True, nms=False)
                model.predictor = None  # a fresh predictor runs select_device() again
                for _ in model.predict(folder, **kw):  # warm-up pass builds the predictor
                    break
                t0 = time.perf_counter()
                count = sum(1 for _ in model.predict(folder, **kw))
                rates[f"b{bs} t{threads}"] = count / (time.perf_counter() - t0)
                assert count == n
    finally:
        ul_torch.NUM_THREADS = shipped
        torch.set_num_threads(caller_threads)
    return rates


PARITY_CONF = 0.05  # low, so that each image gives hundreds of detections to compare
PARITY_IMAGES = 10


def _parity(model_path: str, paths: list[str], imgsz: int, device: str, dtypes: list[str]) -> dict[str, dict]:
    """Per dtype: our detections against Ultralytics' float32 predict(nms=False) over `paths`:
    box / confidence errors of each reference detection to its nearest same-class match
    (runtime.vision.calibrate.match_errors), as median, largest (of those matched) and counts."""
    import cv2
    import numpy as np
    import torch

    import_ultralytics()
    from ultralytics import YOLO

    from runtime.vision.calibrate import calibrate, match_errors
    from runtime.vision.config import VisionConfig
    from runtime.vision.runner import YoloRunner

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = YOLO(model_path)
    images = [cv2.imread(p) for p in paths]
    if model_path.endswith((".yaml", ".yml")):
        calibrate(model.model, images, imgsz)
    runners = {dt: YoloRunner(VisionConfig(model=model_path, imgsz=imgsz, device=device, conf=PARITY_CONF, dtype=dt),
                              module=model.model) for dt in dtypes}  # fmt: skip
    refs = [model.predict(p, imgsz=imgsz, conf=PARITY_CONF, device=device, verbose=False, nms=False)[0].boxes.cpu()
            for p in paths]  # fmt: skip
    out = {}
    for dt, runner in runners.items():
        box_err, conf_err, count = [], [], 0
        for image, ref in zip(images, refs):
            (d,) = runner.predict([image])
            b, c = match_errors(d.boxes, d.conf, d.cls, ref.xyxy.numpy(), ref.conf.numpy(), ref.cls.numpy().astype(np.int64))
            box_err.append(b)
            conf_err.append(c)
            count += len(d)
        b, c = np.concatenate(box_err), np.concatenate(conf_err)
        found = np.isfinite(b)
        out[dt] = {"count": count, "ref_count": len(b), "no_class_match": int((~found).sum()),
                   "median_box_px": float(np.median(b)) if len(b) else 0.0,
                   "max_box_px": float(b[found].max()) if found.any() else 0.0,
                   "max_conf": float(c[found].max()) if found.any() else 0.0, "over_1px": int((b > 1.0).sum())}  # fmt: skip
    return out


def _throughput(engine, paths: list[str]) -> float:
    engine.submit(paths[0]).result()
    t0 = time.perf_counter()
    futures = []
    for p in paths:
        futures.append(engine.submit(p))
    for f in futures:
        f.result()
    return len(paths) / (time.perf_counter() - t0)


def _poisson_latency(engine, images: list, rate: float, n: int, seed: int = 1) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    done: dict[int, float] = {}
    futures, starts = [], []
    t = time.perf_counter()
    for i, gap in enumerate(gaps):
        t += gap
        time.sleep(max(0.0, t - time.perf_counter()))
        starts.append(time.perf_counter())
        f = engine.submit(images[i % len(images)])
        f.add_done_callback(lambda _, i=i: done.__setitem__(i, time.perf_counter()))
        futures.append(f)
    sizes = [f.result().batch_size for f in futures]
    time.sleep(0.01)
    lat = [(done[i] - starts[i]) * 1000 for i in range(n)]
    return {"rate": rate, "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99), "mean_batch": sum(sizes) / len(sizes)}


def _streams(engine, n_streams: int, fps: float, seconds: float) -> dict:
    from sources import StreamsSource
    from sources.loopback import MjpegServer

    servers = [MjpegServer(fps=fps) for _ in range(n_streams)]
    source = StreamsSource([s.url for s in servers])
    lat: list[float] = []
    batch_sizes: list[int] = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            frames = [f for f in source.next_batch(timeout=1.0) if f.ok]
            futures = [(f, engine.submit(f)) for f in frames]
            for frame, fut in futures:
                d = fut.result()
                lat.append((time.monotonic() - frame.timestamp) * 1000)
                batch_sizes.append(d.batch_size)
        health = source.health()
    finally:
        source.close()
        for s in servers:
            s.close()
    read = sum(h.frames_read for h in health)
    return {
        "streams": n_streams, "fps": fps, "seconds": seconds, "frames_read": read, "frames_processed": len(lat),
        "frames_dropped": sum(h.frames_dropped for h in health), "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99),
        "mean_batch": sum(batch_sizes) / max(1, len(batch_sizes)),
    }  # fmt: skip


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    thr = results["throughput"]
    labels = [f"ultralytics {k}" for k in thr["ultralytics"]] + ["tandem"]
    values = list(thr["ultralytics"].values()) + [thr["tandem"]]
    a.bar(labels, values, color=["#999"] * len(thr["ultralytics"]) + ["#2a7"])
    a.set_ylabel("images / s")
    a.set_title(f"throughput, {results['model']} @ {results['imgsz']}")
    names, p50, p99 = [], [], []
    for key, r in results["latency"].items():
        names.append(key)
        p50.append(r["p50_ms"])
        p99.append(r["p99_ms"])
    x = range(len(names))
    b.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
    b.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
    b.set_xticks(list(x), names, rotation=20, fontsize=8)
    b.set_ylabel("latency ms")
    b.set_title("latency under load")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_bench(args: argparse.Namespace) -> int:
    import cv2

    from runtime.vision.config import VisionConfig, vision_batching
    from runtime.vision.engine import VisionEngine

    n_images = 14 if args.quick else args.num_images
    n_requests = 20 if args.quick else 60
    stream_s = 4.0 if args.quick else 10.0
    os.makedirs(args.out, exist_ok=True)
    folder = os.path.join(args.out, "bench_images")
    shutil.rmtree(folder, ignore_errors=True)
    paths = _images(folder, n_images)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"bench vision: {len(paths)} images in {folder}")
    ul_batches = [1, args.max_batch_size] if args.quick else sorted({1, 4, args.max_batch_size})
    ul = _ultralytics(args.model, folder, args.imgsz, args.device, ul_batches)
    log(f"ultralytics images/s by batch and threads: { {k: round(v, 2) for k, v in ul.items()} }")
    batching = vision_batching(max_batch_size=args.max_batch_size)
    base = dict(model=args.model, imgsz=args.imgsz, device=args.device, dtype=args.dtype, batching=batching)
    results: dict = {"model": args.model, "imgsz": args.imgsz, "device": args.device, "images": len(paths)}
    engine = VisionEngine(VisionConfig(**base))
    try:
        ours = _throughput(engine, paths)
        stats = engine.stats()
        for key in ("profile_images_per_s", "preferred_batch_sizes", "workers", "threads_per_worker"):
            results[key] = stats[key]
        log(f"tandem images/s: {ours:.2f} (preferred batch {engine.preferred_batch_sizes}, "
            f"{engine.workers} workers x {engine.threads} threads)")  # fmt: skip
        images = [cv2.imread(p) for p in paths[:8]]
        latency = {}
        for frac in (0.5, 0.9):
            latency[f"dynamic {int(frac * 100)}%"] = _poisson_latency(engine, images, frac * ours, n_requests)
        results["streams"] = _streams(engine, args.streams, args.stream_fps, stream_s)
        results["description"] = engine.runner.description
    finally:
        engine.close()
    single = VisionEngine(VisionConfig(**{**base, "batching": vision_batching(max_batch_size=1)}, profile=False))
    try:
        for frac in (0.5, 0.9):
            latency[f"batch1 {int(frac * 100)}%"] = _poisson_latency(single, images, frac * ours, n_requests)
    finally:
        single.close()
    extra = {}  # the opt-in bfloat16 engine, where the CPU runs it (AVX512-BF16 / AMX)
    if args.device == "cpu" and args.dtype == "float32" and _cpu_bf16():
        bf16 = VisionEngine(VisionConfig(**{**base, "dtype": "bfloat16"}))
        try:
            extra["bfloat16"] = _throughput(bf16, paths)
        finally:
            bf16.close()
        log(f"tandem bfloat16 images/s: {extra['bfloat16']:.2f}")
    dtypes = [args.dtype, *extra]
    # bus.jpg and zidane.jpg (real scenes, two aspect ratios) first, then generated images
    parity_paths = sorted(paths, key=lambda p: os.path.basename(p).startswith("img"))[:PARITY_IMAGES]
    parity = _parity(args.model, parity_paths, args.imgsz, args.device, dtypes)
    best_ul = max(ul.values())
    results["throughput"] = {"ultralytics": ul, "tandem": ours, "ratio_vs_best": ours / best_ul,
                             "tandem_by_dtype": {args.dtype: ours, **extra}}  # fmt: skip
    results["parity_vs_ultralytics_float32"] = {"conf": PARITY_CONF, "images": len(parity_paths), **parity}
    results["latency"] = latency
    with open(os.path.join(args.out, "bench_vision.json"), "w") as fh:
        json.dump(results, fh, indent=2)
    _plot(results, os.path.join(args.out, "bench_vision.png"))
    print(f"{'measure':34s} {'value':>10s} {'vs ultralytics':>15s}")
    for key, r in ul.items():
        bs, threads = key.split()
        label = f"ultralytics images/s, batch {bs[1:]}, {threads[1:]} thr"
        print(f"{label:34s} {r:10.2f} {r / best_ul:14.2f}x")
    print(f"{'tandem images/s (' + args.dtype + ')':34s} {ours:10.2f} {ours / best_ul:14.2f}x")
    for dt, r in extra.items():
        print(f"{'tandem images/s (' + dt + ', opt-in)':34s} {r:10.2f} {r / best_ul:14.2f}x")
    for dt, e in parity.items():
        print(f"{'parity ' + dt + ' vs UL fp32, px/conf':34s} box median {e['median_box_px']:.2g} max {e['max_box_px']:.2g}, "
              f"conf max {e['max_conf']:.2g}; {e['over_1px']}/{e['ref_count']} boxes >1 px off "
              f"({e['no_class_match']} class unmatched), {e['count']} dets vs {e['ref_count']}")  # fmt: skip
    for key, r in latency.items():
        print(f"{'latency ' + key + ' p50/p99 ms':34s} {r['p50_ms']:6.0f}/{r['p99_ms']:<6.0f} batch {r['mean_batch']:.2f}")
    s = results["streams"]
    print(f"{'streams ' + str(s['streams']) + 'x' + str(s['fps']) + 'fps p50/p99 ms':34s} "
          f"{s['p50_ms']:6.0f}/{s['p99_ms']:<6.0f} processed {s['frames_processed']}/{s['frames_read']}, "
          f"dropped {s['frames_dropped']}")  # fmt: skip
    print(f"wrote {os.path.join(args.out, 'bench_vision.json')} and bench_vision.png")
    return 0


def _cpu_bf16() -> bool:
    """Whether oneDNN runs bfloat16 natively here (else it is emulated, and slower than float32)."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench vision")
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
