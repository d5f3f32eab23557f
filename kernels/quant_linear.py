"""Linear layers over GGUF's quantized weights, kept in their blocks: integer dot products with
8-bit activations, as llama.cpp computes them on a CPU.

Why: a single-sequence decode reads every weight once per token, so it is bound by memory.
Held as GGUF's Q4_1 blocks the weights are 20 bytes per 32 (5 bits each) against 128 bytes in
float32, and the C++ kernel reads them as they are, unpacking them in registers.

Layouts (GGUF's, byte for byte). A weight [N outputs, K inputs], K a multiple of 32, is a uint8
tensor [N, K / 32 * bytes_per_block]: row n holds the blocks of output n, inputs 32b .. 32b+31
in block b (gguf.GGUFReader's `tensor.data` is exactly this).

    Q4_1  20 bytes: float16 d, float16 m, uint8 qs[16]
          weight j (0..15) = qs[j] & 15, weight j + 16 = qs[j] >> 4;   w = d * q + m
    Q8_0  34 bytes: float16 d, int8 qs[32];                              w = d * q

The math. Each row of x [M, K] is quantized per block of 32 inputs (llama.cpp's Q8_1 for Q4_1
weights, Q8_0 for Q8_0 weights):

    da = max|x_j| / 127,  qa_j = round_half_even(x_j * (1 / da)) (int8, |qa| <= 127; 0 if da = 0)
    sa = da * sum_j qa_j

and then, per block, with the weight block's d, m, q:

    Q4_1  d * da * sum_j q_j qa_j  +  m * sa        (sum_j (d q_j + m)(da qa_j))
    Q8_0  d * da * sum_j q_j qa_j

summed over the blocks in float32; y = that + bias, in x's dtype (float32 or bfloat16). The
integer sums are exact, so the only rounding beyond float32's is the activations' to 8 bits:
|x_j - da qa_j| <= da / 2, hence |y - x @ W.T| <= sum_b (amax_b / 254) * sum_{j in b} |W_nj|
(plus float32 rounding) for the dequantized W; tests/test_quant_linear.py holds every path to it.

Ops: tandem::q4_1_linear(x, blocks, bias=None) and tandem::q8_0_linear(x, blocks, bias=None),
torch.library custom ops with fake implementations (torch.compile traces them as opaque calls).
Their Python implementation is the torch path below (the same math, vectorized: the integer
sums as float32 batched matmuls, exact below 2**24), which any device runs; the C++ library
(kernels/quant_linear.cpp, quant_linear_batch.cpp, quant_linear_amx.cpp and quant_linear.h),
once loaded, registers its kernels as the ops' CPU implementation. The C++ library holds an AMX
int8, an AVX-512 VNNI, an AVX2 and a portable path, picked from CPUID at run time ("auto": the
fastest this CPU runs, except AMX only from a few activation rows on, VNNI below); `set_isa`
forces one at every row count (tests run each), `available_isas` lists what this CPU runs. AMX
also needs Linux to grant the process its tile state (asked once; where refused, a warning says
why and VNNI runs).

The C++ library is compiled on first use (kernels/cpp_build.py) into $TANDEM_CACHE_DIR (or
~/.cache/tandem)/torch_extensions/tandem_quant_linear/<key>; when that fails the ops run the
torch path and say why once, in a RuntimeWarning. TANDEM_QUANT_LINEAR, read until the library
is loaded, picks the path: "auto" (default: C++ when it builds), "cpp" (C++ or raise), "torch".
"""

from __future__ import annotations

import os

import torch

from kernels import cpp_build

# The kernels (quant_linear.cpp), their batch path (quant_linear_batch.cpp) and AMX path
# (quant_linear_amx.cpp), which share quant_linear.h: ninja recompiles what includes it when it
# changes.
_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_DIR, f) for f in ("quant_linear.cpp", "quant_linear_batch.cpp", "quant_linear_amx.cpp")]

BLOCK = 32
Q4_1_BYTES = 20
Q8_0_BYTES = 34
ISAS = ("amx", "vnni", "avx2", "scalar")

# Baseline flags: the files pick AVX2 / AVX-512 VNNI / AMX per function at run time.
LIBRARY = cpp_build.Library("tandem_quant_linear", _SOURCES, "TANDEM_QUANT_LINEAR", "kernels.quant_linear", simd=False)
available = LIBRARY.available
build_info = LIBRARY.build_info


