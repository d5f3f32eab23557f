"""`tandem worker --tenants FILE --policy fair` over a real worker on the tiny Llama (Celery
submission, a `tenant` on each job, as `tandem serve` sends them): the file's weight reaches the
worker's engine. Two tenants flood equal jobs, gold of weight 3 and bronze of weight 1, on 4
slots: gold is owed 3 of them (schedulers/fair.py's slot shares) and its counter grows a third
as fast, so gold's whole flood starts while a third as many of bronze's do. Without the weight
(both 1) the two alternate, and nearly all of bronze's flood starts before gold's last job.

What is asserted is the order of first tokens (each job's record), not latencies: a busy
two-core machine makes times noise, order it does not. The worker's --concurrency exceeds the
jobs, so every job reaches the engine's waiting queue and the scheduler, not Redis, orders
them. The file holds keys and limits too: the worker takes the file `tandem serve` reads."""

from __future__ import annotations

import time

import pytest
from test_jobs_support import RedisServer, WorkerProcess

from workers.client import JobClient
from workers.settings import JobSettings

PER_TENANT = 24
TENANTS = """
[tenants.gold]
keys = ["sk-gold"]
weight = 3
requests_per_minute = 600

[tenants.bronze]
keys = ["sk-bronze"]
max_concurrent = 8
"""


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, tiny_llama_dir):
    from workers.app import make_app

    tmp = tmp_path_factory.mktemp("worker-tenants")
    (tmp / "tenants.toml").write_text(TENANTS)
    redis = RedisServer(tmp).start()
    settings = JobSettings(redis_url=redis.url)
    args = ["--queues", "llm", "--dtype", "float32", "--model", tiny_llama_dir, "--max-num-seqs", "4"]
    args += ["--concurrency", "64", "--kv-cache-bytes", str(64 << 20), "--policy", "fair"]
    args += ["--tenants", str(tmp / "tenants.toml")]
    worker = WorkerProcess("weights@tenants", redis.url, tmp, args)
    client = None
    try:
        worker.wait_ready(make_app(settings), timeout=180)
        client = JobClient(settings=settings)
        yield client, worker
    finally:
        if client is not None:
            client.close()
        worker.stop()
        redis.stop()


def test_a_weight_3_tenant_gets_three_times_the_slots_of_a_weight_1_tenant(jobs):
    client, worker = jobs
    assert "tenant weights {'gold': 3.0}" in worker.log()  # said once at start (run_worker)
    common = {"max_tokens": 16, "ignore_eos": True}
    ids = {"gold": [], "bronze": []}
    for i in range(PER_TENANT):  # interleaved, so that both are backlogged from the start
        for tenant in ids:
            ids[tenant].append(client.submit(f"Once upon a time, {i}", tenant=tenant, **common))
    sent = time.time()
    every = ids["gold"] + ids["bronze"]
    assert client.wait(every, timeout=300) == set(every)
    first = {}
    for job_id in every:
        status = client.status(job_id)
        assert status["state"] == "done", status
        first[job_id] = status["timings"]["first_token_at"]
    # The flood must be waiting in the engine, or its order proves nothing (on a busy machine the
    # submissions can be slower than the tiny model's decoding, and each job starts as it comes).
    backlog = sum(first[j] > sent for j in every)
    assert backlog >= PER_TENANT, f"only {backlog} of {2 * PER_TENANT} jobs started after the last was sent"
    last_gold = max(first[j] for j in ids["gold"])
    bronze_before = sum(first[j] < last_gold for j in ids["bronze"])
    # 3 slots to 1: about PER_TENANT / 3 = 8 of bronze's start (measured 7 and 8, and 7 beside
    # two busy loops on two cores); with the weight dropped (tenants_option returning {}) the two
    # alternate and all 24 did.
    assert bronze_before <= 14, f"{bronze_before} of bronze's {PER_TENANT} jobs started before gold's last"
