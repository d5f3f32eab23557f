"""`python -m benchmarks.structured`: what one grammar-constrained request costs a decode step.

A batch of --batch running decodes on the engine (SmolLM2-135M-Instruct by default), all free
text, or with --constrained of them held to a JSON schema (an array of at least 64 person
objects, so the grammar never finishes inside the timed steps); the median engine.step() over
--steps steps, after --warmup, in --rounds rounds that alternate the cases (a busy machine
drifts; alternating spreads the drift over both). Beside the step it times, on the host, the
one fill_bitmasks call of each step (llguidance computing the allowed tokens) and the
apply_token_bitmask call (unpack and mask the rows on the logits' device; on CPU that time is
its own, on CUDA it is only the launch).

--grammar picks the constraint: `json` (the schema above, as response_format), `tool` (a
required call, in SmolLM2's generic tool format, to a tool whose arguments are that array: the
call's grammar held for every timed step) or `tool-auto` (tool_choice auto before the model opens
a call: the lazy grammar's free-text phase, the cost every auto request pays for its text).

Prints the CPU first; writes structured.json and structured.png to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import cpu_info

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "minItems": 64,
}
PROMPT = "List many fictional people with their ages, as JSON."
STORY = "Write a long story about a lighthouse keeper and the sea."
GRAMMARS = ("json", "tool", "tool-auto")


def held_request(engine, grammar: str) -> tuple[str, dict]:
    """The constrained requests' prompt and structured_outputs for --grammar."""
    if grammar == "json":
        return engine.apply_chat_template([{"role": "user", "content": PROMPT}]), {"json": SCHEMA}
    from runtime.llm.tools import parse_tools, tool_format_for

    tool = {
        "type": "function",
        "function": {
            "name": "record_people",
            "description": "Record fictional people with their ages.",
            "parameters": {"type": "object", "properties": {"people": SCHEMA}, "required": ["people"]},
        },
    }
    choice = "required" if grammar == "tool" else "auto"
    request = parse_tools([tool], choice)
    fmt = tool_format_for(engine.tokenizer, None)
    content = PROMPT if grammar == "tool" else STORY
    prompt = fmt.render(engine.tokenizer, [{"role": "user", "content": content}], request)
    return prompt, fmt.structured_outputs(request)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--batch", type=int, default=8, help="running decodes per step")
    p.add_argument("--constrained", default="0,1", help="comma-separated counts of constrained requests")
    p.add_argument("--steps", type=int, default=40, help="timed steps per round (median over all)")
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--grammar", default="json", choices=GRAMMARS, help="the constraint (see above)")
    p.add_argument("--out", default="bench_out/structured")


class _Timer:
    """Wraps a callable and records its wall time per call (host side)."""

    def __init__(self, fn) -> None:
        self.fn, self.times = fn, []

    def __call__(self, *args, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kw)
        finally:
            self.times.append(time.perf_counter() - t)


def _case(engine, batch: int, constrained: int, steps: int, warmup: int, grammar: str = "json") -> dict:
    from runtime.llm import sampler as sampler_module
    from runtime.llm.sampling_params import SamplingParams

    chat = engine.apply_chat_template([{"role": "user", "content": PROMPT}])
    held_prompt, spec = held_request(engine, grammar)
    budget = warmup + steps + 64
    free = SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True)
    held = SamplingParams(max_tokens=budget, temperature=0, structured_outputs=spec)
    ids = [engine.add_request(*((held_prompt, held) if k < constrained else (chat, free))) for k in range(batch)]
    while engine.scheduler.stats().num_waiting or engine.last_step_shape[1] != batch:
        engine.step()  # the prefills, until every request decodes
    for _ in range(warmup):
        engine.step()
    compiler = engine.runner.grammar_compiler
    fill = apply = None
    if constrained:
        fill = compiler.fill_bitmasks = _Timer(type(compiler).fill_bitmasks.__get__(compiler))
        apply = sampler_module.apply_token_bitmask = _Timer(sampler_module.apply_token_bitmask)
    times = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
            if engine.last_step_shape != (batch, batch):
                raise RuntimeError(f"a request finished inside the timed steps: step shape {engine.last_step_shape}")
    finally:
        if constrained:
            del compiler.fill_bitmasks
            sampler_module.apply_token_bitmask = apply.fn
        for rid in ids:
            engine.abort(rid)
    return {
        "step_ms": [1000 * t for t in times],
        "fill_ms": [1000 * t for t in fill.times] if fill else [],
        "apply_ms": [1000 * t for t in apply.times] if apply else [],
    }


