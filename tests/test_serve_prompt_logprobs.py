"""Prompt logprobs through `tandem serve` (issue 28, item 5): lm-evaluation-harness's scoring
request (`echo`, `logprobs: 1`, `max_tokens: 0`) gets one logprob per prompt token after the
first, equal to the engine's RequestOutput.prompt_logprobs and to Hugging Face's log-softmax in
float32; echo with a completion puts the prompt's tokens first; vLLM's `prompt_logprobs` extra
on completions and chat. An embedded server in this process (TestClient over an EmbeddedBackend
on the tiny Llama: no process to start), and the session's shared worker for the job path (its
events: the prompt event before any token)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from runtime.llm.sampling_params import SamplingParams

PROMPT = "The capital of France is Paris, and the capital of Italy is"
LM_EVAL = {"echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}  # local-completions' scoring body


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """(TestClient, Runtime): `tandem serve --embedded` on the tiny Llama, in this process."""
    from runtime.runtime import Runtime
    from server.app import create_app
    from server.embedded import EmbeddedBackend

    rt = Runtime(llm={"model": tiny_llama_dir, "dtype": "float32", "max_num_seqs": 4}, profile=False)
    with TestClient(create_app(EmbeddedBackend(rt, "tiny"))) as client:  # closes the Runtime at its end
        yield client, rt


def _post(client, path: str, **body) -> dict:
    resp = client.post(path, json={"model": "tiny", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _engine_prompt_logprobs(rt, prompt: str, k: int) -> tuple[list[int], list]:
    """RequestOutput.prompt_logprobs of `prompt`, straight from the Runtime."""
    out = rt.submit_generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=k)).result(60)
    return out.prompt_token_ids, out.prompt_logprobs


def test_an_lm_eval_scoring_request_gets_one_logprob_per_prompt_token_equal_to_the_engines_and_hfs(
    served, tiny_llama_dir
):
    import torch
    from transformers import AutoModelForCausalLM

    client, rt = served
    out = _post(client, "/v1/completions", prompt=PROMPT, **LM_EVAL)
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    ids, engine = _engine_prompt_logprobs(rt, PROMPT, 1)
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first
    assert lp["tokens"][1:] == [e["token"] for e in engine[1:]]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert lp["token_logprobs"][1:] == [e["logprob"] for e in engine[1:]]  # the engine's, as they are
    # What local-completions reads: each token's logprob, and whether it was the top one.
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[token] == value and 1 <= len(top) <= 2
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    oracle = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], oracle)) < 1e-4


def test_an_lm_eval_request_with_token_ids_scores_them_as_the_text_prompt(served):
    """lm-evaluation-harness's local-completions sends token ids by default (tokenized_requests):
    echo then gives the tokens' text, and the scores are those of the same prompt sent as text."""
    client, rt = served
    ids, _ = _engine_prompt_logprobs(rt, PROMPT, 1)
    by_text = _post(client, "/v1/completions", prompt=PROMPT, **LM_EVAL)["choices"][0]
    by_ids = _post(client, "/v1/completions", prompt=ids, **LM_EVAL)["choices"][0]
    assert by_ids["logprobs"] == by_text["logprobs"]
    assert by_ids["text"] == "".join(by_text["logprobs"]["tokens"])
    # Without logprobs there is no token text to echo (the server holds no tokenizer).
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": ids, "echo": True, "max_tokens": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo"


def test_echo_with_a_completion_puts_the_prompts_tokens_first(served):
    client, _ = served
    args = dict(prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    plain = _post(client, "/v1/completions", **args)["choices"][0]
    echoed = _post(client, "/v1/completions", echo=True, **args)["choices"][0]
    scored = _post(client, "/v1/completions", prompt=PROMPT, **{**LM_EVAL, "logprobs": 2})["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    lp, tail, head = echoed["logprobs"], plain["logprobs"], scored["logprobs"]
    num = len(head["tokens"])
    assert lp["tokens"] == head["tokens"] + tail["tokens"]
    assert lp["token_logprobs"] == head["token_logprobs"] + tail["token_logprobs"]
    assert lp["top_logprobs"][:num] == head["top_logprobs"] and all(len(t) <= 3 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    streamed = client.post("/v1/completions", json={"model": "tiny", "stream": True, "echo": True, **args}).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    parts = [c["choices"][0] for c in chunks if c["choices"]]
    assert parts[0]["text"] == PROMPT and parts[0]["logprobs"]["token_logprobs"] == head["token_logprobs"]
    assert "".join(p["text"] for p in parts) == echoed["text"]
    assert [o for p in parts if p["logprobs"] for o in p["logprobs"]["text_offset"]] == lp["text_offset"]


def test_vllms_prompt_logprobs_extra_on_completions_and_chat(served):
    client, rt = served
    out = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=2, prompt_logprobs=3)
    got = out["choices"][0]["prompt_logprobs"]
    ids, engine = _engine_prompt_logprobs(rt, PROMPT, 3)
    assert got[0] is None and len(got) == len(ids)
    for step, entry, token_id in zip(got[1:], engine[1:], ids[1:]):
        assert str(token_id) in step and step[str(token_id)]["logprob"] == entry["logprob"]
        # The prompt's token (ranked where it is among the top 3, else null) and the top 3.
        assert sorted(v["rank"] for v in step.values() if v["rank"] is not None) == [1, 2, 3]
        assert all(isinstance(v["decoded_token"], str) for v in step.values())
    assert "prompt_logprobs" not in _post(client, "/v1/completions", prompt=PROMPT, max_tokens=1)["choices"][0]
    chat = _post(
        client, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, prompt_logprobs=0
    )
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(step) == 1 for step in chat["prompt_logprobs"][1:])  # k=0: the prompt's token alone
    for body, param in (
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),  # scoring needs echo or prompt_logprobs
        ({"max_tokens": 0, "echo": True, "logprobs": 1, "n": 2}, "n"),  # a score has one choice
    ):
        resp = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_over_a_worker_the_scores_are_the_embedded_servers_and_the_prompt_event_comes_first(shared_fleet, served):
    """On the session's shared worker (the same tiny Llama, float32); its job found by the new id."""
    client, _ = served
    fleet = shared_fleet.ready()
    want = _post(client, "/v1/completions", prompt=PROMPT, **LM_EVAL)["choices"][0]["logprobs"]
    r = redis.Redis.from_url(fleet.redis.url, decode_responses=True)
    before = set(r.scan_iter("tandem:job:*"))
    body = {"model": fleet.model, "prompt": PROMPT, **LM_EVAL, "max_tokens": 2}
    resp = httpx.post(fleet.server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    got = resp.json()["choices"][0]["logprobs"]
    num = len(want["tokens"])
    assert got["tokens"][:num] == want["tokens"] and got["token_logprobs"][0] is None
    assert all(
        math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got["token_logprobs"][1:num], want["token_logprobs"][1:])
    )
    (key,) = set(r.scan_iter("tandem:job:*")) - before
    kinds = [f["type"] for _, f in r.xrange("tandem:events:" + key.rsplit(":", 1)[1])]
    assert kinds == ["prompt", *["token"] * (len(kinds) - 2), "done"] and len(kinds) >= 3, kinds
