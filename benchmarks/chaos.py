"""`tandem bench chaos`: a bounded soak of the whole fleet under faults, on loopback.

    fleet    a private redis-server (append-only, appendfsync always), --workers `tandem worker`
             processes (llm and vision), one `tandem serve`, each on a free loopback port
    load     --clients asyncio tasks, each in a loop: a streamed chat (OpenAI's endpoint), a
             job (POST /v1/jobs, then its events over SSE, resumed with Last-Event-ID, then
             GET /v1/jobs/{id}), or a detect upload (a small generated PNG on /v1/detect)
    faults   seeded, between 10% and 70% of --duration-s (the last 30% shows the recovery):
             `kill` SIGKILLs a random worker and starts a new one (N stay up); `redis` stops
             Redis (SIGTERM or SIGKILL, drawn) and starts it again on its port and folder, from
             its append-only file; `drop` closes a client's connection mid-stream (a chat: the
             server cancels its job; a job's event stream: the client resumes it). `--faults
             kill@4,redis-kill@9` gives a fixed plan instead (seconds from the load's start)

Why appendfsync always and not everysec: submit's 202 promises the job is recorded; with
everysec a SIGKILLed Redis forgets up to a second of acknowledged writes, so the bench would
measure Redis's documented window, not Tandem. `--fsync everysec` measures that window.

The accounting (what "accepted", "completed exactly once", "lost", "duplicated" and "mismatched"
mean) is pure and lives in benchmarks/chaos_accounting.py: this module runs the fleet, the load
and the faults, gathers the evidence (every client's view, every job's record and streams in
Redis) and hands it over.

Greedy token equality: every done LLM job linked to a request (a unique ticket in each prompt)
is run again at the end through an in-process `runtime.LLM` on the job's own prompt token ids,
and the token ids are compared.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.chaos_accounting import (
    FINAL,
    KINDS,
    account,
    audit_job,
    latency_table,
    load_seconds,
    ticket,
    ticket_of,
    without_a_live_worker,
)
from benchmarks.common import QUESTIONS, cpu_info, free_port, no_nan, python_env

FAULT_KINDS = ("kill", "redis", "redis-kill", "redis-term", "drop")
KIND_WEIGHTS = dict(zip(KINDS, (0.4, 0.4, 0.2)))  # chat, job, detect


def add_chaos_arguments(p) -> None:
    p.add_argument("--duration-s", type=float, default=180.0, help="seconds of load (faults in 10%%..70%%)")
    p.add_argument("--workers", type=int, default=2, help="`tandem worker` processes kept up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/chaos")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="float32: tokens compare")
    p.add_argument("--clients", type=int, default=4, help="client tasks, each one request at a time")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per chat and job (ignore_eos)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--kv-cache-bytes", type=int, default=128 << 20, help="per worker")
    p.add_argument("--lease-s", type=float, default=10.0, help="TANDEM_LEASE_S of the workers (heartbeat: lease/5)")
    p.add_argument("--fsync", choices=["always", "everysec"], default="always", help="Redis appendfsync")
    p.add_argument("--fault-interval-s", type=float, default=12.0, help="mean seconds between random faults")
    p.add_argument(
        "--faults",
        default="kill,redis,drop",
        help=f"kinds for the random schedule ({', '.join(FAULT_KINDS)}), or a fixed plan KIND@SECONDS,...",
    )
    p.add_argument("--drain-s", type=float, default=120.0, help="seconds after the load for accepted work to end")
    p.add_argument("--startup-timeout", type=float, default=600.0)


# ---------------------------------------------------------------- the fault plan


def parse_faults(text: str) -> tuple[list[str], list[tuple[float, str]] | None]:
    """(kinds, fixed plan or None) from --faults; ValueError naming --faults."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError("--faults must name at least one fault")
    fixed = ["@" in s for s in items]
    if any(fixed) and not all(fixed):
        raise ValueError(f"--faults must be all kinds or all KIND@SECONDS, got {text!r}")
    plan = []
    for s in items:
        kind, _, at = s.partition("@")
        if kind not in FAULT_KINDS:
            raise ValueError(f"--faults: unknown fault {kind!r} (one of {', '.join(FAULT_KINDS)})")
        if at:
            try:
                plan.append((float(at), kind))
            except ValueError:
                raise ValueError(f"--faults: {s!r} needs a number of seconds after @") from None
    return [s.partition("@")[0] for s in items], (sorted(plan) if all(fixed) else None)


