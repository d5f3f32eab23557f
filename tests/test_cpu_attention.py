"""kernels/cpu_attention.py against the torch reference (kernels/paged_attention.py) and a
float64 one: decode, prefill chunks, both mixed, GQA, float32 and bfloat16, garbage past the
contexts, torch.compile, and the torch fallback. The C++ op is built (or loaded from the
Tandem cache) once per session."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from kernels import cpu_attention as ca
from kernels import paged_attention as ref

DTYPES = [torch.float32, torch.bfloat16]
# (num_heads, num_kv_heads, head_dim): SmolLM2-135M, plain multi-head at 128, and a head_dim
# that is not a multiple of the vector width (the kernel's run-time head_dim path).
SHAPES = [(9, 3, 64), (4, 4, 128), (6, 2, 40)]
PAD = 0  # the block that padding entries of block tables point at


@pytest.fixture
def cpp():
    """The C++ op, built: skipped where there is no compiler or it is turned off, and a
    failure, not a silent comparison of the fallback with itself, when it does not build.
    It runs on two threads whatever the suite's setting (one per xdist process: conftest.py),
    so that the kernel's at::parallel_for splits are what is compared."""
    if ca.LIBRARY.mode() == "torch":
        pytest.skip("TANDEM_CPU_ATTENTION=torch")
    if not ca.available():
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip("no C++ compiler")
        pytest.fail(f"the C++ op did not build: {ca.build_info().get('error')}")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_batch(ctx_lens, q_lens, nh, nkv, hd, dtype, bs=16, seed=0, garbage=float("nan")):
    """Random caches and block tables for sequences of `ctx_lens` whose last `q_lens` tokens
    are queries. Block PAD and every position past a context hold `garbage`; returns the
    batch and a clean copy of the caches (garbage zeroed) for the references."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-c // bs) for c in ctx_lens) + 1  # one padding entry at least
    need = sum(-(-c // bs) for c in ctx_lens)
    nb = need + 3
    k_cache = torch.randn(nb, bs, nkv, hd, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, nkv, hd, generator=g).to(dtype)
    ids = (torch.randperm(nb - 1, generator=g) + 1).tolist()  # scattered, never PAD
    tables = torch.full((len(ctx_lens), width), PAD, dtype=torch.int32)
    clean_k, clean_v = k_cache.clone(), v_cache.clone()
    for s, c in enumerate(ctx_lens):
        n = -(-c // bs)
        tables[s, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        tail = tables[s, n - 1].item()
        for cache, clean in ((k_cache, clean_k), (v_cache, clean_v)):
            cache[tail, c - (n - 1) * bs :] = garbage
            clean[tail, c - (n - 1) * bs :] = 0
    for cache, clean in ((k_cache, clean_k), (v_cache, clean_v)):
        cache[PAD] = garbage
        clean[PAD] = 0
    q = torch.randn(sum(q_lens), nh, hd, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return (q, k_cache, v_cache, tables, cu, ctx), (clean_k, clean_v)


def dense_reference(q, k_cache, v_cache, tables, cu, ctx, scale):
    """Float64, position by position through the block tables: what every path must match."""
    bs, nkv, hd = k_cache.shape[1:]
    nh = q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(len(ctx)):
        c, r0, r1 = int(ctx[s]), int(cu[s]), int(cu[s + 1])
        pos = torch.arange(c)
        slots = tables[s].long()[pos // bs] * bs + pos % bs
        k = k_cache.view(-1, nkv, hd)[slots].double().repeat_interleave(nh // nkv, dim=1)  # [c, nh, hd]
        v = v_cache.view(-1, nkv, hd)[slots].double().repeat_interleave(nh // nkv, dim=1)
        qs = q[r0:r1].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        qpos = torch.arange(c - (r1 - r0), c).unsqueeze(-1)
        scores = scores.masked_fill(pos > qpos, float("-inf"))
        out[r0:r1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def torch_reference(q, k_cache, v_cache, tables, cu, ctx, scale):
    """kernels/paged_attention.py as the runtime calls it: one batched decode call when every
    sequence decodes, else one paged prefill call per sequence (clean caches only)."""
    bs = k_cache.shape[1]
    q_lens = (cu[1:] - cu[:-1]).tolist()
    if all(n == 1 for n in q_lens):
        width = tables.shape[1]
        mask = ref.decode_mask(ctx.long(), width * bs, q.dtype)
        return ref.paged_decode_attention(q, k_cache, v_cache, tables.long(), mask, scale)
    out = torch.empty_like(q)
    for s, n in enumerate(q_lens):
        c, r0 = int(ctx[s]), int(cu[s])
        table = tables[s, : -(-c // bs)].long()
        out[r0 : r0 + n] = ref.paged_prefill_attention(q[r0 : r0 + n], k_cache, v_cache, table, c - n, scale)
    return out


def check(out, batch, clean, scale, fused=True):
    """`fused`: the output of one float32 accumulation, rounded once (SDPA's bfloat16 path
    rounds the scores too, so the torch fallback only matches the reference's tolerance)."""
    q, _, _, tables, cu, ctx = batch
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "garbage past a context reached the output"
    truth = dense_reference(q, *clean, tables, cu, ctx, scale)
    expected = torch_reference(q, *clean, tables, cu, ctx, scale)
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), truth, atol=1e-5, rtol=1e-5)
    else:
        # float32 accumulation, one rounding at the end: within half a bfloat16 ulp of the truth.
        if fused:
            torch.testing.assert_close(out.double(), truth, atol=1e-5, rtol=2**-8)
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out.double(), truth, atol=2e-2, rtol=2e-2)


