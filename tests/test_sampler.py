"""Sampler: greedy, temperature, top-k / top-p support, seeded reproducibility, min_tokens."""

from __future__ import annotations

import math

import torch

from runtime.llm.sampler import Sampler, SamplingBatch, row_seed


def batch(n: int, temperature=1.0, top_k=0, top_p=1.0, seeds=None, suppress=()) -> SamplingBatch:
    return SamplingBatch(
        temperatures=[temperature] * n if isinstance(temperature, (int, float)) else list(temperature),
        top_k=[top_k] * n, top_p=[top_p] * n, seeds=list(seeds) if seeds is not None else [None] * n,
        suppress=list(suppress),
    )


def logits_from_probs(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0).repeat(rows, 1)


def test_greedy_is_argmax_and_mixed_rows_stay_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    s = Sampler()
    assert torch.equal(s(logits, batch(6, temperature=0.0)), logits.argmax(-1))
    temps = [0.0, 1.5, 0.0, 1.5, 0.0, 1.5]
    out = s(logits, batch(6, temperature=temps))
    assert torch.equal(out[0::2], logits.argmax(-1)[0::2])
    assert out.dtype == torch.int64


def test_temperature_sampling_follows_the_distribution():
    probs = [0.5, 0.25, 0.15, 0.1]
    n = 20000
    torch.manual_seed(1)
    out = Sampler()(logits_from_probs(probs, n), batch(n))
    freq = torch.bincount(out, minlength=4).float() / n
    for f, p in zip(freq.tolist(), probs):
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / n), (freq, probs)
    # Temperature 0.5 squares then renormalises the probabilities.
    out = Sampler()(logits_from_probs(probs, n), batch(n, temperature=0.5))
    sq = torch.tensor(probs) ** 2
    sq = sq / sq.sum()
    freq = torch.bincount(out, minlength=4).float() / n
    assert torch.allclose(freq, sq, atol=0.02), (freq, sq)


def test_top_k_and_top_p_restrict_the_support():
    probs = [0.05, 0.5, 0.15, 0.3]  # ranked: 1, 3, 2, 0
    n = 4000
    s = Sampler()
    torch.manual_seed(2)
    support = lambda **kw: set(s(logits_from_probs(probs, n), batch(n, **kw)).tolist())  # noqa: E731
    assert support(top_k=1) == {1}
    assert support(top_k=2) == {1, 3}
    assert support(top_p=0.5) == {1}
    assert support(top_p=0.7) == {1, 3}
    assert support(top_p=0.81) == {1, 3, 2}
    assert support() == {0, 1, 2, 3}
    # top-p applies to the top-k renormalised distribution: {1, 3} -> 0.625, 0.375.
    assert support(top_k=2, top_p=0.6) == {1}
    assert support(top_k=2, top_p=0.65) == {1, 3}


def test_top_p_beyond_the_candidate_prefix_is_exact():
    # A nearly flat 2000-token distribution: top_p=0.9 keeps ~1800 tokens, far beyond the
    # 256 candidates of the fast path. Token i ranks i-th.
    vocab, n = 2000, 3000
    logits = (-torch.arange(vocab, dtype=torch.float32) * 1e-4).repeat(n, 1)
    probs = logits[0].softmax(-1)
    keep = int(((probs.cumsum(-1) - probs) < 0.9).sum())
    assert 1500 < keep < 1900
    torch.manual_seed(3)
    out = Sampler()(logits, batch(n, top_p=0.9))
    assert keep - 20 < out.max().item() < keep  # the tail is reached, never passed
    assert len(set(out.tolist())) > 1000


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(4)
    target = torch.randn(1, 500)
    s = Sampler()
    alone = s(target, batch(1, seeds=[row_seed(42, 0)], top_p=0.95))
    for trial in range(5):
        others = torch.randn(trial + 2, 500)
        pos = trial % (trial + 2)
        rows = torch.cat([others[:pos], target, others[pos:]])
        seeds = [None] * rows.shape[0]
        seeds[pos] = row_seed(42, 0)
        out = s(rows, batch(rows.shape[0], seeds=seeds, top_p=0.95))
        assert out[pos] == alone[0]
    # Each output index draws afresh; the same index always the same.
    draws = [s(target, batch(1, seeds=[row_seed(42, i)], temperature=5.0)).item() for i in range(30)]
    assert len(set(draws)) > 5
    assert draws == [s(target, batch(1, seeds=[row_seed(42, i)], temperature=5.0)).item() for i in range(30)]


def test_min_tokens_suppression_masks_stop_ids_only_in_their_row():
    logits = torch.zeros(3, 50)
    logits[:, 7] = 100.0  # the "EOS" dominates every row
    logits[:, 9] = 50.0
    s = Sampler()
    out = s(logits, batch(3, temperature=0.0, suppress=[(1, [7])]))
    assert out.tolist() == [7, 9, 7]
    out = s(logits, batch(3, temperature=1.0, suppress=[(0, [7, 9]), (2, [7])]))
    assert out[0] not in (7, 9) and out[1] == 7 and out[2] == 9
    assert logits[0, 7] == 100.0  # the caller's logits are untouched
