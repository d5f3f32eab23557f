"""The fleet's metrics in Redis: each serving process (a worker, a camera service) publishes its
payload ({"kind": "runtime" | "cameras", "metrics": runtime/metrics.py's snapshot, ...}) at
every heartbeat, and `tandem serve`'s /metrics gathers every live one to render
(server/metrics.py).

    tandem:metrics                 zset: instance id -> last publish time
    tandem:metrics:{instance}      its JSON payload, expiring
"""

from __future__ import annotations

import json
import time

METRICS_INDEX = "tandem:metrics"  # Redis zset: instance id -> last publish time
METRICS_KEY = "tandem:metrics:"  # + instance id: its JSON payload, expiring


def publish(redis_client, instance: str, payload: dict, ttl_s: float) -> None:
    """Store one process's payload ({"kind": "runtime" | "cameras", "metrics": snapshot, ...})
    for `ttl_s`; a process that stops publishing drops out of the scrape when it expires."""
    body = json.dumps({**payload, "instance": instance, "published_at": time.time()})
    pipe = redis_client.pipeline(transaction=False)
    pipe.set(METRICS_KEY + instance, body, px=max(1, int(ttl_s * 1000)))
    pipe.zadd(METRICS_INDEX, {instance: time.time()})
    pipe.zremrangebyscore(METRICS_INDEX, 0, time.time() - max(60.0, 10 * ttl_s))  # long gone
    pipe.execute()


def withdraw(redis_client, instance: str) -> None:
    pipe = redis_client.pipeline(transaction=False)
    pipe.delete(METRICS_KEY + instance)
    pipe.zrem(METRICS_INDEX, instance)
    pipe.execute()


def gather(redis_client) -> list[dict]:
    """Every live process's payload."""
    instances = redis_client.zrange(METRICS_INDEX, 0, -1)
    if not instances:
        return []
    bodies = redis_client.mget([METRICS_KEY + i for i in instances])
    return [json.loads(b) for b in bodies if b]
