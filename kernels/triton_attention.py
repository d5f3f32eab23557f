"""Paged attention in Triton: the CUDA path. Each kernel has a pure-torch reference beside it.

Layout, as in kernels/paged_attention.py: one layer's KV cache is a pair of tensors
[num_blocks, block_size, num_kv_heads, head_dim]; the token at position p of a sequence with
block table `bt` lives in block `bt[p // block_size]` at offset `p % block_size`. Query head h reads
KV head h // g, g = num_heads // num_kv_heads (Hugging Face's repeat_kv).

    write_kv                 k, v [T, nkv, hd] -> cache rows slot_mapping [T]; slot < 0 skips
    paged_decode_attention   one query per sequence, [B, nh, hd]
    paged_prefill_attention  a varlen batch of causal prefill chunks, [total_q, nh, hd], one launch

Design, and why:

* The attention kernels read K/V where they lie in the cache, one tile of BLOCK_N positions
  at a time, each position's page looked up in the block table: no gather of whole contexts into
  a contiguous copy (that copy is the CPU path's main cost), and the tile size is independent of
  the cache's block_size, so any block_size works, 8, 16 and 32 included.
* One program per (sequence or query tile, KV head) computes every query head of that KV
  head's group: each K/V tile is loaded once for the g heads that share it, g times less traffic
  than one program per query head. The g heads (times the query tile for prefill) are the rows of
  one tl.dot; tl.dot wants at least 16 rows, so decode pads g to a power of two >= 16 (the padded
  rows load zeros and are never stored; decode is bound by reading K/V, not by the MMA).
* Online softmax (FlashAttention): running max m, running sum l, float32 accumulator, rescaled
  by exp2(m_old - m_new) when the max grows. exp2 with the scale folded in as scale*log2(e) saves
  a multiply per score and is what the hardware computes anyway.
* Every position at or past a sequence's context, and every block-table entry past its last
  block, is masked at load time, so it is never read: stale K/V of other requests (even NaN or
  inf) and junk in the padding of block tables cannot reach the result. The CPU path instead
  points padding at a zeroed slot; the kernels need no such slot.
* Accumulation is float32 whatever the input dtype; float32 inputs use tl.dot's "ieee"
  precision, since the default on NVIDIA is TF32 (10-bit mantissa, ~1e-3 error). For float16 and
  bfloat16, P is cast to V's dtype before P @ V, as FlashAttention does, to use the tensor cores.
* Cache offsets are computed in int64: num_blocks * block_size * nkv * hd can pass 2**31.
* Nothing is synchronised with the host (except prefill when max_q_len is not given), so
  decode can be captured in a CUDA graph; pass `out=` to keep its address fixed.

Triton is imported, and the kernels are defined, on the first call, not at import: the module
imports where triton is missing (CI imports everything). TRITON_INTERPRET=1 (the CPU
interpreter the tests use) must be set before triton is first imported: @triton.jit reads it
when it decorates, and triton.language decorates its own helpers (tl.zeros, tl.sum, ...) at
import (tests/conftest.py sets it). The kernels are cached per interpreter setting. Under the
interpreter only, bfloat16 tl.dot operands are upcast to float32 (UPCAST): triton 3.8's
interpreter multiplies bfloat16's raw uint16 storage. The GPU's bfloat16 MMA path is therefore
exercised by benchmarks/gpu_kernels.py, not by the CPU tests.

Requirements checked by the wrappers (kernels/checks.py: ValueError naming the argument
otherwise): dtypes float32, float16, bfloat16 (cache dtype = q dtype); head_dim a power of two
in [16, 256] (tl.arange needs a power of two and tl.dot at least 16); num_heads a multiple of
num_kv_heads; CUDA tensors (or CPU ones under TRITON_INTERPRET=1), all on one device. Values
are not checked (that would sync with the host): context_lens[b] <= block_tables.shape[1] *
block_size and block ids in range are the caller's to keep.
"""

from __future__ import annotations

import os

import torch

from kernels.checks import INT_DTYPES, check_cache, check_device, check_out, check_q, check_scale, check_tensor
from kernels.paged_attention import write_kv_padded

write_kv_ref = write_kv_padded  # write_kv in torch (the C++ op's torch path too), the reference

