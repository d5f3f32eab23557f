"""n choices through `tandem serve` and the workers (issue 28, item 6): one job, whose engine
request forks the choices from one prefill. n=4 computes the prompt once (the
prompt_tokens_computed metric) and its choices equal four single requests seeded with
choice_seed(seed, k); best_of keeps the n of highest cumulative logprob; a stream names each
choice's chunks by index; over a worker it is one job in Redis, whose events name their choice;
a job of n=2 whose worker died resumes each choice from its own tokens, to the same answer.

An embedded server in this process (TestClient over an EmbeddedBackend on the tiny Llama) and,
for the job path, the session's shared worker; the resume runs generate_body in this process
over a redis-server of its own, on the same Runtime."""

from __future__ import annotations

import json

import pytest
import redis
from fastapi.testclient import TestClient
from test_jobs_support import JobHost, RedisServer

from runtime.llm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from runtime.llm.sampling_params import choice_seed

PROMPT = "In the morning the baker opened the shop and"
ARGS = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "seed": 17}


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """(TestClient, Runtime): `tandem serve --embedded` on the tiny Llama, in this process."""
    from runtime.runtime import Runtime
    from server.app import create_app
    from server.embedded import EmbeddedBackend

    rt = Runtime(llm={"model": tiny_llama_dir, "dtype": "float32", "max_num_seqs": 4}, profile=False)
    with TestClient(create_app(EmbeddedBackend(rt, "tiny"))) as client:  # closes the Runtime at its end
        yield client, rt


