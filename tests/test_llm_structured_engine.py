"""Structured outputs through the engine (runtime/llm/engine.py, runner.py, sampler.py) on the
real SmolLM2 in float32: constrained and free-text requests share continuous-batching steps
(chunked prefills, requests joining as others finish), every constrained output parses and
follows its spec, the free-text requests' greedy tokens are those of a run without the
constrained ones, bad specs are refused at submit naming the field, a preempted constrained
request still ends valid, and a token the grammar refuses ends its request with an error."""

from __future__ import annotations

import json
import re

import pytest

from runtime.llm import sampler as sampler_module
from runtime.llm.api import LLM
from runtime.llm.sampling_params import SamplingParams
from tests.test_structured import CITIES, COLOR, PERSON, validate

DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["positive", "negative", "neutral"]
FREE = [
    ("Tell me a short story about a dragon.", 24),
    ("What is the capital of France?", 20),
]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    # 4 sequences and a 64-token budget: 8 requests cannot all run at once, so constrained rows
    # join and leave mid-run, and the ~40-token chat prompts are prefilled in chunks (only the
    # last one samples, and only it takes a grammar row).
    return LLM(
        model=smollm2_dir,
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=512,
    )


def chat(llm: LLM, text: str) -> str:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def run(llm: LLM, requests: list[tuple[str, SamplingParams]]) -> tuple[dict, int]:
    """Queue every request, then step until all finish: (id -> output, most requests in a step)."""
    engine = llm.engine
    ids = [engine.add_request(chat(llm, prompt), params) for prompt, params in requests]
    done, busiest = {}, 0
    while len(done) < len(ids):
        for out in engine.step():
            done[out.request_id] = out
        busiest = max(busiest, engine.last_step_shape[0])
    return [done[rid] for rid in ids], busiest


def free_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def test_constrained_and_free_requests_share_steps(llm):
    constrained = [
        ("Describe a fictional person as JSON with a name and an age.", {"json": PERSON}, 0.0, 5),
        ("List two large cities with their populations as JSON.", {"json": CITIES}, 0.0, None),
        ("Pick a color for the sky, as JSON.", {"json": COLOR}, 0.7, None),
        ('Reply with a JSON object such as {"animal": "cat", "legs": 4}.', {"json_object": True}, 0.0, None),
        ("When did Apollo 11 land on the moon?", {"regex": DATE}, 0.7, None),
        ("Sentiment of 'I love this movie!'?", {"choice": CHOICES}, 0.0, None),
    ]
    requests = [
        (prompt, SamplingParams(max_tokens=100, temperature=t, seed=7, structured_outputs=so, logprobs=lp))
        for prompt, so, t, lp in constrained
    ]
    # Free-text requests between the constrained ones, so they share steps with them.
    requests.insert(1, (FREE[0][0], free_params(FREE[0][1])))
    requests.insert(4, (FREE[1][0], free_params(FREE[1][1])))
    outs, busiest = run(llm, requests)
    assert busiest == 4  # several requests in flight at once

    free_outs = [outs.pop(4), outs.pop(1)][::-1]
    for out, (_, so, _, _) in zip(outs, constrained):
        assert out.error is None, out.error
        assert out.finish_reason == "stop" and out.stop_reason is None, (so, out.finish_reason, out.text)
        kind, spec = next(iter(so.items()))
        if kind == "json":
            validate(json.loads(out.text), spec)
        elif kind == "json_object":
            assert isinstance(json.loads(out.text), dict), out.text
        elif kind == "regex":
            assert re.fullmatch(DATE, out.text), out.text
        else:
            assert out.text in CHOICES, out.text

    # Logprobs stay those of the raw logits: at the first token, where the schema allows only an
    # opening brace, the model's own top alternatives include tokens the mask removed, each with
    # a finite logprob (masked logits would give them -inf).
    first = outs[0].logprobs[0]
    assert len(outs[0].logprobs) == len(outs[0].token_ids)
    assert first["token"].startswith("{")
    others = [e for e in first["top"] if not e["token"].lstrip().startswith("{")]
    assert others and all(e["logprob"] > -1e9 for e in others), first["top"]

    # The free-text requests' greedy tokens do not depend on the grammar rows beside them.
    alone, _ = run(llm, [(prompt, free_params(n)) for prompt, n in FREE])
    for mixed, single in zip(free_outs, alone):
        assert mixed.error is None and mixed.token_ids
        assert (mixed.token_ids, mixed.finish_reason) == (single.token_ids, single.finish_reason)


