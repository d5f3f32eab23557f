"""Sampler: greedy, temperature, top-k / top-p support, seeded reproducibility, min_tokens."""

from __future__ import annotations

import math

import torch

from runtime.llm.sampler import Sampler, SamplingBatch, row_seed


def batch(n: int, temperature=1.0, top_k=0, top_p=1.0, seeds=None, suppress=()) -> SamplingBatch:
    return SamplingBatch(
        temperatures=[temperature] * n if isinstance(temperature, (int, float)) else list(temperature),
        top_k=[top_k] * n,
        top_p=[top_p] * n,
        seeds=list(seeds) if seeds is not None else [None] * n,
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


# --- the exponential race (issue 10) ---------------------------------------------------------


def _allowed(logits_row: torch.Tensor, temperature: float, k: int, p: float) -> set[int]:
    """Reference support of one row, by a full sort: top-k, then top-p on the renormalised
    top-k distribution, ties with the threshold kept, at least one token."""
    probs = (logits_row / temperature).softmax(-1).double()
    vals, order = probs.sort(descending=True)
    n = len(vals) if not 0 < k < len(vals) else k
    kept = vals[:n] / vals[:n].sum()
    before = kept.cumsum(0) - kept
    m = max(1, int((before < p).sum())) if p < 1.0 else n
    return set(torch.nonzero(probs >= vals[m - 1] * (1 - 1e-6)).squeeze(1).tolist())


def test_seeded_rows_are_reproducible_across_batch_compositions_and_orders():
    torch.manual_seed(5)
    vocab = 300
    # (temperature, top_k, top_p): temperature only, top-k, top-p, both, and a second temperature.
    params = [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8), (1.0, 40, 0.9), (2.0, 0, 1.0)]
    targets = torch.randn(len(params), vocab) * 2
    s = Sampler()

    def run(rows, temps, ks, ps, seeds):
        return s(rows, SamplingBatch(temperatures=temps, top_k=ks, top_p=ps, seeds=seeds))

    for index in range(4):  # four output indices: each draws afresh
        alone = [
            run(targets[i : i + 1], [t], [k], [p], [row_seed(100 + i, index)]).item()
            for i, (t, k, p) in enumerate(params)
        ]
        for trial in range(6):
            g = torch.Generator().manual_seed(trial)
            extra = int(torch.randint(0, 5, (), generator=g))
            # Neighbours: greedy, unseeded and other-seeded rows with their own parameters.
            others = torch.randn(extra, vocab, generator=g)
            o_params = [
                ((0.0, 0, 1.0), None),
                ((0.9, 5, 1.0), None),
                ((1.0, 0, 0.5), row_seed(7, trial)),
                ((0.0, 0, 1.0), row_seed(8, 0)),
                ((1.5, 100, 0.95), None),
            ][:extra]
            rows = [(targets[i], params[i], row_seed(100 + i, index), i) for i in range(len(params))]
            rows += [(others[j], o_params[j][0], o_params[j][1], None) for j in range(extra)]
            order = torch.randperm(len(rows), generator=g).tolist()
            rows = [rows[o] for o in order]
            out = run(
                torch.stack([r[0] for r in rows]),
                [r[1][0] for r in rows],
                [r[1][1] for r in rows],
                [r[1][2] for r in rows],
                [r[2] for r in rows],
            )
            got = {r[3]: out[pos].item() for pos, r in enumerate(rows) if r[3] is not None}
            assert got == dict(enumerate(alone)), (index, trial)
    # Different output indices give different tokens (flat enough rows), the same index the same.
    flat = torch.zeros(1, 50)
    draws = [run(flat, [1.0], [0], [1.0], [row_seed(3, i)]).item() for i in range(40)]
    assert len(set(draws)) > 15
    assert draws == [run(flat, [1.0], [0], [1.0], [row_seed(3, i)]).item() for i in range(40)]


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_one_matches_the_softmax_chi_square():
    # 20k draws over 6 tokens, 5 degrees of freedom: chi2 > 30 has probability ~1.5e-5.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -3.0])
    probs = logits.double().softmax(-1)
    n = 20000
    torch.manual_seed(6)
    out = Sampler()(logits.repeat(n, 1), batch(n))
    assert _chi2(torch.bincount(out, minlength=6).double(), probs) < 30
    # Seeded rows (one generator per row and output index) follow the same law.
    seeds = [row_seed(11, i) for i in range(n)]
    out = Sampler()(logits.repeat(n, 1), batch(n, seeds=seeds))
    assert _chi2(torch.bincount(out, minlength=6).double(), probs) < 30
    # Temperature 2 on a homogeneous batch, and per-row temperatures (greedy rows interleaved).
    out = Sampler()(logits.repeat(n, 1), batch(n, temperature=2.0))
    assert _chi2(torch.bincount(out, minlength=6).double(), (logits.double() / 2).softmax(-1)) < 30
    temps = [0.0 if i % 4 == 0 else 0.5 for i in range(n)]
    out = Sampler()(logits.repeat(n, 1), batch(n, temperature=temps))
    assert (out[0::4] == 0).all()
    mask = torch.tensor([t > 0 for t in temps])
    assert _chi2(torch.bincount(out[mask], minlength=6).double(), (logits.double() / 0.5).softmax(-1)) < 30


