"""The peers of `tandem bench vision`, measured in a Python of their own: Ultralytics eager
(PyTorch), and Ultralytics' ONNX Runtime and OpenVINO exports of the same weights.

Run as a script by benchmarks/vision.py, one process per format, under the Python that has
the format's packages (Tandem's own for `torch`; a peer virtualenv such as ../peers/yolo for
`onnx` and `openvino`). It cannot import Tandem, so it is self-contained: it needs ultralytics
and torch, plus onnxruntime or openvino for those formats.

    python bench_peers.py --format onnx --model best.pt --imgsz 320 --images list.txt \
        --batches 1,8 --repeats 3 --workdir OUT/peers --result OUT/peers/onnx.json \
        --eval-dir TEST_SET --predictions OUT/peers/onnx_predictions.json

For each batch size: export (static shape, the end-to-end head, as Tandem runs YOLO26), a
warm-up pass, then `--repeats` timed passes of `predict` over the image list (read from disk,
conf 0.25, as Tandem's throughput row); images/s is the median pass. Threads: eager is timed
with Ultralytics' own setting (torch at cores - 1 threads on CPU) and with every core, as
`--threads` lists; ONNX Runtime gets one intra-op thread per core (its session is rebuilt so
the count does not depend on its physical-core guess); OpenVINO keeps the LATENCY hint that
Ultralytics compiles with, which already uses every core for one request.

With --eval-dir, predictions over images/<split> at conf 0.001 (batch 1) go to --predictions
in runtime/vision/evaluate.py's plain format ({"format": "tandem-predictions/1", "images":
{key: {"boxes", "conf", "cls"}}}), for Tandem to score with its own evaluator. With
--val-data (torch only), Ultralytics' own validator is run too, as a cross-check of that
evaluator. The result (rows, versions, notes) is written to --result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    # Run as a script, this file's folder leads sys.path, and Tandem's modules there (config,
    # model, engine, batch, ...) would shadow any top-level module of those names.
    HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

FORMAT = "tandem-predictions/1"
EVAL_CONF = 0.001
PREDICT_CONF = 0.25  # Ultralytics' predict default, and Tandem's serving default
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
NAMES = {"torch": "ultralytics torch", "onnx": "onnxruntime", "openvino": "openvino"}


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_model(path: str):
    import torch
    from ultralytics import YOLO

    if path.endswith((".yaml", ".yml")):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the seeded random weights Tandem builds from the same .yaml
            return YOLO(path, task="detect")
    return YOLO(path, task="detect")


def export(model_path: str, fmt: str, imgsz: int, batch: int, workdir: Path, device: str) -> tuple[str, float]:
    """Export into a folder of its own (Ultralytics writes beside the .pt, or into the working
    directory for a .yaml), never beside the weights; the exported model's path and seconds."""
    out = workdir / f"{fmt}_b{batch}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    src = model_path
    if not model_path.endswith((".yaml", ".yml")):
        src = str(out / Path(model_path).name)
        shutil.copy(model_path, src)
    t0 = time.perf_counter()
    cwd = os.getcwd()
    os.chdir(out)
    try:
        path = load_model(src).export(format=fmt, imgsz=imgsz, batch=batch, nms=False, device=device, verbose=False)
    finally:
        os.chdir(cwd)
    if src != model_path:
        os.remove(src)  # the export is all that is needed of the copy
    return str(out / path), time.perf_counter() - t0  # an absolute `path` stays as it is


def tune_onnxruntime(model, onnx_path: str) -> dict:
    """Rebuild the predictor's ONNX Runtime session with intra-op threads = cores; what it runs on."""
    import onnxruntime as ort

    backend = model.predictor.model.backend
    options = ort.SessionOptions()
    options.intra_op_num_threads = cores()
    providers = backend.session.get_providers()
    backend.session = ort.InferenceSession(onnx_path, options, providers=providers)
    return {"providers": providers, "intra_op_threads": cores()}


def timed_passes(model, paths: list[str], repeats: int, **kw) -> list[float]:
    """images/s of each of `repeats` passes over `paths`, after a warm-up pass."""
    warm = paths[: max(4, 2 * kw.get("batch", 1))]
    for _ in model.predict(warm, **kw):
        pass
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        count = sum(1 for _ in model.predict(paths, **kw))
        rates.append(count / (time.perf_counter() - t0))
        assert count == len(paths), f"{count} results for {len(paths)} images"
    return rates


