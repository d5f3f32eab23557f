"""Parallel sampling (SamplingParams.n > 1, best_of): one prompt, several choices, as vLLM's
ParentRequest, with the prompt computed once.

The engine turns such a request into one request per choice, `<request id>#<index>`, each with
its own parameters (`choice_params`: its seed is choice_seed(seed, index), the server's
derivation, so a choice's tokens are those of a single request with that seed). Choice 0 leads:
the scheduler queues and prefills it alone, and forks the others from it in the step that
computes the last of the prompt (schedulers/continuous.py): they share its prompt's KV blocks
and sample their first tokens from its logits. From there each choice is an ordinary request
(its own detokenizer, stop strings, grammar, preemption), and this ParentRequest gathers them:

  - streamed (a sink, and best_of == n): each choice's output goes on as the request's, with
    `completions` holding that choice alone (its index and deltas);
  - finished once every choice is: `completions` holds the n choices whole (best_of > n: the n
    of highest cumulative logprob, best first, re-indexed), and the top-level fields are the
    first one's. A choice that fails fails the request: the engine aborts the others with its
    error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from runtime.llm.input_processor import PreparedRequest
from runtime.llm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from runtime.llm.sampling_params import SamplingParams, choice_seed

Sink = Callable[[RequestOutput], None]


def choice_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters: one completion, with its own seed; prompt logprobs on choice
    0 alone (the one that computes the prompt); and, when best_of ranks the choices, the logprob
    of each sampled token (their sum ranks it; they are not reported unless asked)."""
    ranked = params.num_choices > params.n
    return replace(
        params,
        n=1,
        best_of=None,
        seed=None if params.seed is None else choice_seed(params.seed, index),
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
        logprobs=0 if ranked and params.logprobs is None else params.logprobs,
    )


class ParentRequest:
    def __init__(self, p: PreparedRequest, sink: Sink | None) -> None:
        params = p.params
        self.request_id = p.request_id
        self.prompt = p.prompt
        self.n = params.n
        self.ranked = params.num_choices > params.n
        # best_of > n without logprobs asked: the choices' logprobs are computed for the ranking
        # alone, and not reported (the engine gives their outputs none).
        self.reports_logprobs = params.logprobs is not None
        self.sink = sink
        self.arrival_time = p.arrival_time
        self.deadline = p.deadline
        self.choice_ids = [choice_id(p.request_id, k) for k in range(params.num_choices)]
        self.finals: list[RequestOutput | None] = [None] * params.num_choices

    def choices(self, p: PreparedRequest) -> list[PreparedRequest]:
        """One prepared request per choice, choice 0 first (the leader)."""
        grammars = [p.grammar, *(p.choice_grammars or [None] * (len(self.choice_ids) - 1))]
        return [
            replace(p, request_id=cid, params=choice_params(p.params, k), grammar=grammars[k], choice_grammars=None)
            for k, cid in enumerate(self.choice_ids)
        ]

    def choice_sink(self, index: int) -> Sink | None:
        """Where choice `index`'s outputs go: on to the request's sink as its own (None: no
        sink, or best_of > n, where only the final output can say which choices are kept)."""
        if self.sink is None or self.ranked:
            return None
        return lambda out: self.sink(self._streamed(index, out))

    def unfinished_ids(self) -> list[str]:
        return [cid for cid, f in zip(self.choice_ids, self.finals) if f is None]

    def finish_choice(self, index: int, out: RequestOutput) -> RequestOutput | None:
        """Take choice `index`'s final output; the request's, once every choice has ended."""
        self.finals[index] = out
        if any(f is None for f in self.finals):
            return None
        return self._final()

    @staticmethod
    def _completion(index: int, out: RequestOutput, deltas: bool) -> CompletionOutput:
        return CompletionOutput(
            index,
            out.text,
            out.token_ids,
            out.finish_reason,
            out.logprobs,
            out.stop_reason,
            out.cumulative_logprob,
            out.delta_text if deltas else "",
            out.delta_token_ids if deltas else [],
            out.delta_logprobs if deltas else None,
        )

    def _streamed(self, index: int, out: RequestOutput) -> RequestOutput:
        """A choice's output as the request's streamed one (never finished: the request is
        finished by its final output alone)."""
        return RequestOutput(
            self.request_id,
            self.prompt,
            out.prompt_token_ids,
            out.token_ids,
            out.text,
            None,
            out.metrics,
            out.error,
            out.delta_text,
            out.delta_token_ids,
            out.error_code,
            out.logprobs,
            out.delta_logprobs,
            None,
            out.prompt_logprobs,
            out.cumulative_logprob,
            [self._completion(index, out, deltas=True)],
        )

    def _final(self) -> RequestOutput:
        finals: list[RequestOutput] = self.finals  # all set
        order = list(range(len(finals)))
        if self.ranked:  # stable: among equals, the lower index first
            order.sort(key=lambda k: -(finals[k].cumulative_logprob or float("-inf")))
            order = order[: self.n]
        kept = [finals[k] for k in order]
        completions = [self._completion(i, out, deltas=False) for i, out in enumerate(kept)]
        failed = next((f for f in finals if f.error is not None), None)
        best = kept[0]
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=finals[0].metrics.first_scheduled_time,
            first_token_time=min((t for f in finals if (t := f.metrics.first_token_time) is not None), default=None),
            finished_time=max(f.metrics.finished_time for f in finals),
            token_times=list(best.metrics.token_times),
            deadline=self.deadline,
        )
        return RequestOutput(
            self.request_id,
            self.prompt,
            finals[0].prompt_token_ids,
            best.token_ids,
            best.text,
            best.finish_reason,
            metrics,
            failed.error if failed is not None else None,
            "",
            [],
            failed.error_code if failed is not None else None,
            completions[0].logprobs,
            None,
            best.stop_reason,
            finals[0].prompt_logprobs,
            best.cumulative_logprob,
            completions,
        )
