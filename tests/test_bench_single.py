"""`python -m benchmarks single`: Tandem's one-sequence figures on the real SmolLM2, and the
report it writes; without the llama.cpp peer it says why, and still writes its own rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.single import summarize

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_summarize_splits_prefill_from_decode():
    run = {"prompt_tokens": 100, "t0": 10.0, "token_times": [10.5, 10.6, 10.7, 10.9]}
    s = summarize(run)
    assert s["ttft_ms"] == pytest.approx(500) and s["prefill_tokens_per_s"] == pytest.approx(200)
    assert s["decode_tokens_per_s"] == pytest.approx(3 / 0.4) and s["tokens"] == 4


def test_a_run_without_the_peer_reports_tandem_and_names_what_is_missing(tmp_path):
    missing = tmp_path / "no-such-venv" / "bin" / "python"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "single",
        "--prompt-len",
        "16",
        "--max-tokens",
        "6",
        "--runs",
        "1",
        "--dtypes",
        "float32",
        "--llamacpp-python",
        str(missing),
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CPU flags:" in proc.stdout and f"no llama.cpp Python at {missing}" in proc.stdout
    report = json.loads((tmp_path / "single.json").read_text())
    (row,) = report["rows"]
    assert row["contestant"] == "tandem float32" and row["precision"].startswith("float32")
    assert [r["tokens"] for r in row["runs"]] == [6]
    assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0
    assert (tmp_path / "single.png").stat().st_size > 0
