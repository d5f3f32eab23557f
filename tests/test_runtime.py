"""The Runtime: both workloads under one loop, many callers, cancellation, failures that stay
with their request, deadlines, close. The tiny Llama and a small YOLO keep it fast; the
real SmolLM2 checks that outputs through the Runtime equal the plain LLM path.

No test waits for time to pass: each waits on a handle, a future or an event set by a hook,
with timeouts only as safety limits.
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import numpy as np
import pytest
from test_jobs_support import wait_for

from runtime import LLM, DeadlineExceededError, RequestError, Runtime, RuntimeClosedError, SamplingParams
from runtime.memory import DeviceMemoryManager, MemoryConfig

SAFETY_S = 120
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Bonjour, je", "1, 2, 3,"]


def _vision(workers: int | None = None, **batching) -> dict:
    """Small and fast; workers=1 makes a one-lane device, where the two workloads take turns."""
    return {
        "imgsz": 64,
        "conf": 0.0,
        "profile": False,
        "jit": False,
        "workers": workers,
        "batching": {"max_batch_size": 2, "max_queue_delay_ms": 1.0, "preferred_batch_sizes": [1], **batching},
    }


def _llm(model: str, **kw) -> dict:
    # float32: tests compare tokens across batchings, which bfloat16 does not keep bit-stable.
    return {
        "model": model,
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "max_model_len": 128,
        **kw,
    }


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def rt(tiny_llama_dir):
    with Runtime(llm=_llm(tiny_llama_dir), vision=_vision(), profile=False) as runtime:
        yield runtime


def _hold_vision(monkeypatch, runtime: Runtime) -> tuple[threading.Event, threading.Semaphore]:
    """Hold every vision forward until the gate opens; `entered` counts forwards that began."""
    gate, entered = threading.Event(), threading.Semaphore(0)
    real_infer = runtime.vision.runner.infer

    def held_infer(prepared):
        entered.release()
        assert gate.wait(SAFETY_S)
        return real_infer(prepared)

    monkeypatch.setattr(runtime.vision.runner, "infer", held_infer)
    return gate, entered


def _kv_used(runtime: Runtime) -> int:
    return runtime.memory.stats()["kv_blocks"]["used"]


def test_many_threads_submit_both_kinds_and_everything_completes(rt, tiny_llama_dir):
    reference = LLM(
        model=tiny_llama_dir,
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=128,
    )
    expected = {p: o.token_ids for p, o in zip(PROMPTS, reference.generate(PROMPTS, GREEDY, use_tqdm=False))}
    reference.engine.close()
    results: dict[tuple[int, int], object] = {}
    errors: list[BaseException] = []

    def caller(k: int) -> None:
        try:
            handles = [(p, rt.submit_generate(p, GREEDY)) for p in PROMPTS]
            futures = [rt.submit_detect(_image(k * 10 + j)) for j in range(3)]
            for j, (p, h) in enumerate(handles):
                results[k, j] = (p, h.result(SAFETY_S).token_ids)
            for f in futures:
                assert f.result(SAFETY_S).orig_shape == (48, 64)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SAFETY_S)
    assert not errors, errors
    assert len(results) == 6 * len(PROMPTS)
    for p, ids in results.values():  # greedy: the same tokens whatever shared the batch
        assert ids == expected[p]
    assert _kv_used(rt) == 0
    stats = rt.stats()
    assert stats["llm"]["running"] == 0 and stats["vision"]["queued"] == 0
    assert stats["arbiter"]["turns"]["llm"] > 0
    assert sum(size * n for size, n in stats["vision"]["batch_size_counts"].items()) == 6 * 3


def test_streamed_outputs_arrive_as_tokens_and_add_up_to_the_result(rt):
    handle = rt.submit_generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    outs = list(handle)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert sum((o.delta_token_ids for o in outs), []) == outs[-1].token_ids == handle.result().token_ids
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert len(outs[-1].token_ids) == 12


def test_handles_bridge_to_asyncio(rt):
    import asyncio

    async def main():
        handle = rt.submit_generate("Once upon a time", GREEDY)
        out = await asyncio.wrap_future(handle.as_future())
        detections = await asyncio.wrap_future(rt.submit_detect(_image(1)))
        return out, detections

    out, detections = asyncio.run(main())
    assert len(out.token_ids) == GREEDY.max_tokens and detections.orig_shape == (48, 64)


def test_cancel_a_running_and_a_queued_generation_frees_their_blocks(rt):
    baseline = rt.memory.stats()["owners"]
    started = threading.Event()
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    running = rt.submit_generate("Once upon a time", long)
    # Four slots: fill them so that the fifth request waits in the queue.
    others = [rt.submit_generate(p, long) for p in PROMPTS[1:4]]
    queued = rt.submit_generate("never runs", long)
    for _ in running:  # the first token: it is running
        started.set()
        break
    assert started.is_set()
    assert queued.cancel() and running.cancel()
    for h in (running, queued):
        with pytest.raises(CancelledError):
            h.result(SAFETY_S)
    assert queued.cancelled() and not queued.cancel()  # cancelling twice: already done
    for h in others:
        h.cancel()
        with pytest.raises(CancelledError):
            h.result(SAFETY_S)
    assert _kv_used(rt) == 0  # the aborts ran on the loop before the handles ended
    assert rt.memory.stats()["owners"] == baseline


def test_cancel_a_queued_detection_takes_it_out(rt, monkeypatch):
    gate, entered = _hold_vision(monkeypatch, rt)
    first = [rt.submit_detect(_image(j)) for j in range(4)]  # batches that hold the workers
    assert entered.acquire(timeout=SAFETY_S)
    waiting = rt.submit_detect(_image(99), request_id="to-cancel")
    queued = rt.stats()["vision"]["queued"]
    assert "to-cancel" in rt.vision.scheduler.queue
    assert waiting.cancel() and waiting.cancelled()
    # Taken out at once, not when a worker frees.
    assert "to-cancel" not in rt.vision.scheduler.queue and "to-cancel" not in rt.vision.jobs
    assert rt.stats()["vision"]["queued"] == queued - 1
    gate.set()
    assert all(f.result(SAFETY_S) is not None for f in first)
    assert rt.submit_detect(_image(5)).result(SAFETY_S).orig_shape == (48, 64)  # workers still serve


def _fail_once(monkeypatch, obj, name: str, error: BaseException) -> None:
    """Make obj.name raise `error` on its next call only."""
    real = getattr(obj, name)
    calls = {"n": 0}

    def failing_once(*args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise error
        return real(*args)

    monkeypatch.setattr(obj, name, failing_once)


def test_a_failing_llm_step_fails_its_requests_and_the_next_ones_succeed(rt, monkeypatch):
    runner = rt.llm.runner
    real_execute = runner.execute
    _fail_once(monkeypatch, runner, "execute", RuntimeError("injected runner failure"))
    doomed = rt.submit_generate("Once upon a time", GREEDY)
    with pytest.raises(RequestError, match="injected runner failure"):
        doomed.result(SAFETY_S)
    # Pool and runner agree with the scheduler: no blocks held, no runner state for it.
    assert _kv_used(rt) == 0 and doomed.request_id not in runner.requests
    monkeypatch.setattr(runner, "execute", real_execute)
    after = rt.submit_generate("Once upon a time", GREEDY).result(SAFETY_S)
    assert len(after.token_ids) == GREEDY.max_tokens and after.error is None
    assert rt.stats()["llm"]["failed_steps"] >= 1


def test_a_failing_vision_batch_fails_only_its_requests(rt, monkeypatch):
    _fail_once(monkeypatch, rt.vision.runner, "infer", MemoryError("injected out of memory"))
    doomed = rt.submit_detect(_image(1))
    with pytest.raises(RuntimeError, match="injected out of memory"):
        doomed.result(SAFETY_S)
    assert rt.submit_detect(_image(2)).result(SAFETY_S).orig_shape == (48, 64)


def test_a_bad_request_raises_on_the_callers_thread_and_others_go_on(rt):
    good = rt.submit_generate("Once upon a time", GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        rt.submit_generate("word " * 200, GREEDY)
    with pytest.raises(ValueError, match="deadline_s"):
        rt.submit_generate("hi", GREEDY, deadline_s=-1)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        rt.submit_generate([{"role": "user"}], GREEDY)
    with pytest.raises(ValueError, match="priority"):
        rt.submit_detect(_image(0), priority=7)
    bad_image = rt.submit_detect("/nonexistent/image.jpg")
    with pytest.raises(ValueError):
        bad_image.result(SAFETY_S)
    assert len(good.result(SAFETY_S).token_ids) == GREEDY.max_tokens


def test_queued_requests_past_their_deadline_are_rejected(tiny_llama_dir, monkeypatch):
    # One lane: while the vision worker is held, the LLM request waits in the queue until its
    # deadline passes, and so does the next image.
    with Runtime(llm=_llm(tiny_llama_dir, max_num_seqs=1), vision=_vision(workers=1), profile=False) as runtime:
        gate, entered = _hold_vision(monkeypatch, runtime)
        held = runtime.submit_detect(_image(0))
        assert entered.acquire(timeout=SAFETY_S)
        late_text = runtime.submit_generate("Once upon a time", GREEDY, deadline_s=0.05)
        late_image = runtime.submit_detect(_image(9), deadline_s=0.05)
        with pytest.raises(DeadlineExceededError, match="deadline"):
            late_image.result(SAFETY_S)
        with pytest.raises(DeadlineExceededError, match="deadline"):
            late_text.result(SAFETY_S)
        assert runtime.stats()["llm"]["steps"] == 0  # rejected while the lane was vision's
        gate.set()
        assert held.result(SAFETY_S) is not None
        on_time = runtime.submit_generate("Once upon a time", GREEDY, deadline_s=SAFETY_S).result(SAFETY_S)
        assert on_time.metrics.deadline_missed is False


def test_on_several_lanes_vision_runs_beside_llm_steps(tiny_llama_dir, monkeypatch):
    with Runtime(llm=_llm(tiny_llama_dir), vision=_vision(workers=2), profile=False) as runtime:
        assert runtime.arbiter.lanes == 2
        long = runtime.submit_generate(
            "Once upon a time", SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
        )
        next(iter(long))  # the LLM is busy decoding
        gate, entered = _hold_vision(monkeypatch, runtime)
        held = []
        for k in range(2):  # one at a time, so each is a batch of its own: both lanes run vision
            held.append(runtime.submit_detect(_image(k)))
            assert entered.acquire(timeout=SAFETY_S)
        steps = runtime.stats()["llm"]["steps"]
        # And the LLM still steps beside them, never starved: its step count moves on while both
        # lanes are held. (Counting the tokens read would not do: those already streamed before
        # the hold sit in the stream's buffer, and a fast step leaves several there.)
        wait_for(lambda: runtime.stats()["llm"]["steps"] >= steps + 3, SAFETY_S, "LLM steps beside held vision")
        assert not long.done() and not any(f.done() for f in held)
        gate.set()
        assert all(f.result(SAFETY_S) is not None for f in held)
        long.cancel()


def test_on_one_lane_an_urgent_vision_batch_runs_between_llm_steps(tiny_llama_dir):
    arbiter = {"vision_target_latency_ms": 30.0}
    with Runtime(llm=_llm(tiny_llama_dir), vision=_vision(workers=1), arbiter=arbiter, profile=False) as runtime:
        assert runtime.arbiter.lanes == 1
        long = runtime.submit_generate(
            "Once upon a time", SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
        )
        next(iter(long))  # the LLM is busy decoding and holds the lane
        assert runtime.submit_detect(_image(3)).result(SAFETY_S) is not None  # due 30 ms after arrival
        assert not long.done()  # it ran in the middle of the generation, not after it
        assert runtime.stats()["arbiter"]["reasons"]["vision deadline"] >= 1
        long.cancel()


def test_close_drains_by_default_and_fails_pending_work_without_draining(tiny_llama_dir):
    memory = DeviceMemoryManager(MemoryConfig(budget_bytes=1 << 30))
    runtime = Runtime(llm=_llm(tiny_llama_dir), vision=_vision(), memory=memory, profile=False)
    handles = [runtime.submit_generate(p, GREEDY) for p in PROMPTS]
    futures = [runtime.submit_detect(_image(j)) for j in range(4)]
    runtime.close()
    assert all(len(h.result(0).token_ids) == GREEDY.max_tokens for h in handles)
    assert all(f.result(0) is not None for f in futures)
    assert memory.stats()["owners"] == {}  # every reservation released
    with pytest.raises(RuntimeError, match="closed"):
        runtime.submit_generate("hi", GREEDY)

    runtime = Runtime(llm=_llm(tiny_llama_dir), vision=_vision(), memory=memory, profile=False)
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    handles = [runtime.submit_generate(p, long) for p in PROMPTS]
    futures = [runtime.submit_detect(_image(j)) for j in range(8)]
    runtime.close(drain=False)
    for h in handles:
        with pytest.raises(RuntimeClosedError):
            h.result(0)
    outcomes = [f.exception(0) for f in futures]  # batches already running finish; the rest fail
    assert all(e is None or isinstance(e, RuntimeClosedError) for e in outcomes)
    assert any(isinstance(e, RuntimeClosedError) for e in outcomes)
    assert memory.stats()["owners"] == {}


def test_a_broken_loop_fails_pending_and_later_calls_at_once(tiny_llama_dir, monkeypatch):
    runtime = Runtime(llm=_llm(tiny_llama_dir), profile=False)
    try:

        def broken_choice(*args):
            raise AssertionError("injected arbiter bug")

        pending = runtime.submit_generate("Once upon a time", SamplingParams(max_tokens=100, ignore_eos=True))
        next(iter(pending))
        monkeypatch.setattr(runtime.arbiter, "choose", broken_choice)
        with pytest.raises(RuntimeClosedError, match="injected arbiter bug"):
            pending.result(SAFETY_S)
        with pytest.raises(RuntimeError, match="broken.*injected arbiter bug"):
            runtime.submit_generate("hi", GREEDY)
        assert _kv_used(runtime) == 0
    finally:
        runtime.close(timeout=SAFETY_S)


def test_vision_is_reserved_first_and_the_kv_pool_takes_the_rest(tiny_llama_dir):
    memory = DeviceMemoryManager(MemoryConfig(budget_bytes=1 << 30))
    # Given LLM first, vision second: the Runtime still builds vision first.
    with Runtime(llm=_llm(tiny_llama_dir), vision=_vision(), memory=memory, profile=False) as runtime:
        owners = list(runtime.memory.stats()["owners"])
        assert owners.index("vision.activations") < owners.index("llm.kv_cache")
        assert runtime.memory.free_bytes < runtime.memory.kv_bytes_per_block  # the pool took the rest
    assert memory.stats()["owners"] == {}


def test_config_errors_name_the_field(tiny_llama_dir):
    with pytest.raises(ValueError, match="llm, vision or both"):
        Runtime()
    with pytest.raises(ValueError, match="unknown field"):
        Runtime(llm={"modle": tiny_llama_dir})
    with pytest.raises(ValueError, match="max_vision_share"):
        Runtime(llm=_llm(tiny_llama_dir), arbiter={"max_vision_share": 2})


@pytest.mark.slow
def test_runtime_greedy_outputs_equal_the_plain_llm_path_with_vision_beside(smollm2_dir):
    prompts = ["What is the capital of France?", "Write a haiku about autumn.", "def fib(n):"]
    params = SamplingParams(max_tokens=16, temperature=0)
    llm = LLM(model=smollm2_dir, device="cpu", dtype="float32", max_num_seqs=4)
    expected = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.close()
    with Runtime(
        llm={"model": smollm2_dir, "device": "cpu", "dtype": "float32", "max_num_seqs": 4},
        vision=_vision(),
        profile=False,
    ) as runtime:
        futures = [runtime.submit_detect(_image(j)) for j in range(12)]
        handles = [runtime.submit_generate(p, params) for p in prompts]
        assert [h.result(SAFETY_S).token_ids for h in handles] == expected
        assert all(f.result(SAFETY_S) is not None for f in futures)
