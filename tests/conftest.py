"""Shared fixtures: the real SmolLM2 (converted once from its GGUF, then cached) and a tiny
random Llama that uses SmolLM2's tokenizer, for fast tests; for vision, the held-out shapes test
set and the shipped detector's float32 predictions on it, made once a session."""

from __future__ import annotations

import copy
import os

import pytest

# Under pytest-xdist (`make test` runs two processes: alone, one left a core idle 40% of the
# time, a test mostly waiting on one Python thread or on a process it started) each process and
# every worker or server it starts gets one OpenMP thread: two processes of two threads each on
# two cores would make OpenMP's barriers wait on descheduled threads. Set before torch loads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines the tests start stay eager unless a test asks for the captured step (EngineConfig
# enforce_eager): a compile per engine would cost minutes of the suite. Worker and server
# processes the tests start inherit it.
os.environ.setdefault("TANDEM_ENFORCE_EAGER", "1")

# The Triton kernels' tests run on CPU in Triton's interpreter. The flag must be set before
# anything imports triton: triton.language's own helpers (tl.zeros, tl.sum, ...) are decorated
# once, at import, for the mode the flag names then.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test modules import Ultralytics at collection; without this, its OMP_NUM_THREADS=1 default
# would make every torch op of the session single-threaded.
from runtime.vision.ultralytics_import import import_ultralytics

import_ultralytics()


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from runtime.llm.loader import resolve_hf_dir

    hf_dir, _ = resolve_hf_dir(None)
    return hf_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> str:
    """A 2-layer random Llama (seeded) with SmolLM2's tokenizer: benchmarks.common's, which the
    benchmarks' smoke runs build too."""
    from benchmarks.common import write_tiny_llama

    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


VISION_IMGSZ = 320


def calibrated_yolo():
    """A fresh YOLO26n (seeded random weights) calibrated on bus.jpg and zidane.jpg, so that
    comparisons see hundreds of distinct detections (see runtime/vision/calibrate.py). Each
    test module builds its own: Ultralytics' predict may fuse the model in place."""
    import cv2
    import torch
    from ultralytics import YOLO
    from ultralytics.utils import ASSETS

    from runtime.vision.calibrate import calibrate

    torch.manual_seed(0)
    model = YOLO("yolo26n.yaml")
    calibrate(model.model, [cv2.imread(str(ASSETS / n)) for n in ("bus.jpg", "zidane.jpg")], VISION_IMGSZ)
    return model


# The count the default dtype was measured on (runtime/vision/config.py).
SHAPES_TEST_IMAGES = 200


@pytest.fixture(scope="session")
def shapes_test_set(tmp_path_factory) -> str:
    """The held-out generated shapes test set (runtime/vision/synthetic.py, a seed training never
    saw) at the shipped detector's input size, written once: every accuracy test of the session
    scores on these same images."""
    from runtime.vision import detector
    from runtime.vision.synthetic import write_test_set

    out = tmp_path_factory.mktemp("shapes-heldout")
    write_test_set(out, SHAPES_TEST_IMAGES, detector.IMGSZ)
    return str(out)


class Float32Reference:
    """The shipped detector's float32 predictions on the shapes test set and their mAP, per head
    (end2end: the NMS-free head; else the one-to-many head with NMS), each run once a session on
    first use: the accuracy tests compare their path against it instead of running float32
    again (a pass over the set is 5 to 8 s on two cores). Run as `evaluate.evaluate_engine` runs
    a config: in a VisionEngine of its own, at conf EVAL_CONF. Callers get copies."""

    def __init__(self, test_set: str) -> None:
        self.test_set = test_set
        self._runs: dict[bool, tuple[dict, dict]] = {}

    @staticmethod
    def config(end2end: bool = True):
        from runtime.vision import detector
        from runtime.vision.config import VisionConfig

        return VisionConfig(model=str(detector.WEIGHTS), imgsz=detector.IMGSZ, dtype="float32", end2end=end2end)

    def _run(self, end2end: bool) -> tuple[dict, dict]:
        if end2end not in self._runs:
            from runtime.vision import detector
            from runtime.vision import evaluate as ev

            preds = ev.engine_predictions(self.config(end2end), self.test_set)
            scores = ev.evaluate(preds, self.test_set, names=dict(enumerate(detector.CLASSES)))
            self._runs[end2end] = preds, scores
        return self._runs[end2end]

    def predictions(self, end2end: bool = True) -> dict:
        """Image key -> evaluate.ImagePredictions."""
        return copy.deepcopy(self._run(end2end)[0])

    def map(self, end2end: bool = True) -> dict:
        """As `evaluate.evaluate` returns it: {"map50_95", "map50", "images", ...}."""
        return copy.deepcopy(self._run(end2end)[1])


@pytest.fixture(scope="session")
def float32_reference(shapes_test_set) -> Float32Reference:
    return Float32Reference(shapes_test_set)


@pytest.fixture(scope="session")
def shared_fleet(tmp_path_factory, tiny_llama_dir):
    """The session's redis-server, worker, `tandem serve` and `tandem serve --embedded` on the
    tiny Llama (tests/fleet_support.py), each started on first use, stopped at the session's end."""
    from fleet_support import SharedFleet

    fleet = SharedFleet(tmp_path_factory.mktemp("fleet"), tiny_llama_dir)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="session")
def models_fleet(tmp_path_factory, smollm2_dir, tiny_llama_dir):
    """The session's two-model fleet (SmolLM2 and the tiny Llama on one Redis, one `tandem serve`;
    tests/fleet_support.py), started on first use, stopped at the session's end."""
    from fleet_support import ModelsFleet

    fleet = ModelsFleet(tmp_path_factory.mktemp("models"), smollm2_dir, tiny_llama_dir)
    try:
        yield fleet
    finally:
        fleet.stop()


# The session's fleets are processes, started once per pytest process: so that each starts once
# under xdist, the modules that use one run in one xdist process, one after another (they rely
# on a fleet that is idle when they start). Every other module is a unit of its own, so its
# module-scoped fixtures (a redis-server, a worker of its own) start once too.
FLEET_FIXTURES = frozenset({"shared_fleet", "models_fleet"})
FLEET_MODULES = frozenset(
    f"tests/{name}.py"
    for name in (
        "test_agent_libraries",
        "test_bad_requests",
        "test_fleet_models",
        "test_image_limits",
        "test_jobs_logprobs",
        "test_jobs_tools",
        "test_serve",
        "test_serve_fuzz",
        "test_serve_n",
        "test_serve_prompt_logprobs",
        "test_serve_tools",
    )
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if FLEET_FIXTURES.intersection(item.fixturenames) and module not in FLEET_MODULES:
            raise pytest.UsageError(f"{module} uses a session fleet: add it to FLEET_MODULES in tests/conftest.py")


def _xdist_scheduler():
    from xdist.scheduler import LoadScopeScheduling

    class FleetScheduling(LoadScopeScheduling):
        """xdist's per-module scheduling ("loadfile"), with the fleet modules as one unit."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "fleets" if module in FLEET_MODULES else module

    return FleetScheduling


try:
    import xdist  # noqa: F401
except ImportError:  # the suite runs in one process
    pass
else:

    def pytest_xdist_make_scheduler(config, log):
        return _xdist_scheduler()(config, log)
