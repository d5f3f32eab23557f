"""Admission per tenant (server/tenants.py): token buckets for requests and tokens per minute,
caps on concurrent and queued requests, and what each tenant was served, for /metrics.

    ticket = admission.admit(tenant, num_tokens)   # Rejected (-> 429 with Retry-After) past a limit
    ticket.started()                                # its first event came: it left the queue
    ticket.finish(num_tokens)                       # ended: its slot back, its tokens reconciled

A bucket starts full (a minute's worth) and refills continuously; a request takes what it needs
if the bucket holds at least that much (or, for one larger than a minute's worth, if the bucket
is full: it could never fit, and refusing it forever would be a bug, so it runs and leaves the
bucket in debt). Tokens are estimated at admission (prompt bytes / 4, or its token ids, plus
max_tokens) and reconciled with the usage at the end: what was not used goes back. Each tenant
has its own buckets and counts: one tenant past its limits never refuses another's request.
The clock is injected (time.monotonic by default), so tests need no sleeps. One event loop
calls this: nothing here blocks or locks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.metrics import TTFT_BUCKETS, Histogram  # the engine's, so dashboards read both alike
from server.tenants import Tenant

# Rejection reasons, the `reason` label of tandem:tenant_rejections.
RPM, TPM, CONCURRENT, QUEUED = "requests_per_minute", "tokens_per_minute", "max_concurrent", "max_queued"
SLOT_RETRY_S = 1  # a cap on requests in flight frees when one ends: no clock says when
SHARE_HALF_LIFE_S = 30.0  # tandem:tenant_share weighs the last half-minute's tokens most


class Rejected(Exception):
    """A request past one of its tenant's limits: 429, Retry-After `retry_after_s`."""

    def __init__(self, tenant: str, reason: str, limit: int, retry_after_s: int) -> None:
        self.tenant, self.reason, self.limit, self.retry_after_s = tenant, reason, limit, retry_after_s
        what = {
            RPM: f"{limit} requests per minute",
            TPM: f"{limit} tokens per minute",
            CONCURRENT: f"{limit} concurrent requests",
            QUEUED: f"{limit} queued requests",
        }[reason]
        super().__init__(f"tenant {tenant!r} is past its limit of {what} ({reason}); retry in {retry_after_s} s")


class TokenBucket:
    """`capacity` units, refilled at capacity / 60 per second (a per-minute limit)."""

    def __init__(self, capacity: int, clock: Callable[[], float]) -> None:
        self.capacity = capacity
        self.rate = capacity / 60.0
        self.clock = clock
        self.level = float(capacity)
        self.at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_s(self, n: int) -> float:
        """Seconds until `n` can be taken (0: now)."""
        self._refill()
        need = min(n, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, n: int) -> None:
        self.level -= n

    def give_back(self, n: int) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + n)


@dataclass(slots=True)
class TenantState:
    tenant: Tenant
    rpm: TokenBucket | None
    tpm: TokenBucket | None
    num_running: int = 0  # admitted, not finished
    num_queued: int = 0  # admitted, no event yet
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    queue_time: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    recent: float = 0.0  # tokens served, decayed with SHARE_HALF_LIFE_S
    recent_at: float = 0.0


class Ticket:
    """One admitted request: its place in its tenant's counts until finish()."""

    def __init__(self, admission: TenantAdmission, state: TenantState, num_tokens: int) -> None:
        self._admission = admission
        self.state = state
        self.num_tokens = num_tokens  # charged to the tokens bucket at admission
        self.admitted_at = admission.clock()
        self.queued = True
        self.first_token = False
        self.done = False

    @property
    def tenant(self) -> str:
        return self.state.tenant.name

    def started(self) -> None:
        """The request's first event came (the engine took it): it leaves the queue count, and
        its wait is the tenant's queue time."""
        if self.queued and not self.done:
            self.queued = False
            self.state.num_queued -= 1
            self.state.queue_time.observe(self._admission.clock() - self.admitted_at)

    def token(self) -> None:
        """Its first token came: the tenant's TTFT."""
        self.started()
        if not self.first_token and not self.done:
            self.first_token = True
            self.state.ttft.observe(self._admission.clock() - self.admitted_at)

    def finish(self, prompt_tokens: int | None = None, completion_tokens: int | None = None) -> None:
        """Release its slot; with the usage, count what was served and give back the tokens
        estimated but not used (None: the estimate stands). Idempotent."""
        if self.done:
            return
        if self.queued:
            self.state.num_queued -= 1
        self.done = True
        s = self.state
        s.num_running -= 1
        if prompt_tokens is None and completion_tokens is None:
            return
        used = (prompt_tokens or 0) + (completion_tokens or 0)
        s.prompt_tokens += prompt_tokens or 0
        s.completion_tokens += completion_tokens or 0
        self._admission.served(s, used)
        if s.tpm is not None and used < self.num_tokens:
            s.tpm.give_back(self.num_tokens - used)