_LOG2E = 1.4426950408889634

_kernel_cache: dict[bool, object] = {}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernels():
    """The jitted kernels, defined on first use (see the module docstring)."""
    interpret = _interpret()
    if interpret in _kernel_cache:
        return _kernel_cache[interpret]
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # pragma: no cover - CI without triton only imports this module
        raise RuntimeError(
            "kernels.triton_attention needs the `triton` package (it ships with torch's CUDA wheels); "
            "use kernels.paged_attention (pure torch) instead"
        ) from e

    @triton.jit
    def write_kv_kernel(
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        slot_ptr,
        stride_kt,
        stride_kh,
        stride_kd,
        stride_vt,
        stride_vh,
        stride_vd,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_cd,
        NKV: tl.constexpr,
        NKV_P: tl.constexpr,
        HD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        # One program per token: all its heads at once ([NKV_P, HD], padded to a power of two).
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        h = tl.arange(0, NKV_P)
        d = tl.arange(0, HD)
        # A negative slot (a padding token, as in vLLM's reshape_and_cache) stores nothing; the
        # mask, unlike an early return, keeps the program a single straight-line block.
        mask = (h[:, None] < NKV) & (slot >= 0)
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
        # Both caches have k_cache's strides (checked by the wrapper).
        base = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        off = base + h[:, None] * stride_ch + d[None, :] * stride_cd
        tl.store(kc_ptr + off, k, mask=mask)
        tl.store(vc_ptr + off, v, mask=mask)

    @triton.jit
    def attend(
        q,
        kc_ptr,
        vc_ptr,
        bt_row,
        kv_head,
        kv_end,
        qpos,
        qk_scale,
        stride_cb,
        stride_cs,
        stride_cd,
        stride_btn,
        ROWS: tl.constexpr,
        HD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # The online-softmax tile loop both attention kernels run (inlined into each): the ROWS
        # query rows of q over one sequence's K/V positions [0, kv_end), read in place through
        # its block-table row. CAUSAL hides keys past each row's position qpos; decode's one
        # query sees its whole context, so it compiles without the compare.
        if UPCAST:
            # Only under the interpreter, whose tl.dot multiplies bfloat16's raw uint16 storage
            # (triton 3.8): the operands go to float32, where bfloat16 products are exact.
            q = q.to(tl.float32)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HD], tl.float32)
        d = tl.arange(0, HD)
        n_off = tl.arange(0, BLOCK_N)
        for start in range(0, kv_end, BLOCK_N):
            n = start + n_off
            n_ok = n < kv_end
            blk = tl.load(bt_row + (n // BLOCK_SIZE) * stride_btn, mask=n_ok, other=0).to(tl.int64)
            row = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head
            # K loaded transposed, [HD, BLOCK_N], so q @ kT is a plain tl.dot.
            kT = tl.load(kc_ptr + row[None, :] + d[:, None] * stride_cd, mask=n_ok[None, :], other=0.0)
            if UPCAST:
                kT = kT.to(tl.float32)
            s = tl.dot(q, kT, input_precision=DOT_PREC) * qk_scale
            # Every tile has a valid position, and key 0 is visible to every row (qpos >= 0), so
            # the first tile makes every m_i finite and later fully masked rows add exp2(-inf) = 0.
            if CAUSAL:
                s = tl.where((n[None, :] <= qpos[:, None]) & n_ok[None, :], s, float("-inf"))
            else:
                s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vc_ptr + row[:, None] + d[None, :] * stride_cd, mask=n_ok[:, None], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            # P in the cache's dtype, as FlashAttention does, for the 16-bit tensor cores.
            pv = p.to(vc_ptr.dtype.element_ty).to(v.dtype)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PREC)
            m_i = m_new
        # An empty context (not a decode the engine makes) gives zeros rather than 0/0.
        return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]

    if interpret:
        # The interpreter runs a kernel's source again with this module's globals and without
        # its closure (it puts tl there itself), so the helper the kernels call goes there too.
        # A compiled kernel reads its closure first, so it never sees this one.
        globals()["attend"] = attend

    @triton.jit
    def decode_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        bt_ptr,
        ctx_ptr,
        out_ptr,
        qk_scale,
        stride_qb,
        stride_qh,
        stride_qd,
        stride_ob,
        stride_oh,
        stride_od,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_cd,
        stride_btb,
        stride_btn,
        G: tl.constexpr,
        G_P: tl.constexpr,
        HD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        ctx = tl.load(ctx_ptr + b)
        g = tl.arange(0, G_P)
        d = tl.arange(0, HD)
        head = kvh * G + g
        g_ok = g < G
        q = tl.load(
            q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd, mask=g_ok[:, None], other=0.0
        )
        acc = attend(
            q,
            kc_ptr,
            vc_ptr,
            bt_ptr + b * stride_btb,
            kvh * stride_ch,
            ctx,
            0,  # qpos: decode is not CAUSAL (its one query sees its whole context)
            qk_scale,
            stride_cb,
            stride_cs,
            stride_cd,
            stride_btn,
            ROWS=G_P,
            HD=HD,
            BLOCK_SIZE=BLOCK_SIZE,
            BLOCK_N=BLOCK_N,
            CAUSAL=False,
            DOT_PREC=DOT_PREC,
            UPCAST=UPCAST,
        )
        tl.store(
            out_ptr + b * stride_ob + head[:, None] * stride_oh + d[None, :] * stride_od,
            acc.to(out_ptr.dtype.element_ty),
            mask=g_ok[:, None],
        )

    @triton.jit
    def prefill_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        bt_ptr,
        cu_ptr,
        ctx_ptr,
        out_ptr,
        qk_scale,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_cd,
        stride_btb,
        stride_btn,
        G: tl.constexpr,
        HD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # Grid (query tile, chunk, KV head). A tile is BLOCK_Q query positions of one chunk times
        # the G query heads of the KV head: row r is position r // G, head r % G, so each K/V
        # tile loaded serves the whole group. Tiles past a chunk's end exit at once (the grid
        # is sized by the longest chunk).
        tile = tl.program_id(0)
        i = tl.program_id(1)
        kvh = tl.program_id(2)
        q_begin = tl.load(cu_ptr + i)
        q_len = tl.load(cu_ptr + i + 1) - q_begin
        if tile * BLOCK_Q >= q_len:
            return
        ctx = tl.load(ctx_ptr + i)
        first_pos = ctx - q_len  # position of the chunk's first query; K/V [0, ctx) are cached

        r = tl.arange(0, BLOCK_M)
        qi = tile * BLOCK_Q + r // G  # query index within the chunk
        head = kvh * G + r % G
        r_ok = (r < BLOCK_Q * G) & (qi < q_len)
        qpos = first_pos + qi
        d = tl.arange(0, HD)
        q = tl.load(
            q_ptr + (q_begin + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=r_ok[:, None],
            other=0.0,
        )
        # Causal: no key past the tile's last query is needed, so the loop stops there.
        kv_end = tl.minimum(first_pos + (tile + 1) * BLOCK_Q, ctx)
        acc = attend(
            q,
            kc_ptr,
            vc_ptr,
            bt_ptr + i * stride_btb,
            kvh * stride_ch,
            kv_end,
            qpos,
            qk_scale,
            stride_cb,
            stride_cs,
            stride_cd,
            stride_btn,
            ROWS=BLOCK_M,
            HD=HD,
            BLOCK_SIZE=BLOCK_SIZE,
            BLOCK_N=BLOCK_N,
            CAUSAL=True,
            DOT_PREC=DOT_PREC,
            UPCAST=UPCAST,
        )
        tl.store(
            out_ptr + (q_begin + qi)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
            acc.to(out_ptr.dtype.element_ty),
            mask=r_ok[:, None],
        )

    kernels = (write_kv_kernel, decode_kernel, prefill_kernel)
    _kernel_cache[interpret] = kernels
    return kernels


def _dot_precision(dtype: torch.dtype) -> str:
    # "tf32" is the default, and tl.dot ignores it for 16-bit operands.
    return "ieee" if dtype == torch.float32 or _upcast_dot(dtype) else "tf32"


def _upcast_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and _interpret()


# Launch configurations. Chosen from ptxas' register counts for sm_90 (triton 3.8, compiled
# ahead of time without a GPU): the largest tiles that neither spill nor fall below two resident
# programs per SM; not yet tuned by timing (benchmarks/gpu_kernels.py sweeps the decode ones). float32
# runs tl.dot as exact FMAs ("ieee"), which needs far more registers, hence its small tiles.


def decode_config(head_dim: int, dtype: torch.dtype) -> dict:
    """BLOCK_N (positions per K/V tile), num_warps, num_stages of the decode kernel."""
    if dtype == torch.float32 or head_dim > 128:
        return dict(BLOCK_N=16, num_warps=4, num_stages=2)
    return dict(BLOCK_N=64 if head_dim <= 64 else 32, num_warps=4, num_stages=2)


def prefill_config(head_dim: int, dtype: torch.dtype) -> dict:
    """BLOCK_M (score rows: query positions x grouped heads), BLOCK_N, num_warps, num_stages of
    the prefill kernel."""
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2)
    if head_dim > 128:
        return dict(BLOCK_M=64, BLOCK_N=16, num_warps=8, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=64 if head_dim <= 64 else 32, num_warps=8, num_stages=2)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---------------------------------------------------------------------------------------------
