"""GPU check of the LLM engine end to end: python -m benchmarks gpu-engine [--out DIR] [--quick].
Under 8 minutes on one H200 (a 460 s budget; --quick, SmolLM2's shapes only: 200 s); exits 2
where CUDA is unavailable, unless --device cpu (with --tiny: every section on a tiny model in
seconds, which tests/test_bench_gpu_engine.py runs). Needs torch, triton and transformers only
(matplotlib for the plot, if there), and nothing outside the repository:

    PYTHONUNBUFFERED=1 python -m benchmarks gpu-engine --out $OUT            # full
    PYTHONUNBUFFERED=1 python -m benchmarks gpu-engine --quick --out $OUT    # SmolLM2 shapes only
    ... --sections throughput --modes captured --models llama-1b             # a part of it

No model files and no network: each model is a seeded random-weight Llama (normal init, std
about 1.2/sqrt(hidden); norms 1) in the shapes of a real checkpoint, saved as a Hugging Face folder
(safetensors, config, and a word-level tokenizer with one word per id, which Tandem's loader
wants; every prompt is token ids) that both Tandem and transformers load.

  smollm2-135m  SmolLM2-135M-Instruct: vocab 49152, hidden 576, 30 layers, 9/3 heads
  llama-1b      Llama-3.2-1B: vocab 128256, hidden 2048, 16 layers, 32/8 heads, llama3 RoPE
  tiny          2 layers, hidden 64, vocab 512 (--tiny; for the CPU test)

Per model, each section in its own try/except (a failure is recorded, the rest still runs) and
under its own time budget (what is left of it when an item would start decides whether it runs;
items past it are recorded as skipped):

  correctness   Tandem's LLMEngine against transformers' `generate` on the same weights: greedy
                tokens of a few random token-id prompts, float32 and bfloat16, the engine eager
                and captured (EngineConfig.enforce_eager False; "not available" where the
                engine has no such field). Reported: the share of tokens before each prompt's
                first divergence, the prompts identical throughout, the first divergence.
                float32 should be token-identical.
  throughput    a bench trace (64 and 256 requests, 128-token random prompts, 128 output tokens,
                ignore_eos, greedy), bfloat16: Tandem eager, Tandem captured, and transformers'
                own continuous batching (`generate_batch`) on the same GPU and trace; output
                tokens/s (each after a warm-up run of the same shape on other prompts).
  decode_floor  a decode step of the engine at 64 running sequences (128-token prompts), timed
                by engine.step() once the batch is all decode (and the runner's execute within
                it), against its matmul floor: the model's linear layers alone (30 x 4 + 1 for
                SmolLM2, weights of the same shapes, 64 rows), one after another, timed with
                CUDA events, launched one by one and replayed from a CUDA graph.

Writes DIR/gpu_engine.json (after every item, so a run cut short keeps what it measured) and
DIR/gpu_engine.png (default bench_out). Exit code 0 when every section ran and float32 greedy
tokens matched transformers exactly, 1 otherwise, 2 where it cannot run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

# name -> (LlamaConfig fields, init std). The std keeps attention logits (~std^2 * hidden) near 1.4
# in each, so attention is not uniform and greedy output does not collapse onto one token (checked
# on CPU: SmolLM2's shapes at 0.02 repeat one token; at 0.05, and Llama-1B's at 0.026, they do not;
# logits' top-2 gap about 0.28, far above float32 rounding).
MODELS: dict[str, tuple[dict, float]] = {
    "smollm2-135m": (
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
        ),
        0.05,  # at 0.02 its 30 layers attend almost uniformly: greedy output repeats one token
    ),
    "llama-1b": (
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
        ),
        0.026,
    ),
    "tiny": (
        dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            max_position_embeddings=1024,
        ),
        0.2,
    ),
}
SECTIONS = ("correctness", "throughput", "decode_floor")
MODES = ("eager", "captured")
CORRECTNESS_DTYPES = ("float32", "bfloat16")
JSON_NAME, PLOT_NAME = "gpu_engine.json", "gpu_engine.png"


class NotAvailable(Exception):
    """The engine lacks what an item needs (the captured mode before it exists, say)."""


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


# ---------------------------------------------------------------- settings


def settings(args: argparse.Namespace) -> dict:
    """What each section runs, from the flags: full (GPU), --quick (GPU) or --tiny (CPU test)."""
    if args.tiny:
        s = dict(
            models=["tiny"],
            prompt_lens=[3, 9, 17, 40],
            new_tokens=16,
            traces=[8, 16],
            trace_prompt=16,
            trace_output=8,
            floor_seqs=8,
            floor_prompt=16,
            floor_reps=5,
            max_model_len=128,
            budgets=dict(correctness=60, throughput=90, decode_floor=30),
            total=240,
        )
    elif args.quick:
        s = dict(
            models=["smollm2-135m"],
            prompt_lens=[5, 17, 64, 200],
            new_tokens=32,
            traces=[64, 256],
            trace_prompt=128,
            trace_output=128,
            floor_seqs=64,
            floor_prompt=128,
            floor_reps=20,
            max_model_len=512,
            budgets=dict(correctness=45, throughput=110, decode_floor=30),
            total=200,
        )
    else:
        s = dict(
            models=["smollm2-135m", "llama-1b"],
            prompt_lens=[5, 17, 64, 200],
            new_tokens=32,
            traces=[64, 256],
            trace_prompt=128,
            trace_output=128,
            floor_seqs=64,
            floor_prompt=128,
            floor_reps=30,
            max_model_len=512,
            budgets=dict(correctness=60, throughput=150, decode_floor=40),
            total=460,
        )
    if args.models:
        s["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in s["models"] if m not in MODELS]
        if unknown:
            raise SystemExit(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if args.traces:
        s["traces"] = [int(n) for n in args.traces.split(",")]
    if args.total_budget_s:
        s["total"] = args.total_budget_s
    if args.budget_scale != 1.0:
        s["budgets"] = {k: v * args.budget_scale for k, v in s["budgets"].items()}
    s["modes"] = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not s["modes"] or [m for m in s["modes"] if m not in MODES]:
        raise SystemExit(f"--modes must name some of {list(MODES)}, got {args.modes!r}")
    s["sections"] = [x.strip() for x in args.sections.split(",")] if args.sections else list(SECTIONS)
    bad = [x for x in s["sections"] if x not in SECTIONS]
    if bad:
        raise SystemExit(f"unknown section(s) {bad}; choose from {list(SECTIONS)}")
    return s


def device_info(device: str) -> dict:
    import transformers

    info: dict = dict(
        device=device,
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        host=platform.node(),
    )
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001 - the CPU path needs no triton
        info["triton"] = f"not importable: {_err(e)}"
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(torch.device(device))
        info.update(
            gpu=torch.cuda.get_device_name(torch.device(device)),
            capability=f"{p.major}.{p.minor}",
            memory_gib=round(p.total_memory / 2**30, 1),
            sms=p.multi_processor_count,
            cuda=torch.version.cuda,
        )
    else:
        info["cpu_threads"] = torch.get_num_threads()
    info["flags"] = flags()
    try:
        from runtime.llm.engine import EngineConfig

        info["engine_config_fields"] = sorted(getattr(EngineConfig, "__dataclass_fields__", {}))
        info["enforce_eager_available"] = "enforce_eager" in info["engine_config_fields"]
    except Exception as e:  # noqa: BLE001 - recorded; the sections say what fails
        info["engine_config_fields"] = _err(e)
    return info


def flags() -> dict:
    """The settings that change numerics or speed, as they stand now (an engine may change them)."""
    f: dict = {}
    for key, read in (
        ("float32_matmul_precision", torch.get_float32_matmul_precision),
        ("cuda_matmul_allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
        ("cudnn_allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
        ("bf16_reduced_precision_reduction", lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
    ):
        try:
            f[key] = read()
        except Exception as e:  # noqa: BLE001 - a torch that renamed a flag
            f[key] = _err(e)
    for k in ("TRITON_INTERPRET", "CUDA_LAUNCH_BLOCKING", "TORCH_COMPILE_DISABLE", "CUDA_VISIBLE_DEVICES"):
        if k in os.environ:
            f[k] = os.environ[k]
    return f


# ---------------------------------------------------------------- models


def save_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer, word "t<i>" for id i: Tandem's loader loads a tokenizer with every
    model, and prompts here are token ids anyway."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)


def llama_config(fields: dict):
    """A LlamaConfig with no EOS, BOS or pad id (so nothing stops early and HF's generate runs its
    full length); RoPE given as transformers 5's rope_parameters, or 4.x's rope_theta/rope_scaling."""
    from transformers import LlamaConfig

    common = dict(fields, bos_token_id=None, eos_token_id=None, pad_token_id=None, architectures=["LlamaForCausalLM"])
    config = LlamaConfig(**common)
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or rope.get("rope_theta") != fields["rope_parameters"]["rope_theta"]:
        legacy = dict(common)
        rp = dict(legacy.pop("rope_parameters"))
        legacy["rope_theta"] = rp.pop("rope_theta")
        if rp.get("rope_type") != "default":
            legacy["rope_scaling"] = rp
        config = LlamaConfig(**legacy)
    return config


def build_model(name: str, root: Path, device: str, seed: int) -> dict:
    """A seeded random-weight Llama of `name`'s shapes, saved (bfloat16, which float32 holds
    exactly, so both dtypes compare the same weights) as an HF folder under `root`."""
    from transformers import LlamaForCausalLM

    fields, std = MODELS[name]
    t0 = time.perf_counter()
    config = llama_config(fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.fill_(1.0)  # the RMSNorm weights
            assert torch.isfinite(p).all(), pname
    model.to(torch.bfloat16)
    path = root / name
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(str(path), fields["vocab_size"])
    params = sum(p.numel() for p in model.parameters())
    del model
    _free(device)
    return dict(
        path=str(path),
        params=params,
        init_std=std,
        seed=seed,
        saved_dtype="bfloat16",
        build_s=time.perf_counter() - t0,
        config={k: v for k, v in fields.items()},
    )


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------- engines


def kv_bytes_for(fields: dict, dtype: str, tokens: int) -> int:
    elt = 4 if dtype == "float32" else 2
    per_token = 2 * fields["num_hidden_layers"] * fields["num_key_value_heads"] * fields["head_dim"] * elt
    return int(per_token * tokens * 1.25) + (1 << 20)


class Engines:
    """Tandem engines of one model, made once per (dtype, mode) and shared by the sections (an
    engine is idle between uses, and prefix caching is off, so one use cannot help another)."""

    def __init__(self, path: str, fields: dict, device: str, s: dict, params: int) -> None:
        self.path, self.fields, self.device, self.s, self.params = path, fields, device, s, params
        self.cache: dict[tuple[str, str], object] = {}  # engine, or the exception its start raised
        self.notes: dict[str, dict] = {}

    def config(self, dtype: str, mode: str):
        from runtime.llm.engine import EngineConfig

        s = self.s
        seqs = max([*s["traces"], s["floor_seqs"], len(s["prompt_lens"])])
        tokens = max(max(s["traces"]) * (s["trace_prompt"] + s["trace_output"]), seqs * s["max_model_len"] // 2)
        kw = dict(
            model=self.path,
            dtype=dtype,
            device=self.device,
            max_num_seqs=seqs,
            max_model_len=s["max_model_len"],
            kv_cache_bytes=kv_bytes_for(self.fields, dtype, tokens),
            enable_prefix_caching=False,
        )
        fields = getattr(EngineConfig, "__dataclass_fields__", {})
        if "enforce_eager" not in fields:
            if mode == "eager":
                return EngineConfig(**kw), "EngineConfig has no enforce_eager field: its one path (eager)"
            raise NotAvailable("not available: EngineConfig has no enforce_eager field")
        try:
            return EngineConfig(**kw, enforce_eager=(mode == "eager")), None
        except TypeError as e:
            raise NotAvailable(f"not available: EngineConfig(enforce_eager=...) raised {_err(e)}") from e

    def get(self, dtype: str, mode: str, deadline: float):
        key = (dtype, mode)
        if key not in self.cache:
            from runtime.llm.engine import LLMEngine

            t0 = time.perf_counter()
            try:
                config, note = self.config(dtype, mode)
                memory = None
                if not self.device.startswith("cuda"):  # the CPU default budget (2 GiB) holds no big KV cache
                    from runtime.memory import DEFAULT_CPU_BUDGET_BYTES, DeviceMemoryManager, MemoryConfig

                    budget = DEFAULT_CPU_BUDGET_BYTES + 4 * self.params + config.kv_cache_bytes
                    memory = DeviceMemoryManager(MemoryConfig(device="cpu", budget_bytes=budget))
                engine = LLMEngine(config, memory)
                _sync(self.device)
                runner = engine.runner
                self.notes[f"{dtype}/{mode}"] = dict(
                    start_s=time.perf_counter() - t0,
                    note=note,
                    attention_backend=getattr(runner, "attention_backend", None),
                    kv_blocks=runner.kv_pool.num_blocks,
                    max_num_seqs=engine.scheduler.config.max_num_seqs,
                    max_num_batched_tokens=engine.scheduler.config.max_num_batched_tokens,
                    # whatever the runner keeps about graphs (its names are its authors' to choose)
                    graph_attributes=sorted(k for k in vars(runner) if "graph" in k.lower()),
                    cuda_graph_buckets=getattr(getattr(runner, "cuda_graphs", None), "buckets", None),
                    flags_after_start=flags(),
                )
                if mode == "captured":
                    self.notes[f"{dtype}/{mode}"].update(wait_for_graph(engine, deadline))
                self.cache[key] = engine
            except Exception as e:  # noqa: BLE001 - kept, so every item asking for it gets the reason at once
                if not isinstance(e, NotAvailable):
                    traceback.print_exc()
                # the message only: a kept traceback would keep a half-built engine's tensors alive
                self.cache[key] = e if isinstance(e, NotAvailable) else RuntimeError(f"engine start failed: {_err(e)}")
                e.__traceback__ = None
        got = self.cache[key]
        if isinstance(got, BaseException):
            raise got
        return got

    def close(self, dtype: str | None = None) -> None:
        for key in [k for k in self.cache if dtype is None or k[0] == dtype]:
            engine = self.cache.pop(key)
            if not isinstance(engine, BaseException):
                try:
                    engine.close()
                except Exception:  # noqa: BLE001 - closing is best effort
                    traceback.print_exc()
            del engine
        _free(self.device)


def tandem_generate(engine, prompts: list[list[int]], max_tokens: int, device: str) -> tuple[list[list[int]], dict]:
    """Greedy, ignore_eos, every prompt queued at once; (tokens per prompt, timing)."""
    from runtime.llm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if engine.has_unfinished():
        raise RuntimeError("engine is not idle")
    _sync(device)
    steps0, graph0 = engine.num_steps, graph_steps(engine)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    _sync(device)
    elapsed = time.perf_counter() - t0
    missing = [r for r in ids if r not in done]
    errors = [done[r].error for r in ids if r in done and done[r].error]
    if missing or errors:
        raise RuntimeError(f"{len(missing)} requests unfinished, {len(errors)} failed: {(errors or [''])[0]}")
    timing = dict(elapsed_s=elapsed, steps=engine.num_steps - steps0)
    if graph0 is not None:
        timing["graph_steps"] = graph_steps(engine) - graph0  # decode steps the captured graph ran
    return [list(done[r].token_ids) for r in ids], timing


def graph_steps(engine) -> int | None:
    """How many steps the runner's captured graph has run (None: a runner that does not count)."""
    n = getattr(engine.runner, "num_graph_steps", None)
    return n if isinstance(n, int) else None


