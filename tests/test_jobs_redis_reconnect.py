"""A worker that lost its Redis and regained it keeps consuming: Redis is killed and restarted
(twice, the worker idle in between), and jobs sent afterwards all run, several at once, as
before the outage. Celery's tracker has had workers that reconnect and then take nothing, or
take one message at a time (celery #8030, #10205, #10302)."""

from __future__ import annotations

import pytest
from test_jobs_support import RedisServer, WorkerProcess, tiny_worker_args, wait_for

from workers.app import make_app
from workers.client import JobClient
from workers.settings import JobSettings

pytestmark = pytest.mark.slow
NUM_JOBS = 6


def _pings(settings: JobSettings, worker: WorkerProcess) -> bool:
    """Does the worker answer a ping? Asked from a fresh client each time: a client's own broker
    connection may die with Redis too, which says nothing of the worker."""
    import redis as redis_py
    from kombu.exceptions import OperationalError

    assert worker.proc.poll() is None, f"the worker exited:\n{worker.log()[-2000:]}"
    app = make_app(settings)
    try:
        return bool(app.control.ping(destination=[worker.name], timeout=0.5))
    except (redis_py.exceptions.ConnectionError, OperationalError, OSError):
        return False
    finally:
        app.close()


def _overlapped(jobs: JobClient, job_ids: list[str]) -> bool:
    """Did some two of the jobs run at the same time (one batch, not one message at a time)?"""
    spans = []
    for j in job_ids:
        t = jobs.status(j)["timings"]
        spans.append((t["started_at"], t["finished_at"]))
    return any(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(spans) for (b0, b1) in spans[i + 1 :])


def test_a_worker_keeps_consuming_after_redis_restarts(tmp_path, tiny_llama_dir):
    redis = RedisServer(tmp_path).start()
    settings = JobSettings(redis_url=redis.url)
    celery = make_app(settings)
    worker = WorkerProcess("w@reconnect", redis.url, tmp_path, tiny_worker_args(tiny_llama_dir, max_num_seqs=8))
    jobs = JobClient(settings=settings)
    try:
        worker.wait_ready(celery, timeout=180)
        first = jobs.submit("warm up", max_tokens=4)
        jobs.result(first, timeout=60)
        for outage in range(2):
            redis.kill()
            redis.start()
            # The worker's consumer reconnects by itself; a ping through the broker says when.
            wait_for(lambda: _pings(settings, worker), 60, f"the worker to answer a ping after outage {outage}", 0.2)
            job_ids = [
                jobs.submit(f"after outage {outage}, job {i}", max_tokens=60, temperature=0, ignore_eos=True)
                for i in range(NUM_JOBS)
            ]
            done = jobs.wait(job_ids, timeout=90)
            assert done == set(job_ids), f"after outage {outage}: {len(job_ids) - len(done)} jobs never ran"
            assert all(len(jobs.result(j)["token_ids"]) == 60 for j in job_ids)
            assert _overlapped(jobs, job_ids), f"after outage {outage} the worker took one message at a time"
            assert worker.proc.poll() is None
    finally:
        jobs.close()
        worker.stop()
        redis.stop()
