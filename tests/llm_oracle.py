"""Hugging Face transformers as the oracle: greedy continuations with their logits, and the
comparison rule (token-identical, except at a near-tie that the oracle's own logits show)."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3


class Oracle:
    def __init__(self, hf_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self._cache: dict[tuple, tuple[list[int], list[torch.Tensor]]] = {}

    @torch.inference_mode()
    def greedy(self, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
        key = (tuple(ids), n)
        if key not in self._cache:
            out = self.model(torch.tensor([ids]), use_cache=True)
            past, logits = out.cache, out.logits[0, -1].float()
            tokens, all_logits = [], []
            for _ in range(n):
                all_logits.append(logits)
                t = int(logits.argmax())
                tokens.append(t)
                out = self.model(torch.tensor([[t]]), cache=past, use_cache=True)
                past, logits = out.cache, out.logits[0, -1].float()
            self._cache[key] = (tokens, all_logits)
        return self._cache[key]


def compare(ours: list[int], expected: list[int], logits: list[torch.Tensor]) -> str | None:
    """None if `ours` equals the oracle's tokens, or first differs at a near-tie (after which
    the two continuations legitimately part); otherwise a description of the mismatch."""
    for k, (a, b) in enumerate(zip(ours, expected)):
        if a == b:
            continue
        gap = float(logits[k][b] - logits[k][a])
        if gap < NEAR_TIE:
            return None
        return f"token {k}: ours {a}, Hugging Face {b}, logit gap {gap:.4g} (not a near-tie)"
    if len(ours) != len(expected):
        return f"length: ours {len(ours)}, Hugging Face {len(expected)}"
    return None
