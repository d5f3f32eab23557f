"""The runner's exported backends (runtime/vision/backends.py): ONNX Runtime and OpenVINO run
Ultralytics' own export of the shipped detector's weights behind the same letterbox and
postprocess as torch, so they must give torch float32's boxes to float rounding, hold mAP on
the held-out set within 0.5 points (the rule for every fast path, tests/test_vision_accuracy.py),
and be exported once per cache key. The held-out set and torch float32's mAP on it are the
session's (tests/conftest.py), shared with tests/test_vision_accuracy.py.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")

from runtime.vision import backends, detector
from runtime.vision import evaluate as ev
from runtime.vision.config import VisionConfig
from runtime.vision.runner import YoloRunner

MAX_DROP = 0.005  # 0.5 mAP points
EXPORTED = ("onnxruntime", "openvino")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Exports of this module go to a folder of its own (and the user's cache stays untouched)."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("tandem-cache")
    mp.setenv("TANDEM_CACHE_DIR", str(path))
    yield path
    mp.undo()


def _config(backend: str) -> VisionConfig:
    return VisionConfig(model=str(detector.WEIGHTS), imgsz=detector.IMGSZ, dtype="float32", backend=backend)


@pytest.fixture(scope="module")
def runners(cache_dir) -> dict[str, YoloRunner]:
    return {b: YoloRunner(_config(b)) for b in ("torch", *EXPORTED)}


def _predict_map(runner: YoloRunner, test_set: str) -> float:
    preds = ev.predict_split(lambda ims: runner.predict(ims, conf=ev.EVAL_CONF), test_set, batch_size=8)
    return ev.evaluate(preds, test_set)["map50_95"]


@pytest.mark.parametrize("backend", EXPORTED)
def test_exported_backend_gives_torch_float32_boxes(runners, shapes_test_set, backend):
    import cv2

    images = [cv2.imread(str(p)) for p in ev.image_files(shapes_test_set)[:16]]
    # Rect letterboxing: a cropped image gives a non-square input, which the dynamic export must take.
    images.append(np.ascontiguousarray(images[0][:200]))
    ref = runners["torch"].predict(images)
    got = runners[backend].predict(images)
    assert runners[backend].backend == backend
    assert sum(len(d.boxes) for d in ref) > 16  # the shipped detector finds the shapes
    for r, g in zip(ref, got, strict=True):
        assert len(r.boxes) == len(g.boxes)
        np.testing.assert_array_equal(np.asarray(r.cls), np.asarray(g.cls))
        np.testing.assert_allclose(np.asarray(g.boxes), np.asarray(r.boxes), atol=0.05)  # pixels
        np.testing.assert_allclose(np.asarray(g.conf), np.asarray(r.conf), atol=1e-3)


@pytest.mark.parametrize("backend", EXPORTED)
def test_exported_backend_keeps_map_within_half_a_point(runners, shapes_test_set, float32_reference, backend):
    float32 = float32_reference.map()["map50_95"]  # torch float32, the same head (end-to-end)
    assert float32 > 0.6  # a trained detector, not noise
    got = _predict_map(runners[backend], shapes_test_set)
    assert float32 - got <= MAX_DROP, f"{backend}: mAP50-95 {got:.4f} vs torch float32 {float32:.4f}"


def test_second_load_reuses_the_cached_export(cache_dir):
    config = VisionConfig(model=str(detector.WEIGHTS), imgsz=detector.IMGSZ + 32, dtype="float32")
    before = backends.EXPORT_COUNT
    first = backends.exported_model(config, "onnxruntime", True, 300)
    assert backends.EXPORT_COUNT == before + 1
    assert cache_dir in first.parents
    stamp = first.stat().st_mtime_ns
    runner = YoloRunner(VisionConfig(model=str(detector.WEIGHTS), imgsz=detector.IMGSZ + 32, backend="onnxruntime"))
    assert runner.backend == "onnxruntime"
    assert backends.EXPORT_COUNT == before + 1, "the second load exported again"
    assert first.stat().st_mtime_ns == stamp
    # Another input size is another key: exported anew.
    other = backends.exported_model(_config("onnxruntime"), "onnxruntime", True, 300)
    assert other.parent != first.parent


@pytest.mark.parametrize("bad", ["tensorrt", "ORT", "", None])
def test_bad_backend_name_is_a_value_error_naming_backend(bad):
    with pytest.raises(ValueError, match="backend"):
        VisionConfig(backend=bad)
    with pytest.raises(ValueError, match="backend"):
        VisionConfig.from_dict({"backend": bad})


@pytest.mark.parametrize(("ort_rate", "chosen"), [(200.0, "onnxruntime"), (102.0, "torch")])
def test_auto_picks_the_fastest_backend_by_measured_rate(cache_dir, monkeypatch, ort_rate, chosen):
    """Backend "auto": the profile's rates decide (faked here, so the choice is what is tested);
    another backend must beat torch by 5%."""
    from runtime.vision.profiling import profiled_batching

    config = VisionConfig(model=str(detector.WEIGHTS), imgsz=detector.IMGSZ, dtype="float32", backend="auto")
    runner = YoloRunner(config)
    assert runner.backend == "torch"  # until the profile picks
    fake = {"torch": 100.0, "onnxruntime": ort_rate, "openvino": 90.0}
    monkeypatch.setattr(runner, "profile", lambda sizes, iters=None: {b: fake[runner.backend] * b / 8 for b in sizes})
    batching, rates = profiled_batching(runner, config, 1, cache=False)
    assert runner.backend == chosen
    assert set(runner.backend_rates) == {"torch", "onnxruntime", "openvino"}
    assert batching.preferred_batch_sizes == (max(rates),)
