"""Forward backends of the YOLO runner: the same letterboxed batch in, the same raw head out.

The runner letterboxes (runtime/vision/preprocess.py) and postprocesses (postprocess.py) the
same way whichever backend runs the forward, so a backend only has to turn a (B, 3, H, W)
float32 batch in [0, 1] into the tensor `LoadedModel.forward` gives: (B, k, 6) for an
end-to-end head, (B, 4 + nc, anchors) for the NMS head. That is what Triton does with its
backends: one scheduler, several engines behind it.

- "torch": the loaded module (traced on CPU); the exact Ultralytics parity path, VisionConfig's
  default (the CLI's is "auto", see profiling.py).
- "onnxruntime", "openvino": Ultralytics' own exporter (`YOLO(pt).export`) writes the model
  from the same weights, with dynamic batch, height and width (the runner's rect letterbox
  gives non-square inputs), and the head it is asked for (nms=False keeps the end-to-end head).
- "onnxruntime-int8": that ONNX file through ONNX Runtime's static quantization (QDQ, per
  channel), calibrated on generated training images (runtime/vision/synthetic.py, the
  training seed, never the held-out test seed), convolutions only. Measured on the shipped
  detector at 320, 200 held-out images, 2-core AMD EPYC (AVX512-VNNI/BF16), one thread: mAP50-95
  0.7794 vs 0.7830 float32 (quantizing every op: 0.2225), forward 117 to 138 images/s against
  ONNX Runtime float32's 112 to 120 on a loaded machine: within the mAP rule, no clear speed-up,
  so "auto" does not choose it.

Exports are cached under TANDEM_CACHE_DIR (or ~/.cache/tandem)/vision_exports/<key>, where the
key is what the file depends on: the weights' content hash (a .yaml: its path and seed), the
input size, the head, the format, and the exporter's and runtime's versions and the machine
(CPU model and flags). An export takes 2 to 20 s here; a second load reads the file. The
exporter's own report (a dozen lines on stdout) is kept quiet: `tandem detect` prints JSON lines
on stdout, and the start-up line says what the export cost instead.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from runtime.vision.config import VisionConfig

BACKENDS = ("torch", "onnxruntime", "openvino", "onnxruntime-int8")  # what a runner can run
EXPORTED = BACKENDS[1:]
CALIBRATION_IMAGES = 64  # generated training images for int8 calibration
CALIBRATION_SEED = 0  # the training set's seed (runtime/vision/synthetic.write_dataset)


def unavailable(backend: str, device: str) -> str | None:
    """Why `backend` cannot run here (None: it can): the exports run on the CPU, through their
    runtime's Python package."""
    if backend == "torch":
        return None
    if device != "cpu":
        return f"runs on the CPU only, the device is {device}"
    package = backend.removesuffix("-int8")
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed (pip install {package})"
    return None


def cache_root() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    return Path(root) / "vision_exports"


def _cpu() -> dict[str, str]:
    """CPU model and flags: an export's graph optimisations (and int8 kernels) are chosen for them."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
    except OSError:
        model = platform.processor()
    return {"cpu": model, "flags": hashlib.sha256(flags.encode()).hexdigest()[:12]}


def _weights_id(config: VisionConfig) -> dict:
    path = config.model
    if path.endswith((".yaml", ".yml")):
        return {"yaml": path, "seed": config.seed}
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"sha256": h.hexdigest()}


def _versions(backend: str) -> dict:
    import ultralytics

    v = {"ultralytics": ultralytics.__version__, "torch": torch.__version__}
    if backend.startswith("onnxruntime"):
        import onnxruntime

        v["onnxruntime"] = onnxruntime.__version__
    else:
        import openvino

        v["openvino"] = openvino.__version__
    return v


def export_key(config: VisionConfig, backend: str, end2end: bool, max_det: int) -> str:
    key = {
        "weights": _weights_id(config),
        "imgsz": config.imgsz,
        "end2end": end2end,
        "max_det": max_det,
        "backend": backend,
        "batch": "dynamic",
        "calibration": [CALIBRATION_SEED, CALIBRATION_IMAGES, "conv-only"] if backend.endswith("int8") else None,
        **_versions(backend),
        **_cpu(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


_EXPORT_LOCK = threading.Lock()  # one export at a time in a process: two would race on the same folder
EXPORT_COUNT = 0  # exports this process ran (tests check that a second load reuses the cache)


def _ultralytics_export(config: VisionConfig, fmt: str, end2end: bool, max_det: int, out: Path) -> Path:
    """Ultralytics' exporter on the config's weights, writing under `out`; the file it made."""
    from runtime.vision.ultralytics_import import import_ultralytics

    import_ultralytics()
    from ultralytics import YOLO

    if config.model.endswith((".yaml", ".yml")):
        with torch.random.fork_rng(devices=[]):  # the same seeded weights runtime/vision/model.py builds
            torch.manual_seed(config.seed)
            yolo = YOLO(config.model, task="detect")
    else:
        yolo = YOLO(config.model, task="detect")
    # Where the exporter writes: beside this name (never beside the shipped weights).
    yolo.model.pt_path = str(out / "model.pt")
    extra = {}
    if fmt == "onnx":  # onnxslim where installed; without it the exporter would pip-install it at run time
        extra["simplify"] = importlib.util.find_spec("onnxslim") is not None
    # verbose=False does not quiet the exporter: it logs a dozen lines to stdout through
    # Ultralytics' logger, which would land among `tandem detect`'s JSON lines.
    logger = logging.getLogger("ultralytics")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        made = yolo.export(
            **extra,
            format=fmt,
            imgsz=config.imgsz,
            dynamic=True,
            batch=1,
            nms=False if end2end else None,  # False: keep the NMS-free head; None: raw one-to-many output
            max_det=max_det,
            device="cpu",
            verbose=False,
        )
    finally:
        logger.setLevel(level)
    made = Path(made)
    return made / "model.xml" if fmt == "openvino" else made


def _calibration_batches(imgsz: int):
    """Letterboxed generated training images, one per calibration step, as the runner feeds them."""
    from runtime.vision.preprocess import letterbox_into, plan_letterbox, to_tensor
    from runtime.vision.synthetic import draw_image

    rng = np.random.default_rng(CALIBRATION_SEED)
    for _ in range(CALIBRATION_IMAGES):
        img, _ = draw_image(rng, imgsz)
        box = plan_letterbox(img.shape[:2], imgsz, 32, False)
        staging = np.empty((1, *box.input_shape, 3), np.uint8)
        letterbox_into(img, box, staging[0])
        yield to_tensor(staging, torch.device("cpu")).contiguous().numpy()


def _quantize_int8(src: Path, dst: Path, imgsz: int) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = _calibration_batches(imgsz)

        def get_next(self):
            x = next(self.batches, None)
            return None if x is None else {"images": x}

    pre = dst.with_name("pre.onnx")
    try:
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
    except Exception:  # noqa: BLE001 - pre-processing is an optimisation; quantize the export as it is
        shutil.copy(src, pre)
    quantize_static(
        str(pre),
        str(dst),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        # Convolutions only: quantized, the head's top-k, gather and concat collapse the
        # end-to-end head's class and score outputs (measured: mAP50-95 0.22 vs 0.78).
        op_types_to_quantize=["Conv"],
    )
    pre.unlink(missing_ok=True)
    return dst


_FILE_NAMES = {"onnxruntime": "model.onnx", "onnxruntime-int8": "model.int8.onnx", "openvino": "model.xml"}


def cached_export(config: VisionConfig, backend: str, end2end: bool, max_det: int) -> Path | None:
    """The backend's model file for the config where the cache holds it, else None."""
    if backend not in EXPORTED:
        raise ValueError(f"backend must be one of {EXPORTED} to be exported, got {backend!r}")
    final = cache_root() / export_key(config, backend, end2end, max_det)
    return next(final.rglob(_FILE_NAMES[backend]), None) if final.is_dir() else None


