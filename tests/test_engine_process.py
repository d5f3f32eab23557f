"""`tandem serve --embedded` with its Runtime in an engine process of its own (issue 30, item 3):
server/engine_client.py, server/engine_process.py and the frames of server/engine_wire.py.

Real processes on SmolLM2 (the tiny random Llama makes 900 tokens in under two seconds: a
request must still run when the test cancels or kills it): a `tandem serve --embedded` (the
engine process, the default) and a `tandem serve --embedded --no-engine-process` beside it, to
compare with; a third server of its own for the test that kills its engine. Concurrent streams over the one channel
answer what the in-process mode answers (greedy), a client gone mid-stream cancels the engine's
request, a field error is the same 400, a killed engine ends the open streams with a failed
event and turns /health to 503 without hanging anything, and the server process holds no torch.
These modules share no session fleet: they are about processes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys

import httpx
import pytest
from fleet_support import ServeProcess, stop_all
from test_jobs_support import REPO, wait_for

from server import engine_wire as wire
from workers.events import CHOICE_END, DONE, FAILED, PROMPT, TOKEN, TOOL_ARGS, TOOL_CALL, JobEvent

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Dear Sir,", "1, 2, 3,", "Hello"]
LONG = 900  # tokens: seconds of SmolLM2's decoding, far longer than a test waits (max_model_len 1024)


def serve_args(model_dir: str) -> list[str]:
    """`tandem serve --embedded` on SmolLM2, LLM only, four slots of 1024 tokens."""
    kv = ["--kv-cache-bytes", str(256 << 20), "--max-model-len", "1024"]
    return ["--embedded", "--queues", "llm", "--dtype", "float32", "--model", model_dir, "--max-num-seqs", "4", *kv]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from ultralytics.utils import ASSETS

    folder = tmp_path_factory.mktemp("images")
    shutil.copy(ASSETS / "bus.jpg", folder / "bus.jpg")
    return folder


@pytest.fixture(scope="module")
def servers(tmp_path_factory, smollm2_dir, images):
    """(engine-process server, in-process server), both on SmolLM2 and the shipped detector at
    imgsz 160, `images` their allowed root, started together."""
    tmp = tmp_path_factory.mktemp("engine-process")
    vision = [
        "--queues",
        "llm,vision",
        "--imgsz",
        "160",
        "--vision-max-batch-size",
        "1",
        "--allowed-roots",
        str(images),
    ]
    args = [*serve_args(smollm2_dir), *vision, "--no-profile"]
    procs = [
        ServeProcess("serve-engine", tmp, args),
        ServeProcess("serve-inproc", tmp, [*args, "--no-engine-process"]),
    ]
    try:
        yield tuple(p.wait_ready(240) for p in procs)
    finally:
        stop_all(procs)


def engine_pid(server: ServeProcess) -> int:
    """The server's one child: its engine process."""
    pid = server.proc.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        (child,) = f.read().split()
    return int(child)


def maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def metric(url: str, name: str, label: str = "") -> float:
    """The sum of a /metrics series' samples (those whose labels hold `label`)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"tandem:{name}") and label in line
    )


def sse_payloads(lines) -> list:
    """The JSON (or "[DONE]") of each data line of a stream."""
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, await resp.aread()
        payloads = sse_payloads([line async for line in resp.aiter_lines()])
    assert payloads[-1] == "[DONE]", payloads[-3:]
    chunks = [p for p in payloads[:-1] if p.get("choices")]
    assert not any("error" in p for p in payloads[:-1]), payloads
    return {
        "text": "".join(c["choices"][0]["text"] for c in chunks),
        "finish_reason": chunks[-1]["choices"][0]["finish_reason"],
        "usage": payloads[-2]["usage"],
    }


def _concurrently(url: str, bodies: list[dict]) -> list[dict]:
    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(_stream(client, url, b) for b in bodies))

    return asyncio.run(run())


# ---- the frames --------------------------------------------------------------------------------


def test_job_events_cross_the_channel_unchanged():
    events = [
        JobEvent(TOKEN, "caf\u00e9 \ud800", [5, 6], [{"token_id": 5, "logprob": -0.5, "top": [], "bytes": [99]}], 0),
        JobEvent(PROMPT, token_ids=[1, 2], logprobs=[{"token_id": 1, "logprob": None, "top": []}]),
        JobEvent(TOOL_CALL, call_index=0, call_id="call_1", name="get_weather"),
        JobEvent(TOOL_ARGS, call_index=0, arguments='{"city": "Par'),
        JobEvent(CHOICE_END, "!", choice=1, finish_reason="stop", stop_reason=128001, num_tokens=7),
        JobEvent(DONE, "", finish_reason="stop", stop_reason="\n\n"),
        JobEvent(
            FAILED, error="max_tokens: too many", finish_reason="invalid_request", field="max_tokens", code="too_long"
        ),
    ]
    frame = wire.pack({"t": wire.EV, "items": [["r1", [wire.event_to_wire(e) for e in events], {"prompt_tokens": 2}]]})
    body = frame[4:]
    assert wire.body_length(frame[:4]) == len(body)
    ((rid, got, usage),) = wire.unpack(body)["items"]
    assert rid == "r1" and usage == {"prompt_tokens": 2}
    assert [wire.event_from_wire(d) for d in got] == events


# ---- a server whose engine runs apart ----------------------------------------------------------


def test_concurrent_streams_over_one_channel_answer_as_the_in_process_mode(servers):
    """Six greedy streams at once (four slots: two wait) through the engine process and through
    the in-process server: the same texts, ends and usage."""
    engine, inproc = servers
    bodies = [
        {
            "prompt": p,
            "max_tokens": 8 + 4 * k,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        for k, p in enumerate(PROMPTS)
    ]
    got, want = _concurrently(engine.url, bodies), _concurrently(inproc.url, bodies)
    assert got == want
    assert [g["usage"]["completion_tokens"] for g in got] == [b["max_tokens"] for b in bodies]
    # Logprobs cross the channel too (floats, token texts, bytes), as a plain request's answer.
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}
    answers = [httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"] for s in servers]
    assert answers[0] == answers[1]


def test_a_client_gone_mid_stream_cancels_its_request_in_the_engine(servers):
    engine, _ = servers
    aborted = metric(engine.url, "request_success_total", 'finished_reason="abort"')
    body = {"prompt": "Hello", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        # Keep the line iterator referenced: a `for` loop over a temporary one drops it at `break`,
        # and httpcore closes a stream whose iteration stops early, so the disconnect would come
        # here, before the gauge is read (why that gauge read 0 in earlier runs of this test).
        lines = resp.iter_lines()
        for line in lines:  # until the first token's chunk: the request runs in the engine
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break
        wait_for(lambda: metric(engine.url, "num_requests_running") == 1, 60, "the engine to count the request")
        assert metric(engine.url, "request_success_total", 'finished_reason="abort"') == aborted
    # The connection is closed: the server cancels, the engine aborts the request within a step.
    wait_for(
        lambda: metric(engine.url, "request_success_total", 'finished_reason="abort"') == aborted + 1,
        60,
        "the engine to abort the request",
    )
    assert metric(engine.url, "num_requests_running") == 0
    assert metric(engine.url, "num_requests_waiting") == 0
    ok = httpx.post(engine.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "change",
    [
        {"stop_token_ids": [2**70]},  # past 64 bits: msgpack could not carry it, the job's JSON does
        {"stop_token_ids": [1_000_000]},  # past the vocabulary: the engine's check
        {"prompt": "hello " * 1200},  # longer than max_model_len: the tokenizer's count, in the engine
    ],
)
def test_a_field_error_is_the_same_400_naming_the_field(servers, change):
    body = {"prompt": "x", "max_tokens": 4, "min_tokens": 2, **change}
    answers = [httpx.post(s.url + "/v1/completions", json=body, timeout=60) for s in servers]
    assert [a.status_code for a in answers] == [400, 400], answers[0].text
    assert answers[0].json() == answers[1].json()
    assert answers[0].json()["error"]["param"] == next(iter(change))
    streamed = httpx.post(servers[0].url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json() == answers[0].json()


def test_detections_cross_the_channel_as_in_process(servers, images):
    image = (images / "bus.jpg").read_bytes()
    asks = [
        {"json": {"path": str(images / "bus.jpg")}},
        {"content": image, "headers": {"content-type": "application/octet-stream"}},
        {"json": {"path": "/etc/passwd"}},  # outside the allowed roots: 400 naming path
        {"json": {"url": "http://example.com/a.jpg"}},  # no URL prefixes allowed: 400 naming url
        {"content": b"not an image", "headers": {"content-type": "application/octet-stream"}},
    ]
    for ask in asks:
        got, want = (httpx.post(s.url + "/v1/detect", timeout=60, **ask) for s in servers)
        assert (got.status_code, got.json()) == (want.status_code, want.json())
    assert httpx.post(servers[0].url + "/v1/detect", timeout=60, **asks[0]).json()["boxes"]


def test_the_server_process_holds_no_torch_and_the_engine_holds_it(servers):
    """After the tests above have sent it completions, detections and metrics scrapes."""
    engine, inproc = servers
    assert "libtorch" not in maps(engine.proc.pid)  # no torch: no OpenMP pool beside the engine's
    assert "libtorch" in maps(engine_pid(engine))
    assert "libtorch" in maps(inproc.proc.pid)  # the comparison: one process, both


def test_killing_the_engine_ends_open_streams_failed_and_health_503(tmp_path, smollm2_dir):
    server = ServeProcess("serve-doomed", tmp_path, [*serve_args(smollm2_dir), "--no-profile"])
    try:
        server.wait_ready(240)
        body = {"prompt": "Hello", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client:
            streams = [client.stream("POST", server.url + "/v1/completions", json=body) for _ in range(2)]
            responses = [s.__enter__() for s in streams]
            try:
                lines = [r.iter_lines() for r in responses]
                for it in lines:  # each stream has a token: both run in the engine
                    first = next(line for line in it if line.startswith("data: "))
                    assert json.loads(first[6:])["choices"][0]["text"]
                os.kill(engine_pid(server), signal.SIGKILL)
                rests = [sse_payloads(it) for it in lines]  # they end, within the client's timeout
            finally:
                for s in streams:
                    s.__exit__(None, None, None)
        for rest in rests:
            assert rest[-1] == "[DONE]"
            error = rest[-2]["error"]
            assert "engine process was killed by SIGKILL" in error["message"], error
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 503 and "killed by SIGKILL" in health.json()["error"]
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503 and "killed by SIGKILL" in refused.json()["error"]["message"]
        server.proc.send_signal(signal.SIGTERM)  # and it still stops as asked (uvicorn re-raises the signal)
        assert server.proc.wait(30) == -signal.SIGTERM
    finally:
        server.stop()


def gone(pid: int) -> bool:
    """Has process `pid` exited (a zombie waiting for its reaper counts)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_an_engine_never_outlives_its_server(tmp_path, tiny_llama_dir):
    """Stopped (SIGTERM: the app closes its engine) or killed (SIGKILL: the engine sees its
    socket end), the server takes its engine with it."""
    from fleet_support import embedded_args

    how = {"serve-stopped": signal.SIGTERM, "serve-killed": signal.SIGKILL}
    procs = [ServeProcess(name, tmp_path, embedded_args(tiny_llama_dir)) for name in how]
    try:
        engines = [engine_pid(p.wait_ready(240)) for p in procs]
        for p in procs:
            p.proc.send_signal(how[p.name])
        assert [p.proc.wait(30) for p in procs] == [-signal.SIGTERM, -signal.SIGKILL]
        for pid in engines:
            wait_for(lambda: gone(pid), 30, f"the engine process {pid} to exit")  # noqa: B023
    finally:
        stop_all(procs)


def test_a_start_up_error_in_the_engine_exits_as_the_in_process_server_does(tmp_path):
    """A model folder with no weights: the same message and exit status from both modes."""
    (tmp_path / "config.json").write_text("{}")
    base = [sys.executable, "-m", "tandem", "serve", "--port", "0", "--embedded", "--queues", "llm"]
    base += ["--model", str(tmp_path), "--no-profile"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    runs = [
        subprocess.run([*base, *mode], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        for mode in ([], ["--no-engine-process"])
    ]
    assert [r.returncode for r in runs] == [2, 2], [r.stderr[-2000:] for r in runs]
    errors = [[line for line in r.stderr.splitlines() if line.startswith("tandem serve: error:")] for r in runs]
    assert errors[0] == errors[1] and len(errors[0]) == 1, errors
    alone = subprocess.run([*base[:4], "--no-engine-process"], cwd=REPO, env=env, capture_output=True, text=True)
    assert alone.returncode == 2 and "--no-engine-process goes with --embedded" in alone.stderr  # not ignored
