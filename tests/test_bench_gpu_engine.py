"""`python -m benchmarks gpu-engine` on the CPU (--device cpu --tiny): every section runs end to end
on a tiny random-weight Llama, Tandem's float32 greedy tokens are those of transformers' `generate`,
and a failing section or item is recorded while the rest still run."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import cli, gpu_engine


def _run(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "out"
    rc = cli.main(["gpu-engine", "--device", "cpu", "--tiny", "--out", str(out), *extra])
    return rc, json.loads((out / gpu_engine.JSON_NAME).read_text())


def test_every_section_runs_and_float32_greedy_matches_hf(tmp_path):
    # Eager only: the captured engine compiles for a minute on a CPU (the next test covers its items).
    rc, r = _run(tmp_path, "--modes", "eager")
    assert rc == 0, r["problems"]
    assert r["ok"] and not r["problems"]
    assert r["device"]["device"] == "cpu" and r["device"]["flags"]
    for sec in gpu_engine.SECTIONS:
        assert "error" not in r[sec]["tiny"], r[sec]["tiny"]

    c = r["correctness"]["tiny"]
    for dtype in ("float32", "bfloat16"):
        assert len(c[dtype]["hf_generate"]["tokens"]) == 4
        assert "agreement" in c[dtype]["tandem_eager"]
    f32 = c["float32"]["tandem_eager"]
    # Tandem's CPU path is token-identical to HF in float32: a real check, on non-degenerate output.
    assert f32["agreement"] == 1.0 and f32["identical_prompts"] == f32["prompts"] == 4, f32
    assert f32["first_divergence"] == [None] * 4
    assert f32["distinct_tokens"] > 8
    assert "tandem_captured" not in c["float32"]  # not asked for

    t = r["throughput"]["tiny"]
    assert t["traces"] == ["8x16+8", "16x16+8"]
    for trace in t["traces"]:
        row = t[trace]
        for key in ("tandem_eager", "hf_continuous"):
            assert row[key]["generated_tokens"] == row[key]["expected_tokens"], (trace, key, row[key])
            assert row[key]["output_tokens_per_s"] > 0
        assert row["tandem_eager_vs_hf"] > 0
        assert 0 <= row["hf_continuous"]["greedy_vs_tandem_eager"]["agreement"] <= 1

    f = r["decode_floor"]["tiny"]
    assert f["matmul_floor"]["num_linears"] == 2 * 4 + 1  # qkv, o, gate_up, down per layer, lm_head
    assert f["matmul_floor"]["launched_ms"] > 0
    assert f["tandem_eager"]["step_ms"] > 0 and f["tandem_eager"]["execute_ms"] > 0
    assert f["tandem_eager"]["vs_floor_launched"] > 0
    assert (tmp_path / "out" / gpu_engine.PLOT_NAME).stat().st_size > 0


def test_a_failing_section_or_item_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("generate_batch went away")

    monkeypatch.setattr(gpu_engine, "hf_continuous", broken)
    # "captured" gets an eager engine here (a real one compiles for a minute on a CPU): its items'
    # own bookkeeping still runs, and its tokens must be eager's.
    config = gpu_engine.Engines.config
    monkeypatch.setattr(gpu_engine.Engines, "config", lambda self, dtype, mode: config(self, dtype, "eager"))
    rc, r = _run(tmp_path, "--inject-failure", "correctness", "--traces", "8")
    assert rc == 1
    assert "injected failure" in r["correctness"]["tiny"]["error"]
    row = r["throughput"]["tiny"]["8x16+8"]
    assert "generate_batch went away" in row["hf_continuous"]["error"]
    assert row["tandem_eager"]["generated_tokens"] == 64  # the items beside the broken one still ran
    assert row["tandem_captured"]["greedy_vs_tandem_eager"]["agreement"] == 1.0
    assert row["captured_vs_eager"] > 0
    floor = r["decode_floor"]["tiny"]
    assert floor["tandem_eager"]["step_ms"] > 0 and floor["tandem_captured"]["step_ms"] > 0
    assert any("injected failure" in p for p in r["problems"])
    assert any("generate_batch went away" in p for p in r["problems"])


def test_items_past_the_budget_are_skipped_not_run():
    out: dict = {}
    gpu_engine.item(out, "late", lambda: pytest.fail("ran past its deadline"), deadline=0.0, label="late")
    assert "skipped" in out["late"]


def test_compare_reports_the_first_divergence():
    res = gpu_engine.compare([[1, 2, 3, 4], [5, 6], [7, 8]], [[1, 2, 9, 4], [5, 6], [7]])
    assert res["first_divergence"] == [2, None, 1]
    assert res["identical_prompts"] == 1
    assert res["agreement"] == (2 + 2 + 1) / 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_cuda_it_exits_2(tmp_path):
    assert cli.main(["gpu-engine", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / gpu_engine.JSON_NAME).exists()
