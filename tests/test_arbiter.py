"""The Runtime's arbiter, driven with fake costs and a fake clock: no model, no torch."""

from __future__ import annotations

import pytest

from schedulers.arbiter import LLM, VISION, WAIT, Arbiter, ArbiterConfig, LinearCost, LLMState, Turn, VisionState


def _arbiter(llm_s: float = 0.05, vision_s_per_image: float = 0.02, lanes: int = 1, **config) -> Arbiter:
    """An arbiter whose cost models have learned exact fake costs (LLM steps on one lane)."""
    arb = Arbiter(ArbiterConfig(**config), lanes=lanes)
    for reqs, tokens in ((1, 1), (16, 16), (1, 256), (4, 64)):
        arb.llm_cost(1).observe((reqs, tokens), llm_s)
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


def test_the_llm_steps_when_it_has_work_and_the_loop_waits_otherwise():
    arb = _arbiter()
    assert arb.choose(0.0, READY, None) == Turn(LLM, "LLM step", lanes=1)
    assert arb.choose(0.0, READY, VisionState(due_size=0, next_due_s=0.004)).kind == LLM
    # No LLM work: vision serves itself, the loop only waits.
    assert arb.vision_lanes(llm_ready=False) == 1
    assert arb.choose(0.0, LLMState(ready=False), VisionState(2, oldest_deadline=9.0)).kind == WAIT
    assert arb.choose(0.0, None, None).kind == WAIT
    # One lane, held by vision: the LLM waits for it.
    assert arb.choose(0.0, READY, VisionState(0), busy_lanes=1) == Turn(WAIT, "vision holds the lane")


def test_on_several_lanes_vision_takes_any_lane_and_the_llm_steps_beside_it():
    arb = _arbiter(lanes=4)
    assert arb.vision_lanes(llm_ready=True) == arb.vision_lanes(llm_ready=False) == 4
    relaxed = VisionState(1, oldest_deadline=100.0)
    assert arb.choose(0.0, READY, relaxed, busy_lanes=4) == Turn(LLM, "LLM step", lanes=4)  # side by side
    assert arb.choose(0.0, READY, VisionState(0), busy_lanes=1) == Turn(LLM, "LLM step", lanes=4)
    # A backlog that would miss its deadline holds the next LLM step, so the vision workers
    # have the cores to themselves, within the vision share.
    urgent = VisionState(1, oldest_deadline=0.01)
    assert arb.choose(0.0, READY, urgent, busy_lanes=4).reason == "vision deadline"
    assert arb.choose(0.0, LLMState(ready=False), urgent, busy_lanes=4).kind == WAIT


def test_llm_cost_on_untried_lanes_is_scaled_from_the_nearest_known():
    arb = _arbiter(llm_s=0.06, lanes=4)
    assert arb.predict_llm(READY, 1) == pytest.approx(0.06)
    assert arb.predict_llm(READY, 2) == pytest.approx(0.03)  # pessimistic linear scaling
    arb.llm_cost(2).observe((8, 8), 0.045)
    assert arb.predict_llm(READY, 2) == pytest.approx(0.045)


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
    arb = _arbiter(max_vision_share=0.25, share_window_s=1.0)  # one lane: vision blocks the LLM
    now, kinds = 0.0, []
    urgent = VisionState(1, oldest_deadline=-1.0)  # always late: vision would take every turn
    for _ in range(400):
        turn = arb.choose(now, READY, urgent)
        cost = 0.02 if turn.kind == VISION else 0.05
        if turn.kind == VISION:
            arb.record(VISION, now, now + cost, (1,))
            arb.add_busy(VISION, now, now + cost)  # the Runtime counts the time the LLM waited
        else:
            arb.record(LLM, now, now + cost, (8, 8), lanes=turn.lanes)
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
        arb.record(LLM, now, now + 0.05, (8, 8), lanes=1)
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
    with pytest.raises(ValueError, match="lanes"):
        Arbiter(lanes=0)
