"""The start-up profile of LLM steps: what a step costs by its shape, for the Runtime's arbiter.

A few throw-away requests of random token ids run through the real engine: one warm-up
(first calls pick kernels and allocate), then a full batch of short prompts (one prefill
step of many requests, then decodes at max_num_seqs) and one long prompt (a prefill that
fills the step budget, then decodes at batch 1). That spans the shapes a step takes; the
arbiter's cost model then follows real steps as they come.
"""

from __future__ import annotations

import random
import time

from runtime.llm.sampling_params import SamplingParams


def profile_steps(engine, seed: int = 0) -> list[tuple[tuple[int, int], float]]:
    """[((requests, tokens), seconds)] of the profiled steps (warm-up left out)."""
    rng = random.Random(seed)
    config = engine.scheduler.config
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    def run(prompt_lens: list[int], tag: str) -> list[tuple[tuple[int, int], float]]:
        for k, n in enumerate(prompt_lens):
            ids = [rng.randrange(engine.vocab_size) for _ in range(n)]
            engine.add_request(ids, params, request_id=f"tandem-profile-{tag}-{k}")
        samples = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            samples.append((engine.last_step_shape, time.perf_counter() - t0))
        return samples

    longest = max(1, min(config.max_num_batched_tokens, engine.max_model_len - params.max_tokens - 1))
    short = max(1, min(16, config.max_num_batched_tokens // config.max_num_seqs))
    run([8], "warmup")
    return run([short] * config.max_num_seqs, "batch") + run([longest], "long")


def step_vs_floor(
    engine, num_seqs: int = 16, context_len: int = 128, repeats: int = 20, seed: int = 0, profile_steps: int = 0
) -> dict:
    """A decode step at `num_seqs` running sequences of about `context_len` tokens, beside its
    floor: the model's linear layers alone, run one after another on `num_seqs` rows of
    random input with the same weights (the matmuls a decode step cannot avoid; everything
    else, attention, norms, RoPE, sampling, scheduling, is overhead over it). Medians of
    `repeats` runs, in milliseconds. The engine must be idle; it is idle again afterwards.

    With `profile_steps` > 0, that many more steps run under torch's profiler, and "ops" lists
    where a step's time goes: each op's own (self) CPU time per step, largest first, and
    "outside ops" for the step's time that no op accounts for (Python, the scheduler, waits).
    The profiler adds its own cost per op, so read these as shares, not as step times."""
    import statistics

    import torch

    from runtime.llm.model import PackedLinear

    if engine.has_unfinished():
        raise RuntimeError("step_vs_floor needs an idle engine")
    rng = random.Random(seed)
    # Long enough that no request finishes while the last ones prefill or the steps are timed.
    params = SamplingParams(max_tokens=engine.max_model_len - context_len - 1, temperature=0, ignore_eos=True)
    ids = [f"tandem-floor-{k}" for k in range(num_seqs)]
    for rid in ids:
        engine.add_request([rng.randrange(engine.vocab_size) for _ in range(context_len)], params, request_id=rid)
    try:
        while engine.last_step_shape != (num_seqs, num_seqs):  # prefills done: every request decodes
            engine.step()
        for _ in range(2):
            engine.step()
        steps = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
            if engine.last_step_shape != (num_seqs, num_seqs):
                raise RuntimeError(f"a timed step ran {engine.last_step_shape} (requests, tokens), not pure decode")
        ops = _profile_ops(engine, profile_steps) if profile_steps > 0 else None
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()

    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    inputs = {
        m.in_features: torch.randn(num_seqs, m.in_features, dtype=model.dtype, device=engine.runner.device)
        for m in linears
    }
    with torch.inference_mode():

        def run_linears() -> None:
            for m in linears:
                m(inputs[m.in_features])

        for _ in range(3):
            run_linears()
        floors = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_linears()
            if engine.runner.device.type == "cuda":
                torch.cuda.synchronize()
            floors.append(time.perf_counter() - t0)
    step_ms = statistics.median(steps) * 1e3
    floor_ms = statistics.median(floors) * 1e3
    return {
        "num_seqs": num_seqs,
        "context_len": context_len,
        "step_ms": step_ms,
        "linear_floor_ms": floor_ms,
        "ratio": step_ms / floor_ms,
        "num_linear_layers": len(linears),
        **({"ops": ops} if ops is not None else {}),
    }


def _profile_ops(engine, steps: int) -> list[tuple[str, float]]:
    """[(op, self ms per step)] over `steps` decode steps under torch's profiler, largest
    first, the time outside every op last ("outside ops")."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    per_op = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    ops = sorted(((k, ms) for k, ms in per_op.items() if ms > 0), key=lambda kv: -kv[1])
    return ops + [("outside ops", max(0.0, wall_ms - sum(per_op.values())))]
