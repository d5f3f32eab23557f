"""`python -m benchmarks single`: one user, one sequence. Tandem's engine against llama.cpp
(llama-cpp-python, in its own venv: ../shared/PEERS.md) on the same GGUF file, the default
SmolLM2-135M-Instruct: time to the first token (prefill) and tokens/s after it (decode), greedy,
exactly --max-tokens tokens from random token-id prompts that neither contestant has seen
(a fresh prompt per run, so no prefix cache helps).

Each contestant runs at its own precision, and the report says which: llama.cpp reads the
GGUF's 4-bit weights as shipped; Tandem dequantizes them to float32 or bfloat16 (`--dtypes`).
llama.cpp runs in a process of its own (benchmarks/single_llamacpp.py); Tandem in this one, on
the same number of threads. Prints the CPU's flags; writes single.json and single.png to --out.

Speculative decoding (issue 29): a `-spec` spec (e.g. float32-gguf-spec) runs Tandem with n-gram
prompt lookup (SPEC below), and llama.cpp then runs a second time with its own draftless
prompt lookup (llama-cpp-python's LlamaPromptLookupDecoding). `--prompts grounded` times
prompts whose answers repeat their input (copy a passage, edit a function, answer from a
text: benchmarks/grounded.py), chat-templated; `random` (the default) has nothing to look up,
the case where speculation must not cost.

`--avx2-only` runs both contestants on AVX2 code alone, for a CPU that has more: Tandem in a
process where torch (ATEN_CPU_CAPABILITY=avx2), oneDNN (ONEDNN_MAX_CPU_ISA=AVX2), the C++ ops
built for torch's level and the 4-bit kernel (set_isa("avx2")) are all capped there; llama.cpp
must then be a build without AVX-512 (its system info, printed per row, says which it is). The
CPU's caches and memory stay this CPU's, so it stands in for, not equals, an AVX2-only CPU.

What limits the decode: Tandem's one-sequence decode step is timed beside its linear layers
alone (runtime/llm/profile.py step_vs_floor at one row), so each Tandem row also says how much
of a token is the weights' matmuls and how much the rest (attention, norms, RoPE, sampling, the
step's Python), against llama.cpp's time per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import python_env, random_prompts
from benchmarks.grounded import grounded_prompts
from benchmarks.weight_kernels import cpu_flags

LLAMACPP_PYTHON = str(Path(__file__).resolve().parents[2] / "peers" / "llamacpp" / "bin" / "python")
CHILD = Path(__file__).resolve().with_name("single_llamacpp.py")
# Tandem's `-spec` rows and llama.cpp's prompt-lookup row: the same k (tokens drafted per step).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per run")
    p.add_argument("--runs", type=int, default=3, help="timed runs per contestant (median), after one warm-up")
    p.add_argument(
        "--dtypes",
        default="float32,float32-gguf,float32-compiled,bfloat16,bfloat16-gguf,bfloat16-compiled,bfloat16-int4",
        help="Tandem's, comma-separated: <dtype>[-int4|-gguf][-compiled][-spec]; -spec: n-gram speculative "
        "decoding (speculative_config); -int4: the layers' weights at 4 bits "
        "(quantization='int4'); -gguf: the GGUF's Q4_1/Q8_0 blocks as shipped, Tandem's integer kernel "
        "(quantization='gguf'); -compiled: the captured decode step (enforce_eager=False)",
    )
    p.add_argument("--threads", type=int, default=None, help="both contestants' threads (default: torch's)")
    p.add_argument("--llamacpp-python", default=LLAMACPP_PYTHON, help="the peer venv's Python")
    p.add_argument(
        "--model",
        default=None,
        help="Tandem's model: an HF folder or .gguf (default: the bundled SmolLM2 GGUF); llama.cpp always "
        "reads the bundled GGUF, so the comparison means something only with the default (a tiny model: tests)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prompts",
        choices=["random", "grounded"],
        default="random",
        help="random token ids (nothing to look up), or grounded chat prompts whose answers repeat their input",
    )
    p.add_argument(
        "--avx2-only",
        action="store_true",
        help="cap Tandem (torch, oneDNN, the C++ ops, the 4-bit kernel) at AVX2; llama.cpp must be an AVX2 build",
    )
    p.add_argument("--out", default="bench_out")


def summarize(run: dict) -> dict:
    """Prefill and decode figures of one run: {"prompt_tokens", "t0", "token_times"}."""
    times = run["token_times"]
    ttft = times[0] - run["t0"]
    decode_s = times[-1] - times[0]
    return {
        "ttft_ms": 1000 * ttft,
        "prefill_tokens_per_s": run["prompt_tokens"] / ttft,
        "decode_tokens_per_s": (len(times) - 1) / decode_s if decode_s > 0 else float("nan"),
        "tokens": len(times),
    }


def _median_row(name: str, precision: str, runs: list[dict], extra: dict) -> dict:
    s = [summarize(r) for r in runs]
    keys = ("ttft_ms", "prefill_tokens_per_s", "decode_tokens_per_s")
    return {
        "contestant": name,
        "precision": precision,
        **{k: statistics.median(x[k] for x in s) for k in keys},
        "runs": s,
        **extra,
    }


def run_tandem(spec: str, data: dict, threads: int, model: str | None = None, kernel_isa: str | None = None) -> dict:
    """One sequence at a time through LLMEngine, its token times taken as each step streams them.
    `spec`: a dtype, "<dtype>-int4" for torch's 4-bit kernel, "<dtype>-gguf" for the GGUF's blocks."""
    import torch

    from runtime.llm.engine import EngineConfig, LLMEngine
    from runtime.llm.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    dtype, *options = spec.split("-")
    if set(options) - {"int4", "gguf", "compiled", "spec"} or {"int4", "gguf"} <= set(options):
        raise ValueError(f"--dtypes: {spec!r} must be <dtype>[-int4|-gguf][-compiled][-spec]")
    quant = next((q for q in ("int4", "gguf") if q in options), "float")
    compiled = "compiled" in options
    speculative = SPEC if "spec" in options else None
    n = data["max_tokens"]
    longest = max(len(p) for p in data["prompts"] + [data["warmup"]])
    t = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            device="cpu",
            max_num_seqs=1,
            max_model_len=longest + n + 16,
            enable_prefix_caching=False,
            quantization=quant,
            enforce_eager=not compiled,
            speculative_config=speculative,
        )
    )
    load_s = time.perf_counter() - t
    if kernel_isa is not None and quant == "gguf":
        from kernels import quant_linear

        quant_linear.set_isa(kernel_isa)
    if compiled:  # time the graph, not the eager steps served while it compiles
        engine.runner.graph.done.wait()
        if engine.runner.graph.failed:
            raise RuntimeError(f"{spec}: the decode step did not compile: {engine.runner.graph.failed}")
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True)
    runs = []
    try:
        for prompt in [data["warmup"], *data["prompts"]]:
            times: list[float] = []

            def sink(out, times=times) -> None:
                now = time.perf_counter()
                times.extend(now for _ in out.delta_token_ids)

            t0 = time.perf_counter()
            engine.add_request(list(prompt), params, sink=sink)
            while engine.has_unfinished():
                engine.step()
            runs.append({"prompt_tokens": len(prompt), "t0": t0, "token_times": times})
        stats = engine.scheduler.stats()
        limits = None
        if not speculative:  # one decode step beside its linear layers, at this prompt's context
            from runtime.llm.profile import step_vs_floor

            r = step_vs_floor(engine, num_seqs=1, context_len=data["limits_context"], repeats=max(3, min(50, n - 4)))
            limits = {"step_ms": r["step_ms"], "linear_ms": r["linear_floor_ms"], "context": r["context_len"]}
    finally:
        engine.close()
    assert all(len(r["token_times"]) == n for r in runs), "every run must make exactly max_tokens tokens"
    extra = {"load_s": load_s, "limits": limits}
    if kernel_isa is not None and quant == "gguf":
        from kernels import quant_linear

        extra["kernel_isa"] = quant_linear.isa()
    if speculative:
        drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        extra["spec"] = {
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
        }
    precision = {
        "int4": f"{dtype}, layers at 4 bits (int4)",
        "gguf": f"{dtype}, GGUF Q4_1/Q8_0 blocks, 8-bit acts",
        "float": f"{dtype} (GGUF dequantized)",
    }[quant]
    precision += ", captured" if compiled else ""
    precision += ", n-gram speculation" if speculative else ""
    return _median_row(f"tandem {spec}", precision, runs[1:], extra)


def _limits_line(row: dict, peer: dict | None) -> str:
    """Where one Tandem token's time goes: its decode step, the linear layers' share of it, and
    llama.cpp's whole time per token beside it."""
    lim = row["limits"]
    rest = lim["step_ms"] - lim["linear_ms"]
    line = (
        f"decode step {lim['step_ms']:.2f} ms at {lim['context']} tokens of context: linear layers "
        f"{lim['linear_ms']:.2f} ms ({lim['linear_ms'] / lim['step_ms']:.0%}), the rest (attention, norms, "
        f"RoPE, sampling, the step's Python) {rest:.2f} ms"
    )
    if peer is not None:
        line += f"; llama.cpp {1000 / peer['decode_tokens_per_s']:.2f} ms a token in all"
    return line


