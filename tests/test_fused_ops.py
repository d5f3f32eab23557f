"""kernels/fused_ops.py: tandem::rms_norm, add_rms_norm, silu_mul, rope and rope_write_kv against
their torch path, and a model's greedy tokens with and without them."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels import fused_ops as fo

DTYPES = (torch.float32, torch.bfloat16)
EPS = 1e-5


@pytest.fixture(scope="module")
def cpp():
    """The C++ ops, built: skipped only where they are turned off or there is no compiler; a
    failure, not a comparison of the fallback with itself, when a compiler cannot build them."""
    if fo.LIBRARY.mode() == "torch":
        pytest.skip("TANDEM_FUSED_OPS=torch")
    if not fo.available():
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            pytest.skip("no C++ compiler")
        pytest.fail(f"the C++ fused ops did not build: {fo.build_info().get('error')}")
    return fo


def _inputs(t: int, h: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed + t * 7919 + h)
    x = (torch.randn(t, h, generator=g) * 3).to(dtype)
    res = (torch.randn(t, h, generator=g) * 3).to(dtype)
    w = (torch.randn(h, generator=g) + 1).to(dtype)
    return x, res, w


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        assert torch.equal(got, want), (got - want).abs().max()  # ATen's summation order, exactly
    else:  # rounded once from float32 values that may differ in the last float32 bits
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h", [64, 576, 1536])
@pytest.mark.parametrize("t", [1, 3, 16, 300])
def test_ops_match_the_torch_path(cpp, t, h, dtype):
    x, res, w = _inputs(t, h, dtype)
    _close(fo.rms_norm(x, w, EPS), fo.rms_norm_torch(x, w, EPS))
    y, new_res = fo.add_rms_norm(x, res, w, EPS)
    y_ref, res_ref = fo.add_rms_norm_torch(x, res, w, EPS)
    assert torch.equal(new_res, res_ref)  # the sum in x's dtype, as `x + residual`
    _close(y, y_ref)


def test_float32_equals_f_rms_norm_and_hf_formula(cpp):
    x, res, w = _inputs(37, 576, torch.float32)
    y = fo.rms_norm(x * 40, w, EPS)
    assert torch.equal(y, F.rms_norm(x * 40, (576,), w, EPS))
    hf = w * ((x * 40) * torch.rsqrt((x * 40).pow(2).mean(-1, keepdim=True) + EPS))
    assert torch.equal(y, hf)


def test_bfloat16_with_float32_weight(cpp):
    x, res, _ = _inputs(5, 576, torch.bfloat16)
    w = torch.randn(576) + 1
    want = F.rms_norm(x.float(), (576,), w, EPS).to(torch.bfloat16)
    _close(fo.rms_norm(x, w, EPS), want)
    y, new_res = fo.add_rms_norm(x, res, w, EPS)
    _close(y, F.rms_norm((x + res).float(), (576,), w, EPS).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs(cpp, dtype):
    """A row-strided view (a slice of a wider tensor) and a transposed one (inner stride > 1)."""
    big, res, w = _inputs(9, 2 * 576, dtype)
    x = big[:, 100:676]  # rows 1152 apart
    assert not x.is_contiguous()
    _close(fo.rms_norm(x, w[:576], EPS), fo.rms_norm_torch(x.contiguous(), w[:576], EPS))
    r = res[:, :576]
    y, new_res = fo.add_rms_norm(x, r, w[:576], EPS)
    y_ref, res_ref = fo.add_rms_norm_torch(x.contiguous(), r.contiguous(), w[:576], EPS)
    assert torch.equal(new_res, res_ref)
    _close(y, y_ref)
    xt = torch.randn(64, 7).to(dtype).t()  # [7, 64], inner stride 7
    _close(fo.rms_norm(xt, w[:64], EPS), fo.rms_norm_torch(xt.contiguous(), w[:64], EPS))
    # inputs are untouched (the ops are functional)
    assert torch.equal(big[:, 100:676], x) and torch.equal(res[:, :576], r)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(576), torch.ones(576)), "x must have 2 dimensions"),
        ((torch.randn(2, 576).half(), torch.ones(576).half()), "x must have dtype"),
        ((torch.randn(2, 576), torch.ones(64)), "weight must have shape"),
        ((torch.randn(2, 576).bfloat16(), torch.ones(576).half()), "weight must have x's dtype"),
    ],
)
def test_errors_name_the_argument(cpp, args, match):
    for fn in (fo.rms_norm, fo.rms_norm_torch):
        with pytest.raises((ValueError, RuntimeError), match=match):
            fn(*args, EPS)
    with pytest.raises((ValueError, RuntimeError), match=match):
        fo.add_rms_norm(args[0], args[0].clone(), args[1], EPS)


def test_add_errors_name_the_residual(cpp):
    x, w = torch.randn(2, 64), torch.ones(64)
    for fn in (fo.add_rms_norm, fo.add_rms_norm_torch):
        with pytest.raises((ValueError, RuntimeError), match="residual must have x's shape"):
            fn(x, torch.randn(3, 64), w, EPS)
        with pytest.raises((ValueError, RuntimeError), match="residual must have x's dtype"):
            fn(x, torch.randn(2, 64).bfloat16(), w, EPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(cpp, dtype):
    x, res, w = _inputs(3, 64, dtype)
    torch.library.opcheck(torch.ops.tandem.rms_norm.default, (x, w, EPS))
    torch.library.opcheck(torch.ops.tandem.add_rms_norm.default, (x, res, w, EPS))


def test_torch_compile_fullgraph(cpp):
    """The ops are opaque to dynamo and inductor: no graph break around them."""
    x, res, w = _inputs(4, 64, torch.float32)

    def block(x, res, w):
        y, r = fo.add_rms_norm(x * 2.0, res, w, EPS)
        return fo.rms_norm(y + 1.0, w, EPS), r

    eager = block(x, res, w)
    got = torch.compile(block, fullgraph=True, dynamic=False)(x, res, w)
    torch.testing.assert_close(got, eager)


def test_torch_path_is_the_old_formula():
    """The fallback (TANDEM_FUSED_OPS=torch, other devices): F.rms_norm, and x + residual."""
    x, res, w = _inputs(3, 64, torch.bfloat16)
    assert torch.equal(fo.rms_norm_torch(x, w, EPS), F.rms_norm(x, (64,), w, EPS))
    y, new_res = fo.add_rms_norm_torch(x, res, w, EPS)
    assert torch.equal(new_res, x + res) and torch.equal(y, F.rms_norm(x + res, (64,), w, EPS))


def _exact(got: torch.Tensor, want: torch.Tensor) -> None:
    """silu_mul and RoPE round where torch rounds, in both dtypes: the same bits."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()


