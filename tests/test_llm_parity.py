"""End-to-end parity with Hugging Face transformers, float32 greedy, under every scheduling
regime: (a) continuous batching with many requests, (b) chunked prefill forced by a small
token budget, (c) preemption forced by a tiny KV pool, (d) prefix-cache hits on a shared
system prompt, (e) the static scheduler. On a tiny random Llama and on SmolLM2 itself."""

from __future__ import annotations

import pytest
from llm_oracle import Oracle, compare

from runtime import LLM, SamplingParams

LONG_TEXT = " ".join(
    f"Paragraph {i}: the river town kept its records in a ledger that every keeper copied by hand, "
    f"adding the weather, the price of grain and the names of the boats that passed."
    for i in range(12)
)
SYSTEM = (
    "You are a careful assistant for a railway museum. Answer in one or two sentences, "
    "mention dates when you know them, and say so plainly when you do not know."
)
CHAT_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "How many legs does a spider have?"]
PLAIN = [
    "The quick brown fox jumps over the lazy dog. Then",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "La capitale de l'Allemagne est",
    "中国的首都是",
    LONG_TEXT + "\nSummary:",
]


def _prompts(llm: LLM, shared_system: bool) -> list[list[int]]:
    tok = llm.tokenizer
    chats = []
    for q in CHAT_QUESTIONS:
        msgs = ([{"role": "system", "content": SYSTEM}] if shared_system else []) + [{"role": "user", "content": q}]
        chats.append(llm.apply_chat_template(msgs))
    texts = chats if shared_system else chats + PLAIN
    return [tok.encode(t, add_special_tokens=False) for t in texts]


SCENARIOS = {
    "a_continuous": dict(max_num_seqs=8, max_num_batched_tokens=1024),
    "b_chunked_prefill": dict(max_num_seqs=8, max_num_batched_tokens=32),
    "c_preemption": dict(max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=40),
    "d_prefix_cache": dict(max_num_seqs=2, max_num_batched_tokens=512),
    "e_static": dict(max_num_seqs=4, max_num_batched_tokens=1024, scheduler="static"),
}

_oracles: dict[str, Oracle] = {}


def run_parity(model_dir: str, scenario: str, max_tokens: int) -> LLM:
    kw = SCENARIOS[scenario]
    llm = LLM(model=model_dir, dtype="float32", device="cpu", max_model_len=1024, **kw)
    prompts = _prompts(llm, shared_system=scenario == "d_prefix_cache")
    oracle = _oracles.setdefault(model_dir, Oracle(model_dir))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    problems = []
    for i, (p, out) in enumerate(zip(prompts, outs)):
        assert out.prompt_token_ids == p
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
        expected, logits = oracle.greedy(p, max_tokens)
        msg = compare(out.token_ids, expected, logits)
        if msg:
            problems.append(f"prompt {i}: {msg}")
    assert not problems, "\n".join(problems)
    stats = llm.engine.memory.stats()["kv_blocks"]
    assert stats["used"] == 0, "KV blocks still held after every request finished"
    return llm


def _check_regime(llm: LLM, scenario: str) -> None:
    sched = llm.engine.scheduler
    if scenario == "c_preemption":
        assert sched.table.num_preemptions > 0, "the tiny pool did not force a preemption"
    if scenario == "d_prefix_cache":
        assert llm.engine.runner.kv_pool.num_cache_hits > 0, "no prefix-cache hit on the shared system prompt"
    if scenario == "e_static":
        assert sched.group_sizes and max(sched.group_sizes) <= 4


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_tiny_llama_matches_hugging_face(tiny_llama_dir, scenario):
    llm = run_parity(tiny_llama_dir, scenario, max_tokens=24)
    _check_regime(llm, scenario)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_smollm2_matches_hugging_face(smollm2_dir, scenario):
    llm = run_parity(smollm2_dir, scenario, max_tokens=16)
    _check_regime(llm, scenario)
