"""`tandem bench vision`: throughput and accuracy against Ultralytics and its exports, latency
under load, live streams.

All in one run, on the same weights and the same images. The model is Tandem's shipped detector
(runtime.vision.detector.WEIGHTS at its size, 320) when that file exists, else --model: a .pt,
or a .yaml with seeded random weights (then there is no accuracy to measure).
  1. images/s over a list of images, median of --repeats passes after a warm-up, for every
     contestant: Tandem with default flags (what `tandem detect --model M --imgsz S` runs:
     backend "auto", dtype "auto", batching at the CLI's defaults; its first start in an empty
     cache and a second start are timed, exports and profile apart), Tandem in --dtype on the
     torch backend and its faster opt-in configs (bfloat16 where the CPU runs it natively;
     bfloat16 and float16 on CUDA), and each exported backend in float32; Ultralytics eager
     at several batch sizes, as shipped (torch at cores - 1 threads) and on every core;
     Ultralytics' ONNX Runtime and OpenVINO exports of the same weights, run in a peer
     virtualenv (--peer-python, default ../peers/yolo; skipped, saying so, when absent). Each
     peer runs in a process of its own (benchmarks/vision_peers.py). Tandem's images/s is
     reported against the best peer row, and the default-flags row against the 1.5x target.
     Full runs add Tandem with the one-to-many head + NMS (end2end=False) where the model also
     has the end-to-end head that Tandem and the peers run.
  2. mAP50-95 and mAP50 beside every row, on one held-out labeled split with one evaluator
     (runtime/vision/evaluate.py; predictions at conf 0.001): for a detector of the shapes
     dataset (the shipped one, or any .pt with its classes), the generated test set
     (runtime.vision.synthetic.write_test_set), whose images are then also the throughput
     images; any other labeled split with --eval-data. Ultralytics' own validator on the same
     split is reported too, as a cross-check of the evaluator.
  3. parity: our detections against Ultralytics' float32 predict on the same weights
     (calibrated when random, see runtime.vision.calibrate), for each Tandem dtype.
  4. latency p50/p99 under Poisson arrivals at 50% and 90% of our capacity (the default-flags
     row's), with dynamic batching (profiled preferred size, max_batch_size) and without (batch 1).
  5. 8 loopback MJPEG streams at 15 fps: frame-to-result latency p50/p99, frames dropped.
Without a shapes model or --eval-data, the images are generated 480x640 JPEGs plus
Ultralytics' bus.jpg and zidane.jpg. Writes bench_vision.json and bench_vision.png to --out
and prints a table.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from runtime.dtypes import cpu_has_native_bf16
from runtime.vision.ultralytics_import import import_ultralytics

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PEER_PYTHON = REPO.parent / "peers" / "yolo" / "bin" / "python"
PEER_SCRIPT = Path(__file__).resolve().parent / "vision_peers.py"
PEER_FORMATS = ("torch", "onnx", "openvino")  # torch runs under this Python, the exports under the peer's


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="bench_out", help="directory for bench_vision.json / .png")
    parser.add_argument(
        "--model",
        default=None,
        help="a .pt or a model .yaml (default: the shipped detector when its weights exist, "
        "else yolo26n.yaml with random weights)",
    )
    parser.add_argument(
        "--imgsz", type=int, default=None, help="default: 320 for a detector of the shapes dataset, else 640"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the dtype of our torch-backend row, the row after the default-flags one "
        "(auto: the default fast path; float32 keeps parity with Ultralytics)",
    )
    parser.add_argument(
        "--num-images",
        type=int,
        default=None,
        help="throughput images: generated ones (default 64, --quick 12; + bus, zidane), "
        "or the first N of the evaluation split (default: all of it)",
    )
    parser.add_argument(
        "--eval-data",
        default=None,
        help="a labeled dataset root (images/<split>, labels/<split>) to measure mAP on "
        "(default: the generated shapes test set, for a shapes detector)",
    )
    parser.add_argument("--eval-split", default="test")
    parser.add_argument(
        "--test-images", type=int, default=None, help="size of the generated shapes test set (default 200, --quick 64)"
    )
    parser.add_argument(
        "--peer-python",
        default=str(DEFAULT_PEER_PYTHON),
        help="the Python with onnxruntime and openvino for the export peers (see ../shared/PEERS.md)",
    )
    parser.add_argument(
        "--peers", default=",".join(PEER_FORMATS), help=f"comma-separated peers to run, of {', '.join(PEER_FORMATS)}"
    )
    parser.add_argument(
        "--backends",
        default="torch,onnxruntime,openvino",
        help="Tandem's forward backends to run (CPU; runtime/vision/backends.py), each a row in float32",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed passes per row (default 3, --quick 2)")
    parser.add_argument(
        "--max-batch-size", type=int, default=8, help="of every Tandem row but the default-flags one (the CLI's: 8)"
    )
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-fps", type=float, default=15.0)
    parser.add_argument("--quick", action="store_true", help="fewer images, rows, requests and seconds")


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def bench_images(folder: str, n: int) -> list[str]:
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


def _model_info(path: str) -> tuple[dict[int, str] | None, bool]:
    """(the class names a .pt was trained with, None for a .yaml; whether its head has an
    end-to-end branch, which Tandem runs by default)."""
    import torch

    import_ultralytics()
    if path.endswith((".yaml", ".yml")):
        from ultralytics import YOLO

        with torch.random.fork_rng(devices=[]):
            model, names = YOLO(path, task="detect").model, None
    else:
        from ultralytics.nn.tasks import load_checkpoint

        model, _ = load_checkpoint(path, device="cpu")
        names = getattr(model, "names", None) or {}
        names = dict(enumerate(names)) if isinstance(names, (list, tuple)) else dict(names)
    return names, getattr(model.model[-1], "one2one_cv2", None) is not None


def _resolve_model(args: argparse.Namespace, log) -> tuple[str, int, dict[int, str] | None, bool]:
    """(model, imgsz, its class names (None for a .yaml), whether it has an end-to-end head)."""
    from runtime.vision import detector
    from runtime.vision.synthetic import CLASSES

    model = args.model
    if model is None:
        if detector.WEIGHTS.is_file():
            model = str(detector.WEIGHTS)
        else:
            model = "yolo26n.yaml"
            log(f"the shipped detector is not at {detector.WEIGHTS}: yolo26n.yaml with random weights, no mAP")
    names, end2end = _model_info(model)
    shapes = names is not None and [names.get(i) for i in range(len(names))] == list(CLASSES)
    imgsz = args.imgsz or (detector.IMGSZ if shapes else 640)
    return model, imgsz, names, end2end


def _eval_set(args: argparse.Namespace, model: str, names: dict[int, str] | None, log) -> tuple[str, str] | None:
    """(dataset root, split) to measure mAP on, or None where mAP means nothing."""
    from runtime.vision import detector
    from runtime.vision.synthetic import CLASSES, write_test_set

    if args.eval_data:
        return args.eval_data, args.eval_split
    if model.endswith((".yaml", ".yml")):
        return None  # random weights: mAP n/a
    if names is None or [names.get(i) for i in range(len(names))] != list(CLASSES):
        log(f"{model} does not detect the shapes dataset's classes and no --eval-data was given: no mAP")
        return None
    root = os.path.join(args.out, "test_set")
    shutil.rmtree(root, ignore_errors=True)
    count = args.test_images or (64 if args.quick else 200)
    write_test_set(root, count, detector.IMGSZ)
    return root, "test"


def _val_yaml(root: str, split: str, names: dict[int, str], out: str) -> str:
    """A data YAML whose val split is the evaluation split, for Ultralytics' validator."""
    path = os.path.join(out, "eval_data.yaml")
    lines = [f"path: {os.path.abspath(root)}", f"train: images/{split}", f"val: images/{split}", "names:"]
    lines += [f"  {i}: {n}" for i, n in sorted(names.items())]
    Path(path).write_text("\n".join(lines) + "\n")
    return path


