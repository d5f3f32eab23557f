"""A Llama-family decoder (Llama, Mistral, Qwen2) that runs one flattened batch over a paged KV cache.

All scheduled tokens of all requests are concatenated into one [num_tokens, hidden] batch
(Orca's selective batching): embeddings, norms, projections and the MLP see every token at
once; only attention splits by sequence (kernels/paged_attention.py). Logits are computed
for the sampling rows only, gathered before the final norm and lm_head.

The math follows Hugging Face's LlamaForCausalLM step for step (RMSNorm in float32 then cast,
the rotate_half RoPE convention, residual order) so that float32 greedy output matches it
token for token. Q/K/V and gate/up weights are concatenated at load: two matmuls fewer per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels.paged_attention import gather_kv, paged_decode_attention, prefill_attention, write_kv


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

    @classmethod
    def from_config(cls, config: Any) -> "ModelSpec":
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
    slots: torch.Tensor | None  # cache slots of positions [0, start + q_len); None when start == 0


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the runner, shared by every layer. Decode rows come first in
    the flattened batch (rows [0, num_decodes)), then the prefill chunks."""

    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V goes
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_context]
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context]
    prefills: list[PrefillChunk] = field(default_factory=list)


def _can_pack(device: str, dtype: torch.dtype) -> bool:
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    # oneDNN emulates bf16 slowly on CPUs without native support; plain matmuls do better there.
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """y = x @ W.T + b. On CPU the weight is pre-packed into oneDNN's blocked layout once:
    plain F.linear re-lays it out on every call, which costs ~30% of a small-batch decode."""

    __slots__ = ("weight", "bias", "packed", "num_bytes")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, batch_hint: int) -> None:
        self.num_bytes = weight.numel() * weight.element_size() + (bias.numel() * bias.element_size() if bias is not None else 0)
        self.bias = bias
        self.packed = pack
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint) if pack else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm, bit for bit: normalise in float32, round to the model dtype, then
    scale. F.rms_norm does the float32 part as one fused op (bit-identical to the written-out
    formula), which saves four dispatches per call."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


class LlamaModel(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: str,
        max_model_len: int,
        batch_hint: int = 16,
        pack_weights: bool | None = None,
    ) -> None:
        super().__init__()
        pack = _can_pack(device, dtype) if pack_weights is None else pack_weights
        self.spec = spec
        self.dtype = dtype
        self.scale = spec.head_dim**-0.5
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}

        def get(name: str) -> torch.Tensor:
            if name not in sd:
                raise ValueError(f"state_dict is missing {name!r} (needed by the Llama-family model)")
            return sd[name].to(device=device, dtype=dtype)

        def opt(name: str) -> torch.Tensor | None:
            return sd[name].to(device=device, dtype=dtype) if name in sd else None

        self.embed = get("embed_tokens.weight")
        self.norm = get("norm.weight")
        lm_head = sd.get("lm_head.weight")
        lm_w = self.embed if spec.tie_word_embeddings or lm_head is None else lm_head.to(device=device, dtype=dtype)
        self.lm_head = Linear(lm_w, None, pack, batch_hint)
        self.layers: list[dict] = []
        for i in range(spec.num_layers):
            p = f"layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv_b = [opt(a + f"{n}_proj.bias") for n in "qkv"]
            gate_up_b = [opt(m + f"{n}_proj.bias") for n in ("gate", "up")]

            def fused(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> Linear:
                bias = None
                if any(b is not None for b in biases):  # e.g. Qwen2's q/k/v biases
                    bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
                return Linear(torch.cat(weights), bias, pack, batch_hint)

            self.layers.append(
                {
                    "ln1": get(p + "input_layernorm.weight"),
                    "ln2": get(p + "post_attention_layernorm.weight"),
                    "qkv": fused([get(a + f"{n}_proj.weight") for n in "qkv"], qkv_b),
                    "o": Linear(get(a + "o_proj.weight"), opt(a + "o_proj.bias"), pack, batch_hint),
                    "gate_up": fused([get(m + "gate_proj.weight"), get(m + "up_proj.weight")], gate_up_b),
                    "down": Linear(get(m + "down_proj.weight"), opt(m + "down_proj.bias"), pack, batch_hint),
                }
            )
        self.packed = pack
        freqs = torch.arange(max_model_len, dtype=torch.float32)[:, None] * rope_inv_freq(spec)[None, :]
        # Half-width tables: HF's cos/sin repeat the same values in both halves.
        self.cos = freqs.cos().to(device=device, dtype=dtype)
        self.sin = freqs.sin().to(device=device, dtype=dtype)

    def num_parameter_bytes(self) -> int:
        """Bytes of every weight held, counting the packed lm_head apart from a tied embedding."""
        total = sum(t.numel() * t.element_size() for t in (self.embed, self.norm))
        if not self.packed and self.lm_head.weight is self.embed:
            total -= self.embed.numel() * self.embed.element_size()
        total += self.lm_head.num_bytes
        for layer in self.layers:
            total += sum(v.num_bytes if isinstance(v, Linear) else v.numel() * v.element_size() for v in layer.values())
        return total

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Same products and sums as HF's q * cos + rotate_half(q) * sin, so the same bits.
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _attention(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        nd = meta.num_decodes
        if nd and not meta.prefills:
            return paged_decode_attention(q, k_cache, v_cache, meta.decode_slots, meta.decode_mask, self.scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_slots, meta.decode_mask, self.scale)
        for c in meta.prefills:
            s, e = c.token_start, c.token_start + c.q_len
            if c.slots is None:  # the chunk is the whole context so far: no cache read needed
                out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], 0, self.scale)
            else:
                kk, vv = gather_kv(k_cache, c.slots), gather_kv(v_cache, c.slots)
                out[s:e] = prefill_attention(q[s:e], kk, vv, c.start, self.scale)
        return out

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
        spec = self.spec
        nh, nkv, hd, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps
        t = input_ids.shape[0]
        cos = self.cos.index_select(0, positions).unsqueeze(1)  # [T, 1, hd/2], shared by all layers
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        h = F.embedding(input_ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            residual = h
            x = _rms_norm(h, layer["ln1"], eps)
            qkv = layer["qkv"](x)
            qk = self._rope(qkv[:, : (nh + nkv) * hd].view(t, nh + nkv, hd), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, (nh + nkv) * hd :].view(t, nkv, hd)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = self._attention(q, k, v, k_cache, v_cache, meta)
            h = residual + layer["o"](attn.reshape(t, nh * hd))
            residual = h
            x = _rms_norm(h, layer["ln2"], eps)
            gate, up = layer["gate_up"](x).chunk(2, dim=-1)
            h = residual + layer["down"](F.silu(gate) * up)
        if sample_rows is None:
            return None
        h = _rms_norm(h.index_select(0, sample_rows), self.norm, eps)
        return self.lm_head(h).float()
