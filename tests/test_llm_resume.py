"""Resumed requests (LLMEngine.prepare's num_resumed_outputs): a request whose prompt ends with
the first k outputs of an earlier, interrupted run of it (the worker that ran it died) gives
exactly the rest of the uninterrupted run: penalties count the k tokens as outputs, the seeded
random stream goes on at output k, the grammar of a structured output replays them, and a stop
string spanning the resume point is found. Outputs hold only what is new, so the earlier
stream followed by this one is the whole run."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from runtime import LLM, SamplingParams
from runtime.llm.sampler import resumed_seed
from tests.test_structured import PERSON, validate


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, device="cpu", max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256)


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return LLM(model=smollm2_dir, device="cpu", dtype="float32", max_num_seqs=2, max_model_len=512)


def run(llm: LLM, prompt, params: SamplingParams, num_resumed_outputs: int = 0):
    """One request alone, streamed: (final output, [(output tokens so far, streamed text so far)])."""
    seen, text = [], ""
    out = None
    for out in llm.engine.stream(prompt, params, num_resumed_outputs=num_resumed_outputs):
        text += out.delta_text
        seen.append((len(out.token_ids), text))
    assert text == out.text  # the stream adds up to the final text
    return out, seen


def streamed_after(seen, k: int) -> str:
    """What a stream had emitted once its first k tokens were out (what a dead worker left)."""
    return next(text for n, text in seen if n == k)


# Sampled, seeded, with penalties strong enough to change the tiny model's choices.
PENALIZED = SamplingParams(
    max_tokens=24,
    min_tokens=20,
    temperature=1.0,
    top_k=2,
    seed=1234,
    presence_penalty=2.0,
    frequency_penalty=1.0,
    logprobs=2,
)


def test_seeded_penalized_run_resumes_exactly(tiny):
    prompt = tiny.engine.tokenize("Once upon a time")[1]
    full, _ = run(tiny, prompt, PENALIZED)
    assert len(full.token_ids) >= 21
    for k in (1, 7, 15):
        out, _ = run(tiny, prompt + full.token_ids[:k], PENALIZED, num_resumed_outputs=k)
        assert out.token_ids == full.token_ids[k:], k
        assert out.finish_reason == full.finish_reason
        assert [e["token_id"] for e in out.logprobs] == out.token_ids
        assert [e["logprob"] for e in out.logprobs] == pytest.approx(
            [e["logprob"] for e in full.logprobs[k:]], abs=1e-4
        )
    # The old way (earlier outputs as plain prompt, counts and seed shifted by the caller)
    # loses the outputs' presence/frequency counts: with these penalties it goes elsewhere.
    legacy = []
    for k in (3, 7, 12):
        old = replace(PENALIZED, max_tokens=24 - k, min_tokens=20 - k, seed=resumed_seed(PENALIZED.seed, k))
        legacy.append(run(tiny, prompt + full.token_ids[:k], old)[0].token_ids == full.token_ids[k:])
    assert not all(legacy)
    # ... and the penalties do steer this run (else the test above would prove nothing).
    plain, _ = run(tiny, prompt, replace(PENALIZED, presence_penalty=0.0, frequency_penalty=0.0))
    assert plain.token_ids != full.token_ids


def test_min_tokens_count_the_resumed_outputs(tiny):
    """min_tokens holds back stop tokens until the outputs, the earlier ones included, reach it."""
    prompt = tiny.engine.tokenize("The weather today")[1]
    base = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    greedy, _ = run(tiny, prompt, base)
    stopper = greedy.token_ids[3]  # greedy's 4th token, made a stop token held back to output 6
    params = replace(base, stop_token_ids=[stopper], min_tokens=6)
    full, _ = run(tiny, prompt, params)
    assert stopper not in full.token_ids[:6] and full.token_ids != greedy.token_ids  # it was held back
    for k in (2, 5):
        out, _ = run(tiny, prompt + full.token_ids[:k], params, num_resumed_outputs=k)
        assert out.token_ids == full.token_ids[k:] and out.finish_reason == full.finish_reason, k


def test_stop_string_spanning_the_resume_point(tiny):
    engine = tiny.engine
    prompt = engine.tokenize("In a small village")[1]
    # Seeded sampling (greedy on the random tiny model repeats one word), which resumes exactly.
    plain = SamplingParams(max_tokens=40, temperature=1.0, seed=99, ignore_eos=True)
    free, _ = run(tiny, prompt, plain)
    tok = engine.tokenizer
    # A stop string made of the end of the text of the first k tokens and the start of token k's.
    stop = k = None
    for k in range(6, 30):
        before, after = tok.decode(free.token_ids[:k]), tok.decode(free.token_ids[: k + 1])
        grown = after[len(before) :]
        if after.startswith(before) and len(before) >= 3 and len(grown.strip()) >= 2:
            candidate = before[-3:] + grown[:2]
            if free.text.find(candidate) == len(before) - 3:
                stop = candidate
                break
    assert stop is not None, free.text
    params = replace(plain, stop=[stop])
    full, seen = run(tiny, prompt, params)
    assert full.finish_reason == "stop" and full.stop_reason == stop
    assert full.token_ids == free.token_ids[: k + 1]
    # The worker died with k tokens out and the text its stream had emitted (the stop string's
    # possible start held back); the resumed run finds the stop string across the boundary.
    shown = streamed_after(seen, k)
    assert len(shown) < len(tok.decode(free.token_ids[:k]))  # something was held back
    out, _ = run(tiny, prompt + free.token_ids[:k], params, num_resumed_outputs=k)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[k:]
    assert shown + out.text == full.text


def test_already_complete_requests_finish_at_once(tiny):
    engine = tiny.engine
    prompt = engine.tokenize("Hello there")[1]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    full, _ = run(tiny, prompt, params)
    steps = engine.num_steps
    out, _ = run(tiny, prompt + full.token_ids, params, num_resumed_outputs=6)
    assert (out.finish_reason, out.token_ids, out.text) == ("length", [], "")
    last = full.token_ids[-1]
    out, _ = run(tiny, prompt + full.token_ids, replace(params, max_tokens=10, stop_token_ids=[last]), 6)
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", last, [])
    assert engine.num_steps == steps  # neither took a step
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "n, params, field",
    [
        (-1, SamplingParams(max_tokens=4), "num_resumed_outputs must be an integer in"),
        (True, SamplingParams(max_tokens=4), "num_resumed_outputs must be an integer in"),
        (3, SamplingParams(max_tokens=4), "num_resumed_outputs must be an integer in"),  # the whole prompt
        (2, SamplingParams(max_tokens=1), "num_resumed_outputs must be at most max_tokens=1"),
    ],
)
def test_bad_num_resumed_outputs_names_the_field(tiny, n, params, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        tiny.engine.prepare([5, 6, 7], params, num_resumed_outputs=n)


def test_max_tokens_counts_the_original_prompt(tiny):
    """max_tokens is checked as on the first attempt: against the prompt without the outputs."""
    engine = tiny.engine
    prompt = list(range(100, 300))  # 200 tokens; 56 left in the context of 256
    p = engine.prepare(prompt, SamplingParams(max_tokens=56), num_resumed_outputs=50)
    assert p.max_tokens == 6 and p.done_reason is None
    with pytest.raises(ValueError, match="^max_tokens must be at most 106"):
        engine.prepare(prompt, SamplingParams(max_tokens=107), num_resumed_outputs=50)
    assert engine.prepare(prompt, SamplingParams(max_tokens=None), num_resumed_outputs=50).max_tokens == 56


JSON = SamplingParams(max_tokens=80, temperature=0, structured_outputs={"json": PERSON})


def test_structured_output_resumes_exactly(smol):
    prompt = smol.engine.tokenize(
        smol.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    )[1]
    full, seen = run(smol, prompt, JSON)
    assert full.finish_reason == "stop"
    validate(json.loads(full.text), PERSON)
    n = len(full.token_ids)
    assert n >= 6
    for k in (2, n // 2):
        out, _ = run(smol, prompt + full.token_ids[:k], JSON, num_resumed_outputs=k)
        assert out.token_ids == full.token_ids[k:], k
        assert out.finish_reason == "stop"
        assert streamed_after(seen, k) + out.text == full.text
    # Complete after the replay: the grammar is terminated, the request finishes at once.
    steps = smol.engine.num_steps
    out, _ = run(smol, prompt + full.token_ids, JSON, num_resumed_outputs=n)
    assert (out.finish_reason, out.token_ids, out.stop_reason) == ("stop", [], None)
    assert smol.engine.num_steps == steps
    # A resumed output the grammar refuses: the caller's ValueError, naming the field.
    bad = smol.engine.tokenize("hello")[1]
    with pytest.raises(ValueError, match="^num_resumed_outputs: the grammar"):
        smol.engine.prepare(prompt + bad, JSON, num_resumed_outputs=len(bad))
