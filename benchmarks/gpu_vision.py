"""GPU check of the vision path: python -m benchmarks.gpu_vision [--out DIR]. A few minutes on
one NVIDIA GPU; exits 2 where CUDA (or Ultralytics) is unavailable.

  0. the float16 input path: dtype and layout of the tensor prepare hands over, the staging
     buffer page-locked, the copy left running (an event) rather than waited for
  1. float16 against float32: Tandem's detections of the same images, boxes matched by IoU
  2. Tandem against Ultralytics' predict on the same GPU, weights and decoded pixels, per dtype;
     and the VisionEngine's detections against the runner's (the engine prepares the next
     batch in reused page-locked buffers while the device runs the current one: a buffer
     overwritten too early shows up here as boxes of the wrong image)
  3. images/s by batch size (1, 2, 4, 8, 16, 32), float16 and float32, over the same JPEG files:
     - Tandem's runner, one batch at a time (decode, letterbox, forward, postprocess in turn;
       each batch's images decoded and letterboxed side by side on the runner's host pool),
     - Tandem's VisionEngine (decode, letterbox and copy of the next batch beside the forward),
     - Ultralytics' YOLO(model).predict(folder, device=0, batch=b, stream=True), float16 by
       half=True or, where Ultralytics has it (8.4), quantize=16
  4. the start-up profile (what VisionEngine runs): its images/s by batch size and the size it
     picks, per dtype, beside the batch size the engine measured fastest

Model: runtime.vision.detector.WEIGHTS (Tandem's trained detector, imgsz 320) when that file
exists, else yolo26n.yaml at 640 with seeded random weights, calibrated so its outputs spread
(runtime.vision.calibrate) and saved as a checkpoint that both sides load; --model/--imgsz
choose another. The images are the generated shapes (runtime.vision.synthetic), drawn at 1.5x
imgsz so that letterboxing resizes them.

Writes DIR/vision_gpu_check.json and DIR/vision_gpu_check.png (default bench_out); the exit code
is 0 when the detections agree (1 and 2 above), 1 when they do not, 2 where it cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

SIZES = (1, 2, 4, 8, 16, 32)
DTYPES = ("float32", "float16")
CONF = 0.25  # Ultralytics' predict default
# float16 against float32: a float32 box is kept when float16 has a box of its class with IoU >=
# KEEP_IOU; at least MIN_KEPT of the boxes (of the larger of the two sets) must be kept. That
# holds for trained weights only: random ones fill the head's top 300 with near-tied scores, so
# float16 rounding swaps which boxes make the cut (seen on an H200, yolo26n.yaml calibrated, 640:
# 35% kept, yet the boxes that matched had median IoU 0.989 and confidences within 0.005). For
# them the check is that matched boxes agree: median IoU >= RANDOM_MEDIAN_IOU and confidences
# within RANDOM_MAX_CONF (a wrong cast or layout gives boxes of nothing).
KEEP_IOU = 0.9
MIN_KEPT = 0.95
RANDOM_MEDIAN_IOU = 0.95
RANDOM_MAX_CONF = 0.02
# Tandem against Ultralytics (same dtype, same GPU): the median over reference boxes of the
# largest coordinate difference to the nearest box of its class, in pixels, and the share of
# reference boxes with no box of their class at all. Not bit-exact on a GPU: Tandem runs
# channels_last, so cuDNN picks other kernels than for Ultralytics' contiguous input, and float32
# convolutions run in TF32 there (torch's default for cuDNN), ~1e-3 relative: seen on an H200,
# random weights at 640, median 0.09 px (float32) and 0.05 px (float16).
PARITY_MEDIAN_PX = {"float32": 0.25, "float16": 0.5}
PARITY_MAX_MISSING = 0.02
# The engine against the runner, same batches: any difference beyond kernel rounding means a
# batch ran on the wrong pixels.
TRAINED = "Tandem's trained detector"
MAX_MAP_DROP = 0.005  # float16's mAP50-95 may trail float32's by at most 0.5 points (issue 11)
ENGINE_MAX_PX = {"float32": 0.01, "float16": 0.5}


# -- comparisons (pure numpy; unit-tested on CPU) --
def iou(a: np.ndarray, b: np.ndarray, pad: float = 0.0) -> np.ndarray:
    """IoU of every xyxy box in `a` (n, 4) with every one in `b` (m, 4): (n, m), each box put in
    order (x1 <= x2, y1 <= y2) and grown by `pad` pixels on every side first."""
    a = np.concatenate([np.minimum(a[:, :2], a[:, 2:]), np.maximum(a[:, :2], a[:, 2:])], 1)
    b = np.concatenate([np.minimum(b[:, :2], b[:, 2:]), np.maximum(b[:, :2], b[:, 2:])], 1)
    if pad:
        grow = np.array([-pad, -pad, pad, pad], np.float32)
        a, b = a + grow, b + grow
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area_a = np.clip(a[:, 2:] - a[:, :2], 0, None).prod(-1)
    area_b = np.clip(b[:, 2:] - b[:, :2], 0, None).prod(-1)
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-9)


def match(
    ref_boxes: np.ndarray,
    ref_cls: np.ndarray,
    boxes: np.ndarray,
    cls: np.ndarray,
    min_iou: float = 0.5,
    pad: float = 0.0,
) -> list[tuple[int, int, float]]:
    """Greedy one-to-one matching of same-class boxes, highest IoU first: (ref i, j, IoU)."""
    if not len(ref_boxes) or not len(boxes):
        return []
    m = iou(ref_boxes, boxes, pad)
    m[ref_cls[:, None] != cls[None, :]] = -1.0
    used_i, used_j = np.zeros(m.shape[0], bool), np.zeros(m.shape[1], bool)
    pairs = []
    for flat in np.argsort(-m, axis=None, kind="stable"):
        i, j = divmod(int(flat), m.shape[1])
        if m[i, j] < min_iou:
            break  # sorted: every pair after this one is below too
        if not used_i[i] and not used_j[j]:
            pairs.append((i, j, float(m[i, j])))
            used_i[i] = used_j[j] = True
    return pairs


def agreement(ref: list, got: list, keep_iou: float = KEEP_IOU) -> dict:
    """Boxes of `got` against `ref` (lists of Detections of the same images)."""
    n_ref = n_got = kept = 0
    ious: list[float] = []
    conf_diff: list[float] = []
    for r, g in zip(ref, got, strict=True):
        n_ref, n_got = n_ref + len(r), n_got + len(g)
        # Boxes put in order and grown by half a pixel: random weights give many inverted boxes
        # and boxes clipped to zero width at the image border, whose IoU would otherwise be 0
        # even with themselves; real boxes barely change.
        for i, j, v in match(r.boxes, r.cls, g.boxes, g.cls, pad=0.5):
            ious.append(v)
            conf_diff.append(abs(float(r.conf[i]) - float(g.conf[j])))
            kept += v >= keep_iou
    denom = max(n_ref, n_got)
    return {
        "ref_boxes": n_ref,
        "boxes": n_got,
        "matched": len(ious),
        f"kept_iou_{keep_iou}": int(kept),
        "kept_share": kept / denom if denom else 1.0,
        "median_iou": float(np.median(ious)) if ious else None,
        "min_matched_iou": min(ious) if ious else None,
        "max_conf_diff": max(conf_diff) if conf_diff else None,
    }


def box_errors(ref: list[tuple[np.ndarray, np.ndarray, np.ndarray]], got: list) -> dict:
    """Per reference box (xyxy, conf, cls per image): the largest coordinate difference to the
    nearest box of its class in `got` (Detections), in pixels; inf where it has none."""
    from runtime.vision.calibrate import match_errors

    errs, confs, count = [], [], 0
    for (rb, rc, rk), g in zip(ref, got, strict=True):
        b, c = match_errors(g.boxes, g.conf, g.cls, rb, rc, rk)
        errs.append(b)
        confs.append(c)
        count += len(g)
    b, c = (np.concatenate(errs), np.concatenate(confs)) if errs else (np.zeros(0), np.zeros(0))
    found = np.isfinite(b)
    return {
        "ref_boxes": len(b),
        "boxes": count,
        "missing": int((~found).sum()),
        "missing_share": float((~found).mean()) if len(b) else 0.0,
        "median_px": float(np.median(b[found])) if found.any() else 0.0,
        "max_px": float(b[found].max()) if found.any() else 0.0,
        "max_conf_diff": float(c[found].max()) if found.any() else 0.0,
    }


def _as_ref(dets: list) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return [(d.boxes, d.conf, d.cls) for d in dets]


# -- set-up --
def _images(folder: Path, n: int, size: int, seed: int = 0) -> list[str]:
    import cv2

    from runtime.vision.synthetic import draw_image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        img, _ = draw_image(rng, size)
        path = folder / f"img{i:04d}.jpg"
        cv2.imwrite(str(path), img, [cv2.IMWRITE_JPEG_QUALITY, 95])
        paths.append(str(path))
    return paths


def _resolve(model: str | None, imgsz: int | None) -> tuple[str, int, str]:
    """(model, imgsz, what it is): the defaults filled in."""
    from runtime.vision.detector import IMGSZ, WEIGHTS

    if model is None:
        model = str(WEIGHTS) if WEIGHTS.is_file() else "yolo26n.yaml"
    trained = os.path.abspath(model) == str(WEIGHTS)
    what = TRAINED if trained else model
    if model.endswith((".yaml", ".yml")):
        what = f"{model}, random weights (seed 0) calibrated on the first check images"
    return model, imgsz or (IMGSZ if trained else 640), what


def _checkpoint(model: str, imgsz: int, tmp: Path, calib_images: list[np.ndarray]) -> str:
    """The checkpoint both sides load: `model` itself, or a .yaml built, calibrated and saved."""
    if not model.endswith((".yaml", ".yml")):
        return model
    from ultralytics import YOLO

    from runtime.vision.calibrate import calibrate

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yolo = YOLO(model)
    calibrate(yolo.model, calib_images, imgsz)
    path = tmp / (Path(model).stem + "_calibrated.pt")
    yolo.save(str(path))
    return str(path)


# -- measurements --
def _rate(fn, reps: int) -> tuple[float, object]:
    """Best images/s of `fn` (which returns (images, result)) over `reps` runs, and the last result."""
    best, out = 0.0, None
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n, out = fn()
        best = max(best, n / (time.perf_counter() - t0))
    return best, out


def _runner_rates(runner, paths: list[str], sizes, reps: int) -> tuple[dict[int, float], dict[int, list]]:
    from runtime.vision.batch import decode

    rates, dets = {}, {}
    for b in sizes:
        chunks = [paths[i : i + b] for i in range(0, len(paths), b)]

        def images(c: list[str]) -> list[np.ndarray]:  # decoded side by side, as the engine does
            return list(runner.host_pool.map(decode, c)) if runner.host_pool is not None else [decode(p) for p in c]

        def run(chunks=chunks) -> tuple[int, list]:
            out = []
            for c in chunks:
                out += runner.predict(images(c))
            return len(out), out

        runner.predict(images(chunks[0]))  # warm-up: kernels for this batch size
        rates[b], dets[b] = _rate(run, reps)
    return rates, dets


def _engine_rates(path: str, imgsz: int, dtype: str, paths: list[str], sizes, reps: int) -> tuple[dict, dict, dict]:
    from runtime.vision.config import VisionConfig, vision_batching
    from runtime.vision.engine import VisionEngine

    rates, dets, counts = {}, {}, {}
    for b in sizes:
        # All images are queued at once, so every batch is released full at b (the delay only
        # bounds a last partial one); profile=False: the batch size is the one under test.
        batching = vision_batching(
            max_batch_size=b, preferred_batch_sizes=(b,), max_queue_delay_ms=100, max_queue_size=max(len(paths), 256)
        )
        config = VisionConfig(
            model=path, imgsz=imgsz, device="cuda", dtype=dtype, conf=CONF, profile=False, batching=batching
        )
        with VisionEngine(config) as engine:
            for f in [engine.submit(p) for p in paths[:b]]:  # warm-up
                f.result()

            def run(engine=engine) -> tuple[int, list]:
                out = [f.result() for f in [engine.submit(p) for p in paths]]
                return len(out), out

            rates[b], dets[b] = _rate(run, reps)
            counts[b] = engine.stats()["batch_size_counts"]
    return rates, dets, counts


def _precision(dtype: str) -> dict:
    """Ultralytics' float16 switch: `quantize=16` where it has one (it deprecated `half`, which
    it maps onto quantize), else `half=True`."""
    from ultralytics.cfg import DEFAULT_CFG_DICT

    if "quantize" in DEFAULT_CFG_DICT:
        return {"quantize": 16 if dtype == "float16" else None}
    return {"half": dtype == "float16"}


def _ultralytics_rates(
    path: str, folder: str, imgsz: int, dtype: str, end2end: bool, sizes, reps: int
) -> dict[int, float]:
    from ultralytics import YOLO

    model = YOLO(path)
    rates = {}
    for b in sizes:
        kw = dict(
            imgsz=imgsz,
            device=0,
            batch=b,
            conf=CONF,
            verbose=False,
            stream=True,
            nms=False if end2end else None,
            **_precision(dtype),
        )
        model.predictor = None  # a fresh predictor for each batch size, set up as a user's would be
        for _ in model.predict(folder, **kw):  # builds the predictor and warms it up
            break

        def run(kw=kw) -> tuple[int, None]:
            n = 0
            for r in model.predict(folder, **kw):
                r.boxes.data.cpu()  # read back, as Tandem's numpy results are
                n += 1
            return n, None

        rates[b] = _rate(run, reps)[0]
    return rates


def _ultralytics_dets(path: str, images: list[np.ndarray], imgsz: int, dtype: str, end2end: bool) -> list:
    """Ultralytics' detections of the decoded `images` (the same pixels Tandem gets)."""
    from ultralytics import YOLO

    res = YOLO(path).predict(
        images, imgsz=imgsz, device=0, conf=CONF, verbose=False, nms=False if end2end else None, **_precision(dtype)
    )
    out = []
    for r in res:
        b = r.boxes.cpu()
        out.append(
            (b.xyxy.numpy().astype(np.float32), b.conf.numpy().astype(np.float32), b.cls.numpy().astype(np.int64))
        )
    return out


