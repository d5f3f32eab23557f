"""What the hardware computes natively, for the engines' dtype="auto" choices."""

from __future__ import annotations


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bfloat16 natively (AMX or AVX512-BF16), by oneDNN's own check.
    Elsewhere oneDNN emulates it, slower than float32."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return check is not None and bool(check())