# write_kv


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v [num_tokens, num_kv_heads, head_dim] at rows `slot_mapping` [num_tokens]
    (int32 or int64) of the flattened caches; a negative slot is skipped."""
    bs, nkv, hd = check_cache(k_cache, v_cache)
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 3, (k_cache.dtype,))
        if tuple(t.shape[1:]) != (nkv, hd):
            raise ValueError(
                f"{name} must have shape [num_tokens, {nkv}, {hd}] (the cache's heads), got {tuple(t.shape)}"
            )
    check_tensor("slot_mapping", slot_mapping, 1, INT_DTYPES)
    if v.shape[0] != k.shape[0] or slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"k, v and slot_mapping must have the same number of tokens, got {k.shape[0]}, {v.shape[0]}, {slot_mapping.shape[0]}"
        )
    check_device(_interpret(), k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping)
    if k.shape[0] == 0:
        return
    kernel = _kernels()[0]
    # The 1-D index vectors are read with unit stride; .contiguous() is free when they are.
    slot_mapping = slot_mapping.contiguous()
    kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        NKV=nkv,
        NKV_P=_next_pow2(nkv),
        HD=hd,
        BLOCK_SIZE=bs,
    )


# ---------------------------------------------------------------------------------------------
# decode


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, num_heads, head_dim]: sequence b's query at position context_lens[b] - 1, its own
    K/V already written. block_tables [B, max_blocks], context_lens [B] (int32 or int64; int32
    is the one to use on the GPU: int64 indices cost registers).
    Returns [B, num_heads, head_dim] in q's dtype (into `out` when given)."""
    bs, nkv, hd = check_cache(k_cache, v_cache)
    b, nh = check_q(q, k_cache, nkv, hd)
    check_tensor("block_tables", block_tables, 2, INT_DTYPES)
    check_tensor("context_lens", context_lens, 1, INT_DTYPES)
    if block_tables.shape[0] != b or context_lens.shape[0] != b:
        raise ValueError(
            f"block_tables and context_lens must have one row per query (q.shape[0] = {b}), "
            f"got {block_tables.shape[0]} and {context_lens.shape[0]}"
        )
    scale = check_scale(scale)
    check_device(
        _interpret(), q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens
    )
    out = check_out(out, q)
    if b == 0:
        return out
    g = nh // nkv
    kernel = _kernels()[1]
    context_lens = context_lens.contiguous()
    kernel[(b, nkv)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        scale * _LOG2E,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *block_tables.stride(),
        G=g,
        G_P=max(16, _next_pow2(g)),
        HD=hd,
        BLOCK_SIZE=bs,
        DOT_PREC=_dot_precision(q.dtype),
        UPCAST=_upcast_dot(q.dtype),
        **decode_config(hd, q.dtype),
    )
    return out


