"""OpenAI request checks and response shapes (server/protocol.py), and the Prometheus
rendering of serving metrics (runtime/metrics.py): plain data, no server, no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime import metrics
from server import protocol
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
        ("n", 2),
        ("logprobs", 3),
        ("echo", True),
        ("stream", "yes"),
        ("request_timeout", 0),
        ("presence_penalty", 5),
        ("bogus_field", 1),
        ("request_timeout", float("nan")),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
    ],
)
def test_each_bad_completion_field_is_refused_naming_it(field, value):
    body = {"prompt": "hi", "max_tokens": 8, field: value}
    assert _param(protocol.parse_completion, body) == field


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
    first = protocol.chunk(gen, "m", "", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None
    last = protocol.chunk(gen, "m", None, use=protocol.usage(3, 2), no_choices=True)
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
    text = metrics.render([{"instance": "w1", "model_name": "m", "metrics": snap}, cams]).decode()
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

    from server.cli import api_key

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
