"""kernels/fused_ops.py: tandem::rms_norm and tandem::add_rms_norm against their torch path."""

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

    fused = tokens()
    # The model reaches the ops through the module's attributes: point them at the torch path.
    monkeypatch.setattr(fo, "rms_norm", fo.rms_norm_torch)
    monkeypatch.setattr(fo, "add_rms_norm", fo.add_rms_norm_torch)
    plain = tokens()
    assert all(len(t) == 32 for t in fused)
    assert fused == plain
