"""ModelRunner + LlamaModel against Hugging Face transformers on tiny random models.

Every test drives the runner with hand-written StepPlans (as a scheduler would send them)
and compares the logits it computed with a full, uncached HF forward over the same tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from runtime.llm.loader import load_model
from runtime.llm.runner import ModelRunner
from runtime.llm.sampling_params import SamplingParams
from runtime.memory import DeviceMemoryManager, MemoryConfig
from schedulers.plan import NewRequestData, StepPlan

VOCAB = 96


def _save_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", unk_token="w0").save_pretrained(path)


def _make_model(path: str, arch: str) -> str:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        eos_token_id=2,
        bos_token_id=1,
    )
    if arch == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=100000.0)
        model = LlamaForCausalLM(config)
    elif arch == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        config = LlamaConfig(**common, tie_word_embeddings=False, rope_parameters=rope)
        model = LlamaForCausalLM(config)
    elif arch == "mistral":
        config = MistralConfig(**common, tie_word_embeddings=False, sliding_window=4096)
        model = MistralForCausalLM(config)
    else:
        config = Qwen2Config(**common, tie_word_embeddings=False)
        model = Qwen2ForCausalLM(config)
    # Random init is small; widen it so attention patterns and logits are far from uniform.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
        if arch == "qwen2":
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    _save_tokenizer(path)
    return path


@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2", "mistral"])
def model_dir(request, tmp_path_factory):
    return _make_model(str(tmp_path_factory.mktemp(request.param)), request.param)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def make_runner(
    model_dir: str, dtype: str = "float32", block_size: int = 4, num_kv_blocks: int = 64, **kw
) -> ModelRunner:
    loaded = load_model(model_dir, dtype=dtype)
    mem = DeviceMemoryManager(MemoryConfig(budget_bytes=256 * 2**20))
    return ModelRunner(
        loaded,
        mem,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        dtype=dtype,
        **kw,
    )


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


class Driver:
    """The bookkeeping a scheduler would do, minimal: blocks, computed counts, diffs."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.bs = runner.block_size
        self.free = list(range(runner.kv_pool.num_blocks))[::-1]
        self.reqs: dict[str, dict] = {}

    def add(self, rid: str, tokens: list[int], sampling=None, num_computed: int = 0, blocks=None) -> None:
        self.reqs[rid] = {
            "tokens": list(tokens),
            "computed": num_computed,
            "blocks": list(blocks or []),
            "new": True,
            "prompt": len(tokens),
            "sampling": sampling,
        }

    def step(self, schedule: dict[str, int], freed=()) -> tuple[StepPlan, dict[str, list[int]]]:
        plan = StepPlan(freed_req_ids=list(freed))
        for rid, n in schedule.items():
            r = self.reqs[rid]
            need = -(-(r["computed"] + n) // self.bs) - len(r["blocks"])
            new = [self.free.pop(torch.randint(len(self.free), (1,)).item()) for _ in range(max(need, 0))]
            if r["new"]:
                r["blocks"] += new
                plan.new_requests.append(
                    NewRequestData(rid, list(r["tokens"]), list(r["blocks"]), r["computed"], r["prompt"], r["sampling"])
                )
                r["new"] = False
            elif new:
                r["blocks"] += new
                plan.new_block_ids[rid] = new
            plan.req_ids.append(rid)
            plan.num_scheduled_tokens.append(n)
            plan.num_computed_tokens.append(r["computed"])
            plan.sample.append(r["computed"] + n >= len(r["tokens"]))
        result = self.runner.execute(plan)
        out = {}
        for rid, n, toks in zip(plan.req_ids, plan.num_scheduled_tokens, result.sampled_token_ids):
            self.reqs[rid]["computed"] += n
            self.reqs[rid]["tokens"] += toks
            out[rid] = toks
        return plan, out

    def logits_of(self, plan: StepPlan, rid: str) -> torch.Tensor:
        sampling = [r for r, s in zip(plan.req_ids, plan.sample) if s]
        return self.runner.last_logits[sampling.index(rid)]


def test_prefill_then_decode_matches_hf(model_dir, hf_model):
    runner = make_runner(model_dir)
    d = Driver(runner)
    prompts = {"a": prompt(1, 11), "b": prompt(2, 5), "c": prompt(3, 17)}
    for rid, p in prompts.items():
        d.add(rid, p)
    plan, out = d.step({rid: len(p) for rid, p in prompts.items()})
    for rid in prompts:
        ref = hf_logits(hf_model, prompts[rid])[-1]
        torch.testing.assert_close(d.logits_of(plan, rid), ref, atol=2e-5, rtol=1e-5)
        assert out[rid] == [int(ref.argmax())]
    for _ in range(6):  # decode steps cross block boundaries (block_size 4)
        plan, out = d.step({rid: 1 for rid in prompts})
        for rid in prompts:
            ref = hf_logits(hf_model, d.reqs[rid]["tokens"][:-1])[-1]
            torch.testing.assert_close(d.logits_of(plan, rid), ref, atol=2e-5, rtol=1e-5)
            assert out[rid] == [int(ref.argmax())]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_chunked_prefill_mixed_with_decodes(model_dir, hf_model, backend):
    """On both CPU paths: the torch reference (gather + SDPA) and the C++ kernel that reads the
    blocks in place (the default where it builds)."""
    from kernels import cpu_attention

    if backend == "cpp":  # the machines this runs on have a C++ compiler: the kernel must build
        assert cpu_attention.available(), cpu_attention.build_info()
    runner = make_runner(model_dir, attention_backend=backend)
    assert runner.attention_backend == backend
    d = Driver(runner)
    long_prompt = prompt(4, 23)
    d.add("x", prompt(5, 6))
    d.add("y", prompt(6, 9))
    d.step({"x": 6, "y": 9})
    d.add("long", long_prompt)
    # A prefill chunk that does not sample, between decodes, then the rest of it sampling.
    plan, out = d.step({"x": 1, "long": 7, "y": 1})
    assert out["long"] == [] and len(out["x"]) == 1 == len(out["y"])
    plan, out = d.step({"long": 10, "x": 1})
    assert out["long"] == []
    plan, out = d.step({"y": 1, "long": 6, "x": 1})
    ref = hf_logits(hf_model, long_prompt)[-1]
    torch.testing.assert_close(d.logits_of(plan, "long"), ref, atol=2e-5, rtol=1e-5)
    for rid in ("x", "y"):
        ref = hf_logits(hf_model, d.reqs[rid]["tokens"][:-1])[-1]
        torch.testing.assert_close(d.logits_of(plan, rid), ref, atol=2e-5, rtol=1e-5)


def test_triton_attention_path_matches_hf(model_dir, hf_model):
    """The GPU path's metadata (int32 block tables, context lengths, every prefill chunk in one
    launch) run through the Triton kernels on CPU under TRITON_INTERPRET=1: decodes and
    chunked prefills, with and without cached context, give HF's logits."""
    # tests/conftest.py sets the interpreter flag where no GPU is visible; with a GPU the same
    # check runs on it.
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    d = Driver(make_runner(model_dir, attention_backend="triton", device=device))
    long_prompt = prompt(4, 23)
    d.add("x", prompt(5, 6))
    d.add("y", prompt(6, 9))
    d.step({"x": 6, "y": 9})
    d.add("long", long_prompt)
    d.add("z", prompt(10, 7))
    d.step({"x": 1, "long": 7, "y": 1, "z": 7})
    plan, _ = d.step({"y": 1, "long": 16, "x": 1, "z": 1})
    torch.testing.assert_close(
        d.logits_of(plan, "long").cpu(), hf_logits(hf_model, long_prompt)[-1], atol=1e-4, rtol=1e-4
    )
    for rid in ("x", "y", "z"):
        ref = hf_logits(hf_model, d.reqs[rid]["tokens"][:-1])[-1]
        torch.testing.assert_close(d.logits_of(plan, rid).cpu(), ref, atol=1e-4, rtol=1e-4)


def test_prefix_cache_hit_and_preemption_replay(model_dir, hf_model):
    runner = make_runner(model_dir)
    d = Driver(runner)
    shared = prompt(7, 12)
    d.add("first", shared + prompt(8, 3))
    d.step({"first": 15})
    # A second request reuses the first 3 blocks (12 tokens) already in the cache.
    second = shared + prompt(9, 5)
    d.add("second", second, num_computed=12, blocks=d.reqs["first"]["blocks"][:3])
    plan, out = d.step({"second": 5})
    torch.testing.assert_close(d.logits_of(plan, "second"), hf_logits(hf_model, second)[-1], atol=2e-5, rtol=1e-5)
    # Preempted and resent with its generated tokens: recomputes everything, keeps going.
    generated = d.reqs["second"]["tokens"]
    d.add("second", generated)
    d.reqs["second"]["prompt"] = len(second)
    plan, out = d.step({"second": len(generated)}, freed=["second", "never-existed"])
    torch.testing.assert_close(d.logits_of(plan, "second"), hf_logits(hf_model, generated)[-1], atol=2e-5, rtol=1e-5)


def test_bfloat16_close_to_float32(model_dir, hf_model):
    runner = make_runner(model_dir, dtype="bfloat16")
    d = Driver(runner)
    p = prompt(10, 14)
    d.add("a", p)
    plan, _ = d.step({"a": 14})
    ref = hf_logits(hf_model, p)[-1]
    got = d.logits_of(plan, "a")
    assert got.dtype == torch.float32
    err = (got - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item(), err
    plan, _ = d.step({"a": 1})
    ref = hf_logits(hf_model, d.reqs["a"]["tokens"][:-1])[-1]
    assert (d.logits_of(plan, "a") - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def test_min_tokens_suppresses_eos(model_dir, hf_model):
    runner = make_runner(model_dir)
    p = prompt(11, 8)
    greedy = int(hf_logits(hf_model, p)[-1].argmax())
    runner.eos_token_ids = [greedy]  # make the model's favourite token the EOS
    d = Driver(runner)
    d.add("plain", p, SamplingParams(temperature=0, max_tokens=4))
    d.add("min", p, SamplingParams(temperature=0, max_tokens=4, min_tokens=2))
    d.add("ignore", p, SamplingParams(temperature=0, max_tokens=4, min_tokens=2, ignore_eos=True))
    _, out = d.step({"plain": 8, "min": 8, "ignore": 8})
    assert out["plain"] == [greedy] and out["ignore"] == [greedy]
    assert out["min"] != [greedy]


def test_memory_reservations_and_kv_shape(model_dir):
    loaded = load_model(model_dir)
    mem = DeviceMemoryManager(MemoryConfig(budget_bytes=64 * 2**20))
    runner = ModelRunner(
        loaded, mem, block_size=8, kv_cache_bytes=2**20, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64
    )
    spec = runner.spec
    per_block = 2 * spec.num_layers * 8 * spec.num_kv_heads * spec.head_dim * 4
    assert runner.kv_pool.num_blocks == 2**20 // per_block
    assert runner.memory_owner == "llm"
    owners = mem.stats()["owners"]
    assert owners["llm.weights"] > 0 and owners["llm.activations"] > 0
    assert owners["llm.kv_cache"] == runner.kv_pool.num_blocks * per_block
    assert owners["llm.kv_scratch"] == per_block  # the zeroed block decode padding reads
    k, v = runner.kv_caches[0]
    assert k.shape == (runner.kv_pool.num_blocks + 1, 8, spec.num_kv_heads, spec.head_dim) == v.shape
    runner.release_memory()
    assert mem.reserved_bytes == 0 and mem.kv_pool is None
    # The rest of the budget by default.
    mem2 = DeviceMemoryManager(MemoryConfig(budget_bytes=64 * 2**20))
    r2 = ModelRunner(
        load_model(model_dir), mem2, block_size=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64
    )
    assert mem2.free_bytes < per_block and r2.kv_pool.num_blocks > 0


def test_loader_refuses_remote_names_and_bad_fields(model_dir):
    with pytest.raises(ValueError, match="never downloads"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="dtype"):
        load_model(model_dir, dtype="float16")
    loaded = load_model(model_dir)
    assert loaded.eos_token_ids == [2] and loaded.tokenizer is not None and loaded.hf_dir == model_dir
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(
            loaded,
            DeviceMemoryManager(MemoryConfig(budget_bytes=2**26)),
            num_kv_blocks=4,
            max_num_seqs=2,
            max_num_batched_tokens=16,
            max_model_len=10_000,
        )


def test_seeded_request_same_tokens_alone_or_batched(model_dir):
    p = prompt(12, 9)
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8)

    def run(extra: int) -> list[int]:
        d = Driver(make_runner(model_dir))
        d.add("s", p, sp)
        for j in range(extra):
            d.add(f"o{j}", prompt(20 + j, 4 + j), SamplingParams(temperature=1.0))
        d.step({rid: len(r["tokens"]) for rid, r in d.reqs.items()})
        for _ in range(5):
            d.step({rid: 1 for rid in d.reqs})
        return d.reqs["s"]["tokens"][len(p) :]

    alone = run(0)
    assert run(3) == alone and len(alone) == 6


def test_unpacked_weights_path_matches_hf(model_dir, hf_model):
    """The plain F.linear path (GPU, or CPUs without oneDNN) computes the same logits."""
    from runtime.llm.model import LlamaModel

    runner = make_runner(model_dir)
    loaded = load_model(model_dir)
    runner.model = LlamaModel.from_state_dict(
        runner.spec, loaded.state_dict, torch.float32, "cpu", 128, pack_weights=False
    )
    assert not runner.model.packed
    d = Driver(runner)
    p = prompt(13, 10)
    d.add("a", p)
    plan, _ = d.step({"a": 10})
    torch.testing.assert_close(d.logits_of(plan, "a"), hf_logits(hf_model, p)[-1], atol=2e-5, rtol=1e-5)
    plan, _ = d.step({"a": 1})
    torch.testing.assert_close(
        d.logits_of(plan, "a"), hf_logits(hf_model, d.reqs["a"]["tokens"][:-1])[-1], atol=2e-5, rtol=1e-5
    )


def test_rms_norm_matches_hf():
    """float32: bit-identical to HF. bfloat16: HF rounds twice, we round once, so at most one
    bfloat16 rounding step apart (relative 2**-7), and most values equal (about 3 in 4)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from runtime.llm.model import _rms_norm

    for dtype in (torch.float32, torch.bfloat16):
        ref = LlamaRMSNorm(64, eps=1e-5).to(dtype)
        with torch.no_grad():
            ref.weight.normal_()
            x = (torch.randn(37, 64) * 5).to(dtype)
            ours, theirs = _rms_norm(x, ref.weight.data, 1e-5), ref(x)
            if dtype == torch.float32:
                assert torch.equal(ours, theirs)
            else:
                rel = ((ours.float() - theirs.float()).abs() / theirs.float().abs().clamp_min(1e-30)).max().item()
                assert rel <= 2**-7 and (ours == theirs).float().mean() > 0.5, rel
