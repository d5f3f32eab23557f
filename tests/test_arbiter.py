"""The Runtime's arbiter, driven with fake costs and a fake clock: no model, no torch."""

from __future__ import annotations

import pytest

from schedulers.arbiter import LLM, VISION, WAIT, Arbiter, ArbiterConfig, LinearCost, LLMState, VisionState


def _arbiter(llm_s: float = 0.05, vision_s_per_image: float = 0.02, **config) -> Arbiter:
    """An arbiter whose cost models have learned exact fake costs."""
    arb = Arbiter(ArbiterConfig(**config))
    for reqs, tokens in ((1, 1), (16, 16), (1, 256), (4, 64)):
        arb.llm_cost.observe((reqs, tokens), llm_s)
    for n in (1, 2, 4):
        arb.vision_cost.observe((n,), vision_s_per_image * n)
    return arb


READY = LLMState(ready=True, num_reqs=8, num_tokens=8)


def test_linear_cost_recovers_a_linear_model_and_follows_drift():
    cost = LinearCost(2, decay=0.9)
    assert cost.predict((3, 4)) == cost.default_s
    samples = [(d, p) for d in (1, 4, 16) for p in (0, 32, 256)]
    for d, p in samples:
        cost.observe((d, p), 0.010 + 0.002 * d + 0.0001 * p)
    assert cost.predict((8, 128)) == pytest.approx(0.010 + 0.016 + 0.0128, rel=1e-6)
    for _ in range(20):  # the device slows down twofold: old samples fade
        for d, p in samples:
            cost.observe((d, p), 2 * (0.010 + 0.002 * d + 0.0001 * p))
    assert cost.predict((8, 128)) == pytest.approx(2 * 0.0388, rel=0.01)


def test_one_ready_workload_runs_and_an_idle_loop_waits_for_the_next_due_batch():
    arb = _arbiter()
    assert arb.choose(0.0, READY, None).kind == LLM
    assert arb.choose(0.0, READY, VisionState(due_size=0, next_due_s=0.004)).kind == LLM
    assert arb.choose(0.0, LLMState(ready=False), VisionState(due_size=2, oldest_deadline=9.0)).kind == VISION
    turn = arb.choose(0.0, LLMState(ready=False), VisionState(due_size=0, next_due_s=0.004))
    assert (turn.kind, turn.wait_s) == (WAIT, 0.004)
    assert arb.choose(0.0, None, None) == type(turn)(WAIT, "nothing ready", None)


def test_a_vision_batch_goes_first_exactly_when_one_more_llm_step_would_make_it_late():
    arb = _arbiter(llm_s=0.05, vision_s_per_image=0.02)
    now = 10.0
    # Batch of 2 costs 40 ms. With 100 ms left, slack is 60 ms > one 50 ms LLM step: LLM first.
    assert arb.choose(now, READY, VisionState(2, oldest_deadline=now + 0.100)).kind == LLM
    # With 85 ms left, slack is 45 ms < 50 ms: running the LLM step first would miss it.
    turn = arb.choose(now, READY, VisionState(2, oldest_deadline=now + 0.085))
    assert (turn.kind, turn.reason) == (VISION, "vision deadline")
    # A costlier LLM step (a long prefill) makes the same batch urgent sooner.
    arb = _arbiter(llm_s=0.2)
    assert arb.choose(now, READY, VisionState(2, oldest_deadline=now + 0.2)).kind == VISION


def test_llm_steps_are_never_starved_beyond_the_configured_vision_share():
    arb = _arbiter(max_vision_share=0.25, share_window_s=1.0)
    now, kinds = 0.0, []
    urgent = VisionState(1, oldest_deadline=-1.0)  # always late: vision would take every turn
    for _ in range(400):
        turn = arb.choose(now, READY, urgent)
        cost = 0.02 if turn.kind == VISION else 0.05
        arb.record(turn.kind, now, now + cost, (1,) if turn.kind == VISION else (8, 0))
        kinds.append(turn.kind)
        now += cost
    vision_time = 0.02 * kinds.count(VISION)
    share = vision_time / now
    assert 0.2 <= share <= 0.27, share  # bounded by max_vision_share, and vision still runs
    assert arb.reasons["vision used its share"] > 0


def test_vision_without_deadlines_is_not_starved_by_a_busy_llm():
    arb = _arbiter()
    target = arb.config.vision_target_latency_ms / 1000
    arrival, now = 0.0, 0.0
    while True:  # the Runtime gives deadline-less requests arrival + target
        turn = arb.choose(now, READY, VisionState(1, oldest_deadline=arrival + target))
        if turn.kind == VISION:
            break
        arb.record(LLM, now, now + 0.05, (8, 0))
        now += 0.05
    assert now + 0.02 <= target  # it ran in time for the target
    assert now > 0  # but only after LLM steps used the slack


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_vision_share"):
        ArbiterConfig(max_vision_share=0)
    with pytest.raises(ValueError, match="share_window_s"):
        ArbiterConfig(share_window_s=-1)
    with pytest.raises(ValueError, match="vision_target_latency_ms"):
        ArbiterConfig(vision_target_latency_ms="fast")
