"""`python -m benchmarks weight-kernels`: the model's linear layers as Tandem runs them today
(weights pre-packed for oneDNN, float32 or bfloat16) against torch's CPU weight-only kernels,
4-bit (`_weight_int4pack_mm_for_cpu`, group-wise asymmetric, as GGUF's Q4_1 blocks of 32) and
8-bit (`_weight_int8pack_mm`, per output channel), and Tandem's own kernel over GGUF's Q4_1
blocks with 8-bit activations (kernels/quant_linear.py) on each of its SIMD paths this CPU runs
("q4_1 amx", "q4_1 vnni", "q4_1 avx2"), at decode batch sizes.

Why: a small-batch decode reads every weight once per step, so weights kept at the 4 bits the
model ships in could make the step up to 4x (bfloat16) or 8x (float32) cheaper, if the kernel
reads them at the machine's speed. This measures whether torch's kernels do, per dtype and
batch, before a quantized path is built on them (issue 19, item 3). Each kernel's output is
checked against float32 math on the same quantized weights (Tandem's kernel: against its torch
path, the same math with the same 8-bit activations).

Each layer has weights of its own (121 of them, 135 M parameters in all), and each timed call
runs them all in order, as a forward does, so the weights stream from memory as in a decode
step. (Timing one layer many times over keeps its weights in cache: that read 8.3 ms for the
bfloat16 layers at batch 1, where a step pays about 22 ms.)

Prints a table and the CPU's flags; writes weight_kernels.json and weight_kernels.png to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# SmolLM2-135M's linear layers, as the runner fuses them: (in, out, how many per forward)
SMOLLM2_LINEARS = {
    "qkv_proj": (576, 960, 30),
    "o_proj": (576, 576, 30),
    "gate_up_proj": (576, 3072, 30),
    "down_proj": (1536, 576, 30),
    "lm_head": (576, 49152, 1),
}
GROUP = 32  # Q4_1's block: 32 weights share a scale and a minimum


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,4,16", help="comma-separated decode batch sizes")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated activation dtypes")
    p.add_argument("--iters", type=int, default=10, help="timed passes over all the layers per kernel (median)")
    p.add_argument(
        "--copies",
        type=int,
        default=None,
        help="layers of each kind per forward (default: the model's, 30 and one lm_head); 1: every shape "
        "once, a smoke run whose weights stay in cache",
    )
    p.add_argument(
        "--layers",
        default=",".join(SMOLLM2_LINEARS),
        help="comma-separated layer kinds to run (default all; lm_head's 28 M weights take seconds to quantize)",
    )
    p.add_argument("--out", default="bench_out")


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    keep = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
    return " ".join(f for f in keep if f in flags) or "none of " + ", ".join(keep)


def _median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def _tandem_isas() -> list[str]:
    """Tandem's Q4_1 kernel's SIMD paths on this CPU (not the portable one, too slow to time)."""
    from kernels import quant_linear

    return [isa for isa in quant_linear.available_isas() if isa != "scalar"]


def _q4_1_blocks(w):
    """GGUF Q4_1 blocks [N, K / 32 * 20] of weights [N, K]: per 32, float16 d = (max - min) / 15
    and m = min, then 16 bytes of nibbles (weight j low, j + 16 high), as llama.cpp's quantizer."""
    import torch

    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    dm = torch.stack([d, lo], -1).to(torch.float16).view(torch.uint8)  # [N, KB, 4]: d, m
    return torch.cat([dm, q[..., :16] | (q[..., 16:] << 4)], -1).reshape(n, -1).contiguous()


