"""The vision GPU path, as far as a machine without CUDA can check it: the staging buffers
(reused per shape, per thread, waiting on the copy that last read them), the CPU path left as
it was (no stream, no event, no pinning, the same input tensor), the comparisons the GPU check
reports, and the check itself exiting 2 without CUDA. The GPU half runs in
`python -m benchmarks.gpu_vision` on a CUDA machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks import gpu_vision as gpu_check
from runtime.vision.config import VisionConfig
from runtime.vision.postprocess import Detections
from runtime.vision.preprocess import BatchBuffers, letterbox_into, plan_letterbox, to_tensor
from runtime.vision.runner import YoloRunner

ROOT = Path(__file__).resolve().parents[1]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")


class FakeEvent:
    """Stands in for a torch.cuda.Event: counts host waits."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


# -- staging buffers --
def test_buffers_are_reused_per_shape_and_grown_only_when_a_batch_is_larger():
    bufs = BatchBuffers()
    a = bufs.get((64, 96), 4)
    assert a.shape == (4, 64, 96, 3) and a.dtype == np.uint8
    assert bufs.get((64, 96), 4).__array_interface__["data"] == a.__array_interface__["data"]  # same memory
    assert np.shares_memory(bufs.get((64, 96), 2), a)  # a smaller batch: a view of the same buffer
    other = bufs.get((96, 64), 4)
    assert not np.shares_memory(other, a)  # another shape, another buffer
    grown = bufs.get((64, 96), 8)
    assert grown.shape[0] == 8 and not np.shares_memory(grown, a)
    assert np.shares_memory(bufs.get((64, 96), 4), grown)  # the grown one serves smaller batches from then on
    assert bufs.nbytes == grown.nbytes + other.nbytes
    assert bufs.pinned((64, 96), 4) is None  # not pinned: callers copy from the array


def test_a_buffer_waits_for_the_copy_that_last_read_it():
    bufs = BatchBuffers()
    bufs.get((32, 32), 2)
    bufs.get((64, 64), 2)
    event = FakeEvent()
    bufs.fence((32, 32), event)
    bufs.get((64, 64), 2)
    assert event.waits == 0  # another shape's buffer is not held up
    bufs.get((32, 32), 2)
    assert event.waits == 1  # before the buffer is written again
    bufs.get((32, 32), 2)
    assert event.waits == 1  # once: the copy is over
    grown_after = FakeEvent()
    bufs.fence((32, 32), grown_after)
    bufs.get((32, 32), 16)  # replaced by a larger one: still waits (the old memory may be in flight)
    assert grown_after.waits == 1


def test_each_thread_has_its_own_buffers_and_fences():
    """The Runtime's vision workers call prepare on one runner side by side."""
    bufs = BatchBuffers()
    mine = bufs.get((32, 32), 2)
    event = FakeEvent()
    bufs.fence((32, 32), event)
    theirs: list[np.ndarray] = []
    t = threading.Thread(target=lambda: theirs.append(bufs.get((32, 32), 2)))
    t.start()
    t.join()
    assert not np.shares_memory(theirs[0], mine)
    assert event.waits == 0  # the fence is the other thread's
    assert np.shares_memory(bufs.get((32, 32), 2), mine) and event.waits == 1


