"""`python -m benchmarks weight-kernels`: every kernel it times computes what its quantized
weights stand for (so its figures compare like with like), Tandem's Q4_1 kernel on each SIMD path
this CPU runs among them, and it writes its JSON and plot."""

from __future__ import annotations

import json

from benchmarks import cli
from benchmarks.weight_kernels import _tandem_isas


def _baseline(dtype_name: str) -> str:
    """The bench's baseline kernel for a dtype: oneDNN's packed linear where this CPU lets
    oneDNN pack it (bfloat16 wants native bf16 support), else plain F.linear, as the engine."""
    import torch

    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=getattr(torch, dtype_name)), 1)
    except RuntimeError:
        return "plain F.linear"
    return "onednn packed"


def test_the_kernels_agree_with_their_weights_and_the_report_is_written(tmp_path, capsys):
    # In this process, each block's layer shape once (--copies 1, no lm_head: its 28 M weights
    # took 3.5 s to draw and quantize per dtype and batch here): every kernel still runs, and is
    # checked, on every dtype and batch; the model's 121 layers only make the timing honest.
    argv = ["weight-kernels", "--batches", "1,2", "--dtypes", "float32,bfloat16", "--iters", "1", "--copies", "1"]
    argv += ["--layers", "qkv_proj,o_proj,gate_up_proj,down_proj"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    assert "CPU flags:" in capsys.readouterr().out
    report = json.loads((tmp_path / "weight_kernels.json").read_text())
    assert (tmp_path / "weight_kernels.png").stat().st_size > 0
    rows = report["rows"]
    assert {(r["dtype"], r["batch"], r["kernel"]) for r in rows} == {
        (d, b, k)
        for d in ("float32", "bfloat16")
        for b in (1, 2)
        for k in (_baseline(d), "int4 weight-only", "int8 weight-only", *(f"q4_1 {isa}" for isa in _tandem_isas()))
    }
    for r in rows:  # float32 math is exact to rounding; bfloat16 activations lose ~3 digits
        limit = 1e-4 if r["dtype"] == "float32" else 2e-2
        assert r["max_rel_error"] < limit, r
        assert r["ms_per_forward"] > 0
