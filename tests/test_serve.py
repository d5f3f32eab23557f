"""`tandem serve` against real clients (GitHub issue 9): the official `openai` package and raw
httpx, over a real redis-server and real `tandem worker` processes; one embedded server too.

    main     the session's shared fleet (tests/fleet_support.py): redis + one worker (the tiny
             random Llama on llm, YOLO26n at imgsz 160 on vision, two task threads, so that a
             third job waits in Redis) + `tandem serve` (--max-body-bytes 256 KiB); and this
             module's second and third `tandem serve` over it, with --max-queued 1 and --api-key
    smol     the session's ModelsFleet (tests/fleet_support.py, shared with test_fleet_models):
             redis + a worker on the real SmolLM2 (served as "smollm2") + one on the tiny Llama
             + `tandem serve`: answers a model must mean
    embedded the session's `tandem serve --embedded` on the tiny Llama, its Redis URL pointing
             at nothing

This module's processes and the shared ones it needs start at once (their start-up overlaps),
and each test waits only for the parts it uses. The fleet is shared: a test looks only at the
jobs it made (ids new since it looked), and leaves the worker idle. Workers publish metrics
every TANDEM_HEARTBEAT_S = 0.5 s, so what /metrics should show is waited for, never asserted
at once.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
from pathlib import Path

import httpx
import openai
import pytest
import redis
from fleet_support import (
    FLEET_MAX_BODY,
    FLEET_WORKER,
    MODELS_SMOL,
    MODELS_TINY,
    ModelsFleet,
    ServeProcess,
    SharedFleet,
    stop_all,
)
from test_jobs_support import wait_for

from workers.store import job_key

pytestmark = pytest.mark.slow
MAX_BODY = FLEET_MAX_BODY  # bus.jpg (137 kB) fits, as base64 too
DETECT_KEYS = {"source", "frame", "boxes", "conf", "cls", "names", "error"}
FINAL = ("done", "failed", "cancelled")
API_KEY = "serve-test-key"


class Stack:
    """The session's shared fleet (tests/fleet_support.py) and this module's own processes;
    `main()`, `smol()` and `embedded()` wait for their part."""

    def __init__(self, fleet: SharedFleet, tmp: Path, models: ModelsFleet) -> None:
        self.fleet, self.tmp, self.models = fleet, tmp, models
        self.model = ""
        self._ready: set[str] = set()
        self._started: list = []

    def start(self) -> Stack:
        fleet, tmp = self.fleet.start(), self.tmp
        self.fleet.start_embedded()
        self.images, self.redis, self.celery = fleet.images, fleet.redis, fleet.celery
        self.worker, self.server = fleet.worker, fleet.server
        self.r = redis.Redis.from_url(self.redis.url, decode_responses=True)
        self.models.start()
        redis_args = ["--redis-url", self.redis.url]
        self.busy_server = self._add(ServeProcess("serve-busy", tmp, [*redis_args, "--max-queued", "1"]))
        self.key_server = self._add(ServeProcess("serve-key", tmp, [*redis_args, "--api-key", API_KEY]))
        return self

    def _add(self, proc):
        self._started.append(proc)
        return proc

    def main(self) -> Stack:
        if "main" not in self._ready:
            self.model = self.fleet.ready().model
            self._ready.add("main")
        return self

    def smol(self) -> ServeProcess:
        return self.models.ready().server

    def embedded(self) -> ServeProcess:
        return self.fleet.embedded()

    def client(self, server: ServeProcess | None = None) -> openai.OpenAI:
        # No retries: a 503 or 504 must reach the test, not be retried away by the SDK.
        return openai.OpenAI(base_url=(server or self.server).url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def job_ids(self) -> set[str]:
        return {k[len(job_key("")) :] for k in self.r.scan_iter(match=job_key("*"), count=1000)}

    def job(self, job_id: str) -> dict:
        """The job's Redis record: state, num_tokens, ..."""
        return self.r.hgetall(job_key(job_id))

    def stop(self) -> None:
        stop_all(self._started)
        if hasattr(self, "r"):
            self.r.close()


@pytest.fixture(scope="module")
def stack(shared_fleet, tmp_path_factory, models_fleet):
    s = Stack(shared_fleet, tmp_path_factory.mktemp("serve"), models_fleet)
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture
def env(stack) -> Stack:
    return stack.main()


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


