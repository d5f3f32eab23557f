"""`tandem serve` processes for the tests, and the session's shared fleet (issue 27): one
redis-server, one `tandem worker` on the tiny random Llama serving LLM and vision, one `tandem
serve` over them, and one `tandem serve --embedded`, each started once a session on first use
instead of once per module (a worker or an embedded server is 10 to 25 s of CPU on two cores,
importing torch and Celery and building a Runtime).

Who shares it: test_serve (the fleet and the embedded server), test_jobs_logprobs and
test_image_limits (the worker), test_bad_requests (the worker, under a server of its own with
second-long body, header and keep-alive limits), test_serve_fuzz (the embedded server). Who
keeps fleets of their own, and why: test_workers_celery (a vision-only worker that must be the
only one on the vision queue). The session's second fleet, `ModelsFleet` (two models on one
Redis: SmolLM2 and the tiny Llama), serves test_fleet_models and test_serve's SmolLM2 tests:
apart from the first, because a fleet of two models refuses a request that names none.

The rule for its users: tests run one at a time (under pytest-xdist, every module that uses a fleet
runs in one process: FLEET_MODULES in tests/conftest.py), so a test that finishes its jobs (or cancels
them and waits for their end) leaves the fleet idle for the next one; a test never counts every
job in Redis, only those it made (new ids since it looked, or ids with its module's prefix)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from test_jobs_support import REPO, RedisServer, WorkerProcess, free_port, wait_for

FLEET_MAX_BODY = 256 << 10  # bus.jpg (137 kB) fits, as base64 too
FLEET_WORKER = "fleet@tests"
FLEET_TASK_THREADS = 2  # the worker's: this many long jobs running make the next one wait in Redis
FLEET_WORKER_ENV = {"TANDEM_HEARTBEAT_S": "0.5"}  # /metrics lags a worker by one heartbeat


MODELS_SMOL, MODELS_TINY = "smollm2", "tiny"  # ModelsFleet's served model names
MODELS_SMOL_WORKER, MODELS_TINY_WORKER = "smol@models", "tiny@models"


class ServeProcess:
    """`python -m tandem serve --port 0 ...` with its log in a file; `wait_ready` reads the
    URL it printed and waits for /health to answer."""

    def __init__(self, name: str, log_dir: Path, args: list[str], env: dict | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        full_env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem", "serve", "--host", "127.0.0.1", "--port", "0", *args],
            cwd=REPO,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.url = ""

    def wait_ready(self, timeout: float = 120) -> ServeProcess:
        if self.url:
            return self

        def listening():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            m = re.search(r"listening on (http://\S+)", self.log())
            return m and m.group(1)

        url = wait_for(listening, timeout, f"{self.name} to print its URL", interval=0.1)
        wait_for(lambda: answers(url + "/health"), 30, f"{self.name} to answer /health", interval=0.05)
        self.url = url
        return self

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def model_ids(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]]


def embedded_args(model_dir: str) -> list[str]:
    """`tandem serve --embedded` on the tiny Llama, LLM only."""
    return [
        "--embedded",
        "--queues",
        "llm",
        "--dtype",
        "float32",
        "--model",
        model_dir,
        "--max-num-seqs",
        "4",
        "--kv-cache-bytes",
        str(64 << 20),
        "--no-profile",
    ]


class SharedFleet:
    """The session's fleet. `start()` launches the redis-server, worker and server without
    waiting (a module may start its own processes meanwhile, so that the start-ups overlap);
    `ready()` waits for them; `embedded()` starts (once) and waits for the embedded server.

    The worker: the tiny random Llama on llm (--max-num-seqs 4) and YOLO26n at imgsz 160 on
    vision (batch 1), two task threads (so that a third job waits in Redis), `images` as its
    allowed root. The server: --max-body-bytes FLEET_MAX_BODY. The embedded server:
    --request-timeout 60 (the fuzzing's bound; the other users make short requests)."""

    def __init__(self, tmp: Path, tiny_dir: str) -> None:
        self.tmp, self.tiny_dir = tmp, tiny_dir
        self.images = tmp / "images"
        self.model = ""
        self._started: list = []
        self._ready = False
        self._embedded: ServeProcess | None = None

    def start(self) -> SharedFleet:
        if hasattr(self, "worker"):  # started (the embedded server is apart: it may come first)
            return self
        from ultralytics.utils import ASSETS

        from workers.app import make_app
        from workers.settings import JobSettings

        self.images.mkdir()
        shutil.copy(ASSETS / "bus.jpg", self.images / "bus.jpg")
        self.redis = self._add(RedisServer(self.tmp).start())
        self.settings = JobSettings(redis_url=self.redis.url)
        self.celery = make_app(self.settings)
        self.worker = self._add(
            WorkerProcess(
                FLEET_WORKER,
                self.redis.url,
                self.tmp,
                [
                    "--queues",
                    "llm,vision",
                    "--dtype",
                    "float32",
                    "--model",
                    self.tiny_dir,
                    "--max-num-seqs",
                    "4",
                    "--concurrency",
                    str(FLEET_TASK_THREADS),
                    "--kv-cache-bytes",
                    str(64 << 20),
                    "--imgsz",
                    "160",
                    "--vision-max-batch-size",
                    "1",
                ],
                env={**FLEET_WORKER_ENV, "TANDEM_ALLOWED_ROOTS": str(self.images)},
            )
        )
        self.server = self._add(
            ServeProcess(
                "serve-fleet", self.tmp, ["--redis-url", self.redis.url, "--max-body-bytes", str(FLEET_MAX_BODY)]
            )
        )
        return self

    def ready(self) -> SharedFleet:
        self.start()
        if not self._ready:
            self.worker.wait_ready(self.celery, timeout=180)
            self.server.wait_ready()
            self.model = wait_for(lambda: model_ids(self.server.url), 30, "the worker's model in /v1/models")[0]
            self._ready = True
        return self

    def start_embedded(self) -> None:
        """Launch the embedded server without waiting for it."""
        if self._embedded is None:
            nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
            self._embedded = self._add(
                ServeProcess(
                    "serve-embedded",
                    self.tmp,
                    [*embedded_args(self.tiny_dir), "--request-timeout", "60"],
                    env={"TANDEM_REDIS_URL": nowhere},
                )
            )

    def embedded(self) -> ServeProcess:
        self.start_embedded()
        return self._embedded.wait_ready()

    def _add(self, proc):
        self._started.append(proc)
        return proc

    def stop(self) -> None:
        stop_all(self._started)


class ModelsFleet:
    """The session's fleet of two models on one Redis, started on first use (`start()` launches,
    `ready()` waits): a worker on SmolLM2 served as MODELS_SMOL (LLM only; what only a real
    model answers), a worker on the tiny Llama served as MODELS_TINY (LLM, and YOLO26n at imgsz
    160 on vision), and one `tandem serve`. Each worker runs two sequences on two task threads and
    publishes its metrics every 0.5 s. One SmolLM2 worker for the session, where test_serve and
    test_fleet_models each started their own (and their own Redis and server)."""

    def __init__(self, tmp: Path, smol_dir: str, tiny_dir: str) -> None:
        self.tmp, self.smol_dir, self.tiny_dir = tmp, smol_dir, tiny_dir
        self._started: list = []
        self._ready = False

    @staticmethod
    def _llm_args(model: list[str], max_model_len: int, kv_bytes: int) -> list[str]:
        return [
            "--dtype",
            "float32",
            *model,
            "--max-num-seqs",
            "2",
            "--concurrency",
            "2",
            "--max-model-len",
            str(max_model_len),
            "--kv-cache-bytes",
            str(kv_bytes),
        ]

    def start(self) -> ModelsFleet:
        if self._started:
            return self
        from workers.app import make_app
        from workers.settings import JobSettings

        self.redis = self._add(RedisServer(self.tmp).start())
        self.celery = make_app(JobSettings(redis_url=self.redis.url))
        self.smol = self._add(
            WorkerProcess(
                MODELS_SMOL_WORKER,
                self.redis.url,
                self.tmp,
                # Named by --served-model-name here, by NAME=PATH for the tiny one: both spellings.
                [
                    "--queues",
                    "llm",
                    *self._llm_args(["--model", self.smol_dir, "--served-model-name", MODELS_SMOL], 1024, 64 << 20),
                ],
                FLEET_WORKER_ENV,
            )
        )
        self.tiny = self._add(
            WorkerProcess(
                MODELS_TINY_WORKER,
                self.redis.url,
                self.tmp,
                [
                    "--queues",
                    "llm,vision",
                    "--imgsz",
                    "160",
                    "--vision-max-batch-size",
                    "1",
                    *self._llm_args(["--model", f"{MODELS_TINY}={self.tiny_dir}"], 512, 32 << 20),
                ],
                FLEET_WORKER_ENV,
            )
        )
        self.server = self._add(ServeProcess("serve-models", self.tmp, ["--redis-url", self.redis.url]))
        return self

    def ready(self) -> ModelsFleet:
        self.start()
        if not self._ready:
            for w in (self.smol, self.tiny):
                w.wait_ready(self.celery, timeout=240)
            self.server.wait_ready()
            wait_for(
                lambda: sorted(model_ids(self.server.url)) == [MODELS_SMOL, MODELS_TINY],
                30,
                "both models in /v1/models",
            )
            self._ready = True
        return self

    def redis_client(self):
        if not hasattr(self, "_redis_client"):
            import redis

            self._redis_client = redis.Redis.from_url(self.redis.url, decode_responses=True)
        return self._redis_client

    def job_ids(self) -> set[str]:
        """Every job id in its Redis now: a test takes them before its requests, and looks only at
        the new ones."""
        from workers.store import job_key

        prefix = job_key("")
        return {k[len(prefix) :] for k in self.redis_client().scan_iter(match=job_key("*"), count=1000)}

    def _add(self, proc):
        self._started.append(proc)
        return proc

    def stop(self) -> None:
        stop_all(self._started)
        if hasattr(self, "_redis_client"):
            self._redis_client.close()


def stop_all(procs: list) -> None:
    """Servers first, then workers, then redis-servers; each group's shutdowns overlap."""
    from concurrent.futures import ThreadPoolExecutor

    for kind in (ServeProcess, WorkerProcess, RedisServer):
        group = [p for p in procs if isinstance(p, kind)]
        with ThreadPoolExecutor(max(1, len(group))) as pool:
            list(pool.map(lambda p: p.stop(), group))