def available_isas() -> list[str]:
    """The C++ paths this CPU runs, fastest first ([] without the C++ library)."""
    return list(torch.ops.tandem_quant.available_isas()) if available() else []


def set_isa(isa: str) -> str:
    """Force the C++ path for every later call in this process ("auto": the fastest this CPU
    runs, AMX only from a few rows on); returns the previous setting. ValueError for a path
    the CPU (or, for AMX, Linux) does not let this process run."""
    if not available():
        raise RuntimeError(
            f"kernels.quant_linear: no C++ library to pick a path of ({LIBRARY.info.get('error', 'disabled')})"
        )
    return torch.ops.tandem_quant.set_isa(isa)


def amx_refusal() -> str:
    """Why this process cannot run the AMX path ("" when it can): the CPU lacks AMX, Linux
    refused the tile state, or there is no C++ library."""
    if not available():
        return f"no C++ library ({LIBRARY.info.get('error', 'disabled')})"
    return torch.ops.tandem_quant.amx_refusal()


def isa() -> str:
    """The C++ path in use ("torch" without the library)."""
    return torch.ops.tandem_quant.isa() if available() else "torch"


# ---------------------------------------------------------------------------------------------
# argument checks (the C++ kernels make the same ones, with the same messages)


def _check(op: str, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, block_bytes: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"{op}: x must have 2 dimensions [M, K], got shape {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{op}: x must have dtype float32 or bfloat16, got {x.dtype}")
    k = x.shape[1]
    if k <= 0 or k % BLOCK:
        raise ValueError(f"{op}: x.shape[1] (K) must be a positive multiple of 32, got {k}")
    if blocks.dim() != 2:
        raise ValueError(
            f"{op}: blocks must have 2 dimensions [N, K / 32 * {block_bytes}], got shape {list(blocks.shape)}"
        )
    if blocks.dtype != torch.uint8:
        raise ValueError(f"{op}: blocks must have dtype uint8, got {blocks.dtype}")
    want = k // BLOCK * block_bytes
    if blocks.shape[1] != want:
        raise ValueError(
            f"{op}: blocks must have shape [N, K / 32 * {block_bytes}] = [N, {want}] for K = {k}, "
            f"got {list(blocks.shape)}"
        )
    if not blocks.is_contiguous():
        raise ValueError(f"{op}: blocks must be contiguous")
    if x.device != blocks.device:
        raise ValueError(f"{op}: x and blocks must be on one device, got {x.device} and {blocks.device}")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != blocks.shape[0]:
            raise ValueError(f"{op}: bias must have shape [N] = [{blocks.shape[0]}], got {list(bias.shape)}")
        if bias.dtype not in (torch.float32, x.dtype):
            raise ValueError(f"{op}: bias must have dtype float32 or x's, got {bias.dtype}")
        if bias.device != x.device:
            raise ValueError(f"{op}: bias must be on x's device, got {bias.device}")


