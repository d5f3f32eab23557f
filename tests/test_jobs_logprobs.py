"""Contract C end to end: a generate job that asks for logprobs carries them on every token event
(a list aligned with its token_ids) and whole in its result, with the stop_reason that ended it;
the embedded backend's HandleStream yields the same event shape. Compared with the in-process
engine of the same model (the tiny random Llama), token for token."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from workers.client import JobClient

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """(token ids, logprobs) of the greedy answer, and the stop token id that ends it early."""
    from runtime import LLM, SamplingParams

    llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_seqs=2)
    free = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2, stop_token_ids=[stop_id])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.stop_reason == stop_id
    return out.token_ids, out.logprobs, stop_id


def _same_logprobs(got: list[dict], want: list[dict]) -> None:
    assert [g["token_id"] for g in got] == [w["token_id"] for w in want]
    for g, w in zip(got, want):
        assert g["token"] == w["token"] and g["bytes"] == w["bytes"]
        assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
        assert [t["token_id"] for t in g["top"]] == [t["token_id"] for t in w["top"]] and len(g["top"]) == 2


def test_a_job_streams_logprobs_aligned_with_its_tokens_and_ends_with_its_stop_reason(shared_fleet, reference):
    """On the session's shared worker (tests/fleet_support.py), with job ids of this module's own."""
    ids, logprobs, stop_id = reference
    fleet = shared_fleet.ready()
    jobs = JobClient(settings=fleet.settings)
    try:
        job = jobs.submit(
            PROMPT,
            job_id=f"logprobs-stop-{uuid.uuid4().hex[:8]}",
            max_tokens=12,
            temperature=0,
            ignore_eos=True,
            logprobs=2,
            stop_token_ids=[stop_id],
        )
        result = jobs.result(job, timeout=60)
        assert result["token_ids"] == ids and result["finish_reason"] == "stop"
        assert result["stop_reason"] == stop_id  # an int stays an int
        _same_logprobs(result["logprobs"], logprobs)
        events = list(jobs.stream(job, timeout=10))
        tokens = [e for e in events if e["type"] == "token"]
        assert all(len(e["logprobs"]) == len(e["token_ids"]) for e in tokens)
        _same_logprobs([lp for e in tokens for lp in e["logprobs"]], logprobs)
        assert events[-1]["type"] == "done" and events[-1]["stop_reason"] == stop_id
        plain_id = jobs.submit(
            PROMPT, job_id=f"logprobs-plain-{uuid.uuid4().hex[:8]}", max_tokens=3, temperature=0, ignore_eos=True
        )
        plain = jobs.result(plain_id, timeout=60)
        assert plain["logprobs"] is None and plain["stop_reason"] is None  # not asked: null
        assert all("logprobs" not in e for e in jobs.stream(plain["job_id"], timeout=10))
    finally:
        jobs.close()


def test_the_embedded_backend_yields_the_same_event_shape(tiny_llama_dir, reference):
    from runtime.runtime import Runtime
    from server.embedded import EmbeddedBackend
    from server.protocol import Generation

    ids, logprobs, stop_id = reference
    rt = Runtime(llm={"model": tiny_llama_dir, "dtype": "float32", "max_num_seqs": 2}, profile=False)
    backend = EmbeddedBackend(rt, "tiny")

    async def run() -> list:
        job = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2}
        gen = Generation("completion", "tiny", {**job, "stop_token_ids": [stop_id]})
        stream = await backend.generate(gen, 60)
        return [e async for e in stream.events()]

    try:
        events = asyncio.run(run())
    finally:
        rt.close(drain=False, timeout=30)
    tokens = [e for e in events if e.type == "token"]  # workers.events.JobEvent, as the workers' are
    assert [t for e in tokens for t in e.token_ids] == ids
    assert all(len(e.logprobs) == len(e.token_ids) for e in tokens)
    _same_logprobs([lp for e in tokens for lp in e.logprobs], logprobs)
    assert events[-1].to_dict() == {
        "type": "done",
        "text": "",
        "token_ids": [],
        "finish_reason": "stop",
        "stop_reason": stop_id,
    }