def _run_peer(
    fmt: str,
    python: str,
    model: str,
    imgsz: int,
    device: str,
    paths: list[str],
    batches: list[int],
    repeats: int,
    out: str,
    eval_set: tuple[str, str] | None,
    val_yaml: str | None,
    log,
) -> dict:
    """One peer format in a process of its own; its result record ({"error"} when it failed)."""
    work = os.path.abspath(os.path.join(out, "peers"))
    os.makedirs(work, exist_ok=True)
    listing = os.path.join(work, "images.txt")
    Path(listing).write_text("\n".join(os.path.abspath(p) for p in paths) + "\n")
    result, log_path = os.path.join(work, f"{fmt}.json"), os.path.join(work, f"{fmt}.log")
    model = os.path.abspath(model) if os.path.isfile(model) else model  # the peer runs in another folder
    cmd = [
        python,
        str(PEER_SCRIPT),
        "--format",
        fmt,
        "--model",
        model,
        "--imgsz",
        str(imgsz),
        "--device",
        device,
        "--images",
        listing,
        "--batches",
        ",".join(map(str, batches)),
        "--repeats",
        str(repeats),
        "--workdir",
        os.path.join(work, fmt),
        "--result",
        result,
    ]
    if eval_set is not None:
        preds = os.path.join(work, f"{fmt}_predictions.json")
        cmd += ["--eval-dir", os.path.abspath(eval_set[0]), "--eval-split", eval_set[1], "--predictions", preds]
    if val_yaml is not None and fmt == "torch":
        cmd += ["--val-data", os.path.abspath(val_yaml)]
    log(f"peer {fmt}: {python} (log {log_path})")
    env = {**os.environ, "YOLO_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)  # as a user's shell has it; each row sets its own threads
    Path(result).unlink(missing_ok=True)  # a stale one must not pass for this run's
    try:
        with open(log_path, "w") as fh:
            subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=work, env=env, timeout=3600, check=False)
    except subprocess.TimeoutExpired:
        return {"format": fmt, "error": "timed out after 3600 s", "rows": []}
    try:
        return json.loads(Path(result).read_text())
    except (OSError, ValueError):
        tail = Path(log_path).read_text()[-600:] if os.path.isfile(log_path) else ""
        return {"format": fmt, "error": f"no result written; log tail: {tail}", "rows": []}