def _post(client, path: str = "/v1/completions", **body) -> dict:
    resp = client.post(path, json={"model": "tiny", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _computed(client) -> float:
    """tandem:prompt_tokens_computed_total, from /metrics (read when scraped: exact)."""
    text = client.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tandem:prompt_tokens_computed_total")
    )


def _singles(client, prompt: str, n: int, **args) -> list[dict]:
    """Choice k of an n-choice request, as a request of one with seed choice_seed(seed, k)."""
    seed = args.pop("seed")
    return [_post(client, prompt=prompt, seed=choice_seed(seed, k), **args)["choices"][0] for k in range(n)]


def test_n_4_computes_the_prompt_once_and_its_choices_are_four_seeded_single_requests(served):
    client, _ = served
    prompt = PROMPT + " counted the loaves of bread on the long wooden shelf by the door"
    before = _computed(client)
    out = _post(client, prompt=prompt, n=4, logprobs=0, **ARGS)
    num_prompt = out["usage"]["prompt_tokens"]
    assert _computed(client) - before == num_prompt  # one prefill, not four
    assert out["usage"]["completion_tokens"] == 4 * ARGS["max_tokens"]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    singles = _singles(client, prompt, 4, logprobs=0, **ARGS)
    assert [c["text"] for c in out["choices"]] == [c["text"] for c in singles]
    assert [c["logprobs"]["tokens"] for c in out["choices"]] == [c["logprobs"]["tokens"] for c in singles]
    assert len({c["text"] for c in out["choices"]}) == 4


def test_best_of_keeps_the_n_of_highest_cumulative_logprob(served):
    client, _ = served
    out = _post(client, prompt=PROMPT, n=2, best_of=4, **ARGS)
    singles = _singles(client, PROMPT, 4, logprobs=0, **ARGS)
    ranked = sorted(singles, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    assert [c["text"] for c in out["choices"]] == [c["text"] for c in ranked[:2]]
    assert out["usage"]["completion_tokens"] == 2 * ARGS["max_tokens"]  # the n returned, as vLLM counts
    assert out["choices"][0]["logprobs"] is None  # ranked on logprobs nobody asked to see


def test_a_stream_of_n_2_names_each_choices_chunks_and_ends_each_once(served):
    client, _ = served
    body = {"model": "tiny", "prompt": PROMPT, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    text = client.post("/v1/completions", json={**body, **ARGS}).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    by_index: dict[int, str] = {0: "", 1: ""}
    ends = []
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            ends.append(choice["index"])
    assert sorted(ends) == [0, 1] and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    singles = _singles(client, PROMPT, 2, **ARGS)
    assert [by_index[0], by_index[1]] == [c["text"] for c in singles]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": [tool], "n": 2}
    resp = client.post("/v1/chat/completions", json=chat)  # a tool answer is parsed from one choice
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", resp.text


def test_over_a_worker_n_4_is_one_job_whose_events_name_their_choices(shared_fleet):
    import httpx

    fleet = shared_fleet.ready()
    r = redis.Redis.from_url(fleet.redis.url, decode_responses=True)
    url = fleet.server.url + "/v1/completions"
    before = set(r.scan_iter("tandem:job:*"))
    resp = httpx.post(url, json={"model": fleet.model, "prompt": PROMPT, "n": 4, **ARGS}, timeout=60)
    assert resp.status_code == 200, resp.text
    (key,) = set(r.scan_iter("tandem:job:*")) - before  # one job for the four choices
    out = resp.json()
    job_id = key.rsplit(":", 1)[1]
    events = [f for _, f in r.xrange("tandem:events:" + job_id)]
    tokens = [e for e in events if e["type"] == "token"]
    assert sorted({int(e["choice"]) for e in tokens}) == [0, 1, 2, 3]
    assert sorted(int(e["choice"]) for e in events if e["type"] == "choice_end") == [0, 1, 2, 3]
    assert events[-1]["type"] == "done"
    result = json.loads(r.xrange("tandem:end:" + job_id)[0][1]["result"])
    assert result["usage"] == out["usage"] and out["usage"]["completion_tokens"] == 24
    assert result["usage"]["prompt_tokens"] == len(json.loads(r.hget(key, "prompt_token_ids")))  # counted once
    assert [c["text"] for c in result["choices"]] == [c["text"] for c in out["choices"]]
    seed = ARGS["seed"]
    for k, choice in enumerate(out["choices"]):
        body = {"model": fleet.model, "prompt": PROMPT, **ARGS, "seed": choice_seed(seed, k)}
        assert httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"] == choice["text"]


# ---- a job of n=2 resumed after its worker died ------------------------------------------------------


class _Died(Exception):
    """The first worker's end, mid-stream."""


class _DyingRuntime:
    """The Runtime, whose request is cut (cancelled, then _Died) after `after` outputs."""

    def __init__(self, rt, after: int) -> None:
        self.rt, self.after = rt, after

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def submit_generate(self, *args, **kwargs):
        handle = self.rt.submit_generate(*args, **kwargs)
        after = self.after

        class _Cut:
            def __iter__(self):
                for k, out in enumerate(handle):
                    if k == after:
                        handle.cancel()
                        raise _Died()
                    yield out

            def cancel(self):
                handle.cancel()

        return _Cut()


def test_a_job_of_n_2_resumes_each_choice_from_its_own_tokens_to_the_same_answer(served, tmp_path):
    from workers.host import ActiveJob
    from workers.jobs import generate_body, run_job
    from workers.settings import JobSettings
    from workers.store import JobStore

    _, rt = served
    kwargs = {"prompt": PROMPT, "n": 2, "logprobs": 1, **ARGS, "max_tokens": 8}
    server = RedisServer(tmp_path).start()
    store = JobStore(JobSettings(redis_url=server.url))
    try:
        first, second = JobHost(store, "w1", _DyingRuntime(rt, after=5)), JobHost(store, "w2", rt)
        for job_id in ("whole", "cut"):
            store.submit(job_id, "tandem.generate", "llm", kwargs, ttl_s=60, max_tokens=8)
        store.heartbeat("w2")
        whole = run_job(second, "tandem.generate", "whole", "llm", kwargs, generate_body)
        store.heartbeat("w1")
        claim = store.claim("cut", "w1", "t1", "tandem.generate", "llm", kwargs, ttl_s=60, max_tokens=8, submitted_at=0)
        job = ActiveJob("cut", "t1", claim)
        job.queue = "llm"
        with pytest.raises(_Died):
            generate_body(first, job, kwargs)
        first.writer.close()  # what it queued is written; then it is gone
        store.release("w1")
        cut_short = store.events("cut")
        resumed = run_job(second, "tandem.generate", "cut", "llm", kwargs, generate_body)
        events = store.events("cut")
    finally:
        second.writer.close()
        store.close()
        server.stop()
    assert {e.choice for e in cut_short if e.type == "token"} == {0, 1}  # both choices began
    assert not any(e.type == "choice_end" for e in cut_short)  # neither ended: each resumes from its tokens
    for got, want in zip(resumed["choices"], whole["choices"], strict=True):  # as if never cut
        assert {**got, "logprobs": None, "cumulative_logprob": None} == {
            **want,
            "logprobs": None,
            "cumulative_logprob": None,
        }
        assert [e["logprob"] for e in got["logprobs"]] == pytest.approx(
            [e["logprob"] for e in want["logprobs"]], abs=1e-5
        )
        assert got["cumulative_logprob"] == pytest.approx(want["cumulative_logprob"], abs=1e-4)
    assert resumed["usage"] == whole["usage"] and resumed["timings"]["attempts"] == 2
    assert [e.type for e in events].count("restarted") == 1
    for k in (0, 1):
        mine = [e for e in events if e.type == "token" and e.choice == k]
        assert [t for e in mine for t in e.token_ids] == whole["choices"][k]["token_ids"]  # none twice, none lost
        assert [e.index for e in mine] == [sum(len(x.token_ids) for x in mine[:i]) for i in range(len(mine))]
        assert "".join(e.text for e in events if e.choice == k) == whole["choices"][k]["text"]
    assert sorted(e.choice for e in events if e.type == "choice_end") == [0, 1]


# ---- the handle's pending outputs, per choice ---------------------------------------------------------


def _streamed(index: int, ids: list[int], text: str) -> RequestOutput:
    """A streamed output of an n > 1 request: choice `index` alone, its last token and text new."""
    metrics = RequestMetrics(arrival_time=0.0)
    choice = CompletionOutput(index, text, ids, None, delta_text=text, delta_token_ids=ids[-1:])
    new = dict(delta_text=text, delta_token_ids=ids[-1:], completions=[choice])
    return RequestOutput("r", "p", [1], ids, text, None, metrics, **new)


def test_a_handle_never_joins_two_choices_deltas():
    from runtime.handles import GenerationHandle

    handle = GenerationHandle("r", cancel=lambda rid: None)
    for out in (_streamed(0, [5], "a"), _streamed(1, [7], "x"), _streamed(0, [5, 6], "b"), _streamed(1, [7, 8], "y")):
        handle._push(out)
    pending, _ = handle.poll()
    assert [(o.completions[0].index, o.delta_text, o.delta_token_ids) for o in pending] == [
        (0, "ab", [5, 6]),
        (1, "xy", [7, 8]),
    ]
    assert [o.completions[0].delta_text for o in pending] == ["ab", "xy"]
