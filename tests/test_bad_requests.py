"""tests/bad_requests.py's corpus against a real `tandem serve` (this module's, with short body,
header and keep-alive limits) over the session's shared worker (tests/fleet_support.py: the tiny
random Llama, two task threads, so that a third job waits in Redis): each bad request gets its
status, in OpenAI's error shape, naming its field, repeating little of its input; then a plain
request still works. Besides the corpus, what a JSON case cannot say: a chunked body that never
ends, a body or a request head that never finishes, SSE keep-alives while a job waits, and one
log line (no traceback) per client that goes away.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from bad_requests import CASES
from fleet_support import FLEET_TASK_THREADS, ServeProcess
from sse_readers import data_lines, strip_then_split
from test_jobs_support import wait_for
from test_serve import sse

from server.common import KEEPALIVE

pytestmark = pytest.mark.slow
MAX_BODY = 1 << 20
TIMEOUT_S = 1.5  # --body-timeout and --header-timeout
KEEPALIVE_S = 0.3


@pytest.fixture(scope="module")
def server(shared_fleet, tmp_path_factory):
    fleet = shared_fleet.start()
    serve = ServeProcess(
        "serve-bad",
        tmp_path_factory.mktemp("bad"),
        [
            "--redis-url",
            fleet.redis.url,
            "--max-body-bytes",
            str(MAX_BODY),
            "--body-timeout",
            str(TIMEOUT_S),
            "--header-timeout",
            str(TIMEOUT_S),
            "--keepalive",
            str(KEEPALIVE_S),
            "--log-level",
            "info",
        ],
    )
    try:
        fleet.ready()
        serve.wait_ready()
        serve.redis_url = fleet.redis.url  # for the tests that watch their jobs' states
        wait_for(lambda: httpx.get(serve.url + "/v1/models", timeout=5).json()["data"], 30, "the model in /v1/models")
        yield serve
    finally:
        serve.stop()


@pytest.fixture(scope="module")
def job_id(server) -> str:
    r = httpx.post(server.url + "/v1/jobs", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 202, r.text
    return r.json()["job_id"]


def send(server, method: str, path: str, body) -> httpx.Response:
    if body is None:
        content = None
    elif isinstance(body, bytes):
        content = body
    else:  # as a careless client writes it: NaN, Infinity, and lone surrogates as \\u escapes
        content = json.dumps(body).encode()
    headers = {"content-type": "application/json"} if content is not None else {}
    return httpx.request(method, server.url + path, content=content, headers=headers, timeout=60)


def assert_serving(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Still there?", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_the_corpus_has_at_least_50_cases_with_unique_ids():
    ids = [c[0] for c in CASES]
    assert len(ids) >= 50 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_bad_request_gets_its_status_naming_its_field(server, job_id, case):
    name, method, path, body, status, param = case
    r = send(server, method, path.replace("{job}", job_id), body)
    assert r.status_code == status, (name, r.status_code, r.text[:500])
    if status >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
        assert isinstance(err["message"], str) and len(err["message"]) <= 330, len(err["message"])
        if param is not None:
            assert err["param"] == param, (name, err)


def test_a_plain_request_still_works_after_the_corpus(server, job_id):
    for case in CASES:  # all of it again, quickly, then the check
        send(server, case[1], case[2].replace("{job}", job_id), case[3])
    assert_serving(server)
    assert server.proc.poll() is None
    assert "Traceback" not in server.log()


def _raw(server, head: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(head)
    return s


def _read_all(s: socket.socket) -> bytes:
    """What the server sent until it closed (a reset after its answer keeps what came before)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_a_chunked_body_that_never_ends_is_413_and_the_connection_closes(server):
    import select

    s = _raw(
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
    )
    chunk = b'{"prompt": "' + b"a" * 65536
    answer = b""
    with s:
        for _ in range(64 * MAX_BODY // len(chunk)):  # far past the limit: the server must answer first
            if select.select([s], [], [], 0)[0]:
                break  # it answered
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                break
        s.settimeout(10)
        answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert_serving(server)


def test_a_body_that_stops_arriving_is_408(server):
    start = time.monotonic()
    s = _raw(
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": ',
    )
    with s:
        answer = _read_all(s)  # the server answers, then closes
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"param":"body"' in answer
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 5
    assert_serving(server)


@pytest.mark.parametrize("head", [b"", b"GET /health HTTP/1.1\r\nHost: t\r\n"])
def test_a_connection_that_never_finishes_its_head_is_closed(server, head):
    start = time.monotonic()
    s = _raw(server, head)
    with s:
        for _ in range(int(TIMEOUT_S * 2)):  # a byte a while, as slowloris does: no reset of the limit
            time.sleep(0.4)
            try:
                s.sendall(b"X")
            except OSError:
                break
        assert _read_all(s) == b""  # closed, without an answer
    assert time.monotonic() - start < TIMEOUT_S + 5
    assert_serving(server)


def test_a_keep_alive_connection_still_serves_a_second_request_after_the_head_limit(server):
    """The head limit starts again after each answer: an idle keep-alive connection is closed,
    but one that sends its next request in time is served."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        time.sleep(TIMEOUT_S / 3)
        assert client.get("/health").status_code == 200


def _hold(server) -> list[str]:
    """Long jobs that occupy each of the worker's task threads; the next job waits in Redis."""
    body = {"prompt": "Hold", "max_tokens": 1000, "ignore_eos": True}
    jobs = [
        httpx.post(server.url + "/v1/jobs", json=body, timeout=10).json()["job_id"] for _ in range(FLEET_TASK_THREADS)
    ]

    def running():
        return all(httpx.get(f"{server.url}/v1/jobs/{j}", timeout=10).json()["state"] == "running" for j in jobs)

    wait_for(running, 30, "the holders")
    return jobs


def _release(server, holders: list[str]) -> None:
    for job in holders:
        httpx.delete(f"{server.url}/v1/jobs/{job}", timeout=10)


def test_a_queued_stream_sends_keep_alives_then_every_event_to_every_reader(server):
    """A stream that waits in the queue past the keep-alive interval begins with keep-alives
    (nothing else: the job waits), and once its job runs, each reader real clients use gets
    every event: the specification's, `vllm bench serve`'s strip-then-split reader (which lost
    a third of its streams to a leading ": keep-alive" comment) and a naive data-line reader."""
    holders = _hold(server)
    released = False
    try:
        queued = httpx.post(server.url + "/v1/jobs", json={"prompt": "Wait", "max_tokens": 2}, timeout=10).json()
        raw = b""
        with httpx.stream("GET", f"{server.url}/v1/jobs/{queued['job_id']}/events", timeout=30) as r:
            for chunk in r.iter_raw():
                raw += chunk
                if raw.count(KEEPALIVE) >= 2:
                    break
        assert raw == KEEPALIVE * 2, raw  # nothing else came first: the job waits
        body = {"prompt": "Wait too", "max_tokens": 2, "stream": True}
        chunks = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for chunk in r.iter_raw():  # each network chunk as it came
                chunks.append(chunk)
                if not released and b"".join(chunks).count(KEEPALIVE) >= 2:
                    assert b"data:" not in b"".join(chunks), chunks
                    _release(server, holders)
                    released = True
    finally:
        if not released:
            _release(server, holders)
    assert released, chunks  # the holders outlived two keep-alive intervals: the stream was queued
    text = b"".join(chunks).decode()
    spec = [e["data"] for e in sse(text.split("\n"))]
    assert spec[-1] == "[DONE]" and json.loads(spec[-2])["choices"][0]["finish_reason"], spec
    assert strip_then_split(chunks) == spec, chunks
    assert data_lines(text.split("\n")) == spec


def _jobs(server) -> dict[str, dict]:
    """Every job in the server's Redis (the shared one: callers keep to the ids new since they
    looked): id -> its record's state and num_tokens."""
    import redis

    with redis.Redis.from_url(server.redis_url, decode_responses=True) as r:
        keys = [k for k in r.scan_iter("tandem:job:*") if k.count(":") == 2]
        return {k.split(":")[2]: r.hgetall(k) for k in keys}


def test_a_client_that_goes_away_is_one_log_line_without_a_traceback(server):
    before, known = server.log(), set(_jobs(server))
    body = {"prompt": "Count", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        next(iter(r.iter_lines()))
    streamed = set(_jobs(server)) - known
    assert len(streamed) == 1, streamed
    plain = json.dumps({"prompt": "Count", "max_tokens": 1000, "ignore_eos": True}).encode()
    with _raw(
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(plain), plain),
    ):

        def generating():  # the job runs (it has made tokens); then the client goes away
            jobs = _jobs(server)
            mine = [j for j in set(jobs) - known - streamed if int(jobs[j].get("num_tokens") or 0) >= 1]
            return mine and mine[0]

        plain_job = wait_for(generating, 30, "the plain request's job to make tokens", interval=0.05)

    def new_lines():
        lines = server.log()[len(before) :].splitlines()
        return len([x for x in lines if "client went away" in x]) >= 2 and lines

    wait_for(new_lines, 15, "both disconnects in the log", interval=0.1)
    # Cancelling the jobs is the last of the disconnects' work: once both jobs are final, and a
    # request after them has been answered, whatever they would log (a traceback) is in the log.
    wait_for(
        lambda: all(_jobs(server)[j].get("state") in ("cancelled", "done", "failed") for j in {*streamed, plain_job}),
        30,
        "both jobs cancelled",
        interval=0.05,
    )
    assert_serving(server)
    lines = server.log()[len(before) :].splitlines()
    gone = [x for x in lines if "client went away" in x]
    assert len(gone) == 2, lines
    assert "Traceback" not in server.log() and not any("ERROR" in x for x in lines), lines
    assert_serving(server)