def _peers(
    args, model: str, imgsz: int, paths: list[str], eval_set, val_yaml, repeats: int, names, log
) -> tuple[list[dict], dict, list[str]]:
    """Every peer row (with mAP where measured), Ultralytics' own validation, and what was skipped."""
    from runtime.vision.evaluate import evaluate, load_predictions

    wanted = [f for f in args.peers.split(",") if f]
    unknown = sorted(set(wanted) - set(PEER_FORMATS))
    if unknown:
        raise ValueError(f"--peers takes {', '.join(PEER_FORMATS)}, got {', '.join(unknown)}")
    top = args.max_batch_size
    rows, val, skipped = [], {}, []
    for fmt in wanted:
        python = sys.executable if fmt == "torch" else args.peer_python
        if fmt != "torch" and not os.path.isfile(python):
            skipped.append(f"{fmt}: no peer Python at {python} (see ../shared/PEERS.md, or --peer-python)")
            continue
        if fmt == "openvino" and args.device != "cpu":
            skipped.append(f"openvino: a CPU peer, not run against device {args.device}")
            continue
        if fmt == "torch":
            batches = [1, top] if args.quick else sorted({1, 4, top})
        else:
            batches = [1] if args.quick else sorted({1, top})
        r = _run_peer(
            fmt, python, model, imgsz, args.device, paths, batches, repeats, args.out, eval_set, val_yaml, log
        )
        if r.get("error"):
            skipped.append(f"{fmt}: failed: {r['error']}")
        for note in r.get("notes", []):
            skipped.append(f"{fmt}: {note}")
        acc = None
        if eval_set is not None and r.get("predictions"):
            acc = evaluate(load_predictions(r["predictions"]), *eval_set, names=names)
        for row in r.get("rows", []):
            rows.append({**row, "kind": "peer", "versions": r.get("versions"), **_map_fields(acc)})
            log(f"  {row['name']}: {row['images_per_s']:.2f} images/s" + _map_text(acc))
        val.update(r.get("ultralytics_val") or {})
    return rows, val, skipped


def _map_fields(acc: dict | None) -> dict:
    if acc is None:
        return {"map50_95": None, "map50": None}
    return {"map50_95": acc["map50_95"], "map50": acc["map50"], "per_class": acc["per_class"]}


