"""OutputProcessor: each step's sampled token ids turned into what callers read: text (one
incremental detokenizer per request), logprobs entries, metrics, stop strings found, grammar
matchers advanced, and RequestOutputs, streamed to each request's sink and returned when it
finishes. It never touches the scheduler or the runner: the requests it ends (a stop string,
a terminated grammar, a token the grammar refuses) go back to the engine, which tells the
scheduler before any output leaves, as vLLM's output processor returns its requests to abort.

Structured outputs: after each step the sampled token is fed to the request's matcher; a
terminated grammar (nothing but EOS may follow) ends the request "stop", and a token the
grammar refuses (a bug, or a row with no allowed token left) ends it with an error.

Prompt logprobs: the runner's raw rows (a chunk's worth a step) are kept as they come and turned
into entries once, when the first output that carries them is made (the final one, or the first
streamed one): a loop over the prompt's tokens, but once per request, never once per step.

Parallel sampling (n > 1): each choice is a request of its own here (its own detokenizer,
logprobs, grammar, stop strings); `group` ties it to its ParentRequest
(runtime/llm/parallel_sampling.py), which the engine hands each choice's final output.

Resumed requests (runtime/llm/input_processor.py): outputs (token_ids, text, logprobs) hold only
what is new. `text` begins where a stream of the earlier outputs would have stopped emitting
(the characters held back for a stop string or an unfinished UTF-8 character come first), so
that the earlier attempt's streamed text followed by this one's is the whole text.
`prompt_token_ids` stays the whole prompt as passed, the earlier outputs included.
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.llm.detokenizer import IncrementalDetokenizer, TokenTexts
from runtime.llm.input_processor import PreparedRequest
from runtime.llm.outputs import RequestMetrics, RequestOutput
from runtime.llm.sampling_params import SamplingParams
from runtime.llm.structured import GrammarMatcher
from schedulers import Request
from schedulers.plan import NewRequestData, StepOutputs

Sink = Callable[[RequestOutput], None]


class RequestState:
    """The output side of one request: what the scheduler does not need to know."""

    __slots__ = (
        "req",
        "prompt",
        "params",
        "metrics",
        "detok",
        "sink",
        "error",
        "error_code",
        "num_sent",
        "logprobs",
        "grammar",
        "resumed_ids",
        "track_logprobs",
        "cumulative_logprob",
        "prompt_chunks",
        "prompt_entries",
        "group",
        "index",
    )

    def __init__(self, req: Request, prompt: str | None, params: SamplingParams, metrics: RequestMetrics) -> None:
        self.req = req
        self.prompt = prompt
        self.params = params
        self.metrics = metrics
        self.detok: IncrementalDetokenizer | None = None
        self.sink: Sink | None = None  # gets every streamed output, and the final one
        self.error: str | None = None
        self.error_code: str | None = None
        self.num_sent = 0  # output tokens already handed to the sink
        self.logprobs: list[dict] | None = None if params.logprobs is None else []  # one per output token
        self.grammar: GrammarMatcher | None = None
        self.resumed_ids: list[int] = []  # the earlier outputs a resumed request came with
        # The runner sends this request's sampled logprobs (it asked, or best_of ranks it on
        # their sum); `logprobs` is None when they are for ranking only.
        self.track_logprobs = params.logprobs is not None
        self.cumulative_logprob = 0.0
        # Prompt logprobs: the runner's (first position, ids rows, values rows) as they come,
        # then the entries made from them once.
        self.prompt_chunks: list[tuple[int, list[list[int]], list[list[float]]]] | None = (
            None if params.prompt_logprobs is None else []
        )
        self.prompt_entries: list[dict | None] | None = None
        self.group = None  # n > 1: the ParentRequest this choice belongs to
        self.index = 0  # its choice index in the group


class OutputProcessor:
    """The output side of every request in flight, by request id (`requests`)."""

    def __init__(self, tokenizer, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.token_texts = TokenTexts(tokenizer) if tokenizer is not None else None
        self.requests: dict[str, RequestState] = {}

    def new_request(self, req: Request, p: PreparedRequest, sink: Sink | None) -> tuple[RequestState, str | None]:
        """The output side of a request, not tracked until `track()`, and "stop" or "length"
        when it is complete already (a resumed request whose earlier outputs ended it)."""
        params = p.params
        t = RequestState(req, p.prompt, params, RequestMetrics(arrival_time=p.arrival_time, deadline=p.deadline))
        t.resumed_ids = p.resumed_token_ids
        if self.tokenizer is not None:
            # One detokenizer gives both the stream and the final text. It runs every step only
            # where text must be seen as it comes (a sink, or stop strings); else once, at the end.
            t.detok = IncrementalDetokenizer(
                self.tokenizer,
                p.token_ids[: len(p.token_ids) - p.num_resumed_outputs],
                params.stop,
                params.skip_special_tokens,
                params.min_tokens,
                params.include_stop_str_in_output,
                resumed_token_ids=t.resumed_ids,
            )
        t.sink = sink
        t.grammar = p.grammar
        done = p.done_reason
        if done is None and t.detok is not None and t.detok.stop_at is not None:
            done = "stop"  # a stop string in the earlier outputs' text
        return t, done

    def track(self, t: RequestState) -> None:
        self.requests[t.req.request_id] = t

    def mark_scheduled(self, new_requests: list[NewRequestData], now: float) -> None:
        for new in new_requests:
            t = self.requests.get(new.request_id)
            if t is not None and t.metrics.first_scheduled_time is None:
                t.metrics.first_scheduled_time = now

    def process(
        self,
        outs: StepOutputs,
        logprobs: dict[str, tuple[list[int], list[float]]],
        now: float,
        prompt_logprobs: dict[str, tuple[int, list[list[int]], list[list[float]]]] | None = None,
    ) -> tuple[dict[str, str], list[RequestState]]:
        """Take one step's new tokens (and prompt logprobs rows). Returns the requests this
        processor ends (id -> "stop" or "abort"; also entered in `outs.finished`) for the
        scheduler to be told, and the requests with a sink, whose streamed output `stream()`
        sends once the finished ones are out."""
        requests = self.requests
        ended: dict[str, str] = {}
        streamed: list[RequestState] = []
        if prompt_logprobs:
            for rid, chunk in prompt_logprobs.items():
                t = requests.get(rid)
                if t is not None and t.prompt_chunks is not None:
                    t.prompt_chunks.append(chunk)
        for rid, tokens in zip(outs.req_ids, outs.new_token_ids):
            if not tokens:
                continue
            t = requests.get(rid)
            if t is None:
                continue
            if t.track_logprobs:  # the runner sent (ids, logprobs) for its one new token
                ids, values = logprobs[rid]
                t.cumulative_logprob += values[0]
                if t.logprobs is not None:
                    t.logprobs.append(self._logprob_entry(ids, values))
            if t.grammar is not None and not self._advance_grammar(t, tokens, outs.finished, ended):
                continue  # finished with an error: no text to stream
            times = t.metrics.token_times
            if not times:
                t.metrics.first_token_time = now
            times.append(now)
            detok = t.detok
            if detok is not None and (t.sink is not None or t.params.stop):
                detok.add(tokens)
                if detok.stop_at is not None and rid not in outs.finished:
                    ended[rid] = outs.finished[rid] = "stop"
            if t.sink is not None:
                streamed.append(t)
        return ended, streamed

    def stream(self, streamed: list[RequestState]) -> None:
        """Hand each still-running request of `streamed` its output of this step."""
        for t in streamed:
            if t.req.request_id in self.requests:
                t.sink(self.output(t, None))

    def finish(self, t: RequestState, reason: str, now: float) -> RequestOutput:
        """The request's final output, also handed to its sink; it is tracked no more."""
        t.metrics.finished_time = now
        self.requests.pop(t.req.request_id, None)
        detok = t.detok
        if detok is not None:
            if t.sink is None and not t.params.stop:
                detok.add(t.req.output_token_ids)  # its one pass, at the end
            detok.finish()
        out = self.output(t, reason)
        if t.sink is not None:
            t.sink(out)
        return out

    def output(self, t: RequestState, reason: str | None) -> RequestOutput:
        """A snapshot (lists copied: outputs may cross to other threads while the request
        goes on). `delta_*` hold what is new since the last output handed to the sink."""
        req = t.req
        ids = req.output_token_ids
        detok = t.detok
        text = detok.visible_text() if detok is not None else ""
        delta = detok.take_delta(reason is not None) if detok is not None else ""
        sent = t.num_sent
        new_ids = ids[sent:]
        t.num_sent = len(ids)
        lps = t.logprobs
        # Prompt logprobs go out once to a stream (its first output) and again in the final one.
        prompt_lps = None
        if t.prompt_chunks is not None and (reason is not None or not sent):
            prompt_lps = self._prompt_entries(t)
        return RequestOutput(
            req.request_id,
            t.prompt,
            req.prompt_token_ids,
            list(ids),
            text,
            reason,
            t.metrics,
            t.error,
            delta,
            new_ids,
            t.error_code,
            None if lps is None else list(lps),
            None if lps is None else lps[sent:],
            self._stop_reason(t) if reason == "stop" else None,
            prompt_lps,
            t.cumulative_logprob if t.track_logprobs else None,
        )

    def _prompt_entries(self, t: RequestState) -> list[dict | None]:
        """One entry per prompt token (the first None), made once from the runner's rows; a
        position given twice (a request preempted while prefilling computes it again) keeps
        its first. Each row is cut to the request's own k."""
        if t.prompt_entries is not None:
            return list(t.prompt_entries)
        num_prompt = len(t.req.prompt_token_ids) - len(t.resumed_ids)
        entries: list[dict | None] = [None] * num_prompt
        width = t.params.prompt_logprobs + 1
        for first, id_rows, value_rows in t.prompt_chunks:
            for pos, ids, values in zip(range(first, first + len(id_rows)), id_rows, value_rows):
                if entries[pos] is None:
                    entries[pos] = self._logprob_entry(ids[:width], values[:width])
        if t.req.output_token_ids:  # it sampled, so its prompt is complete: made once
            t.prompt_entries, t.prompt_chunks = entries, []
        return list(entries)

    @staticmethod
    def _advance_grammar(t: RequestState, tokens: list[int], finished: dict[str, str], ended: dict[str, str]) -> bool:
        """Feed the step's tokens to the request's matcher. A terminated grammar ends the
        request "stop" (even under ignore_eos or before min_tokens: only EOS could follow); a
        refused token ends it with an error (False)."""
        g, rid = t.grammar, t.req.request_id
        for tok in tokens:
            if not g.accept_token(tok):
                # llguidance's message ends with the whole grammar: its first line says what failed.
                why = (g.error.strip().splitlines() or ["no reason given"])[0][:400]
                t.error = f"structured_outputs: the grammar does not allow the sampled token {tok}: {why}"
                t.error_code = "engine_error"
                ended[rid] = finished[rid] = "abort"
                return False
        if g.is_terminated and rid not in finished:
            ended[rid] = finished[rid] = "stop"
        return True

    def _logprob_entry(self, ids: list[int], values: list[float]) -> dict:
        """Contract B's entry for one token: the sampled token (ids[0]) and its top alternatives."""
        texts = self.token_texts
        entries = []
        for tid, lp in zip(ids, values):
            token, raw = texts(tid)
            entries.append({"token_id": tid, "token": token, "bytes": list(raw), "logprob": lp})
        first = entries[0]
        first["top"] = entries[1:]
        return first

    def _stop_reason(self, t: RequestState) -> str | int | None:
        """vLLM's: the stop string found, else the stop token id that ended it; None for EOS
        (checked first, as vLLM does, when a stop token id is also an EOS id)."""
        detok = t.detok
        if detok is not None and detok.stop_str is not None:
            return detok.stop_str
        ids = t.req.output_token_ids or t.resumed_ids  # finished at once: the earlier outputs' last
        last = ids[-1] if ids else None
        if last is None or (not t.params.ignore_eos and last in self.eos_token_ids):
            return None
        return last if last in t.params.stop_token_ids else None
