"""min_p, include_stop_str_in_output, stop_reason, the greedy epsilon, the field bounds,
structured_outputs checked (its shape here; compiled by the engine), and the context limits (contract D) at prepare time."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.llm.api import LLM
from runtime.llm.detokenizer import PromptBound
from runtime.llm.sampler import Sampler, SamplingBatch
from runtime.llm.sampling_params import SamplingParams

MAX_LEN = 128


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, device="cpu", dtype="float32", max_model_len=MAX_LEN, max_num_seqs=4)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=True), "logprobs"),
        (dict(logprobs=1.5), "logprobs"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p="0.1"), "min_p"),
        (dict(stop=["x"] * 65), "stop"),
        (dict(stop=["x" * 513]), "stop"),
        (dict(stop_token_ids=list(range(65))), "stop_token_ids"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=None, min_tokens=-1), "min_tokens"),
        (dict(structured_outputs={"json": [1]}), "structured_outputs.json"),
        (dict(structured_outputs={"choice": ["a", ""]}), "structured_outputs.choice"),
        (dict(structured_outputs={"grammar": 3}), "structured_outputs.grammar"),
        (dict(structured_outputs={"bogus": 1}), "structured_outputs"),
        (dict(structured_outputs={}), "structured_outputs"),
        (dict(structured_outputs="json"), "structured_outputs"),
    ],
)
def test_bad_fields_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert str(exc.value).startswith(field), str(exc.value)


def test_structured_outputs_of_every_kind_are_accepted_as_given():
    specs = [
        {"json": {"type": "object"}},
        {"json": '{"type": "object"}'},
        {"json_object": True},
        {"regex": "a+"},
        {"choice": ["a", "b"]},
        {"grammar": 'root ::= "x"'},
    ]
    for spec in specs:
        assert SamplingParams(structured_outputs=spec).structured_outputs is spec  # not rewritten
    assert SamplingParams(structured_outputs=None).structured_outputs is None


def test_structured_outputs_are_compiled_at_prepare(llm):
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex could not be compiled"):
        llm.engine.prepare([1, 2, 3], SamplingParams(structured_outputs={"regex": "a["}))
    prepared = llm.engine.prepare([1, 2, 3], SamplingParams(structured_outputs={"regex": "a+"}))
    assert prepared.grammar is not None and prepared.grammar.num_tokens == 0


def test_bounds_at_the_limit_are_accepted():
    SamplingParams(stop=["x" * 512] * 64, stop_token_ids=list(range(64)), logprobs=20, min_p=1.0, max_tokens=None)


# ---- min_p in the sampler ---------------------------------------------------------------------


def draw(logits: list[float], n: int, **kw) -> set[int]:
    rows = torch.tensor([logits] * n, dtype=torch.float32)
    batch = SamplingBatch(
        temperatures=[kw.get("temperature", 1.0)] * n,
        top_k=[kw.get("top_k", 0)] * n,
        top_p=[kw.get("top_p", 1.0)] * n,
        seeds=[None] * n,
        min_p=[kw.get("min_p", 0.0)] * n,
    )
    return set(Sampler(len(logits))(rows, batch).tolist())


def test_min_p_applies_after_temperature():
    # probs at T=1: .705 .259 .035; min_p 0.3 keeps tokens 0 and 1. At T=0.5: .867 .117 .002;
    # min_p 0.3 (threshold .26) keeps token 0 alone. Applied before temperature, it would keep two.
    logits = [0.0, -1.0, -3.0]
    assert draw(logits, 4000) == {0, 1, 2}
    assert draw(logits, 4000, min_p=0.3) == {0, 1}
    assert draw(logits, 4000, min_p=0.3, temperature=0.5) == {0}


def test_top_p_sees_the_mass_left_by_min_p():
    # probs .5 .3 .2; min_p 0.5 keeps .5 and .3, renormalised .625 .375: top_p 0.6 then keeps the
    # first alone (over the raw mass, .5 < .6, it would keep two).
    logits = torch.tensor([0.5, 0.3, 0.2]).log().tolist()
    assert draw(logits, 4000, min_p=0.5) == {0, 1}
    assert draw(logits, 4000, min_p=0.5, top_p=0.6) == {0}


def test_a_seeded_row_does_not_depend_on_its_neighbours_min_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 500, generator=g)
    s = Sampler(500)
    got = []
    for neighbour in (0.0, 0.2):
        batch = SamplingBatch([1.0, 1.0], [0, 0], [1.0, 1.0], [1234, None], min_p=[0.0, neighbour])
        got.append(s(logits, batch)[0].item())
    assert got[0] == got[1]


def test_min_p_one_is_greedy_end_to_end(llm):
    greedy = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    mp = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=1.0, min_p=1.0, ignore_eos=True))
    assert mp[0].token_ids == greedy.token_ids


@pytest.mark.parametrize("temperature", [1e-320, 1e-6, 9.9e-6])
def test_temperatures_below_the_epsilon_are_greedy(llm, temperature):
    want = llm.generate(["The sky is"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    got = llm.generate(["The sky is"], SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True))[0]
    assert SamplingParams(temperature=temperature).greedy
    assert got.token_ids == want.token_ids and got.text == want.text and got.text


# ---- stop strings and stop_reason ---------------------------------------------------------------


def _free_run(llm, prompt: str):
    return llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]


def test_include_stop_str_in_output_keeps_the_stop_string(llm):
    free = _free_run(llm, "Once upon a time")
    stop = free.text[8:11]
    assert len(stop) == 3
    end = free.text.index(stop) + len(stop)
    for include, want in ((True, free.text[:end]), (False, free.text[: end - len(stop)])):
        params = SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=include
        )
        (out,) = llm.generate(["Once upon a time"], params)
        assert (out.text, out.finish_reason, out.stop_reason) == (want, "stop", stop)
        assert out.outputs[0].stop_reason == stop
        streamed = "".join(o.delta_text for o in llm.stream("Once upon a time", params))
        assert streamed == want


def test_stop_reason_of_a_stop_token_eos_and_length(llm):
    free = _free_run(llm, "The sky is")
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    (out,) = llm.generate(["The sky is"], params)
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", stop_id, free.token_ids[: first + 1])
    assert free.finish_reason == "length" and free.stop_reason is None
    # An EOS id that the caller also lists as a stop token ends it as EOS: stop_reason None (vLLM's order).
    eos = next(iter(llm.engine.eos_token_ids))
    (out,) = llm.generate([[eos, eos]], SamplingParams(max_tokens=4, min_tokens=0, logprobs=None))
    if out.token_ids[-1] == eos:
        assert out.finish_reason == "stop" and out.stop_reason is None


# ---- contract D: the context ----------------------------------------------------------------------


def test_max_tokens_past_the_context_is_refused_naming_it(llm):
    ids = [5] * 100
    with pytest.raises(ValueError, match=r"^max_tokens must be at most 28 \(max_model_len 128 minus the prompt's 100"):
        llm.generate([ids], SamplingParams(max_tokens=29))
    (out,) = llm.generate([ids], SamplingParams(max_tokens=28, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 28 and out.finish_reason == "length"


def test_max_tokens_none_takes_what_the_context_leaves(llm):
    (out,) = llm.generate([[5] * 100], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == MAX_LEN - 100 and out.finish_reason == "length"
    with pytest.raises(ValueError, match=r"^min_tokens must be at most 28"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=None, min_tokens=29))


def test_a_prompt_whose_bytes_prove_it_too_long_is_refused_before_tokenizing(llm, monkeypatch):
    engine = llm.engine
    calls = []
    real = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    huge = "hello " * 100_000
    with pytest.raises(ValueError, match=r"^prompt is too long: .* max_model_len is 128"):
        engine.prepare(huge, SamplingParams())
    assert calls == []
    # Under the bound, the tokenizer decides (and the token count refuses it).
    with pytest.raises(ValueError, match="max_model_len is 128"):
        engine.prepare("hello " * 200, SamplingParams())
    assert calls == [1]


def test_the_prompt_bound_never_exceeds_the_real_token_count(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    bound = PromptBound.of(tok)
    assert bound is not None
    rng = random.Random(0)
    pieces = ["-", " ", "\n", "\x04", "\x06\x13", "é", "日本", "🙂", "<|im_start|>", "word", "=" * 80, "\U00040000"]
    for _ in range(300):
        s = "".join(rng.choice(pieces) * rng.randint(1, 200) for _ in range(rng.randint(1, 8)))
        assert bound.min_tokens(s) <= len(tok.encode(s, add_special_tokens=False)), repr(s[:80])
