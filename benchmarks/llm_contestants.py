"""Tandem's side of `tandem bench llm` (and Hugging Face `generate`'s, behind --with-hf): one
contestant in a fresh process. It reads the traces file the parent wrote, builds its engine,
runs the warm-up, then each trace, and writes its result JSON after each trace (so what was
done survives a later crash). Progress goes to stderr; the parent prints the tables.

    python -m benchmarks.llm_contestants --contestant tandem-continuous --traces-file T.json \
        --result R.json --dtype bfloat16 --slots 16 --max-model-len 2048 [--model M] [--floor]

Requests join the engine when their arrival time has passed, with `ignore_eos`, temperature 0
and prefix caching off. Per step: the requests running and the fraction of KV blocks in use
when the step ends (the point where vLLM's scheduler stats are taken, so both read alike), and
the requests in the step itself. Time to first token: from the request's arrival to the step
that produced its first token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CONTESTANTS = ("tandem-continuous", "tandem-static", "tandem-spec", "hf-generate")


def _write(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def run_trace(engine, requests: list[dict], desc: str) -> dict:
    """One trace through a Tandem engine; the raw records the parent summarises."""
    from tqdm import tqdm

    from runtime.llm.sampling_params import SamplingParams

    n = len(requests)
    order = sorted(range(n), key=lambda i: requests[i]["arrival_s"])
    pool, sched = engine.runner.kv_pool, engine.scheduler
    running, batch, kv = [], [], []
    done: dict[int, object] = {}
    steps0 = engine.num_steps
    bar = tqdm(total=n, desc=desc, unit="req", file=sys.stderr, leave=False, mininterval=1.0)
    k = 0
    try:
        t0 = time.monotonic()
        while k < n or engine.has_unfinished():
            now = time.monotonic()
            while k < n and t0 + requests[order[k]]["arrival_s"] <= now:
                i = order[k]
                r = requests[i]
                params = SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True)
                engine.add_request(r["prompt"], params, request_id=f"r{i}")
                k += 1
            if not engine.has_unfinished():
                time.sleep(max(0.0, t0 + requests[order[k]]["arrival_s"] - time.monotonic()))
                continue
            before = engine.num_steps
            outs = engine.step()
            if engine.num_steps > before:
                batch.append(engine.last_step_shape[0])
                running.append(len(sched.running))
                kv.append(pool.num_used_blocks / pool.num_blocks)
            for o in outs:
                if o.error:
                    raise RuntimeError(f"{desc}: request {o.request_id} failed: {o.error}")
                if o.finished:
                    done[int(o.request_id[1:])] = o
                    bar.update(1)
    finally:
        bar.close()
    if len(done) != n:
        raise RuntimeError(f"{desc}: {n - len(done)} of {n} requests never finished")
    ends = [o.metrics.finished_time for o in done.values()]
    return {
        "seconds": max(ends) - t0,
        "requests": [
            {
                "asked": r["max_tokens"],
                "produced": len(done[i].token_ids),
                "ttft_s": None
                if done[i].metrics.first_token_time is None
                else done[i].metrics.first_token_time - (t0 + r["arrival_s"]),
                "e2e_s": done[i].metrics.finished_time - (t0 + r["arrival_s"]),
            }
            for i, r in enumerate(requests)
        ],
        "steps": engine.num_steps - steps0,
        "step_running": running,
        "step_batch": batch,
        "step_kv": kv,
        "stats_when": "after each step (running, KV); step_batch: requests in the step",
        "preemptions": sched.table.num_preemptions,
    }


def measure_floor(engine, num_seqs: int, context_len: int) -> dict:
    """The lead's `step_vs_floor`, or why it could not run (it may not exist yet)."""
    try:
        from runtime.llm.profile import step_vs_floor

        out = step_vs_floor(engine, num_seqs=num_seqs, context_len=context_len)
    except (AttributeError, ImportError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "num_seqs": num_seqs, "context_len": context_len}
    except Exception as exc:  # noqa: BLE001 - the traces' results are already written
        return {"error": f"{type(exc).__name__}: {exc}", "num_seqs": num_seqs, "context_len": context_len}
    return {"num_seqs": num_seqs, "context_len": context_len, **dict(out)}


