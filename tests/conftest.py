"""Shared fixtures: the real SmolLM2 (converted once from its GGUF, then cached) and a tiny
random Llama that uses SmolLM2's tokenizer, for fast tests."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines the tests start stay eager unless a test asks for the captured step (EngineConfig
# enforce_eager): a compile per engine would cost minutes of the suite. Worker and server
# processes the tests start inherit it.
os.environ.setdefault("TANDEM_ENFORCE_EAGER", "1")

# The Triton kernels' tests run on CPU in Triton's interpreter. The flag must be set before
# anything imports triton: triton.language's own helpers (tl.zeros, tl.sum, ...) are decorated
# once, at import, for the mode the flag names then.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test modules import Ultralytics at collection; without this, its OMP_NUM_THREADS=1 default
# would make every torch op of the session single-threaded.
from runtime.vision.ultralytics_import import import_ultralytics

import_ultralytics()


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from runtime.llm.loader import resolve_hf_dir

    hf_dir, _ = resolve_hf_dir(None)
    return hf_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out)


VISION_IMGSZ = 320


def calibrated_yolo():
    """A fresh YOLO26n (seeded random weights) calibrated on bus.jpg and zidane.jpg, so that
    comparisons see hundreds of distinct detections (see runtime/vision/calibrate.py). Each
    test module builds its own: Ultralytics' predict may fuse the model in place."""
    import cv2
    import torch
    from ultralytics import YOLO
    from ultralytics.utils import ASSETS

    from runtime.vision.calibrate import calibrate

    torch.manual_seed(0)
    model = YOLO("yolo26n.yaml")
    calibrate(model.model, [cv2.imread(str(ASSETS / n)) for n in ("bus.jpg", "zidane.jpg")], VISION_IMGSZ)
    return model
