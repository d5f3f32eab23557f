"""Draftless speculative decoding (issue 29): the n-gram proposer, exact greedy tokens with
and without speculation under every scheduling regime, stop criteria met inside an accepted
run, the KV pool whole after rollbacks, and the sampled distribution kept by the rejection rule
(a statistical test of runtime/llm/spec_verify.py)."""

from __future__ import annotations

import math

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.llm.sampler import Sampler
from runtime.llm.spec_verify import accepted_tokens, verify_tensors
from schedulers.speculation import NgramProposer, SpeculativeConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

PASSAGE = (
    "The ledger of the river town recorded the weather, the price of grain and the names of the "
    "boats that passed each day. Every keeper copied it by hand into a new book each spring."
)


# ---- the proposer (no model) ----------------------------------------------------------------


def test_proposer_drafts_what_followed_the_latest_earlier_occurrence():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3))
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 6, 2, 3]
    # The suffix (2, 3) occurred at 1..2 (then 4, 5) and at 6..7 (then 7, 8): the latest wins.
    assert p.propose("r", tokens, 3) == [7, 8, 6]
    assert p.propose("r", tokens, 1) == [7]
    tokens += [7]  # (2, 3, 7) now matches its 3-gram at 6..8: followed by 8, 6, 2
    assert p.propose("r", tokens, 3) == [8, 6, 2]


def test_proposer_gives_nothing_without_a_match_and_stops_for_low_acceptance():
    cfg = SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=3, warmup_drafts=4, min_acceptance=0.5)
    p = NgramProposer(cfg)
    assert p.propose("a", list(range(50)), 4) == []  # never repeats: no draft
    tokens = [5, 6, 7, 5, 6]
    assert p.propose("b", tokens, 2) == [7, 5]
    p.record("b", drafted=4, accepted=1)  # 25% after the warm-up: it stops drafting
    assert p.propose("b", tokens, 2) == []
    p.forget("b")
    assert p.propose("b", tokens, 2) == [7, 5]


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative_config.model"):
        SpeculativeConfig.from_dict({"method": "ngram", "model": "draft"})
    with pytest.raises(ValueError, match="speculative_config.method"):
        SpeculativeConfig.from_dict({"method": "eagle"})
    assert SpeculativeConfig(max_batch_size=4).k_for(5) == 0


# ---- exact greedy tokens ---------------------------------------------------------------------

SCENARIOS = {
    "continuous": dict(max_num_seqs=8, max_num_batched_tokens=1024),
    "chunked_prefill": dict(max_num_seqs=8, max_num_batched_tokens=32),
    "preemption": dict(max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=12),
    "prefix_cache": dict(max_num_seqs=2, max_num_batched_tokens=512),
}


def _prompts(tok) -> list[list[int]]:
    texts = [
        "Copy this passage word for word.\n\n" + PASSAGE + "\n\n" + PASSAGE[:60],
        "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return",
        "Copy this passage word for word.\n\n" + PASSAGE + " " + PASSAGE,  # shares the first's prefix
        "The quick brown fox jumps over the lazy dog. Then",
    ]
    texts += [texts[0], texts[1]]  # again, with a stop string and with a grammar
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def _params() -> list[SamplingParams]:
    """Greedy requests, some that draft and some that may not (logprobs, penalties, stop
    strings, a grammar: they decode one token a step beside the others), all ignore_eos."""
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    return [
        plain,
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2),
        plain,
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=["the", "\n"]),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, structured_outputs={"regex": "[a-z ,.]{1,60}"}),
    ]


