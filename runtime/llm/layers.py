"""Helpers of runtime/llm/model.py's decoder, kept apart to hold that file's size: RoPE and the
MLP's activation (kernels/fused_ops.py's C++ ops on CPU, their torch formulas elsewhere), and
the C++ CPU and Triton attention paths of one layer (model.DecoderLayer picks one per
AttentionMetadata)."""

from __future__ import annotations

import torch

from kernels import fused_ops

# `meta` below is model.AttentionMetadata, not imported here: model imports this module.
# The fused ops are reached through the module's attributes (a test points them at their
# torch versions). Off the CPU they would run their Python fallback and hide the math from a
# GPU graph's fusion: there the torch formulas are called directly.


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int):
    """(q, k, v) of the fused projection's output [T, (nh + 2 nkv) * hd], q and k rotated by
    the tables cos, sin [T, hd / 2] (HF's rotate_half convention, the same bits)."""
    t, hd = qkv.shape[0], 2 * cos.shape[-1]
    op = fused_ops.rope if qkv.device.type == "cpu" else fused_ops.rope_torch
    qk = op(qkv, cos, sin, num_heads, num_kv_heads)
    v = qkv[:, (num_heads + num_kv_heads) * hd :].view(t, num_kv_heads, hd)
    return qk[:, :num_heads], qk[:, num_heads:], v


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """HF's act_fn(gate) * up of the fused gate_up projection's output."""
    if gate_up.device.type != "cpu":
        return fused_ops.silu_mul_torch(gate_up)
    return fused_ops.silu_mul(gate_up)


def attention_cpp(qkv, cos, sin, k_cache, v_cache, meta, num_heads: int, scale: float) -> torch.Tensor:
    """The C++ CPU kernel (kernels/cpu_attention.py): blocks read in place; decodes in one call,
    the prefill chunks in another, on the Triton path's metadata. RoPE and the K/V write are
    one pass before it (fused_ops.rope_write_kv)."""
    from kernels import cpu_attention as cpp

    q = fused_ops.rope_write_kv_eager(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, num_heads)
    nd = meta.num_decodes
    parts = []
    if nd:
        cu = meta.decode_cu_q_lens
        qd = q if nd == q.shape[0] else q[:nd]
        parts.append(
            cpp.paged_attention(qd, k_cache, v_cache, meta.decode_block_tables, cu, meta.decode_context_lens, scale)
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
