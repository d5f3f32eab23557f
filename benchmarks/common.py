"""What several benchmarks share, defined once: the peers' side environments (vLLM's Python,
llama.cpp's server binary and the GGUF file it reads), the machine's CPU, seeded workloads
(random token-id prompts, chat prompts, Poisson arrivals), percentiles, a private
redis-server, and the small process helpers."""

from __future__ import annotations

import json
import math
import os
import platform
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

# The peers live in side virtual environments beside the checkout (../shared/PEERS.md).
PEERS = Path(__file__).resolve().parents[2] / "peers"
VLLM_PYTHON = str(PEERS / "vllm" / "bin" / "python")
# llama.cpp's own HTTP server (`llama-server`, parallel slots and continuous batching), built
# from the sources llama-cpp-python vendors into the llama.cpp peer's bin/: the recipe, and why
# not llama-cpp-python's own server, are in benchmarks/llm_llamacpp.py.
LLAMACPP_SERVER = str(PEERS / "llamacpp" / "bin" / "llama-server")


# ---------------------------------------------------------------- the machine and the model file


CPU_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """The CPU every figure of a run was measured on: its model name, cores, the flags that
    decide which kernels run (`flags`: AVX2, AVX-512, its bfloat16 and VNNI extensions, AMX) and
    every flag /proc/cpuinfo lists (`all_flags`). The same machine name has meant an Intel with
    AMX one day and an AMD with AVX-512 the next: a figure without these is no figure."""
    name, flags = "", []
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = value.split()
    except OSError:
        pass
    kept = [f for f in CPU_FLAGS_OF_NOTE if f in flags]
    return {
        "model": name or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "flags": " ".join(kept) if kept else ("none of " + ", ".join(CPU_FLAGS_OF_NOTE) if flags else "unknown"),
        "all_flags": " ".join(flags),
    }


def gguf_file(model: str | None) -> str | None:
    """The GGUF file a run's --model names (the default SmolLM2 package's when None, a folder's
    single .gguf), or None when the model is a Hugging Face folder: llama.cpp reads only GGUF."""
    from runtime.llm.loader import _single_gguf, default_model_path

    if model is None:
        return default_model_path()
    if model.endswith(".gguf") and os.path.isfile(model):
        return os.path.abspath(model)
    if os.path.isdir(model):
        try:
            return _single_gguf(model)
        except ValueError:
            return None
    return None


def gguf_precision(path: str) -> dict:
    """How a GGUF file stores its weights, as llama.cpp computes with them: {"short": "Q4_1
    4-bit", "long": the file type with its tensors' types counted, "file_type": "Q4_1"}."""
    from collections import Counter

    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.file_type")
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    if field is not None:
        try:
            name = gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name
        except ValueError:
            name = f"file type {int(field.parts[field.data[0]][0])}"
        ftype = re.sub(r"^(MOSTLY|ALL)_", "", name)
    else:
        ftype = counts.most_common(1)[0][0] if counts else "unknown"
    if m := re.match(r"I?Q(\d)", ftype):
        bits = f"{m.group(1)}-bit"
    else:
        bits = {"F32": "32-bit", "F16": "16-bit", "BF16": "16-bit"}.get(ftype, "")
    short = f"{ftype} {bits}".strip()
    tensors = ", ".join(f"{n} {t}" for t, n in counts.most_common())
    return {"short": short, "long": f"{short}, the GGUF as shipped (tensors: {tensors})", "file_type": ftype}


def llamacpp_server_command(
    binary: str,
    gguf_path: str,
    port: int,
    slots: int,
    max_model_len: int,
    threads: int,
    alias: str | None = None,
    extra: str = "",
) -> list[str]:
    """`llama-server` at `slots` parallel slots of `max_model_len` tokens each, continuous
    batching on, on loopback: no prompt cache (no prefix reuse across requests, as the other
    engines run with prefix caching off), /metrics on (steps and busy slots per step). `extra`:
    more of its flags, shell-split, last (so they win: "--poll 0", "--batch-size 256")."""
    import shlex

    cmd = [
        binary,
        "--model",
        gguf_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(slots),
        "--ctx-size",
        str(slots * max_model_len),  # split evenly: each slot holds max_model_len tokens
        "--no-kv-unified",
        "--cont-batching",
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--no-cache-prompt",
        "--cache-ram",
        "0",
        "--metrics",
        "--no-ui",
    ]
    return cmd + (["--alias", alias] if alias else []) + shlex.split(extra)


def llamacpp_version(binary: str) -> str:
    """`llama-server --version`'s first line ("version: 1 (0c1e570)"), or why there is none."""
    try:
        proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({type(exc).__name__}: {exc})"
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else "unknown"


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


def write_tiny_llama(out: str) -> str:
    """A 2-layer random Llama (seeded) with SmolLM2's tokenizer in the HF folder `out`: the tests'
    tiny model (tests/conftest.py), for smoke runs that measure no model."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from runtime.llm.loader import resolve_hf_dir

    tok = AutoTokenizer.from_pretrained(resolve_hf_dir(None)[0])
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class RedisServer:
    """A private redis-server on a free loopback port, append-only as in production. `kill()`
    then `start()` brings it back on the same port from its append-only file (a restart)."""

    def __init__(self, fsync: str = "always", folder: str | None = None, start: bool = True) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server not found: install it or pass --redis-url")
        self.port, self.fsync = free_port(), fsync
        self._own_dir = folder is None
        self.dir = folder if folder is not None else tempfile.mkdtemp(prefix="tandem-bench-redis-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        if start:
            self.start()

    def start(self) -> None:
        """Returns once Redis answers (its append-only file loaded)."""
        import redis

        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", ""]
        cmd += ["--appendonly", "yes", "--appendfsync", self.fsync]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with redis.Redis(port=self.port, socket_connect_timeout=0.5) as client:
            deadline = time.monotonic() + 20
            while True:
                try:
                    client.ping()
                    return
                except redis.exceptions.RedisError:  # refused, or still loading its append-only file
                    if time.monotonic() > deadline:
                        raise RuntimeError("the private redis-server did not start") from None
                    time.sleep(0.02)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