def _run(model: str, spec: dict | None, **kw):
    llm = LLM(model=model, dtype="float32", device="cpu", max_model_len=1024, speculative_config=spec, **kw)
    outs = llm.generate(_prompts(llm.tokenizer), _params(), use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_identical_with_and_without_speculation(tiny_llama_dir, scenario):
    kw = SCENARIOS[scenario]
    base_llm, base = _run(tiny_llama_dir, None, **kw)
    llm, spec = _run(tiny_llama_dir, SPEC, **kw)
    for i, (a, b) in enumerate(zip(base, spec)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, f"prompt {i} differs with speculation"
        assert b.outputs[0].logprobs == a.outputs[0].logprobs
    if scenario == "prefix_cache":
        # A prompt that is a first answer's prompt and output reads the blocks that answer's
        # speculative steps published: only accepted tokens' K/V may be in them.
        hits = llm.engine.runner.kv_pool.num_cache_hits
        follow = [base[0].prompt_token_ids + base[0].outputs[0].token_ids]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        a = base_llm.generate(follow, params, use_tqdm=False)[0].outputs[0].token_ids
        b = llm.generate(follow, params, use_tqdm=False)[0].outputs[0].token_ids
        assert b == a
        assert llm.engine.runner.kv_pool.num_cache_hits > hits
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0, f"no draft was accepted: the test proves nothing ({stats})"
    assert stats.num_draft_tokens > stats.num_accepted_tokens, "no draft was rejected: rollback untested"
    if scenario == "preemption":
        assert llm.engine.scheduler.table.num_preemptions > 0, "the tiny pool did not force a preemption"
    if scenario == "prefix_cache":
        assert llm.engine.runner.kv_pool.num_cache_hits > 0
    pool = llm.engine.runner.kv_pool
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks, "blocks leaked by rollbacks"


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_smollm2_greedy_tokens_identical_and_accepted(smollm2_dir, scenario):
    kw = SCENARIOS[scenario]
    _, base = _run(smollm2_dir, None, **kw)
    llm, spec = _run(smollm2_dir, SPEC, **kw)
    for i, (a, b) in enumerate(zip(base, spec)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, f"prompt {i} differs with speculation"
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    if scenario == "preemption":
        assert llm.engine.scheduler.table.num_preemptions > 0, "the tiny pool did not force a preemption"


def test_stop_criteria_inside_an_accepted_run(tiny_llama_dir):
    """max_tokens and a stop token id reached in the middle of a step's accepted drafts end the
    request exactly where decoding one token at a time ends it."""
    kw = dict(max_num_seqs=4, max_num_batched_tokens=512)
    base_llm = LLM(model=tiny_llama_dir, dtype="float32", device="cpu", max_model_len=1024, **kw)
    prompt = _prompts(base_llm.tokenizer)[2]
    free = base_llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    ids = free[0].outputs[0].token_ids
    stop_id = ids[17]  # a token the greedy text reaches; it ends there (or at its first occurrence)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 3, 7, 13)] + [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, min_tokens=20, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]),
    ]
    base = base_llm.generate([prompt] * len(params), params, use_tqdm=False)
    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cpu", max_model_len=1024, speculative_config=SPEC, **kw)
    spec = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for a, b in zip(base, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
    assert spec[-1].outputs[0].finish_reason == "stop" and spec[-1].outputs[0].token_ids[-1] == stop_id
    assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_a_request_can_opt_out(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cpu", max_model_len=1024, speculative_config=SPEC)
    prompt = _prompts(llm.tokenizer)[2]
    llm.generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, speculate=False), use_tqdm=False
    )
    assert llm.engine.scheduler.spec_stats.num_drafts == 0
    llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.spec_stats.num_drafts > 0
    with pytest.raises(ValueError, match="speculate"):
        SamplingParams(speculate="no")
    from server import protocol

    gen = protocol.parse_completion({"prompt": "hi", "max_tokens": 4, "speculate": False})
    assert gen.job["speculate"] is False


# ---- the sampled distribution ------------------------------------------------------------------


class _State:
    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, 0.0


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[bool, float]:
    """Pearson's chi-square against `probs` (cells with expectation >= 5), at p = 1e-4."""
    expected = probs * n
    keep = expected >= 5
    stat = float((((counts - expected) ** 2) / expected.clamp(min=1e-9))[keep].sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty: the chi-square quantile at 1 - 1e-4 (z = 3.719).
    limit = dof * (1 - 2 / (9 * dof) + 3.719 * math.sqrt(2 / (9 * dof))) ** 3
    leaked = float(counts[~keep & (probs == 0)].sum())
    return stat < limit and leaked == 0, stat


@pytest.mark.parametrize("top_k", [0, 4])
def test_rejection_rule_keeps_the_sampled_distribution(top_k):
    """Each position of a verified run follows the model's distribution, whatever the draft:
    the first token is drawn n times with a likely draft and with an unlikely one, and the
    second token (after an accepted first draft) is checked too."""
    torch.manual_seed(0)
    vocab, n, temp = 8, 40_000, 0.8
    logits = torch.randn(2, vocab) * 1.5
    sampler = Sampler(vocab)
    ref = sampler.probabilities(logits, [temp, temp], [top_k] * 2, [1.0] * 2, [0.0] * 2)
    ref = ref / ref.sum(-1, keepdim=True)
    for draft0 in (int(ref[0].argmax()), int(ref[0].argmin())):
        draft1 = int(ref[1].argmax())
        # n requests with drafts [draft0, draft1]: rows 0, 1 and the bonus row (as row 1).
        rows = torch.stack([logits[0].expand(n, vocab), logits[1].expand(n, vocab), logits[1].expand(n, vocab)], 1)
        drafts = [[draft0, draft1]] * n
        states = [_State(temp, top_k)] * n
        accept, token = verify_tensors(sampler, rows.reshape(-1, vocab), states, drafts)
        out = accepted_tokens(accept.tolist(), token.tolist(), drafts)
        first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=vocab).float()
        ok, stat = _chi2_ok(first, ref[0], n)
        assert ok, f"first token off its distribution (draft {draft0}): chi2 {stat:.1f}, {first / n} vs {ref[0]}"
        second = [o[1] for o in out if len(o) > 1]  # runs whose first draft was accepted
        if ref[0, draft0] == 0:  # a draft outside top-k is never accepted
            assert not second
            continue
        counts = torch.bincount(torch.tensor(second), minlength=vocab).float()
        ok, stat = _chi2_ok(counts, ref[1], len(second))
        assert ok, f"second token off its distribution: chi2 {stat:.1f}"


def test_greedy_verification_accepts_the_argmax_prefix():
    logits = torch.full((3, 5), -1.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = 3.0
    sampler = Sampler(5)
    accept, token = verify_tensors(sampler, logits, [_State(0.0)], [[2, 3]])
    assert accepted_tokens(accept.tolist(), token.tolist(), [[2, 3]]) == [[2, 4]]  # 2 kept, 3 -> argmax 4
    accept, token = verify_tensors(sampler, logits, [_State(0.0)], [[2, 4]])
    assert accepted_tokens(accept.tolist(), token.tolist(), [[2, 4]]) == [[2, 4, 1]]  # both, then the bonus
