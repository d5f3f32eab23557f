"""`tandem demo` (the README's `make demo`): the mixed workload on embedded defaults, with no
external services. Each part prints what it did and how long it took."""

from __future__ import annotations

import time

SEED_LENGTHS = [5, 50, 8, 12, 40, 3, 30, 7]


def _banner(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


def run_scheduler_demo() -> None:
    from runtime.simulate import format_report

    _banner("Schedulers: the seed example, static vs continuous batching (no model)")
    print(format_report(SEED_LENGTHS, 4))


def run_demo(vision: bool = True, llm: bool = True) -> int:
    t0 = time.perf_counter()
    run_scheduler_demo()
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")
    return 0
