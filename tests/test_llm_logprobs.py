"""Logprobs against Hugging Face transformers: each generated token's logprob and its top-k
alternatives are float32 log_softmax of the raw logits (before penalties and temperature, as
vLLM reports them), and asking for them changes nobody's tokens."""

from __future__ import annotations

import pytest
import torch

from runtime.llm.api import LLM
from runtime.llm.sampling_params import SamplingParams

TOL = 1e-4
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module", params=["tiny_llama_dir", "smollm2_dir"])
def model(request):
    d = request.getfixturevalue(request.param)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = LLM(model=d, device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4)
    return llm, hf


@torch.inference_mode()
def hf_logprobs(hf, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """[len(out_ids), vocab]: row j is log_softmax of the logits that predicted out_ids[j]."""
    logits = hf(torch.tensor([prompt_ids + out_ids])).logits[0].float()
    return logits[len(prompt_ids) - 1 : -1].log_softmax(-1)


def check_against_hf(hf, out, k: int) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    ref = hf_logprobs(hf, out.prompt_token_ids, out.token_ids)
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[j]
        assert entry["token_id"] == tok
        assert abs(entry["logprob"] - float(row[tok])) < TOL, (j, entry["logprob"], float(row[tok]))
        top = entry["top"]
        assert len(top) == k
        want = row.topk(k)
        # Values in order, and each reported id carries the value HF gives it (robust to the order of ties).
        assert [t["logprob"] for t in top] == pytest.approx(want.values.tolist(), abs=TOL)
        for t in top:
            assert abs(t["logprob"] - float(row[t["token_id"]])) < TOL


def test_greedy_logprobs_equal_hf(model):
    llm, hf = model
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=5, ignore_eos=True)
    for out in llm.generate(PROMPTS, params):
        check_against_hf(hf, out, 5)
        for entry in out.logprobs:  # greedy: the sampled token is the most likely one
            assert entry["top"][0]["token_id"] == entry["token_id"]


def test_logprobs_come_from_the_raw_logits_not_the_penalized_and_tempered_ones(model):
    llm, hf = model
    params = SamplingParams(
        max_tokens=6, temperature=0.7, seed=3, repetition_penalty=1.5, presence_penalty=1.0, logprobs=2, ignore_eos=True
    )
    (out,) = llm.generate(PROMPTS[:1], params)
    check_against_hf(hf, out, 2)


def test_token_text_and_bytes(model):
    llm, _ = model
    tok = llm.tokenizer
    (out,) = llm.generate(["Café au lait, 日本語:"], SamplingParams(max_tokens=8, temperature=0, logprobs=1))
    for entry in out.logprobs:
        for e in [entry, *entry["top"]]:
            assert e["token"] == tok.convert_tokens_to_string([tok.convert_ids_to_tokens(e["token_id"])])
    # The bytes of a byte-level BPE's tokens join into the text, even across a split character.
    ids = [e["token_id"] for e in out.logprobs]
    if not set(ids) & set(tok.all_special_ids):
        joined = b"".join(bytes(e["bytes"]) for e in out.logprobs)
        assert joined.decode("utf-8", errors="replace") == tok.decode(ids)


def test_logprobs_zero_gives_the_sampled_token_only(model):
    llm, hf = model
    (out,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, temperature=0, logprobs=0, ignore_eos=True))
    check_against_hf(hf, out, 0)


def test_only_the_asking_request_gets_logprobs_and_tokens_do_not_change(model):
    llm, _ = model
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,", "Hello"]
    base = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=5, ignore_eos=True),
    ]
    without = llm.generate(prompts, base)
    asking = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3),
        *base[1:],
    ]
    mixed = llm.generate(prompts, asking)
    assert [o.token_ids for o in mixed] == [o.token_ids for o in without]
    assert mixed[0].logprobs is not None and len(mixed[0].logprobs) == 6
    for o in mixed[1:]:
        assert o.logprobs is None and o.delta_logprobs is None
        assert o.outputs[0].logprobs is None


def test_streamed_delta_logprobs_add_up_to_the_final_list(model):
    llm, _ = model
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    streamed, final = [], None
    for out in llm.stream(PROMPTS[0], params):
        assert len(out.delta_logprobs) == len(out.delta_token_ids)
        streamed += out.delta_logprobs
        final = out
    assert final.finished and streamed == final.logprobs and len(streamed) == 6
    assert [e["token_id"] for e in streamed] == final.token_ids