def fault_schedule(kinds: list[str], duration_s: float, interval_s: float, seed: int) -> list[tuple[float, str]]:
    """Exponential gaps (mean `interval_s`) from 10% to 70% of the run; kinds taken round-robin
    in seeded shuffled rounds, so each kind comes up even in a short run."""
    rng = random.Random(f"{seed}-faults")
    t, end, out, bag = 0.1 * duration_s, 0.7 * duration_s, [], []
    while True:
        t += rng.expovariate(1.0 / interval_s)
        if t > end:
            return out
        if not bag:
            bag = rng.sample(kinds, len(kinds))
        out.append((round(t, 2), bag.pop()))


# ---------------------------------------------------------------- processes


def _die_with_parent() -> None:
    # A child killed with the bench (even by SIGKILL) must not outlive it: PR_SET_PDEATHSIG.
    # Children are started from the main thread only, which lives as long as the bench.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


class Child:
    """A process in a session of its own (its group is signalled as one), logging to a file."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict | None = None) -> None:
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def rss_mb(self) -> float | None:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self, timeout: float = 20) -> None:
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # and whatever of its group outlived it
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


class Fleet:
    """Redis, the workers and the server of one run; `close()` stops every one of them."""

    def __init__(self, args, tmp: Path, logs: Path) -> None:
        self.args, self.tmp, self.logs = args, tmp, logs
        self.redis_port, self.http_port = free_port(), free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.url = f"http://127.0.0.1:{self.http_port}"
        (tmp / "redis").mkdir()
        self.redis: Child | None = None
        self.server: Child | None = None
        self.workers: dict[str, Child] = {}
        self.retired: list[Child] = []
        self._next = 0
        heartbeat = args.lease_s / 5
        self.env = {
            **python_env(),
            "PYTHONUNBUFFERED": "1",
            "TANDEM_REDIS_URL": self.redis_url,
            "TANDEM_LEASE_S": str(args.lease_s),
            "TANDEM_HEARTBEAT_S": str(heartbeat),
        }

    def start_redis(self) -> None:
        cmd = ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1"]
        cmd += ["--dir", str(self.tmp / "redis"), "--save", "", "--appendonly", "yes"]
        cmd += ["--appendfsync", self.args.fsync, "--logfile", str(self.logs / "redis.log")]
        self.redis = Child("redis", cmd, self.logs / "redis.out")

    def redis_up(self) -> bool:
        import redis

        try:
            with redis.Redis(port=self.redis_port, socket_connect_timeout=0.5, socket_timeout=2) as r:
                return bool(r.ping())
        except redis.exceptions.RedisError:  # refused, or still loading its append-only file
            return False

    def start_worker(self) -> str:
        self._next += 1
        name = f"w{self._next}"
        a = self.args
        cmd = [sys.executable, "-m", "tandem", "worker", "--redis-url", self.redis_url, "--queues", "llm,vision"]
        cmd += ["--hostname", f"chaos-{name}@%h", "--loglevel", "WARNING", "--dtype", a.dtype, "--no-profile"]
        cmd += ["--max-num-seqs", str(a.max_num_seqs), "--kv-cache-bytes", str(a.kv_cache_bytes)]
        cmd += ["--vision-max-batch-size", "2"] + (["--model", a.model] if a.model else [])
        self.workers[name] = Child(name, cmd, self.logs / f"worker-{name}.log", self.env)
        return name

    def start_server(self) -> None:
        cmd = [sys.executable, "-m", "tandem", "serve", "--host", "127.0.0.1", "--port", str(self.http_port)]
        cmd += ["--redis-url", self.redis_url, "--request-timeout", "300"]
        self.server = Child("serve", cmd, self.logs / "serve.log", self.env)

    def kill_worker(self, rng: random.Random) -> str | None:
        alive = sorted(n for n, w in self.workers.items() if w.alive())
        if not alive:
            return None
        name = rng.choice(alive)
        victim = self.workers.pop(name)
        victim.signal(signal.SIGKILL)
        self.retired.append(victim)
        return name

    def close(self) -> None:
        """SIGTERM to all at once (a worker's warm shutdown takes seconds), then SIGKILL to any
        group still there after a shared 20 s."""
        children = [c for c in [self.server, *self.workers.values(), *self.retired, self.redis] if c is not None]
        for c in children:
            if c.alive():
                c.signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for c in children:
            c.stop(timeout=max(0.1, deadline - time.monotonic()))


# ---------------------------------------------------------------- the load


@dataclass(slots=True)
class Op:
    id: str
    kind: str
    start: float
    max_tokens: int = 0
    end: float | None = None
    accepted: bool = False
    done: bool = False
    dropped: bool = False
    error: str = ""
    ttft: float | None = None
    job_id: str | None = None
    text: str = ""
    statuses: list[int] = field(default_factory=list)
    indices: list[tuple[int, int]] = field(default_factory=list)  # (index, tokens) per token event
    token_ids: list[int] = field(default_factory=list)
    result_token_ids: list[int] | None = None
    reconnects: int = 0


class SSE:
    """Server-sent events, one line at a time: `feed` returns (id, data) at an event's end."""

    def __init__(self) -> None:
        self.id, self.data = None, []

    def feed(self, line: str) -> tuple[str | None, str] | None:
        line = line.rstrip("\r\n")
        if not line:
            if not self.data:
                return None
            out, self.data = (self.id, "\n".join(self.data)), []
            return out
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self.data.append(value)
        elif name == "id":
            self.id = value
        return None


def shapes_png(seed: int) -> bytes:
    """A small image of the shipped detector's kind (a circle and a square), PNG-encoded."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(seed)
    img = np.full((240, 320, 3), 235, np.uint8)
    x, y = (int(v) for v in rng.integers(60, 180, 2))
    cv2.circle(img, (x, y), 35, (40, 90, 200), -1)
    cv2.rectangle(img, (x + 60, 40), (x + 120, 100), (30, 160, 60), -1)
    return cv2.imencode(".png", img)[1].tobytes()


RETRYABLE = (502, 503, 504)


class Load:
    def __init__(self, url: str, model: str, args, t0: float, stop_at: float, hard_stop: float) -> None:
        self.url, self.model, self.args = url, model, args
        self.t0, self.stop_at, self.hard_stop = t0, stop_at, hard_stop
        self.ops: list[Op] = []
        self.pending_drops = 0
        self.drops: list[dict] = []
        self.image = shapes_png(args.seed)
        self._n = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _take_drop(self, op: Op) -> bool:
        if self.pending_drops <= 0:
            return False
        self.pending_drops -= 1
        self.drops.append({"t": round(self.now(), 3), "kind": "drop", "detail": f"{op.kind} {op.id}"})
        return True

    async def client(self, k: int, http) -> None:
        rng = random.Random(f"{self.args.seed}-client-{k}")
        kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
        while time.monotonic() < self.stop_at:
            kind = rng.choices(kinds, weights)[0]
            self._n += 1
            op = Op(f"{kind[0]}{self._n}", kind, self.now(), self.args.max_tokens if kind != "detect" else 0)
            self.ops.append(op)
            try:
                await {"chat": self.chat, "job": self.job, "detect": self.detect}[kind](op, http, rng)
            except asyncio.CancelledError:
                op.error = op.error or "unfinished when the drain ended"
                raise
            except Exception as exc:  # noqa: BLE001 - one request's failure is a finding, not the end
                op.error = op.error or f"{type(exc).__name__}: {exc}"[:300]
            finally:
                op.end = self.now()

    async def _retry_wait(self, op: Op, attempt: int) -> bool:
        """Back off before the next try; False once the request's time is up."""
        if time.monotonic() > min(self.hard_stop, self.t0 + op.start + 120):
            return False
        await asyncio.sleep(min(2.0, 0.2 * 2**attempt))
        return True

    async def chat(self, op: Op, http, rng: random.Random) -> None:
        import httpx

        question = QUESTIONS[rng.randrange(len(QUESTIONS))]
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": f"{question} {ticket(op.id)}"}],
            "max_tokens": op.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for attempt in range(100):
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    op.statuses.append(resp.status_code)
                    if resp.status_code != 200:
                        await resp.aread()
                        if resp.status_code in RETRYABLE and await self._retry_wait(op, attempt):
                            continue
                        op.error = f"HTTP {resp.status_code}"
                        return
                    op.accepted = True
                    decoder = SSE()
                    async for line in resp.aiter_lines():
                        got = decoder.feed(line)
                        if got is None:
                            continue
                        if got[1] == "[DONE]":
                            op.done = not op.error
                            return
                        chunk = json.loads(got[1])
                        if chunk.get("error"):
                            op.error = f"error chunk: {json.dumps(chunk['error'])[:200]}"
                            continue
                        for choice in chunk.get("choices") or []:
                            delta = (choice.get("delta") or {}).get("content") or ""
                            if delta and op.ttft is None:
                                op.ttft = self.now() - op.start
                            op.text += delta
                        if op.text and self._take_drop(op):
                            op.dropped = True
                            return  # leaving the block closes the connection mid-stream
                    op.error = "the stream ended before [DONE]"
                    return
            except httpx.HTTPError as exc:
                if op.accepted:
                    op.error = f"stream broken: {type(exc).__name__}: {exc}"[:300]
                    return
                op.statuses.append(0)
                if not await self._retry_wait(op, attempt):
                    op.error = f"{type(exc).__name__}: {exc}"[:300]
                    return

    async def job(self, op: Op, http, rng: random.Random) -> None:
        import httpx

        op.job_id = f"chaos{self.args.seed}-{op.id}"
        question = QUESTIONS[rng.randrange(len(QUESTIONS))]
        body = {
            "prompt": f"{question} {ticket(op.id)}",
            "max_tokens": op.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "job_id": op.job_id,  # its own id: a retry after a lost reply is the same job
        }
        attempt = 0
        while not op.accepted:
            try:
                resp = await http.post("/v1/jobs", json=body)
                op.statuses.append(resp.status_code)
                if resp.status_code == 202:
                    op.accepted = True
                    break
                if resp.status_code not in RETRYABLE:
                    op.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    return
            except httpx.HTTPError:
                op.statuses.append(0)
            if not await self._retry_wait(op, attempt):
                op.error = op.error or "never accepted"
                return
            attempt += 1
        last, final = None, None
        while final is None:
            headers = {"Last-Event-ID": last} if last else {}
            try:
                async with http.stream("GET", f"/v1/jobs/{op.job_id}/events", headers=headers) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        raise httpx.HTTPError(f"HTTP {resp.status_code}")
                    decoder = SSE()
                    async for line in resp.aiter_lines():
                        got = decoder.feed(line)
                        if got is None:
                            continue
                        last, event = got[0] or last, json.loads(got[1])
                        if event["type"] == "token":
                            if op.ttft is None:
                                op.ttft = self.now() - op.start
                            op.indices.append((int(event.get("index", 0)), len(event.get("token_ids") or [])))
                            op.token_ids.extend(event.get("token_ids") or [])
                            if self._take_drop(op):
                                break  # closed mid-stream; resumed below from `last`
                        elif event["type"] in FINAL:
                            final = event
                            break
            except httpx.HTTPError:
                pass
            if final is None:
                op.reconnects += 1
                if time.monotonic() > self.hard_stop:
                    op.error = "no final event by the end of the drain"
                    return
                await asyncio.sleep(0.2)
        if final["type"] != "done":
            op.error = f"the job ended {final['type']}: {final.get('error', '')}"[:300]
            return
        while op.result_token_ids is None:
            try:
                resp = await http.get(f"/v1/jobs/{op.job_id}")
                if resp.status_code == 200:
                    op.result_token_ids = (resp.json().get("result") or {}).get("token_ids")
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > self.hard_stop:
                op.error = "GET /v1/jobs/{id} never answered"
                return
            await asyncio.sleep(0.2)
        op.done = True

    async def detect(self, op: Op, http, rng: random.Random) -> None:
        files = {"file": ("shapes.png", self.image, "image/png")}
        resp = await http.post("/v1/detect", files=files)
        op.statuses.append(resp.status_code)
        if resp.status_code != 200:
            op.error = f"HTTP {resp.status_code}"
            return
        record = resp.json()
        op.accepted = op.done = "boxes" in record and not record.get("error")
        if not op.done:
            op.error = f"bad record: {json.dumps(record)[:200]}"


# ---------------------------------------------------------------- faults and samples


class Chaos:
    """The fault driver and the sampler of one run, on the event loop of the load."""

    def __init__(self, fleet: Fleet, load: Load, plan: list[tuple[float, str]], seed: int) -> None:
        self.fleet, self.load, self.plan = fleet, load, plan
        self.rng = random.Random(f"{seed}-victims")
        self.faults: list[dict] = []
        self.rss: dict[str, list[tuple[float, float]]] = {}
        self.workers_up: list[tuple[float, int, int]] = []  # (t, processes alive, /health workers)

    async def drive(self) -> None:
        for at, kind in self.plan:
            await asyncio.sleep(max(0.0, self.load.t0 + at - time.monotonic()))
            if kind == "redis":
                kind = self.rng.choice(["redis-term", "redis-kill"])
            t = self.load.now()
            if kind == "kill":
                victim = self.fleet.kill_worker(self.rng)
                new = self.fleet.start_worker()  # from the loop's (main) thread: see _die_with_parent
                self.faults.append({"t": round(t, 3), "kind": "kill", "detail": f"SIGKILL {victim}, started {new}"})
            elif kind == "drop":
                self.load.pending_drops += 1  # the next stream to get a chunk closes its connection
            else:
                await self._restart_redis(kind, t)

    async def _restart_redis(self, kind: str, t: float) -> None:
        sig = signal.SIGKILL if kind == "redis-kill" else signal.SIGTERM
        old = self.fleet.redis
        old.signal(sig)
        await asyncio.to_thread(old.proc.wait, 60)
        old.log.close()
        down = self.rng.uniform(0.5, 2.0)  # clients and workers see a real outage
        await asyncio.sleep(down)
        self.fleet.start_redis()
        t_up = time.monotonic()
        while not await asyncio.to_thread(self.fleet.redis_up):
            if time.monotonic() - t_up > 60:
                raise RuntimeError("redis-server did not come back from its append-only file")
            await asyncio.sleep(0.05)
        detail = f"{signal.Signals(sig).name}, down {down:.1f} s, back in {self.load.now() - t:.1f} s"
        self.faults.append({"t": round(t, 3), "kind": kind, "detail": detail})

    async def sample(self, http, every_s: float = 1.0) -> None:
        while True:
            t = round(self.load.now(), 2)
            for name, w in list(self.fleet.workers.items()):
                mb = w.rss_mb()
                if mb is not None:
                    self.rss.setdefault(name, []).append((t, round(mb, 1)))
            try:
                seen = int((await http.get("/health", timeout=2)).json().get("workers", 0))
            except Exception:  # noqa: BLE001 - Redis down: the server answers 503
                seen = -1
            alive = sum(w.alive() for w in self.fleet.workers.values())
            self.workers_up.append((t, alive, seen))
            await asyncio.sleep(every_s)


# ---------------------------------------------------------------- the run


def audit_redis(redis_url: str) -> dict[str, dict]:
    import redis

    from workers.store import end_key, events_key, job_key

    prefix = job_key("")
    out = {}
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        for key in r.scan_iter(match=job_key("*"), count=1000):
            job_id = key[len(prefix) :]
            out[job_id] = audit_job(job_id, r.hgetall(key), r.xrange(events_key(job_id)), r.xrange(end_key(job_id)))
    return out


def link_tickets(audits: dict[str, dict], decode) -> dict[str, str]:
    """Request id -> the job its ticket links it to, from the tickets in the jobs' prompts. A
    ticket that more than one job carries is one request run as several jobs: a duplicate,
    written as evidence into the linked job's audit, so that `account` counts it once (for its
    request, or as an unlinked job when the request was refused). Pure: a decode function and
    the audits."""
    jobs: dict[str, list[str]] = {}
    for job_id in sorted(audits):  # sorted: the same job is linked however Redis lists them
        t = ticket_of(audits[job_id], decode)
        if t is not None:
            jobs.setdefault(t, []).append(job_id)
    for t, ids in jobs.items():
        if len(ids) > 1:
            audits[ids[0]]["duplicate"].append(f"{len(ids)} jobs carry ticket {t}: {', '.join(ids[:5])}")
    return {t: ids[0] for t, ids in jobs.items()}


def wait_settled(redis_url: str, timeout: float) -> None:
    """Until no job is queued or running (dropped chats' cancels, refused submits that Redis
    recorded), or `timeout`."""
    import redis

    from workers.store import job_key

    deadline = time.monotonic() + timeout
    with redis.Redis.from_url(redis_url, decode_responses=True) as r:
        while time.monotonic() < deadline:
            states = [r.hget(k, "state") for k in r.scan_iter(match=job_key("*"), count=1000)]
            if not any(s in ("queued", "running") for s in states):
                return
            time.sleep(0.5)


async def _wait_ready(fleet: Fleet, n: int, timeout: float) -> str:
    """The served model's id once /health counts n workers serving both queues."""
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=fleet.url, timeout=5) as http:
        while True:
            for c in [fleet.server, *fleet.workers.values()]:
                if not c.alive():
                    tail = c.log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{c.name} exited with {c.proc.returncode}; {c.log_path}:\n{tail}")
            try:
                h = (await http.get("/health")).json()
                if h.get("llm", 0) >= n and h.get("vision", 0) >= n:
                    return (await http.get("/v1/models")).json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} workers were not up within {timeout:.0f} s (logs in {fleet.logs})")
            await asyncio.sleep(0.5)


