"""`python -m benchmarks single`: Tandem's one-sequence figures (on the tiny random Llama here),
and the report it writes; without the llama.cpp peer it says why, and still writes its own rows."""

from __future__ import annotations

import json

import pytest

from benchmarks import cli
from benchmarks.single import summarize

pytestmark = pytest.mark.slow


def test_summarize_splits_prefill_from_decode():
    run = {"prompt_tokens": 100, "t0": 10.0, "token_times": [10.5, 10.6, 10.7, 10.9]}
    s = summarize(run)
    assert s["ttft_ms"] == pytest.approx(500) and s["prefill_tokens_per_s"] == pytest.approx(200)
    assert s["decode_tokens_per_s"] == pytest.approx(3 / 0.4) and s["tokens"] == 4


def test_a_run_without_the_peer_reports_tandem_and_names_what_is_missing(tmp_path, tiny_llama_dir, capsys):
    # In this process, on the tiny random Llama: the report's shape and the missing peer's
    # message do not depend on the model (the real SmolLM2's load was most of a minute here).
    missing = tmp_path / "no-such-venv" / "bin" / "python"
    argv = ["single", "--prompt-len", "16", "--max-tokens", "6", "--runs", "1", "--dtypes", "float32"]
    argv += ["--model", tiny_llama_dir, "--llamacpp-python", str(missing), "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    assert "CPU flags:" in stdout and f"no llama.cpp Python at {missing}" in stdout
    report = json.loads((tmp_path / "single.json").read_text())
    assert report["model"] == tiny_llama_dir
    (row,) = report["rows"]
    assert row["contestant"] == "tandem float32" and row["precision"].startswith("float32")
    assert [r["tokens"] for r in row["runs"]] == [6]
    assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0
    assert (tmp_path / "single.png").stat().st_size > 0
    # What limits the decode: its step beside the linear layers alone, at the prompt's context.
    limits = row["limits"]
    assert limits["context"] == 16 and 0 < limits["linear_ms"] and 0 < limits["step_ms"]
    assert "tandem float32: decode step" in stdout and "linear layers" in stdout


def test_step_breakdown_lists_the_ops_of_a_decode_step(tiny_llama_dir):
    from benchmarks.step import _limits
    from runtime.llm.engine import EngineConfig, LLMEngine
    from runtime.llm.profile import step_vs_floor

    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", device="cpu", max_num_seqs=4))
    try:
        r = step_vs_floor(engine, num_seqs=4, context_len=16, repeats=3, profile_steps=2)
        assert not engine.has_unfinished()
    finally:
        engine.close()
    names = [name for name, _ in r["ops"]]
    assert names[-1] == "outside ops" and all(ms >= 0 for _, ms in r["ops"])
    # The model's own ops are there: its linear layers and its attention.
    assert any("linear" in n or "addmm" in n or n == "aten::mm" for n in names)
    assert any("attention" in n for n in names), names[:20]
    line = _limits(r["ops"])
    assert "linear ops" in line and "outside any op" in line
