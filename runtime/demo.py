"""`tandem demo` (the README's `make demo`): the mixed workload on embedded defaults, with no
external services. Each part prints what it did and how long it took."""

from __future__ import annotations

import time

SEED_LENGTHS = [5, 50, 8, 12, 40, 3, 30, 7]


def _banner(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


def run_scheduler_demo() -> None:
    from runtime.simulate import format_report

    _banner("Schedulers: the seed example, static vs continuous batching (no model)")
    print(format_report(SEED_LENGTHS, 4))


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "Write a haiku about autumn.",
    "What is the boiling point of water in Celsius?",
    "Explain in one sentence what a GPU is.",
    "Name two planets larger than Earth.",
]


def run_llm_demo(llm) -> None:
    from runtime import SamplingParams

    _banner("LLM: SmolLM2-135M-Instruct, continuous batching over a paged KV cache")
    params = SamplingParams(max_tokens=64, temperature=0)
    t0 = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": q}] for q in CHAT_QUESTIONS], params)
    wall = time.perf_counter() - t0
    for q, out in zip(CHAT_QUESTIONS, outs):
        m = out.metrics
        rate = m.decode_tokens_per_s
        print(f"\nQ: {q}\nA: {out.text.strip()}")
        print(
            f"   [{len(out.token_ids)} tokens, {out.finish_reason}, TTFT {m.time_to_first_token * 1000:.0f} ms, "
            f"{rate:.1f} tokens/s for this request]" if rate else f"   [{len(out.token_ids)} tokens, {out.finish_reason}]"
        )
    total = sum(len(o.token_ids) for o in outs)
    print(f"\n{len(outs)} requests, {total} tokens in {wall:.1f} s: {total / wall:.1f} tokens/s overall, "
          f"{llm.engine.num_steps} engine steps")


def _print_memory(memory) -> None:
    stats = memory.stats()
    mib = 2**20
    print(f"device budget {stats['total_bytes'] / mib:.0f} MiB, every byte with an owner:")
    for owner, n in stats["owners"].items():
        print(f"  {owner:<22}{n / mib:>9.1f} MiB")
    print(f"  {'(unreserved)':<22}{stats['free_bytes'] / mib:>9.1f} MiB")
    kv = stats.get("kv_blocks")
    if kv:
        print(f"  KV pool: {kv['total']} blocks of {kv['block_size']} tokens, {kv['bytes_per_block'] / 1024:.0f} KiB each")


def run_demo(vision: bool = True, llm: bool = True) -> int:
    from contextlib import nullcontext

    from runtime.memory import DeviceMemoryManager, MemoryConfig

    t0 = time.perf_counter()
    run_scheduler_demo()
    if not (vision or llm):
        return 0
    # One memory manager for the device, as in the runtime: vision reserves its weights, batch
    # buffers and activation peak first; the LLM takes its weights and activations, and the
    # rest becomes KV blocks.
    memory = DeviceMemoryManager(MemoryConfig(budget_bytes=3 * 2**30))
    _banner("One device, two workloads: loading")
    t1 = time.perf_counter()
    if vision:
        from runtime.vision.demo import demo_config
        from runtime.vision.engine import VisionEngine

        vision_ctx = VisionEngine(demo_config(), memory=memory)
    else:
        vision_ctx = nullcontext(None)
    with vision_ctx as vision_engine:
        model = None
        if llm:
            from runtime import LLM

            model = LLM(memory=memory)
        print(f"loaded in {time.perf_counter() - t1:.1f} s")
        _print_memory(memory)
        if model is not None:
            run_llm_demo(model)
        if vision_engine is not None:
            from runtime.vision.demo import run_vision_demo

            _banner("Vision: YOLO26n under the dynamic batcher")
            run_vision_demo(vision_engine)
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")
    return 0
