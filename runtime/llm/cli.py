"""`tandem generate` (streams one answer) and `tandem chat` (interactive)."""

from __future__ import annotations

import sys


def _llm_and_params(args):
    from runtime.llm.api import LLM
    from runtime.llm.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    print("loading model ...", file=sys.stderr, flush=True)
    return LLM(model=args.model, dtype=args.dtype, device=args.device), params


def _stream(llm, prompt, params) -> str:
    text = []
    out = None
    for out in llm.stream(prompt, params):
        if out.delta_text:
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            text.append(out.delta_text)
    sys.stdout.write("\n")
    m = out.metrics
    ttft = m.time_to_first_token or 0.0
    rate = m.decode_tokens_per_s
    print(
        f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, TTFT {ttft * 1000:.0f} ms"
        + (f", {rate:.1f} tokens/s]" if rate else "]"),
        file=sys.stderr,
    )
    return "".join(text)


def run_generate(args) -> int:
    try:
        llm, params = _llm_and_params(args)
        prompt = args.prompt
        if not args.no_chat_template and getattr(llm.tokenizer, "chat_template", None):
            prompt = llm.apply_chat_template([{"role": "user", "content": prompt}])
        _stream(llm, prompt, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run_chat(args) -> int:
    try:
        llm, params = _llm_and_params(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    history: list[dict] = []
    print("Chat with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        try:
            answer = _stream(llm, llm.apply_chat_template(history), params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})
    return 0
