"""The ops a captured decode step calls opaquely: `tandem::decode_attention` (one layer's K/V
write and decode attention) and `tandem::linear` (a linear layer as the eager path holds it).

torch.compile traces the decode step (runtime/llm/compiled.py) into one graph over all layers
only if nothing in it breaks the trace. Paged attention indexes a cache by block tables and
writes it in place, which the compiler should neither trace nor reorder, so it enters the
graph as an opaque custom op (torch.library) with a fake (shape-only) implementation.

Why one op for the write and the read, over the runner's whole cache tensor rather than one
layer's views: a graph that mutates a view of one of its inputs is functionalised into a copy
of the base; mutating the input itself is what inductor re-does in place. The generated code
then passes the cache straight through, with no copy of it (checked in its output code).

`tandem::linear` runs a PackedLinear by handle. Its weight stays as eager holds it (oneDNN's
packed layout, or 4-bit), which the graph could not take as a tensor: inductor's own freezing
would pack a second copy, and only for static batch sizes; with the batch dynamic it falls
back to unpacked matmuls 2-4x slower than oneDNN's. So the graph fuses everything between the
matmuls, and the matmuls are eager's fastest, with one copy of the weights.

Inside, the attention op runs the same kernels the eager path runs: the in-place C++ kernel
(kernels/cpu_attention.py) where it built, else the torch reference (gather + SDPA); on CUDA
the Triton kernel.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from kernels import paged_attention as ref

# handle -> linear module; weak, so that a released model's layers are not kept alive here.
_LINEARS: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


def register_linear(module: torch.nn.Module) -> int:
    """A handle for `module` (a PackedLinear) that tandem::linear calls it by."""
    handle = next(_HANDLES)
    _LINEARS[handle] = module
    return handle


@torch.library.custom_op("tandem::linear", mutates_args=())
def linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """The registered linear layer `handle` applied to x [rows, in_features]."""
    return _LINEARS[handle](x)


@linear.register_fake
def _(x, handle):
    return x.new_empty((x.shape[0], _LINEARS[handle].out_features))


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
    # kernels.cpu_attention's write skips negative slots (the runner's padding rows), on its C++
    # and its torch path alike, so the pad block stays zero.
    from kernels import cpu_attention

    cpu_attention.write_kv(k_cache, v_cache, k, v, slot_mapping)
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
