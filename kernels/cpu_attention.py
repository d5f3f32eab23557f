"""Paged attention on the CPU without gathering contexts: a small C++ op, wrapped as custom ops.

Layout, as in kernels/paged_attention.py: one layer's KV cache is a pair of tensors
[num_blocks, block_size, num_kv_heads, head_dim]; the token at position p of a sequence with
block table `bt` lives in block `bt[p // block_size]` at offset `p % block_size`. Query head h
reads KV head h // g, g = num_heads // num_kv_heads.

    write_kv         k, v [T, nkv, hd] -> cache rows slot_mapping [T]; a negative slot is skipped
    paged_attention  a varlen batch of sequences, decode (q_len 1) and prefill chunks mixed,
                     [T, nh, hd], causal, one call

Both are torch.library custom ops (tandem::paged_attention, tandem::write_kv) with fake
implementations, so torch.compile(fullgraph=True) traces through them as opaque calls. Their
Python implementation is the torch path below; the C++ library, once loaded, registers its
kernels as the ops' CPU implementation, so CPU calls then go from the dispatcher straight to
C++ (3 us a call under inference_mode, against 14 us through a Python implementation).

The kernel (kernels/cpu_attention.cpp, its comments say how) reads each sequence's blocks in
place, never past its context, with a fused online softmax in float32: the torch path
(kernels/paged_attention.py) copies every context into a contiguous tensor first, and needs
the padding of block tables to point at a zeroed block; this one needs neither.

The C++ op is compiled on first use (kernels/cpp_build.py: torch.utils.cpp_extension, g++ and ninja), into
$TANDEM_CACHE_DIR (or ~/.cache/tandem)/torch_extensions/<key>: the key names torch's version, the
Python ABI, the SIMD level the op is compiled for and a hash of the CPU's flags, the
compiler flags and the source's path, so a cache shared between machines, environments or
checkouts never hands one a binary built for another, nor makes two take turns rebuilding it.
A cold build takes 10 to 25 s (one file, g++ -O3, two busy cores); loading it from the cache
takes about 0.05 s. When the build fails (no compiler, no ninja), the ops run the torch
implementation instead and say why once, in a RuntimeWarning. TANDEM_CPU_ATTENTION, read until the library is
loaded (so set it before the first call), picks the path: "auto" (default: C++ when it builds),
"cpp" (C++ or raise) or "torch" (never build).

CPU dtypes: float32, bfloat16 and float16, the cache's dtype equal to q's. Metadata is checked
on the host before the kernel runs (RuntimeError otherwise): 0 <= q_len <= context_len <=
block_tables.shape[1] * block_size, and every block id the context needs in range.
"""

from __future__ import annotations

import logging
import os

import torch

from kernels import cpp_build
from kernels.paged_attention import gather_blocks, prefill_attention
from kernels.paged_attention import write_kv_padded as write_kv_torch

logger = logging.getLogger(__name__)

LIBRARY = cpp_build.Library(
    "tandem_cpu_attention",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_attention.cpp"),
    "TANDEM_CPU_ATTENTION",
    "kernels.cpu_attention",
)
available = LIBRARY.available
build_info = LIBRARY.build_info


# ---------------------------------------------------------------------------------------------
# torch path: the fallback, and what any device other than the CPU runs


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """paged_attention with SDPA: decode rows in one batched call over gathered blocks, each
    prefill chunk in its own. Positions past a context are zeroed after the gather, so
    padding blocks may hold anything (an additive mask alone would let NaN through)."""
    cu = cu_q_lens.tolist()
    ctx = context_lens.tolist()
    bs, nkv, hd = k_cache.shape[1:]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decodes = [s for s in range(len(ctx)) if cu[s + 1] - cu[s] == 1]
    if decodes:
        n_blk = -(-max(ctx[s] for s in decodes) // bs)
        idx = torch.tensor(decodes, device=q.device)
        rows = torch.tensor([cu[s] for s in decodes], device=q.device)
        lens = torch.tensor([ctx[s] for s in decodes], device=q.device)
        tables = block_tables.index_select(0, idx)[:, :n_blk].long()
        inside = torch.arange(n_blk * bs, device=q.device) < lens.unsqueeze(-1)  # [B, L]
        keep = inside.view(len(decodes), -1, 1, 1)
        k = torch.where(keep, gather_blocks(k_cache, tables), 0).transpose(1, 2)  # [B, nkv, L, hd]
        v = torch.where(keep, gather_blocks(v_cache, tables), 0).transpose(1, 2)
        b, nh = len(decodes), q.shape[1]
        qg = q.index_select(0, rows).view(b, nkv, nh // nkv, hd)
        o = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=inside.view(b, 1, 1, -1), scale=scale)
        out.index_copy_(0, rows, o.reshape(b, nh, hd))
    for s in range(len(ctx)):
        q_len = cu[s + 1] - cu[s]
        if q_len <= 1:
            continue
        pos = torch.arange(ctx[s], device=q.device)
        slots = block_tables[s].long()[pos // bs] * bs + pos % bs
        k = k_cache.view(-1, nkv, hd).index_select(0, slots)
        v = v_cache.view(-1, nkv, hd).index_select(0, slots)
        out[cu[s] : cu[s + 1]] = prefill_attention(q[cu[s] : cu[s + 1]], k, v, ctx[s] - q_len, scale)
    return out


# ---------------------------------------------------------------------------------------------
# the custom ops


@torch.library.custom_op("tandem::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [num_tokens, num_kv_heads, head_dim] at rows `slot_mapping` [num_tokens]
    (int32 or int64) of the flattened caches; a negative slot is skipped."""
    if LIBRARY.use_cpp(k_cache, v_cache, k, v, slot_mapping):
        torch.ops.tandem_cpu.write_kv(k_cache, v_cache, k, v, slot_mapping)
    else:
        write_kv_torch(k_cache, v_cache, k, v, slot_mapping)


@write_kv.register_fake
def _(k_cache, v_cache, k, v, slot_mapping) -> None:
    return None


@torch.library.custom_op("tandem::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of S sequences' query rows over their paged K/V. q [T, nh, hd] holds
    the sequences' rows back to back: sequence s owns rows cu_q_lens[s]:cu_q_lens[s+1]
    (cu_q_lens [S + 1], from 0), at positions [context_lens[s] - q_len_s, context_lens[s]),
    and attends to positions [0, context_lens[s]) (its own rows already written by write_kv)
    through block_tables[s] (entries past its last block may hold any valid id). Decode is
    q_len 1. Index tensors int32 (int64 is converted). Returns [T, nh, hd] in q's dtype,
    accumulated in float32."""
    if LIBRARY.use_cpp(q, k_cache, v_cache, block_tables, cu_q_lens, context_lens):
        return torch.ops.tandem_cpu.paged_attention(q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, scale)
    return paged_attention_torch(q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, scale)


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, cu_q_lens, context_lens, scale):
    return q.new_empty(q.shape)
