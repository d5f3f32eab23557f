"""Speculative decoding, the runner's half: verify one step's draft tokens against the model's
own distribution at every drafted position, exactly.

A request with k drafts was computed as a (k + 1)-token chunk (its last token, then the
drafts), so the forward gave k + 1 rows of logits: row j is the model's distribution for the
token after draft j - 1. Draft j is accepted while every draft before it was:

    greedy rows   accepted iff it is the row's argmax; the first rejected position, or the row
                  after the last draft, gives the argmax. Exactly the tokens decoding one at a
                  time gives.
    sampled rows  the rejection rule for a deterministic draft (Leviathan et al., Chen et al.):
                  accept draft d with probability p(d), p the row's distribution after
                  temperature, min-p, top-k and top-p; at the first rejection sample from p
                  with d removed and renormalised (the race needs no normalising); after the
                  last draft, sample from p. Every token then follows p exactly, as without
                  speculation; the random draws differ, so the tokens do too.

Only requests whose sampling needs nothing per position beyond these parameters draft (no
penalties, grammar, logprobs, seed or stop strings, and past min_tokens: input_processor.py
says which), so nothing else changes between positions.

All rows of all requests are decided on the device in a handful of ops; the host reads two
small vectors in the step's one sync and walks at most k entries per request.
"""

from __future__ import annotations

import torch


def verify_tensors(sampler, logits: torch.Tensor, states: list, drafts: list[list[int]]):
    """(accept [rows] bool, token [rows] int64) for the rows of `logits` [sum(len(d) + 1),
    vocab]: whether row j's draft (the request's draft j) is accepted, and the token the row
    gives when its draft is rejected (or, on a request's last row, its bonus token)."""
    dev = logits.device
    draft_col: list[int] = []
    temps: list[float] = []
    for st, d in zip(states, drafts):
        draft_col += d
        draft_col.append(-1)  # the bonus row has no draft
        temps += [st.temperature] * (len(d) + 1)
    draft_t = torch.tensor(draft_col, dtype=torch.long, device=dev)
    argmax = logits.argmax(dim=-1)
    accept = argmax == draft_t
    sampled = [j for j, t in enumerate(temps) if t != 0]
    if not sampled:
        return accept, argmax
    rows: list[int] = []
    top_k: list[int] = []
    top_p: list[float] = []
    min_p: list[float] = []
    for st, d in zip(states, drafts):
        rows += [st.temperature != 0] * (len(d) + 1)
        top_k += [st.top_k] * (len(d) + 1)
        top_p += [st.top_p] * (len(d) + 1)
        min_p += [st.min_p] * (len(d) + 1)
    idx = torch.tensor(sampled, dtype=torch.long, device=dev)
    pick = [j for j, r in enumerate(rows) if r]
    probs = sampler.probabilities(
        logits.index_select(0, idx).float(),
        [temps[j] for j in pick],
        [top_k[j] for j in pick],
        [top_p[j] for j in pick],
        [min_p[j] for j in pick],
    )
    probs = probs / probs.sum(dim=-1, keepdim=True)  # top-k / top-p left them unnormalised
    d = draft_t.index_select(0, idx)
    has = d >= 0
    safe = d.clamp(min=0).unsqueeze(1)
    p_draft = probs.gather(1, safe).squeeze(1)
    ok = (sampler.uniform(len(sampled), dev) < p_draft) & has
    residual = probs.scatter(1, safe, torch.where(has, 0.0, p_draft).unsqueeze(1))
    token = sampler.race(residual)
    return accept.index_copy(0, idx, ok), argmax.index_copy(0, idx, token)


def accepted_tokens(accept: list[bool], token: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Each request's new tokens from the host copies of verify_tensors' vectors: its drafts up
    to the first rejected one, then the token of that row (or of its bonus row)."""
    out: list[list[int]] = []
    at = 0
    for d in drafts:
        k = len(d)
        j = 0
        while j < k and accept[at + j]:
            j += 1
        out.append(d[:j] + [token[at + j]])
        at += k + 1
    return out
