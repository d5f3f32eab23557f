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