# ---- helpers --------------------------------------------------------------------------------------


def sse(lines) -> list[dict]:
    """Server-sent events from text lines: [{"id", "event", "data"}], comments skipped."""
    events, event = [], {}
    for line in lines:
        if not line:
            if event:
                events.append(event)
                event = {}
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        event[name] = event[name] + "\n" + value if name == "data" and "data" in event else value
    if event:
        events.append(event)
    return events


def greedy(env: Stack, prompt, n: int, **extra) -> openai.types.Completion:
    return env.client().completions.create(
        model=env.model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True, **extra}
    )


def job_result(env: Stack, **body) -> dict:
    """A job through POST /v1/jobs, its result through GET /v1/jobs/{id} once done."""
    job_id = httpx.post(env.server.url + "/v1/jobs", json=body, timeout=10).json()["job_id"]

    def done():
        out = httpx.get(f"{env.server.url}/v1/jobs/{job_id}", timeout=10).json()
        assert out["state"] in ("queued", "running", "done"), out
        return out if out["state"] == "done" else None

    return wait_for(done, 60, f"job {job_id} to finish", interval=0.05)["result"]


def assert_serving(env: Stack) -> None:
    """The server (and its worker) still answer a plain request."""
    assert env.server.proc.poll() is None
    out = greedy(env, "Still there?", 2)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2


def scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def metric(families: dict, sample: str, **labels) -> float:
    """The sum of the samples named `sample` whose labels include `labels`."""
    return sum(
        s.value
        for f in families.values()
        for s in f.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def new_job(env: Stack, before: set[str]) -> str:
    """The one job submitted since `before` was taken."""
    found = wait_for(lambda: env.job_ids() - before, 10, "the request's job in Redis")
    assert len(found) == 1, found
    return found.pop()


def kv_blocks_used(env: Stack) -> int:
    return env.worker.stats(env.celery)["runtime"]["memory"]["kv_blocks"]["used"]


# ---- completions and chat -------------------------------------------------------------------------


def test_models_lists_the_worker_model_under_its_folder_name(env, tiny_llama_dir):
    models = env.client().models.list().data
    assert [m.id for m in models] == [Path(tiny_llama_dir).name]
    assert models[0].object == "model" and models[0].owned_by == "tandem"


def test_completion_returns_text_usage_and_length_with_ignore_eos(env, tok):
    prompt = "Once upon a time"
    out = greedy(env, prompt, 8)
    assert out.object == "text_completion" and out.model == env.model and out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert out.usage.prompt_tokens == len(tok(prompt).input_ids)
    assert out.usage.completion_tokens == 8 and out.usage.total_tokens == out.usage.prompt_tokens + 8
    assert len(tok(choice.text, add_special_tokens=False).input_ids) >= 1
    assert greedy(env, prompt, 8).choices[0].text == choice.text  # greedy: the same every time


def test_completion_of_token_ids_matches_the_text_prompt(env, tok):
    prompt = "The quick brown fox"
    ids = tok(prompt).input_ids
    by_ids, by_text = greedy(env, ids, 6), greedy(env, prompt, 6)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert greedy(env, [ids], 6).choices[0].text == by_text.choices[0].text  # a batch of one


def test_chat_completion_matches_its_stream_and_ends_with_usage_then_done(env):
    client = env.client()
    messages = [{"role": "user", "content": "Say something."}]
    plain = client.chat.completions.create(
        model=env.model, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            model=env.model,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_raw_stream_is_sse_with_usage_last_and_done(env, endpoint):
    body = {
        "model": env.model,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update({"prompt": "Hello"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    with httpx.stream("POST", f"{env.server.url}/v1/{endpoint}", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    assert all(set(e) == {"data"} for e in events)
    assert events[-1]["data"] == "[DONE]"
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    *text_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in text_chunks)
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_with_smollm2_answers_and_its_stream_says_the_same(stack):
    client = stack.client(stack.smol())
    assert sorted(m.id for m in client.models.list().data) == [MODELS_SMOL, MODELS_TINY]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=32, temperature=0)
    answer = plain.choices[0].message.content
    assert "Paris" in answer and plain.choices[0].finish_reason == "stop"  # its own EOS, before 32 tokens
    assert plain.usage.completion_tokens < 32
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=messages,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()


def test_ignore_eos_and_min_tokens_keep_smollm2_past_its_eos(stack):
    client = stack.client(stack.smol())
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    def ask(**extra):
        return client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0, extra_body=extra
        )

    ignoring, forced = ask(ignore_eos=True), ask(min_tokens=24)
    for out in (ignoring, forced):
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 24
        assert "Paris" in out.choices[0].message.content


# ---- the extra fields -----------------------------------------------------------------------------


def test_stop_token_ids_stop_and_min_tokens_forces_length(env):
    prompt = "Count the stars"
    ids = job_result(env, prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True)["token_ids"]
    k = next(i for i in range(2, 8) if ids[i] not in ids[:i])  # a token first made at step k
    stopped = greedy(env, prompt, 8, stop_token_ids=[ids[k]])
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens in (k, k + 1)
    full = greedy(env, prompt, 8).choices[0].text
    assert full.startswith(stopped.choices[0].text)
    forced = greedy(env, prompt, 8, stop_token_ids=[ids[k]], min_tokens=8)
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 8


def test_seed_top_k_priority_and_repetition_penalty(env):
    client = env.client()

    def sample(**extra):
        out = client.completions.create(
            model=env.model,
            prompt="Tell me a story",
            max_tokens=12,
            temperature=1.0,
            extra_body={"ignore_eos": True, **extra},
        )
        return out.choices[0].text

    assert sample(seed=1234) == sample(seed=1234)  # a seed makes sampling reproducible
    assert sample(seed=1234) != sample(seed=4321)
    baseline = greedy(env, "Tell me a story", 12).choices[0].text
    assert sample(top_k=1) == baseline  # top_k=1 is greedy, whatever the temperature
    assert greedy(env, "Tell me a story", 12, priority=-5).choices[0].text == baseline
    assert greedy(env, "Tell me a story", 12, repetition_penalty=3.0).choices[0].text != baseline


# ---- bad requests -----------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ("max_tokens", {"max_tokens": -1}),
    ("max_tokens", {"max_tokens": "10"}),
    ("temperature", {"temperature": -0.5}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"extra_body": {"top_k": 1.5}}),
    ("prompt", {"prompt": "hello " * 1200}),  # the tiny Llama's context is 1024 tokens
    ("prompt", {"prompt": 5}),
    ("prompt", {"prompt": ""}),
    ("n", {"n": 17}),
    ("best_of", {"n": 3, "best_of": 2}),
    ("echo", {"prompt": [1, 2, 3], "echo": True}),
    ("prompt_logprobs", {"stream": True, "extra_body": {"prompt_logprobs": 1}}),
    ("stop", {"stop": 5}),
    ("seed", {"seed": "x"}),
    ("min_tokens", {"extra_body": {"min_tokens": 9}}),  # more than max_tokens
    ("priority", {"extra_body": {"priority": "high"}}),
    ("request_timeout", {"extra_body": {"request_timeout": 0}}),
    ("stream_options", {"stream_options": {"include_usage": True}}),  # without stream
    ("frobnicate", {"extra_body": {"frobnicate": 1}}),
]
BAD_CHATS = [
    ("messages", {"messages": []}),
    ("messages", {"messages": "hello"}),
    ("messages[0].role", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("messages[0].content", {"messages": [{"role": "user", "content": 5}]}),
    ("max_completion_tokens", {"max_completion_tokens": 0}),
    ("temperature", {"temperature": -1}),
    ("top_p", {"top_p": 0}),
]


@pytest.mark.parametrize("param, change", BAD_COMPLETIONS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_is_400_naming_the_field(env, param, change):
    args = {"model": env.model, "prompt": "Hello", "max_tokens": 8, **change}
    with pytest.raises(openai.BadRequestError) as exc:
        env.client().completions.create(**args)
    assert exc.value.status_code == 400 and exc.value.body["param"] == param, exc.value.body
    assert param.split("[")[0] in exc.value.body["message"]
    assert_serving(env)


@pytest.mark.parametrize("param, change", BAD_CHATS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_CHATS)])
def test_bad_chat_is_400_naming_the_field(env, param, change):
    args = {"model": env.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as exc:
        env.client().chat.completions.create(**args)
    assert exc.value.body["param"] == param, exc.value.body
    assert_serving(env)


@pytest.mark.parametrize("server", ["main", "embedded"])
def test_an_out_of_vocabulary_stop_token_id_is_400_and_the_requests_in_flight_keep_their_tokens(stack, server):
    """Issue 18's reproduction: three completions of 48 tokens streaming, then one with
    stop_token_ids past the vocabulary. It used to be a 500 for all four, with --embedded too."""
    proc = stack.main().server if server == "main" else stack.embedded()
    client, model = stack.client(proc), [m.id for m in stack.client(proc).models.list().data][0]
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    args = dict(model=model, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **args).choices[0].text for p in prompts]
    streams = [client.completions.create(prompt=p, stream=True, **args) for p in prompts]
    firsts = [next(iter(s)).choices[0].text for s in streams[:2]]  # streaming (the main worker runs two at once)
    for bad in (1_000_000, 2**70):
        r = httpx.post(
            proc.url + "/v1/completions",
            timeout=30,
            json={"model": model, "prompt": "x", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [bad]},
        )
        assert r.status_code == 400, r.text
        body = r.json()["error"]
        assert body["param"] == "stop_token_ids" and str(bad) in body["message"], body
    texts = [first + "".join(c.choices[0].text for c in s) for first, s in zip([*firsts, ""], streams)]
    assert texts == alone
    assert client.completions.create(prompt="Still there?", **{**args, "max_tokens": 2}).usage.completion_tokens == 2


def test_a_too_long_prompt_is_400_when_streaming_too(env):
    with pytest.raises(openai.BadRequestError) as exc:
        env.client().completions.create(model=env.model, prompt="hello " * 1200, max_tokens=4, stream=True)
    assert exc.value.body["param"] == "prompt" and "max_model_len" in exc.value.body["message"]
    assert_serving(env)


def test_unknown_model_is_404_on_both_endpoints(env):
    client = env.client()
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt="Hello", max_tokens=2)
    assert exc.value.body["param"] == "model" and "no-such-model" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}], stream=True)
    assert_serving(env)