# -- report --
def _table(report: dict) -> str:
    thr = report["throughput"]
    head = f"{'batch':>5} |" + "|".join(
        f" {dt:>7}: {'ultralytics':>11} {'runner':>8} {'engine':>8} {'eng/ul':>6} " for dt in DTYPES if dt in thr
    )
    lines = ["images/s (JPEG files in, detections out)", head, "-" * len(head)]
    for b in report["sizes"]:
        cells = []
        for dt in DTYPES:
            if dt not in thr:
                continue
            t = thr[dt]
            ul, ru, en = (t.get(k, {}).get(str(b)) for k in ("ultralytics", "runner", "engine"))
            f = lambda v: f"{v:8.1f}" if isinstance(v, float) else f"{'-':>8}"  # noqa: E731
            ratio = f"{en / ul:5.2f}x" if isinstance(en, float) and isinstance(ul, float) and ul else f"{'-':>6}"
            cells.append(f" {'':>7}  {f(ul):>11} {f(ru)} {f(en)} {ratio} ")
        lines.append(f"{b:>5} |" + "|".join(cells))
    for dt, p in report.get("profile", {}).items():
        if "error" in p:
            lines.append(f"start-up profile {dt}: FAILED ({p['error'][:200]})")
        else:
            lines.append(
                f"start-up profile {dt}: picks batch {p['chosen']} (engine fastest at {p.get('engine_best')}); "
                + ", ".join(f"b{k} {v:.0f}/s" for k, v in p["rates"].items())
            )
    return "\n".join(lines)