CASES = {
    # name: (context lengths, query lengths)
    "decode_ragged": ([1, 2, 15, 16, 17, 33, 64, 100], [1] * 8),
    "prefill_start0": ([37], [37]),
    "prefill_start_gt0": ([70], [21]),
    "prefill_batch": ([16, 50, 81], [16, 9, 40]),
    "mixed": ([5, 129, 40, 1, 77], [1, 1, 40, 1, 30]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(cpp, case, shape, dtype):
    nh, nkv, hd = shape
    ctx_lens, q_lens = CASES[case]
    batch, clean = make_batch(ctx_lens, q_lens, nh, nkv, hd, dtype)
    scale = 1 / math.sqrt(hd)
    check(ca.paged_attention(*batch, scale), batch, clean, scale)


def test_float16(cpp):
    """Also supported on the CPU: within half a float16 ulp of the float64 truth."""
    batch, clean = make_batch(*CASES["mixed"], 9, 3, 64, torch.float16)
    out = ca.paged_attention(*batch, 0.125)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    truth = dense_reference(batch[0], *clean, *batch[3:], 0.125)
    torch.testing.assert_close(out.double(), truth, atol=1e-5, rtol=2**-11)


@pytest.mark.parametrize("bs", [1, 8, 32])
def test_block_sizes(cpp, bs):
    batch, clean = make_batch([1, 31, 64, 90], [1, 1, 20, 33], 9, 3, 64, torch.float32, bs=bs)
    check(ca.paged_attention(*batch, 0.125), batch, clean, 0.125)


def test_inf_garbage_and_strided_q(cpp):
    """+inf past a context (an additive mask cannot hide it), and q a view of a fused QKV
    projection, as the model passes it."""
    nh, nkv, hd = 9, 3, 64
    batch, clean = make_batch([20, 45, 3], [1, 25, 1], nh, nkv, hd, torch.float32, garbage=float("inf"))
    q, *rest = batch
    qkv = torch.randn(q.shape[0], (nh + 2 * nkv) * hd)
    qkv[:, : nh * hd] = q.reshape(q.shape[0], -1)
    q_view = qkv[:, : nh * hd].view(-1, nh, hd)
    assert not q_view.is_contiguous()
    out = ca.paged_attention(q_view, *rest, 0.125)
    check(out, batch, clean, 0.125)


def test_empty_sequence_rows(cpp):
    """A sequence with no query rows in this step contributes nothing."""
    batch, clean = make_batch([10, 30, 7], [1, 0, 5], 9, 3, 64, torch.float32)
    check(ca.paged_attention(*batch, 0.125), batch, clean, 0.125)


def test_rejects_bad_metadata(cpp):
    batch, _ = make_batch([10, 30], [1, 5], 9, 3, 64, torch.float32)
    q, kc, vc, tables, cu, ctx = batch
    with pytest.raises(RuntimeError, match="exceeds"):
        ca.paged_attention(q, kc, vc, tables, cu, torch.tensor([10, 30 + 16 * tables.shape[1]], dtype=torch.int32), 1.0)
    bad = tables.clone()
    bad[1, 0] = kc.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        ca.paged_attention(q, kc, vc, bad, cu, ctx, 1.0)
    with pytest.raises(RuntimeError, match="q_len"):
        ca.paged_attention(q, kc, vc, tables, cu, torch.tensor([10, 4], dtype=torch.int32), 1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv(cpp, dtype):
    g = torch.Generator().manual_seed(1)
    nb, bs, nkv, hd = 6, 16, 3, 64
    k_cache = torch.randn(nb, bs, nkv, hd, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, nkv, hd, generator=g).to(dtype)
    fused = torch.randn(20, 2, nkv, hd, generator=g).to(dtype)
    k, v = fused[:, 0], fused[:, 1]  # strided token rows, as split from a projection
    slots = torch.randperm(nb * bs, generator=g)[:20]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.write_kv(want_k, want_v, k, v, slots)
    ca.write_kv(k_cache, v_cache, k, v, slots.to(torch.int32))
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    before = k_cache.clone()
    ca.write_kv(k_cache, v_cache, k[:2] + 1, v[:2] + 1, torch.tensor([-1, 5]))  # -1: skipped
    assert torch.equal(k_cache.view(-1, nkv, hd)[5], k[1] + 1)
    before.view(-1, nkv, hd)[5] = k[1] + 1
    assert torch.equal(k_cache, before)


def test_opcheck(cpp):
    batch, _ = make_batch([3, 20], [1, 8], 4, 2, 16, torch.float32, garbage=0.0)
    torch.library.opcheck(torch.ops.tandem.paged_attention.default, (*batch, 0.25))
    q, kc, vc = batch[:3]
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    torch.library.opcheck(torch.ops.tandem.write_kv.default, (kc, vc, k, v, torch.tensor([3, 40])))


def test_torch_compile_fullgraph(cpp):
    """The ops are opaque to dynamo and inductor: no graph break around them."""
    nh, nkv, hd = 9, 3, 64
    batch, clean = make_batch([20, 9], [1, 9], nh, nkv, hd, torch.float32, garbage=0.0)
    q, k_cache, v_cache, tables, cu, ctx = batch
    new_k, new_v = torch.randn(10, nkv, hd), torch.randn(10, nkv, hd)
    # The new tokens go where each sequence's query rows are: position 19 of sequence 0,
    # positions 0..8 of sequence 1.
    pos = torch.tensor([19, *range(9)])
    seq = torch.tensor([0] + [1] * 9)
    slots = tables[seq, pos // 16].long() * 16 + pos % 16

    def layer(x, k_cache, v_cache, k, v):
        ca.write_kv(k_cache, v_cache, k * 1.0, v, slots)
        return ca.paged_attention(x * 2.0, k_cache, v_cache, tables, cu, ctx, 0.125) + 1.0

    caches = (k_cache.clone(), v_cache.clone())
    eager = layer(q, *caches, new_k, new_v)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    caches_c = (k_cache.clone(), v_cache.clone())
    got = compiled(q, *caches_c, new_k, new_v)
    torch.testing.assert_close(got, eager)
    assert torch.equal(caches_c[0], caches[0]) and torch.equal(caches_c[1], caches[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["decode_ragged", "mixed", "prefill_start_gt0"])
def test_torch_path(case, dtype):
    """The fallback's implementation, called directly: the reference's results, and the op's
    (C++ where it built) within the reference's tolerance."""
    ctx_lens, q_lens = CASES[case]
    batch, clean = make_batch(ctx_lens, q_lens, 9, 3, 64, dtype)
    slow = ca.paged_attention_torch(*batch, 0.125)
    check(slow, batch, clean, 0.125, fused=False)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(slow, ca.paged_attention(*batch, 0.125), **tol)
    k_cache, v_cache = batch[1].clone(), batch[2].clone()
    k = torch.randn(3, 3, 64).to(dtype)
    ca.write_kv_torch(k_cache, v_cache, k, k, torch.tensor([4, -1, 17]))
    assert torch.equal(k_cache.view(-1, 3, 64)[[4, 17]], k[[0, 2]])


FALLBACK_CASES = [("decode_ragged", torch.float32), ("mixed", torch.bfloat16), ("prefill_start_gt0", torch.float32)]


def _fallback_process(out_path: str) -> None:
    """Run in a fresh process (the C++ kernels, once loaded, take every CPU call): the
    TANDEM_CPU_ATTENTION=torch switch, then a failed build, then TANDEM_CPU_ATTENTION=cpp."""
    assert os.environ["TANDEM_CPU_ATTENTION"] == "torch"
    assert not ca.available() and ca.LIBRARY.loaded is None  # never even tried to build
    outs = {}
    for case, dtype in FALLBACK_CASES:
        batch, clean = make_batch(*CASES[case], 9, 3, 64, dtype)
        outs[case] = ca.paged_attention(*batch, 0.125)
        check(outs[case], batch, clean, 0.125, fused=False)

    def fail():
        raise RuntimeError("no compiler here")

    ca.LIBRARY.build = fail
    os.environ["TANDEM_CPU_ATTENTION"] = "auto"
    batch, clean = make_batch([12, 30], [1, 6], 9, 3, 64, torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(ca.paged_attention(*batch, 0.125), batch, clean, 0.125)
        ca.paged_attention(*batch, 0.125)
        k_cache = batch[1].clone()
        ca.write_kv(k_cache, k_cache.clone(), batch[0][:1, :3], batch[0][:1, :3], torch.tensor([5]))
        assert torch.equal(k_cache.view(-1, 3, 64)[5], batch[0][0, :3])
    assert [str(w.message).count("no compiler here") for w in caught] == [1], "warn once, saying why"
    assert not ca.available() and "no compiler here" in ca.build_info()["error"]

    ca.LIBRARY.loaded = None
    os.environ["TANDEM_CPU_ATTENTION"] = "cpp"
    with pytest.raises(RuntimeError, match="no compiler here"):
        ca.available()
    torch.save(outs, out_path)


def test_fallback(tmp_path):
    """TANDEM_CPU_ATTENTION=torch and a failed build give the C++ op's results."""
    out_path = str(tmp_path / "fallback.pt")
    code = f"import sys; sys.path.insert(0, 'tests'); import test_cpu_attention as t; t._fallback_process({out_path!r})"
    env = dict(os.environ, TANDEM_CPU_ATTENTION="torch")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = torch.load(out_path)
    for case, dtype in FALLBACK_CASES:
        batch, _ = make_batch(*CASES[case], 9, 3, 64, dtype)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(outs[case], ca.paged_attention(*batch, 0.125), **tol)