def test_an_oversized_body_is_413_declared_or_chunked(env):
    with pytest.raises(openai.APIStatusError) as exc:
        env.client().completions.create(model=env.model, prompt="x" * (MAX_BODY + 1), max_tokens=2)
    assert exc.value.status_code == 413
    big = json.dumps({"model": env.model, "prompt": "y" * MAX_BODY, "max_tokens": 2}).encode()
    url = env.server.url + "/v1/completions"
    declared = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=30)
    assert declared.status_code == 413 and str(MAX_BODY) in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit must hold while reading
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    chunked = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == 413
    boundary = b"tandemboundary"
    upload = (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="big.jpg"\r\n'
        b"Content-Type: image/jpeg\r\n\r\n" + b"\xff" * (MAX_BODY + 1) + b"\r\n--" + boundary + b"--\r\n"
    )

    def upload_chunks():  # a chunked multipart upload: no Content-Length either
        for i in range(0, len(upload), 4096):
            yield upload[i : i + 4096]

    multipart = httpx.post(
        env.server.url + "/v1/detect",
        content=upload_chunks(),
        timeout=30,
        headers={"content-type": "multipart/form-data; boundary=tandemboundary"},
    )
    assert multipart.status_code == 413, multipart.text
    assert_serving(env)


def test_the_same_job_id_with_other_arguments_is_409(env):
    url = env.server.url + "/v1/jobs"
    first = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2, "job_id": "serve-same-id-409"}, timeout=10)
    again = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2, "job_id": "serve-same-id-409"}, timeout=10)
    assert first.status_code == 202 and again.status_code == 202 and again.json()["created"] is False
    other = httpx.post(url, json={"prompt": "Bye", "max_tokens": 2, "job_id": "serve-same-id-409"}, timeout=10)
    assert other.status_code == 409 and other.json()["error"]["param"] == "job_id"


# ---- timeouts ---------------------------------------------------------------------------------------


