"""What several benchmarks share, defined once: the peers' side environments, seeded
workloads (random token-id prompts, chat prompts, Poisson arrivals), percentiles, a private
redis-server, and the small process helpers."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

# The peers live in side virtual environments beside the checkout (../shared/PEERS.md).
VLLM_PYTHON = str(Path(__file__).resolve().parents[2] / "peers" / "vllm" / "bin" / "python")


# ---------------------------------------------------------------- workloads


def random_prompts(num: int, length: int, vocab_size: int, seed: int | str) -> list[list[int]]:
    """`num` prompts of exactly `length` token ids. Ids come from the middle of the vocabulary:
    Llama-family tokenizers keep their special and byte tokens at the low end, and some pad the top."""
    lo, hi = min(1000, vocab_size // 4), max(vocab_size - 1000, vocab_size * 3 // 4)
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(num)]


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the phase start: all at 0 for an infinite rate, else a
    Poisson process (exponential gaps, seeded), the first request at 0."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


# The chat workload of `tandem bench jobs` (benchmarks/jobs.py): chat prompts with output lengths
# drawn at random, log-uniform or uniform.
QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis to a child.",
    "Write a short poem about rain.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a recipe idea with lentils.",
    "What causes tides?",
    "Summarise the plot of a heist movie you invent.",
    "How do vaccines work?",
    "Suggest a name for a bakery.",
    "What is a prime number?",
    "Describe a sunset over the sea.",
]


def chat_workload(tokenizer, n: int, lo: int, hi: int, seed: int, dist: str) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    draw = (
        (lambda: round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        if dist == "loguniform"
        else (lambda: rng.randint(lo, hi))
    )
    prompts, lengths = [], []
    for i in range(n):
        msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
        lengths.append(draw())
    return prompts, lengths


# ---------------------------------------------------------------- statistics and reports


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated between closest ranks (numpy's
    default, and what vLLM's benchmark client reports), so the figures compare with its."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    i = int(k)
    return s[i] if i + 1 >= len(s) else s[i] + (s[i + 1] - s[i]) * (k - i)


def no_nan(obj):
    """The report with null for NaN (percentiles of a phase where every request failed): strict JSON."""
    if isinstance(obj, float):
        return None if obj != obj else obj
    if isinstance(obj, dict):
        return {k: no_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [no_nan(v) for v in obj]
    return obj


# ---------------------------------------------------------------- processes


def model_dir(model: str | None) -> tuple[str, int]:
    from runtime.llm.loader import resolve_hf_dir

    hf_dir, _ = resolve_hf_dir(model)
    with open(os.path.join(hf_dir, "config.json")) as f:
        return hf_dir, int(json.load(f)["vocab_size"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class RedisServer:
    """A private redis-server on a free loopback port, append-only as in production."""

    def __init__(self, fsync: str) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server not found: install it or pass --redis-url")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="tandem-bench-redis-")
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                self.dir,
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                fsync,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.RedisError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the private redis-server did not start") from None
                time.sleep(0.05)
        client.close()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
