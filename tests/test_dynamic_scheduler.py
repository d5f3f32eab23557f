"""Request-level batching: the Triton-style queue policy (sizes, delay, priorities, timeouts,
bound), the vision scheduler built on it, and the LLM static batcher."""

from __future__ import annotations

import pytest
from scheduler_harness import drive, token_at

from runtime.block_pool import BlockPool
from schedulers import (
    DynamicBatchConfig,
    DynamicBatchScheduler,
    QueueFullError,
    Request,
    SchedulerConfig,
    StaticBatchScheduler,
    StopCriteria,
)


def dyn(**kw):
    return DynamicBatchScheduler(DynamicBatchConfig(**kw))


def test_batch_released_when_full():
    s = dyn(max_batch_size=3, max_queue_delay_ms=1000)
    for i in range(4):
        s.add_request(f"i{i}", i, now=0.0)
    b = s.schedule(0.0)
    assert b.request_ids == ["i0", "i1", "i2"] and b.payloads == [0, 1, 2]
    assert s.schedule(0.0).size == 0  # one left: waits for the delay
    assert s.next_due(0.0) == pytest.approx(1.0)
    assert s.schedule(1.0).request_ids == ["i3"]


def test_preferred_batch_size_released_before_the_delay():
    s = dyn(max_batch_size=8, preferred_batch_sizes=(2, 4), max_queue_delay_ms=1000)
    for i in range(3):
        s.add_request(f"i{i}", None, now=0.0)
    assert s.schedule(0.0).size == 2  # largest preferred size that 3 waiting requests can fill
    assert s.schedule(0.0).size == 0
    for i in range(3, 8):
        s.add_request(f"i{i}", None, now=0.1)
    assert s.schedule(0.1).size == 4
    assert s.batch_sizes == [2, 4]


def test_oldest_request_waiting_max_queue_delay_releases_a_partial_batch():
    s = dyn(max_batch_size=8, max_queue_delay_ms=5)
    s.add_request("a", None, now=0.0)
    s.add_request("b", None, now=0.003)
    assert s.schedule(0.004).size == 0
    assert s.next_due(0.004) == pytest.approx(0.001)
    assert s.schedule(0.005).request_ids == ["a", "b"]
    assert s.next_due(0.005) is None


def test_priority_levels_fifo_within_a_level():
    s = dyn(max_batch_size=4, priority_levels=3, max_queue_delay_ms=0)
    for rid, prio in [("l1", 2), ("h1", 0), ("m1", 1), ("h2", 0), ("l2", 2)]:
        s.add_request(rid, None, now=0.0, priority=prio)
    assert s.schedule(0.0).request_ids == ["h1", "h2", "m1", "l1"]
    assert s.schedule(0.0).request_ids == ["l2"]
    with pytest.raises(ValueError, match=r"priority must be an integer in \[0, 2\]"):
        s.add_request("x", None, now=0.0, priority=3)


def test_request_timeout_in_queue_is_rejected_with_a_clear_error():
    s = dyn(max_batch_size=4, max_queue_delay_ms=100, default_timeout_ms=50)
    s.add_request("slow", None, now=0.0)
    s.add_request("patient", None, now=0.0, timeout_ms=500)
    b = s.schedule(0.06)
    assert b.size == 0 and set(b.rejected) == {"slow"}
    assert "timed out after waiting 60.0 ms" in b.rejected["slow"]
    assert s.schedule(0.1).request_ids == ["patient"]


def test_full_queue_rejects_at_once():
    s = dyn(max_batch_size=2, max_queue_size=2, max_queue_delay_ms=100)
    s.add_request("a", None, now=0.0)
    s.add_request("b", None, now=0.0)
    with pytest.raises(QueueFullError, match="max_queue_size=2"):
        s.add_request("c", None, now=0.0)
    s.schedule(0.0)
    s.add_request("c", None, now=0.0)  # room again once a batch left


def test_update_finishes_the_whole_batch_and_abort_drops_a_queued_request():
    s = dyn(max_batch_size=2, max_queue_delay_ms=0)
    for rid in "abc":
        s.add_request(rid, rid.upper(), now=0.0)
    assert s.abort("c") and not s.abort("c")
    b = s.schedule(0.0)
    assert s.has_unfinished()
    assert s.update(b, ["A!", "B!"]) == {"a": "A!", "b": "B!"}
    assert not s.has_unfinished()
    with pytest.raises(ValueError, match="one entry per batch member"):
        s.update(b, ["only one"])


