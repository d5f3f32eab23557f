"""One request's bad data never takes down the others (issue 18's first probe finding).

The reproduction: three greedy generations of 48 tokens are in flight, then a fourth asks for
`stop_token_ids: [1000000]` (or 2**70) with `min_tokens: 2`. It used to reach the sampler, whose
[rows, vocab] suppression index failed the whole step: all four requests ended with "the engine
step failed: IndexError". Now there are two defences, each tested here:

- the field is checked against the model's vocabulary when the request is submitted, on the
  caller's thread (`LLMEngine.prepare`), so the Runtime, the worker and the server answer with
  an error naming `stop_token_ids` (tests/test_serve.py and tests/test_workers_celery.py cover
  those two over real processes);
- data that gets past that check anyway fails its own request when the runner admits it, and
  the step goes on for the others, who finish with exactly the tokens they had without it.

float32 and greedy: "the tokens they would have had" is compared bit for bit.
"""

from __future__ import annotations

import pytest

from runtime import RequestError, Runtime, SamplingParams
from runtime.llm.engine import EngineConfig, LLMEngine

SAFETY_S = 120
VICTIMS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
LONG = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
BAD_IDS = [1_000_000, 2**70]


def _config(model: str) -> EngineConfig:
    return EngineConfig(
        model=model, device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256
    )


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    eng = LLMEngine(_config(tiny_llama_dir))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    """Each victim's tokens when nothing bad shares its batch."""
    rids = {engine.add_request(p, LONG): p for p in VICTIMS}
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[rids[out.request_id]] = out.token_ids
    assert all(len(ids) == 48 for ids in outs.values())
    return outs


def _start_victims(engine: LLMEngine, steps: int = 3) -> dict[str, str]:
    rids = {engine.add_request(p, LONG): p for p in VICTIMS}
    for _ in range(steps):  # in flight: prefilled, decoding
        assert not engine.step()
    return rids


def _run_out(engine: LLMEngine) -> dict[str, object]:
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    return outs


@pytest.mark.parametrize("bad", [*BAD_IDS, "vocab"])
def test_an_out_of_vocabulary_stop_token_id_is_refused_on_submit_naming_the_field(engine, reference, bad):
    bad = engine.vocab_size if bad == "vocab" else bad  # the first id past the vocabulary
    rids = _start_victims(engine)
    with pytest.raises(ValueError, match=r"stop_token_ids .*\[0, 49152\)") as info:
        engine.add_request("x", SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[bad]))
    assert str(bad) in str(info.value)
    outs = _run_out(engine)
    assert {rids[r]: o.token_ids for r, o in outs.items()} == reference
    assert all(o.error is None and o.finish_reason == "length" for o in outs.values())


def test_bad_data_past_the_submit_check_fails_only_its_own_request(engine, reference):
    """As if a check were missing: the request's data is made bad after `prepare` checked it."""
    failed_steps = engine.num_failed_steps
    rids = _start_victims(engine)
    prepared = engine.prepare("x", SamplingParams(max_tokens=4, min_tokens=2))
    prepared.params.stop_token_ids.append(1_000_000)
    bad = engine.add_prepared(prepared)
    outs = _run_out(engine)
    out = outs.pop(bad)
    assert out.finish_reason == "abort" and out.error_code == "invalid_request" and out.token_ids == []
    assert "stop_token_ids" in out.error and "1000000" in out.error and bad in out.error
    assert {rids[r]: o.token_ids for r, o in outs.items()} == reference  # the same tokens as without it
    assert all(o.error is None for o in outs.values())
    assert engine.num_failed_steps == failed_steps  # no step failed: the others never noticed
    pool = engine.runner.kv_pool
    assert pool.num_free_blocks == pool.num_blocks  # the refused request's blocks came back too
    assert bad not in engine.runner.requests


def test_through_the_runtime_the_caller_gets_the_error_and_the_others_their_tokens(tiny_llama_dir, reference):
    with Runtime(llm=_config(tiny_llama_dir), profile=False) as rt:
        handles = [rt.submit_generate(p, LONG) for p in VICTIMS]
        first = [next(iter(h)) for h in handles]  # each has streamed a token: in flight
        assert all(o.token_ids for o in first)
        for bad in BAD_IDS:
            with pytest.raises(ValueError, match="stop_token_ids"):
                rt.submit_generate("x", SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[bad]))
        results = [h.result(timeout=SAFETY_S) for h in handles]
        assert [r.token_ids for r in results] == [reference[p] for p in VICTIMS]
        # and it goes on serving
        assert rt.submit_generate("y", SamplingParams(max_tokens=2, temperature=0)).result(timeout=SAFETY_S).token_ids


def test_a_runtime_request_refused_by_the_runner_raises_for_its_caller_alone(tiny_llama_dir, reference, monkeypatch):
    with Runtime(llm=_config(tiny_llama_dir), profile=False) as rt:
        real_prepare = rt.llm.prepare

        def unchecked_prepare(*args, **kwargs):  # the bad id slips past the submit check
            p = real_prepare(*args, **kwargs)
            if p.prompt == "x":
                p.params.stop_token_ids.append(1_000_000)
            return p

        monkeypatch.setattr(rt.llm, "prepare", unchecked_prepare)
        handles = [rt.submit_generate(p, LONG) for p in VICTIMS]
        assert all(next(iter(h)).token_ids for h in handles)
        bad = rt.submit_generate("x", SamplingParams(max_tokens=4, min_tokens=2))
        with pytest.raises(RequestError, match="stop_token_ids"):
            bad.result(timeout=SAFETY_S)
        assert [h.result(timeout=SAFETY_S).token_ids for h in handles] == [reference[p] for p in VICTIMS]