def _gate_up(t: int, i: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + t * 7919 + i)
    return (torch.randn(t, 2 * i, generator=g) * 4).to(dtype)  # |gate| up to ~16: exp's whole range


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("i", [1536, 64, 37, 100, 7])  # SmolLM2's, and rows with a scalar rest
@pytest.mark.parametrize("t", [1, 3, 16, 300])
def test_silu_mul_matches_the_torch_path(cpp, t, i, dtype):
    gate_up = _gate_up(t, i, dtype)
    _exact(fo.silu_mul(gate_up), fo.silu_mul_torch(gate_up))


def test_silu_mul_is_the_mlp_formula(cpp):
    """F.silu(gate) * up, and HF's written-out gate * sigmoid(gate) * up within a rounding."""
    gate_up = _gate_up(16, 1536, torch.float32)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fo.silu_mul(gate_up), F.silu(gate) * up)
    torch.testing.assert_close(fo.silu_mul(gate_up), gate * torch.sigmoid(gate) * up, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_strided_rows(cpp, dtype):
    """Rows of a wider tensor (the layout a slice of a bigger projection would have)."""
    big = _gate_up(9, 300, dtype)
    gate_up = big[:, 100:500]
    assert not gate_up.is_contiguous()
    _exact(fo.silu_mul(gate_up), fo.silu_mul_torch(gate_up.contiguous()))


def _rope_inputs(t: int, nh: int, nkv: int, hd: int, dtype: torch.dtype, seed: int = 0):
    """qkv [T, (nh + 2 nkv) hd] and the tables at random positions, as the model builds them."""
    g = torch.Generator().manual_seed(seed + t * 7919 + nh * 31 + hd)
    qkv = (torch.randn(t, (nh + 2 * nkv) * hd, generator=g) * 3).to(dtype)
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    freqs = torch.randint(0, 8192, (t,), generator=g).float()[:, None] * inv[None, :]
    return qkv, freqs.cos().to(dtype), freqs.sin().to(dtype)


# SmolLM2's heads (9 q, 3 kv, 64 wide), Llama's 128-wide heads, and odd widths (a scalar rest).
ROPE_SHAPES = [(9, 3, 64), (4, 2, 128), (2, 1, 10), (3, 3, 38)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nh, nkv, hd", ROPE_SHAPES)
@pytest.mark.parametrize("t", [1, 3, 16, 300])
def test_rope_matches_the_torch_path(cpp, t, nh, nkv, hd, dtype):
    qkv, cos, sin = _rope_inputs(t, nh, nkv, hd, dtype)
    _exact(fo.rope(qkv, cos, sin, nh, nkv), fo.rope_torch(qkv, cos, sin, nh, nkv))


def test_rope_is_hf_rotate_half(cpp):
    """HF's q * cos + rotate_half(q) * sin with full-width tables: the same bits."""
    qkv, cos, sin = _rope_inputs(16, 9, 3, 64, torch.float32)
    x = qkv[:, : 12 * 64].view(16, 12, 64)
    c, s = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)
    rotated = torch.cat((-x[..., 32:], x[..., :32]), -1)
    assert torch.equal(fo.rope(qkv, cos, sin, 9, 3), x * c + rotated * s)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_strided_inputs(cpp, dtype):
    """qkv rows of a wider tensor, and tables sliced out of wider ones."""
    big, cos, sin = _rope_inputs(7, 9, 3, 64, dtype)
    qkv = torch.cat((big, big[:, :64]), 1)[:, 32 : 32 + big.shape[1]]
    wide_cos, wide_sin = torch.cat((cos, cos), 1)[:, 5:37], torch.cat((sin, sin), 1)[:, 5:37]
    want = fo.rope_torch(qkv.contiguous(), wide_cos.contiguous(), wide_sin.contiguous(), 9, 3)
    _exact(fo.rope(qkv, wide_cos, wide_sin, 9, 3), want)


def _cache(num_blocks: int, nkv: int, hd: int, dtype: torch.dtype):
    k = torch.full((num_blocks, 16, nkv, hd), 7.0, dtype=dtype)  # 7: any slot left alone stays 7
    return k, k.clone()


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nh, nkv, hd", ROPE_SHAPES)
@pytest.mark.parametrize("t", [1, 16, 300])
def test_rope_write_kv_matches_the_torch_path(cpp, t, nh, nkv, hd, dtype, slot_dtype):
    qkv, cos, sin = _rope_inputs(t, nh, nkv, hd, dtype)
    g = torch.Generator().manual_seed(t)
    slots = torch.randperm(24 * 16, generator=g)[:t].to(slot_dtype)
    slots[::5] = -1  # padding rows: not written
    k, v = _cache(24, nkv, hd, dtype)
    k_ref, v_ref = _cache(24, nkv, hd, dtype)
    k_eager, v_eager = _cache(24, nkv, hd, dtype)
    q = fo.rope_write_kv(qkv, cos, sin, k, v, slots, nh)
    q_ref = fo.rope_write_kv_torch(qkv, cos, sin, k_ref, v_ref, slots, nh)
    q_eager = fo.rope_write_kv_eager(qkv, cos, sin, k_eager, v_eager, slots, nh)  # the model's eager call
    _exact(q, q_ref)
    _exact(q_eager, q_ref)
    assert q.is_contiguous() and q.shape == (t, nh, hd)
    _exact(k, k_ref)
    _exact(v, v_ref)
    assert torch.equal(k_eager, k) and torch.equal(v_eager, v)
    # the same as rope, then write_kv of its k heads and qkv's v heads
    qk = fo.rope_torch(qkv, cos, sin, nh, nkv)
    kept = slots >= 0
    assert torch.equal(k.view(-1, nkv, hd)[slots[kept].long()], qk[kept, nh:])
    assert torch.equal(v.view(-1, nkv, hd)[slots[kept].long()], qkv[kept, (nh + nkv) * hd :].view(-1, nkv, hd))
    assert int((k.view(-1, nkv, hd) != 7).any(-1).any(-1).sum()) <= int(kept.sum())


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: fo.silu_mul(torch.randn(2, 7)), "gate_up must have 2 dimensions"),
        (lambda: fo.silu_mul(torch.randn(2, 8).half()), "gate_up must have dtype"),
        (lambda: fo.rope(torch.randn(2, 12 * 64), torch.randn(3, 32), torch.randn(3, 32), 9, 3), "cos and sin must be"),
        (lambda: fo.rope(torch.randn(2, 12 * 64), torch.randn(2, 32).bfloat16(), torch.randn(2, 32), 9, 3), "dtype"),
        (lambda: fo.rope(torch.randn(2, 11 * 64), torch.randn(2, 32), torch.randn(2, 32), 9, 3), "columns"),
        (lambda: fo.rope(torch.randn(2, 12 * 64), torch.randn(2, 32), torch.randn(2, 32), 0, 3), "must be > 0"),
    ],
)
def test_new_op_errors_name_the_argument(cpp, call, match):
    with pytest.raises((ValueError, RuntimeError), match=match):
        call()


