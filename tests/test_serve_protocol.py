"""OpenAI request checks and response shapes (server/protocol.py), and the Prometheus
rendering of serving metrics (runtime/metrics.py, server/metrics.py): plain data, no server, no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime import metrics
from server import protocol, responses
from server.metrics import render
from server.protocol import APIError


def _param(fn, body) -> str:
    with pytest.raises(APIError) as info:
        fn(body)
    assert info.value.status == 400
    assert info.value.param in info.value.message or info.value.param.startswith("messages")
    return info.value.param


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", -1),
        ("max_tokens", "12"),
        ("temperature", -0.5),
        ("top_p", 1.5),
        ("top_p", 0),
        ("top_k", -3),
        ("min_tokens", 99),
        ("seed", "x"),
        ("stop_token_ids", [-1]),
        ("priority", 1.5),
        ("n", 0),
        ("n", 17),
        ("best_of", 0),
        ("best_of", 17),
        ("prompt_logprobs", 21),
        ("logprobs", 21),
        ("logprobs", True),
        ("echo", "yes"),
        ("suffix", "tail"),
        ("logit_bias", {"5": 1}),
        ("spaces_between_special_tokens", False),
        ("min_p", 1.5),
        ("min_p", float("nan")),
        ("top_p", float("nan")),
        ("repetition_penalty", float("inf")),
        ("max_tokens", 10**30),
        ("seed", 2**64),
        ("stop", ["x"] * 10_000),
        ("stream_options", {"include_usage": True, "continuous_usage_stats": True}),
        ("guided_choice", []),
        ("guided_regex", 5),
        ("response_format", {"type": "xml"}),
        ("stream", "yes"),
        ("request_timeout", 0),
        ("presence_penalty", 5),
        ("bogus_field", 1),
        ("request_timeout", float("nan")),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("speculate", "no"),
    ],
)
def test_each_bad_completion_field_is_refused_naming_it(field, value):
    body = {"prompt": "hi", "max_tokens": 8, field: value}
    if field == "stream_options":
        body["stream"] = True
    param = _param(protocol.parse_completion, body)
    assert param == field or param.startswith(field + "."), param


@pytest.mark.parametrize("prompt", ["", [], [1, -2], [["a"], ["b"]], ["a", "b"], 5, None])
def test_a_bad_prompt_is_refused_naming_prompt(prompt):
    assert _param(protocol.parse_completion, {"prompt": prompt}) == "prompt"


@pytest.mark.parametrize(
    "messages, param",
    [
        ([], "messages"),
        (None, "messages"),
        ("hi", "messages"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        (["x"], "messages[0]"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]"),
    ],
)
def test_bad_messages_are_refused_naming_the_message(messages, param):
    assert _param(protocol.parse_chat, {"messages": messages}) == param


def test_a_completion_keeps_vllm_extras_and_openai_stream_options():
    gen = protocol.parse_completion(
        {
            "model": "m",
            "prompt": [[1, 2, 3]],
            "max_tokens": 4,
            "temperature": 0,
            "top_k": 5,
            "min_tokens": 2,
            "seed": 7,
            "ignore_eos": True,
            "stop_token_ids": [9],
            "priority": -1,
            "stop": "END",
            "user": "u",
            "stream": True,
            "stream_options": {"include_usage": True},
            "request_timeout": 2.5,
        }
    )
    assert gen.job == {
        "prompt": [1, 2, 3],
        "max_tokens": 4,
        "temperature": 0,
        "top_k": 5,
        "min_tokens": 2,
        "seed": 7,
        "ignore_eos": True,
        "stop_token_ids": [9],
        "priority": -1,
        "stop": ["END"],
    }
    assert (gen.stream, gen.include_usage, gen.timeout_s, gen.model) == (True, True, 2.5, "m")


def test_chat_takes_max_completion_tokens_and_text_parts():
    gen = protocol.parse_chat(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_completion_tokens": 3,
        }
    )
    assert gen.job["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert gen.job["max_tokens"] == 3 and gen.id.startswith("chatcmpl-")


def test_usage_only_with_streaming():
    assert _param(protocol.parse_completion, {"prompt": "x", "stream_options": {"include_usage": True}}) == (
        "stream_options"
    )


def test_stream_chunks_carry_null_usage_until_the_last():
    gen = protocol.parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "stream": True, "stream_options": {"include_usage": True}}
    )
    first = responses.chunk(gen, "m", "", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None
    last = responses.chunk(gen, "m", None, use=responses.usage(3, 2), no_choices=True)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 5


def _output(reason, tokens, error_code=None):
    m = SimpleNamespace(
        arrival_time=0.0,
        first_scheduled_time=0.01,
        first_token_time=0.05 if tokens else None,
        finished_time=0.5,
        token_times=[0.05 + 0.05 * i for i in range(tokens)],
    )
    return SimpleNamespace(
        metrics=m, finish_reason=reason, error_code=error_code, prompt_token_ids=[1] * 10, token_ids=[2] * tokens
    )


def test_metrics_render_as_prometheus_text_with_vllm_names():
    m = metrics.ServingMetrics()
    m.observe_request(_output("length", 8))
    m.observe_request(_output("stop", 3))
    m.observe_request(_output("abort", 0, "deadline_exceeded"))
    m.observe_vision_batch(4, [0.001, 0.002, 0.003, 0.2])
    snap = m.snapshot({"num_requests_running": 2, "kv_cache_usage_perc": 0.25})
    cams = {
        "instance": "cams",
        "cameras": [{"camera": "door", "up": 0, "state": "retrying", "fps": 0, "frames": 5, "drops": 2}],
    }
    text = render([{"instance": "w1", "model_name": "m", "metrics": snap}, cams]).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}

    def at(name: str, **labels) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    w = {"tandem_instance": "w1", "model_name": "m"}
    assert at("tandem:num_requests_running", **w) == 2
    assert at("tandem:generation_tokens_total", **w) == 11
    assert at("tandem:prompt_tokens_total", **w) == 30
    assert at("tandem:request_success_total", finished_reason="deadline_exceeded", **w) == 1
    assert at("tandem:time_to_first_token_seconds_count", **w) == 2
    assert at("tandem:inter_token_latency_seconds_count", **w) == 7 + 2
    assert at("tandem:vision_batch_size_bucket", le="4.0", **w) == 1
    assert at("tandem:vision_queue_delay_seconds_count", **w) == 4
    cam = {"camera": "door", "tandem_instance": "cams"}
    assert at("tandem:camera_up", state="retrying", **cam) == 0
    assert at("tandem:camera_frames_dropped_total", **cam) == 2


def test_an_unreachable_redis_is_503_with_retry_after_not_a_crash():
    import socket

    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.backends import JobsBackend
    from workers.settings import JobSettings

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = JobsBackend(JobSettings(redis_url=f"redis://127.0.0.1:{port}/0", reconnect_s=0))
    with TestClient(create_app(backend)) as client:
        for method, path, body in (
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"prompt": "hi"}),
            ("POST", "/v1/jobs", {"prompt": "hi"}),
            ("GET", "/v1/jobs/abc", None),
        ):
            resp = client.request(method, path, json=body)
            assert resp.status_code == 503 and resp.headers["retry-after"], (path, resp.text)
            assert "Redis" in resp.json()["error"]["message"]
        assert client.get("/health").status_code == 503


def test_an_api_key_guards_every_endpoint_but_health():
    """With a key, a request without it or with a wrong one is 401 in OpenAI's shape and never
    reaches the backend (here a Redis nothing listens on: a request that got past the check
    would be 503); the right key passes; /health answers without one."""
    import socket

    from fastapi.testclient import TestClient

    from server.app import ServeConfig, create_app
    from server.backends import JobsBackend
    from workers.settings import JobSettings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = JobsBackend(JobSettings(redis_url=f"redis://127.0.0.1:{port}/0", reconnect_s=0))
    endpoints = (
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "hi"}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/v1/jobs", {"prompt": "hi"}),
        ("GET", "/v1/jobs/abc", None),
        ("DELETE", "/v1/jobs/abc", None),
        ("POST", "/v1/detect", {"url": "http://127.0.0.1/x.jpg"}),
        ("GET", "/metrics", None),
    )
    with TestClient(create_app(backend, ServeConfig(api_key="s3cret"))) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"X-Api-Key": "s3cret"}):
            for method, path, body in endpoints:
                resp = client.request(method, path, json=body, headers=headers)
                assert resp.status_code == 401, (path, headers, resp.text)
                assert resp.headers["www-authenticate"] == "Bearer"
                err = resp.json()["error"]
                assert err["type"] == "invalid_request_error" and "API key" in err["message"]
        for method, path, body in endpoints[:5]:
            resp = client.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert resp.status_code == 503, (path, resp.text)  # past the check, at the (absent) Redis
        assert client.get("/health").status_code == 503  # no key needed: unhealthy, not unauthorized


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch):
    import argparse

    from tandem.serve_cli import api_key

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert api_key(argparse.Namespace(api_key=None)) is None
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    assert api_key(argparse.Namespace(api_key=None)) == "from-env"
    assert api_key(argparse.Namespace(api_key="from-flag")) == "from-flag"
    with pytest.raises(ValueError, match="--api-key"):
        api_key(argparse.Namespace(api_key=" "))


@pytest.mark.parametrize("field", ["conf", "iou", "imgsz"])
def test_detect_refuses_a_field_it_would_ignore_naming_it(field):
    """/v1/detect takes url, path or image; any other field (conf, say) is a 400 naming it,
    before the backend is reached (here a Redis nothing listens on: past the check, 503)."""
    import socket

    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.backends import JobsBackend
    from workers.settings import JobSettings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = JobsBackend(JobSettings(redis_url=f"redis://127.0.0.1:{port}/0", reconnect_s=0))
    with TestClient(create_app(backend)) as client:
        resp = client.post("/v1/detect", json={"url": "http://127.0.0.1/x.jpg", field: 0.5})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == field
        assert client.post("/v1/detect", json={"url": "http://127.0.0.1/x.jpg"}).status_code != 400


class _FleetJobs:
    """A jobs-mode backend that records what POST /v1/jobs submits, over a fleet given as the
    workers' payloads: the route's routing and checks, without Redis or workers."""

    mode = "jobs"

    def __init__(self, models: dict[str, int]) -> None:
        self.payloads = [{"kind": "runtime", "models": [{"name": n, "max_model_len": m}]} for n, m in models.items()]
        self.submitted: list[tuple[str, dict, str | None]] = []

    async def workers(self) -> list[dict]:
        return self.payloads

    async def check_capacity(self, queue: str) -> None:
        pass

    async def submit(self, task, kwargs, *, job_id=None, queue=None, priority=0, max_tokens=0, owner=None):
        self.submitted.append((task, dict(kwargs), queue))
        return job_id or f"job-{len(self.submitted)}", True, "queued"

    async def close(self) -> None:
        pass


def test_a_job_runs_on_the_model_it_names_and_is_refused_as_the_openai_endpoints_refuse():
    from fastapi.testclient import TestClient

    from server.app import create_app
    from workers.settings import model_queue

    backend = _FleetJobs({"smol": 2048, "llama": 128})
    with TestClient(create_app(backend)) as client:
        resp = client.post("/v1/jobs", json={"prompt": "hi", "model": "llama", "max_tokens": 100})
        assert resp.status_code == 202, resp.text
        assert backend.submitted[-1] == ("tandem.generate", {"prompt": "hi", "max_tokens": 100}, model_queue("llama"))
        # max_tokens is held to the named model's context, not the largest served one's
        resp = client.post("/v1/jobs", json={"prompt": "hi", "model": "llama", "max_tokens": 200})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text
        assert "(128)" in resp.json()["error"]["message"]
        resp = client.post("/v1/jobs", json={"prompt": "hi", "model": "smol", "max_tokens": 200})
        assert resp.status_code == 202 and backend.submitted[-1][2] == model_queue("smol"), resp.text
        num_submitted = len(backend.submitted)
        for model, status in ((None, 400), ("nobody", 404), ("x" * 10_000, 404)):
            body = {"prompt": "hi"} | ({} if model is None else {"model": model})
            job, openai = client.post("/v1/jobs", json=body), client.post("/v1/completions", json=body)
            assert job.status_code == openai.status_code == status, job.text
            assert job.json() == openai.json()  # the same answer, word for word
            err = job.json()["error"]
            assert err["param"] == "model" and len(err["message"]) <= 300, err
            if model is not None:
                assert model[:20] in err["message"]
        for model in (5, "", ["smol"]):
            resp = client.post("/v1/jobs", json={"prompt": "hi", "model": model})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "model", resp.text
        assert len(backend.submitted) == num_submitted  # nothing refused reached the backend


def test_a_job_with_no_llm_worker_up_waits_on_the_llm_queue_unless_it_names_a_model():
    from fastapi.testclient import TestClient

    from server.app import ServeConfig, create_app
    from workers.settings import model_queue

    backend = _FleetJobs({})
    with TestClient(create_app(backend)) as client:
        assert client.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 10**6}).status_code == 202
        assert backend.submitted[-1][2] == "llm"
        resp = client.post("/v1/jobs", json={"prompt": "hi", "model": "smol"})
        assert resp.status_code == 503 and resp.headers["retry-after"], resp.text
    backend = _FleetJobs({"smol": 2048})  # one model: named by its --served-model-name, or not at all
    with TestClient(create_app(backend, ServeConfig(served_model_name="alias"))) as client:
        for body in ({"prompt": "hi", "model": "alias"}, {"prompt": "hi"}):
            assert client.post("/v1/jobs", json=body).status_code == 202
            assert backend.submitted[-1][2] == model_queue("smol")
        assert client.post("/v1/jobs", json={"prompt": "hi", "model": "smol"}).status_code == 404


def test_n_choices_are_one_job_that_carries_n_and_best_of():
    """The engine forks the choices (one prefill) and derives their seeds
    (runtime.llm.sampling_params.choice_seed): the server keeps no copy of the derivation."""
    gen = protocol.parse_completion({"prompt": "x", "n": 3, "seed": 7})
    assert (gen.n, gen.job["n"], gen.job["seed"]) == (3, 3, 7) and "best_of" not in gen.job
    ranked = protocol.parse_completion({"prompt": "x", "n": 2, "best_of": 4})
    assert (ranked.job["n"], ranked.job["best_of"]) == (2, 4)
    assert "n" not in protocol.parse_completion({"prompt": "x", "best_of": 1}).job  # best_of == n: nothing to rank
    assert not hasattr(protocol, "choice_seed")


def _entry(token: str, logprob: float, top: list[tuple[str, float]]) -> dict:
    def one(t, lp):
        return {"token_id": 1, "token": t, "bytes": list(t.encode()), "logprob": lp}

    return {**one(token, logprob), "top": [one(t, lp) for t, lp in top]}


def test_logprobs_take_each_endpoints_openai_shape():
    entries = [_entry("He", -0.1, [("He", -0.1), ("A", -2.0)]), _entry("llo", -0.5, [("y", -0.3), ("A", -1.0)])]
    comp = protocol.parse_completion({"prompt": "x", "logprobs": 2})
    out = responses.logprobs_of(comp, entries, offset=3)
    assert out == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.1, -0.5],
        "top_logprobs": [{"He": -0.1, "A": -2.0}, {"y": -0.3, "A": -1.0, "llo": -0.5}],
        "text_offset": [3, 5],
    }
    chat = protocol.parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2})
    assert chat.job["logprobs"] == 2
    content = responses.logprobs_of(chat, entries)["content"]
    assert content[1] == {
        "token": "llo",
        "logprob": -0.5,
        "bytes": [108, 108, 111],
        "top_logprobs": [
            {"token": "y", "logprob": -0.3, "bytes": [121]},
            {"token": "A", "logprob": -1.0, "bytes": [65]},
        ],
    }
    assert protocol.parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True}).job["logprobs"] == 0
    assert responses.logprobs_of(protocol.parse_completion({"prompt": "x"}), entries) is None


def test_structured_output_fields_map_to_one_job_field_and_are_refused_in_the_requests_terms():
    """Until the runtime builds structured output, SamplingParams refuses it: a 400 that names
    the field the request used."""
    schema = {"type": "object"}
    for body, param in (
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"guided_json": schema}, "guided_json"),
        ({"guided_choice": ["a", "b"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    ):
        try:
            gen = protocol.parse_completion({"prompt": "x", **body})
        except APIError as exc:
            assert exc.status == 400 and exc.param == param and exc.message.startswith(param), exc.message
        else:  # the runtime supports it: the job carries contract A's field
            assert set(gen.job["structured_outputs"]) <= {"json", "json_object", "regex", "choice", "grammar"}
    assert protocol.parse_completion({"prompt": "x", "response_format": {"type": "text"}}).job.keys() == {"prompt"}


def test_the_job_api_checks_are_the_openai_ones():
    for body, param in (
        ({"messages": [{"role": "bogus", "content": "x"}]}, "messages[0].role"),
        ({"prompt": "x", "temperature": float("inf")}, "temperature"),
        ({"prompt": "x", "deadline_s": float("inf")}, "deadline_s"),
        ({"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
        ({"prompt": "x", "min_p": float("nan")}, "min_p"),
    ):
        with pytest.raises(APIError) as info:
            protocol.check_job(dict(body))
        assert info.value.param == param, info.value.message


def test_errors_repeat_little_of_the_input_and_carry_no_lone_surrogate():
    with pytest.raises(APIError) as info:
        protocol.parse_completion({"prompt": "x", "stop": ["s"] * 10_000 + [5]})
    assert info.value.param == "stop" and len(info.value.message) <= 330
    err = APIError(400, "bad \ud800 " + "y" * 5000, "p\udfff")
    err.message.encode("utf-8")  # escaped, so the JSON answer can be written
    assert len(err.message) <= 330 and err.param == "p\\udfff"


def test_lone_surrogates_are_found_with_their_path():
    from server.common import lone_surrogate

    assert lone_surrogate({"prompt": "ok", "messages": [{"content": "a"}, {"content": "b\ud800"}]}) == (
        "messages[1].content"
    )
    assert lone_surrogate({"a": [1, 2.5, None, {"b": "fine"}]}) is None
    deep: list = []
    node = deep
    for _ in range(5000):  # deeper than Python's recursion limit: the walk is iterative
        node.append([])
        node = node[0]
    node.append("\udc00")
    assert lone_surrogate(deep).endswith("[0]")


def test_ticking_yields_keep_alive_ticks_while_the_source_is_quiet():
    import asyncio

    from server.common import TICK, ticking

    async def slow():
        yield 1
        await asyncio.sleep(0.35)
        yield 2

    async def main():
        return [item async for item in ticking(slow(), 0.1)]

    items = asyncio.run(main())
    assert items[0] == 1 and items[-1] == 2 and items.count(TICK) >= 2
    assert set(items[1:-1]) == {TICK}
