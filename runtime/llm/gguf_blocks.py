"""A GGUF checkpoint's quantized linear weights as shipped: each layer's raw blocks, under the
Hugging Face names runtime/llm/model.py loads, for the quantized linear kernel
(kernels/quant_linear.py), which reads them as they are instead of a float copy.

A GGUF matrix of N outputs by K inputs is N rows of K / 32 blocks, each block the 32 weights of
one output (Q4_1: an fp16 scale and minimum and sixteen bytes of nibbles, 20 bytes; Q8_0: an
fp16 scale and 32 int8, 34 bytes). So the rows are the outputs, and anything that reorders
outputs reorders whole rows of bytes:
- llama.cpp's converter permutes the rows of attn_q and attn_k (its RoPE pairs neighbouring
  dimensions; Hugging Face's pairs the halves of a head). transformers undoes that when it
  dequantizes (runtime/llm/loader.py's conversion); the same permutation on the rows of blocks
  gives the bytes of the weights that conversion wrote.
- The model's fused layers (qkv_proj, gate_up_proj) concatenate their parts' outputs: rows.

The blocks' dequantized values equal the converted float32 weights exactly (both are fp16 *
small integer + fp16 in float32); tests/test_gguf_blocks.py checks every tensor of SmolLM2.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights per block, both kinds
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
_KINDS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}  # gguf's GGMLQuantizationType names -> the kernel's

# llama.cpp's tensor names -> Hugging Face's (LlamaForCausalLM, without the "model." prefix)
_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
_TOP = {"token_embd.weight": "embed_tokens.weight", "output.weight": "lm_head.weight"}


@dataclass(frozen=True)
class QuantWeight:
    """One matrix's blocks: uint8 [out_features, in_features // 32 * BLOCK_BYTES[kind]]."""

    kind: str
    blocks: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]


def hf_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'layers.3.self_attn.q_proj.weight'; None for a tensor the
    model has no linear weight for."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_PARTS:
        return f"layers.{m.group(1)}.{_LAYER_PARTS[m.group(2)]}.weight"
    return None


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K output order -> Hugging Face's, on rows (of blocks or of floats): within
    each head, the rows (0, 2, 4, ..., 1, 3, 5, ...) become (0, 1, 2, ...)."""
    n = rows.shape[0]
    if n % (2 * heads):
        raise ValueError(f"{n} rows do not split into {heads} heads of row pairs")
    half = n // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def read_blocks(gguf_path: str, num_heads: int, num_kv_heads: int) -> dict[str, QuantWeight]:
    """Every Q4_1 or Q8_0 linear weight of a llama-family GGUF file, by Hugging Face name, its
    rows in Hugging Face's output order. Weights of other kinds (F32 norms, K-quants) are left
    out: the caller keeps those in float."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    out: dict[str, QuantWeight] = {}
    for t in reader.tensors:
        kind = _KINDS.get(t.tensor_type.name)
        name = hf_name(t.name)
        if kind is None or name is None:
            continue
        rows = np.asarray(t.data)  # memory-mapped (N, K / 32 * block bytes) uint8
        in_features = int(t.shape[0])  # GGUF lists dimensions innermost first
        if rows.shape != (int(t.shape[1]), in_features // BLOCK * BLOCK_BYTES[kind]):
            raise ValueError(f"{gguf_path}: {t.name} holds {rows.shape} bytes for a {list(t.shape)} {kind} matrix")
        if ".self_attn.q_proj." in name:
            rows = unpermute_rows(rows, num_heads)
        elif ".self_attn.k_proj." in name:
            rows = unpermute_rows(rows, num_kv_heads)
        # a copy: the reader maps the file read-only, and torch wants tensors it may write
        out[name] = QuantWeight(kind, torch.from_numpy(np.array(rows, order="C")), in_features)
    return out
