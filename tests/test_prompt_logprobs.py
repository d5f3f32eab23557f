"""Prompt logprobs against Hugging Face transformers: for each prompt token after the first, the
float32 log_softmax of the logits that predict it (and the top k), through chunked prefill, past
a prefix-cache hit (such a request computes its whole prompt), and for a prompt scored with
max_tokens=0 (lm-evaluation-harness's `echo` + `max_tokens: 0`)."""

from __future__ import annotations

import pytest
import torch

from runtime.llm.api import LLM
from runtime.llm.sampling_params import SamplingParams

TOL = 1e-4
CHUNK = 16  # max_num_batched_tokens: a prompt longer than this is prefilled in several steps
LONG = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden screw press. Within decades, print "
    "shops spread across Europe, books became cheaper, and literacy rose in cities and towns."
)


@pytest.fixture(scope="module")
def model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    llm = LLM(
        model=smollm2_dir,
        device="cpu",
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=CHUNK,
        num_kv_blocks=96,
    )
    return llm, hf


@torch.inference_mode()
def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is log_softmax of the logits at position i (predicting ids[i + 1])."""
    return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_against_hf(hf, out, k: int) -> None:
    ids = out.prompt_token_ids
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(ids)
    assert entries[0] is None  # nothing predicts the first token
    ref = hf_prompt_logprobs(hf, ids)
    for i in range(1, len(ids)):
        entry, row = entries[i], ref[i - 1]
        assert entry["token_id"] == ids[i]
        assert abs(entry["logprob"] - float(row[ids[i]])) < TOL, (i, entry["logprob"], float(row[ids[i]]))
        top = entry["top"]
        assert len(top) == k
        assert [t["logprob"] for t in top] == pytest.approx(row.topk(k).values.tolist(), abs=TOL)
        for t in top:  # each id carries HF's value for it (robust to the order of ties)
            assert abs(t["logprob"] - float(row[t["token_id"]])) < TOL


def test_prompt_logprobs_equal_hf_through_chunked_prefill(model):
    llm, hf = model
    prompts = ["The capital of France is", LONG]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3, ignore_eos=True))
    assert len(outs[1].prompt_token_ids) > 2 * CHUNK  # three chunks at least
    for out in outs:
        check_against_hf(hf, out, 3)
        assert len(out.token_ids) == 3


def test_asking_changes_no_tokens(model):
    llm, _ = model
    plain = llm.generate([LONG], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    asked = llm.generate([LONG], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0))[0]
    assert asked.token_ids == plain.token_ids
    assert plain.prompt_logprobs is None
    assert all(len(e["top"]) == 0 for e in asked.prompt_logprobs[1:])


def test_a_prefix_cache_hit_still_gives_every_prompt_logprob(model):
    """The request asking for them skips the cache (as vLLM does): it computes its whole prompt."""
    llm, hf = model
    engine = llm.engine
    prompt = "Prefix caching keeps the KV of full blocks: " + LONG
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # its blocks enter the cache
    hits = engine.runner.kv_pool.num_cache_hits
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    assert engine.runner.kv_pool.num_cache_hits > hits  # a plain request does hit it
    before = engine.num_computed_prompt_tokens
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    assert engine.num_computed_prompt_tokens - before == len(out.prompt_token_ids)
    check_against_hf(hf, out, 1)


def test_max_tokens_0_scores_the_prompt_without_generating(model):
    llm, hf = model
    before = llm.engine.num_computed_prompt_tokens
    outs = llm.generate(["Paris is in France.", LONG], SamplingParams(max_tokens=0, prompt_logprobs=1))
    for out in outs:
        assert out.finish_reason == "length"
        assert out.token_ids == [] and out.text == ""
        assert out.metrics.first_token_time is None
        n = len(out.prompt_token_ids)
        assert len(out.prompt_logprobs) == n  # None, then one entry per prompt token after the first
        assert sum(e is not None for e in out.prompt_logprobs) == n - 1
        check_against_hf(hf, out, 1)
    assert llm.engine.num_computed_prompt_tokens - before == sum(len(o.prompt_token_ids) for o in outs)
    assert llm.engine.runner.kv_pool.num_used_blocks == 0


def test_a_scored_prompt_beside_decoding_requests(model):
    """Mixed steps: decodes of others, and a scored prompt's chunks, in the same batch."""
    llm, hf = model
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=0, prompt_logprobs=2),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    ]
    outs = llm.generate(["Once upon a time", LONG, "def fibonacci(n):"], params)
    check_against_hf(hf, outs[1], 2)
    assert [len(o.token_ids) for o in outs] == [12, 0, 12]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-1, prompt_logprobs=1), "max_tokens"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt_logprobs=True), "prompt_logprobs"),
        (dict(max_tokens=0, prompt_logprobs=1, n=2), "n"),
    ],
)
def test_bad_fields_are_named(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**kwargs)


def test_a_scoring_request_preempted_while_prefilling_gives_the_same_logprobs(tiny_llama_dir):
    """A pool too small for both: the later request is preempted by recompute mid-prompt and
    prefills again; its entries equal an undisturbed run's."""
    ids = list(range(1000, 1120))  # 120 tokens, 8 blocks of 16
    kw = dict(model=tiny_llama_dir, device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4)
    alone = LLM(**kw, num_kv_blocks=64).generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    llm = LLM(**kw, num_kv_blocks=12, max_num_batched_tokens=16, enable_prefix_caching=False)
    first = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    outs = llm.generate([[7] * 100, ids], [first, SamplingParams(max_tokens=0, prompt_logprobs=2)])
    assert llm.engine.scheduler.stats().num_preemptions > 0
    got, want = outs[1].prompt_logprobs, alone.prompt_logprobs
    assert got[0] is None and len(got) == len(want) == len(ids)
    for a, b in zip(got[1:], want[1:]):
        assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < TOL
        assert [t["token_id"] for t in a["top"]] == [t["token_id"] for t in b["top"]]
    assert llm.engine.runner.kv_pool.num_used_blocks == 0
    llm.engine.runner.kv_pool.check_invariants()
