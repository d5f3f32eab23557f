"""Waiting out a Redis restart, written once: the waits between tries (`Backoff`) and the loops
around one call (`retry`, `retry_async`).

A restart that loads an append-only file takes seconds, a dropped connection milliseconds: the
first wait is short so a blip costs little, and it doubles to a cap so a long outage is polled
a couple of times a second rather than hammered. The server's event reader walks a `Backoff`
by hand, since it ends its stream with a "failed" event where these loops raise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class Backoff:
    """One outage's waits: `first_s`, doubled after each try up to `max_s`, until a deadline:
    `until` (a time.monotonic()) when given, else `budget_s` after the first failure.

    `next_s()` after a failure says how long to wait before the next try, or None when that
    wait would end at or past the deadline (give up now rather than sleep into it). `reset()`
    after a success makes the next failure start a fresh outage."""

    __slots__ = ("first_s", "max_s", "budget_s", "_until", "until", "delay_s")

    def __init__(
        self, first_s: float, *, budget_s: float | None = None, until: float | None = None, max_s: float = 0.5
    ) -> None:
        if budget_s is None and until is None:
            raise ValueError("Backoff needs budget_s (seconds from the first failure) or until (a monotonic time)")
        self.first_s, self.max_s, self.budget_s, self._until = first_s, max_s, budget_s, until
        self.reset()

    def reset(self) -> None:
        self.delay_s = self.first_s
        self.until = self._until

    def next_s(self) -> float | None:
        now = time.monotonic()
        if self.until is None:
            self.until = now + self.budget_s
        if now + self.delay_s >= self.until:
            return None
        delay = self.delay_s
        self.delay_s = min(delay * 2, self.max_s)
        return delay


def retry(
    fn: Callable[[], T],
    backoff: Backoff,
    errors: tuple[type[BaseException], ...],
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """`fn()`, tried again after each of `errors` while `backoff` allows; past it the error is
    raised. `on_retry(error)` before each wait (a log line)."""
    while True:
        try:
            return fn()
        except errors as exc:
            delay = backoff.next_s()
            if delay is None:
                raise
            if on_retry is not None:
                on_retry(exc)
            time.sleep(delay)


async def retry_async(fn: Callable[[], Awaitable[T]], backoff: Backoff, errors: tuple[type[BaseException], ...]) -> T:
    """`await fn()`, as `retry` does, sleeping without blocking the event loop."""
    while True:
        try:
            return await fn()
        except errors:
            delay = backoff.next_s()
            if delay is None:
                raise
            await asyncio.sleep(delay)
