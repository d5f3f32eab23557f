"""The engine and the vLLM-style API on the tiny model: bad input, streaming, stop strings,
seeded sampling, metrics, abort."""

from __future__ import annotations

import pytest

from runtime import LLM, SamplingParams
from runtime.llm.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, device="cpu", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(stop=[1, 2]), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_input_leaves_requests_in_flight_untouched(llm):
    engine = llm.engine
    good = engine.add_request("Once upon a time", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()  # the good request is running
    with pytest.raises(ValueError, match="prompt must be a non-empty"):
        llm.generate([""], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.generate(["word " * 400], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, "):
        llm.generate([[1, 2, 10**9]])
    with pytest.raises(ValueError, match="sampling_params must be one SamplingParams or one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()])
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    assert done[good].finish_reason == "length" and len(done[good].token_ids) == 6
    # the same prompt alone gives the same tokens: nothing above disturbed it
    again = llm.generate(["Once upon a time"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert again.token_ids == done[good].token_ids


def test_unknown_model_path_is_refused_without_download():
    with pytest.raises(ValueError, match="never downloads"):
        LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")


def test_outputs_in_order_with_metrics(llm):
    prompts = ["one", "two two", "three three three"]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5, 4)])
    assert [o.prompt for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == [3, 5, 4]
    for o in outs:
        m = o.metrics
        assert m.time_to_first_token is not None and m.time_to_first_token >= 0
        assert len(m.token_times) == len(o.token_ids) and len(m.inter_token_latencies) == len(o.token_ids) - 1
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert o.outputs[0].token_ids == o.token_ids


def test_seeded_sampling_is_the_same_whatever_shares_the_batch(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate(["The weather today"], p)[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=0.8, seed=None, ignore_eos=True) for n in (5, 9, 20)]
    batch = llm.generate(["Hello", "The weather today", "Numbers:", "x"], [others[0], p, others[1], others[2]])
    assert batch[1].token_ids == alone
    different = llm.generate(
        ["The weather today"], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert different[0].token_ids != alone  # the seed matters


def test_streaming_deltas_add_up_to_the_final_text(llm):
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = list(llm.stream("Hello there", p))
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert outs[-1].text == llm.generate(["Hello there"], p)[0].text


def test_stop_string_ends_generation_and_is_not_returned(llm):
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = llm.generate(["Count"], p)[0]
    assert len(full.text) > 6
    stop = full.text[4:7]  # a piece the greedy continuation is known to contain
    cut = llm.generate(["Count"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    streamed = list(llm.stream("Count", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])))
    assert "".join(o.delta_text for o in streamed) == cut.text


def test_stop_token_ids_and_eos(llm):
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    base = llm.generate(["abc"], p)[0].token_ids
    stopped = llm.generate(
        ["abc"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[base[2]])
    )[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == base[: base.index(base[2]) + 1]


def test_abort_frees_the_request(llm):
    engine = llm.engine
    rid = engine.add_request("abort me", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.abort(rid) and not engine.abort(rid)
    engine.step()
    assert engine.memory.stats()["kv_blocks"]["used"] == 0 and not engine.has_unfinished()


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3, temperature=0))[0]
    assert "<|im_start|>user\nHi<|im_end|>" in out.prompt
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        llm.chat([{"content": "no role"}])


class _ByteTokenizer:
    """Each token is one UTF-8 byte: decoding a partial character gives U+FFFD."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_detokenizer_never_emits_half_a_character():
    text = "naïve 中文 🙂 done"
    data = list(text.encode())
    detok = IncrementalDetokenizer(_ByteTokenizer(), [ord("x")], stop=[])
    pieces = []
    for b in data:
        detok.add([b])
        pieces.append(detok.take_delta(False))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_incremental_detokenizer_holds_back_a_possible_stop_string():
    detok = IncrementalDetokenizer(_ByteTokenizer(), [ord("x")], stop=["END"])
    streamed = []
    for ch in "abc EN":
        detok.add([ord(ch)])
        streamed.append(detok.take_delta(False))
    assert "".join(streamed) == "abc "  # "EN" might begin "END": held back
    detok.add([ord("D")])
    assert detok.stop_at == 4 and detok.take_delta(True) == "" and detok.visible_text() == "abc "


def test_stop_strings_are_ignored_until_min_tokens_exist():
    detok = IncrementalDetokenizer(_ByteTokenizer(), [ord("x")], stop=["ab"], min_tokens=4)
    for ch in "ab":  # a stop string within the first min_tokens outputs: not a stop
        detok.add([ord(ch)])
    assert detok.stop_at is None
    for ch in "cdab":
        detok.add([ord(ch)])
    assert detok.stop_at == 4 and detok.visible_text() == "abcd"


def test_the_final_text_keeps_a_trailing_incomplete_character_as_a_full_decode_does():
    data = list("fin 中".encode())[:-1]  # the last character cut in the middle
    detok = IncrementalDetokenizer(_ByteTokenizer(), [ord("x")], stop=[])
    streamed = []
    for b in data:
        detok.add([b])
        streamed.append(detok.take_delta(False))
    assert "".join(streamed) == "fin "  # held back while it might still complete
    detok.finish()
    streamed.append(detok.take_delta(True))
    assert detok.visible_text() == bytes(data).decode("utf-8", errors="replace") == "".join(streamed)


def test_min_tokens_outlasts_a_stop_string_end_to_end(llm):
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = llm.generate(["Count"], p)[0]
    stop = full.text[1:3]  # appears within the first few tokens
    early = llm.generate(["Count"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))[0]
    late = llm.generate(
        ["Count"],
        SamplingParams(max_tokens=30, min_tokens=len(early.token_ids) + 3, temperature=0, ignore_eos=True, stop=[stop]),
    )[0]
    assert len(late.token_ids) >= len(early.token_ids) + 3  # the early stop string did not end it
    assert late.token_ids[: len(early.token_ids)] == early.token_ids


def test_streamed_and_unstreamed_requests_get_the_same_text(llm):
    p = SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)
    plain = llm.generate(["Hello there"], p)[0]
    streamed = list(llm.stream("Hello there", p))
    assert plain.text == streamed[-1].text == "".join(o.delta_text for o in streamed)
    assert sum((o.delta_token_ids for o in streamed), []) == plain.token_ids
