"""The worker's broker channel (workers/tasks.py BatchPop): one BLMPOP takes every message
waiting on the first non-empty list, up to the consumer's free prefetch credit, in Kombu's
order (priority lists in turn, each oldest first); a Redis without BLMPOP gets Kombu's BRPOP.

Why it matters: with `appendfsync always` every pop waits for an fsync, and one message a pop
made a flood of jobs queue up in Redis ahead of a light tenant's chat (BENCHMARKS.md, issue 31).
Counted here from Redis's own command statistics, over a real redis-server, with Kombu's
consumer as the worker runs it (ack emulation off, no_ack off, a prefetch limit)."""

from __future__ import annotations

import subprocess

import pytest
from kombu import Connection, Queue
from test_jobs_support import RedisServer, free_port, wait_for

from workers.tasks import batch_pops


def _calls(client, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("batch-pop")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def old_redis_url(tmp_path_factory):
    """A redis-server that answers BLMPOP as a Redis before 7.0 does: unknown command."""
    import redis

    port = free_port()
    folder = tmp_path_factory.mktemp("batch-pop-old")
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", ""]
    proc = subprocess.Popen([*cmd, "--rename-command", "BLMPOP", ""], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.5)

    def up():
        try:
            return client.ping()
        except redis.exceptions.RedisError:
            return False

    try:
        wait_for(up, 20, "redis-server (no BLMPOP) to accept connections")
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


class _Taker:
    """A Kombu consumer as Celery's worker makes one: ack emulation off, acks by hand."""

    def __init__(self, url: str, queue: str, prefetch: int | None = None) -> None:
        self.queue = queue
        self.conn = Connection(url, transport_options={"ack_emulation": False})
        batch_pops(self.conn.transport)
        self.conn.connect()
        self.channel = self.conn.channel()
        self.got: list = []
        self.consumer = self.conn.Consumer(
            Queue(queue, routing_key=queue), channel=self.channel, callbacks=[self._on], accept=["json"]
        )
        if prefetch is not None:
            self.consumer.qos(prefetch_count=prefetch)
        self.consumer.consume()

    def _on(self, body, message) -> None:
        self.got.append((body, message))

    def publish(self, bodies: list, priority: int = 0) -> None:
        producer = self.conn.Producer(serializer="json")
        for body in bodies:
            producer.publish(body, routing_key=self.queue, priority=priority)

    def take(self, n: int) -> list:
        """Drain until `n` messages came in all (their bodies)."""
        wait_for(lambda: self._drain() or len(self.got) >= n, 30, f"{n} messages")
        return [b for b, _ in self.got]

    def _drain(self) -> None:
        try:
            self.conn.drain_events(timeout=0.2)
        except TimeoutError:
            pass

    def close(self) -> None:
        # Acked, so that closing the channel does not put them back in Redis (Kombu restores
        # the unacked messages of a channel it closes).
        for _, message in self.got:
            if not message.acknowledged:
                message.ack()
        self.consumer.cancel()
        self.conn.release()


def test_one_pop_takes_every_waiting_message_in_kombus_order(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    taker = _Taker(redis_url, "in-order")
    try:
        taker.publish([f"late {i}" for i in range(3)], priority=9)  # polled after priority 0's list
        taker.publish([f"job {i}" for i in range(20)])
        pops, brpops = _calls(client, "blmpop"), _calls(client, "brpop")
        got = taker.take(23)
        assert got == [f"job {i}" for i in range(20)] + [f"late {i}" for i in range(3)]
        # One pop for each list, and perhaps one more that timed out waiting: not one a message.
        assert _calls(client, "blmpop") - pops <= 3, "BLMPOP took one message a pop"
        assert _calls(client, "brpop") == brpops
        assert client.llen("in-order") == 0
    finally:
        taker.close()
        client.close()


def test_a_pop_takes_no_more_than_the_free_prefetch_credit(redis_url):
    """What a worker cannot start soon stays in Redis, for the other workers to take."""
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    taker = _Taker(redis_url, "credit", prefetch=4)
    try:
        taker.publish([f"job {i}" for i in range(10)])
        assert taker.take(4) == [f"job {i}" for i in range(4)]
        taker._drain()  # no credit left: nothing more comes
        assert len(taker.got) == 4
        assert client.llen("credit") == 6
        for _, message in taker.got[:3]:
            message.ack()
        assert taker.take(7)[4:] == ["job 4", "job 5", "job 6"]
        assert client.llen("credit") == 3
        for _, message in taker.got[3:]:
            message.ack()
        assert taker.take(10)[7:] == ["job 7", "job 8", "job 9"]
    finally:
        taker.close()
        client.close()


def test_a_redis_without_blmpop_gets_brpop(old_redis_url):
    import redis

    client = redis.Redis.from_url(old_redis_url, decode_responses=True)
    taker = _Taker(old_redis_url, "old")
    try:
        taker.publish([f"job {i}" for i in range(5)])
        assert taker.take(5) == [f"job {i}" for i in range(5)]
        assert _calls(client, "brpop") >= 5  # one at a time, as Kombu does
        assert taker.channel._blmpop is False
    finally:
        taker.close()
        client.close()


def test_a_message_that_is_not_json_is_dropped_alone(redis_url):
    """Popped with others, a broken message must not take them down with it."""
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    taker = _Taker(redis_url, "garbage")
    try:
        taker.publish(["job 0"])
        client.lpush("garbage", "not json {")
        taker.publish(["job 1"])
        assert taker.take(2) == ["job 0", "job 1"]
        assert client.llen("garbage") == 0
    finally:
        taker.close()
        client.close()
