"""`tandem bench llm`: its traces, its summary and ratio maths on made-up records, its argument
checks, the tail of a crashed contestant's log, and one --quick run end to end (Tandem's two
schedulers in their own processes, no vLLM, no llama.cpp: tests/test_bench_llm_llamacpp.py has
its contestant against a fake server)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

from benchmarks import cli
from benchmarks import llm as bench

VOCAB = 49152


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_bench_arguments(p)
    return p.parse_args(list(argv))


# ---------------------------------------------------------------- traces


def test_trace_lengths_stay_in_their_ranges_and_prompts_have_their_drawn_length():
    data = bench.make_traces(["short", "long"], VOCAB, seed=0)
    for name, (n, (plo, phi), (olo, ohi)) in bench.TRACE_SHAPES.items():
        reqs = data["traces"][name]["requests"]
        assert len(reqs) == n
        assert all(plo <= len(r["prompt"]) <= phi and olo <= r["max_tokens"] <= ohi for r in reqs)
        assert all(0 <= t < VOCAB for r in reqs for t in r["prompt"])
        assert all(r["arrival_s"] == 0.0 for r in reqs)
        assert data["traces"][name]["asked_tokens"] == sum(r["max_tokens"] for r in reqs)
    # log-uniform, not uniform: the median sits near the geometric mean of the range
    lens = bench.loguniform_lengths(4000, 16, 256, __import__("random").Random(1))
    assert 16 <= min(lens) and max(lens) <= 256
    assert abs(statistics.median(lens) - math.sqrt(16 * 256)) < 8


def test_traces_are_reproducible_for_a_seed_and_differ_across_seeds():
    a = bench.make_traces(["short", "long", "poisson"], VOCAB, seed=3, rate=2.0)
    b = bench.make_traces(["short", "long", "poisson"], VOCAB, seed=3, rate=2.0)
    c = bench.make_traces(["short", "long", "poisson"], VOCAB, seed=4, rate=2.0)
    assert a == b
    assert a["traces"]["short"]["requests"] != c["traces"]["short"]["requests"]
    assert a["traces"]["poisson"]["requests"] != c["traces"]["poisson"]["requests"]


def test_poisson_trace_is_the_short_requests_with_monotone_arrivals_at_the_rate():
    data = bench.make_traces(["short", "poisson"], VOCAB, seed=0, num_requests=2000, rate=4.0)
    short, poisson = data["traces"]["short"]["requests"], data["traces"]["poisson"]["requests"]
    assert [(r["prompt"], r["max_tokens"]) for r in short] == [(r["prompt"], r["max_tokens"]) for r in poisson]
    arrivals = [r["arrival_s"] for r in poisson]
    assert arrivals[0] == 0.0
    assert all(b >= a for a, b in zip(arrivals, arrivals[1:]))
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 4.0, rel=0.1)
    assert data["traces"]["poisson"]["rate"] == 4.0


def test_num_requests_sets_short_and_poisson_and_long_gets_half():
    data = bench.make_traces(["short", "long", "poisson"], VOCAB, seed=0, num_requests=7, quick=True)
    assert [data["traces"][t]["num_requests"] for t in ("short", "long", "poisson")] == [7, 4, 7]
    assert len(data["warmup"]) == 2 and data["order"] == ["short", "long", "poisson"]


# ---------------------------------------------------------------- summaries and ratios


def _run(seconds, asked, produced, ttft=None, steps=None, running=None, kv=None):
    reqs = [{"asked": a, "produced": p, "ttft_s": t} for a, p, t in zip(asked, produced, ttft or [None] * len(asked))]
    return {"seconds": seconds, "requests": reqs, "steps": steps, "step_running": running, "step_kv": kv}


def test_summary_counts_only_asked_tokens_and_reads_steps_kv_and_ttft():
    s = bench.summarize_run(
        _run(
            2.0,
            [10, 20, 30],
            [10, 25, 20],
            ttft=[0.1, 0.2, 0.3],
            steps=4,
            running=[3, 3, 2, 1],
            kv=[0.1, 0.3, 0.2, 0.0],
        )
    )
    assert s["asked_tokens"] == 60 and s["useful_tokens"] == 10 + 20 + 20 and s["produced_tokens"] == 55
    assert s["tokens_per_s"] == pytest.approx(25.0)
    assert s["steps"] == 4 and s["ms_per_step"] == pytest.approx(500.0) and s["mean_running"] == pytest.approx(2.25)
    assert s["kv_mean"] == pytest.approx(0.15) and s["kv_peak"] == pytest.approx(0.3)
    assert s["ttft_p50_ms"] == pytest.approx(200.0) and s["ttft_p99_ms"] == pytest.approx(298.0)


def test_summary_leaves_missing_step_figures_as_none_rather_than_guessing():
    s = bench.summarize_run(_run(1.0, [4], [4]))
    assert s["steps"] is None and s["ms_per_step"] is None and s["mean_running"] is None
    assert s["kv_mean"] is None and s["kv_peak"] is None
    assert s["ttft_p50_ms"] is None and s["tokens_per_s"] == 4.0


def test_ratios_pair_contestants_of_the_same_dtype_and_trace():
    def row(dtype, trace, name, tps, steps, ttft):
        return {
            "dtype": dtype,
            "trace": trace,
            "contestant": name,
            "tokens_per_s": tps,
            "steps": steps,
            "ttft_p50_ms": ttft,
        }

    rows = [
        row("bfloat16", "short", bench.CONTINUOUS, 200.0, 100, 50.0),
        row("bfloat16", "short", bench.STATIC, 100.0, 250, 400.0),
        row("bfloat16", "short", bench.VLLM, 160.0, 120, 40.0),
        row("float32", "short", bench.CONTINUOUS, 90.0, 100, 80.0),
        {"dtype": "float32", "trace": "short", "contestant": bench.STATIC, "error": "crashed"},
    ]
    by = {(q["dtype"], q["trace"]): q for q in bench.compute_ratios(rows)}
    bf = by[("bfloat16", "short")]
    assert bf["continuous_over_vllm"] == pytest.approx(1.25)
    assert bf["continuous_over_static"] == pytest.approx(2.0)
    assert bf["static_steps_over_continuous"] == pytest.approx(2.5)
    assert bf["ttft_p50_static_over_continuous"] == pytest.approx(8.0)
    assert bf["ttft_p50_continuous_over_vllm"] == pytest.approx(1.25)
    fp = by[("float32", "short")]  # no vLLM row and a crashed static: no ratio, not a made-up one
    assert fp["continuous_over_vllm"] is None and fp["continuous_over_static"] is None
    assert fp["static_steps_over_continuous"] is None


def test_rows_of_a_crashed_contestant_keep_its_finished_traces_and_error_the_rest():
    res = {"runs": {"short": _run(1.0, [3], [3], steps=3)}, "error": "vllm (bfloat16) exited with status 1"}
    rows = bench.rows_of(bench.VLLM, "bfloat16", ["short", "long"], res)
    assert rows[0]["tokens_per_s"] == 3.0 and "error" not in rows[0]
    assert rows[1]["error"] == res["error"]


# ---------------------------------------------------------------- arguments and logs


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--traces", "short,medium"], "--traces"),
        (["--traces", ""], "--traces"),
        (["--traces", "short,short"], "--traces"),
        (["--dtypes", "float16"], "--dtypes"),
        (["--num-requests", "0"], "--num-requests"),
        (["--rate", "0"], "--rate"),
        (["--rate", "inf"], "--rate"),
        (["--slots", "0"], "--slots"),
        (["--kv-cache-gib", "0.5"], "--kv-cache-gib"),
        (["--max-model-len", "1024"], "--max-model-len"),
        (["--timeout", "0"], "--timeout"),
        (["--llamacpp-threads", "0"], "--llamacpp-threads"),
    ],
)
def test_bad_arguments_are_refused_with_the_flag_named(argv, words):
    assert words in bench.validate_args(_args(*argv))


def test_good_arguments_pass_and_quick_traces_fit_a_small_max_model_len():
    assert bench.validate_args(_args()) is None
    assert bench.validate_args(_args("--quick", "--max-model-len", "256", "--traces", "short,poisson")) is None
    assert bench.run_bench(_args("--slots", "0")) == 2


def test_log_tail_leaves_progress_bars_out(tmp_path):
    log = tmp_path / "c.log"
    log.write_bytes(
        b"loading\n\rshort:  10%|#   | 1/10 [00:01<00:09, 1.00req/s]\r"
        b"short:  20%|##  | 2/10 [00:02<00:08, 1.00req/s]\rTraceback (most recent call last):\n"
        b"RuntimeError: boom\n"
    )
    assert bench.log_tail(log).splitlines() == ["loading", "Traceback (most recent call last):", "RuntimeError: boom"]


def test_vllm_state_says_plainly_why_vllm_does_not_run(tmp_path):
    missing = tmp_path / "nope" / "python"
    assert bench.vllm_state(_args("--vllm-python", str(missing))) == f"not run: --vllm-python {missing} does not exist"
    assert bench.vllm_state(_args("--no-vllm", "--vllm-python", sys.executable)) == "not run: --no-vllm"
    none = _args()
    none.vllm_python = None
    assert bench.vllm_state(none).startswith("not run: no vLLM Python at ")
    assert bench.vllm_state(_args("--vllm-python", sys.executable)) == "run"


def test_a_crashing_contestant_becomes_an_error_with_the_end_of_its_log(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'starting up' >&2\necho 'RuntimeError: no engine here' >&2\nexit 3\n")
    fake.chmod(0o755)
    args = _args("--vllm-python", str(fake), "--quick")
    res = bench.run_contestant(bench.VLLM, args, "bfloat16", tmp_path, tmp_path / "traces.json", str(tmp_path))
    assert "vllm (bfloat16) exited with status 3" in res["error"]
    assert res["error"].endswith("starting up\nRuntimeError: no engine here")
    rows = bench.rows_of(bench.VLLM, "bfloat16", ["short"], res)
    assert rows[0]["error"] == res["error"]


# ---------------------------------------------------------------- end to end


def test_quick_run_measures_both_tandem_schedulers_in_their_own_processes(tmp_path, tiny_llama_dir, capsys):
    # The bench itself in this process; each contestant in its own, as always.
    out = tmp_path / "bench"
    argv = ["llm", "--quick", "--no-vllm", "--dtypes", "float32", "--traces", "short,poisson"]
    argv += ["--num-requests", "3", "--rate", "50", "--kv-cache-gib", "1", "--model", tiny_llama_dir]
    rc = cli.main([*argv, "--max-model-len", "512", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout[-3000:]
    report = json.loads((out / "llm.json").read_text())
    assert report["vllm"]["status"] == "not run: --no-vllm"
    assert "vLLM: not run: --no-vllm" in stdout
    # an HF folder has no GGUF for llama.cpp to read, and the run says so
    assert report["llamacpp"]["status"].startswith("not run: ")
    assert f"llama.cpp: {report['llamacpp']['status']}" in stdout
    assert report["cpu"]["flags"] and f"flags {report['cpu']['flags']}" in stdout
    assert {r["precision"] for r in report["rows"]} == {"float32"}
    traces = json.loads((out / "llm_traces.json").read_text())
    asked = {t: sum(r["max_tokens"] for r in traces["traces"][t]["requests"]) for t in ("short", "poisson")}
    rows = {(r["contestant"], r["trace"]): r for r in report["rows"]}
    assert set(rows) == {(c, t) for c in (bench.CONTINUOUS, bench.STATIC) for t in ("short", "poisson")}
    for (_name, trace), r in rows.items():
        assert "error" not in r, r
        assert r["num_requests"] == 3
        assert r["tokens_per_s"] > 0 and r["steps"] > 0 and r["mean_running"] > 0 and r["kv_peak"] > 0
        assert r["useful_tokens"] == r["asked_tokens"] == r["produced_tokens"] == asked[trace]
        assert r["ttft_p50_ms"] is not None
    # each contestant had its own process and log
    logs = {c["contestant"]: c["log"] for c in report["contestants"]}
    assert set(logs) == {bench.CONTINUOUS, bench.STATIC}
    assert len(set(logs.values())) == 2 and all(Path(p).exists() for p in logs.values())
    assert "floor" in report and "float32" in report["floor"]
    floor = report["floor"]["float32"]
    assert ("error" in floor) == ("not measured" in stdout)
    assert (out / "llm.png").stat().st_size > 0
