"""Exactly once in effect, with the real SmolLM2 and the default lease: two LLM workers share
12 jobs; one is SIGKILLed mid-batch; every job completes once, on time, with the tokens the
in-process engine makes, and its stream reads cleanly (a `restarted` event at the seam)."""

from __future__ import annotations

import time

import pytest
from test_jobs_support import RedisServer, WorkerProcess, wait_for

from workers.app import make_app
from workers.client import JobClient
from workers.settings import JobSettings

pytestmark = pytest.mark.slow
NUM_JOBS = 12
MAX_TOKENS = 32
TOPICS = ["the sea", "bread", "a lighthouse", "winter", "copper", "bees", "a violin", "the moon", "rain", "chess"]
PROMPTS = [f"Write a few sentences about {TOPICS[i % 10]}{'!' if i >= 10 else '.'}" for i in range(NUM_JOBS)]


def _worker(name: str, redis_url: str, folder) -> WorkerProcess:
    # float32: the check compares tokens across batchings, which bfloat16 does not keep bit-stable.
    args = [
        "--queues",
        "llm",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "8",
        "--kv-cache-bytes",
        str(256 << 20),
        "--loglevel",
        "INFO",
    ]
    return WorkerProcess(name, redis_url, folder, args)


def test_sigkill_of_a_worker_mid_batch_loses_no_job_and_runs_none_twice(tmp_path):
    from runtime import LLM, SamplingParams

    redis = RedisServer(tmp_path).start()
    settings = JobSettings(redis_url=redis.url)
    producer = make_app(settings)
    a = _worker("a@test", redis.url, tmp_path)
    b = _worker("b@test", redis.url, tmp_path)
    jobs = JobClient(settings=settings)
    try:
        # The in-process reference, computed while the workers load.
        llm = LLM(max_num_seqs=8, dtype="float32")
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        reference = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
        a.wait_ready(producer, timeout=180)
        b.wait_ready(producer, timeout=180)

        job_ids = [
            jobs.submit(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, job_id=f"crash-{i}")
            for i, p in enumerate(PROMPTS)
        ]

        def a_is_mid_batch():
            on_a = [jobs.status(j) for j in job_ids]
            on_a = [s for s in on_a if (s["worker"] or "").startswith("a@test")]
            return any(0 < s["progress"]["tokens"] < MAX_TOKENS for s in on_a) and on_a

        victims = {s["job_id"] for s in wait_for(a_is_mid_batch, 120, "worker a to be mid-batch", interval=0.01)}
        a.kill()
        killed_at = time.time()

        done = jobs.wait(job_ids, timeout=120)
        assert done == set(job_ids), f"unfinished: {set(job_ids) - done}"
        results = {j: jobs.result(j) for j in job_ids}
        for i, j in enumerate(job_ids):
            assert results[j]["token_ids"] == reference[i], f"{j}: tokens differ from the in-process engine"

        restarted = {j for j in job_ids if jobs.status(j)["attempts"] == 2}
        assert victims <= restarted, "every job that was running on the killed worker ran again"
        assert all(jobs.status(j)["attempts"] == 1 for j in set(job_ids) - restarted)
        # Both workers took jobs from the one broker (b's first attempts, a's victims).
        assert any(results[j]["worker"].startswith("b@test") for j in set(job_ids) - restarted)
        for j in restarted:
            claimed_again = float(jobs.store.record(j)["claimed_at"])
            assert claimed_again - killed_at < 30, f"{j} waited {claimed_again - killed_at:.1f} s for another worker"
            assert results[j]["worker"].startswith("b@test")

        for j in job_ids:
            events = list(jobs.stream(j, timeout=10))
            tokens = [e for e in events if e["type"] == "token"]
            assert [e["type"] for e in events].count("done") == 1 and events[-1]["type"] == "done"
            assert sum(e["type"] == "restarted" for e in events) == (1 if j in restarted else 0)
            indices = [e["index"] for e in tokens]
            assert indices == [sum(len(e["token_ids"]) for e in tokens[:k]) for k in range(len(tokens))]
            assert [t for e in tokens for t in e["token_ids"]] == results[j]["token_ids"]
            assert "".join(e["text"] for e in events) == results[j]["text"]
    finally:
        jobs.close()
        for w in (a, b):
            if w.proc.poll() is None:
                w.stop()
        redis.stop()
