"""runtime/llm/gguf_blocks.py: SmolLM2's GGUF blocks, read as shipped, are the weights the float
conversion holds, row for row (Q and K unpermuted), dequantized by gguf's own reference code."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.numpy import load_file

from runtime.llm.gguf_blocks import hf_name, read_blocks, unpermute_rows
from runtime.llm.loader import default_model_path

QTYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        config = json.load(f)
    tensors = {}
    for name in sorted(os.listdir(smollm2_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(smollm2_dir, name)))
    return config, {k.removeprefix("model."): v for k, v in tensors.items()}


def test_every_quantized_weight_dequantizes_to_the_converted_float_weights(smollm2):
    config, tensors = smollm2
    blocks = read_blocks(default_model_path(), config["num_attention_heads"], config["num_key_value_heads"])
    layers = config["num_hidden_layers"]
    assert len(blocks) == 7 * layers + 1  # every layer's seven linears and the (tied) embedding
    assert {w.kind for w in blocks.values()} == {"q4_1", "q8_0"}
    for name, w in blocks.items():
        values = dequantize(w.blocks.numpy(), QTYPES[w.kind])
        assert values.shape == (w.out_features, w.in_features)
        np.testing.assert_array_equal(values, tensors[name], err_msg=name)


def test_q_and_k_rows_need_the_unpermutation(smollm2):
    """Red without it: llama.cpp's Q row order is not Hugging Face's."""
    config, tensors = smollm2
    raw = read_blocks(default_model_path(), 1, 1)  # one head: the pairs of the whole matrix reordered
    name = "layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(dequantize(raw[name].blocks.numpy(), QTYPES["q4_1"]), tensors[name])


def test_names_and_the_permutation():
    assert hf_name("blk.12.ffn_down.weight") == "layers.12.mlp.down_proj.weight"
    assert hf_name("blk.0.attn_output.weight") == "layers.0.self_attn.o_proj.weight"
    assert hf_name("token_embd.weight") == "embed_tokens.weight"
    assert hf_name("blk.0.attn_norm.weight") is None
    rows = np.arange(8)[:, None]  # one head of 8 rows: llama.cpp holds (0, 4, 1, 5, 2, 6, 3, 7)
    assert unpermute_rows(rows, 1)[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert unpermute_rows(np.arange(8)[:, None], 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(ValueError, match="heads"):
        unpermute_rows(np.zeros((6, 1)), 2)
