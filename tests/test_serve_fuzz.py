"""Schemathesis against a real `tandem serve --embedded` (the tiny random Llama; the session's,
shared with test_serve): every operation of GET /openapi.json gets request bodies generated from
its documented schema; no answer may be a 5xx, each must have a documented status and match its
documented schema, and the server still serves afterwards (and logged no traceback meanwhile).
Bounded: MAX_EXAMPLES and BUDGET_S per operation (a budget shared by all would leave the last
operations fuzzed zero times once the first spent it, and the test would pass on nothing),
max_tokens cut to a few tokens (what the fuzzing means to reach is the checks, not long
generations). Each operation that takes input must have run MIN_CASES."""

from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 40
BUDGET_S = 8.0  # per operation
MIN_CASES = 10  # sent, per operation that takes a body or a path parameter
# 5xx answers this server gives by design, documented, not crashes (their shape is still checked):
# --embedded keeps no jobs (the job API is 501), and /health?model= for a model nobody serves is
# 503 (a load balancer's signal); and a 504 past the request_timeout the request itself gave.
DESIGNED_5XX = {
    ("POST /v1/jobs", 501),
    ("GET /v1/jobs/{job_id}", 501),
    ("GET /v1/jobs/{job_id}/events", 501),
    ("DELETE /v1/jobs/{job_id}", 501),
    ("GET /health", 503),
}
TAKES_INPUT = {
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/jobs",
    "POST /v1/detect",
    "GET /v1/jobs/{job_id}",
    "GET /v1/jobs/{job_id}/events",
    "DELETE /v1/jobs/{job_id}",
}


@pytest.fixture(scope="module")
def server(shared_fleet):
    """The session's `tandem serve --embedded` on the tiny Llama, --request-timeout 60
    (tests/fleet_support.py)."""
    return shared_fleet.embedded()


def test_fuzzed_requests_get_documented_non_5xx_answers(server):
    import schemathesis

    log_start = len(server.log())  # the shared server's earlier lines are other tests'
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    labels = {f"{op.method.upper()} {op.path}" for op in operations}
    assert TAKES_INPUT <= labels
    body = schema.raw_schema["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["properties"]["prompt"]  # documented, not {}
    checks = [not_a_server_error, status_code_conformance, response_schema_conformance]
    start = time.monotonic()
    seen: dict[str, set[int]] = {}
    sent: dict[str, int] = dict.fromkeys(labels, 0)

    def fuzzer(op):
        label = f"{op.method.upper()} {op.path}"
        begin = time.monotonic()  # this operation's own budget starts now

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,  # the same cases every run: a failure reproduces
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy())
        def fuzz(case):
            if time.monotonic() - begin > BUDGET_S:
                return
            if isinstance(case.body, dict):
                for name in ("max_tokens", "max_completion_tokens"):
                    mt = case.body.get(name)
                    if isinstance(mt, int) and not isinstance(mt, bool) and 0 < mt <= 1 << 20:
                        case.body[name] = min(mt, 4)  # a short answer; past-context ones still get their 400
                if label == "POST /v1/chat/completions" and not {"max_tokens", "max_completion_tokens"} & set(
                    case.body
                ):
                    # A chat's default is the whole context (vLLM's): seconds per case on a CPU,
                    # which left chat fuzzed twice in its budget.
                    case.body["max_tokens"] = 4
            response = case.call(base_url=server.url, timeout=60)
            seen.setdefault(label, set()).add(response.status_code)
            sent[label] += 1
            asked_timeout = isinstance(case.body, dict) and case.body.get("request_timeout") is not None
            if (label, response.status_code) in DESIGNED_5XX or (asked_timeout and response.status_code == 504):
                body = response.json()  # a 504 past the request's own request_timeout is its answer, too
                assert body.get("status") == "unavailable" or body["error"]["type"] in ("not_implemented", "timeout")
                case.validate_response(response, checks=[status_code_conformance, response_schema_conformance])
                return
            case.validate_response(response, checks=checks)

        return fuzz

    for op in operations:
        fuzzer(op)()
    assert time.monotonic() - start < len(operations) * BUDGET_S + 60
    assert all(sent[label] >= 1 for label in labels), sent  # an operation fuzzed zero times proves nothing
    short = {label: sent[label] for label in TAKES_INPUT if sent[label] < MIN_CASES}
    assert not short, f"fuzzed fewer than {MIN_CASES} times in {BUDGET_S:g} s: {short}"
    assert any(200 in codes for label, codes in seen.items() if "completions" in label), seen  # some ran
    out = httpx.post(server.url + "/v1/completions", json={"prompt": "Still there?", "max_tokens": 2}, timeout=60)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2
    assert server.proc.poll() is None and "Traceback" not in server.log()[log_start:]
