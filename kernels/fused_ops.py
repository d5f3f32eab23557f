"""RMSNorm, and the pre-norm transformer's residual add fused with the next norm, as custom ops.

    rms_norm(x, weight, eps) -> y                               y = x / rms(x) * weight
    add_rms_norm(x, residual, weight, eps) -> (y, new_residual) new_residual = x + residual,
                                                                 y = rms_norm(new_residual)

x (and residual) [T, H] float32 or bfloat16; weight [H] in x's dtype or float32. The norm is
computed in float32 and rounded once to x's dtype, as F.rms_norm does; new_residual is the sum
in x's dtype (what `x + residual` gives), and y is the norm of that rounded sum. Both ops are
functional (new tensors out, inputs untouched), so torch.compile(fullgraph=True) traces them as
opaque calls (tandem::rms_norm, tandem::add_rms_norm) with fake implementations.

Why: a one-sequence decode step of SmolLM2 runs 61 norms; ATen's rms_norm on CPU is six
dispatches (pow, mean, add, rsqrt, mul, casts), ~30 us a call, ~1.8 ms of an ~11 ms step; the
C++ kernel (kernels/fused_ops.cpp) does a [1, 576] row in about a microsecond, and folds the
residual add before it in.

The torch path below (the current formulas) is the fallback, the oracle of the tests, and what
devices other than the CPU run. In float32 the C++ kernel gives F.rms_norm's bits exactly: it
reproduces ATen's summation order (see the .cpp). The C++ library is built on first use as
kernels/cpp_build.py describes (cached; its CPU kernels then take the ops' CPU dispatch);
TANDEM_FUSED_OPS, read until the library is loaded, picks the path: "auto" (default: C++
when it builds), "cpp" (C++ or raise) or "torch" (never build).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import cpp_build

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
