"""`tandem bench llm`: useful tokens/s on one workload, every contestant in the same run.

Workload: chat prompts with output lengths drawn at random (seeded; log-uniform by default,
since real answer lengths are long-tailed, or uniform), `ignore_eos` so every request
generates exactly its length; 16 slots. "Useful" tokens are the ones requests asked
for: a static batch that keeps decoding for its longest member earns nothing for the padding.

Contestants: Tandem continuous, Tandem static (request-level batching on the same engine),
Hugging Face `generate` in static batches (left-padded), and Hugging Face's continuous
batching manager, all on the same weights and dtype.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from pathlib import Path

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis to a child.", "Write a short poem about rain.",
    "List three uses of copper.", "Why is the sky blue?", "Give me a recipe idea with lentils.",
    "What causes tides?", "Summarise the plot of a heist movie you invent.", "How do vaccines work?",
    "Suggest a name for a bakery.", "What is a prime number?", "Describe a sunset over the sea.",
]  # fmt: skip
VLLM_CPU_REFERENCE = {"float32": 76.0, "bfloat16": 189.0}  # measured on this machine kind, not in this run


def add_bench_arguments(p) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dist", choices=["loguniform", "uniform"], default="loguniform", help="output lengths")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true", help="only Tandem's two schedulers")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--seed", type=int, default=0)


def _workload(tokenizer, n: int, lo: int, hi: int, seed: int, dist: str) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    draw = (lambda: round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) if dist == "loguniform" else (
        lambda: rng.randint(lo, hi)
    )
    prompts, lengths = [], []
    for i in range(n):
        msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
        lengths.append(draw())
    return prompts, lengths


def _tandem(model, dtype, scheduler, prompts, lengths, slots) -> dict:
    from runtime.llm.api import LLM
    from runtime.llm.sampling_params import SamplingParams

    llm = LLM(model=model, dtype=dtype, device="cpu", max_num_seqs=slots, scheduler=scheduler)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    steps0 = llm.engine.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    useful = sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics.time_to_first_token for o in outs]
    return {
        "name": f"tandem {scheduler}", "useful_tokens": useful, "seconds": wall, "tokens_per_s": useful / wall,
        "steps": llm.engine.num_steps - steps0, "ttft_p50_s": statistics.median(ttft),
        "preemptions": llm.engine.scheduler.table.num_preemptions,
    }  # fmt: skip


def _hf_model(model, dtype):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.llm.loader import resolve_hf_dir

    hf_dir, _ = resolve_hf_dir(model)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    return hf, AutoTokenizer.from_pretrained(hf_dir)


def _hf_static(hf, tok, prompts, lengths, slots) -> dict:
    import torch
    from tqdm import tqdm

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    useful = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in tqdm(range(0, len(prompts), slots), desc="hf static", leave=False):
            group, want = prompts[i : i + slots], lengths[i : i + slots]
            width = max(map(len, group))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = hf.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max(want), min_new_tokens=max(want),
                do_sample=False, pad_token_id=pad,
            )  # fmt: skip
            useful += sum(min(n, out.shape[1] - width) for n in want)
    wall = time.perf_counter() - t0
    return {"name": "hf static", "useful_tokens": useful, "seconds": wall, "tokens_per_s": useful / wall}


def _hf_continuous(hf, tok, prompts, lengths, slots) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(lengths), eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_requests_per_batch=slots, max_batch_tokens=256)
    mgr = hf.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    mgr.start()
    try:
        t0 = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        useful = 0
        for _ in prompts:
            res = mgr.get_result(timeout=600)
            if res is None:
                raise RuntimeError("Hugging Face continuous batching returned no result within 600 s")
            useful += len(res.generated_tokens)
        wall = time.perf_counter() - t0
    finally:
        mgr.stop(block=True)
    return {"name": "hf continuous", "useful_tokens": useful, "seconds": wall, "tokens_per_s": useful / wall}


def run_bench(args) -> int:
    from runtime.llm.loader import load_model

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    tok = load_model(args.model).tokenizer
    prompts, lengths = _workload(tok, args.num_requests, args.min_tokens, args.max_tokens, args.seed, args.dist)
    print(
        f"{len(prompts)} requests, {args.dist} output lengths {min(lengths)}..{max(lengths)} "
        f"(mean {statistics.fmean(lengths):.0f}, sum {sum(lengths)}), {args.slots} slots"
    )
    report = {"num_requests": len(prompts), "useful_tokens": sum(lengths), "slots": args.slots,
              "dist": args.dist, "lengths": lengths, "runs": {}}  # fmt: skip
    for dtype in dtypes:
        rows = [_tandem(args.model, dtype, "continuous", prompts, lengths, args.slots),
                _tandem(args.model, dtype, "static", prompts, lengths, args.slots)]  # fmt: skip
        if not args.skip_hf:
            hf, hf_tok = _hf_model(args.model, dtype)
            rows.append(_hf_static(hf, hf_tok, prompts, lengths, args.slots))
            try:
                rows.append(_hf_continuous(hf, hf_tok, prompts, lengths, args.slots))
            except Exception as e:  # report a peer that cannot run here instead of hiding it
                rows.append({"name": "hf continuous", "error": f"{type(e).__name__}: {e}"[:300]})
        report["runs"][dtype] = rows
        _print(dtype, rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llm.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "llm.png")
    print(f"wrote {out / 'llm.json'} and {out / 'llm.png'}")
    return 0


def _print(dtype: str, rows: list[dict]) -> None:
    ours = rows[0]["tokens_per_s"]
    print(f"\n{dtype}: {'contestant':<16}{'useful tok/s':>14}{'seconds':>10}{'continuous is':>16}")
    for r in rows:
        if "error" in r:
            print(f"{'':9}{r['name']:<16}  could not run: {r['error']}")
            continue
        print(f"{'':9}{r['name']:<16}{r['tokens_per_s']:>14.1f}{r['seconds']:>10.1f}{ours / r['tokens_per_s']:>15.2f}x")
    ref = VLLM_CPU_REFERENCE.get(dtype)
    if ref:
        print(f"{'':9}{'vLLM CPU (ref.)':<16}{ref:>14.1f}{'':>10}{ours / ref:>15.2f}x  (figure from the brief, not this run)")


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    dtypes = list(report["runs"])
    names = [r["name"] for r in report["runs"][dtypes[0]]]
    width = 0.8 / max(1, len(dtypes))
    for j, dtype in enumerate(dtypes):
        vals = [r.get("tokens_per_s", 0.0) for r in report["runs"][dtype]]
        ax.bar([i + j * width for i in range(len(names))], vals, width, label=dtype)
    ax.set_xticks([i + width * (len(dtypes) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("useful tokens/s")
    ax.set_title(f"SmolLM2-135M, {report['num_requests']} requests, {report['slots']} slots (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
