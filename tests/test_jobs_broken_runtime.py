"""A worker whose Runtime breaks (its loop hits an error it cannot survive) stops taking jobs and
exits non-zero (host.EXIT_RUNTIME_BROKEN), so that a supervisor restarts it; the jobs it ran
finish on the other worker, with the tokens they would have had, and none is marked failed."""

from __future__ import annotations

import pytest
from test_jobs_support import RedisServer, WorkerProcess, tiny_worker_args, wait_for

from workers.app import make_app
from workers.client import JobClient
from workers.host import EXIT_RUNTIME_BROKEN
from workers.settings import JobSettings

pytestmark = pytest.mark.slow
MAX_TOKENS = 120
PROMPTS = [f"Story number {i}:" for i in range(6)]


def test_a_worker_whose_runtime_broke_exits_and_its_jobs_run_elsewhere(tmp_path, tiny_llama_dir):
    from runtime import LLM, SamplingParams

    redis = RedisServer(tmp_path).start()
    settings = JobSettings(redis_url=redis.url)
    celery = make_app(settings)
    args = tiny_worker_args(tiny_llama_dir, max_num_seqs=4)
    a = WorkerProcess("a@broken", redis.url, tmp_path, args, env={"TANDEM_ALLOW_FAULTS": "1"})
    b = WorkerProcess("b@broken", redis.url, tmp_path, args)
    jobs = JobClient(settings=settings)
    try:
        llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_seqs=4)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        reference = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
        a.wait_ready(celery, timeout=180)
        b.wait_ready(celery, timeout=180)
        job_ids = [jobs.submit(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True) for p in PROMPTS]

        def a_runs_some():
            on_a = [s for s in map(jobs.status, job_ids) if (s["worker"] or "").startswith("a@broken")]
            return [s["job_id"] for s in on_a if 0 < s["progress"]["tokens"] < MAX_TOKENS]

        victims = wait_for(a_runs_some, 120, "worker a to be mid-job", interval=0.01)
        replies = celery.control.broadcast(
            "tandem_fault", arguments={"reason": "drill"}, reply=True, destination=["a@broken"], timeout=5
        )
        assert replies and replies[0]["a@broken"] == {"ok": True}
        assert a.proc.wait(30) == EXIT_RUNTIME_BROKEN, a.log()[-2000:]
        assert "its runtime broke" in a.log()

        assert jobs.wait(job_ids, timeout=120) == set(job_ids)
        for i, j in enumerate(job_ids):
            result = jobs.result(j)  # done, not failed: the broken worker wrote no final state
            assert result["token_ids"] == reference[i]
        for j in victims:
            assert jobs.status(j)["attempts"] == 2 and jobs.result(j)["worker"].startswith("b@broken")
        assert b.proc.poll() is None
        # b refuses the drill: only a worker started with TANDEM_ALLOW_FAULTS=1 takes it.
        replies = celery.control.broadcast("tandem_fault", reply=True, destination=["b@broken"], timeout=5)
        assert "error" in replies[0]["b@broken"] and b.proc.poll() is None
    finally:
        jobs.close()
        for w in (a, b):
            if w.proc.poll() is None:
                w.stop()
        redis.stop()