def test_rope_write_kv_errors(cpp):
    qkv, cos, sin = _rope_inputs(2, 9, 3, 64, torch.float32)
    k, v = _cache(2, 3, 64, torch.float32)
    slots = torch.tensor([0, 1])
    for fn in (fo.rope_write_kv, fo.rope_write_kv_torch):
        with pytest.raises((ValueError, RuntimeError), match="columns"):
            fn(qkv[:, :-64], cos, sin, k, v, slots, 9)
        with pytest.raises((ValueError, RuntimeError), match="slot_mapping must be"):
            fn(qkv, cos, sin, k, v, slots.float(), 9)
        with pytest.raises((ValueError, RuntimeError), match="caches must have qkv's dtype"):
            fn(qkv, cos, sin, k.bfloat16(), v.bfloat16(), slots, 9)
    with pytest.raises(RuntimeError, match="past the cache"):
        fo.rope_write_kv(qkv, cos, sin, k, v, torch.tensor([0, 32]), 9)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_new_ops_opcheck(cpp, dtype):
    qkv, cos, sin = _rope_inputs(3, 2, 1, 64, dtype)
    k, v = _cache(2, 1, 64, dtype)
    torch.library.opcheck(torch.ops.tandem.silu_mul.default, (_gate_up(3, 64, dtype),))
    torch.library.opcheck(torch.ops.tandem.rope.default, (qkv, cos, sin, 2, 1))
    torch.library.opcheck(torch.ops.tandem.rope_write_kv.default, (qkv, cos, sin, k, v, torch.tensor([3, -1, 17]), 2))


