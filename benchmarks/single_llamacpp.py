"""llama.cpp's side of `python -m benchmarks single`: run by the peer's own Python (the
llama-cpp-python venv), so it imports nothing from Tandem. It reads the prompts file the parent
wrote, and for each prompt times the prefill (to the first token) and the decode (every later
token) of one greedy sequence of exactly max_tokens tokens, and writes its result JSON.

    <llama.cpp python> -P benchmarks/single_llamacpp.py --prompts-file P.json --result R.json \
        --model PATH.gguf --threads 2
"""

import argparse
import json
import os
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts-file", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--prompt-lookup", type=int, default=0, help="> 0: llama.cpp's prompt-lookup drafts of N tokens")
    args = p.parse_args()
    with open(args.prompts_file) as f:
        data = json.load(f)
    from llama_cpp import Llama, __version__, llama_print_system_info

    draft = {}
    if args.prompt_lookup > 0:  # llama-cpp-python's draftless speculation (n-gram prompt lookup)
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=args.prompt_lookup)

    n_ctx = max(len(pr) for pr in data["prompts"] + [data["warmup"]]) + data["max_tokens"] + 16
    t = time.perf_counter()
    llm = Llama(
        model_path=args.model,
        n_ctx=n_ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=512,
        verbose=False,
        **draft,
    )
    load_s = time.perf_counter() - t
    runs = []
    for prompt in [data["warmup"], *data["prompts"]]:
        llm.reset()  # no prefix reuse between prompts: each one is prefilled in full
        times = []
        t0 = time.perf_counter()
        # top_k=1 at temperature 0: greedy. generate() never stops by itself (no EOS check).
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if len(times) == data["max_tokens"]:
                break
        runs.append({"prompt_tokens": len(prompt), "t0": t0, "token_times": times})
    result = {
        "version": __version__,
        "precision": "GGUF as shipped (Q4_1, 4-bit)" + (", prompt lookup" if args.prompt_lookup else ""),
        "load_s": load_s,
        # The instruction sets this build of llama.cpp runs ("AVX2 = 1 | AVX512 = 0 | ...").
        "system_info": llama_print_system_info().decode(errors="replace").strip(),
        "warmup": runs[0],
        "runs": runs[1:],
    }
    tmp = args.result + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
