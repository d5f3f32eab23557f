"""The last read of a streamed answer (its result, for the usage chunk) rides out a Redis
restart as the event stream does: the chaos bench saw a stream with every token sent broken
at that read when Redis was SIGKILLed."""

from __future__ import annotations

import asyncio
import json

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from server.backends import JobsBackend, JobStream
from workers.settings import JobSettings


class FlakyRedis:
    """xrange fails `failures` times (a restarting Redis), then answers the job's final entry."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    async def xrange(self, key, count=None):
        self.calls += 1
        if self.calls <= self.failures:
            raise RedisConnectionError("Connection reset by peer")
        return [("1-0", {"result": json.dumps({"usage": {"completion_tokens": 7}})})]


def _backend(redis, reconnect_s: float) -> JobsBackend:
    backend = JobsBackend(JobSettings(redis_url="redis://127.0.0.1:1/0", reconnect_s=reconnect_s))
    backend.redis = redis
    return backend


def test_the_result_read_is_retried_through_a_short_outage():
    redis = FlakyRedis(failures=3)
    result = asyncio.run(_backend(redis, reconnect_s=5.0).result("j1"))
    assert result == {"usage": {"completion_tokens": 7}} and redis.calls == 4


def test_past_reconnect_s_the_error_is_raised_and_usage_is_empty_not_a_broken_stream():
    backend = _backend(FlakyRedis(failures=10**6), reconnect_s=0.2)
    with pytest.raises(RedisConnectionError):
        asyncio.run(backend.result("j1"))
    stream = JobStream(backend, "j1", None, None)
    assert asyncio.run(stream.usage()) == {}