def exported_model(config: VisionConfig, backend: str, end2end: bool, max_det: int) -> Path:
    """The backend's model file for the config, from the cache or exported (then cached)."""
    global EXPORT_COUNT
    found = cached_export(config, backend, end2end, max_det)
    if found is not None:
        return found
    final = cache_root() / export_key(config, backend, end2end, max_det)
    name = _FILE_NAMES[backend]
    with _EXPORT_LOCK:
        found = next(final.rglob(name), None) if final.is_dir() else None
        if found is not None:
            return found
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=final.parent))
        try:
            if backend == "onnxruntime-int8":
                fp32 = exported_model(config, "onnxruntime", end2end, max_det)
                _quantize_int8(fp32, tmp / name, config.imgsz)
            else:
                _ultralytics_export(config, "onnx" if backend == "onnxruntime" else "openvino", end2end, max_det, tmp)
            EXPORT_COUNT += 1
            try:
                os.replace(tmp, final)  # whole folder at once: a reader never sees half an export
            except OSError:  # another process won the race: use its folder
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return next(final.rglob(name))


class OrtForward:
    """An ONNX Runtime session; safe to call from several engine workers at once (run() is
    thread-safe, and with one intra-op thread each call runs on its caller's thread, which is
    how the engine's single-threaded CPU workers run side by side)."""

    def __init__(self, path: Path, threads: int) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = np.ascontiguousarray(images.float().numpy())
        return torch.from_numpy(self.session.run(None, {self.input: x})[0])


class OpenVinoForward:
    """An OpenVINO compiled model with one stream per engine worker and one infer request per
    calling thread (a request is not safe to share). Precision: f32, or bf16 where the config's
    dtype resolves to bfloat16 (OpenVINO's own default on AMX machines)."""

    def __init__(self, path: Path, threads: int, workers: int, bf16: bool) -> None:
        import openvino as ov

        core = ov.Core()
        self.compiled = core.compile_model(
            core.read_model(str(path)),
            "CPU",
            {
                "INFERENCE_NUM_THREADS": threads * workers,
                "NUM_STREAMS": workers,
                "INFERENCE_PRECISION_HINT": "bf16" if bf16 else "f32",
            },
        )
        self._local = threading.local()

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        x = np.ascontiguousarray(images.float().numpy())
        out = request.infer({0: x})
        return torch.from_numpy(np.array(next(iter(out.values()))))


def load_forward(config: VisionConfig, backend: str, end2end: bool, max_det: int, workers: int, threads: int):
    """(a callable (B, 3, H, W) float32 -> raw head output for an exported backend, the seconds
    this call spent exporting: 0.0 where the cache had the export)."""
    if config.device != "cpu":
        raise ValueError(f"backend {backend!r} runs on the CPU only; device is {config.device!r} (use backend 'torch')")
    t0 = time.perf_counter()
    cached = cached_export(config, backend, end2end, max_det) is not None
    path = exported_model(config, backend, end2end, max_det)
    export_s = 0.0 if cached else time.perf_counter() - t0
    if backend == "openvino":
        return OpenVinoForward(path, threads, workers, bf16=config.resolved_dtype() == "bfloat16"), export_s
    return OrtForward(path, threads), export_s