# -- the CPU path is the one it was --
def test_to_tensor_on_cpu_is_unchanged():
    batch = np.random.default_rng(0).integers(0, 256, (3, 64, 96, 3), dtype=np.uint8)
    t = to_tensor(batch, torch.device("cpu"))
    old = torch.from_numpy(batch).flip(3).permute(0, 3, 1, 2).float().div_(255)  # the code before the CUDA path
    assert t.dtype == torch.float32 and torch.equal(t, old)
    assert t.is_contiguous(memory_format=torch.channels_last)
    # A pinned source (here: the same bytes as a tensor) and a target dtype give the same values.
    same = to_tensor(batch, torch.device("cpu"), pinned=torch.from_numpy(batch))
    assert torch.equal(same, old)
    half = to_tensor(batch, torch.device("cpu"), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(
        half, torch.from_numpy(batch).flip(3).permute(0, 3, 1, 2).to(torch.bfloat16).div_(255)
    )


def _expected(image: np.ndarray, imgsz: int) -> torch.Tensor:
    box = plan_letterbox(image.shape[:2], imgsz, 32, True)
    buf = np.empty((1, *box.input_shape, 3), np.uint8)
    letterbox_into(image, box, buf[0])
    return torch.from_numpy(buf).flip(3).permute(0, 3, 1, 2).float().div_(255)


def test_cpu_runner_has_no_cuda_state_and_reused_buffers_do_not_leak_into_earlier_batches():
    runner = YoloRunner(VisionConfig(dtype="float32", imgsz=160, jit=False))
    assert runner._copy_stream is None and not runner._buffers.pin_memory
    rng = np.random.default_rng(1)
    first = [rng.integers(0, 256, (120, 200, 3), dtype=np.uint8) for _ in range(2)]
    second = [rng.integers(0, 256, (120, 200, 3), dtype=np.uint8) for _ in range(2)]  # same shape: same buffer
    a = runner.prepare(first)
    b = runner.prepare(second)
    assert a.ready is None and b.ready is None
    for prepared, images in ((a, first), (b, second)):
        ((idx, tensor, _),) = prepared.groups
        assert idx == [0, 1] and tensor.dtype == torch.float32
        for row, image in enumerate(images):
            assert torch.equal(tensor[row : row + 1], _expected(image, 160))
    # Results go through infer unchanged: the same detections as a fresh prepare of the same images.
    again = runner.infer(runner.prepare(first))
    for x, y in zip(runner.infer(a), again):
        assert np.array_equal(x.boxes, y.boxes) and np.array_equal(x.conf, y.conf) and np.array_equal(x.cls, y.cls)


# -- the GPU check --
@no_cuda
def test_gpu_check_exits_2_without_cuda(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written


@no_cuda
def test_gpu_check_module_entry_point_exits_2_without_cuda(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_vision", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "benchmarks.gpu_vision: no CUDA device" in proc.stderr


def _dets(rows: list[tuple[float, float, float, float, float, int]]) -> Detections:
    a = np.array(rows, dtype=np.float32).reshape(-1, 6)
    return Detections(
        a[:, :4].copy(), a[:, 4].copy(), a[:, 5].astype(np.int64), [str(int(c)) for c in a[:, 5]], (100, 100)
    )


def test_match_is_one_to_one_same_class_highest_iou_first():
    ref = np.array([[0, 0, 10, 10], [0, 0, 10, 9]], np.float32)
    got = np.array([[0, 0, 10, 10], [50, 50, 60, 60]], np.float32)
    pairs = gpu_check.match(ref, np.array([0, 0]), got, np.array([0, 0]))
    assert pairs == [(0, 0, 1.0)]  # ref 1 also overlaps got 0, but got 0 is taken
    assert gpu_check.match(ref, np.array([0, 0]), got, np.array([1, 1])) == []  # other classes never match
    assert gpu_check.match(ref[:0], np.zeros(0), got, np.array([0, 0])) == []


def test_agreement_counts_kept_boxes_against_the_larger_set():
    ref = [_dets([(0, 0, 10, 10, 0.9, 0), (20, 20, 40, 40, 0.8, 1)]), _dets([])]
    same = gpu_check.agreement(ref, ref)
    assert same["kept_share"] == 1.0 and same["matched"] == 2 and same["max_conf_diff"] == 0.0
    shifted = [_dets([(0, 0, 10, 10, 0.85, 0), (21, 20, 41, 40, 0.8, 1), (70, 70, 80, 80, 0.3, 2)]), _dets([])]
    agreement = gpu_check.agreement(ref, shifted)
    # box 2 moved 1 px (IoU 19/21 = 0.905 >= 0.9), one extra box: 2 kept of max(2, 3)
    assert agreement["ref_boxes"] == 2 and agreement["boxes"] == 3
    assert agreement["kept_share"] == pytest.approx(2 / 3)
    assert agreement["max_conf_diff"] == pytest.approx(0.05, abs=1e-6)


def test_box_errors_report_pixels_and_missing_boxes():
    got = [_dets([(0, 0, 10, 10, 0.9, 0), (20, 20, 40, 40, 0.8, 1)])]
    ref = [(np.array([[0, 0, 10, 10.5], [5, 5, 6, 6]], np.float32), np.array([0.9, 0.5], np.float32), np.array([0, 2]))]
    err = gpu_check.box_errors(ref, got)
    assert err["ref_boxes"] == 2 and err["boxes"] == 2 and err["missing"] == 1  # class 2 has no box of ours
    assert err["max_px"] == pytest.approx(0.5) and err["median_px"] == pytest.approx(0.5)


def test_inverted_and_zero_width_boxes_of_random_weights_match_themselves():
    boxes = [
        (0, 240, 240, 0, 0.5, 3),
        (94.9, 0, 0, 92.1, 0.4, 1),
        (0, 10, 0, 50, 0.3, 2),
    ]  # as a random head gives them
    dets = [_dets(boxes)]
    assert gpu_check.agreement(dets, dets)["kept_share"] == 1.0


def test_host_pool_path_gives_the_inline_results_and_keeps_bad_inputs_to_themselves():
    """CUDA runners decode and letterbox a batch's images on a thread pool; the same code with
    a pool on CPU must give what the inline path gives, a bad input failing only itself."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from runtime.vision.batch import VisionJob, prepare_batch
    from schedulers import Batch

    rng = np.random.default_rng(2)
    images = [
        rng.integers(0, 256, (120, 200, 3), dtype=np.uint8),
        rng.integers(0, 256, (200, 120, 3), dtype=np.uint8),
        rng.integers(0, 256, (120, 200, 3), dtype=np.uint8),
    ]
    payloads = [images[0], np.zeros((4, 4), np.float64), images[1], images[2]]  # the second cannot be decoded
    runner = YoloRunner(VisionConfig(dtype="float32", imgsz=160, jit=False))
    assert runner.host_pool is None  # CPU: inline

    def prepare():
        jobs = {f"r{k}": VisionJob(Future(), 0.0) for k in range(len(payloads))}
        ready = prepare_batch(runner, Batch(list(jobs), payloads), jobs, 0.0)
        return ready, jobs

    inline, inline_jobs = prepare()
    with ThreadPoolExecutor(3) as pool:
        runner.host_pool = pool
        pooled, pooled_jobs = prepare()
    assert pooled.request_ids == inline.request_ids == ["r0", "r2", "r3"]
    for jobs in (inline_jobs, pooled_jobs):
        assert isinstance(jobs["r1"].future.exception(timeout=0), ValueError)  # VisionInputError
    assert len(pooled.prepared.groups) == len(inline.prepared.groups) == 2
    for (i1, t1, b1), (i2, t2, b2) in zip(inline.prepared.groups, pooled.prepared.groups):
        assert i1 == i2 and b1 == b2 and torch.equal(t1, t2)