async def _soak(fleet: Fleet, args, plan) -> tuple[Load, Chaos]:
    import httpx
    from tqdm import tqdm

    model = await _wait_ready(fleet, args.workers, args.startup_timeout)
    t0 = time.monotonic()
    load = Load(fleet.url, model, args, t0, t0 + args.duration_s, t0 + args.duration_s + args.drain_s)
    chaos = Chaos(fleet, load, plan, args.seed)
    limits = httpx.Limits(max_connections=4 * args.clients + 4)
    async with httpx.AsyncClient(base_url=fleet.url, timeout=httpx.Timeout(30, connect=5), limits=limits) as http:
        clients = [asyncio.create_task(load.client(k, http)) for k in range(args.clients)]
        side = [asyncio.create_task(chaos.drive()), asyncio.create_task(chaos.sample(http))]
        bar = tqdm(total=int(args.duration_s), desc="chaos", unit="s", file=sys.stderr)
        try:
            while time.monotonic() < load.stop_at:
                await asyncio.sleep(1.0)
                bar.update(1)
                bar.set_postfix(
                    accepted=sum(o.accepted for o in load.ops),
                    done=sum(o.done for o in load.ops),
                    faults=len(chaos.faults) + len(load.drops),
                )
                if side[0].done() and side[0].exception():
                    raise side[0].exception()
            bar.close()
            print(f"load stopped; draining up to {args.drain_s:.0f} s", file=sys.stderr, flush=True)
            await asyncio.wait(clients, timeout=max(1.0, load.hard_stop - time.monotonic()))
        finally:
            bar.close()
            for task in clients + side:
                task.cancel()
            await asyncio.gather(*clients, *side, return_exceptions=True)
    if load.pending_drops:
        chaos.faults.append({"t": None, "kind": "drop", "detail": f"{load.pending_drops} found no stream to drop"})
    return load, chaos


