"""Helpers of runtime/llm/model.py's decoder, kept apart to hold that file's size: the C++ CPU
and Triton attention paths of one layer (model._attention picks one per AttentionMetadata)."""

from __future__ import annotations

import torch

# `meta` below is model.AttentionMetadata, not imported here: model imports this module.


def attention_cpp(q, k, v, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    """The C++ CPU kernel (kernels/cpu_attention.py): blocks read in place; decodes in one call,
    the prefill chunks in another, on the Triton path's metadata."""
    from kernels import cpu_attention as cpp

    cpp.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    nd = meta.num_decodes
    parts = []
    if nd:
        cu = meta.decode_cu_q_lens
        parts.append(
            cpp.paged_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables, cu, meta.decode_context_lens, scale)
        )
    if meta.prefills:
        parts.append(
            cpp.paged_attention(
                q[nd:],
                k_cache,
                v_cache,
                meta.prefill_block_tables,
                meta.prefill_cu_q_lens,
                meta.prefill_context_lens,
                scale,
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def attention_triton(q, k, v, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    from kernels import triton_attention as tri

    tri.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    nd = meta.num_decodes
    if nd and not meta.prefills:
        return tri.paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
        )
    out = torch.empty_like(q)
    if nd:
        out[:nd] = tri.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
        )
    out[nd:] = tri.paged_prefill_attention(
        q[nd:],
        k_cache,
        v_cache,
        meta.prefill_block_tables,
        meta.prefill_cu_q_lens,
        meta.prefill_context_lens,
        scale,
        max_q_len=meta.prefill_max_q_len,
    )
    return out
