"""Batched next-token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds,
min_tokens, repetition / presence / frequency penalties, and logprobs.

One pass over the [num_rows, vocab] logits for the whole batch; no loop over tokens.

    greedy rows  argmax of the (min_tokens-masked) logits; no softmax, no random numbers
    other rows   softmax(logits / temperature), probabilities below min_p * the row's largest
                 zeroed (vLLM's order: min-p after temperature, before top-k / top-p, which then
                 see the renormalised rest), probabilities below the row's top-k / top-p
                 threshold zeroed, then the exponential race: token = argmax(p / E) with
                 E = -log U ~ Exponential(1) drawn per token (computed as argmax(log U / p)).
                 E / p is an exponential of rate p, and the first to arrive is token j with
                 probability p_j / sum(p): the law of inverse-CDF sampling (and the Gumbel-max
                 trick), with no cumulative sum over the vocabulary and no renormalisation
                 after top-k / top-p.

A mixed batch samples only its non-greedy rows (gathered), so greedy rows never touch a
generator. Thresholds come from a partial top-k over the probabilities (sorting 50k-entry
rows is ~20x slower): top-k alone reads the k-th largest value; top-p runs over the top
candidates, and a top-p row whose candidates do not reach its mass falls back to a full sort,
so the result is exact either way. Tokens tied with the threshold stay in.

A seeded row draws its noise from its own generator, re-seeded from (seed, output index) for
every token, so its tokens are the same whatever else shares the batch (and in whatever row),
and even when a preemption replays the request. Unseeded rows share one draw from the
sampler's own generator, seeded once from the OS: never torch's global one, which other work in
the process may save and restore (torch.compile does, around every compile, so a compile on
another thread would replay draws already used).

Host syncs: none on the common paths. Per-row parameters go to the device in pinned,
non-blocking copies. The one that remains is the top-p fallback check (`bool(short.any())`),
taken only when some row has top-p without top-k: whether a full sort is needed depends on the
probabilities.

Penalties read per-request token statistics kept on the device (PenaltyState): which tokens
the prompt and output hold, and how often each was sampled. They are applied to the logits
first (before min_tokens and temperature) and updated from the sampled tokens on the device,
so they add no host sync and no Python loop over tokens.

Logprobs (`logprobs`), for the rows that ask only, come from the raw logits, before penalties,
min_tokens masking and temperature (vLLM's default, "raw_logprobs"): one float32 log_softmax
over those rows, one gather of the sampled tokens and one topk for the largest k asked; the
small [rows, k + 1] results reach the host in the step's one sync (`to_host`). Prompt
logprobs (`compute_prompt_logprobs`) are the same three ops over the rows of the prompt's
positions (runtime/llm/prompt_logprobs.py), in the same sync.

Constrained decoding (structured outputs, runtime/llm/structured.py): the rows of
`SamplingBatch.grammar_rows` get their allowed-token bitmask applied to the logits in
`Sampler.__call__`, after the penalties and before `_sample` (so that greedy, min_tokens
suppression and the race all see it): an unpack of the int32 words and one `where` over those
rows on the logits' device, no loop over tokens and no host sync (the host mask is pinned on
CUDA and copied non-blocking). A batch without grammar rows skips it and costs nothing more.
Never applied to the logits `logprobs` reads: those stay raw, as vLLM reports them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from runtime.llm.structured import apply_token_bitmask

_MASK63 = (1 << 63) - 1
_CANDIDATES = 256  # top-p candidates taken per row before falling back to a full sort
_TINY = torch.finfo(torch.float32).tiny  # lower bound of the race's uniforms: log(U) stays finite


_SEED_MUL = 0x9E3779B97F4A7C15
_INDEX_MUL = 0xBF58476D1CE4E5B9


def row_seed(seed: int, output_index: int) -> int:
    """The generator seed for a seeded request's `output_index`-th sampled token."""
    return (seed * _SEED_MUL + output_index * _INDEX_MUL + 1) & _MASK63


