"""A Llama-family decoder (Llama, Mistral, Qwen2) that runs one flattened batch over a paged KV cache.

All scheduled tokens of all requests are concatenated into one [num_tokens, hidden] batch
(Orca's selective batching): embeddings, norms, projections and the MLP see every token at
once; only attention splits by sequence (kernels/paged_attention.py on CPU,
kernels/triton_attention.py on CUDA). Logits are computed for the sampling rows only,
gathered before the final norm and lm_head.

The model is a tree of nn.Modules (`state_dict`, `.to()`, hooks and `torch.compile` see
every weight), named after Hugging Face's with two fusions made at load: q/k/v become one
`qkv_proj` and gate/up one `gate_up_proj`, two matmuls fewer per layer.

The math follows Hugging Face's LlamaForCausalLM step for step (RMSNorm in float32 then cast,
the rotate_half RoPE convention, residual order) so that float32 greedy output matches it
token for token.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fused_ops, quant_linear
from kernels import paged_attention as cpu_attn
from runtime.dtypes import cpu_has_native_bf16
from runtime.llm.layers import attention_cpp, attention_triton, rope, silu_mul


@dataclass(slots=True)
class ModelSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # llama3-style parameters, or None for plain RoPE
    tie_word_embeddings: bool
    sliding_window: int | None
    # Which projections carry biases (Qwen2: q/k/v), read off the checkpoint's tensors.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelSpec:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.hidden_act must be 'silu' for the Llama-family model, got {act!r}")
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"config rope_type must be 'default' or 'llama3', got {rope_type!r}")
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None  # Qwen2 lists a window it does not use
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=rope if rope_type == "llama3" else None,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=window,
        )

    def with_biases_of(self, state_dict: dict[str, torch.Tensor]) -> ModelSpec:
        keys = [k for k in state_dict if k.endswith(".bias")]

        def has(*names: str) -> bool:
            return any(k.endswith(n) for k in keys for n in names)

        return dataclasses.replace(
            self,
            qkv_bias=has("q_proj.bias", "k_proj.bias", "v_proj.bias"),
            o_bias=has("o_proj.bias"),
            mlp_bias=has("gate_proj.bias", "up_proj.bias", "down_proj.bias"),
        )


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies as Hugging Face computes them (default and llama3 scaling)."""
    dim = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = spec.rope_scaling
    if s is None:
        return inv
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # row of the chunk's first token in the flattened batch
    q_len: int
    start: int  # position of the chunk's first token in its sequence
    block_ids: torch.Tensor | None  # [ceil((start + q_len) / block_size)] its blocks; None when start == 0


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the runner, shared by every layer. Decode rows come first in
    the flattened batch (rows [0, num_decodes)), then the prefill chunks."""

    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V goes
    # "torch" (kernels/paged_attention.py), "cpp" (kernels/cpu_attention.py) or "triton"
    # (kernels/triton_attention.py); "cpp" takes the Triton path's int32 metadata.
    backend: str = "torch"
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks], padded with a zero block
    decode_context_lens: torch.Tensor | None = None  # [num_decodes]
    decode_cu_q_lens: torch.Tensor | None = None  # "cpp": [num_decodes + 1] int32, 0, 1, 2, ...
    decode_mask: torch.Tensor | None = None  # CPU: [num_decodes, 1, 1, max_blocks * block_size] additive
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Triton path: every prefill chunk in one launch.
    prefill_block_tables: torch.Tensor | None = None  # [num_chunks, max_blocks] int32
    prefill_cu_q_lens: torch.Tensor | None = None  # [num_chunks + 1] int32
    prefill_context_lens: torch.Tensor | None = None  # [num_chunks] int32, start + q_len
    prefill_max_q_len: int = 0  # from the plan, so the kernel's grid needs no device read


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in float32, then scale (kernels/fused_ops.py: one C++ pass
    on CPU, F.rms_norm's formula). In float32 bit-identical to HF's written-out formula; in
    bfloat16 it rounds once where HF rounds twice, so within one bfloat16 rounding of HF.
    Off the CPU the op would run its Python fallback, and hide the norm from a GPU graph's
    fusion: there the torch ops are called directly."""
    if x.device.type != "cpu":
        return fused_ops.rms_norm_torch(x, weight, eps)
    return fused_ops.rms_norm(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(x + residual), x + residual), the pre-norm block's
        residual add folded into the next norm (fused_ops.add_rms_norm)."""
        if residual is None:
            return _rms_norm(x, self.weight, self.eps)
        if x.device.type != "cpu":  # as _rms_norm
            return fused_ops.add_rms_norm_torch(x, residual, self.weight, self.eps)
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can pre-pack linear weights here. These are the ops torch.compile's own
    CPU freezing pass emits (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`);
    they are not a documented API, so the model checks each packed layer against F.linear
    once (PackedLinear.pack) and stays on F.linear wherever they are missing or disagree."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    # oneDNN emulates bf16 slowly on CPUs without native support; plain matmuls do better there.
    return dtype != torch.bfloat16 or cpu_has_native_bf16()


_QUANT_OPS = {"q4_1": quant_linear.q4_1_linear, "q8_0": quant_linear.q8_0_linear}
_QUANT_BYTES = {"q4_1": quant_linear.Q4_1_BYTES, "q8_0": quant_linear.Q8_0_BYTES}


class PackedLinear(nn.Linear):
    """nn.Linear that can pre-pack its weight into oneDNN's blocked layout on CPU. Plain
    F.linear re-lays the weight out on every call, which costs ~30% of a small-batch decode.

    Packing replaces `weight` with the packed tensor (an opaque oneDNN tensor, layout
    torch._mkldnn), so the model holds each weight once. A packed layer's state_dict
    therefore holds that layout: load weights before packing, and read plain weights from
    the checkpoint, not from a packed model."""

    packed: bool
    int4_group: int  # > 0: the weight is held at 4 bits in groups of this size (quantize_int4)
    quant_kind: str | None  # "q4_1" / "q8_0": the weight is a GGUF's blocks as shipped (hold_blocks)

    def __init__(self, in_features: int, out_features: int, bias: bool, **kw) -> None:
        super().__init__(in_features, out_features, bias, **kw)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.packed = False
        self.int4_group = 0
        self.int4_scales: nn.Parameter | None = None
        self.quant_kind = None
        # Set by a captured step (runtime/llm/compiled.py): while torch.compile traces, the
        # layer enters the graph as the opaque op tandem::linear (runtime/llm/graph_ops.py).
        self.graph_handle: int | None = None

    @torch.no_grad()
    def quantize_int4(self, group: int = 32) -> bool:
        """Hold the weight at 4 bits: per group of `group` inputs of a row, a bfloat16 scale and
        minimum (group-wise asymmetric, as GGUF's Q4_1 blocks of 32), packed for torch's CPU
        int4 kernel, which takes bfloat16 activations. A Q4_1 block whose weights span its
        whole 0..15 range comes back as the same scale and minimum, up to their bfloat16
        rounding. False (and the weight untouched) where the shape or dtype does not fit.
        Why: a small-batch decode reads every weight once a step; at 4 bits that is a quarter
        of bfloat16's bytes (BENCHMARKS.md, "Weights kept small")."""
        w = self.weight.data
        n, k = w.shape
        if self.packed or self.int4_group or w.dtype != torch.bfloat16 or w.device.type != "cpu":
            return False
        if k % group or n % 8:
            return False
        groups = w.float().view(n, k // group, group)
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = ((groups - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # The kernel computes (q - 8) * scale + zero: its zero is the group's minimum + 8 scales.
        sz = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).to(torch.bfloat16).contiguous()
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.int4_scales = nn.Parameter(sz, requires_grad=False)
        self.int4_group = group
        return True

    @torch.no_grad()
    def hold_blocks(self, kind: str, blocks: torch.Tensor) -> None:
        """Hold the weight as a GGUF's quantized blocks (uint8 [out, in / 32 * block bytes]),
        read as they are by kernels/quant_linear.py's integer kernel with 8-bit activations:
        a one-sequence decode reads every weight once a token, and the blocks are 20 (Q4_1) or
        34 (Q8_0) bytes per 32 weights, against 128 in float32."""
        if kind not in _QUANT_OPS:
            raise ValueError(f"kind must be one of {sorted(_QUANT_OPS)}, got {kind!r}")
        expect = (self.out_features, self.in_features // quant_linear.BLOCK * _QUANT_BYTES[kind])
        if self.in_features % quant_linear.BLOCK or blocks.dtype != torch.uint8 or tuple(blocks.shape) != expect:
            raise ValueError(
                f"blocks: a {self.in_features} -> {self.out_features} layer holds {kind} blocks as uint8 {expect}, "
                f"got {blocks.dtype} {tuple(blocks.shape)}"
            )
        if self.packed or self.int4_group or self.quant_kind:
            raise ValueError("hold_blocks: the layer's weight is already packed or quantized")
        self.weight = nn.Parameter(blocks.to(self.weight.device).contiguous(), requires_grad=False)
        self.quant_kind = kind

    @torch.no_grad()
    def pack(self, batch_hint: int) -> bool:
        if self.packed:
            return True
        if self.int4_group or self.quant_kind:
            return False  # held at 4 bits (or as GGUF blocks): their own kernel reads it, not oneDNN
        w = self.weight.data
        probe = torch.randn(3, self.in_features, dtype=w.dtype)
        want = F.linear(probe, w, self.bias)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], "")
        tol = 1e-4 if w.dtype == torch.float32 else 5e-2
        if got.shape != want.shape or not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
            return False  # this build's oneDNN disagrees: keep the plain path
        self.weight = nn.Parameter(packed, requires_grad=False)  # an opaque oneDNN tensor (layout torch._mkldnn)
        self.packed = True
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.graph_handle is not None and torch.compiler.is_compiling():
            return torch.ops.tandem.linear(x, self.graph_handle)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.quant_kind:
            return _QUANT_OPS[self.quant_kind](x, self.weight, self.bias)
        if self.int4_group:
            y = torch._weight_int4pack_mm_for_cpu(x, self.weight, self.int4_group, self.int4_scales)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        s = spec
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.scale = s.head_dim**-0.5
        qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.qkv_proj = PackedLinear(s.hidden_size, qkv, bias=s.qkv_bias)
        self.o_proj = PackedLinear(s.num_heads * s.head_dim, s.hidden_size, bias=s.o_bias)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.gate_up_proj = PackedLinear(s.hidden_size, 2 * s.intermediate_size, bias=s.mlp_bias)
        self.down_proj = PackedLinear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)

    def _qkv(self, h: torch.Tensor, res: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`h` is the previous layer's MLP output, not yet added to the residual stream `res`
        (None at the first layer, whose `h` is the embedding): the add and this layer's norm
        are one op. Returns the fused q, k, v projection (RoPE not applied) and the residual
        stream."""
        if res is None:
            x, res = self.input_layernorm(h), h
        else:
            x, res = self.input_layernorm(h, res)
        return self.qkv_proj(x), res

    def _finish(self, res: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.o_proj(attn.reshape(res.shape[0], self.num_heads * self.head_dim))
        x, res = self.post_attention_layernorm(o, res)  # res + o, normed
        return self.down_proj(silu_mul(self.gate_up_proj(x))), res  # the caller adds the two (in its norm)

    def forward(
        self,
        h: torch.Tensor,
        res: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream): the layer's output is their sum, which the next
        norm forms (see _qkv)."""
        qkv, res = self._qkv(h, res)
        if meta.backend == "cpp":  # RoPE writes K/V to the cache in the same pass
            return self._finish(res, attention_cpp(qkv, cos, sin, *kv, meta, self.num_heads, self.scale))
        q, k, v = rope(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        return self._finish(res, _attention(q, k, v, kv[0], kv[1], meta, self.scale))

    def forward_decode(
        self, h: torch.Tensor, res: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *step: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode-only step of one layer as a captured graph sees it: the K/V write and the
        attention are one registered op (runtime/llm/graph_ops.py) over the whole cache, so
        the graph does not break at attention. `step`: LlamaModel.forward_decode's tensors."""
        qkv, res = self._qkv(h, res)
        q, k, v = rope(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        kv_cache, slot_mapping, block_tables, context_lens, mask = step
        attn = torch.ops.tandem.decode_attention(
            q, k, v, kv_cache, self.layer_idx, slot_mapping, block_tables, context_lens, mask, self.scale
        )
        return self._finish(res, attn)


def _attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if meta.backend == "triton":
        return attention_triton(q, k, v, k_cache, v_cache, meta, scale)
    cpu_attn.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    nd = meta.num_decodes
    if nd and not meta.prefills:
        return cpu_attn.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_mask, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = cpu_attn.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_mask, scale
        )
    for c in meta.prefills:
        s, e = c.token_start, c.token_start + c.q_len
        if c.block_ids is None:  # the chunk is the whole context so far: no cache read needed
            out[s:e] = cpu_attn.prefill_attention(q[s:e], k[s:e], v[s:e], 0, scale)
        else:
            out[s:e] = cpu_attn.paged_prefill_attention(q[s:e], k_cache, v_cache, c.block_ids, c.start, scale)
    return out


class LlamaModel(nn.Module):
    """Build with `LlamaModel.from_state_dict` (fused, converted and on the device), or
    construct empty and `load_weights` a Hugging Face state_dict."""

    def __init__(self, spec: ModelSpec, max_model_len: int) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = PackedLinear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        freqs = torch.arange(max_model_len, dtype=torch.float32)[:, None] * rope_inv_freq(spec)[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def packed(self) -> bool:
        return any(m.packed for m in self.modules() if isinstance(m, PackedLinear))

    @classmethod
    def from_state_dict(
        cls,
        spec: ModelSpec,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: str | torch.device,
        max_model_len: int,
        batch_hint: int = 16,
        pack_weights: bool | None = None,
        quantization: str | None = None,
        gguf_path: str | None = None,
    ) -> LlamaModel:
        """The model on `device` in `dtype`, weights taken from a Hugging Face state_dict
        (consumed: each tensor is dropped from it once copied, so peak memory stays near one
        model), CPU weights pre-packed for oneDNN when available (`pack_weights` forces it)."""
        device = torch.device(device)
        spec = spec.with_biases_of(state_dict)
        with torch.device("meta"):
            model = cls(spec, max_model_len)
        model.to_empty(device=device)
        if spec.tie_word_embeddings:  # to_empty makes new Parameters, one per module
            model.lm_head.weight = model.embed_tokens.weight
        model.load_weights(state_dict, dtype)
        freqs = (
            torch.arange(max_model_len, dtype=torch.float32, device=device)[:, None]
            * rope_inv_freq(spec).to(device)[None, :]
        )
        model.cos, model.sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        if quantization == "int4":
            model.quantize_int4()
        elif quantization == "gguf":
            if gguf_path is None:
                raise ValueError("quantization='gguf' keeps a GGUF file's blocks: the model must be a .gguf file")
            from runtime.llm.gguf_blocks import read_blocks

            model.hold_gguf_blocks(read_blocks(gguf_path, spec.num_heads, spec.num_kv_heads))
        pack = onednn_packing_available(device, dtype) if pack_weights is None else pack_weights
        if pack:
            model.pack_linears(batch_hint)
        return model.eval()

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            if name not in sd:
                if required:
                    raise ValueError(f"state_dict is missing {name!r} (needed by the Llama-family model)")
                return None
            return sd.pop(name)

        def put(param: torch.Tensor, *parts: torch.Tensor) -> None:
            rows = 0
            for p in parts:
                param[rows : rows + p.shape[0]].copy_(p)
                rows += p.shape[0]
            if rows != param.shape[0]:
                raise ValueError(f"weights of {rows} rows do not fit a parameter of shape {tuple(param.shape)}")

        self.to(dtype)
        put(self.embed_tokens.weight, take("embed_tokens.weight"))
        put(self.norm.weight, take("norm.weight"))
        lm_head = take("lm_head.weight", required=False)
        if not self.spec.tie_word_embeddings:
            put(self.lm_head.weight, lm_head if lm_head is not None else self.embed_tokens.weight)
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"))
            put(layer.post_attention_layernorm.weight, take(p + "post_attention_layernorm.weight"))
            for module, names in (
                (layer.qkv_proj, [a + f"{n}_proj" for n in "qkv"]),
                (layer.o_proj, [a + "o_proj"]),
                (layer.gate_up_proj, [m + "gate_proj", m + "up_proj"]),
                (layer.down_proj, [m + "down_proj"]),
            ):
                weights = [take(n + ".weight") for n in names]
                put(module.weight, *weights)
                if module.bias is not None:  # a fused layer may have biases on some parts only
                    put(
                        module.bias,
                        *(
                            b if (b := take(n + ".bias", required=False)) is not None else w.new_zeros(w.shape[0])
                            for n, w in zip(names, weights)
                        ),
                    )

    def hold_gguf_blocks(self, blocks: dict) -> int:
        """Hold every linear layer whose parts a GGUF ships as Q4_1 or Q8_0 as those blocks
        (PackedLinear.hold_blocks; `blocks`: runtime/llm/gguf_blocks.read_blocks' dict). A fused
        layer takes its parts' rows in order; one whose parts are of other kinds (or mixed)
        stays in float. A tied lm_head takes the embedding's blocks, and the embedding keeps
        its float rows for lookups. Returns how many layers hold blocks."""
        held = 0

        def hold(module: PackedLinear, names: list[str]) -> None:
            nonlocal held
            parts = [blocks.get(n) for n in names]
            if any(p is None for p in parts) or len({p.kind for p in parts}) != 1:
                return
            module.hold_blocks(parts[0].kind, torch.cat([p.blocks for p in parts]))
            held += 1

        for i, layer in enumerate(self.layers):
            a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            hold(layer.qkv_proj, [a + f"{n}_proj.weight" for n in "qkv"])
            hold(layer.o_proj, [a + "o_proj.weight"])
            hold(layer.gate_up_proj, [m + "gate_proj.weight", m + "up_proj.weight"])
            hold(layer.down_proj, [m + "down_proj.weight"])
        head = "embed_tokens.weight" if self.spec.tie_word_embeddings else "lm_head.weight"
        if head in blocks:
            hold(self.lm_head, [head])  # a new Parameter: a tied embedding keeps its own
        return held

    def quantize_int4(self, group: int = 32) -> int:
        """Hold the decoder layers' linear weights at 4 bits (PackedLinear.quantize_int4); the
        lm_head stays in the model's dtype (it is tied to the embedding in small models, and
        its rounding moves every logit). Returns how many layers were quantized; ValueError
        where one could not be."""
        layers = [
            m for layer in self.layers for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ]
        for m in layers:
            if not m.quantize_int4(group):
                raise ValueError(
                    f"quantization='int4' needs bfloat16 weights on CPU with in_features divisible by {group} and "
                    f"out_features by 8; a layer has {m.in_features} -> {m.out_features} in {m.weight.dtype} on "
                    f"{m.weight.device.type}"
                )
        return len(layers)

    def pack_linears(self, batch_hint: int) -> None:
        """Pre-pack every linear layer for oneDNN (CPU). A tied lm_head gets its own packed
        copy: the embedding must stay in the plain layout for lookups."""
        if self.lm_head.weight is self.embed_tokens.weight:
            self.lm_head.weight = nn.Parameter(self.embed_tokens.weight.detach().clone(), requires_grad=False)
        for m in self.modules():
            if isinstance(m, PackedLinear):
                m.pack(batch_hint)

    def num_parameter_bytes(self) -> int:
        """Bytes of every weight held (a tied lm_head counted once, a packed copy apart)."""
        seen: set[int] = set()
        total = 0
        for t in list(self.parameters()) + [self.cos, self.sin]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sample_rows: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """input_ids, positions [num_tokens]; returns float32 logits [len(sample_rows), vocab]
        (None when no row samples)."""
        cos = self.cos.index_select(0, positions)  # [T, hd/2], shared by all layers
        sin = self.sin.index_select(0, positions)
        h, res = self.embed_tokens(input_ids), None
        for layer, kv in zip(self.layers, kv_caches):
            h, res = layer(h, res, cos, sin, kv, meta)
        if sample_rows is None:
            return None
        return self._head(h.index_select(0, sample_rows), None if res is None else res.index_select(0, sample_rows))

    def _head(self, h: torch.Tensor, res: torch.Tensor | None) -> torch.Tensor:
        """Logits of the last layer's (MLP output, residual stream): their sum, normed."""
        x = self.norm(h) if res is None else self.norm(h, res)[0]
        return self.lm_head(x).float()

    def forward_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """One decode-only step, in the form torch.compile captures (runtime/llm/compiled.py):
        plain tensors in, float32 logits for every row out.

        input_ids, positions, slot_mapping [B] int64 (B >= 2: the runner pads a lone sequence);
        `kv_cache` the runner's whole [layers, 2, blocks, block_size, kv_heads, head_dim]
        tensor, written in place; block_tables [B, M >= 2] int32 padded with the pad block;
        context_lens [B] int32; mask [B, 1, 1, M * block_size] additive (the torch fallback's).
        No inference_mode here: a graph that writes an input in place cannot take inference
        tensors."""
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        h, res = self.embed_tokens(input_ids), None
        step = (kv_cache, slot_mapping, block_tables, context_lens, mask)
        for layer in self.layers:
            h, res = layer.forward_decode(h, res, cos, sin, *step)
        return self._head(h, res)
