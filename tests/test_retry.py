"""workers/retry.py: the one backoff the job store and the server share, on a fake clock."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from workers import retry as retry_module
from workers.retry import Backoff, retry, retry_async


class Clock:
    """time.monotonic and the sleeps, advanced only by the sleeps."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s

    async def asleep(self, s: float) -> None:
        self.sleep(s)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    # The module's own names only: the event loop keeps the real clock.
    monkeypatch.setattr(retry_module, "time", SimpleNamespace(monotonic=lambda: c.now, sleep=c.sleep))
    monkeypatch.setattr(retry_module, "asyncio", SimpleNamespace(sleep=c.asleep))
    return c


def test_waits_double_to_the_cap_and_stop_before_the_deadline(clock):
    b = Backoff(0.05, budget_s=2.0)
    waits = []
    while (s := b.next_s()) is not None:
        waits.append(s)
        clock.sleep(s)
    assert waits == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]  # a seventh 0.5 s would end at 2.25 s
    b.reset()  # a success: the next outage has its own budget and starts short again
    assert b.next_s() == 0.05


def test_a_fixed_deadline_is_not_moved_by_reset(clock):
    b = Backoff(0.05, budget_s=60.0, until=clock.now + 0.1)
    assert b.next_s() == 0.05
    b.reset()
    clock.now += 0.06
    assert b.next_s() is None


def test_retry_gives_the_answer_after_failures_and_raises_past_the_deadline(clock):
    calls, seen = [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("down")
        return "ok"

    assert retry(flaky, Backoff(0.02, budget_s=1.0), (ConnectionError,), seen.append) == "ok"
    assert clock.slept == [0.02, 0.04] and len(seen) == 2

    def down() -> None:
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        retry(down, Backoff(0.02, until=clock.now + 0.1), (ConnectionError,))
    with pytest.raises(ValueError):  # not a listed error: no retry
        retry(lambda: int("x"), Backoff(0.02, budget_s=1.0), (ConnectionError,))


def test_retry_async_sleeps_the_same_waits(clock):
    calls = []

    async def flaky() -> int:
        calls.append(1)
        if len(calls) < 4:
            raise OSError("reset")
        return 7

    assert asyncio.run(retry_async(flaky, Backoff(0.05, budget_s=5.0), (OSError,))) == 7
    assert clock.slept == [0.05, 0.1, 0.2]


def test_a_backoff_needs_a_deadline():
    with pytest.raises(ValueError, match="budget_s"):
        Backoff(0.05)