def _tandem(args, data: dict) -> dict:
    from runtime.llm.api import LLM
    from runtime.memory import DEFAULT_CPU_BUDGET_BYTES, DeviceMemoryManager, MemoryConfig

    name = args.contestant.split("-", 1)[1]
    scheduler = "continuous" if name == "spec" else name
    result = {"contestant": f"tandem {name}", "dtype": args.dtype, "runs": {}}
    speculative = None
    if name == "spec":  # the continuous engine with n-gram speculation, as `benchmarks single` runs it
        from benchmarks.single import SPEC

        speculative = SPEC
    t = time.perf_counter()
    # The KV cache the other engines get too: the default budget (weights, activations, ...)
    # grows by exactly that much, so that the pool is that size whatever the dtype.
    kv_bytes = int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None
    memory = DeviceMemoryManager(MemoryConfig(device="cpu", budget_bytes=DEFAULT_CPU_BUDGET_BYTES + (kv_bytes or 0)))
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device="cpu",
        max_num_seqs=args.slots,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduler=scheduler,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
        kv_cache_bytes=kv_bytes,
        memory=memory,
        speculative_config=speculative,
        quantization="float",  # vLLM's CPU build runs the GGUF dequantized: the same weights on both sides
    )
    engine = llm.engine
    graph = engine.runner.graph  # enforce_eager=False (TANDEM_ENFORCE_EAGER=0): the captured step
    if graph is not None:
        graph.done.wait()  # time the graph, not the eager steps served while it compiles
        result["compile_s"] = graph.compile_seconds
        result["compile_failed"] = graph.failed
    result["load_s"] = time.perf_counter() - t
    c = engine.scheduler.config
    pool = engine.runner.kv_pool
    result["config"] = {
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "max_model_len": engine.max_model_len,
        "enable_prefix_caching": pool.enable_prefix_caching,
        "block_size": pool.block_size,
        "num_kv_blocks": pool.num_blocks,
        "kv_cache_gib": args.kv_cache_gib,
        "captured_decode": graph is not None and graph.failed is None,
    }
    t = time.perf_counter()
    run_trace(engine, data["warmup"], f"tandem {scheduler} warm-up")
    result["warmup_s"] = time.perf_counter() - t
    for name in data["order"]:
        result["runs"][name] = run_trace(engine, data["traces"][name]["requests"], f"{scheduler} {args.dtype} {name}")
        result["runs"][name]["graph_steps"] = engine.runner.num_graph_steps
        _write(args.result, result)
    if args.floor:
        result["floor"] = measure_floor(engine, num_seqs=min(16, args.slots), context_len=128)
    return result


def _hf_generate(args, data: dict) -> dict:
    """Hugging Face `generate` in static batches of `slots` (left-padded, in arrival order),
    each batch running for its longest member. It has no arrivals: traces whose requests do
    not all arrive at t=0 are skipped. Steps: forward passes (one per token of the longest)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.llm.loader import resolve_hf_dir
    from runtime.threads import settle_native_pools

    settle_native_pools()
    result = {"contestant": "hf generate", "dtype": args.dtype, "runs": {}, "skipped": {}}
    t = time.perf_counter()
    hf_dir, _ = resolve_hf_dir(args.model)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, args.dtype)).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    result["load_s"] = time.perf_counter() - t
    result["config"] = {"max_num_seqs": args.slots}

    def run(requests: list[dict], desc: str) -> dict:
        steps, produced = 0, []
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i in tqdm(range(0, len(requests), args.slots), desc=desc, file=sys.stderr, leave=False):
                group = requests[i : i + args.slots]
                width, most = max(len(r["prompt"]) for r in group), max(r["max_tokens"] for r in group)
                ids = torch.tensor([[pad] * (width - len(r["prompt"])) + r["prompt"] for r in group])
                mask = torch.tensor([[0] * (width - len(r["prompt"])) + [1] * len(r["prompt"]) for r in group])
                out = hf.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=most,
                    min_new_tokens=most,
                    do_sample=False,
                    pad_token_id=pad,
                )
                produced += [min(r["max_tokens"], out.shape[1] - width) for r in group]
                steps += most
        wall = time.perf_counter() - t0
        return {
            "seconds": wall,
            "steps": steps,
            "requests": [
                {"asked": r["max_tokens"], "produced": p, "ttft_s": None, "e2e_s": None}
                for r, p in zip(requests, produced)
            ],
        }

    run(data["warmup"], "hf warm-up")
    for name in data["order"]:
        requests = data["traces"][name]["requests"]
        if any(r["arrival_s"] > 0 for r in requests):
            result["skipped"][name] = "generate has no arrivals: only traces that all arrive at t=0"
            continue
        result["runs"][name] = run(requests, f"hf {args.dtype} {name}")
        _write(args.result, result)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llm_contestants", description=__doc__.split("\n\n")[0])
    p.add_argument("--contestant", choices=CONTESTANTS, required=True)
    p.add_argument("--traces-file", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    p.add_argument("--slots", type=int, required=True)
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="Tandem's step budget (default: the engine's)"
    )
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--floor", action="store_true", help="measure step_vs_floor after the traces")
    args = p.parse_args(argv)
    with open(args.traces_file) as f:
        data = json.load(f)
    result = _hf_generate(args, data) if args.contestant == "hf-generate" else _tandem(args, data)
    _write(args.result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