def run_llamacpp(args, data: dict, threads: int, out: Path, lookup: int = 0) -> tuple[dict | None, str | None]:
    """llama.cpp's row; `lookup` > 0: with its prompt-lookup drafts of that many tokens."""
    if not Path(args.llamacpp_python).exists():
        return None, f"no llama.cpp Python at {args.llamacpp_python} (see ../shared/PEERS.md, or --llamacpp-python)"
    from runtime.llm.loader import default_model_path

    with tempfile.TemporaryDirectory() as tmp:
        prompts, result = Path(tmp) / "prompts.json", Path(tmp) / "result.json"
        prompts.write_text(json.dumps(data))
        cmd = [
            args.llamacpp_python,
            "-P",
            str(CHILD),
            "--prompts-file",
            str(prompts),
            "--result",
            str(result),
            "--model",
            default_model_path(),
            "--threads",
            str(threads),
            "--prompt-lookup",
            str(lookup),
        ]
        env = {k: v for k, v in python_env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        log = out / ("llamacpp-lookup.log" if lookup else "llamacpp.log")
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=3600)
        if proc.returncode != 0 or not result.exists():
            return None, f"llama.cpp failed (exit {proc.returncode}); see {log}"
        res = json.loads(result.read_text())
    name = "llama.cpp + prompt lookup" if lookup else "llama.cpp"
    extra = {"load_s": res["load_s"], "version": res["version"], "system_info": res.get("system_info")}
    row = _median_row(name, res["precision"], res["runs"], extra)
    return row, None