def _map_text(acc: dict | None) -> str:
    return f", mAP50-95 {acc['map50_95']:.4f}" if acc else ""


def default_flags_config(model: str, imgsz: int, device: str):
    """The VisionConfig `tandem detect SOURCE --model M --imgsz S --device D` runs: every
    other flag at its default (backend "auto" and dtype "auto" among them)."""
    from runtime.vision.cli import add_detect_arguments, detect_config

    parser = argparse.ArgumentParser()
    add_detect_arguments(parser)
    return detect_config(parser.parse_args(["SOURCE", "--model", model, "--imgsz", str(imgsz), "--device", device]))


def _start_twice(config, log) -> tuple[object, dict]:
    """The default-flags engine, started first in an empty cache (TANDEM_CACHE_DIR: a fresh
    folder, so exports and profile are paid as on a first start), then again over that cache;
    (the second engine, both starts' records: startup_s, export_s, profile_s, why)."""
    import tempfile

    from runtime.vision.engine import VisionEngine

    starts = {}
    saved = os.environ.get("TANDEM_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="tandem-cold-") as cache:
        os.environ["TANDEM_CACHE_DIR"] = cache
        try:
            first = VisionEngine(config)  # built and profiled: the start-up is the cost
            starts["first"] = first.startup()
            first.close()
            engine = VisionEngine(config)
            starts["second"] = engine.startup()
        finally:
            if saved is None:
                os.environ.pop("TANDEM_CACHE_DIR", None)
            else:
                os.environ["TANDEM_CACHE_DIR"] = saved
    for when, s in starts.items():
        log(
            f"tandem default flags, {when} start: {s['startup_s']:.1f} s (exports {s['export_s']:.1f} s, "
            f"profile {s['profile_s']:.1f} s); backend {s['backend']} ({s['why']})"
        )
    return engine, starts


def _tandem_configs(args: argparse.Namespace, end2end: bool) -> dict[str, dict]:
    """Tandem's rows after the default-flags one, the first being --dtype on the torch backend
    (the default "auto" is the fast path each device gets by default); float32 beside it
    (parity with Ultralytics), the other fast dtypes the device runs, and (full runs) the
    one-to-many head + NMS where the model also has an end-to-end head, which Tandem runs by
    default: the heads differ in accuracy (and the peers run the end-to-end one)."""
    from runtime.vision.config import VisionConfig

    resolved = VisionConfig(dtype=args.dtype, device=args.device).resolved_dtype()
    first = f"auto ({resolved})" if args.dtype == "auto" else args.dtype
    configs = {first: {"dtype": args.dtype, "backend": "torch"}}
    extra = ["float32"]
    if args.device == "cpu" and cpu_has_native_bf16():  # AVX512-BF16 / AMX; emulated bfloat16 is slower than float32
        extra.append("bfloat16")
    elif args.device.startswith("cuda"):
        extra += ["bfloat16", "float16"]
    for dtype in extra:
        if dtype != resolved:
            configs[dtype] = {"dtype": dtype, "backend": "torch"}
    if end2end and not args.quick:
        configs["float32 nms head"] = {"dtype": "float32", "end2end": False, "backend": "torch"}
    if args.device == "cpu":  # the exported backends, same weights via Ultralytics' exporter
        for backend in [b for b in args.backends.split(",") if b and b != "torch"]:
            configs[f"{backend} float32"] = {"dtype": "float32", "backend": backend}
    return configs


TARGET = 1.5  # issues 21 and 30: Tandem with default flags at least 1.5x the best peer


def cpu_flags() -> str:
    """The CPU model and the flags that decide these figures (AVX2, AVX-512 and its bfloat16 and
    VNNI extensions, AMX), as benchmarks.common.cpu_info reads them for every bench."""
    from benchmarks.common import cpu_info

    info = cpu_info()
    return f"{info['model']}, {info['cores']} cores: {info['flags']}"


def _run_all(engine, paths: list[str], window: int = 128) -> None:
    """Every image through engine.submit, at most `window` waiting at once (the engine's queue is
    bounded: 256 by default), each awaited."""
    pending: collections.deque = collections.deque()
    for p in paths:
        if len(pending) >= window:
            pending.popleft().result()
        pending.append(engine.submit(p))
    for f in pending:
        f.result()


def _throughput_runs(engine, paths: list[str], repeats: int) -> list[float]:
    """images/s of `repeats` passes over `paths`, all submitted at once, after a warm-up."""
    _run_all(engine, paths[:4])
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _run_all(engine, paths)
        rates.append(len(paths) / (time.perf_counter() - t0))
    return rates


def throughput(engine, paths: list[str]) -> float:
    """One pass (benchmarks/mixed.py's rounds)."""
    return _throughput_runs(engine, paths, 1)[0]


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
    runners = {
        dt: YoloRunner(
            VisionConfig(model=model_path, imgsz=imgsz, device=device, conf=PARITY_CONF, dtype=dt), module=model.model
        )
        for dt in dtypes
    }
    refs = [
        model.predict(p, imgsz=imgsz, conf=PARITY_CONF, device=device, verbose=False, nms=False)[0].boxes.cpu()
        for p in paths
    ]
    out = {}
    for dt, runner in runners.items():
        box_err, conf_err, count = [], [], 0
        for image, ref in zip(images, refs):
            (d,) = runner.predict([image])
            b, c = match_errors(
                d.boxes, d.conf, d.cls, ref.xyxy.numpy(), ref.conf.numpy(), ref.cls.numpy().astype(np.int64)
            )
            box_err.append(b)
            conf_err.append(c)
            count += len(d)
        b, c = np.concatenate(box_err), np.concatenate(conf_err)
        found = np.isfinite(b)
        out[dt] = {
            "count": count,
            "ref_count": len(b),
            "no_class_match": int((~found).sum()),
            "median_box_px": float(np.median(b)) if len(b) else 0.0,
            "max_box_px": float(b[found].max()) if found.any() else 0.0,
            "max_conf": float(c[found].max()) if found.any() else 0.0,
            "over_1px": int((b > 1.0).sum()),
        }
    return out


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
        "streams": n_streams,
        "fps": fps,
        "seconds": seconds,
        "frames_read": read,
        "frames_processed": len(lat),
        "frames_dropped": sum(h.frames_dropped for h in health),
        "p50_ms": _pct(lat, 50),
        "p99_ms": _pct(lat, 99),
        "mean_batch": sum(batch_sizes) / max(1, len(batch_sizes)),
    }


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    rows = results["rows"]
    bars = a.bar(
        [r["name"] for r in rows],
        [r["images_per_s"] for r in rows],
        color=["#2a7" if r["kind"] == "tandem" else "#999" for r in rows],
    )
    for bar, r in zip(bars, rows):
        if r.get("map50_95") is not None:
            a.annotate(
                f"{r['map50_95']:.3f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    plt.setp(a.get_xticklabels(), rotation=40, ha="right", fontsize=7)
    a.set_ylabel("images / s (mAP50-95 above the bars)")
    a.set_title(f"throughput, {os.path.basename(results['model'])} @ {results['imgsz']}")
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
    from runtime.vision.evaluate import evaluate_engine, image_files

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    n_requests = 20 if args.quick else 60
    stream_s = 4.0 if args.quick else 10.0
    repeats = args.repeats or (2 if args.quick else 3)
    os.makedirs(args.out, exist_ok=True)
    model, imgsz, names, end2end = _resolve_model(args, log)
    eval_set = _eval_set(args, model, names, log)
    if eval_set is not None:
        paths = [str(p) for p in image_files(*eval_set)][: args.num_images or None]
        log(
            f"bench vision: {model} @ {imgsz}; mAP and throughput on {len(paths)} images of "
            f"{eval_set[0]}/images/{eval_set[1]}"
        )
    else:
        folder = os.path.join(args.out, "bench_images")
        shutil.rmtree(folder, ignore_errors=True)
        paths = bench_images(folder, args.num_images or (12 if args.quick else 64))
        log(f"bench vision: {model} @ {imgsz}; {len(paths)} generated images in {folder}, no mAP")
    val_yaml = _val_yaml(*eval_set, names, args.out) if eval_set is not None and names else None
    peer_rows, ul_val, skipped = _peers(args, model, imgsz, paths, eval_set, val_yaml, repeats, names, log)
    for msg in skipped:
        log(f"skipped: {msg}")

    batching = vision_batching(max_batch_size=args.max_batch_size)
    base = dict(model=model, imgsz=imgsz, device=args.device, batching=batching)
    results: dict = {
        "model": model,
        "imgsz": imgsz,
        "device": args.device,
        "images": len(paths),
        "eval": None if eval_set is None else {"data": eval_set[0], "split": eval_set[1]},
    }
    tandem_rows, latency = [], {}
    images = [cv2.imread(p) for p in paths[:8]]  # the latency runs' inputs
    default = default_flags_config(model, imgsz, args.device)
    contestants = [("default flags", None, default)]
    contestants += [(n, o, VisionConfig(**base, **o)) for n, o in _tandem_configs(args, end2end).items()]
    for k, (name, overrides, config) in enumerate(contestants):
        if k == 0:
            engine, results["startup"] = _start_twice(config, log)
            name = f"default flags [{engine.runner.backend}]"
            b = config.batching
            overrides = {"dtype": config.dtype, "backend": config.backend, "max_batch_size": b.max_batch_size}
            overrides["max_queue_delay_ms"] = b.max_queue_delay_ms
        else:
            engine = VisionEngine(config)
        try:
            runs = _throughput_runs(engine, paths, repeats)
            row = {
                "name": f"tandem {name}",
                "kind": "tandem",
                "config": overrides,
                "images_per_s": statistics.median(runs),
                "runs": runs,
                "preferred_batch_sizes": list(engine.preferred_batch_sizes),
                "backend": engine.runner.backend,
            }
            if k == 0:  # default flags: the engine the latency and stream figures are taken on
                stats = engine.stats()
                for key in ("profile_images_per_s", "preferred_batch_sizes", "workers", "threads_per_worker"):
                    results[key] = stats[key]
                for frac in (0.5, 0.9):
                    rate = frac * row["images_per_s"]
                    latency[f"dynamic {int(frac * 100)}%"] = _poisson_latency(engine, images, rate, n_requests)
                results["streams"] = _streams(engine, args.streams, args.stream_fps, stream_s)
                results["description"] = engine.runner.description
        finally:
            engine.close()
        # mAP of what ran: "auto" is pinned to the backend the row's start-up chose
        measured = dataclasses.replace(config, backend=engine.runner.backend)
        acc = evaluate_engine(measured, *eval_set) if eval_set is not None else None
        tandem_rows.append({**row, **_map_fields(acc)})
        log(
            f"tandem {name}: {row['images_per_s']:.2f} images/s (preferred batch {row['preferred_batch_sizes']}, "
            f"{engine.workers} workers x {engine.threads} threads)" + _map_text(acc)
        )
    ours = tandem_rows[0]["images_per_s"]
    single = VisionEngine(
        VisionConfig(**{**base, "dtype": args.dtype, "batching": vision_batching(max_batch_size=1)}, profile=False)
    )
    try:
        for frac in (0.5, 0.9):
            latency[f"batch1 {int(frac * 100)}%"] = _poisson_latency(single, images, frac * ours, n_requests)
    finally:
        single.close()
    dtypes = list(dict.fromkeys(r["config"]["dtype"] for r in tandem_rows))
    # generated runs: bus.jpg and zidane.jpg (real scenes, two aspect ratios) first
    parity_paths = sorted(paths, key=lambda p: os.path.basename(p).startswith("img"))[:PARITY_IMAGES]
    parity = _parity(model, parity_paths, imgsz, args.device, dtypes)

    best = max(peer_rows, key=lambda r: r["images_per_s"], default=None)
    for r in tandem_rows:
        r["vs_best_peer"] = r["images_per_s"] / best["images_per_s"] if best else None
    results["rows"] = peer_rows + tandem_rows
    fastest = max(tandem_rows, key=lambda r: r["images_per_s"])
    results["cpu"] = cpu_flags()
    results["target"] = {
        "ratio": TARGET,
        "default_flags": tandem_rows[0]["name"],
        "default_flags_ratio": tandem_rows[0]["vs_best_peer"],
        "met": None if best is None else tandem_rows[0]["vs_best_peer"] >= TARGET,  # with default flags
        "best_tandem": fastest["name"],
        "best_tandem_ratio": fastest["vs_best_peer"],
    }
    results["best_peer"] = None if best is None else {"name": best["name"], "images_per_s": best["images_per_s"]}
    results["skipped"] = skipped
    results["ultralytics_val"] = ul_val or None
    results["throughput"] = {
        "ultralytics": {
            r["name"].removeprefix("ultralytics torch "): r["images_per_s"] for r in peer_rows if r["format"] == "torch"
        },
        "peers": {r["name"]: r["images_per_s"] for r in peer_rows},
        "tandem": ours,
        "ratio_vs_best": tandem_rows[0]["vs_best_peer"],
        "tandem_by_dtype": {  # the torch backend's rows
            r["config"]["dtype"]: r["images_per_s"]
            for r in tandem_rows
            if r["config"].get("backend") == "torch" and "end2end" not in r["config"]
        },
    }
    results["parity_vs_ultralytics_float32"] = {"conf": PARITY_CONF, "images": len(parity_paths), **parity}
    results["latency"] = latency
    with open(os.path.join(args.out, "bench_vision.json"), "w") as fh:
        json.dump(results, fh, indent=2)
    _plot(results, os.path.join(args.out, "bench_vision.png"))
    _print_table(results)
    print(f"wrote {os.path.join(args.out, 'bench_vision.json')} and bench_vision.png")
    return 0


def _print_table(results: dict) -> None:
    best = results["best_peer"]
    fmt_map = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    print(f"{'contestant':34s} {'images/s':>10s} {'vs best peer':>13s} {'mAP50-95':>9s} {'mAP50':>7s}")
    for r in results["rows"]:
        ratio = f"{r['images_per_s'] / best['images_per_s']:12.2f}x" if best else f"{'n/a':>13s}"
        maps = f"{fmt_map(r['map50_95']):>9s} {fmt_map(r['map50']):>7s}"
        print(f"{r['name']:34s} {r['images_per_s']:10.2f} {ratio} {maps}")
    if best:
        print(f"best peer: {best['name']} ({best['images_per_s']:.2f} images/s)")
    t = results["target"]
    if t["met"] is not None:
        print(
            f"Tandem, default flags: {t['default_flags_ratio']:.2f}x the best peer: target {t['ratio']}x "
            f"{'met' if t['met'] else 'not met'} (fastest Tandem row: {t['best_tandem']}, {t['best_tandem_ratio']:.2f}x)"
        )
    else:
        print(f"Tandem, default flags: no peer ran, so no ratio to the {t['ratio']}x target")
    for when, s in results["startup"].items():
        print(
            f"{'start-up, default flags, ' + when:34s} {s['startup_s']:.1f} s: exports {s['export_s']:.1f} s, "
            f"profile {s['profile_s']:.1f} s; backend {s['backend']} ({s['why']})"
        )
    print(f"cpu: {results['cpu']}")
    for head, v in (results.get("ultralytics_val") or {}).items():
        print(f"{'ultralytics val, ' + head:34s} {'':10s} {'':13s} {v['map50_95']:9.4f} {v['map50']:7.4f}")
    for msg in results["skipped"]:
        print(f"skipped: {msg}")
    for dt, e in results["parity_vs_ultralytics_float32"].items():
        if not isinstance(e, dict):
            continue
        print(
            f"{'parity ' + dt + ' vs UL fp32, px/conf':34s} box median {e['median_box_px']:.2g} max {e['max_box_px']:.2g}, "
            f"conf max {e['max_conf']:.2g}; {e['over_1px']}/{e['ref_count']} boxes >1 px off "
            f"({e['no_class_match']} class unmatched), {e['count']} dets vs {e['ref_count']}"
        )
    for key, r in results["latency"].items():
        print(
            f"{'latency ' + key + ' p50/p99 ms':34s} {r['p50_ms']:6.0f}/{r['p99_ms']:<6.0f} batch {r['mean_batch']:.2f}"
        )
    s = results["streams"]
    print(
        f"{'streams ' + str(s['streams']) + 'x' + str(s['fps']) + 'fps p50/p99 ms':34s} "
        f"{s['p50_ms']:6.0f}/{s['p99_ms']:<6.0f} processed {s['frames_processed']}/{s['frames_read']}, "
        f"dropped {s['frames_dropped']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench vision")
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
