"""Contract E: a seeded, sampled job gives the same tokens after its worker is SIGKILLed mid-stream
as without. The job resumes on the other worker from the tokens its stream holds, under
sampler.resumed_seed(seed, tokens_done), so its k-th new token draws what the uninterrupted
job's (tokens_done + k)-th would have."""

from __future__ import annotations

import pytest
from test_jobs_support import RedisServer, WorkerProcess, tiny_worker_args, wait_for

from workers.app import make_app
from workers.client import JobClient
from workers.settings import JobSettings

pytestmark = pytest.mark.slow
MAX_TOKENS = 64
PROMPTS = [f"Tale {i} begins" for i in range(4)]
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "ignore_eos": True}


def test_a_seeded_job_resumed_after_sigkill_gives_the_tokens_of_an_uninterrupted_run(tmp_path, tiny_llama_dir):
    from runtime import LLM, SamplingParams

    redis = RedisServer(tmp_path).start()
    settings = JobSettings(redis_url=redis.url)
    celery = make_app(settings)
    args = tiny_worker_args(tiny_llama_dir, max_num_seqs=4)
    a = WorkerProcess("a@seeded", redis.url, tmp_path, args)
    b = WorkerProcess("b@seeded", redis.url, tmp_path, args)
    jobs = JobClient(settings=settings)
    try:
        llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_seqs=4)
        params = [SamplingParams(max_tokens=MAX_TOKENS, seed=100 + i, **SAMPLING) for i in range(len(PROMPTS))]
        reference = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
        a.wait_ready(celery, timeout=180)
        b.wait_ready(celery, timeout=180)
        job_ids = [jobs.submit(p, max_tokens=MAX_TOKENS, seed=100 + i, **SAMPLING) for i, p in enumerate(PROMPTS)]

        def a_is_mid_stream():
            on_a = [s for s in map(jobs.status, job_ids) if (s["worker"] or "").startswith("a@seeded")]
            return [s["job_id"] for s in on_a if 10 < s["progress"]["tokens"] < MAX_TOKENS - 10]

        victims = wait_for(a_is_mid_stream, 120, "worker a to be mid-stream", interval=0.01)
        a.kill()
        assert jobs.wait(job_ids, timeout=120) == set(job_ids)
        for j in victims:
            assert jobs.status(j)["attempts"] == 2, f"{j} ran again after the kill"
        for i, j in enumerate(job_ids):
            assert jobs.result(j)["token_ids"] == reference[i], f"{j}: a restart changed its sampled tokens"
    finally:
        jobs.close()
        for w in (a, b):
            if w.proc.poll() is None:
                w.stop()
        redis.stop()