def _kernels(k: int, n: int, m: int, dtype, seed: int = 0):
    """One layer's weights under each kernel: {name: (callable, relative error against float32
    math on its own weights)}."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(k * 100003 + n * 7 + seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = {}

    wd = w.to(dtype)
    ref = F.linear(x.float(), wd.float())
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(wd, m)
    except RuntimeError:
        # oneDNN packs bfloat16 only where the CPU has native bf16 (avx512bw/vl/dq or
        # avx_ne_convert): elsewhere the engine runs plain F.linear (model.onednn_packing_available),
        # so that is the baseline here too.
        out["plain F.linear"] = (lambda: F.linear(x, wd), F.linear(x, wd), ref)
    else:
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        out["onednn packed"] = (lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), got, ref)

    groups = w.view(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q4 = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    w4 = (q4 * scale[..., None] + lo[..., None]).view(n, k)  # what the 4-bit weights stand for
    packed4 = torch._convert_weight_to_int4pack_for_cpu(q4.view(n, k).to(torch.int32), 1)
    # The kernel computes (q - 8) * scale + zero: its zero is the group's minimum + 8 scales.
    sz = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).to(dtype).contiguous()
    out["int4 weight-only"] = (
        lambda: torch._weight_int4pack_mm_for_cpu(x, packed4, GROUP, sz),
        torch._weight_int4pack_mm_for_cpu(x, packed4, GROUP, sz),
        F.linear(x.float(), w4),
    )

    s8 = (w.abs().amax(1) / 127).clamp(min=1e-8)
    q8 = (w / s8[:, None]).round().clamp(-128, 127).to(torch.int8)
    s8d = s8.to(dtype)
    out["int8 weight-only"] = (
        lambda: torch._weight_int8pack_mm(x, q8, s8d),
        torch._weight_int8pack_mm(x, q8, s8d),
        F.linear(x.float(), q8.float() * s8[:, None]),
    )

    from kernels import quant_linear

    blocks = _q4_1_blocks(w)
    want = quant_linear.q4_1_linear_torch(x, blocks).float()
    for isa in _tandem_isas():
        before = quant_linear.set_isa(isa)
        try:
            got = quant_linear.q4_1_linear(x, blocks)
        finally:
            quant_linear.set_isa(before)
        # run() forces the path around the timed calls: a set_isa per layer would be timed too.
        out[f"q4_1 {isa}"] = (lambda: quant_linear.q4_1_linear(x, blocks), got, want)
    return {name: (fn, float((got.float() - r).abs().max() / r.abs().max())) for name, (fn, got, r) in out.items()}


def _timed(name: str, fn, iters: int) -> float:
    """_median_ms, with Tandem's kernel forced onto the path its name says."""
    if not name.startswith("q4_1 "):
        return _median_ms(fn, iters)
    from kernels import quant_linear

    before = quant_linear.set_isa(name.split()[1])
    try:
        return _median_ms(fn, iters)
    finally:
        quant_linear.set_isa(before)


def run(args) -> int:
    import torch

    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if args.copies is not None and args.copies < 1:
        print(f"--copies must be >= 1, got {args.copies}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.layers.split(",") if n.strip()]
    if not names or set(names) - set(SMOLLM2_LINEARS):
        print(f"--layers must name some of {', '.join(SMOLLM2_LINEARS)}, got {args.layers!r}", file=sys.stderr)
        return 2
    layer_kinds = {
        n: (k, o, min(count, args.copies or count)) for n, (k, o, count) in SMOLLM2_LINEARS.items() if n in names
    }
    flags = cpu_flags()
    print(f"CPU flags: {flags}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    rows = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        for m in batches:
            # Every layer gets weights of its own, as in the model: a pass reads them all once,
            # from memory rather than cache, which is what a decode step pays.
            layers = [_kernels(k, n, m, dtype, seed=i) for k, n, count in layer_kinds.values() for i in range(count)]
            total: dict[str, float] = {}
            worst: dict[str, float] = {}
            for name in layers[0]:
                calls = [layer[name][0] for layer in layers]
                total[name] = _timed(name, lambda calls=calls: [call() for call in calls], args.iters)
                worst[name] = max(layer[name][1] for layer in layers)
            del layers
            base = total[next(iter(total))]  # oneDNN packed, or plain F.linear where oneDNN cannot pack
            for name, ms in total.items():
                rows.append(
                    {
                        "dtype": dname,
                        "batch": m,
                        "kernel": name,
                        "ms_per_forward": ms,
                        "vs_onednn": base / ms,
                        "max_rel_error": worst[name],
                    }
                )
    num_layers = sum(c for *_, c in layer_kinds.values())
    if layer_kinds == SMOLLM2_LINEARS:
        what = f"all {num_layers} linear layers of SmolLM2-135M"
    else:
        what = f"{num_layers} of SmolLM2-135M's linear layers ({', '.join(f'{c} {n}' for n, (*_, c) in layer_kinds.items())})"
    print(f"\n{what}, one forward:")
    print(f"{'dtype':9s} {'batch':>5s}  {'kernel':18s} {'ms':>8s}  {'speed vs oneDNN':>15s}  {'max rel error':>13s}")
    for r in rows:
        print(
            f"{r['dtype']:9s} {r['batch']:5d}  {r['kernel']:18s} {r['ms_per_forward']:8.2f}  "
            f"{r['vs_onednn']:14.2f}x  {r['max_rel_error']:13.1e}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "cpu_flags": flags,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "group_size": GROUP,
        "layers": layer_kinds,
        "rows": rows,
    }
    (out / "weight_kernels.json").write_text(json.dumps(report, indent=2))
    _plot(rows, out / "weight_kernels.png")
    print(f"wrote {out / 'weight_kernels.json'} and {out / 'weight_kernels.png'}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 4), squeeze=False)
    for ax, dt in zip(axes[0], dtypes):
        for kernel in dict.fromkeys(r["kernel"] for r in rows):
            pts = [(r["batch"], r["ms_per_forward"]) for r in rows if r["dtype"] == dt and r["kernel"] == kernel]
            ax.plot([b for b, _ in pts], [ms for _, ms in pts], marker="o", label=kernel)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("decode batch (rows)")
        ax.set_ylabel("ms per forward, all linear layers")
        ax.set_title(f"SmolLM2-135M linears, {dt} activations")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks weight-kernels", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