def _check_blocks(name: str, blocks: torch.Tensor, k: int, block_bytes: int) -> None:
    if k <= 0 or k % BLOCK:
        raise ValueError(f"{name}: k must be a positive multiple of 32, got {k}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != k // BLOCK * block_bytes:
        raise ValueError(
            f"{name}: blocks must be uint8 [N, {k // BLOCK * block_bytes}] for k = {k}, "
            f"got {blocks.dtype} {list(blocks.shape)}"
        )


# ---------------------------------------------------------------------------------------------
# torch path: the fallback, the reference of the C++ kernels, and what other devices run


def _halves(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of every block of [N, KB, bytes], as float32 [N, KB]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _q4_1_parts(blocks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d [N, KB], m [N, KB], q [N, KB, 32] uint8 in 0..15) of Q4_1 blocks."""
    _check_blocks("q4_1", blocks, k, Q4_1_BYTES)
    b = blocks.view(blocks.shape[0], k // BLOCK, Q4_1_BYTES)
    qs = b[..., 4:]
    return _halves(b, 0), _halves(b, 2), torch.cat([qs & 15, qs >> 4], dim=-1)


def _q8_0_parts(blocks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d [N, KB], q [N, KB, 32] int8) of Q8_0 blocks."""
    _check_blocks("q8_0", blocks, k, Q8_0_BYTES)
    b = blocks.view(blocks.shape[0], k // BLOCK, Q8_0_BYTES)
    return _halves(b, 0), b[..., 2:].contiguous().view(torch.int8)


def dequantize_q4_1(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """Q4_1 blocks [N, K / 32 * 20] -> float32 weights [N, K] (as gguf.quants.dequantize)."""
    d, m, q = _q4_1_parts(blocks, k)
    return (d.unsqueeze(-1) * q.float() + m.unsqueeze(-1)).view(blocks.shape[0], k)


def dequantize_q8_0(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """Q8_0 blocks [N, K / 32 * 34] -> float32 weights [N, K] (as gguf.quants.dequantize)."""
    d, q = _q8_0_parts(blocks, k)
    return (d.unsqueeze(-1) * q.float()).view(blocks.shape[0], k)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (qa int8 [M, K], da float32 [M, K / 32], sa float32 [M, K / 32]), per block
    of 32: da = max|x| / 127, qa = round_half_even(x * (1 / da)), sa = da * sum(qa). The float32
    operations are those of the C++ kernels, in the same order, so the bits match."""
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"quantize_activations: x must be [M, K], K a multiple of 32, got shape {list(x.shape)}")
    m, k = x.shape
    xb = x.float().view(m, k // BLOCK, BLOCK)
    da = xb.abs().amax(-1) / 127
    inv = torch.where(da > 0, da.reciprocal(), torch.zeros((), dtype=da.dtype, device=da.device))
    qa = (xb * inv.unsqueeze(-1)).round().to(torch.int8)
    sa = da * qa.sum(-1, dtype=torch.int32).float()
    return qa.view(m, k), da, sa


def _linear_torch(
    x: torch.Tensor, d: torch.Tensor, q: torch.Tensor, mins: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """The kernels' math over unpacked blocks d, q [N, KB(, 32)] (and Q4_1's mins)."""
    m, k = x.shape
    n, kb = d.shape
    qa, da, sa = quantize_activations(x)
    acts = qa.float().view(m, kb, BLOCK).transpose(0, 1)  # [KB, M, 32]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    # Outputs in chunks that bound the [KB, M, chunk] block sums to ~64 MB.
    chunk = max(1, (16 << 20) // max(1, kb * m))
    for n0 in range(0, n, chunk):
        n1 = min(n, n0 + chunk)
        # Integer sums of products of 32 terms, each |.| <= 128 * 127: exact in float32.
        sums = torch.bmm(acts, q[n0:n1].float().permute(1, 2, 0))  # [KB, M, n]
        part = (sums * da.t().unsqueeze(-1) * d[n0:n1].t().unsqueeze(1)).sum(0)
        if mins is not None:
            part = part + sa @ mins[n0:n1].t()
        y[:, n0:n1] = part
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def q4_1_linear_torch(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check("q4_1_linear", x, blocks, bias, Q4_1_BYTES)
    d, mins, q = _q4_1_parts(blocks, x.shape[1])
    return _linear_torch(x, d, q, mins, bias)


def q8_0_linear_torch(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check("q8_0_linear", x, blocks, bias, Q8_0_BYTES)
    d, q = _q8_0_parts(blocks, x.shape[1])
    return _linear_torch(x, d, q, None, bias)


# ---------------------------------------------------------------------------------------------
# the custom ops


@torch.library.custom_op("tandem::q4_1_linear", mutates_args=())
def q4_1_linear(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T (+ bias [N]) for W in Q4_1 blocks [N, K / 32 * 20], with x
    quantized to 8 bits per block of 32; y in x's dtype (float32 or bfloat16)."""
    if LIBRARY.use_cpp(x, blocks):
        return torch.ops.tandem_quant.q4_1_linear(x, blocks, bias)
    return q4_1_linear_torch(x, blocks, bias)


@q4_1_linear.register_fake
def _(x, blocks, bias=None):
    _check("q4_1_linear", x, blocks, bias, Q4_1_BYTES)
    return x.new_empty(x.shape[0], blocks.shape[0])


@torch.library.custom_op("tandem::q8_0_linear", mutates_args=())
def q8_0_linear(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T (+ bias [N]) for W in Q8_0 blocks [N, K / 32 * 34], with x
    quantized to 8 bits per block of 32; y in x's dtype (float32 or bfloat16)."""
    if LIBRARY.use_cpp(x, blocks):
        return torch.ops.tandem_quant.q8_0_linear(x, blocks, bias)
    return q8_0_linear_torch(x, blocks, bias)


@q8_0_linear.register_fake
def _(x, blocks, bias=None):
    _check("q8_0_linear", x, blocks, bias, Q8_0_BYTES)
    return x.new_empty(x.shape[0], blocks.shape[0])
