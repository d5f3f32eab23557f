"""The captured decode step (runtime/llm/compiled.py): it really compiles (inductor, on the tiny
random Llama: the test pays one short compile, or a cache hit), its greedy tokens equal eager's
in float32, the engine serves eagerly while it compiles, and a compile that fails leaves the
engine eager and serving."""

from __future__ import annotations

import threading

import pytest
import torch

from runtime.llm.api import LLM
from runtime.llm.compiled import CompiledDecode
from runtime.llm.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# Ragged prompts (decode batches of 3 at different contexts, crossing block boundaries), and a
# lone sequence afterwards, which the runner pads to two rows.
PROMPTS = [[5, 6, 7, 8, 9], [11, 12] * 10, [100]]


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, [GREEDY] * len(prompts), use_tqdm=False)]


@pytest.fixture(scope="module")
def eager_tokens(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cpu", enforce_eager=True)
    assert llm.engine.runner.graph is None
    return _tokens(llm, PROMPTS), _tokens(llm, PROMPTS[:1])


@pytest.fixture
def one_thread():
    """This thread at one torch thread, as a vision engine in the same process may leave it; a
    new thread starts at OpenMP's default instead, which a compile thread must not inherit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_compiled_greedy_tokens_equal_eager_in_float32(tiny_llama_dir, eager_tokens, tmp_path, one_thread):
    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cpu", enforce_eager=False, cache_dir=str(tmp_path))
    graph = llm.engine.runner.graph
    assert isinstance(graph, CompiledDecode)
    assert graph.done.wait(600), "the compile did not finish"
    assert graph.failed is None, graph.failed
    runner = llm.engine.runner
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    batch, lone = _tokens(llm, PROMPTS), _tokens(llm, PROMPTS[:1])
    assert (batch, lone) == eager_tokens
    # Every pure-decode step ran the graph: 3 prompts * 23 decodes in 23 steps, then 23 alone.
    assert runner.num_graph_steps == 2 * (GREEDY.max_tokens - 1)
    # One graph served batches of 3 and the padded lone sequence, at every table width.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    # The lone sequence's padding row wrote nothing: the pad block is still zero.
    assert not runner.kv_cache[:, :, runner.pad_block].any()


def test_graph_failing_while_serving_falls_back_to_eager(tiny_llama_dir, eager_tokens, tmp_path, monkeypatch):
    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cpu", enforce_eager=False, cache_dir=str(tmp_path))
    runner = llm.engine.runner
    graph = runner.graph
    assert graph.done.wait(600) and graph.failed is None
    calls = []

    def broken(*inputs):
        calls.append(len(inputs))
        raise RuntimeError("guard failed past the recompile limit")

    monkeypatch.setattr(runner, "_run_graph", broken)
    assert _tokens(llm, PROMPTS) == eager_tokens[0]  # the failing step and every later one ran eagerly
    assert len(calls) == 1 and runner.graph is None and runner.num_graph_steps == 0
    assert graph.failed == "RuntimeError: guard failed past the recompile limit"
    assert llm.engine.num_failed_steps == 0


def test_serves_eagerly_while_compiling_then_switches(tiny_llama_dir, eager_tokens, tmp_path, monkeypatch):
    release = threading.Event()
    warm_up = CompiledDecode._warm_up

    def held_warm_up(self):
        release.wait()  # the compile cannot finish before the test lets it start
        warm_up(self)

    monkeypatch.setattr(CompiledDecode, "_warm_up", held_warm_up)
    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cpu", enforce_eager=False, cache_dir=str(tmp_path))
    runner = llm.engine.runner
    try:
        assert _tokens(llm, PROMPTS) == eager_tokens[0]
        assert runner.num_graph_steps == 0 and not runner.graph.done.is_set()
    finally:
        release.set()
    assert runner.graph.done.wait(600) and runner.graph.failed is None
    assert _tokens(llm, PROMPTS) == eager_tokens[0]
    assert runner.num_graph_steps == GREEDY.max_tokens - 1


def test_failed_compile_stays_eager_and_serves(tiny_llama_dir, eager_tokens, tmp_path, monkeypatch):
    def broken(self, *args):
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr(CompiledDecode, "__call__", broken)
    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cpu", enforce_eager=False, cache_dir=str(tmp_path))
    runner = llm.engine.runner
    assert runner.graph.done.wait(60)
    assert runner.graph.failed == "RuntimeError: inductor exploded"
    assert _tokens(llm, PROMPTS) == eager_tokens[0]
    assert runner.graph is None and runner.num_graph_steps == 0


def test_enforce_eager_comes_from_the_environment(monkeypatch):
    from runtime.llm.engine import EngineConfig

    monkeypatch.setenv("TANDEM_ENFORCE_EAGER", "0")
    assert EngineConfig().resolved_enforce_eager() is False
    assert EngineConfig(enforce_eager=True).resolved_enforce_eager() is True
    monkeypatch.setenv("TANDEM_ENFORCE_EAGER", "yes")
    with pytest.raises(ValueError, match="TANDEM_ENFORCE_EAGER"):
        EngineConfig().resolved_enforce_eager()
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="no")


def test_decode_attention_op_writes_the_cache_and_matches_the_reference():
    from kernels import paged_attention as ref
    from runtime.llm import graph_ops

    torch.manual_seed(0)
    layers, blocks, bs, nkv, hd, nh = 2, 6, 4, 2, 8, 4
    kv = torch.randn(layers, 2, blocks, bs, nkv, hd)
    q, k, v = torch.randn(2, nh, hd), torch.randn(2, nkv, hd), torch.randn(2, nkv, hd)
    tables = torch.tensor([[1, 2], [3, 5]], dtype=torch.int32)
    ctx = torch.tensor([6, 3], dtype=torch.int32)
    slots = torch.tensor([2 * bs + 1, 3 * bs + 2])
    mask = ref.decode_mask(ctx, 2 * bs, torch.float32)
    want_kv = kv.clone()
    ref.write_kv(want_kv[1, 0], want_kv[1, 1], k, v, slots)
    want = ref.paged_decode_attention(q, want_kv[1, 0], want_kv[1, 1], tables.long(), mask, 0.5)
    got = graph_ops.decode_attention(q, k, v, kv, 1, slots, tables, ctx, mask, 0.5)
    assert torch.equal(kv, want_kv)
    torch.testing.assert_close(got, want)
