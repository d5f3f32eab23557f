"""The decode step's small ops as custom ops: RMSNorm, the residual add fused with the next norm,
SiLU(gate) * up, and RoPE (alone, or with the K/V write into the paged cache).

    rms_norm(x, weight, eps) -> y                               y = x / rms(x) * weight
    add_rms_norm(x, residual, weight, eps) -> (y, new_residual) new_residual = x + residual,
                                                                 y = rms_norm(new_residual)
    silu_mul(gate_up) -> y                                      y = silu(gate) * up, gate_up [T, 2 I]
                                                                 = [gate | up], y [T, I]
    rope(qkv, cos, sin, num_heads, num_kv_heads) -> qk          the q and k heads of qkv rotated,
                                                                 [T, num_heads + num_kv_heads, hd]
    rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads) -> q
                                                                q [T, num_heads, hd] rotated; k
                                                                 (rotated) and v to the cache

x (and residual) [T, H] float32 or bfloat16; weight [H] in x's dtype or float32. The norm is
computed in float32 and rounded once to x's dtype, as F.rms_norm does; new_residual is the sum
in x's dtype (what `x + residual` gives), and y is the norm of that rounded sum. qkv is the fused
projection's output [T, (num_heads + 2 num_kv_heads) * hd] (q heads, k heads, v heads); cos, sin
[T, hd / 2] the half-width tables at each token's position, in qkv's dtype (Hugging Face's
rotate_half convention). The caches are one layer's [num_blocks, block_size, num_kv_heads, hd]
(kernels/cpu_attention.py's layout); token t goes to row slot_mapping[t] (int32 or int64) of
the flattened caches, or nowhere where that is negative. rope_write_kv mutates the caches; the
other ops are functional (new tensors out, inputs untouched). torch.compile(fullgraph=True)
traces them all as opaque calls (tandem::*), with fake implementations.

Why: a one-sequence decode step of SmolLM2 runs 61 norms; ATen's rms_norm on CPU is six
dispatches (pow, mean, add, rsqrt, mul, casts), ~30 us a call, ~1.8 ms of an ~11 ms step; the
C++ kernel (kernels/fused_ops.cpp) does a [1, 576] row in about a microsecond, and folds the
residual add before it in. After the norms, a profile of the step named RoPE (slices, four muls,
a sub, an add and a cat a layer) and the MLP's silu and mul as the next small ops: one C++ call
each, and RoPE writes K/V into the cache in the same pass (the C++ attention path).

The torch path below (the current formulas) is the fallback, the oracle of the tests, and what
devices other than the CPU run. In float32 the C++ kernels give the torch path's bits exactly:
the norm reproduces ATen's summation order, SiLU's exp is ATen's (Sleef's vectorized exp, and
std::exp for a row's last values, where ATen's loop takes them one by one), RoPE rounds each
product as torch does (see the .cpp). bfloat16: the norm rounds once; silu_mul and RoPE round
where torch's bfloat16 ops round, so they too give the torch path's bits. The C++ library is
built on first use as kernels/cpp_build.py describes (cached; its CPU kernels then take the
ops' CPU dispatch); TANDEM_FUSED_OPS, read until the library is loaded, picks the path: "auto"
(default: C++ when it builds), "cpp" (C++ or raise) or "torch" (never build).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import cpp_build
from kernels.paged_attention import write_kv_padded

LIBRARY = cpp_build.Library(
    "tandem_fused_ops",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "fused_ops.cpp"),
    "TANDEM_FUSED_OPS",
    "kernels.fused_ops",
)
available = LIBRARY.available
build_info = LIBRARY.build_info

_DTYPES = (torch.float32, torch.bfloat16)


def _check(op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{op}: x must have 2 dimensions [T, H], got shape {list(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{op}: x must have dtype float32 or bfloat16, got {x.dtype}")
    h = x.shape[1]
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual must have x's shape {list(x.shape)}, got {list(residual.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual must have x's dtype {x.dtype}, got {residual.dtype}")
        if residual.device != x.device:
            raise ValueError(f"{op}: residual must be on x's device {x.device}, got {residual.device}")
    if weight.dim() != 1 or weight.shape[0] != h:
        raise ValueError(f"{op}: weight must have shape [H] = [{h}], got {list(weight.shape)}")
    if weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"{op}: weight must have x's dtype or float32, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{op}: weight must be on x's device {x.device}, got {weight.device}")


def _check_dtype(op: str, name: str, x: torch.Tensor) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"{op}: {name} must have dtype float32 or bfloat16, got {x.dtype}")


def _check_silu_mul(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up must have 2 dimensions [T, 2 * I], got shape {list(gate_up.shape)}")
    _check_dtype("silu_mul", "gate_up", gate_up)


def _check_rope(
    op: str, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int, exact: bool
) -> int:
    """The rope ops' checks; returns head_dim (twice the tables' width)."""
    if qkv.dim() != 2:
        raise ValueError(f"{op}: qkv must have 2 dimensions [T, heads * head_dim], got shape {list(qkv.shape)}")
    _check_dtype(op, "qkv", qkv)
    t = qkv.shape[0]
    if cos.dim() != 2 or cos.shape[0] != t or cos.shape[1] == 0 or sin.shape != cos.shape:
        raise ValueError(
            f"{op}: cos and sin must be [T, head_dim / 2] with T = {t}, got {list(cos.shape)} and {list(sin.shape)}"
        )
    if cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        raise ValueError(f"{op}: cos and sin must have qkv's dtype {qkv.dtype}, got {cos.dtype} and {sin.dtype}")
    if cos.device != qkv.device or sin.device != qkv.device:
        raise ValueError(f"{op}: cos and sin must be on qkv's device {qkv.device}")
    if nh <= 0 or nkv <= 0:
        raise ValueError(f"{op}: num_heads and num_kv_heads must be > 0, got {nh} and {nkv}")
    hd = 2 * cos.shape[1]
    need = (nh + 2 * nkv) * hd if exact else (nh + nkv) * hd
    if qkv.shape[1] < need or (exact and qkv.shape[1] != need):
        what = (
            "(num_heads + 2 * num_kv_heads) * head_dim" if exact else "at least (num_heads + num_kv_heads) * head_dim"
        )
        raise ValueError(f"{op}: qkv must have {what} = {need} columns, got {qkv.shape[1]}")
    return hd


def _check_rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, nh) -> int:
    op = "rope_write_kv"
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"{op}: k_cache and v_cache must be one shape [num_blocks, block_size, num_kv_heads, head_dim] and "
            f"dtype, got {list(k_cache.shape)} {k_cache.dtype} and {list(v_cache.shape)} {v_cache.dtype}"
        )
    hd = _check_rope(op, qkv, cos, sin, nh, k_cache.shape[2], exact=True)
    if k_cache.shape[3] != hd:
        raise ValueError(f"{op}: the caches' head_dim {k_cache.shape[3]} must be twice cos' width {cos.shape[1]}")
    if k_cache.dtype != qkv.dtype:
        raise ValueError(f"{op}: the caches must have qkv's dtype {qkv.dtype}, got {k_cache.dtype}")
    if slot_mapping.shape != (qkv.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{op}: slot_mapping must be int32 or int64 [T] with T = {qkv.shape[0]}, "
            f"got {slot_mapping.dtype} {list(slot_mapping.shape)}"
        )
    return hd


# ---------------------------------------------------------------------------------------------
# torch path: the fallback, the oracle of the C++ kernel, and what other devices run


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check("rms_norm", x, None, weight)
    if weight.dtype != x.dtype:  # F.rms_norm wants one dtype; float32 math either way
        return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _check("add_rms_norm", x, residual, weight)
    new_residual = x + residual
    return rms_norm_torch(new_residual, weight, eps), new_residual


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    _check_silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_torch(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> torch.Tensor:
    # Same products and sums as HF's q * cos + rotate_half(q) * sin, so the same bits; the
    # tables are half width (HF's cos/sin repeat the same values in both halves).
    hd = _check_rope("rope", qkv, cos, sin, num_heads, num_kv_heads, exact=False)
    x = qkv[:, : (num_heads + num_kv_heads) * hd].view(qkv.shape[0], num_heads + num_kv_heads, hd)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_write_kv_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    hd = _check_rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
    nkv = k_cache.shape[2]
    qk = rope_torch(qkv, cos, sin, num_heads, nkv)
    v = qkv[:, (num_heads + nkv) * hd :].view(qkv.shape[0], nkv, hd)
    write_kv_padded(k_cache, v_cache, qk[:, num_heads:], v, slot_mapping)
    return qk[:, :num_heads].contiguous()


# ---------------------------------------------------------------------------------------------
# the custom ops


@torch.library.custom_op("tandem::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y [T, H] = x / sqrt(mean(x**2, -1) + eps) * weight, in float32, rounded once to x's dtype."""
    if LIBRARY.use_cpp(x, weight):
        return torch.ops.tandem_fused.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    _check("rms_norm", x, None, weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("tandem::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum in x's dtype: the residual add of a
    pre-norm block and the next block's norm, in one pass."""
    if LIBRARY.use_cpp(x, residual, weight):
        return torch.ops.tandem_fused.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    _check("add_rms_norm", x, residual, weight)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(x, memory_format=torch.contiguous_format),
    )


@torch.library.custom_op("tandem::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up of the fused gate_up projection's output [T, 2 I] = [gate | up]: [T, I]."""
    if LIBRARY.use_cpp(gate_up):
        return torch.ops.tandem_fused.silu_mul(gate_up)
    return silu_mul_torch(gate_up)


@silu_mul.register_fake
def _(gate_up):
    _check_silu_mul(gate_up)
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.custom_op("tandem::rope", mutates_args=())
def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The q and k heads of qkv [T, >= (num_heads + num_kv_heads) * hd], rotated by the tables
    cos, sin [T, hd / 2]: a new [T, num_heads + num_kv_heads, hd] (q heads first)."""
    if LIBRARY.use_cpp(qkv, cos, sin):
        return torch.ops.tandem_fused.rope(qkv, cos, sin, num_heads, num_kv_heads)
    return rope_torch(qkv, cos, sin, num_heads, num_kv_heads)


@rope.register_fake
def _(qkv, cos, sin, num_heads, num_kv_heads):
    hd = _check_rope("rope", qkv, cos, sin, num_heads, num_kv_heads, exact=False)
    return qkv.new_empty((qkv.shape[0], num_heads + num_kv_heads, hd))


@torch.library.custom_op("tandem::rope_write_kv", mutates_args=("k_cache", "v_cache"))
def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """rope, then k (rotated) and v of each token to row slot_mapping[t] of the flattened caches
    (skipped where negative), as kernels/cpu_attention.write_kv would store them; returns the
    rotated q heads, a new [T, num_heads, hd]. qkv must be exactly the q, k and v heads."""
    if LIBRARY.use_cpp(qkv, cos, sin, k_cache, v_cache, slot_mapping):
        return torch.ops.tandem_fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
    return rope_write_kv_torch(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads)


@rope_write_kv.register_fake
def _(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads):
    hd = _check_rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
    return qkv.new_empty((qkv.shape[0], num_heads, hd))


def rope_write_kv_eager(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """rope_write_kv for eager callers: the C++ kernel called by its library's name when it is
    in use. Why: the custom op mutates the caches, and for such an op torch.library runs a
    Python kernel (ADInplaceOrView, the version counters) whenever a cache was made outside
    inference mode, as the runner's is: 7.4 us a call against 3.1 us (SmolLM2, one token).
    A traced graph must see the custom op (its mutation declared): call rope_write_kv there."""
    if LIBRARY.use_cpp(qkv):  # the C++ op checks the other tensors' devices
        return torch.ops.tandem_fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
    return rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
