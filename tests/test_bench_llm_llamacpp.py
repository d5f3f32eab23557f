"""llama.cpp's contestant of `tandem bench llm`, without llama.cpp: its requests and its parsing
against a tiny fake `llama-server` on loopback (native /completion streaming, /health,
/metrics, /props), the contestant's whole process against that fake started as its binary,
the skip reasons, the ratios and the report's precision and CPU lines. Seconds, no model.

Run as a script (`python tests/test_bench_llm_llamacpp.py --port N ...`), this file is the fake
binary itself."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest
from fake_http import FakeServer, fake_binary

from benchmarks import common
from benchmarks import llm as bench
from benchmarks import llm_llamacpp as lc


class FakeLlamaServer(FakeServer):
    """llama-server's endpoints as the benchmark uses them. /completion streams `n_predict`
    events of one token each, the first after `first_s`, then `gap_s` apart, then a final
    `stop` event with tokens_predicted (no [DONE], as llama-server's native endpoint). Every
    token emitted counts one decode with the streams open at that moment busy, so /metrics
    moves as llama.cpp's does. /health answers 503 for `loading_s` after the start."""

    stream_path = "/completion"
    rejected = {"error": {"message": "bad request", "code": 400}}
    protocol_version = "HTTP/1.1"

    def __init__(self, port=0, first_s=0.02, gap_s=0.002, loading_s=0.0, slots=4, reject=lambda body: False):
        super().__init__(port, reject)
        self.first_s, self.gap_s, self.slots = first_s, gap_s, slots
        self.ready_at = time.monotonic() + loading_s
        self.n_decode = 100  # a warm-up decoded before the benchmark's first read
        self.n_busy = 100

    def get(self, h):
        if time.monotonic() < self.ready_at:
            return h.json(503, {"error": {"message": "Loading model", "code": 503}})
        if h.path == "/health":
            return h.json(200, {"status": "ok"})
        if h.path == "/props":
            return h.json(200, {"total_slots": self.slots, "build_info": "b0-fake"})
        if h.path == "/metrics":
            with self.lock:
                per = self.n_busy / max(self.n_decode, 1)
                text = (
                    "# HELP llamacpp:n_decode_total Total number of llama_decode() calls\n"
                    "# TYPE llamacpp:n_decode_total counter\n"
                    f"llamacpp:n_decode_total {self.n_decode}\n"
                    f"llamacpp:n_busy_slots_per_decode {per!r}\n"
                    'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 0\n'
                )
            return h.text(200, text, "text/plain; version=0.0.4")
        return h.json(404, {"error": {"message": "not found"}})

    def stream(self, h, body):
        time.sleep(self.first_s)
        for i in range(body["n_predict"]):
            if i:
                time.sleep(self.gap_s)
            with self.lock:
                self.n_decode += 1
                self.n_busy += self.open
            h.event({"content": f" t{i}", "tokens": [1000 + i], "stop": False})
        h.event(
            {
                "content": "",
                "tokens": [],
                "stop": True,
                "stop_type": "limit",
                "tokens_predicted": body["n_predict"],
                "tokens_evaluated": len(body["prompt"]),
                "timings": {"prompt_n": len(body["prompt"]), "cache_n": 0},
            }
        )


def _trace(n=4, max_tokens=(3, 5, 2, 4), arrivals=None, plen=8):
    return [
        {"prompt": list(range(500 + i, 500 + i + plen)), "max_tokens": max_tokens[i % len(max_tokens)], "arrival_s": a}
        for i, a in enumerate(arrivals or [0.0] * n)
    ]


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_bench_arguments(p)
    return p.parse_args(list(argv))


def _tiny_gguf(path: Path) -> Path:
    """A GGUF of two tensors whose file type says Q4_1, as the default SmolLM2's does."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_tensor("blk.0.w", np.zeros((2, 20), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.add_tensor("norm", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------- requests and parsing


def test_completion_body_asks_exact_greedy_tokens_from_token_ids_without_the_prompt_cache():
    body = lc.completion_body((5, 6, 7), 9)
    assert body == {
        "prompt": [5, 6, 7],
        "n_predict": 9,
        "ignore_eos": True,
        "temperature": 0.0,
        "cache_prompt": False,
        "stream": True,
    }


def test_metrics_parsing_and_step_figures_between_two_reads():
    text = (
        "# HELP llamacpp:n_decode_total x\n# TYPE llamacpp:n_decode_total counter\n"
        "llamacpp:n_decode_total 40\nllamacpp:n_busy_slots_per_decode 2.5\n"
        'llamacpp:per_pos{position="0"} 3\nllamacpp:broken nope\n'
    )
    m = lc.parse_metrics(text)
    assert m == {"n_decode_total": 40.0, "n_busy_slots_per_decode": 2.5}
    after = {"n_decode_total": 100.0, "n_busy_slots_per_decode": (100 + 60 * 3) / 100}  # 60 decodes of 3 slots
    assert lc.step_figures(m, after) == {"steps": 60, "mean_running": pytest.approx((280 - 100) / 60)}
    assert lc.step_figures({}, after) == {"steps": None, "mean_running": None}
    assert lc.step_figures(m, m)["mean_running"] is None


def test_a_trace_against_the_fake_server_counts_tokens_steps_slots_and_ttft():
    reqs = _trace(arrivals=[0.0, 0.0, 0.15, 0.3])
    with FakeLlamaServer(first_s=0.05, gap_s=0.005) as fake:
        run = lc.run_trace(fake.url, reqs)
    # Requests that arrive together reach the server in either order: match them by prompt.
    sent = sorted((tuple(b["prompt"]), b["n_predict"]) for b in fake.bodies)
    assert sent == sorted((tuple(r["prompt"]), r["max_tokens"]) for r in reqs)
    assert sorted(tuple(b["prompt"]) for b in fake.bodies) == sorted(tuple(r["prompt"]) for r in reqs)
    assert all(b["ignore_eos"] and b["stream"] and not b["cache_prompt"] for b in fake.bodies)
    recs = run["requests"]
    assert [r["produced"] for r in recs] == [r["asked"] for r in recs] == [3, 5, 2, 4]
    assert [r["tokens_predicted"] for r in recs] == [3, 5, 2, 4]
    assert all(r["stop_type"] == "limit" and r["prompt_cached"] == 0 for r in recs)
    assert [r["prompt_evaluated"] for r in recs] == [8] * 4 and run["prompt_cached"] == 0
    for r in recs:
        assert 0.05 <= r["ttft_s"] < 0.05 + 1.0  # from its arrival, not from the trace's start
        assert r["e2e_s"] >= r["ttft_s"]
    assert run["seconds"] >= 0.3 + 0.05
    assert run["steps"] == 14  # one decode per token the fake emitted during the trace
    assert 1.0 <= run["mean_running"] <= 4.0
    assert run["step_running"] is None and run["step_kv"] is None and run["client_cpu_s"] >= 0
    s = bench.summarize_run(run)  # the parent's summary reads the means it was given
    assert s["useful_tokens"] == s["asked_tokens"] == 14 and s["steps"] == 14
    assert s["mean_running"] == pytest.approx(run["mean_running"]) and s["kv_mean"] is None
    assert s["ttft_p50_ms"] is not None and s["client_cpu_s"] == run["client_cpu_s"]


def test_all_at_once_requests_stream_concurrently():
    with FakeLlamaServer(first_s=0.5, gap_s=0.0) as fake:
        t = time.monotonic()
        lc.run_trace(fake.url, _trace(n=8, max_tokens=(2,)))
        wall = time.monotonic() - t
    assert fake.max_open == 8 and wall < 3.0  # one at a time would take 4 s


def test_a_failed_request_fails_the_trace_naming_it():
    with FakeLlamaServer(reject=lambda body: body["prompt"][0] == 502) as fake:
        with pytest.raises(RuntimeError, match=r"1 of 4 requests failed; request 2: HTTP 400"):
            lc.run_trace(fake.url, _trace(), desc="")


def test_stream_that_ends_without_its_final_event_is_an_error():
    class Resp:
        status_code = 200

        async def aiter_lines(self):
            for line in ['data: {"tokens": [5], "stop": false}', ""]:
                yield line

    class Client:
        def stream(self, *a, **k):
            class Ctx:
                async def __aenter__(self):
                    return Resp()

                async def __aexit__(self, *exc):
                    return False

            return Ctx()

    res = asyncio.run(lc.stream_completion(Client(), lc.completion_body([1], 3)))
    assert not res["ok"] and res["produced"] == 1 and "before its final event" in res["error"]


def test_wait_ready_waits_out_loading_and_reports_a_dead_server(tmp_path):
    with FakeLlamaServer(loading_s=0.6) as fake:
        server = lc.LlamaServer([sys.executable, "-c", "import time; time.sleep(30)"], str(tmp_path / "a.log"))
        try:
            t = time.monotonic()
            assert server.wait_ready(fake.url, 20) == {"total_slots": 4, "build_info": "b0-fake"}
            assert time.monotonic() - t >= 0.5
        finally:
            server.stop()
        assert server.proc.returncode is not None
    dead = lc.LlamaServer(
        [sys.executable, "-c", "print('no such model'); raise SystemExit(4)"], str(tmp_path / "b.log")
    )
    with pytest.raises(RuntimeError, match=r"(?s)llama-server exited with 4.*b\.log:\nno such model"):
        dead.wait_ready(f"http://127.0.0.1:{common.free_port()}", 20)


# ---------------------------------------------------------------- the contestant's process


def fake_binary_main(argv: list[str]) -> None:
    """The fake `llama-server`: `--version`, or serve on --port until SIGTERM, after writing
    its arguments to $FAKE_LLAMA_ARGV."""
    if argv == ["--version"]:
        print("version: 0 (fake)")
        return
    if os.environ.get("FAKE_LLAMA_ARGV"):
        Path(os.environ["FAKE_LLAMA_ARGV"]).write_text(json.dumps(argv))
    port = int(argv[argv.index("--port") + 1])
    slots = int(argv[argv.index("--parallel") + 1])
    with FakeLlamaServer(port=port, loading_s=0.3, slots=slots, first_s=0.01, gap_s=0.001):
        print("fake llama-server listening", flush=True)
        while True:
            time.sleep(1)


def test_the_contestant_runs_every_trace_against_its_own_server(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(tmp_path / "argv.json"))
    gguf = _tiny_gguf(tmp_path / "m.Q4_1.gguf")
    binary = fake_binary(tmp_path / "llama-server", "test_bench_llm_llamacpp", "fake_binary_main")
    args = _args("--quick", "--slots", "3", "--max-model-len", "256", "--llamacpp-server", str(binary))
    args.llamacpp_args = "--poll 0"
    args.model = str(gguf)
    assert bench.llamacpp_state(args) == "run"
    assert args.llamacpp_gguf[1]["short"] == "Q4_1 4-bit"
    data = bench.make_traces(["short", "poisson"], 5000, seed=0, num_requests=3, quick=True)
    traces_file = tmp_path / "traces.json"
    traces_file.write_text(json.dumps(data))
    res = bench.run_contestant(bench.LLAMACPP, args, "Q4_1", tmp_path, traces_file, str(tmp_path))
    assert "error" not in res, res.get("error")
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("--parallel") + 1] == "3" and argv[argv.index("--ctx-size") + 1] == str(3 * 256)
    assert "--cont-batching" in argv and "--no-cache-prompt" in argv and "--metrics" in argv
    assert argv[argv.index("--model") + 1] == str(gguf) and argv[-2:] == ["--poll", "0"]
    assert res["version"] == "version: 0 (fake)" and res["precision"] == "Q4_1 4-bit"
    assert res["config"]["max_num_seqs"] == 3 and res["config"]["slot_ctx"] == 256
    assert res["load_s"] >= 0.3 and Path(res["log"]).exists()
    assert "fake llama-server listening" in Path(res["server_log"]).read_text()  # its own log, beside the result
    assert Path(res["server_log"]).parent == tmp_path
    rows = bench.rows_of(bench.LLAMACPP, "Q4_1", ["short", "poisson"], res)
    for row, trace in zip(rows, ("short", "poisson")):
        asked = sum(r["max_tokens"] for r in data["traces"][trace]["requests"])
        assert row["precision"] == "Q4_1 4-bit" and row["dtype"] == "Q4_1"
        assert row["useful_tokens"] == row["asked_tokens"] == asked and row["steps"] == asked
        assert row["ttft_p50_ms"] is not None and row["mean_running"] >= 1 - 1e-9


def test_a_server_that_dies_at_start_is_an_error_row_with_its_log(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'error: unknown argument: --no-kv-unified' >&2\nexit 1\n")
    binary.chmod(0o755)
    args = _args("--quick", "--llamacpp-server", str(binary))
    args.model = str(_tiny_gguf(tmp_path / "m.gguf"))
    assert bench.llamacpp_state(args) == "run"
    data = bench.make_traces(["short"], 5000, seed=0, quick=True)
    (tmp_path / "t.json").write_text(json.dumps(data))
    res = bench.run_contestant(bench.LLAMACPP, args, "Q4_1", tmp_path, tmp_path / "t.json", str(tmp_path))
    assert "llama.cpp (Q4_1) exited with status 1" in res["error"]
    assert "unknown argument: --no-kv-unified" in res["error"] and "exited with 1 before it was ready" in res["error"]


# ---------------------------------------------------------------- skips, ratios, the report


def test_llamacpp_state_says_plainly_why_it_does_not_run(tmp_path):
    missing = tmp_path / "nope" / "llama-server"
    assert bench.llamacpp_state(_args("--llamacpp-server", str(missing))) == (
        f"not run: --llamacpp-server {missing} does not exist"
    )
    assert bench.llamacpp_state(_args("--no-llamacpp", "--llamacpp-server", sys.executable)) == (
        "not run: --no-llamacpp"
    )
    none = _args()
    none.llamacpp_server = None
    assert bench.llamacpp_state(none).startswith(f"not run: no llama-server at {common.LLAMACPP_SERVER}")
    assert "benchmarks/llm_llamacpp.py says how to build it" in bench.llamacpp_state(none)
    hf = tmp_path / "hf"
    hf.mkdir()
    args = _args("--llamacpp-server", sys.executable, "--model", str(hf))
    assert bench.llamacpp_state(args) == f"not run: --model {hf} is no GGUF file (llama.cpp reads GGUF only)"
    assert args.llamacpp_gguf is None


def test_gguf_precision_and_file_lookup(tmp_path):
    path = _tiny_gguf(tmp_path / "x.gguf")
    prec = common.gguf_precision(str(path))
    assert prec["short"] == "Q4_1 4-bit" and prec["file_type"] == "Q4_1"
    assert "1 Q4_1, 1 F32" in prec["long"] and "as shipped" in prec["long"]
    assert common.gguf_file(str(path)) == str(path)
    assert common.gguf_file(str(tmp_path)) == str(path)  # a folder's single .gguf
    assert common.gguf_file(str(tmp_path / "none.gguf")) is None


def test_cpu_info_reads_the_flags_that_pick_kernels(tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
    )
    info = common.cpu_info(str(fake))
    assert info["model"] == "AMD EPYC 9R14" and info["flags"] == "avx2 avx512f avx512_bf16 avx512_vnni"
    assert info["all_flags"].startswith("fpu sse2") and info["cores"] == os.cpu_count()
    assert common.cpu_info(str(tmp_path / "absent"))["flags"] == "unknown"


def _row(dtype, trace, name, tps, ttft, precision=None):
    return {
        "dtype": dtype,
        "trace": trace,
        "contestant": name,
        "precision": precision or dtype,
        "tokens_per_s": tps,
        "steps": 10,
        "ttft_p50_ms": ttft,
    }


def test_every_dtype_of_tandem_is_set_against_the_one_llamacpp_row():
    rows = [
        _row("float32", "short", bench.CONTINUOUS, 60.0, 80.0),
        _row("bfloat16", "short", bench.CONTINUOUS, 90.0, 50.0),
        _row("Q4_1", "short", bench.LLAMACPP, 120.0, 40.0, "Q4_1 4-bit"),
        {"dtype": "Q4_1", "trace": "long", "contestant": bench.LLAMACPP, "error": "crashed"},
        _row("float32", "long", bench.CONTINUOUS, 30.0, 500.0),
    ]
    by = {(q["dtype"], q["trace"]): q for q in bench.compute_ratios(rows)}
    assert set(by) == {("float32", "short"), ("bfloat16", "short"), ("float32", "long")}  # no Q4_1 ratio row
    assert by[("float32", "short")]["continuous_over_llamacpp"] == pytest.approx(0.5)
    assert by[("bfloat16", "short")]["continuous_over_llamacpp"] == pytest.approx(0.75)
    assert by[("bfloat16", "short")]["ttft_p50_continuous_over_llamacpp"] == pytest.approx(1.25)
    assert by[("bfloat16", "short")]["llamacpp_precision"] == "Q4_1 4-bit"
    assert by[("float32", "long")]["continuous_over_llamacpp"] is None  # its llama.cpp row failed


def test_report_prints_precision_per_row_and_the_cpu_flags(tmp_path, capsys):
    args = _args("--quick", "--no-floor", "--llamacpp-server", sys.executable)
    args.llamacpp_gguf = (str(tmp_path / "m.gguf"), {"short": "Q4_1 4-bit", "long": "Q4_1 4-bit, as shipped"})
    data = bench.make_traces(["short"], 5000, seed=0, quick=True)
    run = {"seconds": 1.0, "requests": [{"asked": 4, "produced": 4, "ttft_s": 0.1}], "steps": 4, "mean_running": 1.0}
    results = [
        {"contestant": bench.CONTINUOUS, "dtype": "float32", "runs": {"short": run}},
        {"contestant": bench.LLAMACPP, "dtype": "Q4_1", "precision": "Q4_1 4-bit", "runs": {"short": run}},
    ]
    rows = [r for res in results for r in bench.rows_of(res["contestant"], res["dtype"], ["short"], res)]
    cpu = {"model": "Fake CPU", "cores": 2, "flags": "avx2 avx512f", "all_flags": "fpu avx2 avx512f"}
    report = bench.build_report(args, str(tmp_path), data, "not run: --no-vllm", results, rows, "run", cpu)
    bench.print_report(report)
    out = capsys.readouterr().out
    assert "CPU: Fake CPU, 2 cores, flags avx2 avx512f" in out
    assert "  Q4_1 4-bit  llama.cpp" in out and "  float32     tandem continuous" in out
    assert "continuous/llama.cpp 1.00x (float32 against Q4_1 4-bit)" in out
    assert report["cpu"] == cpu and report["llamacpp"]["precision"]["short"] == "Q4_1 4-bit"
    assert [r["precision"] for r in report["rows"]] == ["float32", "Q4_1 4-bit"]
    bench.plot_report(report, tmp_path / "llm.png")
    assert (tmp_path / "llm.png").stat().st_size > 0


if __name__ == "__main__":
    fake_binary_main(sys.argv[1:])
