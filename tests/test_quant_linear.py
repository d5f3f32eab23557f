"""kernels/quant_linear.py: the Q4_1 / Q8_0 linear ops on every instruction-set path this CPU
runs (AMX, AVX-512 VNNI, AVX2, portable), against float64 math over the same quantized weights
and activations (tight), against x @ W.T over the dequantized weights (within the bound 8-bit
activations allow), the torch path, SmolLM2's real GGUF blocks, argument errors and opcheck. The
C++ library is built (or loaded from the Tandem cache) once per session."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from kernels import quant_linear as ql

FORMATS = {
    # name: (op, torch path, dequantize, GGUF type)
    "q4_1": (ql.q4_1_linear, ql.q4_1_linear_torch, ql.dequantize_q4_1, gguf.GGMLQuantizationType.Q4_1),
    "q8_0": (ql.q8_0_linear, ql.q8_0_linear_torch, ql.dequantize_q8_0, gguf.GGMLQuantizationType.Q8_0),
}
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(576, 192), (576, 576), (576, 1536), (1536, 192), (1536, 576), (1536, 1536)]  # (K, N)
# (M, K, N, bias): every M from 1 to 16 (every tile height, and tails of the tiles), each on a
# different shape, then one past a tile, and batches that take many tiles. On the avx2 and vnni
# paths, M >= 4 (Q4_1) and M >= 5 (Q8_0) run the packed batch path. Then two Q8_0 packed
# batches with N odd: that path takes groups of 8 weight rows, and these end in partial groups,
# at the end and (on two threads) where the threads' shares meet.
CASES = [(m, *SHAPES[m % len(SHAPES)], m % 2 == 1) for m in range(1, 17)]
CASES += [(17, 1536, 1536, True), (64, 1536, 576, False), (300, 576, 576, True)]
CASES += [(6, 576, 203, True), (13, 1536, 99, False)]
# An odd number of blocks (K a multiple of 32, not of 64: the AMX path runs blocks in pairs) with
# N not a multiple of 16 (AMX's groups of weight rows), below, at and past one AMX tile of rows.
CASES += [(3, 608, 40, True), (16, 96, 17, False), (33, 544, 50, True)]
# What each path needs from the CPU, for the reason of a skip (AMX's: amx_refusal's own words).
NEEDS = {"vnni": "AVX-512 VNNI (avx512f, avx512bw, avx512vl, avx512_vnni)", "avx2": "AVX2 and FMA", "scalar": ""}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """torch's own math here (the float64 references, the torch path) on one thread, as under
    xdist (conftest.py): on two threads, right after the kernels' OpenMP region on a busy
    two-core machine, each small reference took 0.3 s where one thread takes a few ms. The
    kernels themselves run on two (on_two_threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def require_library() -> None:
    """Skip where there is no compiler or the library is turned off; fail where it does not
    build (not a silent comparison of the torch path with itself)."""
    if ql.LIBRARY.mode() == "torch":
        pytest.skip("TANDEM_QUANT_LINEAR=torch")
    if not ql.available():
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip("no C++ compiler")
        pytest.fail(f"the C++ library did not build: {ql.build_info().get('error')}")


@pytest.fixture(params=ql.ISAS)
def isa(request):
    """Each C++ path in turn: skipped where there is no compiler, the library is turned off or
    the CPU lacks the path's instructions, and a failure, not a silent comparison of the torch
    path with itself, when the library does not build."""
    require_library()
    if request.param == "amx" and ql.amx_refusal():
        pytest.skip(f"no AMX path here: {ql.amx_refusal()}")
    if request.param not in ql.available_isas():
        pytest.skip(f"this CPU lacks {NEEDS[request.param]}")
    before = ql.set_isa(request.param)
    try:
        yield request.param
    finally:
        ql.set_isa(before)


def on_two_threads(op, *args):
    """op(*args) on two threads whatever the suite's setting, so that the kernels'
    at::parallel_for splits are what is compared."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return op(*args)
    finally:
        torch.set_num_threads(before)


@functools.cache
def weights(fmt: str, k: int, n: int, seed: int = 0) -> torch.Tensor:
    """GGUF blocks of random weights, quantized by the gguf package. Q8_0 gets a few -128s,
    which gguf's quantizer never writes but a block may hold (|w| = 128 in the sign trick)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, :32] += 0.2  # a block all positive: Q4_1's minimum then is not -max
    blocks = torch.from_numpy(gguf.quants.quantize(w.numpy(), FORMATS[fmt][3]))
    if fmt == "q8_0":
        raw = blocks.view(n, k // 32, 34)
        raw[:3, 1, 2:5] = 0x80
    return blocks


@functools.cache
def activations(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[0, 32:64] = 0  # a block of zeros: da = 0
    x[-1, :32] *= 1000  # a block far from its neighbours
    return x.to(dtype)


def bias_for(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) / n - 0.5).to(dtype)


def parts(fmt: str, blocks: torch.Tensor, k: int):
    """(d, m or None, q) of the blocks, float64."""
    if fmt == "q4_1":
        d, mins, q = ql._q4_1_parts(blocks, k)
        return d.double(), mins.double(), q.double()
    d, q = ql._q8_0_parts(blocks, k)
    return d.double(), None, q.double()


@functools.cache
def reference(fmt: str, m: int, k: int, n: int, dtype: torch.dtype):
    """Float64 sums over the same quantized weights and activations (the activations from the
    torch path, which test_quantize_activations holds every C++ path to, bit for bit), their
    absolute sums (for the rounding tolerance), x @ W.T in float32 over the dequantized weights
    and the bound of its difference from the kernels' result."""
    blocks, x = weights(fmt, k, n), activations(m, k, dtype)
    d, mins, q = parts(fmt, blocks, k)
    qa, da, sa = ql.quantize_activations(x)
    kb = k // 32
    acts = qa.double().view(m, kb, 32).transpose(0, 1)  # [KB, M, 32]
    scales = da.double().t().unsqueeze(-1) * d.t().unsqueeze(1)  # [KB, M, N]
    exact = (torch.bmm(acts, q.permute(1, 2, 0)) * scales).sum(0)
    # The kernels sum a block's products in SIMD lanes that may cancel in the block's total: the
    # magnitude their float32 rounding is relative to is that of the products, not the sums.
    mag = (torch.bmm(acts.abs(), q.abs().permute(1, 2, 0)) * scales.abs()).sum(0)
    if mins is not None:
        exact = exact + sa.double() @ mins.t()
        mag = mag + sa.double().abs() @ mins.abs().t()
    w = FORMATS[fmt][2](blocks, k)
    dense = x.float() @ w.t()
    # 8-bit activations: |x_j - da * qa_j| <= da / 2 = amax / 254 per block, times sum_j |w_j|.
    amax = x.float().view(m, kb, 32).abs().amax(-1)
    bound = (amax.double() / 254) @ w.double().abs().view(n, kb, 32).sum(-1).t()
    # Float32 rounding of both sides: at most K + KB roundings of terms up to |x| @ |w|.
    slack = 2 * (k + kb) * 2**-24 * (x.double().abs() @ w.double().abs().t())
    return exact, mag, dense, bound + slack


def check(y: torch.Tensor, fmt: str, m: int, k: int, n: int, dtype: torch.dtype, bias: torch.Tensor | None):
    assert y.shape == (m, n) and y.dtype == dtype
    exact, mag, dense, bound = reference(fmt, m, k, n, dtype)
    if bias is not None:
        exact, dense = exact + bias.double(), dense + bias.float()
    y64 = y.double()
    # Float32 accumulation of KB block terms (each itself a few float32 products): relative to
    # their absolute sum, then (bfloat16) one rounding to 8 significant bits.
    tol = 1e-5 * (mag + 1) + (exact.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
    err = (y64 - exact).abs()
    assert (err <= tol).all(), f"vs the float64 sums: worst excess {(err - tol).max().item():.3g}"
    dense_tol = bound + (dense.double().abs() * 2**-8 if dtype == torch.bfloat16 else 0)
    err = (y64 - dense.double()).abs()
    assert (err <= dense_tol).all(), f"vs x @ W.T: worst excess {(err - dense_tol).max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_linear(isa, fmt, dtype):
    op = FORMATS[fmt][0]
    for m, k, n, with_bias in CASES:
        bias = bias_for(n, dtype) if with_bias else None
        y = on_two_threads(op, activations(m, k, dtype), weights(fmt, k, n), bias)
        check(y, fmt, m, k, n, dtype, bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_activations(isa, dtype):
    """Every C++ path quantizes the activations to the torch path's bits, ties included."""
    x = activations(37, 576, dtype).clone()
    x[1, :32] = torch.tensor([127.0] + [v + 0.5 for v in range(-16, 15)])  # da = 1: every x * (1 / da) a tie
    ours = on_two_threads(torch.ops.tandem_quant.quantize_activations, x)
    want = ql.quantize_activations(x)
    for got, expected in zip(ours, want):
        assert torch.equal(got, expected)
    assert want[0][1, 1:5].tolist() == [-16, -14, -14, -12]  # half to even


def test_strided_x_and_float32_bias_for_bfloat16(isa):
    """x a view of a wider tensor (a fused projection's slice); a float32 bias with bfloat16 x."""
    k, n = 576, 192
    wide = torch.randn(5, 2 * k).to(torch.bfloat16)
    x = wide[:, k:]
    bias = bias_for(n, torch.float32)
    for fmt, (op, slow, _, _) in FORMATS.items():
        y = on_two_threads(op, x, weights(fmt, k, n), bias)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, slow(x.contiguous(), weights(fmt, k, n), bias), atol=2e-2, rtol=2e-2)


def test_paths_agree(isa):
    """Every path against the portable one on one batch: the same integer sums, so the same
    result up to float32 summation order."""
    x, bias = activations(9, 1536, torch.float32), bias_for(576, torch.float32)
    for fmt, (op, *_) in FORMATS.items():
        y = on_two_threads(op, x, weights(fmt, 1536, 576), bias)
        ql.set_isa("scalar")
        try:
            portable = on_two_threads(op, x, weights(fmt, 1536, 576), bias)
        finally:
            ql.set_isa(isa)
        torch.testing.assert_close(y, portable, atol=1e-4, rtol=1e-5)


def test_amx_is_the_default_where_linux_grants_it():
    """ "auto" runs AMX where this process may (from a few rows on; VNNI below), and AMX is
    listed exactly when amx_refusal has no reason against it."""
    require_library()
    assert ("amx" in ql.available_isas()) == (ql.amx_refusal() == "")
    before = ql.set_isa("auto")
    try:
        assert ql.isa() == ql.available_isas()[0]
    finally:
        ql.set_isa(before)


def test_threads_of_their_own(isa):
    """Python threads calling the ops at once, each with its kernels' OpenMP threads (AMX: a
    tile configuration per thread), give what one call alone gives."""
    from concurrent.futures import ThreadPoolExecutor

    k, n = 576, 203
    jobs = [(FORMATS[fmt][0], activations(m, k, torch.float32), weights(fmt, k, n)) for fmt in FORMATS for m in (5, 16)]
    alone = [op(x, w) for op, x, w in jobs]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda job: job[0](job[1], job[2]), jobs * 3))
    for i, y in enumerate(together):
        assert torch.equal(y, alone[i % len(jobs)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_torch_path(fmt, dtype):
    """The fallback's implementation, called directly, against the same math."""
    slow = FORMATS[fmt][1]
    for m, k, n, with_bias in [CASES[0], CASES[4], CASES[11], CASES[17]]:
        bias = bias_for(n, dtype) if with_bias else None
        check(slow(activations(m, k, dtype), weights(fmt, k, n), bias), fmt, m, k, n, dtype, bias)


# TANDEM_QUANT_LINEAR=torch: the library is never built, the ops run the torch path. It needs a
# fresh process, and importing torch is most of its 2 to 4 s: the autouse fixture below starts
# it with the module's first test, so that it runs on the other core while the tests do, and
# test_torch_switch collects its result.
SWITCH_CODE = (
    "import torch; from kernels import quant_linear as ql; "
    "x = torch.randn(3, 64); w = torch.randint(0, 255, (8, 40), dtype=torch.uint8); "
    "w.view(8, 2, 20)[..., :4] = torch.tensor([0, 0x3c, 0, 0x3c], dtype=torch.uint8); "  # d = m = 1.0
    "assert not ql.available() and ql.LIBRARY.loaded is None and ql.isa() == 'torch'; "
    "assert torch.equal(ql.q4_1_linear(x, w), ql.q4_1_linear_torch(x, w))"
)


@pytest.fixture(scope="module", autouse=True)
def torch_switch_process(request):
    """The subprocess of test_torch_switch, started at once when that test is to run here."""
    if not any(item.name == "test_torch_switch" for item in request.session.items):
        yield None
        return
    env = dict(os.environ, TANDEM_QUANT_LINEAR="torch", OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-c", SWITCH_CODE]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:  # the test did not run (-x, a failure before it)
            proc.kill()
        proc.communicate()


def test_torch_switch(torch_switch_process):
    """TANDEM_QUANT_LINEAR=torch: the library is never built, the ops run the torch path."""
    _, err = torch_switch_process.communicate(timeout=120)
    assert torch_switch_process.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def smollm2_gguf():
    from runtime.llm.loader import default_model_path  # raises, naming the package, when it is missing

    return {t.name: t for t in gguf.GGUFReader(default_model_path()).tensors}


@pytest.mark.parametrize(
    "name, fmt", [("blk.0.attn_q.weight", "q4_1"), ("blk.3.ffn_down.weight", "q4_1"), ("token_embd.weight", "q8_0")]
)
def test_real_gguf_blocks(smollm2_gguf, name, fmt):
    """SmolLM2's own blocks: the dequantizers give gguf's floats, bit for bit, and the op (C++
    where it built) stays within the 8-bit activations' bound of x @ W.T."""
    t = smollm2_gguf[name]
    assert t.tensor_type == FORMATS[fmt][3]
    n, k = int(t.shape[1]), int(t.shape[0])
    assert t.data.shape == (n, k // 32 * (20 if fmt == "q4_1" else 34))
    n = min(n, 8192)  # of the 49152 token rows, enough to meet every kind of block
    data = np.array(t.data[:n])  # a copy: the reader's memory map is read-only
    blocks = torch.from_numpy(data)
    want = torch.from_numpy(gguf.quants.dequantize(data, t.tensor_type))
    w = FORMATS[fmt][2](blocks, k)
    assert torch.equal(w, want)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    y = FORMATS[fmt][0](x, blocks)
    kb = k // 32
    bound = (x.view(3, kb, 32).abs().amax(-1).double() / 254) @ w.double().abs().view(n, kb, 32).sum(-1).t()
    bound += 2 * (k + kb) * 2**-24 * (x.double().abs() @ w.double().abs().t())
    assert ((y.double() - x.double() @ w.double().t()).abs() <= bound).all()


BAD = [
    # (what to change, the message's argument)
    (lambda x, w, b: (x[None], w, b), "x must have 2 dimensions"),
    (lambda x, w, b: (x.long(), w, b), "x must have dtype"),
    (lambda x, w, b: (x[:, :48], w, b), r"x.shape\[1\] \(K\) must be a positive multiple of 32"),
    (lambda x, w, b: (x, w.view(torch.int8), b), "blocks must have dtype uint8"),
    (lambda x, w, b: (x, w[:, :-1], b), "blocks must have shape"),
    (lambda x, w, b: (x, w.flatten(), b), "blocks must have 2 dimensions"),
    (lambda x, w, b: (x, torch.cat([w, w], 1)[:, : w.shape[1]], b), "blocks must be contiguous"),
    (lambda x, w, b: (x, w, b[:-1]), "bias must have shape"),
    (lambda x, w, b: (x, w, b.double()), "bias must have dtype"),
]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_argument_errors(fmt):
    """ValueError naming the argument, from the op (C++ where it built) and the torch path."""
    op, slow, _, _ = FORMATS[fmt]
    x, w, b = activations(2, 64, torch.float32), weights(fmt, 64, 8), bias_for(8, torch.float32)
    for change, message in BAD:
        for fn in (op, slow):
            with pytest.raises(ValueError, match=message):
                fn(*change(x, w, b))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_opcheck(fmt):
    op = getattr(torch.ops.tandem, f"{fmt}_linear").default
    x, w = activations(3, 64, torch.float32), weights(fmt, 64, 16)
    torch.library.opcheck(op, (x, w, bias_for(16, torch.float32)))
    torch.library.opcheck(op, (x.to(torch.bfloat16), w))
