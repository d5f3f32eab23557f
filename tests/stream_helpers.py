"""Helpers shared by the stream tests (tests/test_sources.py, tests/test_rtsp.py)."""

from __future__ import annotations

import time


def take_until(src, done, limit_s: float = 10.0) -> list:
    """Frames from `src` until `done(frames)` holds. next_batch wakes on every frame and error,
    so `limit_s` is only a safety limit, reached when `done` never comes true."""
    frames, deadline = [], time.monotonic() + limit_s
    while not done(frames):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"not done after {limit_s} s: {len(frames)} frames, health {src.health()}"
        frames.extend(src.next_batch(timeout=remaining))
    return frames