def test_a_request_past_its_timeout_gets_504_and_its_job_stops(env):
    before = env.job_ids()
    with pytest.raises(openai.APIStatusError) as exc:
        env.client().completions.create(
            model=env.model, prompt="Go on", max_tokens=1000, extra_body={"ignore_eos": True, "request_timeout": 0.05}
        )
    assert exc.value.status_code == 504 and exc.value.body["type"] == "timeout"
    job_id = new_job(env, before)
    final = wait_for(lambda: env.job(job_id).get("state") in FINAL and env.job(job_id), 30, "the job to end")
    assert final["state"] in ("cancelled", "failed") and int(final.get("num_tokens") or 0) < 1000
    wait_for(lambda: kv_blocks_used(env) == 0, 30, "the KV blocks to be freed", interval=0.2)
    assert_serving(env)


def test_a_stream_past_its_timeout_ends_with_a_504_error_then_done(env):
    body = {
        "model": env.model,
        "prompt": "Go on",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
        "request_timeout": 1.5,
    }
    with httpx.stream("POST", env.server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sse(r.iter_lines())
    assert events[-1]["data"] == "[DONE]"
    error = json.loads(events[-2]["data"])["error"]
    assert error["code"] == 504 and "1.5 s" in error["message"]
    assert len(events) > 3  # tokens came first
    assert_serving(env)


# ---- SSE resumption and disconnects -----------------------------------------------------------


def test_job_events_resume_after_a_disconnect_without_loss_or_repeat(env):
    url = env.server.url
    submitted = httpx.post(
        url + "/v1/jobs",
        json={"prompt": "Tell me everything", "max_tokens": 300, "temperature": 0, "ignore_eos": True},
        timeout=10,
    )
    assert submitted.status_code == 202 and submitted.json()["created"] is True
    job_id = submitted.json()["job_id"]
    lines: list[str] = []
    with httpx.stream("GET", f"{url}/v1/jobs/{job_id}/events", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            lines.append(line)
            if not line and len(sse(lines)) == 3:
                break  # three events read: go away mid-stream
    first = sse(lines)
    with httpx.stream(
        "GET", f"{url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": first[-1]["id"]}, timeout=60
    ) as r:
        rest = sse(r.iter_lines())
    events = first + rest
    ids = [e["id"] for e in events]
    assert len(set(ids)) == len(ids) and ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    assert [e["event"] for e in events].count("done") == 1 and events[-1]["event"] == "done"
    data = [json.loads(e["data"]) for e in events]
    tokens = [d for d in data if d["type"] == "token"]
    assert [d["index"] for d in tokens] == [sum(len(t["token_ids"]) for t in tokens[:i]) for i in range(len(tokens))]
    status = httpx.get(f"{url}/v1/jobs/{job_id}", timeout=10).json()
    assert status["state"] == "done"
    assert [t for d in tokens for t in d["token_ids"]] == status["result"]["token_ids"]
    assert len(status["result"]["token_ids"]) == 300
    # ?after= resumes the same way; after the final event there is nothing more.
    tail = sse(httpx.get(f"{url}/v1/jobs/{job_id}/events", params={"after": events[-3]["id"]}, timeout=30).iter_lines())
    assert [e["id"] for e in tail] == ids[-2:]
    assert httpx.get(f"{url}/v1/jobs/{job_id}/events", params={"after": ids[-1]}, timeout=30).text == ""
    assert httpx.get(f"{url}/v1/jobs/no-such-job/events", timeout=10).status_code == 404


@pytest.mark.parametrize(
    "param, body",
    [
        ("max_tokens", {"prompt": "Hi", "max_tokens": -1}),
        ("max_tokenz", {"prompt": "Hi", "max_tokenz": 3}),
        ("task", {"prompt": "Hi", "task": "paint"}),
        ("job_id", {"prompt": "Hi", "job_id": "no spaces allowed"}),
    ],
)
def test_job_api_bad_fields_are_400_naming_the_field(env, param, body):
    r = httpx.post(env.server.url + "/v1/jobs", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_job_events_with_a_malformed_last_event_id_is_400(env):
    submitted = httpx.post(env.server.url + "/v1/jobs", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    job_id = submitted.json()["job_id"]
    for how in ({"headers": {"Last-Event-ID": "not-an-id"}}, {"params": {"after": "garbage"}}):
        r = httpx.get(f"{env.server.url}/v1/jobs/{job_id}/events", timeout=30, **how)
        assert r.status_code == 400, (how, r.status_code, r.text)
        assert r.json()["error"]["param"] in ("Last-Event-ID", "after")
    assert_serving(env)


def test_a_stream_client_that_disconnects_cancels_its_job_and_frees_its_kv_blocks(env):
    before = env.job_ids()
    aborted_before = metric(scrape(env.server.url), "tandem:request_success_total", finished_reason="abort")
    stream = env.client().completions.create(
        model=env.model,
        prompt="Count forever",
        max_tokens=1000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    assert next(chunks).choices[0].text is not None and next(chunks).choices[0].text is not None
    job_id = new_job(env, before)
    wait_for(
        lambda: metric(scrape(env.server.url), "tandem:kv_cache_usage_perc") > 0,
        10,
        "/metrics to show the job's KV blocks in use",
    )
    stream.close()  # the client goes away mid-stream
    final = wait_for(lambda: env.job(job_id).get("state") in FINAL and env.job(job_id), 10, "the job to end")
    assert final["state"] == "cancelled" and int(final["num_tokens"]) < 1000
    wait_for(
        lambda: metric(scrape(env.server.url), "tandem:kv_cache_usage_perc") == 0,
        10,
        "/metrics to show the KV cache empty again",
    )
    assert kv_blocks_used(env) == 0
    wait_for(
        lambda: (
            metric(scrape(env.server.url), "tandem:request_success_total", finished_reason="abort") > aborted_before
        ),
        10,
        "the aborted request in /metrics",
    )
    assert_serving(env)


def test_a_plain_request_whose_client_disconnects_cancels_its_job(env):
    before = env.job_ids()
    body = json.dumps({"model": env.model, "prompt": "Count forever", "max_tokens": 1000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", env.server.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        job_id = new_job(env, before)
        wait_for(lambda: int(env.job(job_id).get("num_tokens") or 0) > 0, 10, "the job's first tokens")
    final = wait_for(lambda: env.job(job_id).get("state") in FINAL and env.job(job_id), 10, "the job to end")
    assert final["state"] == "cancelled" and int(final["num_tokens"]) < 1000
    wait_for(lambda: kv_blocks_used(env) == 0, 10, "the KV blocks to be freed", interval=0.2)
    assert_serving(env)


# ---- overload ---------------------------------------------------------------------------------------


def test_a_full_queue_answers_503_with_retry_after_and_recovers(env):
    busy = env.busy_server.wait_ready()
    jobs_url = env.server.url + "/v1/jobs"
    hold = {"prompt": "Hold the line", "max_tokens": 1000, "ignore_eos": True}
    holders = [httpx.post(jobs_url, json=hold, timeout=10).json()["job_id"] for _ in range(2)]
    # The worker runs two tasks at once: with both busy, the next job waits in Redis.
    wait_for(lambda: all(env.job(j).get("state") == "running" for j in holders), 30, "both holders to run")
    waiting = httpx.post(jobs_url, json={"prompt": "Next", "max_tokens": 2}, timeout=10).json()["job_id"]
    assert env.job(waiting)["state"] == "queued"

    results: list = [None] * 4

    def request(i: int) -> None:
        try:
            results[i] = env.client(busy).completions.create(model=env.model, prompt="Me too", max_tokens=2)
        except openai.APIStatusError as exc:
            results[i] = exc

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert env.job(waiting)["state"] == "queued"  # the queue stayed full throughout
    for exc in results:
        assert isinstance(exc, openai.InternalServerError) and exc.status_code == 503, exc
        assert exc.body["type"] == "service_unavailable" and "--max-queued 1" in exc.body["message"]
        assert float(exc.response.headers["retry-after"]) > 0
    refused = httpx.post(busy.url + "/v1/jobs", json={"prompt": "Me too", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and "retry-after" in refused.headers

    for j in holders:  # the load drains
        assert httpx.delete(f"{jobs_url}/{j}", timeout=10).json()["cancelled"] is True
    wait_for(lambda: env.job(waiting).get("state") == "done", 30, "the waiting job to run")
    out = env.client(busy).completions.create(model=env.model, prompt="Me too", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2 and busy.proc.poll() is None


# ---- metrics ----------------------------------------------------------------------------------------


def test_metrics_parse_and_count_the_requests(env):
    fams = scrape(env.server.url)
    labels = {"model_name": env.model}
    names = (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
    )
    assert {f"tandem:{n}" for n in names} <= set(fams)
    assert fams["tandem:num_requests_running"].type == "gauge" and fams["tandem:generation_tokens"].type == "counter"
    gen0 = metric(fams, "tandem:generation_tokens_total", **labels)
    e2e0 = metric(fams, "tandem:e2e_request_latency_seconds_count", **labels)
    length0 = metric(fams, "tandem:request_success_total", finished_reason="length")
    for _ in range(2):
        greedy(env, "Measure me", 7)

    def counted():
        f = scrape(env.server.url)
        grew = metric(f, "tandem:generation_tokens_total", **labels) >= gen0 + 14
        return grew and f

    fams = wait_for(counted, 10, "the two requests' tokens in /metrics", interval=0.1)
    assert metric(fams, "tandem:e2e_request_latency_seconds_count", **labels) >= e2e0 + 2
    assert metric(fams, "tandem:request_success_total", finished_reason="length") >= length0 + 2
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        fam = fams[f"tandem:{name}"]
        assert fam.type == "histogram"
        buckets = [s for s in fam.samples if s.name.endswith("_bucket") and s.labels["model_name"] == env.model]
        counts = [s.value for s in buckets]
        assert len(buckets) > 5 and buckets[-1].labels["le"] == "+Inf" and counts == sorted(counts)
        (count,) = [s.value for s in fam.samples if s.name.endswith("_count") and s.labels["model_name"] == env.model]
        assert count == counts[-1] > 0
    for s in fams["tandem:prompt_tokens"].samples:
        assert s.labels["model_name"] == env.model and s.labels["tandem_instance"].startswith(FLEET_WORKER)


# ---- vision -----------------------------------------------------------------------------------------


def test_detect_an_upload_a_base64_image_and_an_allowed_path(env):
    url = env.server.url + "/v1/detect"
    data = (env.images / "bus.jpg").read_bytes()
    uploaded = httpx.post(url, files={"file": ("bus.jpg", data, "image/jpeg")}, timeout=120)
    assert uploaded.status_code == 200, uploaded.text
    assert set(uploaded.json()) == DETECT_KEYS and uploaded.json()["error"] is None
    by_b64 = httpx.post(url, json={"image": base64.b64encode(data).decode()}, timeout=120).json()
    by_path = httpx.post(url, json={"path": str(env.images / "bus.jpg")}, timeout=120).json()
    assert by_path["source"] == os.path.realpath(env.images / "bus.jpg") and by_b64["source"] == "image"
    assert by_b64["boxes"] == by_path["boxes"] == uploaded.json()["boxes"]
    wait_for(lambda: metric(scrape(env.server.url), "tandem:vision_images_total") >= 3, 10, "the images in /metrics")


def test_detect_refuses_paths_outside_the_allowed_roots_and_bad_bodies(env):
    url = env.server.url + "/v1/detect"
    for path in ("/etc/passwd", str(env.images / ".." / "x.jpg")):
        r = httpx.post(url, json={"path": path}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
        assert "outside the allowed roots" in r.json()["error"]["message"]
    assert httpx.post(url, json={"url": "x", "path": "y"}, timeout=10).status_code == 400
    assert httpx.post(url, files={"other": ("a.jpg", b"x")}, timeout=10).json()["error"]["param"] == "file"
    assert httpx.post(url, json={"image": "%%%"}, timeout=10).status_code == 400
    assert_serving(env)


# ---- embedded ---------------------------------------------------------------------------------------


def test_embedded_mode_serves_completions_and_models_without_redis(stack, tiny_llama_dir):
    server = stack.embedded()
    assert "embedded mode" in server.log()
    client = stack.client(server)
    name = Path(tiny_llama_dir).name
    assert [m.id for m in client.models.list().data] == [name]
    out = client.completions.create(
        model=name, prompt="Once upon a time", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    chunks = list(
        client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=name, prompt="Hi", max_tokens=2, temperature=-1)
    assert exc.value.body["param"] == "temperature"
    assert httpx.post(server.url + "/v1/jobs", json={"prompt": "x"}, timeout=10).status_code == 501
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["mode"] == "embedded" and health["llm"] == 1
    wait_for(lambda: metric(scrape(server.url), "tandem:generation_tokens_total") >= 9, 10, "the tokens in /metrics")


# ---- logprobs, n, echo, the API key (issue 20) ----------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def _hf_logprobs(hf_model, ids: list[int]) -> list[float]:
    """Log-softmax of the next-token logits after `ids`, from Hugging Face: the oracle."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.float(), -1).tolist()


def test_completion_logprobs_match_transformers_streamed_and_not(env, tok, hf_model):
    prompt = "The quick brown fox"
    client = env.client()
    out = client.completions.create(
        model=env.model, prompt=prompt, max_tokens=5, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == logprob  # the top 3, and the sampled token
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the most likely
    oracle = _hf_logprobs(hf_model, tok(prompt).input_ids)
    assert lp.token_logprobs[0] == pytest.approx(max(oracle), abs=1e-3)
    streamed = list(
        client.completions.create(
            model=env.model,
            prompt=prompt,
            max_tokens=5,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.token_logprobs] == lp.token_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_chat_logprobs_in_openai_shape_streamed_and_not(env):
    client = env.client()
    args = dict(
        model=env.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    out = client.chat.completions.create(**args)
    content = out.choices[0].logprobs.content
    assert len(content) == 4 == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or entry.token == ""
    streamed = [c for c in client.chat.completions.create(stream=True, **args) if c.choices]
    entries = [e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == [e.logprob for e in content]
    plain = client.chat.completions.create(**{**args, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_n_2_gives_two_seeded_choices_and_counts_the_prompt_once(env):
    client = env.client()
    args = dict(model=env.model, prompt="Tell me a story", max_tokens=8, temperature=1.0, seed=7)
    one = client.completions.create(**args, extra_body={"ignore_eos": True})
    two = client.completions.create(n=2, **args, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == one.choices[0].text  # choice 0 keeps the request's seed
    assert two.choices[1].text != two.choices[0].text  # choice 1 has its own
    assert two.usage.prompt_tokens == one.usage.prompt_tokens and two.usage.completion_tokens == 16
    again = client.completions.create(n=2, **args, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in two.choices]
    chunks = list(
        client.chat.completions.create(
            model=env.model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            temperature=1.0,
            seed=3,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    by_index = {0: "", 1: ""}
    for c in chunks[:-1]:
        by_index[c.choices[0].index] += c.choices[0].delta.content or ""
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finishes) == [0, 1] and chunks[-1].usage.completion_tokens == 10
    plain = env.client().chat.completions.create(
        model=env.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=1.0,
        seed=3,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.message.content for c in plain.choices] == [by_index[0], by_index[1]]


def test_echo_puts_the_prompt_before_the_completion(env):
    out = greedy(env, "Once upon", 3, echo=True)
    plain = greedy(env, "Once upon", 3)
    assert out.choices[0].text == "Once upon" + plain.choices[0].text


def test_without_the_api_key_the_openai_client_gets_401_over_real_workers(env):
    server = env.key_server.wait_ready()
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as exc:
        wrong.completions.create(model=env.model, prompt="Hi", max_tokens=2)
    assert exc.value.status_code == 401
    right = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    out = right.completions.create(model=env.model, prompt="Hi", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1
    submitted = httpx.post(
        server.url + "/v1/jobs",
        json={"prompt": "Hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    )
    assert submitted.status_code == 202
    job_id = submitted.json()["job_id"]
    assert httpx.get(f"{server.url}/v1/jobs/{job_id}", timeout=10).status_code == 401


def test_json_schema_output_parses_and_matches_the_schema(env):
    """The schema's values are finite (a boolean, an enum), so that even the random tiny Llama
    ends its object well within max_tokens: what is tested is the constraint, not the model."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "name": {"enum": ["ann", "bob"]}},
        "required": ["ok", "name"],
        "additionalProperties": False,
    }
    out = env.client().chat.completions.create(
        model=env.model,
        messages=[{"role": "user", "content": "A person as JSON"}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0]
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"ok", "name"} and isinstance(value["ok"], bool) and value["name"] in ("ann", "bob")