def run(args) -> int:
    import torch

    from runtime.llm.engine import EngineConfig, LLMEngine

    cpu = cpu_info()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores; flags: {cpu['flags']}; {torch.get_num_threads()} threads")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = [int(c) for c in args.constrained.split(",")]
    if any(not 0 <= c <= args.batch for c in counts):
        raise SystemExit(f"--constrained counts must be in [0, {args.batch}], got {counts}")
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            max_num_seqs=args.batch,
            max_model_len=1024,
            enable_prefix_caching=False,
            enforce_eager=True,
        )
    )
    device = engine.runner.device.type
    engine.grammar_compiler()  # built once, outside the timed steps
    samples = {c: {"step_ms": [], "fill_ms": [], "apply_ms": []} for c in counts}
    for r in range(args.rounds):
        for c in counts if r % 2 == 0 else counts[::-1]:
            got = _case(engine, args.batch, c, args.steps, args.warmup, args.grammar)
            for k, v in got.items():
                samples[c][k] += v
    rows = []
    for c in counts:
        s = samples[c]
        row = {"constrained": c, "batch": args.batch, "steps": len(s["step_ms"])}
        for k, v in s.items():
            row[k.replace("_ms", "_median_ms")] = statistics.median(v) if v else None
        rows.append(row)
    base = rows[0]["step_median_ms"]
    print(
        f"\ndevice {device}, {args.dtype}, batch {args.batch}, grammar {args.grammar}, "
        f"{rows[0]['steps']} timed steps per case"
    )
    print(f"{'constrained':>11s} {'step ms':>8s} {'vs first':>8s} {'fill ms':>8s} {'apply ms':>8s}")
    for row in rows:
        fill = "-" if row["fill_median_ms"] is None else f"{row['fill_median_ms']:8.3f}"
        apply = "-" if row["apply_median_ms"] is None else f"{row['apply_median_ms']:8.3f}"
        print(
            f"{row['constrained']:11d} {row['step_median_ms']:8.2f} {row['step_median_ms'] / base:7.3f}x "
            f"{fill:>8s} {apply:>8s}"
        )
    report = {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "device": device,
        "dtype": args.dtype,
        "model": args.model,
        "schema": SCHEMA,
        "grammar": args.grammar,
        "args": vars(args),
        "rows": rows,
        "samples": {str(c): samples[c] for c in counts},
    }
    (out / "structured.json").write_text(json.dumps(report, indent=2))
    _plot(rows, samples, out / "structured.png", f"{device}, {args.dtype}, batch {args.batch}, {args.grammar}")
    engine.close()
    print(f"wrote {out / 'structured.json'} and {out / 'structured.png'}")
    return 0


def _plot(rows: list[dict], samples: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['constrained']} constrained" for r in rows]
    left.boxplot([samples[r["constrained"]]["step_ms"] for r in rows], showfliers=False)
    left.set_xticks(range(1, len(rows) + 1), labels)
    left.set_ylabel("engine.step() ms")
    left.set_title(f"decode step, {title}")
    x = range(len(rows))
    fills = [r["fill_median_ms"] or 0 for r in rows]
    applies = [r["apply_median_ms"] or 0 for r in rows]
    right.bar(x, fills, label="fill_bitmasks (host)")
    right.bar(x, applies, bottom=fills, label="apply_token_bitmask")
    right.set_xticks(list(x), labels)
    right.set_ylabel("median ms per step")
    right.set_title("grammar work per step")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