def _plot(report: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - the JSON and the table carry the same numbers
        return f"no plot: {type(e).__name__}: {e}"
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {"ultralytics": "tab:gray", "runner": "tab:blue", "engine": "tab:red"}
    for dt in DTYPES:
        for system, colour in colours.items():
            rates = report["throughput"].get(dt, {}).get(system)
            if isinstance(rates, dict) and rates and "error" not in rates:
                xs = sorted(int(k) for k in rates)
                name = "Ultralytics" if system == "ultralytics" else f"Tandem {system}"
                ax.plot(
                    xs,
                    [rates[str(x)] for x in xs],
                    color=colour,
                    linestyle="-" if dt == "float16" else "--",
                    marker="o",
                    label=f"{name}, {dt}",
                )
        chosen = report.get("profile", {}).get(dt, {}).get("chosen")
        engine = report["throughput"].get(dt, {}).get("engine", {})
        if chosen and str(chosen) in engine:
            ax.plot(
                [chosen],
                [engine[str(chosen)]],
                marker="*",
                markersize=16,
                color="gold",
                markeredgecolor="k",
                linestyle="none",
                label=f"start-up profile's pick, {dt}",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(report["sizes"], [str(s) for s in report["sizes"]])
    ax.set_xlabel("batch size")
    ax.set_ylabel("images / s")
    ax.set_title(f"{report['model']} @ {report['imgsz']} on {report['gpu']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _section(report: dict, key: str, title: str, fn) -> None:
    print(title, flush=True)
    t0 = time.perf_counter()
    try:
        report[key] = fn()
    except Exception as e:  # noqa: BLE001 - one failed section is reported; the others still run
        traceback.print_exc()
        report[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(f"  FAILED: {report[key]['error'][:300]}")
    print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_vision",
        description="Check the vision path on a CUDA GPU against Ultralytics (exits 2 without one).",
    )
    ap.add_argument("--out", default="bench_out", help="directory for vision_gpu_check.json/.png (default bench_out)")
    ap.add_argument(
        "--model", help="a .pt checkpoint or model .yaml (default: the trained detector if present, else yolo26n.yaml)"
    )
    ap.add_argument("--imgsz", type=int, help="input size (default 320 for the trained detector, else 640)")
    ap.add_argument("--images", type=int, default=128, help="JPEG files per pass (default 128)")
    ap.add_argument("--check-images", type=int, default=32, help="images for the detection checks (default 32)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="batch sizes (default 1,2,4,8,16,32)")
    ap.add_argument("--reps", type=int, default=2, help="timed passes per measurement, best kept (default 2)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks.gpu_vision: no CUDA device (torch.cuda.is_available() is False); nothing to check",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("YOLO_OFFLINE", "1")  # read at import: no online checks (the GPU machine has no network)
    try:
        from runtime.vision.ultralytics_import import import_ultralytics

        ultralytics = import_ultralytics()
    except ImportError as e:
        print(
            f"benchmarks.gpu_vision: Ultralytics is not importable ({e}); it loads the models and is the peer",
            file=sys.stderr,
        )
        return 2
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    from runtime.vision.batch import decode
    from runtime.vision.config import VisionConfig, vision_batching
    from runtime.vision.profiling import profiled_batching
    from runtime.vision.runner import YoloRunner

    tmp_dir = tempfile.TemporaryDirectory(prefix="tandem-vision-gpu-")
    tmp = Path(tmp_dir.name)
    try:
        model, imgsz, what = _resolve(args.model, args.imgsz)
        source_size = imgsz * 3 // 2  # larger than the input, so letterboxing resizes
        paths = _images(tmp / "images", args.images, source_size)
        check = [decode(p) for p in paths[: args.check_images]]
        path = _checkpoint(model, imgsz, tmp, check[:8])
        report: dict = dict(
            gpu=torch.cuda.get_device_name(),
            torch=torch.__version__,
            ultralytics=ultralytics.__version__,
            model=what,
            checkpoint=path,
            imgsz=imgsz,
            source_size=source_size,
            images=len(paths),
            check_images=len(check),
            sizes=sizes,
            conf=CONF,
            reps=args.reps,
        )
        print(f"GPU {report['gpu']}, torch {report['torch']}, ultralytics {report['ultralytics']}")
        print(f"model {what} ({path}), imgsz {imgsz}; {len(paths)} images of {source_size}x{source_size}")
        runners = {
            dt: YoloRunner(VisionConfig(model=path, imgsz=imgsz, device="cuda", dtype=dt, conf=CONF)) for dt in DTYPES
        }
        end2end = runners["float32"].model.end2end
        report["end2end"] = end2end

        def pipeline() -> dict:
            """What prepare hands the forward on this machine: the input's dtype and layout, the
            staging buffer page-locked, a copy event rather than a finished copy."""
            runner = runners["float16"]
            prepared = runner.prepare(check[:2])
            ((_, tensor, boxes),) = prepared.groups
            staging = runner._buffers.pinned(boxes[0].input_shape, 2)
            runner.infer(prepared)
            res = {
                "input_dtype": str(tensor.dtype),
                "channels_last": tensor.is_contiguous(memory_format=torch.channels_last),
                "staging_pinned": staging is not None and staging.is_pinned(),
                "copy_event": prepared.ready is not None,
            }
            print("  " + ", ".join(f"{k} {v}" for k, v in res.items()))
            return res

        _section(report, "pipeline", "0. the float16 input path:", pipeline)

        def chunked(runner, images, b=8) -> list:
            return [d for i in range(0, len(images), b) for d in runner.predict(images[i : i + b])]

        def fp16_vs_fp32() -> dict:
            res = agreement(chunked(runners["float32"], check), chunked(runners["float16"], check))
            if model.endswith((".yaml", ".yml")):  # random weights (see RANDOM_MEDIAN_IOU)
                res["criterion"] = (
                    f"random weights: matched boxes' median IoU >= {RANDOM_MEDIAN_IOU}, confidences within {RANDOM_MAX_CONF}"
                )
                res["ok"] = (res["median_iou"] or 0) >= RANDOM_MEDIAN_IOU and (
                    res["max_conf_diff"] or 0
                ) <= RANDOM_MAX_CONF
            else:
                res["criterion"] = f"share of boxes kept at IoU >= {KEEP_IOU} >= {MIN_KEPT}"
                res["ok"] = res["kept_share"] >= MIN_KEPT
            print(
                f"  float32 {res['ref_boxes']} boxes, float16 {res['boxes']}; matched {res['matched']}, "
                f"kept at IoU >= {KEEP_IOU}: {res['kept_share']:.1%}, median IoU {res['median_iou']}, "
                f"max conf diff {res['max_conf_diff']}  {'ok' if res['ok'] else 'FAIL'} ({res['criterion']})"
            )
            return res

        def parity() -> dict:
            out = {}
            for dt in DTYPES:
                res = box_errors(_ultralytics_dets(path, check, imgsz, dt, end2end), chunked(runners[dt], check))
                res["ok"] = res["median_px"] <= PARITY_MEDIAN_PX[dt] and res["missing_share"] <= PARITY_MAX_MISSING
                out[dt] = res
                print(
                    f"  {dt}: Ultralytics {res['ref_boxes']} boxes, Tandem {res['boxes']}; median {res['median_px']:.2e} px, "
                    f"max {res['max_px']:.2e} px, max conf diff {res['max_conf_diff']:.1e}, no match {res['missing']}  "
                    f"{'ok' if res['ok'] else 'FAIL'}"
                )
            return out

        _section(report, "fp16_vs_fp32", f"1. float16 against float32, {len(check)} images:", fp16_vs_fp32)
        _section(report, "parity", "2. Tandem against Ultralytics predict on this GPU:", parity)

        def throughput() -> dict:
            out: dict = {}
            engine_dets: dict = {}
            for dt in DTYPES:
                t: dict = out.setdefault(dt, {})
                print(f"  {dt}: runner", flush=True)
                rates, runner_dets = _runner_rates(runners[dt], paths, sizes, args.reps)
                t["runner"] = {str(b): r for b, r in rates.items()}
                print(f"  {dt}: engine", flush=True)
                rates, dets, counts = _engine_rates(path, imgsz, dt, paths, sizes, args.reps)
                t["engine"] = {str(b): r for b, r in rates.items()}
                t["engine_batch_size_counts"] = {str(b): c for b, c in counts.items()}
                engine_dets[dt] = max(
                    (box_errors(_as_ref(runner_dets[b]), dets[b]) | {"batch": b} for b in sizes),
                    key=lambda e: (e["missing"], e["max_px"]),
                )
                engine_dets[dt]["ok"] = (
                    engine_dets[dt]["missing"] == 0 and engine_dets[dt]["max_px"] <= ENGINE_MAX_PX[dt]
                )
                e = engine_dets[dt]
                print(
                    f"  {dt}: engine against runner, worst batch size {e['batch']}: max {e['max_px']:.2e} px, "
                    f"no match {e['missing']}  {'ok' if e['ok'] else 'FAIL'}"
                )
                print(f"  {dt}: ultralytics", flush=True)
                try:
                    t["ultralytics"] = {
                        str(b): r
                        for b, r in _ultralytics_rates(
                            path, str(tmp / "images"), imgsz, dt, end2end, sizes, args.reps
                        ).items()
                    }
                except Exception as e:  # noqa: BLE001 - Tandem's own numbers still count
                    traceback.print_exc()
                    t["ultralytics"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            report["engine_vs_runner"] = engine_dets
            return out

        _section(
            report,
            "throughput",
            f"3. images/s by batch size {sizes}, {len(paths)} JPEG files, best of {args.reps}:",
            throughput,
        )

        def profile() -> dict:
            out = {}
            for dt in DTYPES:
                config = VisionConfig(
                    model=path,
                    imgsz=imgsz,
                    device="cuda",
                    dtype=dt,
                    conf=CONF,
                    batching=vision_batching(max_batch_size=max(sizes)),
                )
                batching, rates = profiled_batching(runners[dt], config, None, cache=False)
                engine = report.get("throughput", {}).get(dt, {}).get("engine", {})
                best = max(engine, key=engine.get) if engine and "error" not in engine else None
                out[dt] = {
                    "rates": {str(k): v for k, v in rates.items()},
                    "chosen": batching.preferred_batch_sizes[0],
                    "engine_best": int(best) if best else None,
                    "profile_iters": config.profile_iters,
                }
            return out

        _section(report, "profile", "4. the start-up profile (forward only, square input):", profile)

        def accuracy() -> dict:
            """float16 is "auto"'s choice on CUDA only because it keeps mAP within MAX_MAP_DROP of
            float32 on the shipped detector's held-out test set: measured here."""
            from runtime.vision.evaluate import evaluate_engine
            from runtime.vision.synthetic import write_test_set

            write_test_set(tmp / "test", imgsz=imgsz)
            out = {
                dt: evaluate_engine(
                    VisionConfig(model=path, imgsz=imgsz, device="cuda", dtype=dt, conf=0.001), tmp / "test"
                )
                for dt in DTYPES
            }
            out = {dt: {k: out[dt][k] for k in ("map50_95", "map50", "images")} for dt in DTYPES}
            drop = out["float32"]["map50_95"] - out["float16"]["map50_95"]
            out["ok"] = drop <= MAX_MAP_DROP
            print(
                "  "
                + ", ".join(f"{dt} mAP50-95 {out[dt]['map50_95']:.4f} (mAP50 {out[dt]['map50']:.4f})" for dt in DTYPES)
                + f"; float16 loses {drop * 100:.2f} points  {'ok' if out['ok'] else 'FAIL'} (at most {MAX_MAP_DROP * 100:g})"
            )
            return out

        if what == TRAINED:
            _section(report, "accuracy", "5. mAP on the held-out generated test set (200 images):", accuracy)
    finally:
        tmp_dir.cleanup()

    checks = [
        report.get("accuracy", {"ok": what != TRAINED}),
        report.get("fp16_vs_fp32", {}),
        *report.get("parity", {}).values(),
        *report.get("engine_vs_runner", {}).values(),
    ]
    ok = (
        all(isinstance(c, dict) and c.get("ok") for c in checks) and "parity" in report and "engine_vs_runner" in report
    )
    report["ok"] = ok
    print()
    if isinstance(report.get("throughput"), dict) and "error" not in report["throughput"]:
        print(_table(report))
    print(f"detections agree (float16/float32, Tandem/Ultralytics, engine/runner): {'yes' if ok else 'NO'}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vision_gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out / 'vision_gpu_check.json'}")
    if isinstance(report.get("throughput"), dict) and "error" not in report["throughput"]:
        note = _plot(report, out / "vision_gpu_check.png")
        print(note or f"wrote {out / 'vision_gpu_check.png'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
