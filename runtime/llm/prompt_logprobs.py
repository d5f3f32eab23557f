"""Prompt logprobs (SamplingParams.prompt_logprobs), the runner's side: for each prompt token
after the first, its logprob given the tokens before it, and the k most likely alternatives.

A prefill chunk computes the hidden state of every position it holds anyway; the model is asked
for the logits of the positions whose next token is a prompt token (their rows gathered before
the final norm and lm_head, beside the rows that sample), then the sampler's
`compute_prompt_logprobs` takes one float32 log_softmax, one gather and one topk over them, on
the device; the [rows, 1 + k] results reach the host in the step's one sync. A request adds one
slice of rows per step, never a loop over its tokens.

    prompt position   0    1    2   ...   P-2    P-1
    its logits row    predicts 1, 2, 3, ... P-1  | the first output (sampled, not a prompt logprob)

Chunked prefill: each chunk gives the rows of its own positions. Only a request's first pass over
its prompt asks (a request preempted after it sampled already has them; one preempted while
prefilling asks again from where its recompute starts, and the engine keeps what it had).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PromptRows:
    """The rows of one step that give prompt logprobs, with the prompt token each predicts."""

    rows: list[int] = field(default_factory=list)  # rows of the flattened batch
    targets: list[int] = field(default_factory=list)
    # (request id, prompt position of its first target, number of rows), in the order of `rows`.
    segments: list[tuple[str, int, int]] = field(default_factory=list)
    k: int = 0  # the most alternatives any of them asks for


def prompt_rows(pending: set[str], plan, states, row_of_last: dict[int, int]) -> PromptRows | None:
    """The rows of this step's chunks of the requests in `pending` (asking for prompt logprobs,
    their prompt not yet computed). A request whose prompt this step completes leaves `pending`.
    `row_of_last`: plan index -> row of the chunk's last token in the batch."""
    out = PromptRows()
    where = {rid: i for i, rid in enumerate(plan.req_ids)}
    for rid in list(pending):
        i = where.get(rid)
        if i is None or i not in row_of_last:
            continue  # not in this step (or refused at admission)
        st = states[i]
        start, n = plan.num_computed_tokens[i], plan.num_scheduled_tokens[i]
        ends = st.num_prompt_tokens - 1  # positions [0, ends) predict a prompt token
        m = min(start + n, ends) - start
        if m > 0:
            first_row = row_of_last[i] - n + 1
            out.rows.extend(range(first_row, first_row + m))
            out.targets.extend(st.token_ids[start + 1 : start + 1 + m])
            out.segments.append((rid, start + 1, m))
            out.k = max(out.k, st.num_prompt_logprobs)
        if start + n >= ends:
            pending.discard(rid)
            st.num_prompt_logprobs = None
    return out if out.rows else None


def split(rows: PromptRows, ids: list[list[int]], values: list[list[float]]) -> dict:
    """request id -> (first position, ids rows, values rows) of the host results; each row is
    the prompt token then the top k of the step (the engine keeps a request's own k)."""
    out = {}
    at = 0
    for rid, first, m in rows.segments:
        out[rid] = (first, ids[at : at + m], values[at : at + m])
        at += m
    return out
