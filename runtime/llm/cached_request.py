"""What the model runner keeps of each running request (vLLM's CachedRequestState): the token
ids and block table it was sent once, and its sampling fields in the flat form the sampler
reads; and how a step's sampled rows become one SamplingBatch.

The runner makes a state when a request joins a step (again after a preemption) and drops it
when the plan frees the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.llm.sampler import SamplingBatch, row_seed
from runtime.llm.structured import GrammarMatcher


@dataclass(slots=True)
class CachedRequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_prompt_tokens: int  # a resumed request's earlier outputs are not prompt here
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    min_tokens: int
    stop_ids: list[int]  # suppressed while fewer than min_tokens outputs exist
    penalized: bool = False  # has a row in sampler.penalties
    min_p: float = 0.0
    num_logprobs: int | None = None  # None: no logprobs
    grammar: GrammarMatcher | None = None  # structured outputs: the request's matcher (the engine's)
    # Prompt logprobs still to give (k alternatives); None once its prompt is computed, or never asked.
    num_prompt_logprobs: int | None = None


def sampling_batch(states: list[CachedRequestState], request_ids: list[str]) -> SamplingBatch:
    """The sampler's per-row parameters for the rows of `states`, in order."""
    suppress: list[tuple[int, list[int]]] = []
    seeds: list[int | None] = []
    logprobs: list[tuple[int, int]] = []
    for row, st in enumerate(states):
        num_out = len(st.token_ids) - st.num_prompt_tokens
        if num_out < st.min_tokens and st.stop_ids:
            suppress.append((row, st.stop_ids))
        seeds.append(row_seed(st.seed, num_out) if st.seed is not None else None)
        if st.num_logprobs is not None:
            logprobs.append((row, st.num_logprobs))
    min_p = [st.min_p for st in states]
    return SamplingBatch(
        temperatures=[st.temperature for st in states],
        top_k=[st.top_k for st in states],
        top_p=[st.top_p for st in states],
        seeds=seeds,
        suppress=suppress,
        penalized=[(row, rid) for row, (rid, st) in enumerate(zip(request_ids, states)) if st.penalized],
        min_p=min_p if any(min_p) else None,
        logprobs=logprobs,
    )