def test_a_spec_the_grammar_engine_refuses_is_a_valueerror_at_submit(llm):
    engine = llm.engine
    running = engine.add_request(chat(llm, FREE[1][0]), free_params(6))
    engine.step()  # in flight when the bad requests arrive
    for spec, field in [
        ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json could not be compiled"),
        ({"regex": "[a-z"}, "structured_outputs.regex could not be compiled"),
        ({"grammar": "start: missing_rule"}, "structured_outputs.grammar could not be compiled"),
    ]:
        with pytest.raises(ValueError) as exc:
            engine.add_request(chat(llm, "Anything."), SamplingParams(max_tokens=8, structured_outputs=spec))
        assert str(exc.value).startswith(field), str(exc.value)
    out = None
    while out is None:
        out = next((o for o in engine.step() if o.request_id == running), None)
    assert out.error is None and out.token_ids
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"json": 3}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"json_object": False}, "structured_outputs.json_object"),
        ({"json": {}, "regex": "a"}, "structured_outputs"),
        ({"xml": "a"}, "structured_outputs"),
    ],
)
def test_a_malformed_spec_is_refused_by_sampling_params(spec, field):
    with pytest.raises(ValueError) as exc:
        SamplingParams(structured_outputs=spec)
    assert str(exc.value).startswith(field), str(exc.value)


def test_a_preempted_constrained_request_still_ends_valid(smollm2_dir):
    # 12 blocks of 16 tokens for three ~40-token prompts that each grow past 100 tokens: the pool
    # runs dry and the scheduler preempts by recompute, the latest arrival first: the third
    # request, constrained. Re-admitted, it re-prefills its outputs and keeps its matcher, which
    # is already past them.
    llm = LLM(
        model=smollm2_dir,
        device="cpu",
        dtype="float32",
        max_num_seqs=3,
        max_model_len=512,
        num_kv_blocks=12,
        enable_prefix_caching=False,
    )
    prompt = "List three large cities with their populations as JSON."
    schema = {**CITIES, "minItems": 3}
    params = SamplingParams(max_tokens=80, temperature=0, structured_outputs={"json": schema})
    outs, _ = run(llm, [(prompt, params), (FREE[0][0], free_params(60)), (prompt, params)])
    assert llm.engine.scheduler.stats().num_preemptions > 0
    for out in (outs[0], outs[2]):
        assert out.error is None and out.finish_reason == "stop", (out.finish_reason, out.text)
        validate(json.loads(out.text), schema)
    assert outs[0].token_ids == outs[2].token_ids  # greedy, preempted or not
    assert outs[1].finish_reason == "length"


def test_a_token_the_grammar_refuses_ends_that_request_with_an_error(llm, monkeypatch):
    # Without the mask the model answers the sentiment prompt freely; its first token is not a
    # prefix of one of the choices, the matcher refuses it and the request ends with the error.
    monkeypatch.setattr(sampler_module, "apply_token_bitmask", lambda logits, mask, rows: logits)
    spec = {"choice": ["zzz-first", "zzz-second"]}
    outs, _ = run(
        llm,
        [
            ("Sentiment of 'I love this movie!'?", SamplingParams(max_tokens=8, structured_outputs=spec)),
            (FREE[1][0], free_params(5)),
        ],
    )
    bad, free = outs
    assert bad.finish_reason == "abort" and bad.error_code == "engine_error"
    assert bad.error.startswith("structured_outputs: the grammar does not allow the sampled token"), bad.error
    assert free.error is None and free.token_ids
    assert not llm.engine.runner.grammars  # finished requests leave no matcher behind


def test_a_choice_the_tokenizer_cannot_spell_is_refused_at_submit_naming_it(tiny_llama_dir):
    """SmolLM2's byte-level vocabulary has no token for byte 0x04, nor for 0xf2 (which leads the
    UTF-8 of U+80000 and above): a choice holding one could never be written, and the grammar
    failed mid-generation (a 500, found by the fuzz test with an astral character)."""
    from runtime import LLM, SamplingParams

    llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_seqs=2)
    bad = SamplingParams(max_tokens=4, structured_outputs={"choice": ["fine", "no\u0004way"]})
    with pytest.raises(ValueError, match=r"^structured_outputs\.choice\[1\] holds byte\(s\) \['0x4'\]"):
        llm.generate(["Pick one:"], bad, use_tqdm=False)
    astral = SamplingParams(max_tokens=4, structured_outputs={"choice": ["\U0008d5d2"]})
    with pytest.raises(ValueError, match=r"^structured_outputs\.choice\[0\] holds byte\(s\) \['0xf2'\]"):
        llm.generate(["Pick one:"], astral, use_tqdm=False)
    good = SamplingParams(max_tokens=8, temperature=0, structured_outputs={"choice": ["fine", "ok"]})
    assert llm.generate(["Pick one:"], good, use_tqdm=False)[0].text in ("fine", "ok")