class TenantAdmission:
    """Every tenant's buckets, counts and served totals. `admit()` raises Rejected with the
    first limit passed (concurrent, queued, then requests and tokens per minute); a refused
    request takes nothing from any bucket."""

    def __init__(self, tenants: tuple[Tenant, ...], clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.states: dict[str, TenantState] = {}
        for t in tenants:
            rpm = TokenBucket(t.requests_per_minute, clock) if t.requests_per_minute else None
            tpm = TokenBucket(t.tokens_per_minute, clock) if t.tokens_per_minute else None
            self.states[t.name] = TenantState(t, rpm, tpm)

    def admit(self, tenant: str, num_tokens: int) -> Ticket:
        s = self.states[tenant]
        t = s.tenant
        if t.max_concurrent is not None and s.num_running >= t.max_concurrent:
            self._refuse(s, CONCURRENT, t.max_concurrent, SLOT_RETRY_S)
        if t.max_queued is not None and s.num_queued >= t.max_queued:
            self._refuse(s, QUEUED, t.max_queued, SLOT_RETRY_S)
        self._charge(s, num_tokens)
        s.num_running += 1
        s.num_queued += 1
        return Ticket(self, s, num_tokens)

    def charge(self, tenant: str, num_tokens: int) -> None:
        """The per-minute buckets alone, for work this server does not see to its end (a job
        API job: it outlives its request, so it holds no slot here)."""
        self._charge(self.states[tenant], num_tokens)

    def _charge(self, s: TenantState, num_tokens: int) -> None:
        for bucket, reason, n in ((s.rpm, RPM, 1), (s.tpm, TPM, num_tokens)):
            if bucket is not None:
                wait = bucket.wait_s(n)
                if wait > 0:
                    self._refuse(s, reason, bucket.capacity, max(1, math.ceil(wait)))
        if s.rpm is not None:
            s.rpm.take(1)
        if s.tpm is not None:
            s.tpm.take(num_tokens)

    def _refuse(self, s: TenantState, reason: str, limit: int, retry_after_s: int) -> None:
        s.rejections[reason] = s.rejections.get(reason, 0) + 1
        raise Rejected(s.tenant.name, reason, limit, retry_after_s)

    def served(self, s: TenantState, num_tokens: int) -> None:
        now = self.clock()
        s.recent = self._decayed(s, now) + num_tokens
        s.recent_at = now

    def _decayed(self, s: TenantState, now: float) -> float:
        return s.recent * 0.5 ** ((now - s.recent_at) / SHARE_HALF_LIFE_S)

    def served_tokens(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Count tokens served outside a ticket (a job API job's, from its usage)."""
        s = self.states[tenant]
        s.prompt_tokens += prompt_tokens
        s.completion_tokens += completion_tokens
        self.served(s, prompt_tokens + completion_tokens)

    def payload(self) -> dict:
        """{tenant: {...}} for /metrics (server/metrics.py's tenant series)."""
        now = self.clock()
        recent = {name: self._decayed(s, now) for name, s in self.states.items()}
        total = sum(recent.values())
        return {
            name: {
                "weight": float(s.tenant.weight),
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
                "running": s.num_running,
                "queued": s.num_queued,
                "share": recent[name] / total if total > 0 else 0.0,
                "rejections": dict(s.rejections),
                "queue_time": s.queue_time.to_dict(),
                "ttft": s.ttft.to_dict(),
            }
            for name, s in self.states.items()
        }


def estimate_tokens(prompt: object, prompt_bytes: int, max_tokens: object, default_max_tokens: int) -> int:
    """A request's tokens before a tokenizer saw it: its token ids, or a prompt's bytes / 4
    (English text runs 4 to 5 bytes a token), plus max_tokens (or `default_max_tokens`)."""
    n = len(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else prompt_bytes // 4
    mt = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else default_max_tokens
    return max(1, n + mt)