def measure(args, paths: list[str], workdir: Path) -> tuple[list[dict], dict[int, str], list[str]]:
    """Throughput rows, the model path per batch size, and notes."""
    import torch
    import ultralytics.utils.torch_utils as ul_torch

    rows, models, notes = [], {}, []
    shipped = ul_torch.NUM_THREADS
    for batch in args.batches:
        export_s = None
        if args.format == "torch":
            models[batch] = args.model
        else:
            models[batch], export_s = export(args.model, args.format, args.imgsz, batch, workdir, args.device)
        threads = [shipped]
        if args.format == "torch" and args.device == "cpu":  # as shipped, and on every core
            threads = args.threads or sorted({shipped, cores()})
        for t in threads:
            model = load_model(models[batch])
            ul_torch.NUM_THREADS = t  # what select_device() sets torch to on CPU, as the predictor starts
            kw = dict(
                imgsz=args.imgsz,
                device=args.device,
                batch=batch,
                conf=PREDICT_CONF,
                nms=False,
                verbose=False,
                stream=True,
            )
            info = {}
            if args.format == "onnx":
                for _ in model.predict(paths[:1], **kw):  # builds the predictor and its session
                    pass
                info = tune_onnxruntime(model, models[batch])
                note = f"onnxruntime has no CUDA provider here: ran on {info.get('providers')}"
                if args.device != "cpu" and "CUDAExecutionProvider" not in info["providers"] and note not in notes:
                    notes.append(note)
            runs = timed_passes(model, paths, args.repeats, **kw)
            rows.append(
                {
                    "name": f"{NAMES[args.format]} b{batch}" + (f" t{t}" if args.format == "torch" else ""),
                    "format": args.format,
                    "batch": batch,
                    "threads": t if args.format == "torch" else None,
                    "images_per_s": statistics.median(runs),
                    "runs": runs,
                    "export_s": export_s,
                    "torch_threads": torch.get_num_threads(),
                    **info,
                }
            )
            print(f"{rows[-1]['name']}: {rows[-1]['images_per_s']:.2f} images/s", file=sys.stderr, flush=True)
    ul_torch.NUM_THREADS = shipped
    return rows, models, notes


def predictions(model_path: str, args) -> dict:
    """Detections over the eval split at conf 0.001, in evaluate.py's plain format."""
    root = Path(args.eval_dir) / "images" / args.eval_split
    paths = sorted(str(p) for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    model = load_model(model_path)
    kw = dict(imgsz=args.imgsz, device=args.device, batch=1, conf=EVAL_CONF, nms=False, verbose=False, stream=True)
    images = {}
    for path, r in zip(paths, model.predict(paths, **kw), strict=True):
        b = r.boxes.cpu()
        images[Path(path).relative_to(root).as_posix()] = {
            "boxes": b.xyxy.tolist(),  # unrounded: rounding moves borderline IoUs and ties confidences
            "conf": b.conf.tolist(),
            "cls": [int(c) for c in b.cls.tolist()],
        }
    return {"format": FORMAT, "images": images}


def ultralytics_val(args, workdir: Path) -> dict:
    """Ultralytics' own validator on the eval split (batch 1, conf 0.001): with the end-to-end
    head on square inputs, the same network inputs predict() gives the other rows (its rect
    batches would pad a 320 image to 352), which cross-checks Tandem's evaluator; and as `yolo
    val` runs by default (one-to-many head + multi-label NMS, rect batches)."""
    out = {}
    for head, kw in (("end2end, square", {"nms": False, "rect": False}), ("yolo val default", {})):
        m = load_model(args.model).val(
            data=args.val_data,
            imgsz=args.imgsz,
            batch=1,
            conf=EVAL_CONF,
            device=args.device,
            plots=False,
            verbose=False,
            project=str(workdir),
            name="val",
            exist_ok=True,
            **kw,
        )
        out[head] = {"map50_95": float(m.box.map), "map50": float(m.box.map50)}
    return out


def versions(fmt: str) -> dict:
    import torch
    import ultralytics

    v = {"python": sys.version.split()[0], "torch": torch.__version__, "ultralytics": ultralytics.__version__}
    if fmt == "onnx":
        import onnxruntime

        v["onnxruntime"] = onnxruntime.__version__
    if fmt == "openvino":
        import openvino

        v["openvino"] = openvino.__version__
    return v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="One peer format of `tandem bench vision`: export, time, predict.")
    p.add_argument("--format", required=True, choices=sorted(NAMES))
    p.add_argument("--model", required=True, help="a .pt (or a model .yaml: seeded random weights)")
    p.add_argument("--imgsz", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--images", required=True, help="a text file with the throughput images, one path a line")
    p.add_argument("--batches", default="1", help="comma-separated batch sizes (one static export each)")
    p.add_argument(
        "--threads",
        default="",
        help="torch on CPU: comma-separated thread counts (default: Ultralytics' own, and every core)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--eval-dir")
    p.add_argument("--eval-split", default="test")
    p.add_argument("--predictions", help="where the eval split's predictions go (with --eval-dir)")
    p.add_argument("--val-data", help="torch only: a data YAML to run Ultralytics' validator on")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.threads = [int(t) for t in args.threads.split(",") if t]
    os.environ.setdefault("YOLO_OFFLINE", "1")
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict = {"format": args.format, "name": NAMES[args.format], "cores": cores(), "rows": [], "notes": []}
    try:
        result["versions"] = versions(args.format)
        if args.format == "openvino" and args.device != "cpu":
            raise RuntimeError(f"the OpenVINO peer runs on CPU only, not on {args.device}")
        paths = [line.strip() for line in Path(args.images).read_text().splitlines() if line.strip()]
        rows, models, notes = measure(args, paths, workdir)
        result["rows"], result["notes"] = rows, notes
        if args.eval_dir and args.predictions:
            first = models[min(models)]  # batch 1 where it was measured: no padding of short batches
            record = predictions(first, args)
            Path(args.predictions).write_text(json.dumps(record))
            result["predictions"] = args.predictions
            result["predictions_batch"] = min(models)
        if args.val_data and args.format == "torch":
            result["ultralytics_val"] = ultralytics_val(args, workdir)
    except Exception as exc:  # noqa: BLE001 - reported in the result: the bench prints it and goes on
        result["error"] = f"{type(exc).__name__}: {exc}"
    Path(args.result).write_text(json.dumps(result, indent=2))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