def reference_tokens(args, audits: dict[str, dict], greedy_ids: list[str]) -> dict:
    """Greedy token equality: the jobs' own prompt token ids through an in-process LLM."""
    from runtime import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_cache_bytes)
    jobs = [j for j in greedy_ids if audits[j]["state"] == "done" and audits[j]["prompt_token_ids"]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([audits[j]["prompt_token_ids"] for j in jobs], params, use_tqdm=False) if jobs else []
    differ = [j for j, o in zip(jobs, outs) if o.token_ids != audits[j]["result"]["token_ids"]]
    return {"compared": len(jobs), "equal": len(jobs) - len(differ), "differ": len(differ), "differ_ids": differ[:20]}


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def run_chaos(args) -> int:
    try:
        kinds, plan = parse_faults(args.faults)
        for name in ("duration_s", "lease_s", "fault_interval_s", "drain_s"):
            if not getattr(args, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
        for name in ("workers", "clients", "max_tokens"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if args.lease_s < 1:
            raise ValueError(f"--lease-s must be >= 1 (TANDEM_LEASE_S), got {args.lease_s}")
        if shutil.which("redis-server") is None:
            raise ValueError("redis-server: not found on PATH (apt-get install redis-server)")
    except ValueError as exc:
        print(f"tandem bench chaos: error: {exc}", file=sys.stderr)
        return 2
    if plan is None:
        plan = fault_schedule(kinds, args.duration_s, args.fault_interval_s, args.seed)
    out = Path(args.out).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {cpu['flags']}", flush=True)
    print(
        f"chaos: {args.duration_s:g} s of load from {args.clients} clients on {args.workers} workers "
        f"(model {args.model or 'SmolLM2-135M-Instruct'}, {args.dtype}), lease {args.lease_s:g} s, Redis "
        f"appendfsync {args.fsync}; faults {', '.join(f'{k}@{t:g}' for t, k in plan) or 'none'}",
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    fleet = Fleet(args, tmp, logs)
    # SIGTERM ends the run as Ctrl-C does: through the finally below, which stops every process.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        fleet.start_redis()
        deadline = time.monotonic() + 30
        while not fleet.redis_up():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; see {logs / 'redis.log'}")
            time.sleep(0.05)
        for _ in range(args.workers):
            fleet.start_worker()
        fleet.start_server()
        load, chaos = asyncio.run(_soak(fleet, args, plan))
        wait_settled(fleet.redis_url, 30)
        audits = audit_redis(fleet.redis_url)
    finally:
        fleet.close()
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
    ops = [asdict(o) for o in load.ops]
    from runtime.llm.loader import load_model

    tok = load_model(args.model).tokenizer
    tickets = link_tickets(audits, tok.decode)
    counts = account(ops, audits, tickets)
    linked = [op["job_id"] or tickets.get(op["id"]) for op in ops if op["kind"] != "detect" and op["accepted"]]
    equality = reference_tokens(args, audits, sorted({j for j in linked if j in audits}))
    faults = sorted(chaos.faults + load.drops, key=lambda f: (f["t"] is None, f["t"] or 0))
    report = {
        "cpu": cpu,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "fault_plan": [{"t": t, "kind": k} for t, k in plan],
        "faults": faults,
        "num_faults": {
            k: sum(f["t"] is not None and f["kind"].startswith(k) for f in faults) for k in ("kill", "redis", "drop")
        },
        **counts,
        "token_equality": equality,
        "latency": latency_table(ops, [f for f in faults if f["t"] is not None]),
        "rss_mb": chaos.rss,
        "workers_up": chaos.workers_up,
        "without_a_live_worker": without_a_live_worker(chaos.workers_up),
        "model_load_s": sorted(
            s for log in logs.glob("worker-*.log") for s in load_seconds(log.read_text(errors="replace"))
        ),
        "lease_s": args.lease_s,
        "ops": ops,
    }
    (out / "chaos.json").write_text(json.dumps(no_nan(report), indent=1, allow_nan=False))
    _plot(report, out / "chaos.png")
    _print(report)
    print(f"wrote {out / 'chaos.json'} and {out / 'chaos.png'}; logs in {logs}")
    bad = report["lost"] or report["duplicated"] or report["mismatched"] or equality["differ"]
    return 1 if bad else 0


def _print(r: dict) -> None:
    print(f"\nCPU: {r['cpu']['model']}, {r['cpu']['cores']} cores, flags {r['cpu']['flags']}")
    for f in r["faults"]:
        print(f"  fault at {f['t'] if f['t'] is not None else '-':>7} s  {f['kind']:<10} {f['detail']}")
    by = ", ".join(f"{k} {n}" for k, n in r["accepted_by_kind"].items())
    print(
        f"requests {r['requests']}, accepted {r['accepted']} ({by}), refused {r['refused']}\n"
        f"completed exactly once {r['completed_once']}; lost {r['lost']} (goal 0); duplicated {r['duplicated']} "
        f"(goal 0); mismatched {r['mismatched']}; dropped by the bench {r['dropped']}; unverified {r['unverified']}"
    )
    red = r["redis"]
    print(f"Redis: {red['jobs']} jobs {red['states']}, {red['resumed']} resumed on another worker")
    eq = r["token_equality"]
    print(f"greedy token equality with the in-process engine: {eq['equal']}/{eq['compared']} equal")
    for d in r["details"][:10]:
        print(f"  {d['outcome']}: {d['request']} (job {d['job_id']}): {d['why']}")
    print(f"{'phase':<8}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'chat TTFT p50':>15}{'p99':>9}")
    for name, row in r["latency"].items():
        a, t = row["all"], row["chat_ttft"]
        fmt = lambda x: f"{x:.0f}" if x == x else "-"  # noqa: E731 - NaN: no request in that phase
        print(
            f"{name:<8}{a['n']:>6}{fmt(a['p50_ms']):>10}{fmt(a['p99_ms']):>10}{fmt(t['p50_ms']):>15}{fmt(t['p99_ms']):>9}"
        )
    gap, loads = r["without_a_live_worker"], r["model_load_s"]
    where = f" (from {gap['from']} s to {gap['to']} s)" if gap["from"] is not None else ""
    if loads:
        load = statistics.median(loads)
        each = ", ".join(f"{x:.1f}" for x in loads)
        goal = f"{r['lease_s']:g} + {load:.1f} = {r['lease_s'] + load:.1f} s (model loads {each} s)"
    else:  # the workers run at --loglevel WARNING: their "runtime ready in X s" lines are not written
        goal = f"{r['lease_s']:g} s + one model load (not in the workers' logs: `benchmarks worker-start` measures it)"
    print(
        f"longest interval without a live worker: {gap['seconds']:.1f} s{where}; "
        f"goal at most the lease plus one model load: {goal}"
    )
    peaks = {w: max(mb for _, mb in s) for w, s in r["rss_mb"].items() if s}
    print("worker RSS peak: " + ", ".join(f"{w} {mb:.0f} MB" for w, mb in peaks.items()))


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for kind, color in (("chat", "tab:blue"), ("job", "tab:orange"), ("detect", "tab:green")):
        done = [op for op in r["ops"] if op["kind"] == kind and op["done"] and not op["error"]]
        ax1.scatter([o["start"] for o in done], [o["end"] - o["start"] for o in done], s=8, color=color, label=kind)
    ax1.set_yscale("log")
    ax1.set_ylabel("end-to-end latency (s)")
    for w, samples in r["rss_mb"].items():
        ax2.plot([t for t, _ in samples], [mb for _, mb in samples], label=w)
    ax2.set_ylabel("worker RSS (MB)")
    ax2.set_xlabel("seconds from the start of the load")
    colors = {"kill": "red", "redis-kill": "purple", "redis-term": "magenta", "drop": "gray"}
    for f in r["faults"]:
        if f["t"] is not None:
            for ax in (ax1, ax2):
                ax.axvline(f["t"], color=colors.get(f["kind"], "black"), lw=0.8, ls="--")
    ax1.set_title(
        f"lost {r['lost']}, duplicated {r['duplicated']} of {r['accepted']} accepted; dashed: faults "
        "(red kill, purple redis SIGKILL, magenta redis SIGTERM, gray drop)",
        fontsize=9,
    )
    ax1.legend(fontsize=8, loc="upper right")
    ax2.legend(fontsize=8, loc="upper right", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="tandem bench chaos", description=__doc__.split("\n\n")[0])
    add_chaos_arguments(parser)
    return run_chaos(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
