"""Schemathesis against a real `tandem serve --embedded` (the tiny random Llama): every
operation of GET /openapi.json gets request bodies generated from its documented schema; no
answer may be a 5xx, each must have a documented status and match its documented schema, and
the server still serves afterwards. Bounded: MAX_EXAMPLES per operation, max_tokens cut to a
few tokens (what the fuzzing means to reach is the checks, not long generations)."""

from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from test_jobs_support import free_port
from test_serve import ServeProcess

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 40
BUDGET_S = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    proc = ServeProcess(
        "serve-fuzz",
        tmp_path_factory.mktemp("fuzz"),
        [
            "--embedded",
            "--queues",
            "llm",
            "--dtype",
            "float32",
            "--model",
            tiny_llama_dir,
            "--max-num-seqs",
            "4",
            "--kv-cache-bytes",
            str(64 << 20),
            "--no-profile",
            "--request-timeout",
            "60",
        ],
        env={"TANDEM_REDIS_URL": nowhere},
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_fuzzed_requests_get_documented_non_5xx_answers(server):
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    labels = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/jobs", "POST /v1/detect"} <= labels
    body = schema.raw_schema["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["properties"]["prompt"]  # documented, not {}
    checks = [not_a_server_error, status_code_conformance, response_schema_conformance]
    start = time.monotonic()
    seen: dict[str, set[int]] = {}

    def fuzzer(op):
        label = f"{op.method.upper()} {op.path}"

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,  # the same cases every run: a failure reproduces
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy())
        def fuzz(case):
            if time.monotonic() - start > BUDGET_S:
                return
            if isinstance(case.body, dict) and "max_tokens" in case.body:
                mt = case.body["max_tokens"]
                if isinstance(mt, int) and not isinstance(mt, bool) and 0 < mt <= 1 << 20:
                    case.body["max_tokens"] = min(mt, 4)  # a short answer; past-context ones still get their 400
            response = case.call(base_url=server.url, timeout=60)
            seen.setdefault(label, set()).add(response.status_code)
            case.validate_response(response, checks=checks)

        return fuzz

    for op in operations:
        fuzzer(op)()
    assert time.monotonic() - start < BUDGET_S + 60
    assert any(200 in codes for label, codes in seen.items() if "completions" in label), seen  # some ran
    out = httpx.post(server.url + "/v1/completions", json={"prompt": "Still there?", "max_tokens": 2}, timeout=60)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2
    assert server.proc.poll() is None and "Traceback" not in server.log()
