"""`tandem::decode_attention`: one layer's K/V write and decode attention as one registered op.

torch.compile traces the decode step (runtime/llm/compiled.py) into one graph over all layers
only if nothing in it breaks the trace. Paged attention indexes a cache by block tables and
writes it in place, which the compiler should neither trace nor reorder, so it enters the
graph as an opaque custom op (torch.library) with a fake (shape-only) implementation.

Why one op for the write and the read, over the runner's whole cache tensor rather than one
layer's views: a graph that mutates a view of one of its inputs is functionalised into a copy
of the base; mutating the input itself is what inductor re-does in place. The generated code
then passes the cache straight through, with no copy of it (checked in its output code).

Inside, the op runs the same kernels the eager path runs: the in-place C++ kernel
(kernels/cpu_attention.py) where it built, else the torch reference (gather + SDPA); on CUDA
the Triton kernel.
"""

from __future__ import annotations

import torch

from kernels import paged_attention as ref


def _cpu_kernel():
    """kernels.cpu_attention when its C++ op is usable here, else None (the torch reference)."""
    try:
        from kernels import cpu_attention
    except ImportError:
        return None
    return cpu_attention if cpu_attention.available() else None


@torch.library.custom_op("tandem::decode_attention", mutates_args=("kv_cache",))
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, heads, head_dim], k, v [B, kv_heads, head_dim] of one token per sequence; writes
    k, v at `slot_mapping` in layer `layer` of `kv_cache` [layers, 2, blocks, block_size,
    kv_heads, head_dim], then attends each query to its sequence's first context_lens keys
    through block_tables [B, M] (int32: every kernel takes it, the reference's index_select
    too) and, on the torch reference, the additive `mask`. Returns a contiguous [B, heads,
    head_dim]."""
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
    if q.is_cuda:
        from kernels import triton_attention as tri

        tri.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return tri.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale).contiguous()
    ref.write_kv(k_cache, v_cache, k, v, slot_mapping)
    kernel = _cpu_kernel()
    if kernel is not None:
        b = q.shape[0]
        cu = torch.arange(b + 1, dtype=torch.int32)
        return kernel.paged_attention(
            q.contiguous(), k_cache, v_cache, block_tables, cu, context_lens, scale
        ).contiguous()
    return ref.paged_decode_attention(q, k_cache, v_cache, block_tables, mask, scale).contiguous()


@decode_attention.register_fake
def _(q, k, v, kv_cache, layer, slot_mapping, block_tables, context_lens, mask, scale):
    return q.new_empty(q.shape)
