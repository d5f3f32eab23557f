"""Repetition, presence and frequency penalties: validated in SamplingParams, applied in the
sampler from statistics kept on the device, and equal to Hugging Face transformers'
repetition penalty (greedy, float32) on the tiny Llama."""

from __future__ import annotations

import pytest
import torch
from llm_oracle import compare

from runtime import LLM, SamplingParams
from runtime.llm.sampler import PenaltyState, Sampler, SamplingBatch

PROMPTS = ["The quick brown fox jumps over the lazy dog. Then", "def fibonacci(n):\n", "Once upon a time"]
NUM_TOKENS = 24


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("repetition_penalty", 0, "repetition_penalty must be a number > 0"),
        ("repetition_penalty", -1.2, "repetition_penalty must be a number > 0"),
        ("repetition_penalty", float("nan"), "repetition_penalty must be a number > 0"),
        ("presence_penalty", 2.5, "presence_penalty must be a number in [-2, 2]"),
        ("frequency_penalty", -3, "frequency_penalty must be a number in [-2, 2]"),
        ("frequency_penalty", True, "frequency_penalty must be a number in [-2, 2]"),
    ],
)
def test_bad_penalties_name_the_field_and_range(field, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})


def test_defaults_are_off():
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties


def test_sampler_applies_each_penalty_to_its_tokens_only():
    # vocab of 6: the prompt holds token 1; the output so far is 2, 3, 3.
    state = PenaltyState(vocab_size=6)
    sampler = Sampler(6)
    sampler.penalties = state
    state.add("r", [1, 2, 3, 3], num_prompt_tokens=1, repetition=2.0, presence=0.5, frequency=0.25)
    logits = torch.tensor([[1.0, 4.0, -2.0, 3.0, 0.0, 3.9]])
    penalized = state.apply(logits, state.slots(["r"]))
    expected = torch.tensor([[1.0, 4.0 / 2, -2.0 * 2 - 0.5 - 0.25, 3.0 / 2 - 0.5 - 0.5, 0.0, 3.9]])
    torch.testing.assert_close(penalized, expected)
    batch = SamplingBatch(temperatures=[0.0], top_k=[0], top_p=[1.0], seeds=[None], penalized=[(0, "r")])
    assert sampler(logits, batch).tolist() == [5]  # without penalties: token 1
    # The sampled token now counts: once in the output, so presence and frequency apply to it.
    assert state.counts[state.slots(["r"])[0], 5] == 1 and bool(state.seen[state.slots(["r"])[0], 5])


def test_rows_are_reused_and_grow_without_mixing_requests():
    state = PenaltyState(vocab_size=4)
    for i in range(9):  # more than the first allocation: the tensors grow, rows keep their data
        state.add(f"r{i}", [i % 4], num_prompt_tokens=1, repetition=1.5, presence=0.0, frequency=0.0)
    assert (
        len(state) == 9 and bool(state.seen[state.slots(["r0"])[0], 0]) and bool(state.seen[state.slots(["r3"])[0], 3])
    )
    state.remove("r0")
    state.add("new", [2], num_prompt_tokens=1, repetition=1.5, presence=0.0, frequency=0.0)
    row = state.seen[state.slots(["new"])[0]]
    assert row.tolist() == [False, False, True, False]  # the reused row forgot r0's token


class _PresenceFrequency:
    """The reference: vLLM's definition, one Python loop per token, over the output only."""

    def __init__(self, num_prompt_tokens: int, presence: float, frequency: float) -> None:
        self.n, self.presence, self.frequency = num_prompt_tokens, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        counts: dict[int, int] = {}
        for t in input_ids[0, self.n :].tolist():
            counts[t] = counts.get(t, 0) + 1
        for t, c in counts.items():
            scores[0, t] -= self.presence + self.frequency * c
        return scores


@torch.inference_mode()
def _oracle(model, ids: list[int], processor) -> tuple[list[int], list[torch.Tensor]]:
    seq = torch.tensor([ids])
    tokens, all_logits = [], []
    for _ in range(NUM_TOKENS):
        scores = processor(seq, model(seq).logits[:, -1].float())
        all_logits.append(scores[0])
        t = int(scores[0].argmax())
        tokens.append(t)
        seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
    return tokens, all_logits


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cpu", max_model_len=256, max_num_seqs=4)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return llm, hf


def _check(llm, hf, params, make_processor):
    plain_params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    # Each prompt ends with its own greedy continuation, which the model would go on repeating:
    # the penalty on prompt tokens then decides what comes next.
    prompts = [ids + out.token_ids for ids, out in zip(prompts, llm.generate(prompts, plain_params))]
    outs = llm.generate(prompts, params)  # one batch: rows with and without history side by side
    plain = llm.generate(prompts, plain_params)
    assert any(o.token_ids != p.token_ids for o, p in zip(outs, plain)), "the penalty changed nothing: a weak test"
    for ids, out in zip(prompts, outs):
        expected, logits = _oracle(hf, ids, make_processor(len(ids)))
        assert compare(out.token_ids, expected, logits) is None, compare(out.token_ids, expected, logits)


def test_repetition_penalty_matches_transformers(tiny):
    from transformers import RepetitionPenaltyLogitsProcessor

    llm, hf = tiny
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    _check(llm, hf, params, lambda n: RepetitionPenaltyLogitsProcessor(1.3))


def test_presence_and_frequency_penalties_match_the_reference(tiny):
    llm, hf = tiny
    params = SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.3
    )
    _check(llm, hf, params, lambda n: _PresenceFrequency(n, 0.4, 0.3))


def test_finished_requests_give_their_rows_back(tiny):
    llm, _ = tiny
    runner = llm.engine.runner
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.8, seed=1, repetition_penalty=1.2))
    # The runner hears of finished requests with the next plan: run one more request.
    llm.generate("Hello", SamplingParams(max_tokens=2))
    assert len(runner.sampler.penalties) == sum(st.penalized for st in runner.requests.values()) == 0