def test_abort_drops_only_queued_requests_and_add_request_reports_the_deadline():
    s = dyn(max_batch_size=1, max_queue_delay_ms=0, default_timeout_ms=50)
    assert s.add_request("a", None, now=1.0).deadline == pytest.approx(1.05)
    assert s.add_request("b", None, now=1.0, timeout_ms=200).deadline == pytest.approx(1.2)
    b = s.schedule(1.0)
    assert b.request_ids == ["a"] and not s.abort("a")  # formed: running, no longer abortable
    assert s.abort("b") and len(s.queue) == 0 and s.schedule(1.0).size == 0


def test_the_queue_takes_its_knobs_from_one_config():
    config = DynamicBatchConfig(max_batch_size=4, preferred_batch_sizes=(2,), max_queue_delay_ms=10, max_queue_size=3)
    s = DynamicBatchScheduler(config)
    assert s.queue.config is config
    for i in range(3):
        s.add_request(f"i{i}", None, now=0.0)
    with pytest.raises(QueueFullError, match="max_queue_size=3"):
        s.add_request("x", None, now=0.0)
    assert s.schedule(0.0).size == 2  # the preferred size, before the delay


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"max_batch_size": 0}, "max_batch_size must be an integer >= 1, got 0"),
        ({"max_batch_size": True}, "max_batch_size must be an integer >= 1, got True"),
        ({"max_batch_size": 4, "preferred_batch_sizes": (8,)}, r"preferred_batch_sizes .*\[1, max_batch_size=4\]"),
        ({"preferred_batch_sizes": 4}, "preferred_batch_sizes must be a sequence of integers, got 4"),
        ({"preferred_batch_sizes": (2.0,)}, "preferred_batch_sizes must hold integers"),
        ({"max_queue_delay_ms": -1}, "max_queue_delay_ms must be a number >= 0, got -1"),
        ({"max_queue_delay_ms": "5"}, "max_queue_delay_ms must be a number >= 0, got '5'"),
        ({"default_timeout_ms": 0}, "default_timeout_ms must be a number > 0 or None, got 0"),
        ({"max_queue_size": 0}, "max_queue_size must be an integer >= 1"),
        ({"priority_levels": 0}, "priority_levels must be an integer >= 1"),
    ],
)
def test_config_errors_name_the_field_and_range(fields, message):
    with pytest.raises(ValueError, match=message):
        DynamicBatchConfig(**fields)


def static(slots, num_blocks=64, block_size=4, **batching):
    batching.setdefault("max_queue_delay_ms", 0.0)
    return StaticBatchScheduler(
        SchedulerConfig(max_num_seqs=slots, max_num_batched_tokens=256, max_model_len=128),
        BlockPool(num_blocks, block_size),
        DynamicBatchConfig(max_batch_size=slots, **batching),
    )


def test_static_group_runs_until_its_longest_member_finishes():
    s = static(2)
    for i, n in enumerate([2, 6, 3, 1]):
        s.add_request(Request(f"r{i}", [5, 6, 7], StopCriteria(max_tokens=n), arrival_time=0.0))
    plans, tokens, _ = drive(s)
    running = [p.req_ids for p in plans]
    # Group 1 (r0, r1) holds the floor for 6 steps although r0 is done after 2; then group 2.
    assert running == [["r0", "r1"], ["r0", "r1"]] + [["r1"]] * 4 + [["r2", "r3"]] + [["r2"]] * 2
    assert s.group_sizes == [2, 2]
    assert tokens["r1"] == [token_at("r1", 3 + k) for k in range(6)]


def test_static_scheduler_times_out_queued_requests():
    s = static(1, default_timeout_ms=10)
    s.add_request(Request("first", [1, 2], StopCriteria(max_tokens=3)))
    s.add_request(Request("second", [1, 2], StopCriteria(max_tokens=3)))
    plan = s.schedule(0.0)
    assert plan.req_ids == ["first"]
    plan = s.schedule(0.02)
    assert "second" in plan.rejected and "timed out" in plan.rejected["second"]