def _gather_positions(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """K or V of positions [0, n) of the sequence with block table `table` -> [n, nkv, hd]."""
    bs, nkv, hd = cache.shape[1:]
    slots = (table[: -(-n // bs)].long().unsqueeze(-1) * bs + torch.arange(bs, device=table.device)).flatten()[:n]
    return cache.view(-1, nkv, hd)[slots]


def _dense_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    """q [q_len, nh, hd] at positions [first_pos, first_pos + q_len); k, v [kv_len, nkv, hd] for
    positions [0, kv_len). Causal, float32, K/V repeated per query head."""
    g = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(g, 1).transpose(0, 1)  # [nh, kv_len, hd]
    v = v.float().repeat_interleave(g, 1).transpose(0, 1)
    s = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [nh, q_len, kv_len]
    qpos = torch.arange(first_pos, first_pos + q.shape[0], device=q.device).unsqueeze(1)
    s = s.masked_fill(torch.arange(k.shape[1], device=q.device) > qpos, float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1).to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """paged_decode_attention in torch: per sequence, gather its context, dense float32 softmax."""
    out = torch.empty_like(q)
    for b, n in enumerate(context_lens.tolist()):
        k, v = _gather_positions(k_cache, block_tables[b], n), _gather_positions(v_cache, block_tables[b], n)
        out[b] = _dense_ref(q[b : b + 1], k, v, n - 1, scale)[0]
    return out


# ---------------------------------------------------------------------------------------------
# prefill


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A varlen batch of prefill chunks in one launch. q [total_q, num_heads, head_dim]; chunk i
    owns rows cu_q_lens[i]:cu_q_lens[i+1] (cu_q_lens [num_chunks + 1], starting at 0), its
    queries at positions [context_lens[i] - q_len_i, context_lens[i]) of its sequence, attending
    causally to K/V of positions [0, context_lens[i]), read through block_tables[i] (the chunk's
    own K/V written first). `max_q_len` (the longest chunk) sizes the grid; without it, it is
    read from cu_q_lens, a host sync. Returns [total_q, num_heads, head_dim] in q's dtype."""
    bs, nkv, hd = check_cache(k_cache, v_cache)
    total_q, nh = check_q(q, k_cache, nkv, hd)
    check_tensor("block_tables", block_tables, 2, INT_DTYPES)
    check_tensor("cu_q_lens", cu_q_lens, 1, INT_DTYPES)
    check_tensor("context_lens", context_lens, 1, INT_DTYPES)
    num_chunks = context_lens.shape[0]
    if cu_q_lens.shape[0] != num_chunks + 1 or block_tables.shape[0] != num_chunks:
        raise ValueError(
            f"cu_q_lens must have num_chunks + 1 entries and block_tables num_chunks rows, with num_chunks = "
            f"context_lens.shape[0] = {num_chunks}; got {cu_q_lens.shape[0]} and {block_tables.shape[0]}"
        )
    scale = check_scale(scale)
    check_device(
        _interpret(),
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        cu_q_lens=cu_q_lens,
        context_lens=context_lens,
    )
    out = check_out(out, q)
    if num_chunks == 0 or total_q == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max())
    if isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or max_q_len < 1:
        raise ValueError(f"max_q_len must be an integer >= 1 (the longest chunk), got {max_q_len!r}")
    g = nh // nkv
    config = prefill_config(hd, q.dtype)
    # BLOCK_M rows of the score tile hold BLOCK_M // g query positions; the rows past a multiple
    # of g are padding.
    block_m = max(config.pop("BLOCK_M"), _next_pow2(g))
    block_q = block_m // g
    kernel = _kernels()[2]
    cu_q_lens, context_lens = cu_q_lens.contiguous(), context_lens.contiguous()
    grid = (-(-max_q_len // block_q), num_chunks, nkv)
    kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_q_lens,
        context_lens,
        out,
        scale * _LOG2E,
        *q.stride(),
        *out.stride(),
        *k_cache.stride(),
        *block_tables.stride(),
        G=g,
        HD=hd,
        BLOCK_SIZE=bs,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        DOT_PREC=_dot_precision(q.dtype),
        UPCAST=_upcast_dot(q.dtype),
        **config,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """paged_prefill_attention in torch: per chunk, gather its context, dense causal float32."""
    out = torch.empty_like(q)
    cu = cu_q_lens.tolist()
    for i, n in enumerate(context_lens.tolist()):
        lo, hi = cu[i], cu[i + 1]
        k, v = _gather_positions(k_cache, block_tables[i], n), _gather_positions(v_cache, block_tables[i], n)
        out[lo:hi] = _dense_ref(q[lo:hi], k, v, n - (hi - lo), scale)
    return out