def test_top_k_then_top_p_is_the_renormalised_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -3.0])
    n = 20000
    torch.manual_seed(7)
    # top-k = 3: tokens 0..2 renormalised.
    out = Sampler()(logits.repeat(n, 1), batch(n, top_k=3))
    counts = torch.bincount(out, minlength=6).double()
    assert counts[3:].sum() == 0
    assert _chi2(counts[:3], logits[:3].double().softmax(-1)) < 30
    # top-k = 4, then top-p = 0.8 of the renormalised four: 0.53, 0.20, 0.12, ... -> tokens 0..2.
    out = Sampler()(logits.repeat(n, 1), batch(n, top_k=4, top_p=0.8))
    counts = torch.bincount(out, minlength=6).double()
    assert _allowed(logits, 1.0, 4, 0.8) == {0, 1, 2}
    assert counts[3:].sum() == 0
    assert _chi2(counts[:3], logits[:3].double().softmax(-1)) < 30


def test_top_k_and_top_p_never_emit_excluded_tokens_in_a_mixed_batch():
    torch.manual_seed(8)
    vocab, rows = 3000, 64
    logits = torch.randn(rows, vocab) * 3
    logits[::7] = torch.randn(len(range(0, rows, 7)), vocab) * 0.01  # near-flat rows: the full-sort fallback
    g = torch.Generator().manual_seed(9)
    ks = [[0, 1, 5, 50, 300, vocab + 10][int(i)] for i in torch.randint(0, 6, (rows,), generator=g)]
    ps = [[1.0, 0.3, 0.9, 0.99][int(i)] for i in torch.randint(0, 4, (rows,), generator=g)]
    temps = [[0.0, 0.5, 1.0, 1.7][int(i)] for i in torch.randint(0, 4, (rows,), generator=g)]
    seeds = [row_seed(i, 0) if i % 3 == 0 else None for i in range(rows)]
    allowed = [_allowed(logits[i], temps[i] or 1.0, ks[i], ps[i]) for i in range(rows)]
    s = Sampler()
    for _ in range(30):
        out = s(logits, SamplingBatch(temperatures=temps, top_k=ks, top_p=ps, seeds=seeds)).tolist()
        for i, tok in enumerate(out):
            if temps[i] == 0:
                assert tok == int(logits[i].argmax())
            else:
                assert tok in allowed[i], (i, ks[i], ps[i], temps[i])
    # top-k alone, mixed with unlimited rows (the gather path) and homogeneous.
    for kk in ([3, 0, 10, 1] * 16, [7] * rows):
        out = s(
            logits, SamplingBatch(temperatures=[1.0] * rows, top_k=kk, top_p=[1.0] * rows, seeds=[None] * rows)
        ).tolist()
        for i, tok in enumerate(out):
            assert tok in _allowed(logits[i], 1.0, kk[i], 1.0)