def test_new_ops_torch_compile_fullgraph(cpp):
    qkv, cos, sin = _rope_inputs(4, 2, 1, 64, torch.float32)
    gate_up = _gate_up(4, 64, torch.float32)

    def block(qkv, cos, sin, gate_up):
        return fo.rope(qkv * 2.0, cos, sin, 2, 1) + 1.0, fo.silu_mul(gate_up + 1.0)

    eager = block(qkv, cos, sin, gate_up)
    got = torch.compile(block, fullgraph=True, dynamic=False)(qkv, cos, sin, gate_up)
    torch.testing.assert_close(got, eager)


def test_new_ops_torch_path_is_the_old_formula():
    """The fallback: the model's formulas before the ops (F.silu(gate) * up; _rope's cat)."""
    gate_up = _gate_up(3, 64, torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fo.silu_mul_torch(gate_up), F.silu(gate) * up)
    qkv, cos, sin = _rope_inputs(3, 2, 1, 64, torch.bfloat16)
    x = qkv[:, :192].view(3, 3, 64)
    x1, x2, c, s = x[..., :32], x[..., 32:], cos.unsqueeze(1), sin.unsqueeze(1)
    assert torch.equal(fo.rope_torch(qkv, cos, sin, 2, 1), torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1))


def test_greedy_tokens_identical_with_and_without_the_fused_ops(cpp, smollm2_dir, monkeypatch):
    from runtime.llm.api import LLM
    from runtime.llm.sampling_params import SamplingParams

    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The three primary colors are",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(model=smollm2_dir, dtype="float32", enforce_eager=True, enable_prefix_caching=False)

    def tokens():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    # The model reaches the ops through the module's attributes: count the C++ ops' calls, then
    # point them at the torch path. (rope, without the K/V write, is the other attention
    # backends' and the captured step's: tests/test_llm_compiled.py runs it in a model.)
    torch_path = {
        "rms_norm": fo.rms_norm_torch,
        "add_rms_norm": fo.add_rms_norm_torch,
        "silu_mul": fo.silu_mul_torch,
        "rope": fo.rope_torch,
        "rope_write_kv": fo.rope_write_kv_torch,
        "rope_write_kv_eager": fo.rope_write_kv_torch,
    }
    calls = dict.fromkeys(torch_path, 0)

    def counted(name, op):
        def call(*args):
            calls[name] += 1
            return op(*args)

        return call

    for name in torch_path:
        monkeypatch.setattr(fo, name, counted(name, getattr(fo, name)))
    fused = tokens()
    assert all(calls[n] > 0 for n in ("rms_norm", "add_rms_norm", "silu_mul", "rope_write_kv_eager")), calls
    for name, op in torch_path.items():
        monkeypatch.setattr(fo, name, op)
    plain = tokens()
    assert all(len(t) == 32 for t in fused)
    assert fused == plain
