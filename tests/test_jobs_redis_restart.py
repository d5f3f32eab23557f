"""Redis dies (SIGKILL) and restarts from its append-only file while jobs run, and while a
client submits: the worker and the clients reconnect, and every job `submit` acknowledged
completes once, with a clean stream."""

from __future__ import annotations

import threading

import pytest
from test_jobs_support import RedisServer, WorkerProcess, tiny_worker_args

from workers.app import make_app
from workers.client import JobClient
from workers.settings import JobSettings

pytestmark = pytest.mark.slow


def test_jobs_survive_a_redis_restart(tmp_path, tiny_llama_dir):
    redis = RedisServer(tmp_path).start()
    settings = JobSettings(redis_url=redis.url)
    worker = WorkerProcess("w@test", redis.url, tmp_path, tiny_worker_args(tiny_llama_dir))
    jobs = JobClient(settings=settings)
    try:
        worker.wait_ready(make_app(settings))
        before = [jobs.submit(f"before {i}", max_tokens=150, temperature=0, ignore_eos=True) for i in range(24)]
        first = next(e for e in jobs.stream(before[0]) if e["type"] == "token")  # work is under way
        assert first["index"] == 0

        redis.kill()
        during: list[str] = []
        submitter = threading.Thread(
            target=lambda: during.extend(jobs.submit(f"during {i}", max_tokens=20) for i in range(8)), daemon=True
        )
        submitter.start()  # these calls wait for Redis to come back
        redis.start()
        submitter.join(60)
        assert len(during) == 8, "submissions made while Redis restarted were acknowledged"
        after = [jobs.submit(f"after {i}", max_tokens=20) for i in range(4)]

        job_ids = before + during + after
        assert jobs.wait(job_ids, timeout=120) == set(job_ids)
        for j in job_ids:
            result = jobs.result(j)
            events = list(jobs.stream(j, timeout=10))
            tokens = [t for e in events if e["type"] == "token" for t in e["token_ids"]]
            assert tokens == result["token_ids"], f"{j}: its stream lost or repeated tokens"
            assert [e["type"] for e in events].count("done") == 1
            assert len(result["token_ids"]) == (150 if j in before else 20)
        assert worker.proc.poll() is None
    finally:
        jobs.close()
        worker.stop()
        redis.stop()
