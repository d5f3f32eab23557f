"""llama.cpp's side of `tandem bench llm`: its own HTTP server (`llama-server`) on the same GGUF
file Tandem loads, at the same number of parallel slots, driven through the same traces. Run by
Tandem's Python (it only speaks HTTP); the server is a process of its own.

    python -m benchmarks.llm_llamacpp --traces-file T.json --result R.json --server BIN \
        --gguf PATH.gguf --dtype Q4_1 --slots 16 --max-model-len 2048 --threads 2

It starts `llama-server --parallel SLOTS --ctx-size SLOTS*MAX_MODEL_LEN --no-kv-unified
--cont-batching` on a free loopback port (each slot holds max_model_len tokens; continuous
batching; no prompt cache, as every engine here runs with prefix caching off; /metrics on),
waits for /health, runs the warm-up and then each trace, and writes its result JSON after each
trace. Every request goes to the native /completion endpoint as the trace's token ids (so
nothing is tokenized and no BOS is added, as for the other engines), with `n_predict` = the
asked tokens and `ignore_eos` (so the output length is exact), temperature 0 (llama.cpp keeps
the top logit only), `cache_prompt` false, streamed: one event per token, each carrying its
token id. A request is sent when its arrival time has passed, on its own connection.

Figures: time to first token from the request's arrival to the first event that carries a
token; a request's end at its final event (`stop`: true, with `tokens_predicted` and the
prompt tokens it evaluated and took from a cache, `timings.prompt_n` and `cache_n`, kept to
show that no prefix was reused). Steps and slots: llama.cpp's /metrics before and after each trace,
`n_decode_total` (llama_decode calls: steps) and `n_busy_slots_per_decode` (cumulative, so busy
slots = it x the decode count, and the trace's mean = its busy slots / its steps; printed to 6
digits, exact enough). It counts the slots that are processing when a decode ends, the point
where the other engines' running requests are read. It gives no KV-use fraction (its slots own
their share of the context outright), and none is guessed.

The client is an asyncio loop in this process, on the same cores as the server: its CPU
seconds are in the result (`client_cpu_s`), as `tandem bench serve` reports its own.

Threads: --threads defaults to the CPU count, what llama.cpp picks by itself here and what
torch gives Tandem (2 on this 2-core machine). llama.cpp's workers meet at a spinning barrier
after every op, so when anything else holds one of the cores, each step waits on a thread that
is not running: on this machine, shared with other work (load average 3.5), the quick traces
gave 43 ms a step at 1 thread against 250 to 640 ms at 2, where Tandem kept 47 ms at 2. Read
its figures with the load average beside them; `--llamacpp-threads` and `--llamacpp-args`
(e.g. "--poll 0") are there to show that, not to tune a row against the others.

Installing the peer (outside the repository; ../shared/PEERS.md has the llama-cpp-python venv).
llama-cpp-python's own server (`python -m llama_cpp.server`, 0.3.36) is no stand-in: it wraps
one Llama object in a lock (llama_cpp/server/app.py), so it serves one request at a time and
has no slots. llama.cpp's `llama-server` has both, and llama-cpp-python's sdist vendors its
sources, so it is built from the same llama.cpp the venv runs:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d ../peers/src
    tar xzf ../peers/src/llama_cpp_python-0.3.36.tar.gz -C ../peers/src
    cd ../peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build --target llama-server -j2        # 20 minutes or more on 2 busy cores
    mkdir -p ../../../../llamacpp/bin && cp build/bin/llama-server ../../../../llamacpp/bin/

That puts it at ../peers/llamacpp/bin/llama-server (common.LLAMACPP_SERVER, the default of
--llamacpp-server; a static binary, no web UI, no network use). GGML_NATIVE compiles for this
CPU's flags: rebuild it on a machine with other ones (a run prints them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

from benchmarks.common import free_port, llamacpp_server_command, llamacpp_version

# llama-server's defaults, recorded with every result (not passed: what a user gets).
SERVER_DEFAULTS = {"batch_size": 2048, "ubatch_size": 512, "kv_cache_type": "f16"}


def _write(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def completion_body(prompt: list[int], max_tokens: int) -> dict:
    """One request of a trace as llama-server's /completion takes it: token ids in, exactly
    `max_tokens` out (n_predict with ignore_eos), greedy, no prompt cache, one event per token."""
    return {
        "prompt": list(prompt),
        "n_predict": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "cache_prompt": False,
        "stream": True,
    }


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name without the "llamacpp:" prefix: value}; comments and labelled
    series are left out."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "{" in line:
            continue
        name, _, value = line.partition(" ")
        try:
            out[name.removeprefix("llamacpp:")] = float(value.split()[0])
        except (ValueError, IndexError):
            continue
    return out


def step_figures(before: dict, after: dict) -> dict:
    """Steps and the mean of busy slots per step between two /metrics reads."""
    if "n_decode_total" not in before or "n_decode_total" not in after:
        return {"steps": None, "mean_running": None}
    steps = round(after["n_decode_total"] - before["n_decode_total"])
    busy = {k: m.get("n_busy_slots_per_decode", 0.0) * m["n_decode_total"] for k, m in (("a", after), ("b", before))}
    return {
        "steps": steps,
        "mean_running": (busy["a"] - busy["b"]) / steps if steps > 0 else None,
    }


async def stream_completion(client, body: dict) -> dict:
    """One streamed /completion: {"ok", "error", "first" (monotonic time of the first event
    with a token, or None), "end", "produced" (tokens counted), "predicted" (the server's
    tokens_predicted)}."""
    import httpx

    from benchmarks.serve import SSEDecoder

    res = {"ok": False, "error": "", "first": None, "end": None, "produced": 0, "predicted": None}
    decoder = SSEDecoder()
    try:
        async with client.stream("POST", "/completion", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res["error"] = f"HTTP {resp.status_code}: {text[:300]}"
                return res
            async for line in resp.aiter_lines():
                data = decoder.feed(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    res["error"] = f"error event: {json.dumps(event['error'])[:300]}"
                    return res
                if tokens := event.get("tokens"):
                    if res["first"] is None:
                        res["first"] = time.monotonic()
                    res["produced"] += len(tokens)
                if event.get("stop"):
                    res["ok"], res["end"] = True, time.monotonic()
                    res["predicted"] = event.get("tokens_predicted")
                    res["stop_type"] = event.get("stop_type")
                    timings = event.get("timings") or {}
                    res["prompt_evaluated"], res["prompt_cached"] = timings.get("prompt_n"), timings.get("cache_n")
                    break
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return res
    if not res["ok"]:
        res["error"] = "stream ended before its final event"
    return res


async def _get_metrics(client) -> dict:
    resp = await client.get("/metrics")
    resp.raise_for_status()
    return parse_metrics(resp.text)


async def run_trace_async(url: str, requests: list[dict], desc: str = "", timeout: float = 3600) -> dict:
    """One trace against a ready llama-server; the raw records the parent summarises."""
    import httpx
    from tqdm import tqdm

    n = len(requests)
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
    bar = tqdm(total=n, desc=desc, unit="req", file=sys.stderr, leave=False, mininterval=1.0, disable=not desc)
    cpu0 = time.process_time()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(timeout, connect=30)) as client:
        before = await _get_metrics(client)
        t0 = time.monotonic()

        async def one(r: dict) -> dict:
            await asyncio.sleep(max(0.0, t0 + r["arrival_s"] - time.monotonic()))
            out = await stream_completion(client, completion_body(r["prompt"], r["max_tokens"]))
            bar.update(1)
            return out

        results = await asyncio.gather(*(one(r) for r in requests))
        after = await _get_metrics(client)
    bar.close()
    failed = [(i, r["error"]) for i, r in enumerate(results) if not r["ok"]]
    if failed:
        i, why = failed[0]
        raise RuntimeError(f"{desc or 'trace'}: {len(failed)} of {n} requests failed; request {i}: {why}")
    return {
        "seconds": max(r["end"] for r in results) - t0,
        "requests": [
            {
                "asked": q["max_tokens"],
                "produced": r["produced"],
                "tokens_predicted": r["predicted"],
                "stop_type": r.get("stop_type"),
                "prompt_evaluated": r.get("prompt_evaluated"),
                "prompt_cached": r.get("prompt_cached"),
                "ttft_s": None if r["first"] is None else r["first"] - (t0 + q["arrival_s"]),
                "e2e_s": r["end"] - (t0 + q["arrival_s"]),
            }
            for q, r in zip(requests, results)
        ],
        **step_figures(before, after),
        "step_running": None,
        "step_kv": None,
        "stats_when": "llama.cpp /metrics around the trace: llama_decode calls, busy slots per call",
        "prompt_cached": sum(r.get("prompt_cached") or 0 for r in results),
        "client_cpu_s": time.process_time() - cpu0,
    }


def run_trace(url: str, requests: list[dict], desc: str = "", timeout: float = 3600) -> dict:
    return asyncio.run(run_trace_async(url, requests, desc, timeout))


# ---------------------------------------------------------------- the server process


class LlamaServer:
    """llama-server as a child of this process (in its group: the parent stopping this
    contestant's group stops the server too); its output goes to `log_path`."""

    def __init__(self, cmd: list[str], log_path: str) -> None:
        self.cmd, self.log_path = cmd, log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def tail(self, num_lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 20_000))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(lines[-num_lines:])

    def wait_ready(self, url: str, timeout: float) -> dict:
        """Poll /health until it answers 200 (503 while the model loads); then /props (what the
        server says of itself, or {} where it says nothing). RuntimeError when the process exits
        first or the time is up."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with {self.proc.returncode} before it was ready: {self.cmd}; "
                    f"last lines of {self.log_path}:\n{self.tail()}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"llama-server was not ready within {timeout:.0f} s; last lines of {self.log_path}:\n{self.tail()}"
                )
            time.sleep(0.25)
        try:
            props = httpx.get(f"{url}/props", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            props = {}
        return props if isinstance(props, dict) else {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llm_llamacpp", description=__doc__.split("\n\n")[0])
    p.add_argument("--traces-file", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--server", required=True, help="the llama-server binary")
    p.add_argument("--gguf", required=True)
    p.add_argument("--dtype", required=True, help="the GGUF's file type, as the rows name it (Q4_1)")
    p.add_argument("--precision", default=None, help="the GGUF's precision in words, for the report")
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--extra", default="", help="more llama-server flags, one string")
    p.add_argument("--server-log", default=None, help="llama-server's output (default: beside --result)")
    args = p.parse_args(argv)
    with open(args.traces_file) as f:
        data = json.load(f)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = llamacpp_server_command(
        args.server, args.gguf, port, args.slots, args.max_model_len, args.threads, extra=args.extra
    )
    result = {
        "contestant": "llama.cpp",
        "dtype": args.dtype,
        "precision": args.precision or args.dtype,
        "version": llamacpp_version(args.server),
        "gguf": args.gguf,
        "command": cmd,
        "runs": {},
    }
    server_log = args.server_log or os.path.join(os.path.dirname(os.path.abspath(args.result)), "llamacpp-server.log")
    result["server_log"] = server_log
    t = time.perf_counter()
    server = LlamaServer(cmd, server_log)
    try:
        props = server.wait_ready(url, args.startup_timeout)
        result["load_s"] = time.perf_counter() - t
        result["config"] = {
            "max_num_seqs": props.get("total_slots", args.slots),
            "slot_ctx": args.max_model_len,
            "ctx_size": args.slots * args.max_model_len,
            "threads": args.threads,
            "continuous_batching": True,
            "prompt_cache": False,
            "build_info": props.get("build_info"),
            **SERVER_DEFAULTS,
        }
        t = time.perf_counter()
        run_trace(url, data["warmup"], "llama.cpp warm-up")
        result["warmup_s"] = time.perf_counter() - t
        for name in data["order"]:
            result["runs"][name] = run_trace(url, data["traces"][name]["requests"], f"llama.cpp {name}")
            _write(args.result, result)  # what is done survives a later crash
    finally:
        server.stop()
    _write(args.result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