# Set before torch loads, in the process that runs Tandem: torch's kernels, oneDNN's and the
# C++ ops built for torch's level (kernels/cpp_build.py) then run AVX2 code only.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def run(args) -> int:
    if args.avx2_only and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        if "torch" in sys.modules:  # too late to cap this process: run the benchmark in a fresh one
            argv = [sys.executable, "-m", "benchmarks", "single", *sys.argv[sys.argv.index("single") + 1 :]]
            return subprocess.run(argv, env={**os.environ, **AVX2_ENV}).returncode
        os.environ.update(AVX2_ENV)
    import torch

    threads = args.threads or torch.get_num_threads()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from runtime.llm.loader import resolve_hf_dir

    hf_dir, _ = resolve_hf_dir(args.model)
    vocab = json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]
    if args.prompts == "grounded":
        prompts = grounded_prompts(hf_dir, args.runs + 1)
    else:
        prompts = random_prompts(args.runs + 1, args.prompt_len, vocab, f"{args.seed}-single")
    data = {
        "warmup": prompts[0],
        "prompts": prompts[1:],
        "max_tokens": args.max_tokens,
        "limits_context": statistics.median_low(len(p) for p in prompts[1:]),
    }
    flags = cpu_flags()
    print(
        f"CPU flags: {flags}; {threads} threads; prompt {args.prompt_len} tokens, {args.max_tokens} generated, "
        f"{args.runs} runs after a warm-up; {args.prompts} prompts",
        flush=True,
    )
    rows = []
    kernel_isa = "avx2" if args.avx2_only else None
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        rows.append(run_tandem(dtype, data, threads, args.model, kernel_isa))
        print(f"  {rows[-1]['contestant']}: decode {rows[-1]['decode_tokens_per_s']:.1f} tok/s", flush=True)
    specs = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    peer, reason = run_llamacpp(args, data, threads, out)
    peer_spec = None
    if peer is not None and any(d.endswith("-spec") for d in specs):
        peer_spec, why = run_llamacpp(args, data, threads, out, lookup=SPEC["num_speculative_tokens"])
        if peer_spec is None:
            print(f"llama.cpp with prompt lookup not run: {why}")
    for r in (peer, peer_spec):
        if r is not None:
            rows.append(r)
    print(f"\n{'contestant':30s} {'precision':52s} {'decode tok/s':>12s} {'prefill tok/s':>13s} {'TTFT ms':>8s}")
    for r in rows:
        print(
            f"{r['contestant']:30s} {r['precision']:52s} {r['decode_tokens_per_s']:12.1f} "
            f"{r['prefill_tokens_per_s']:13.1f} {r['ttft_ms']:8.1f}"
        )
    tandem = [r for r in rows if r["contestant"].startswith("tandem ")]
    by_name = {r["contestant"]: r for r in tandem}
    for r in tandem:  # speculation against the same configuration without it
        name = r["contestant"]
        if not name.endswith("-spec") or name[: -len("-spec")] not in by_name:
            continue
        ratio = r["decode_tokens_per_s"] / by_name[name[: -len("-spec")]]["decode_tokens_per_s"]
        r["decode_vs_no_spec"] = ratio
        target, need = ("2x", 2.0) if args.prompts == "grounded" else ("0.97x", 0.97)
        acc = r.get("spec", {}).get("acceptance")
        print(
            f"{name} / without speculation: decode {ratio:.2f}x (target >= {target} on {args.prompts} prompts: "
            f"{'met' if ratio >= need else 'NOT met'}); drafts accepted {acc if acc is None else f'{acc:.0%}'}"
        )
    if peer is None:
        print(f"llama.cpp not run: {reason}")
        print("target (decode >= 1.0x llama.cpp on the same GGUF): not measured in this run")
    else:
        for r in tandem:
            spec_row = r["contestant"].endswith("-spec")
            ref = peer_spec if spec_row and peer_spec is not None else peer
            if spec_row and peer_spec is None:
                continue
            r["decode_vs_llamacpp"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
            r["prefill_vs_llamacpp"] = r["prefill_tokens_per_s"] / ref["prefill_tokens_per_s"]
            need = 1.3 if spec_row and args.prompts == "grounded" else 1.0
            met = "met" if r["decode_vs_llamacpp"] >= need else "NOT met"
            print(
                f"{r['contestant']} / {ref['contestant']}: decode {r['decode_vs_llamacpp']:.2f}x "
                f"(target >= {need}x: {met}), prefill {r['prefill_vs_llamacpp']:.2f}x"
            )
            if met == "NOT met" and r.get("limits"):
                print("  what limits it: " + _limits_line(r, ref))
        if peer.get("system_info"):
            print(f"llama.cpp's build: {peer['system_info']}")
    for r in tandem:
        if r.get("limits") and "decode_vs_llamacpp" not in r:
            print(f"{r['contestant']}: " + _limits_line(r, None))
    report = {
        "cpu_flags": flags,
        "threads": threads,
        "model": hf_dir,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "seed": args.seed,
        "llamacpp_reason": reason,
        "avx2_only": args.avx2_only,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "prompts": args.prompts,
        "rows": rows,
    }
    (out / "single.json").write_text(json.dumps(report, indent=2))
    _plot(rows, out / "single.png")
    print(f"wrote {out / 'single.json'} and {out / 'single.png'}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["contestant"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in (
        (axes[0], "decode_tokens_per_s", "decode tokens/s, one sequence"),
        (axes[1], "prefill_tokens_per_s", "prefill tokens/s"),
    ):
        ax.bar(
            names,
            [r[key] for r in rows],
            color=["tab:orange" if n.startswith("llama.cpp") else "tab:blue" for n in names],
        )
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks single", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