def wait_for_graph(engine, deadline: float) -> dict:
    """On CPU the captured engine compiles its graph on a background thread and serves eagerly
    meanwhile: wait for it (until `deadline`), so that what is timed is the graph. On CUDA the
    graphs are captured at start and there is nothing to wait for."""
    g = getattr(engine.runner, "graph", None)
    done, ready = getattr(g, "done", None), getattr(g, "ready", None)
    if done is None or not hasattr(done, "wait"):
        return {}
    t0 = time.perf_counter()
    done.wait(timeout=max(0.0, deadline - t0))
    return dict(graph_wait_s=time.perf_counter() - t0, graph_ready=bool(ready is not None and ready.is_set()))


def random_prompts(lengths: list[int], vocab: int, seed) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Greedy agreement: per prompt the first position where `got` leaves `ref` (None: never)."""
    first, matched, total = [], 0, 0
    for r, g in zip(ref, got, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None)
        if n is None and len(r) != len(g):
            n = min(len(r), len(g))
        first.append(n)
        matched += len(r) if n is None else n
        total += len(r)
    return dict(
        agreement=matched / total if total else 1.0,
        identical_prompts=sum(n is None for n in first),
        prompts=len(ref),
        first_divergence=first,
        tokens_compared=total,
    )


# ---------------------------------------------------------------- HF


def hf_load(path: str, dtype: str, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def hf_generate(model, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    """transformers' greedy `generate`, one prompt at a time (no padding in play)."""
    from transformers import GenerationConfig

    gc_ = GenerationConfig(max_new_tokens=n, do_sample=False)  # the model has no EOS id: always n tokens
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            res = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc_)
            out.append(res[0, len(p) :].tolist())
    return out


