"""Argument checks of the attention wrappers, on the host before a launch: ValueError naming the
argument and what is allowed. Shapes, dtypes and devices only: checking values (context
lengths, block ids) would sync with the GPU.

kernels/triton_attention.py calls these for every kernel. The C++ CPU op
(kernels/cpu_attention.py) checks its arguments in C++ instead (cpu_attention.cpp, RuntimeError):
it also checks values, since it runs on the host anyway, and takes any head_dim.
"""

from __future__ import annotations

import math

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype {allowed}; got {str(t.dtype).removeprefix('torch.')}")


def check_device(allow_cpu: bool, **tensors: torch.Tensor) -> None:
    """One device for all, a CUDA one unless `allow_cpu` (Triton's interpreter)."""
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        where = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    (device,) = devices
    if device.type != "cuda" and not allow_cpu:
        raise ValueError(f"tensors must be on a CUDA device (or set TRITON_INTERPRET=1 to run on CPU), got {device}")


def check_cache(k_cache, v_cache) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, head_dim) of a KV cache pair."""
    check_tensor("k_cache", k_cache, 4, DTYPES)
    check_tensor("v_cache", v_cache, 4, DTYPES)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or v_cache.stride() != k_cache.stride():
        raise ValueError(
            f"v_cache must match k_cache in shape, dtype and strides, got {tuple(v_cache.shape)} {v_cache.dtype} "
            f"and {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    _, bs, nkv, hd = k_cache.shape
    if hd < 16 or hd > 256 or hd & (hd - 1):
        raise ValueError(f"head_dim (k_cache.shape[3]) must be a power of two in [16, 256], got {hd}")
    return bs, nkv, hd


def check_q(q, k_cache, nkv: int, hd: int) -> tuple[int, int]:
    """(number of query rows, num_heads) of q against the cache."""
    check_tensor("q", q, 3, DTYPES)
    n, nh, qhd = q.shape
    if qhd != hd:
        raise ValueError(f"q.shape[2] (head_dim) must equal k_cache.shape[3] = {hd}, got {qhd}")
    if nh % nkv:
        raise ValueError(f"q.shape[1] (num_heads) must be a multiple of num_kv_heads = {nkv}, got {nh}")
    if k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache dtype must equal q dtype {q.dtype}, got {k_cache.dtype}")
    return n, nh


def check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    return float(scale)


def check_out(out, q) -> torch.Tensor:
    """`out`, or a new tensor like q when it is None."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be a tensor of q's shape {tuple(q.shape)}, dtype {q.dtype} and device {q.device}")
    return out