def resumed_seed(seed: int, tokens_done: int) -> int:
    """The seed under which a request's k-th token draws what `seed`'s (tokens_done + k)-th
    would: a job resumed after `tokens_done` tokens (its worker died) continues the same random
    stream, so a seeded job's tokens do not depend on a restart. row_seed is affine in the seed
    and the multiplier is odd, so it has an inverse modulo 2**63.

    Kept for callers that still resubmit earlier outputs as plain prompt. A request submitted
    with `num_resumed_outputs=n` (LLMEngine.prepare) continues at output index n by itself and
    takes the original seed: shifting it here too would skip n draws."""
    inverse = pow(_SEED_MUL, -1, 1 << 63)
    return (seed + tokens_done * _INDEX_MUL * inverse) & _MASK63


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`: pinned and non-blocking for CUDA, so the host
    does not wait for the device queue to drain (a plain copy from pageable memory would)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters for one step, parallel to the logits rows."""

    temperatures: list[float]  # 0 = greedy
    top_k: list[int]  # 0 = no limit
    top_p: list[float]  # 1.0 = no limit
    seeds: list[int | None]  # already mixed with the output index (row_seed); None = unseeded
    # (row, token ids) pairs whose logits become -inf: stop tokens before min_tokens outputs.
    suppress: list[tuple[int, list[int]]] = field(default_factory=list)
    # (row, request id) for rows whose request has penalties (PenaltyState knows its stats).
    penalized: list[tuple[int, str]] = field(default_factory=list)
    min_p: list[float] | None = None  # per row, 0 = off; None = off for every row
    # (row, k) for rows that want logprobs: the sampled token's and the top k alternatives'.
    logprobs: list[tuple[int, int]] = field(default_factory=list)
    # Rows held to a grammar, and their allowed tokens: grammar_mask[k] (host int32 [>= rows,
    # ceil(vocab / 32)], structured.py's layout) is the mask of row grammar_rows[k].
    grammar_rows: list[int] = field(default_factory=list)
    grammar_mask: torch.Tensor | None = None


@dataclass(slots=True)
class Logprobs:
    """Device tensors for the rows of `SamplingBatch.logprobs`, in that order: `token_ids`
    [rows, 1 + k] int64 and `logprobs` [rows, 1 + k] float32, column 0 the sampled token,
    then the top k (k the largest asked; a row that asked fewer reads a prefix)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[tuple[int, int]]) -> Logprobs:
    """Log-probabilities of the sampled `tokens` [all rows] and the top k, from the raw
    `logits` [all rows, vocab], for the (row, k) pairs `rows` only: no host sync."""
    dev = logits.device
    idx = _to_device([r for r, _ in rows], torch.long, dev)
    lp = logits.index_select(0, idx).float().log_softmax(dim=-1)
    sampled = tokens.index_select(0, idx).unsqueeze(1)
    k = max(k for _, k in rows)
    if k == 0:
        return Logprobs(sampled, lp.gather(1, sampled))
    # topk's order among tied values is unspecified; ties are rare in float32 logits.
    top = lp.topk(k, dim=-1)
    return Logprobs(torch.cat([sampled, top.indices], 1), torch.cat([lp.gather(1, sampled), top.values], 1))


def compute_prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> Logprobs:
    """Prompt logprobs: row j of the raw `logits` [rows, vocab] predicts prompt token
    `targets[j]`; its float32 logprob, then the top k, as compute_logprobs gives a sampled
    token's. One log_softmax, one gather, one topk over all rows: no host sync."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = _to_device(targets, torch.long, logits.device).unsqueeze(1)
    if k == 0:
        return Logprobs(chosen, lp.gather(1, chosen))
    top = lp.topk(k, dim=-1)
    return Logprobs(torch.cat([chosen, top.indices], 1), torch.cat([lp.gather(1, chosen), top.values], 1))


def to_host(*tensors: torch.Tensor) -> list[list]:
    """`.tolist()` of each tensor with one host sync in all: on CUDA every copy is queued
    non-blocking (into pinned memory) and one stream synchronize waits for them together."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [t.tolist() for t in host]


def _thresholds(sorted_probs: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability kept by top-k then top-p (applied to the top-k
    renormalized distribution, as Hugging Face and vLLM do). `sorted_probs` [rows, n] descending
    (n >= every active k); k = 0 and p = 1 mean no limit."""
    n = sorted_probs.shape[1]
    rank = torch.arange(n, device=sorted_probs.device).unsqueeze(0)
    in_k = (rank < ks.unsqueeze(1)) | (ks.unsqueeze(1) == 0)
    kept = sorted_probs * in_k
    # Rows without top-k keep their full-vocabulary normalisation (their candidates may be a prefix).
    norm = torch.where(ks > 0, kept.sum(-1), 1.0).unsqueeze(1)
    probs = kept / norm
    before = probs.cumsum(-1) - probs  # mass ranked above each token
    keep = in_k & ((before < ps.unsqueeze(1)) | (ps.unsqueeze(1) >= 1.0))
    last = keep.sum(-1).clamp(min=1) - 1
    smallest = sorted_probs.gather(1, last.unsqueeze(1)).squeeze(1)
    return torch.where((ks > 0) | (ps < 1.0), smallest, 0.0)


class PenaltyState:
    """Per-request token statistics for the penalties, one row ("slot") per request that
    has any, in tensors on the logits' device:

        seen    [slots, vocab] bool     token is in the prompt or the output (repetition)
        counts  [slots, vocab] float32  times the token was sampled (presence, frequency)
        rep, presence, frequency  [slots]  the request's parameters

    Rows are allocated on add() and reused after remove(); the tensors double when full.
    Only requests with penalties take a row, so others cost nothing.
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._alloc(0)

    def _alloc(self, capacity: int) -> None:
        old = getattr(self, "seen", None)
        n, v, dev = capacity, self.vocab_size, self.device
        seen = torch.zeros(n, v, dtype=torch.bool, device=dev)
        counts = torch.zeros(n, v, dtype=torch.float32, device=dev)
        params = torch.zeros(3, n, dtype=torch.float32, device=dev)  # repetition, presence, frequency
        if old is not None and old.shape[0]:
            k = old.shape[0]
            seen[:k], counts[:k], params[:, :k] = self.seen, self.counts, self.params
        self.seen, self.counts, self.params = seen, counts, params
        self._free.extend(range(n - 1, (old.shape[0] if old is not None else 0) - 1, -1))

    def __len__(self) -> int:
        return len(self._slot)

    def add(
        self,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        repetition: float,
        presence: float,
        frequency: float,
    ) -> None:
        """Start tracking a request from its tokens so far (a replayed request brings its
        earlier outputs, which count as sampled)."""
        if request_id in self._slot:
            self.remove(request_id)
        if not self._free:
            self._alloc(max(4, 2 * self.seen.shape[0]))
        slot = self._free.pop()
        self._slot[request_id] = slot
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        self.seen[slot].zero_()
        self.seen[slot, ids] = True
        self.counts[slot].zero_()
        out = ids[num_prompt_tokens:]
        self.counts[slot].index_add_(0, out, torch.ones(out.shape[0], device=self.device))
        self.params[:, slot] = torch.tensor([repetition, presence, frequency], device=self.device)

    def remove(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        for rid in list(self._slot):
            self.remove(rid)

    def slots(self, request_ids: list[str]) -> torch.Tensor:
        return _to_device([self._slot[rid] for rid in request_ids], torch.long, self.device)

    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Penalized copy of `logits` [len(slots), vocab]."""
        rep, presence, frequency = (p.unsqueeze(1) for p in self.params[:, slots])
        seen, counts = self.seen[slots], self.counts[slots]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - frequency * counts - presence * (counts > 0)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count the tokens just sampled, on the device (no host sync)."""
        self.counts.index_put_((slots, token_ids), torch.ones_like(token_ids, dtype=torch.float32), accumulate=True)
        self.seen[slots, token_ids] = True


class Sampler:
    def __init__(self, vocab_size: int = 0, device: torch.device | str = "cpu") -> None:
        self._generators: dict[torch.device, torch.Generator] = {}  # seeded rows, per device
        self._unseeded: dict[torch.device, torch.Generator] = {}  # unseeded rows, per device
        self.penalties = PenaltyState(vocab_size, device)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [rows, vocab] float32 (left unchanged); returns token ids [rows] int64."""
        pen_rows = pen_slots = None
        if batch.penalized:
            pen_rows = _to_device([r for r, _ in batch.penalized], torch.long, logits.device)
            pen_slots = self.penalties.slots([rid for _, rid in batch.penalized])
            logits = logits.clone()
            logits[pen_rows] = self.penalties.apply(logits[pen_rows], pen_slots)
        if batch.grammar_rows:
            if pen_rows is None:  # the caller's logits stay raw (logprobs read them)
                logits = logits.clone()
            apply_token_bitmask(logits, batch.grammar_mask, batch.grammar_rows)
        tokens = self._sample(logits, batch)
        if pen_rows is not None:
            self.penalties.record(pen_slots, tokens[pen_rows])
        return tokens

    def _unseeded_generator(self, device: torch.device) -> torch.Generator:
        gen = self._unseeded.get(device)
        if gen is None:
            gen = self._unseeded[device] = torch.Generator(device=device)
            gen.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        return gen

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        return gen

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        dev = logits.device
        if batch.suppress:
            logits = logits.clone()
            rc = [[r for r, toks in batch.suppress for _ in toks], [t for _, toks in batch.suppress for t in toks]]
            idx = _to_device(rc, torch.long, dev)
            logits[idx[0], idx[1]] = float("-inf")
        temps = batch.temperatures
        rows = [i for i, t in enumerate(temps) if t != 0]
        if not rows:
            return logits.argmax(dim=-1)
        min_p = batch.min_p or [0.0] * len(temps)
        if len(rows) == len(temps):
            return self._draw(logits, temps, batch.top_k, batch.top_p, batch.seeds, min_p)
        # Mixed: greedy rows take the argmax; only the others are sampled (and draw noise).
        idx = _to_device(rows, torch.long, dev)
        sampled = self._draw(
            logits.index_select(0, idx),
            [temps[i] for i in rows],
            [batch.top_k[i] for i in rows],
            [batch.top_p[i] for i in rows],
            [batch.seeds[i] for i in rows],
            [min_p[i] for i in rows],
        )
        return logits.argmax(dim=-1).index_copy_(0, idx, sampled)

    def _draw(
        self,
        logits: torch.Tensor,
        temps: list[float],
        top_k: list[int],
        top_p: list[float],
        seeds: list[int | None],
        min_p: list[float],
    ) -> torch.Tensor:
        """Sample every row of `logits` (all temperatures > 0) by the exponential race."""
        dev = logits.device
        probs = self.probabilities(logits, temps, top_k, top_p, min_p)
        # E = -log U with U uniform in [tiny, 1): E is Exponential(1), finite and > 0, so
        # log(U) / p is finite and < 0 for every kept token and -inf for an excluded one (p = 0),
        # never NaN; its argmax is the argmin of E / p, the winner of the race. (On CPU, uniform_
        # then log_ costs a sixth of exponential_.)
        noise = torch.empty_like(probs)
        if any(s is None for s in seeds):
            # Every unseeded row in one draw (seeded rows are overwritten below).
            noise.uniform_(_TINY, 1.0, generator=self._unseeded_generator(dev))
        for i, seed in enumerate(seeds):  # one small draw per seeded row, from its own seed
            if seed is not None:
                gen = self._generator(dev)
                gen.manual_seed(seed)
                noise[i].uniform_(_TINY, 1.0, generator=gen)
        return noise.log_().div_(probs).argmax(dim=-1)

    def probabilities(
        self, logits: torch.Tensor, temps: list[float], top_k: list[int], top_p: list[float], min_p: list[float]
    ) -> torch.Tensor:
        """The distribution each row samples from (temperatures > 0): softmax(logits / T), then
        min-p, top-k and top-p zero what they exclude (not renormalised: the race needs no
        sum, and speculation's verification divides by it where it must)."""
        dev = logits.device
        # Multiply by 1/T, the same float32 product whether T is shared (a scalar) or per row
        # (a tensor), so a seeded row's probabilities do not depend on its neighbours.
        inv = [1.0 / t for t in temps]
        if all(x == inv[0] for x in inv):
            scaled = logits if inv[0] == 1.0 else logits * inv[0]
        else:
            scaled = logits * _to_device(inv, torch.float32, dev).unsqueeze(1)
        probs = scaled.softmax(dim=-1)  # a fresh tensor: the steps below work in place
        if any(m > 0 for m in min_p):
            self._min_p(probs, min_p)
        self._restrict(probs, top_k, top_p)
        return probs

    def race(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of (unnormalised) `probs` by the exponential race (see _draw)."""
        dev = probs.device
        noise = torch.empty_like(probs)
        noise.uniform_(_TINY, 1.0, generator=self._unseeded_generator(dev))
        return noise.log_().div_(probs).argmax(dim=-1)

    def uniform(self, n: int, device: torch.device) -> torch.Tensor:
        """`n` uniforms in [0, 1) from the unseeded generator."""
        return torch.rand(n, device=device, generator=self._unseeded_generator(device))

    @staticmethod
    def _min_p(probs: torch.Tensor, min_p: list[float]) -> None:
        """Zero, in place, probabilities below min_p * the row's largest, and renormalise those
        rows so that top-p measures the mass of what is left (as vLLM, which masks the logits
        and takes a fresh softmax). Rows with min_p = 0 are divided by exactly 1: their
        probabilities, hence a seeded row's tokens, do not depend on their neighbours."""
        mp = _to_device(min_p, torch.float32, probs.device).unsqueeze(1)
        probs.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * mp, 0.0)
        probs.div_(torch.where(mp > 0, probs.sum(dim=-1, keepdim=True), 1.0))

    @staticmethod
    def _restrict(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Zero, in place, the probabilities outside each row's top-k / top-p set."""
        vocab = probs.shape[1]
        kl = [k if 0 < k < vocab else 0 for k in top_k]
        use_p = any(p < 1.0 for p in top_p)
        if not use_p and not any(kl):
            return probs
        dev = probs.device
        if not use_p:
            # top-k only: the k-th largest probability is the threshold; no sort, no cumsum.
            kmax = max(kl)
            top = probs.topk(kmax, dim=-1).values  # sorted, descending
            if all(k == kmax for k in kl):
                thr = top[:, -1:]
            else:
                ks = _to_device([max(k, 1) - 1 for k in kl], torch.long, dev).unsqueeze(1)
                off = _to_device([k == 0 for k in kl], torch.bool, dev).unsqueeze(1)
                thr = top.gather(1, ks).masked_fill_(off, 0.0)
            return probs.masked_fill_(probs < thr, 0.0)
        ks = _to_device(kl, torch.long, dev)
        ps = _to_device(top_p, torch.float32, dev)
        n = min(vocab, max(max(kl), _CANDIDATES))
        top = probs.topk(n, dim=-1).values
        thr = _thresholds(top, ks, ps)
        if n < vocab and any(k == 0 and p < 1.0 for k, p in zip(kl, top_p)):
            # A top-p row (without top-k) whose candidates hold less mass than p needs them all.
            # The one host sync of the sampler: only the probabilities say whether it is needed.
            short = (ks == 0) & (ps < 1.0) & (top.sum(-1) < ps)
            if bool(short.any()):
                idx = short.nonzero().squeeze(1)
                full = probs[idx].sort(dim=-1, descending=True).values
                thr[idx] = _thresholds(full, ks[idx], ps[idx])
        return probs.masked_fill_(probs < thr.unsqueeze(1), 0.0)
