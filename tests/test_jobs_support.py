"""Real parts for the job tests: a `redis-server` on a free loopback port and `tandem worker`
processes, started and stopped by the tests. No tests here; the job test modules import it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll `predicate` until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class RedisServer:
    """One redis-server with an append-only file fsynced at every write, so that a restart
    (even after SIGKILL) keeps everything it acknowledged."""

    def __init__(self, folder: Path) -> None:
        if shutil.which("redis-server") is None:
            # A failure, not a skip: these tests are the evidence for the job API (.ci/run installs it).
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--logfile",
                "redis.log",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)

        def up():
            try:
                return client.ping()
            except redis.exceptions.RedisError:  # connection refused, or still loading the AOF
                return False

        wait_for(up, 20, "redis-server to accept connections")
        client.close()
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def used_memory(self) -> int:
        import redis

        with redis.Redis(port=self.port) as r:
            return int(r.info("memory")["used_memory"])


class WorkerProcess:
    """`python -m workers.worker ...` with its log in a file; `wait_ready` pings it through
    Celery's control channel, which answers only once its Runtime is loaded and it consumes."""

    def __init__(self, name: str, redis_url: str, log_dir: Path, args: list[str], env: dict | None = None) -> None:
        self.name = name  # Celery node name, e.g. "w1@test"
        self.log_path = log_dir / f"{name.split('@')[0]}.log"
        full_env = {
            **os.environ,
            "TANDEM_REDIS_URL": redis_url,
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "workers.worker", "--hostname", name, "--no-profile", *args],
            cwd=REPO,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, app, timeout: float = 120) -> WorkerProcess:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.name} exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            return app.control.ping(destination=[self.name], timeout=0.5)

        wait_for(ready, timeout, f"worker {self.name} to answer a ping", interval=0.1)
        return self

    def stats(self, app) -> dict:
        replies = app.control.broadcast("tandem_stats", reply=True, destination=[self.name], timeout=5)
        for reply in replies:
            if self.name in reply:
                return reply[self.name]
        raise AssertionError(f"no tandem_stats reply from {self.name}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # Celery's warm shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def tiny_worker_args(model_dir: str, max_num_seqs: int = 8) -> list[str]:
    """An LLM-only worker on the tiny random Llama, with a small KV cache."""
    return [
        "--queues",
        "llm",
        "--dtype",
        "float32",
        "--model",
        model_dir,
        "--max-num-seqs",
        str(max_num_seqs),
        "--kv-cache-bytes",
        str(64 << 20),
        "--loglevel",
        "INFO",
    ]


class JobHost:
    """What workers.jobs.run_job and generate_body need of a WorkerHost, without its threads: a
    JobStore, an EventWriter, the jobs it holds, its counters; `runtime` a fake one, or None."""

    def __init__(self, store, worker_id: str = "w-test", runtime=None) -> None:
        from workers.writer import EventWriter

        self.store, self.settings, self.worker_id = store, store.settings, worker_id
        self.writer = EventWriter(store)
        self.runtime, self.model_name = runtime, "tiny"
        self.active: dict = {}
        self.counts: dict[str, int] = {}

    def reserve(self, job_id: str) -> bool:
        return self.active.setdefault(job_id, None) is None

    def activate(self, job) -> None:
        self.active[job.job_id] = job

    def release_job(self, job_id: str) -> None:
        self.active.pop(job_id, None)

    def runtime_broken(self):
        return None

    def count(self, state: str) -> None:
        self.counts[state] = self.counts.get(state, 0) + 1
