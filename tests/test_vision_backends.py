"""The runner's exported backends (runtime/vision/backends.py): ONNX Runtime and OpenVINO run
Ultralytics' own export of the shipped detector's weights behind the same letterbox and
postprocess as torch, so they must give torch float32's boxes to float rounding, hold mAP on
the held-out set within 0.5 points (the rule for every fast path, tests/test_vision_accuracy.py),
in float32 and as backend "auto" runs them (the default dtype, either head), and be exported
once per cache key. Backend "auto" (the CLI's default) picks among exactly these by the
start-up profile's rates, says why, and a second start reuses exports and rates. The held-out
set and torch float32's mAP on it are the session's (tests/conftest.py), shared with
tests/test_vision_accuracy.py.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")

from runtime.vision import backends, detector
from runtime.vision import evaluate as ev
from runtime.vision.config import VisionConfig, vision_batching
from runtime.vision.profiling import AUTO_CANDIDATES, profiled_batching
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


@pytest.fixture(scope="module")
def runner_for(cache_dir):
    """runner_for(backend, dtype, end2end): a runner of the shipped detector, made once a module."""
    made: dict[tuple, YoloRunner] = {}

    def get(backend: str, dtype: str, end2end: bool) -> YoloRunner:
        if (backend, dtype, end2end) not in made:
            config = VisionConfig(
                model=str(detector.WEIGHTS), imgsz=detector.IMGSZ, dtype=dtype, backend=backend, end2end=end2end
            )
            made[backend, dtype, end2end] = YoloRunner(config)
        return made[backend, dtype, end2end]

    return get


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


# Each export as it can run: ONNX Runtime computes float32 whatever the dtype; OpenVINO runs
# bfloat16 where the default dtype resolves to it (backends.OpenVinoForward), as "auto" runs it,
# and float32 when asked. Both heads: `--nms` with "auto" chooses among them too.
MAP_CASES = [
    ("onnxruntime", "float32", True),
    ("openvino", "float32", True),
    ("openvino", "auto", True),
    ("onnxruntime", "float32", False),
    ("openvino", "auto", False),
]


@pytest.mark.parametrize(("backend", "dtype", "end2end"), MAP_CASES)
def test_exported_backend_keeps_map_within_half_a_point(
    runners, runner_for, shapes_test_set, float32_reference, backend, dtype, end2end
):
    float32 = float32_reference.map(end2end)["map50_95"]  # torch float32, the same head
    assert float32 > 0.6  # a trained detector, not noise
    runner = runners[backend] if (dtype, end2end) == ("float32", True) else runner_for(backend, dtype, end2end)
    got = _predict_map(runner, shapes_test_set)
    assert float32 - got <= MAX_DROP, f"{backend} {dtype} end2end={end2end}: mAP50-95 {got:.4f} vs {float32:.4f}"


def test_auto_chooses_only_among_backends_whose_map_is_held_here():
    """AUTO_CANDIDATES is the rule's list: the exports are held above, torch in every dtype
    "auto" resolves to by tests/test_vision_accuracy.py. int8 is not on it."""
    assert set(AUTO_CANDIDATES) == {"torch", *EXPORTED}
    assert {b for b, _, _ in MAP_CASES} == set(EXPORTED)


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
    assert runner.export_s == {"onnxruntime": 0.0}  # reported: nothing exported at this load
    assert first.stat().st_mtime_ns == stamp
    # Another input size is another key: exported anew.
    other = backends.exported_model(_config("onnxruntime"), "onnxruntime", True, 300)
    assert other.parent != first.parent


def test_a_second_auto_start_reuses_exports_and_rates_and_reports_the_first_starts_cost(cache_dir):
    """The first start of backend "auto" exports each candidate and times it, and says what that
    cost (stats()["startup"]); the second reads both caches: no export, no timing, the same
    choice, and only the chosen backend is loaded."""
    from runtime.vision.engine import VisionEngine

    imgsz = detector.IMGSZ + 64  # a key no other test of the module exports
    config = VisionConfig(
        model=str(detector.WEIGHTS),
        imgsz=imgsz,
        backend="auto",
        profile_iters=1,
        batching=vision_batching(max_batch_size=2),
    )
    before = backends.EXPORT_COUNT
    with VisionEngine(config) as engine:
        first = engine.stats()
    assert backends.EXPORT_COUNT == before + len(EXPORTED)
    cost = first["startup"]
    assert cost["requested"] == "auto" and cost["backend"] == first["backend"] in AUTO_CANDIDATES
    assert set(cost["images_per_s"]) == set(AUTO_CANDIDATES) and cost["skipped"] == {}
    assert cost["export_s"] > 0 and cost["profile_s"] > 0 and cost["startup_s"] >= cost["export_s"] + cost["profile_s"]
    assert cost["why"].startswith(f"auto: {cost['backend']} ")
    with VisionEngine(config) as engine:
        second = engine.stats()
        loaded = dict(engine.runner.export_s)
        line = engine.startup_line()
    assert backends.EXPORT_COUNT == before + len(EXPORTED), "the second start exported again"
    again = second["startup"]
    assert again["export_s"] == 0.0 and again["profile_s"] == 0.0
    assert (again["backend"], again["images_per_s"]) == (cost["backend"], cost["images_per_s"])
    assert second["preferred_batch_sizes"] == first["preferred_batch_sizes"]
    assert loaded == ({} if cost["backend"] == "torch" else {cost["backend"]: 0.0})
    assert line.startswith(f"vision backend {cost['backend']} (auto: ") and "exports 0.0 s, profile 0.0 s" in line


@pytest.mark.parametrize("bad", ["tensorrt", "ORT", "", None])
def test_bad_backend_name_is_a_value_error_naming_backend(bad):
    with pytest.raises(ValueError, match="backend"):
        VisionConfig(backend=bad)
    with pytest.raises(ValueError, match="backend"):
        VisionConfig.from_dict({"backend": bad})


def _stub_measure(fake: dict[str, float]):
    """A measure function for profiled_batching: the rate `fake` gives the runner's current
    backend, at every batch size (per image, so the largest batch wins by a clear margin)."""
    return lambda runner, sizes: {b: fake[runner.backend] * b / 8 for b in sizes}


@pytest.mark.parametrize(("ort_rate", "chosen"), [(200.0, "onnxruntime"), (102.0, "torch")])
def test_auto_picks_the_fastest_backend_by_measured_rate(cache_dir, ort_rate, chosen):
    """Backend "auto": the profile's rates decide (a stub measure here, so the choice is what is
    tested); another backend must beat torch by 5%."""
    config = VisionConfig(model=str(detector.WEIGHTS), imgsz=detector.IMGSZ, dtype="float32", backend="auto")
    runner = YoloRunner(config)
    assert runner.backend == "torch"  # until the profile picks
    fake = {"torch": 100.0, "onnxruntime": ort_rate, "openvino": 90.0}
    batching, rates = profiled_batching(runner, config, 1, cache=False, measure=_stub_measure(fake))
    assert runner.backend == runner.choice.backend == chosen
    assert set(runner.choice.rates) == {"torch", "onnxruntime", "openvino"}
    assert batching.preferred_batch_sizes == (max(rates),)


def _cli_default_config(*flags: str) -> VisionConfig:
    """What `tandem detect SOURCE [flags]` runs (the backend flag left out)."""
    import argparse

    from runtime.vision.cli import add_detect_arguments, detect_config

    parser = argparse.ArgumentParser()
    add_detect_arguments(parser)
    return detect_config(parser.parse_args(["bus.jpg", "--device", "cpu", *flags]))


@pytest.mark.parametrize(
    ("hidden", "chosen"),
    [((), "openvino"), (("openvino",), "onnxruntime"), (("openvino", "onnxruntime"), "torch")],
    ids=["all-installed", "no-openvino", "neither"],
)
def test_default_flags_run_the_profiles_choice_and_say_why(cache_dir, monkeypatch, hidden, chosen):
    """No --backend: "auto", and the backend the profile measured fastest runs; a candidate
    that cannot be imported is left out and named in the reason, down to torch."""
    config = _cli_default_config("--imgsz", str(detector.IMGSZ))
    assert config.backend == "auto" and config.dtype == "auto" and config.profile
    for name in hidden:  # as if not installed: find_spec and import both see None
        monkeypatch.setitem(sys.modules, name, None)
    runner = YoloRunner(config)
    fake = {"torch": 100.0, "onnxruntime": 150.0, "openvino": 200.0}
    profiled_batching(runner, config, 1, cache=False, measure=_stub_measure(fake))
    choice = runner.choice
    assert runner.backend == choice.backend == chosen
    assert set(choice.rates) == set(AUTO_CANDIDATES) - set(hidden)
    assert choice.why.startswith(f"auto: {chosen} {fake[chosen]:.0f} images/s at batch 8")
    for name in hidden:
        assert choice.skipped[name] == f"{name} is not installed (pip install {name})"
        assert f"{name} not tried: {name} is not installed" in choice.why


def test_a_candidate_that_fails_to_export_is_skipped_not_fatal(cache_dir, monkeypatch):
    config = VisionConfig(model=str(detector.WEIGHTS), imgsz=detector.IMGSZ, dtype="float32", backend="auto")
    runner = YoloRunner(config)
    real = backends.load_forward

    def broken(config, backend, *args):
        if backend == "openvino":
            raise RuntimeError("the exporter cannot take this model")
        return real(config, backend, *args)

    monkeypatch.setattr(backends, "load_forward", broken)
    fake = {"torch": 100.0, "onnxruntime": 150.0, "openvino": 200.0}
    profiled_batching(runner, config, 1, cache=False, measure=_stub_measure(fake))
    assert runner.backend == "onnxruntime"
    assert runner.choice.skipped == {"openvino": "failed: RuntimeError: the exporter cannot take this model"}


def test_auto_off_the_cpu_or_without_the_profile_runs_torch_and_says_so(cache_dir):
    assert backends.unavailable("openvino", "cuda") == "runs on the CPU only, the device is cuda"
    config = VisionConfig(model=str(detector.WEIGHTS), imgsz=detector.IMGSZ, backend="auto", profile=False)
    runner = YoloRunner(config)
    profiled_batching(runner, config, 1, cache=False, measure=_stub_measure({}))
    assert runner.backend == "torch" and "without the start-up profile" in runner.choice.why