def test_greedy_rows_are_argmax_and_leave_every_generator_alone(monkeypatch):
    torch.manual_seed(10)
    logits = torch.randn(8, 500)
    s = Sampler()
    state = torch.get_rng_state()

    def no_softmax(*a, **kw):
        raise AssertionError("an all-greedy batch computed a softmax")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "softmax", no_softmax)
        m.setattr(torch, "softmax", no_softmax)
        seeds = [row_seed(1, 0), None] * 4  # seeded greedy rows draw nothing either
        assert torch.equal(s(logits, batch(8, temperature=0.0, seeds=seeds)), logits.argmax(-1))
        assert torch.equal(s(logits, batch(8, temperature=0.0, top_k=5, top_p=0.5)), logits.argmax(-1))
    assert torch.equal(torch.get_rng_state(), state)
    # Mixed: greedy rows are the argmax; with only seeded sampled rows the global RNG is untouched.
    temps = [0.0, 1.0, 0.0, 0.8, 0.0, 1.0, 0.0, 1.2]
    seeds = [None, row_seed(2, 0), None, row_seed(3, 0), None, row_seed(4, 0), None, row_seed(5, 0)]
    out = s(logits, batch(8, temperature=temps, seeds=seeds))
    assert torch.equal(out[0::2], logits.argmax(-1)[0::2])
    assert torch.equal(torch.get_rng_state(), state)


def test_plain_sampling_uses_no_cumsum_sort_or_host_sync(monkeypatch):
    def forbidden(name):
        def f(*a, **kw):
            raise AssertionError(f"{name} on the sampler's plain path")

        return f

    torch.manual_seed(11)
    logits = torch.randn(6, 4096)
    s = Sampler()
    cases = [
        batch(6),  # temperature 1
        batch(6, temperature=0.7, seeds=[row_seed(1, 0), None] * 3),
        batch(6, temperature=[0.0, 1.0, 0.5, 0.0, 2.0, 1.0]),
        batch(6, top_k=50),
        SamplingBatch(
            temperatures=[1.0] * 6,
            top_k=[0, 5, 50, 0, 1, 4096],
            top_p=[1.0] * 6,
            seeds=[None] * 6,
            suppress=[(1, [3, 4])],
        ),
    ]
    with monkeypatch.context() as m:
        for name in ("cumsum", "sort", "argsort", "searchsorted"):
            m.setattr(torch, name, forbidden(f"torch.{name}"))
            if hasattr(torch.Tensor, name):
                m.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}"))
        for name in ("item", "tolist", "__bool__"):
            m.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}"))
        outs = [s(logits, b) for b in cases]
    for o in outs:
        assert o.shape == (6,) and o.dtype == torch.int64
    # top-p whose candidates reach the mass: a cumsum over the candidates, never a full sort.
    peaked = torch.randn(6, 4096) * 8
    with monkeypatch.context() as m:
        m.setattr(torch, "sort", forbidden("torch.sort"))
        m.setattr(torch.Tensor, "sort", forbidden("Tensor.sort"))
        s(peaked, batch(6, top_p=0.9))
        s(peaked, batch(6, top_k=20, top_p=0.9))


def test_top_p_falls_back_to_a_full_sort_only_for_short_rows(monkeypatch):
    torch.manual_seed(12)
    logits = torch.randn(4, 4096) * 8  # peaked: the 256 candidates reach p
    logits[2] = 0.0  # flat: they do not
    sorted_rows = []
    real_sort = torch.Tensor.sort

    def spy(self, *a, **kw):
        sorted_rows.append(self.shape[0])
        return real_sort(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "sort", spy)
    out = Sampler()(logits, batch(4, top_p=0.9))
    assert sorted_rows == [1]
    assert 0 <= out[2] < 4096


def test_extreme_uniforms_never_pick_an_excluded_token(monkeypatch):
    # The race draws U in [tiny, 1) (uniform_ excludes its upper bound): at either end every
    # kept token must still beat every excluded one (no NaN from 0 / 0, no all -inf row whose
    # argmax falls on token 0).
    logits = torch.randn(4, 1000)
    logits[:, 0] = -50.0  # token 0 is excluded by every limit below
    real_uniform = torch.Tensor.uniform_
    for end in ("low", "high"):

        def pinned(self, lo=0.0, hi=1.0, *, generator=None, _end=end):
            real_uniform(self, lo, hi, generator=generator)
            return self.fill_(lo if _end == "low" else 1.0 - 2.0**-24)  # the largest float32 below 1

        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "uniform_", pinned)
            for kw in (dict(top_k=1), dict(top_k=3), dict(top_p=0.01), dict(top_k=5, top_p=0.5)):
                out = Sampler()(logits, batch(4, seeds=[None, row_seed(1, 0), None, row_seed(2, 0)], **kw))
                assert (out != 0).all(), (end, kw, out)
                if kw.get("top_k") == 1 or kw.get("top_p") == 0.01:
                    assert torch.equal(out, logits.argmax(-1))