def hf_continuous(model, prompts: list[list[int]], warm: list[list[int]], n: int, device: str) -> tuple[list, dict]:
    """transformers' continuous batching on the trace: `generate_batch` once on `warm` (same
    shape, other prompts) keeping its manager, then timed on `prompts` with that manager."""
    import transformers.generation
    from transformers import GenerationConfig

    cb_config = getattr(transformers.generation, "ContinuousBatchingConfig", None)  # older: generate_batch's defaults
    if not hasattr(model, "generate_batch"):
        raise NotAvailable(f"transformers {transformers.__version__} has no generate_batch")
    gen = GenerationConfig(max_new_tokens=n, do_sample=False)  # no EOS id anywhere: the manager disables it
    kw: dict = dict(generation_config=gen, progress_bar=False)
    note = []
    if cb_config is not None and not device.startswith("cuda"):
        # On CPU its default sizes the cache from memory (tens of seconds for a tiny model).
        tokens = len(prompts) * (max(map(len, prompts)) + n)
        try:
            kw["continuous_batching_config"] = cb_config(
                page_size=16, num_blocks=2 * (tokens // 16) + 16, max_batch_tokens=256
            )
        except TypeError as e:
            note.append(f"ContinuousBatchingConfig(...) raised {_err(e)}; its defaults used")

    def call(inputs, **extra):
        try:
            return model.generate_batch(inputs, **kw, **extra)
        except TypeError as e:  # an older signature: no persistent_manager
            if not extra:
                raise
            note.append(f"generate_batch({', '.join(extra)}=...) raised {_err(e)}; called without")
            return model.generate_batch(inputs, **kw)

    def check(res, inputs) -> list:
        outs = list(res.values()) if isinstance(res, dict) else list(res or [])
        failed = [o for o in outs if getattr(o, "error", None)]
        if len(outs) != len(inputs) or failed:  # generate_batch logs its exceptions and returns what it has
            raise RuntimeError(
                f"generate_batch returned {len(outs)} of {len(inputs)} results, {len(failed)} with an error"
                + (f": {failed[0].error}" if failed else "")
            )
        by_prompt = {tuple(getattr(o, "prompt_ids", None) or ()): o for o in outs}
        if all(tuple(p) in by_prompt for p in inputs):  # in prompt order, whatever order it returns them in
            outs = [by_prompt[tuple(p)] for p in inputs]
        return outs

    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    info: dict = dict(notes=note)
    with torch.inference_mode():
        try:
            t0 = time.perf_counter()
            check(call(warm, persistent_manager=True), warm)  # its manager's start (graphs) and a full run
            info["warmup_call_s"] = time.perf_counter() - t0
            _sync(device)
            t0 = time.perf_counter()
            res = call(prompts, persistent_manager=True)  # the same manager, warm
            _sync(device)
            info["elapsed_s"] = time.perf_counter() - t0
            outs = check(res, prompts)
        except Exception as e:  # noqa: BLE001 - one more try, as a user's plain call (its start timed in)
            traceback.print_exc()
            note.append(f"warm manager reused: {_err(e)[:300]}; timed a plain call instead (its start included)")
            if destroy is not None:
                destroy()
            _sync(device)
            t0 = time.perf_counter()
            res = model.generate_batch(prompts, **kw)
            _sync(device)
            info["elapsed_s"] = time.perf_counter() - t0
            info["includes_manager_start"] = True
            outs = check(res, prompts)
        finally:
            if destroy is not None:
                destroy()
    tokens = [list(o.generated_tokens) for o in outs]
    starts = [getattr(o, "created_time", None) for o in outs]
    ends = [(getattr(o, "lifespan", None) or (None, None))[1] for o in outs]
    if all(isinstance(x, float) and x > 0 for x in starts + ends):
        info["span_s"] = max(ends) - min(starts)  # first request created to last finished
    return tokens, info


# ---------------------------------------------------------------- sections


class Budget:
    def __init__(self, total_s: float) -> None:
        self.t0 = time.perf_counter()
        self.total_s = total_s

    def deadline(self, section_s: float) -> float:
        return min(time.perf_counter() + section_s, self.t0 + self.total_s)


_checkpoint = [lambda: None]  # main() points it at writing the report: after every item


def item(out: dict, key: str, fn, deadline: float, label: str) -> object:
    """out[key] = fn(), or its error, or "skipped" past the deadline; prints as it goes, and
    writes the report after it."""
    if time.perf_counter() > deadline:
        out[key] = {"skipped": "the section's time budget was spent before it started"}
        print(f"  {label}: skipped (time budget)", flush=True)
        return None
    print(f"  {label} ...", flush=True)
    t0 = time.perf_counter()
    try:
        out[key] = fn()
    except NotAvailable as e:
        out[key] = {"error": str(e), "not_available": True}
    except Exception as e:  # noqa: BLE001 - one item's failure is recorded; the others run
        traceback.print_exc()
        out[key] = {"error": _err(e)}
    res = out[key]
    if isinstance(res, dict) and "error" in res:
        print(f"  {label}: FAILED {res['error'][:300]}", flush=True)
    else:
        print(f"  {label}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    _checkpoint[0]()
    return res


def correctness(name: str, info: dict, engines: Engines, hf: dict, s: dict, device: str, deadline: float, res: dict):
    fields = MODELS[name][0]
    prompts = random_prompts(s["prompt_lens"], fields["vocab_size"], f"{name}-correctness")
    n = s["new_tokens"]
    res.update(prompt_lens=s["prompt_lens"], new_tokens=n)
    for dtype in CORRECTNESS_DTYPES:
        row: dict = res.setdefault(dtype, {})

        def reference(dtype=dtype) -> dict:
            if dtype not in hf:
                hf[dtype] = hf_load(info["path"], dtype, device)
            t0 = time.perf_counter()
            toks = hf_generate(hf[dtype], prompts, n, device)
            return dict(tokens=toks, elapsed_s=time.perf_counter() - t0)

        ref = item(row, "hf_generate", reference, deadline, f"{name} {dtype} HF generate")
        for mode in s["modes"]:

            def run(dtype=dtype, mode=mode, ref=ref) -> dict:
                engine = engines.get(dtype, mode, deadline)
                toks, timing = tandem_generate(engine, prompts, n, device)
                out = compare(ref["tokens"], toks) if isinstance(ref, dict) and "tokens" in ref else {}
                flat = [t for p in toks for t in p]
                return dict(**out, distinct_tokens=len(set(flat)), tokens=toks, **timing)

            r = item(row, f"tandem_{mode}", run, deadline, f"{name} {dtype} Tandem {mode}")
            if isinstance(r, dict) and "agreement" in r:
                print(
                    f"    agreement {r['agreement']:.3f}, {r['identical_prompts']}/{r['prompts']} prompts identical, "
                    f"first divergence {r['first_divergence']}, {r['distinct_tokens']} distinct tokens",
                    flush=True,
                )
        if dtype == "float32":
            engines.close("float32")
            hf.pop("float32", None)
            _free(device)


def throughput(name: str, info: dict, engines: Engines, hf: dict, s: dict, device: str, deadline: float, res: dict):
    fields = MODELS[name][0]
    dtype = s["dtype"]
    res.update(dtype=dtype, prompt_len=s["trace_prompt"], output_len=s["trace_output"])
    traces = {
        f"{r}x{s['trace_prompt']}+{s['trace_output']}": (
            random_prompts([s["trace_prompt"]] * r, fields["vocab_size"], f"{name}-trace-{r}"),
            random_prompts([s["trace_prompt"]] * r, fields["vocab_size"], f"{name}-warmup-{r}"),
        )
        for r in s["traces"]
    }
    res["traces"] = list(traces)
    reference: dict[str, list] = {}  # trace -> Tandem eager's tokens
    n = s["trace_output"]

    def summary(toks: list[list[int]], prompts: list[list[int]], timing: dict, warm_s: float | None = None) -> dict:
        generated = sum(map(len, toks))
        el = timing["elapsed_s"]
        out = dict(
            requests=len(prompts),
            generated_tokens=generated,
            expected_tokens=len(prompts) * n,
            output_tokens_per_s=generated / el,
            total_tokens_per_s=(generated + sum(map(len, prompts))) / el,
            **timing,
        )
        if warm_s is not None:
            out["warmup_s"] = warm_s
        return out

    # Trace by trace, so that a budget cut leaves whole rows. The engines stay up for
    # decode_floor (a captured engine may be slow to start); HF's manager sizes its cache from
    # the memory they leave, plenty on a GPU of this size.
    for tname, (prompts, warm) in traces.items():
        row = res.setdefault(tname, {})
        for mode in s["modes"]:

            def run(mode=mode, tname=tname, prompts=prompts, warm=warm) -> dict:
                engine = engines.get(dtype, mode, deadline)
                t0 = time.perf_counter()
                tandem_generate(engine, warm, n, device)  # Triton compiles, graphs, allocator: same shape
                warm_s = time.perf_counter() - t0
                toks, timing = tandem_generate(engine, prompts, n, device)
                out = summary(toks, prompts, timing, warm_s)
                if mode == "eager":
                    reference[tname] = toks
                elif tname in reference:
                    out["greedy_vs_tandem_eager"] = _short(compare(reference[tname], toks))
                return out

            _print_rate(item(row, f"tandem_{mode}", run, deadline, f"{name} {tname} Tandem {mode}"))

        def run_hf(tname=tname, prompts=prompts, warm=warm) -> dict:
            if dtype not in hf:
                hf[dtype] = hf_load(info["path"], dtype, device)
            toks, timing = hf_continuous(hf[dtype], prompts, warm, n, device)
            out = summary(toks, prompts, timing)
            if tname in reference:
                out["greedy_vs_tandem_eager"] = _short(compare(reference[tname], toks))
            return out

        _print_rate(item(row, "hf_continuous", run_hf, deadline, f"{name} {tname} HF generate_batch"))
    for t in res["traces"]:
        row = res[t]
        hf_rate = row.get("hf_continuous", {}).get("output_tokens_per_s")
        for mode in MODES:
            rate = row.get(f"tandem_{mode}", {}).get("output_tokens_per_s")
            if rate and hf_rate:
                row[f"tandem_{mode}_vs_hf"] = rate / hf_rate
        e, c = (row.get(f"tandem_{m}", {}).get("output_tokens_per_s") for m in MODES)
        if e and c:
            row["captured_vs_eager"] = c / e


def _short(cmp: dict) -> dict:
    return {k: cmp[k] for k in ("agreement", "identical_prompts", "prompts")}


def _print_rate(r) -> None:
    if isinstance(r, dict) and "output_tokens_per_s" in r:
        graph = f", {r['graph_steps']} of {r['steps']} steps by the graph" if "graph_steps" in r else ""
        print(
            f"    {r['generated_tokens']} tokens (expected {r['expected_tokens']}) in {r['elapsed_s']:.2f} s: "
            f"{r['output_tokens_per_s']:.0f} output tok/s{graph}",
            flush=True,
        )


def linear_shapes(fields: dict) -> list[tuple[int, int]]:
    """(in, out) of every linear a forward runs, as the runner fuses them (qkv, o, gate_up, down
    per layer, then lm_head)."""
    h, hd = fields["hidden_size"], fields["head_dim"]
    nh, nkv, inter = fields["num_attention_heads"], fields["num_key_value_heads"], fields["intermediate_size"]
    layer = [(h, (nh + 2 * nkv) * hd), (nh * hd, h), (h, 2 * inter), (inter, h)]
    return layer * fields["num_hidden_layers"] + [(h, fields["vocab_size"])]


def time_fn(fn, device: str, reps: int) -> float:
    """Median milliseconds of fn over `reps` runs after 3 warm-ups: CUDA events on a GPU."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def matmul_floor(fields: dict, dtype: str, rows: int, device: str, reps: int) -> dict:
    shapes = linear_shapes(fields)
    tdt = getattr(torch, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(o, i, generator=g, device=device, dtype=tdt) * 0.02 for i, o in shapes]
    xs = {i: torch.randn(rows, i, generator=g, device=device, dtype=tdt) for i in {i for i, _ in shapes}}
    F = torch.nn.functional

    def run() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    with torch.inference_mode():
        launched = time_fn(run, device, reps)
        graph_ms: float | str | None = None
        if device.startswith("cuda"):
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        run()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                graph_ms = time_fn(graph.replay, device, reps)
                del graph
            except Exception as e:  # noqa: BLE001 - the launched floor still stands
                graph_ms = _err(e)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops = 2 * rows * sum(i * o for i, o in shapes)
    out = dict(
        rows=rows,
        dtype=dtype,
        num_linears=len(shapes),
        weight_bytes=nbytes,
        flops=flops,
        launched_ms=launched,
        weight_GBps_launched=nbytes / launched / 1e6,
    )
    if isinstance(graph_ms, float):
        out.update(graph_ms=graph_ms, weight_GBps_graph=nbytes / graph_ms / 1e6, TFLOPs_graph=flops / graph_ms / 1e9)
    elif graph_ms is not None:
        out["graph_error"] = graph_ms
    weights.clear()
    xs.clear()
    return out


def decode_step(engine, seqs: int, prompt_len: int, reps: int, device: str) -> dict:
    """engine.step() at `seqs` running sequences, all decode, and the runner's execute within
    it (the rest: scheduling, the engine's bookkeeping). Medians in ms."""
    from runtime.llm.sampling_params import SamplingParams

    if engine.has_unfinished():
        raise RuntimeError("engine is not idle")
    vocab = engine.vocab_size
    max_tokens = engine.max_model_len - prompt_len - 1
    if max_tokens < reps + 8:
        raise RuntimeError(f"max_model_len {engine.max_model_len} too short for {reps} timed steps")
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts([prompt_len] * seqs, vocab, "floor")]
    runner = engine.runner
    execute = runner.execute
    exec_times: list[float] = []

    def timed_execute(plan):
        t0 = time.perf_counter()
        try:
            return execute(plan)
        finally:
            exec_times.append(time.perf_counter() - t0)

    steps = []
    try:
        for _ in range(10 * seqs):  # prefills, until every request decodes
            engine.step()
            if engine.last_step_shape == (seqs, seqs):
                break
        else:
            raise RuntimeError(f"the batch never became all-decode (last step {engine.last_step_shape})")
        for _ in range(3):
            engine.step()
        try:
            runner.execute = timed_execute
        except AttributeError:  # a runner with __slots__: the step alone is timed
            pass
        graph0 = graph_steps(engine)
        for _ in range(reps):
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
            if engine.last_step_shape != (seqs, seqs):
                raise RuntimeError(f"a timed step ran {engine.last_step_shape} (requests, tokens), not pure decode")
        timed_graph_steps = None if graph0 is None else graph_steps(engine) - graph0
    finally:
        if getattr(runner, "__dict__", {}).get("execute") is timed_execute:
            del runner.execute
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        _sync(device)
    return dict(
        seqs=seqs,
        context_len=f"{prompt_len}..{prompt_len + 3 + reps + 10}",
        step_ms=statistics.median(steps) * 1e3,
        step_min_ms=min(steps) * 1e3,
        execute_ms=statistics.median(exec_times) * 1e3 if exec_times else None,
        reps=reps,
        graph_steps=timed_graph_steps,  # of the timed steps, how many the captured graph ran
    )


def decode_floor(name: str, info: dict, engines: Engines, hf: dict, s: dict, device: str, deadline: float, res: dict):
    fields = MODELS[name][0]
    dtype, seqs = s["dtype"], s["floor_seqs"]
    res.update(dtype=dtype, seqs=seqs)
    floor = item(
        res,
        "matmul_floor",
        lambda: matmul_floor(fields, dtype, seqs, device, s["floor_reps"]),
        deadline,
        f"{name} matmul floor ({len(linear_shapes(fields))} linears x {seqs} rows)",
    )
    if isinstance(floor, dict) and "launched_ms" in floor:
        graph = f", from a CUDA graph {floor['graph_ms']:.3f} ms" if "graph_ms" in floor else ""
        print(
            f"    launched one by one {floor['launched_ms']:.3f} ms{graph} "
            f"({floor['weight_bytes'] / 2**20:.0f} MiB of weights)",
            flush=True,
        )
    for mode in s["modes"]:

        def run(mode=mode) -> dict:
            out = decode_step(engines.get(dtype, mode, deadline), seqs, s["floor_prompt"], s["floor_reps"], device)
            if isinstance(floor, dict) and "launched_ms" in floor:
                out["vs_floor_launched"] = out["step_ms"] / floor["launched_ms"]
                if "graph_ms" in floor:
                    out["vs_floor_graph"] = out["step_ms"] / floor["graph_ms"]
            return out

        r = item(res, f"tandem_{mode}", run, deadline, f"{name} decode step, {seqs} sequences, {mode}")
        if isinstance(r, dict) and "step_ms" in r:
            print(
                f"    step {r['step_ms']:.3f} ms (execute {_fmt(r.get('execute_ms'), '.3f')} ms); "
                f"{r.get('vs_floor_launched', float('nan')):.2f}x the launched floor"
                + (f", {r['vs_floor_graph']:.2f}x the graph floor" if "vs_floor_graph" in r else ""),
                flush=True,
            )


SECTION_FNS = {"correctness": correctness, "throughput": throughput, "decode_floor": decode_floor}


# ---------------------------------------------------------------- report


def _fmt(v, spec: str = ".0f", none: str = "-") -> str:
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else none


def _cell(d, key: str, spec: str) -> str:
    if not isinstance(d, dict):
        return "-"
    if key in d:
        return _fmt(d[key], spec)
    if d.get("not_available"):
        return "n/a"
    if "skipped" in d:
        return "skipped"
    return "FAILED" if "error" in d else "-"


def table(report: dict) -> str:
    lines = []
    for name in report["settings"]["models"]:
        lines.append(f"== {name}")
        c = report.get("correctness", {}).get(name)
        if isinstance(c, dict) and "error" in c:
            lines.append(f"  correctness: FAILED ({c['error'][:200]})")
        elif isinstance(c, dict):
            lines.append("  greedy tokens vs HF generate (share before first divergence; identical prompts):")
            for dt in CORRECTNESS_DTYPES:
                row = c.get(dt, {})
                cells = []
                for mode in MODES:
                    r = row.get(f"tandem_{mode}", {})
                    if "agreement" in r:
                        cells.append(f"{mode} {r['agreement']:.3f} ({r['identical_prompts']}/{r['prompts']})")
                    else:
                        cells.append(f"{mode} {_cell(r, 'agreement', '.3f')}")
                lines.append(f"    {dt:9s} " + "   ".join(cells))
        t = report.get("throughput", {}).get(name)
        if isinstance(t, dict) and "error" in t:
            lines.append(f"  throughput: FAILED ({t['error'][:200]})")
        elif isinstance(t, dict):
            lines.append(f"  output tok/s, {t.get('dtype')}:")
            lines.append(
                f"    {'trace':18s} {'eager':>9s} {'captured':>9s} {'HF CB':>9s} {'eager/HF':>9s} {'capt/HF':>9s}"
            )
            for tr in t.get("traces", []):
                row = t.get(tr, {})
                lines.append(
                    f"    {tr:18s} {_cell(row.get('tandem_eager'), 'output_tokens_per_s', '.0f'):>9s} "
                    f"{_cell(row.get('tandem_captured'), 'output_tokens_per_s', '.0f'):>9s} "
                    f"{_cell(row.get('hf_continuous'), 'output_tokens_per_s', '.0f'):>9s} "
                    f"{_fmt(row.get('tandem_eager_vs_hf'), '.2f'):>9s} {_fmt(row.get('tandem_captured_vs_hf'), '.2f'):>9s}"
                )
        f = report.get("decode_floor", {}).get(name)
        if isinstance(f, dict) and "error" in f:
            lines.append(f"  decode floor: FAILED ({f['error'][:200]})")
        elif isinstance(f, dict):
            fl = f.get("matmul_floor", {})
            lines.append(
                f"  decode step at {f.get('seqs')} sequences ({f.get('dtype')}): linear floor "
                f"{_cell(fl, 'launched_ms', '.3f')} ms launched, {_cell(fl, 'graph_ms', '.3f')} ms from a graph"
            )
            for mode in MODES:
                r = f.get(f"tandem_{mode}", {})
                if "step_ms" not in r:
                    lines.append(f"    {mode:9s} {_cell(r, 'step_ms', '.3f')}")
                    continue
                graph = f", {r['graph_steps']}/{r['reps']} by the graph" if r.get("graph_steps") is not None else ""
                lines.append(
                    f"    {mode:9s} step {r['step_ms']:.3f} ms, execute {_fmt(r.get('execute_ms'), '.3f')} ms, "
                    f"{_fmt(r.get('vs_floor_launched'), '.2f')}x launched floor, "
                    f"{_fmt(r.get('vs_floor_graph'), '.2f')}x graph floor{graph}"
                )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - the JSON and the table carry the same numbers
        return f"no plot: {_err(e)}"
    names = report["settings"]["models"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels, series = [], {"Tandem eager": [], "Tandem captured": [], "HF generate_batch": []}
    keys = {"Tandem eager": "tandem_eager", "Tandem captured": "tandem_captured", "HF generate_batch": "hf_continuous"}
    for name in names:
        t = report.get("throughput", {}).get(name, {})
        for tr in t.get("traces", []) if isinstance(t, dict) else []:
            labels.append(f"{name}\n{tr}")
            for k, v in keys.items():
                series[k].append(t.get(tr, {}).get(v, {}).get("output_tokens_per_s") or 0.0)
    w = 0.27
    for j, (k, ys) in enumerate(series.items()):
        ax1.bar([i + (j - 1) * w for i in range(len(labels))], ys, w, label=k)
    ax1.set_xticks(range(len(labels)), labels, fontsize=7)
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("bench trace, greedy, ignore_eos", fontsize=9)
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3, axis="y")
    bars = {"step eager": [], "step captured": [], "floor launched": [], "floor graph": []}
    for name in names:
        f = report.get("decode_floor", {}).get(name, {})
        f = f if isinstance(f, dict) else {}
        fl = f.get("matmul_floor", {})
        bars["step eager"].append(f.get("tandem_eager", {}).get("step_ms") or 0.0)
        bars["step captured"].append(f.get("tandem_captured", {}).get("step_ms") or 0.0)
        bars["floor launched"].append(fl.get("launched_ms") or 0.0)
        bars["floor graph"].append(fl.get("graph_ms") or 0.0)
    w = 0.2
    for j, (k, ys) in enumerate(bars.items()):
        ax2.bar([i + (j - 1.5) * w for i in range(len(names))], ys, w, label=k)
    ax2.set_xticks(range(len(names)), names, fontsize=8)
    ax2.set_ylabel("ms")
    ax2.set_title(f"decode step at {report['settings']['floor_seqs']} sequences vs its linear layers", fontsize=9)
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3, axis="y")
    dev = report["device"]
    fig.suptitle(f"Tandem engine on {dev.get('gpu', dev['device'])}, torch {dev['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _write(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (JSON_NAME + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str))
    os.replace(tmp, out / JSON_NAME)


def verdict(report: dict) -> tuple[bool, list[str]]:
    """(ok, problems): every section ran, and float32 greedy tokens matched HF exactly."""
    problems = []

    def walk(d, where: str) -> None:
        if isinstance(d, dict):
            if "error" in d and not d.get("not_available"):
                problems.append(f"{where}: {str(d['error'])[:160]}")
            for k, v in d.items():
                if k not in ("tokens", "error"):
                    walk(v, f"{where}/{k}")

    for sec in report["settings"]["sections"]:
        walk(report.get(sec, {}), sec)
    for name, c in report.get("correctness", {}).items():
        for mode in MODES:
            r = c.get("float32", {}).get(f"tandem_{mode}", {}) if isinstance(c, dict) else {}
            if "agreement" in r and r["agreement"] < 1.0:
                problems.append(f"correctness/{name}/float32/{mode}: agreement {r['agreement']:.3f} < 1")
    return not problems, problems


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks gpu-engine",
        description="Tandem's LLM engine on a GPU: greedy tokens vs transformers, tokens/s vs transformers' "
        "continuous batching, a decode step vs its matmul floor (random-weight models, no files, no network).",
    )
    ap.add_argument("--out", default="bench_out", help=f"directory for {JSON_NAME} and {PLOT_NAME} (default bench_out)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (with --tiny, for tests)")
    ap.add_argument("--quick", action="store_true", help="SmolLM2 shapes only, smaller budgets (about 3 min)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and traces (2 layers, hidden 64): seconds")
    ap.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (overrides the mode's choice)")
    ap.add_argument("--sections", help=f"comma-separated, of {', '.join(SECTIONS)} (default all)")
    ap.add_argument("--traces", help="comma-separated request counts of the throughput traces (default 64,256)")
    ap.add_argument("--modes", default="eager,captured", help="Tandem engine modes to run (default eager,captured)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="throughput and floor dtype")
    ap.add_argument("--total-budget-s", type=float, help="wall-clock budget of the run (default 460; quick 200)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time budget")
    ap.add_argument("--seed", type=int, default=0, help="weight init seed")
    ap.add_argument("--work-dir", help="where the model folders go (default: a temporary folder, removed)")
    ap.add_argument("--inject-failure", metavar="SECTION", help=argparse.SUPPRESS)  # tests: SECTION raises
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "benchmarks.gpu_engine: no CUDA device (torch.cuda.is_available() is False); "
            "nothing to check (--device cpu --tiny runs it on the CPU)",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network there; nothing here downloads
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device.startswith("cuda") and os.environ.pop("TRITON_INTERPRET", None) not in (None, "0"):
        print("note: TRITON_INTERPRET was set; unset so the kernels compile for the GPU")
    s = settings(args)
    s["dtype"] = args.dtype
    out = Path(args.out)
    budget = Budget(s["total"])
    report: dict = dict(device=device_info(device), settings=s, argv=list(argv if argv is not None else sys.argv[1:]))
    dev = report["device"]
    print(
        f"device {dev.get('gpu', device)} (capability {dev.get('capability', '-')}, {dev.get('memory_gib', '-')} GiB), "
        f"torch {dev['torch']}, triton {dev['triton']}, transformers {dev['transformers']}"
    )
    print(f"flags: {dev['flags']}; EngineConfig.enforce_eager available: {dev.get('enforce_eager_available')}")
    print(
        f"models {s['models']}, sections {s['sections']}, budgets {s['budgets']} s per model, total {s['total']} s",
        flush=True,
    )
    _checkpoint[0] = lambda: _write(report, out)
    report["models"] = {}
    for sec in s["sections"]:
        report[sec] = {}
    report["section_times"] = {}
    tmp = tempfile.TemporaryDirectory(prefix="tandem-gpu-engine-") if not args.work_dir else None
    root = Path(args.work_dir or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    try:
        for name in s["models"]:
            print(f"\n== {name}: building random weights", flush=True)
            try:
                info = build_model(name, root, device, args.seed)
                report["models"][name] = info
                print(f"  {info['params'] / 1e6:.1f} M parameters, built and saved in {info['build_s']:.1f} s")
            except Exception as e:  # noqa: BLE001 - this model's sections cannot run; the next model's can
                traceback.print_exc()
                report["models"][name] = {"error": _err(e)}
                for sec in s["sections"]:
                    report[sec][name] = {"error": f"model not built: {_err(e)}"}
                _write(report, out)
                continue
            engines = Engines(info["path"], MODELS[name][0], device, s, info["params"])
            hf: dict = {}
            try:
                for sec in s["sections"]:
                    print(f"-- {name}: {sec} (budget {s['budgets'][sec]:.0f} s)", flush=True)
                    t0 = time.perf_counter()
                    res = report[sec][name] = {}  # filled as it goes: a run cut short keeps its items
                    try:
                        if args.inject_failure == sec:
                            raise RuntimeError(f"injected failure in {sec} (--inject-failure)")
                        deadline = budget.deadline(s["budgets"][sec])
                        SECTION_FNS[sec](name, info, engines, hf, s, device, deadline, res)
                    except Exception as e:  # noqa: BLE001 - one section's failure is recorded; the rest run
                        traceback.print_exc()
                        res["error"] = _err(e)
                        print(f"  FAILED: {res['error'][:300]}", flush=True)
                    report["section_times"][f"{name}/{sec}"] = time.perf_counter() - t0
                    if device.startswith("cuda"):
                        peak = torch.cuda.max_memory_allocated(torch.device(device)) / 2**30
                        report.setdefault("gpu_peak_allocated_gib", {})[f"{name}/{sec}"] = round(peak, 2)
                        torch.cuda.reset_peak_memory_stats(torch.device(device))
                    report["engines"] = {**report.get("engines", {}), name: engines.notes}
                    _write(report, out)
            finally:
                engines.close()
                hf.clear()
                _free(device)
                import shutil

                shutil.rmtree(info["path"], ignore_errors=True)
    finally:
        _checkpoint[0] = lambda: None
        if tmp is not None:
            tmp.cleanup()
    report["total_s"] = time.perf_counter() - budget.t0
    ok, problems = verdict(report)
    report["ok"], report["problems"] = ok, problems
    _write(report, out)
    print("\nsummary:")
    print(table(report))
    note = plot(report, out / PLOT_NAME)
    print(note or f"wrote {out / PLOT_NAME}")
    print(f"wrote {out / JSON_NAME} ({report['total_s']:.0f} s in all)")
    print("ok" if ok else "problems:\n  " + "\n  ".join(problems))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
