"""The Triton kernels (kernels/triton_attention.py) against their torch references and against
textbook dense attention, run on CPU by Triton's interpreter (TRITON_INTERPRET=1).

Where the interpreter flag is set: @triton.jit reads TRITON_INTERPRET when it decorates a
function, and triton.language decorates its own helpers (tl.zeros, tl.sum, tl.max, ...) when
triton is first imported, so the flag must be set before anything imports triton
(tests/conftest.py sets it when no GPU is visible; test_interpreter_needs_the_flag_before_import
runs both orders in fresh interpreters). kernels/triton_attention.py defines its kernels on the
first call and caches them per flag value, so this module's fixture can still set it for a
machine with a GPU, where conftest leaves it unset.

Tolerances: float32 1e-4 abs / 1e-5 rel. The kernel sums the softmax block by block with
running rescales (online softmax) and the reference sums densely; in float32 these orders differ
by a few ulps (~1e-6) per output, far below 1e-4, while any masking or indexing mistake moves an
output by ~1e-1. 16-bit: the inputs and outputs are rounded to float16 / bfloat16 and P is cast
to 16 bits before P @ V, so the tolerance is a few ulps of the output: 2e-2 (bfloat16 has an 8-bit
mantissa, ulp 2**-7 at 1), 4e-3 for float16.

Shapes are small (2 KV heads, contexts up to ~100 positions) because the interpreter runs every
program in Python; the positions still cross block and tile boundaries.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from kernels import triton_attention as ta

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

NKV = 2
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [q_len, nh, hd] at positions [start, start + q_len); k, v [start + q_len, nkv, hd]. The
    textbook form, from the sequence's own K/V (not the cache): K/V repeated per query head,
    explicit causal mask, float64."""
    hd = q.shape[-1]
    g = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(g, dim=1).transpose(0, 1)
    v = v.double().repeat_interleave(g, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * hd**-0.5
    qpos = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[1]) > qpos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def paged_sequences(lengths: list[int], block_size: int, hd: int, dtype: torch.dtype, seed: int, write=ta.write_kv_ref):
    """A cache holding sequences of `lengths` on shuffled, non-contiguous blocks (written by
    write_kv_ref: the interpreter runs the Triton write_kv, one program per token, too slowly
    for every test; test_write_kv_* and test_prefill_chunks_* use it). Every slot no sequence
    owns is NaN (stale K/V of another request at its worst), and each block table is padded
    with the id of a NaN block: a kernel that reads a position past a context, or a table entry
    past its last block, returns NaN."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    k_cache = torch.full((num_blocks, block_size, NKV, hd), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    junk_block = perm.pop()
    nblk = max(-(-n // block_size) for n in lengths) + 1
    tables, seqs = [], []
    for n in lengths:
        nb = -(-n // block_size)
        blocks, perm = perm[:nb], perm[nb:]
        assert len(blocks) == nb, "not enough blocks"
        k = torch.randn(n, NKV, hd, generator=g).to(dtype)
        v = torch.randn(n, NKV, hd, generator=g).to(dtype)
        slots = (torch.tensor(blocks).repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(nb))[
            :n
        ]
        write(k_cache, v_cache, k, v, slots)
        tables.append(blocks + [junk_block] * (nblk - nb))
        seqs.append((k, v))
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), seqs


# ---------------------------------------------------------------------------------------------
# write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_matches_reference_and_skips_negative_slots(dtype, slot_dtype):
    bs, hd, nkv = 8, 64, 3  # 3 KV heads: the head axis is padded to 4 inside the kernel
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, bs, nkv, hd, generator=g).to(dtype)
    v_cache = torch.randn(6, bs, nkv, hd, generator=g).to(dtype)
    # k, v as views of one fused projection, as a model makes them: not contiguous per token.
    kv = torch.randn(7, 2, nkv, hd, generator=g).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([5, -1, 0, 47, -7, 8, 21], dtype=slot_dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ta.write_kv_ref(ref_k, ref_v, k, v, slots)
    before_k = k_cache.clone()
    ta.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    flat_k, flat_before = k_cache.view(-1, nkv, hd), before_k.view(-1, nkv, hd)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k[t]) and torch.equal(v_cache.view(-1, nkv, hd)[s], v[t])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[[s for s in slots.tolist() if s >= 0]] = True
    assert torch.equal(flat_k[~written], flat_before[~written])  # nothing else moved


# ---------------------------------------------------------------------------------------------
# decode

# (num_heads, block_size, head_dim): GQA ratios 1, 3, 4 with 2 KV heads, each with every block
# size at head_dim 64, and each once at head_dim 128 (the interpreter's time, not the kernels,
# asks for fewer than all 18).
GQA_BLOCKS = [(nh, bs, 64) for nh in (2, 6, 8) for bs in (8, 16, 32)] + [(2, 32, 128), (6, 8, 128), (8, 16, 128)]


def decode_lengths(bs: int) -> list[int]:
    # Across block boundaries and the kernel's 64-position tiles; one much longer than the rest.
    return [1, bs - 1, bs, bs + 1, 3 * bs + 2, 130]


def check_decode(nh, bs, hd, dtype, seed):
    lengths = decode_lengths(bs)
    k_cache, v_cache, tables, seqs = paged_sequences(lengths, bs, hd, dtype, seed)
    q = torch.randn(len(lengths), nh, hd, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    out = ta.paged_decode_attention(q, k_cache, v_cache, tables, ctx, hd**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    ref = ta.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, hd**-0.5)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for i, (n, (k, v)) in enumerate(zip(lengths, seqs)):
        dense = dense_attention(q[i : i + 1], k, v, n - 1)[0]
        torch.testing.assert_close(out[i].double(), dense, **TOL[dtype])


@pytest.mark.parametrize("nh,bs,hd", GQA_BLOCKS)
def test_decode_float32(nh, bs, hd):
    check_decode(nh, bs, hd, torch.float32, seed=nh * bs + hd)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nh,bs,hd", [(6, 16, 64), (8, 32, 128)])
def test_decode_16bit(nh, bs, hd, dtype):
    check_decode(nh, bs, hd, dtype, seed=3)


def test_decode_strided_q_and_out():
    """q a view of a fused qkv projection, and a preallocated (CUDA-graph style) out."""
    nh, bs, hd = 6, 16, 64
    lengths = [5, 40]
    k_cache, v_cache, tables, seqs = paged_sequences(lengths, bs, hd, torch.float32, 7)
    qkv = torch.randn(len(lengths), (nh + 2 * NKV) * hd)
    q = qkv[:, : nh * hd].view(len(lengths), nh, hd)
    assert not q.is_contiguous()
    out = torch.full((len(lengths), nh, hd), float("nan"))
    ctx = torch.tensor(lengths, dtype=torch.int64)
    got = ta.paged_decode_attention(q, k_cache, v_cache, tables.long(), ctx, hd**-0.5, out=out)
    assert got is out
    ref = ta.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, hd**-0.5)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


# ---------------------------------------------------------------------------------------------
# prefill


def prefill_chunks(bs: int) -> list[tuple[int, int]]:
    """(cached positions, chunk length) per chunk of one launch: no cached context (one query,
    and a chunk across a block boundary), cached context ending on, before and after a block
    boundary, a one-query chunk after several blocks, and a chunk longer than one query tile."""
    return [(0, 1), (0, bs + 3), (bs, 5), (bs - 1, 2 * bs + 1), (3 * bs + 1, 1), (5, 70)]


def check_prefill(nh, bs, hd, dtype, seed):
    chunks = prefill_chunks(bs)
    lengths = [s + n for s, n in chunks]
    k_cache, v_cache, tables, seqs = paged_sequences(lengths, bs, hd, dtype, seed)
    q_lens = [n for _, n in chunks]
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), nh, hd, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    out = ta.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, hd**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    ref = ta.paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, ctx, hd**-0.5)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for i, ((start, n), (k, v)) in enumerate(zip(chunks, seqs)):
        lo = int(cu[i])
        dense = dense_attention(q[lo : lo + n], k, v, start)
        torch.testing.assert_close(out[lo : lo + n].double(), dense, **TOL[dtype])


@pytest.mark.parametrize("nh,bs,hd", GQA_BLOCKS)
def test_prefill_float32(nh, bs, hd):
    check_prefill(nh, bs, hd, torch.float32, seed=nh * bs + hd)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nh,bs,hd", [(6, 16, 64), (8, 32, 128)])
def test_prefill_16bit(nh, bs, hd, dtype):
    check_prefill(nh, bs, hd, dtype, seed=5)


def test_prefill_chunks_equal_full_causal_pass_and_decode():
    """One sequence prefilled as chunks of separate launches gives the rows of one full causal
    launch, and its last row equals a decode of the same query."""
    nh, bs, hd, n = 6, 8, 64, 37
    k_cache, v_cache, tables, _ = paged_sequences([n], bs, hd, torch.float32, 11, write=ta.write_kv)
    q = torch.randn(n, nh, hd, generator=torch.Generator().manual_seed(12))
    scale = hd**-0.5

    def prefill(lo, hi):
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        return ta.paged_prefill_attention(
            q[lo:hi], k_cache, v_cache, tables, cu, torch.tensor([hi], dtype=torch.int32), scale
        )

    full = prefill(0, n)
    chunked = torch.cat([prefill(lo, hi) for lo, hi in ((0, 9), (9, 10), (10, 30), (30, n))])
    torch.testing.assert_close(chunked, full, **TOL[torch.float32])
    last = ta.paged_decode_attention(q[-1:], k_cache, v_cache, tables, torch.tensor([n], dtype=torch.int32), scale)
    torch.testing.assert_close(last[0], full[-1], **TOL[torch.float32])


# ---------------------------------------------------------------------------------------------
# argument checks


def _decode_args():
    k_cache = torch.zeros(4, 16, 2, 64)
    return dict(
        q=torch.zeros(3, 6, 64),
        k_cache=k_cache,
        v_cache=k_cache.clone(),
        block_tables=torch.zeros(3, 2, dtype=torch.int32),
        context_lens=torch.ones(3, dtype=torch.int32),
        scale=0.125,
    )


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(q=torch.zeros(3, 6)), "q"),
        (dict(q=torch.zeros(3, 5, 64)), "num_heads"),
        (dict(q=torch.zeros(3, 6, 32)), "head_dim"),
        (dict(q=torch.zeros(3, 6, 64, dtype=torch.float64)), "q"),
        (dict(q=torch.zeros(3, 6, 64, dtype=torch.float16)), "k_cache dtype"),
        (
            dict(k_cache=torch.zeros(4, 16, 2, 48), v_cache=torch.zeros(4, 16, 2, 48), q=torch.zeros(3, 6, 48)),
            "head_dim",
        ),
        (dict(v_cache=torch.zeros(4, 8, 2, 64)), "v_cache"),
        (dict(block_tables=torch.zeros(3, 2)), "block_tables"),
        (dict(block_tables=torch.zeros(2, 2, dtype=torch.int32)), "block_tables"),
        (dict(context_lens=torch.ones(3, 1, dtype=torch.int32)), "context_lens"),
        (dict(scale=0.0), "scale"),
        (dict(q=[1.0]), "q"),
    ],
)
def test_decode_rejects_bad_arguments(change, name):
    args = _decode_args() | change
    with pytest.raises(ValueError, match=name):
        ta.paged_decode_attention(**args)


def test_prefill_and_write_kv_reject_bad_arguments():
    a = _decode_args()
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_q_lens"):
        ta.paged_prefill_attention(
            a["q"], a["k_cache"], a["v_cache"], a["block_tables"], cu[:3], a["context_lens"], 0.125
        )
    with pytest.raises(ValueError, match="max_q_len"):
        ta.paged_prefill_attention(
            a["q"], a["k_cache"], a["v_cache"], a["block_tables"], cu, a["context_lens"], 0.125, max_q_len=0
        )
    with pytest.raises(ValueError, match="out"):
        ta.paged_prefill_attention(
            a["q"],
            a["k_cache"],
            a["v_cache"],
            a["block_tables"],
            cu,
            a["context_lens"],
            0.125,
            out=torch.zeros(3, 6, 32),
        )
    k = torch.zeros(2, 2, 64)
    with pytest.raises(ValueError, match="k must have shape"):
        ta.write_kv(a["k_cache"], a["v_cache"], torch.zeros(2, 3, 64), k, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="slot_mapping"):
        ta.write_kv(a["k_cache"], a["v_cache"], k, k, torch.zeros(2))
    with pytest.raises(ValueError, match="same number of tokens"):
        ta.write_kv(a["k_cache"], a["v_cache"], k, k, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="v must have dtype float32"):
        ta.write_kv(a["k_cache"], a["v_cache"], k, k.half(), torch.zeros(2, dtype=torch.int32))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        ta.paged_decode_attention(**_decode_args())


def test_interpreter_needs_the_flag_before_import():
    """TRITON_INTERPRET set before `import triton`: the attention kernels run on CPU. Set only
    after: triton.language's helpers were decorated for the GPU and the kernel cannot run,
    which is why tests/conftest.py sets the flag before anything imports triton."""
    code = (
        "import os\n"
        "{pre}"
        "import torch, triton\n"
        "{post}"
        "from kernels import triton_attention as ta\n"
        "q = torch.randn(2, 4, 16); kc = torch.randn(4, 8, 2, 16); vc = torch.randn(4, 8, 2, 16)\n"
        "bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32); cl = torch.tensor([9, 3], dtype=torch.int32)\n"
        "out = ta.paged_decode_attention(q, kc, vc, bt, cl, 0.25)\n"
        "ref = ta.paged_decode_attention_ref(q, kc, vc, bt, cl, 0.25)\n"
        "assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()\n"
        "print('ok')\n"
    )
    flag = "os.environ['TRITON_INTERPRET'] = '1'\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(pre: str, post: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code.format(pre=pre, post=post)],
            capture_output=True,
            text=True,
            env=env,
            cwd=root,
            timeout=120,
        )

    before = run(flag, "")
    assert before.returncode == 0 and before.stdout.strip() == "ok", before.stderr[-2000:]
    after = run("", flag)
    assert after.returncode != 0 and "outside of the scope of a kernel" in after.stderr, after.stderr[-2000:]
