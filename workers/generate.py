"""tandem.generate's body on a worker: a job's JSON turned into Runtime calls, its outputs into
the job's events (workers/choices.py's translation), its result. workers/jobs.py runs it under
a claim (run_job), as every task's body.

One job, whatever n: a job of n > 1 choices (or best_of) is one request to the engine, which
forks the choices from one prefill; its token events name their choice, each choice ends with a
choice_end event, and the result lists the choices.

A generation that restarts after its worker died continues from the tokens the stream already
holds (prompt + those tokens as the new prompt, the budget reduced by as many), so its stream
goes on without a token twice or missing; the `restarted` event marks the seam. A job of n > 1
resumes per choice: each choice not ended goes on alone from its own tokens (a request of one,
with its own seed, choice_seed(seed, k)), so that nothing it streamed is sent twice; the shared
prefill is lost for the resumed attempt only. A best_of > n job streams nothing before its end
(only then is it known which choices are kept), so it simply runs again.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import CancelledError

from runtime.handles import DeadlineExceededError, error_for
from runtime.llm.sampling_params import choice_seed
from workers.choices import ChoiceState, OutputEvents, Resumed, resumed_from
from workers.events import CHOICE_END, TOKEN, JobEvent
from workers.host import ActiveJob, Cancelled, Fenced, WorkerHost
from workers.jobspec import parse_generate, tenancy_kwargs
from workers.settings import MODEL_QUEUE_PREFIX, model_queue
from workers.tool_stream import ToolStream, tool_result


def runtime_serving(host: WorkerHost, part: str, what: str):
    """The worker's Runtime, if it has `part` ("llm" or "vision")."""
    rt = host.runtime
    if rt is None or getattr(rt, part, None) is None:
        raise RuntimeError(f"this worker serves no {what}")
    return rt


def time_left(job: ActiveJob, deadline_s: float | None) -> float | None:
    """Seconds left of the job's deadline (counted from submission); None: no deadline."""
    if deadline_s is None:
        return None
    remaining = job.submitted_at + deadline_s - time.time()
    if remaining <= 0:
        raise DeadlineExceededError(f"deadline_s={deadline_s} passed before the job started")
    return remaining


def _check_model(host: WorkerHost, job: ActiveJob) -> None:
    """A job on `llm.NAME` asks for model NAME: refuse it on a worker serving another (a
    misrouted message must not answer with the wrong model)."""
    if job.queue.startswith(MODEL_QUEUE_PREFIX) and job.queue != model_queue(host.model_name or "-"):
        asked = job.queue[len(MODEL_QUEUE_PREFIX) :]
        raise RuntimeError(f"model {asked!r} is not served by this worker (it serves {host.model_name!r})")


class _Appender:
    """The job's appended events (lua_events.APPEND: tool, prompt, choice_end), one seq for all
    of them, counted on from what earlier attempts wrote."""

    def __init__(self, host: WorkerHost, job: ActiveJob, seq: int) -> None:
        self.host, self.job, self.seq = host, job, seq

    def append(self, event: JobEvent) -> None:
        event.attempt = self.job.attempt
        self.host.writer.append(self.job, self.seq, event)
        self.seq += 1


class _JobTools:
    """A tool job's ToolStream and what it writes: content rides the job's next token event (or
    its end), tool events are appended after it."""

    def __init__(self, host: WorkerHost, job: ActiveJob, stream: ToolStream, appender: _Appender) -> None:
        self.host, self.job, self.stream, self.appender = host, job, stream, appender
        self.pending = ""  # content read from text whose tokens went out already (a resume)

    def replay(self, raw: str) -> None:
        """Text whose tokens an earlier attempt streamed: what it did not send goes out now."""
        content, events = self.stream.feed(raw)
        self.pending += content
        self._append(events)

    def emit(self, start: int, new: list[int], delta_text: str, prompt_ids, lp) -> None:
        content, events = self.stream.feed(delta_text)
        self.host.writer.emit(self.job, start, new, self.pending + content, prompt_ids, lp)
        self.pending = ""
        self._append(events)

    def finish(self, trailing: str, reason: str | None):
        """(the content still to send, as the end's text; the message; OpenAI's finish_reason)."""
        self.replay(trailing)
        content, events, message, reason = self.stream.finish(reason)
        self._append(events)
        text, self.pending = self.pending + content, ""
        return text, message, reason

    def _append(self, events: list[JobEvent]) -> None:
        for event in events:
            self.appender.append(event)


class _Writes:
    """Where a job's events go: tokens through EMIT (a tool job's through its ToolStream),
    the others appended. Remembers when the first token came."""

    def __init__(self, host: WorkerHost, job: ActiveJob, appender: _Appender, calls: _JobTools | None) -> None:
        self.host, self.job, self.appender, self.calls = host, job, appender, calls
        self.first_token_at: float | None = None
        self._prompt_stored = False

    def write(self, events: list[JobEvent], prompt_ids: list[int] | None) -> None:
        for ev in events:
            if ev.type != TOKEN:
                self.appender.append(ev)
                continue
            # The first attempt's prompt ids go into the job's record with its first token (a
            # resumed attempt reads them there).
            ids = prompt_ids if ev.index == 0 and not self._prompt_stored else None
            self._prompt_stored |= ids is not None
            if self.calls is not None:
                self.calls.emit(ev.index, ev.token_ids, ev.text, ids, ev.logprobs)
            else:
                self.host.writer.emit(self.job, ev.index, ev.token_ids, ev.text, ids, ev.logprobs, ev.choice)
            if self.first_token_at is None:
                self.first_token_at = time.time()


class _Handles:
    """Several requests of one job (choices resumed alone), cancelled together."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()


def _token_texts(rt, params):
    """The first prompt token's text, for the prompt event (None when no prompt logprobs are asked)."""
    if params.prompt_logprobs is None or rt.tokenizer is None:
        return None
    from runtime.llm.detokenizer import TokenTexts

    return TokenTexts(rt.tokenizer)


def _drain(job: ActiveJob, handle, tr: OutputEvents, writes: _Writes):
    """Read one request to its end, writing its events; its final output."""
    out = None
    try:
        for out in handle:
            if job.fenced:
                raise Fenced()
            writes.write(tr.feed(out), tr.prompt_token_ids)
    except CancelledError:
        if job.fenced:
            raise Fenced() from None
        raise Cancelled() from None
    if job.fenced or out is None:
        raise Fenced()
    if job.cancel_requested and out.finish_reason == "abort":
        raise Cancelled()
    if out.error:
        raise error_for(out)  # DeadlineExceededError for a deadline: the job's finish_reason says so
    return out


def _tool_result(result: dict, message, reason: str | None) -> dict:
    """A tool job's result: content as `text` ("" for none), its calls, OpenAI's finish_reason."""
    return {**result, "text": message.content or "", **tool_result(message), "finish_reason": reason}


def generate_body(host: WorkerHost, job: ActiveJob, kwargs: dict) -> tuple[dict, str]:
    spec = parse_generate(kwargs)
    rt = runtime_serving(host, "llm", "an LLM (start it with the llm queue)")
    _check_model(host, job)
    remaining = time_left(job, spec.deadline_s)
    prompt, params = spec.prompt, spec.params
    tools = None
    if spec.tools is not None:  # the tool format's prompt and grammar; its parser over the text
        prompt, params, fmt = spec.tools.prepare(rt.tokenizer, spec.prompt, params)
        tools = (fmt, spec.tools.request)
    multi = params.num_choices > 1
    # A resumed attempt reads what the earlier ones wrote: every event where choices, calls or
    # the prompt's logprobs are at stake; else the tokens alone.
    written: list[JobEvent] = []
    if job.attempt > 1 and (tools or multi or params.prompt_logprobs is not None):
        written = host.store.events(job.job_id)
    resumed = resumed_from(written, params.n if multi else 1)
    if job.resumed_from and not written:
        ids, text, logprobs = host.store.prefix(job.job_id)
        resumed.choices[0] = ChoiceState(0, ids, text, logprobs, base=len(ids))
    rec = host.store.record(job.job_id) if job.resumed_from else None  # the first attempt's timings
    appender = _Appender(host, job, resumed.num_appended)
    if resumed.prompt_logprobs is not None and params.max_tokens != 0:
        params = dataclasses.replace(params, prompt_logprobs=None)  # an earlier attempt sent them
    # The engine's priority, and its fair-share tenant and tier (jobspec.check_tenancy).
    order = {"priority": spec.priority, **tenancy_kwargs(spec.tenant, spec.tier)}
    if multi:
        return _generate_choices(host, job, rt, order, prompt, params, remaining, resumed, rec, appender)
    return _generate_one(host, job, rt, order, prompt, params, remaining, resumed, rec, appender, tools, written)


def _generate_one(host, job, rt, order, prompt, params, remaining, resumed: Resumed, rec, appender, tools, written):
    c = resumed.choices[0]
    prefix_ids, prefix_text, prefix_logprobs = list(c.ids), c.text, c.logprobs
    calls = _JobTools(host, job, ToolStream(*tools, written), appender) if tools else None
    if calls is not None and prefix_ids:  # a tool job's token events hold content, not the text
        prefix_text = c.text = rt.tokenizer.decode(prefix_ids, skip_special_tokens=params.skip_special_tokens)
        calls.replay(prefix_text)
    if job.resumed_from:
        reason = _finished_already(rt, params, job.prompt_token_ids, prefix_ids)
        if reason is not None:
            result = _result(host.worker_id, job, rec, job.prompt_token_ids, prefix_ids, prefix_text, reason, None)
            result["logprobs"] = prefix_logprobs if getattr(params, "logprobs", None) is not None else None
            result["stop_reason"] = _stop_reason_of(params, prefix_ids, prefix_text) if reason == "stop" else None
            if calls is None:
                return result, ""
            trailing, message, reason = calls.finish("", reason)
            return _tool_result(result, message, reason), trailing
        # The engine counts the earlier outputs itself (max_tokens and min_tokens, penalties, the
        # seeded stream, the grammar, stop strings across the resume point): the job's own params
        # go unchanged, and its k-th new token is what the uninterrupted job's (n + k)-th would be.
        prompt = job.prompt_token_ids + prefix_ids
    handle = rt.submit_generate(
        prompt,
        params,
        **order,
        deadline_s=remaining,
        request_id=f"{job.job_id}#{job.attempt}",
        num_resumed_outputs=len(prefix_ids),
    )
    job.attach(handle)
    tr = OutputEvents(
        params, resumed.choices, _token_texts(rt, params), prompt_sent=resumed.prompt_logprobs is not None
    )
    writes = _Writes(host, job, appender, calls)
    out = _drain(job, handle, tr, writes)
    trailing = tr.trailing
    prompt_ids = job.prompt_token_ids if job.resumed_from else out.prompt_token_ids
    ids, text = prefix_ids + out.token_ids, prefix_text + out.text
    result = _result(host.worker_id, job, rec, prompt_ids, ids, text, out.finish_reason, out, writes.first_token_at)
    logprobs = getattr(out, "logprobs", None)
    result["logprobs"] = None if logprobs is None else (prefix_logprobs or []) + list(logprobs)
    result["stop_reason"] = getattr(out, "stop_reason", None)
    _add_prompt_logprobs(result, params, tr, resumed)
    if calls is None:
        return result, trailing
    trailing, message, reason = calls.finish(trailing, out.finish_reason)
    return _tool_result(result, message, reason), trailing


def _add_prompt_logprobs(result: dict, params, tr: OutputEvents, resumed: Resumed) -> None:
    entries = tr.prompt_logprobs if tr.prompt_logprobs is not None else resumed.prompt_logprobs
    if entries is not None or params.prompt_logprobs is not None:
        result["prompt_logprobs"] = entries


def _choice_params(params, index: int):
    """Choice `index` of an n > 1 job as a request of one (a choice resumed alone): its own seed,
    as the engine derives it for a forked choice, so its tokens go on as they would have."""
    seed = None if params.seed is None else choice_seed(params.seed, index)
    return dataclasses.replace(params, n=1, best_of=None, seed=seed, prompt_logprobs=None)


def _generate_choices(host, job, rt, order, prompt, params, remaining, resumed: Resumed, rec, appender):
    """A job of n > 1 choices: one request (choices forked from one prefill); resumed, one
    request per choice not ended, from its own tokens."""
    states = resumed.choices
    texts = _token_texts(rt, params)
    prompt_sent = resumed.prompt_logprobs is not None
    writes = _Writes(host, job, appender, None)
    runs: list[tuple] = []  # (params, prompt, earlier outputs, the one choice it runs or None)
    started = resumed.started  # (the choices' states fill up as they run)
    if not started:
        runs.append((params, prompt, 0, None))
    else:
        prompt_ids = job.prompt_token_ids
        for c in states:
            if c.ended:
                continue
            p = _choice_params(params, c.index)
            reason = _finished_already(rt, p, prompt_ids, c.ids)
            if reason is None:
                runs.append((p, prompt_ids + c.ids, len(c.ids), c.index))
                continue
            c.ended, c.finish_reason = True, reason
            c.stop_reason = _stop_reason_of(p, c.ids, c.text) if reason == "stop" else None
            end = JobEvent(CHOICE_END, choice=c.index, finish_reason=reason, stop_reason=c.stop_reason)
            end.num_tokens = len(c.ids)
            appender.append(end)
    handles: list = []
    try:
        for p, request_prompt, num_earlier, fixed in runs:
            rid = f"{job.job_id}#{job.attempt}" + ("" if fixed is None else f".{fixed}")
            handles.append(
                rt.submit_generate(
                    request_prompt,
                    p,
                    **order,
                    deadline_s=remaining,
                    request_id=rid,
                    num_resumed_outputs=num_earlier,
                )
            )
    except BaseException:
        _Handles(handles).cancel()
        raise
    job.attach(_Handles(handles))
    out = None
    for (p, _, _, fixed), handle in zip(runs, handles):
        tr = OutputEvents(p, states, texts, multi=True, fixed=fixed, prompt_sent=prompt_sent)
        out = _drain(job, handle, tr, writes)
        if tr.prompt_logprobs is not None:
            resumed.prompt_logprobs = tr.prompt_logprobs
    first = states[0]
    prompt_ids = job.prompt_token_ids if started else out.prompt_token_ids
    result = _result(
        host.worker_id, job, rec, prompt_ids, first.ids, first.text, first.finish_reason, out, writes.first_token_at
    )
    completion = sum(len(c.ids) for c in states)
    result["usage"].update(completion_tokens=completion, total_tokens=len(prompt_ids) + completion)
    result["logprobs"], result["stop_reason"] = first.logprobs, first.stop_reason
    result["choices"] = [c.to_result() for c in states]
    if params.prompt_logprobs is not None or resumed.prompt_logprobs is not None:
        result["prompt_logprobs"] = resumed.prompt_logprobs
    return result, ""


def _stop_reason_of(params, ids: list[int], text: str) -> str | int | None:
    """What ended a generation whose last attempt stopped it (the stop token id or string)."""
    if ids and ids[-1] in set(params.stop_token_ids):
        return ids[-1]
    for s in params.stop:
        if s in text:
            return s
    return None


def _finished_already(rt, params, prompt_ids: list[int], ids: list[int]) -> str | None:
    """Did the previous attempt make the job's last token before its worker died? Length
    first, as the engine decides it: the budget spent, or the context full (max_tokens None
    takes what the context leaves; resuming there would hand the engine a prompt of
    max_model_len tokens, which it refuses, and a finished job would end failed)."""
    if params.max_tokens is not None and len(ids) >= params.max_tokens:
        return "length"
    max_model_len = getattr(rt, "max_model_len", None)  # the Runtime's: its LLM engine's
    if max_model_len and len(prompt_ids) + len(ids) >= max_model_len:
        return "length"
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids |= set(getattr(rt.llm, "eos_token_ids", ()))
    if ids and ids[-1] in stop_ids and len(ids) >= params.min_tokens:
        return "stop"
    if params.stop and rt.tokenizer is not None:
        full = rt.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if any(s in full for s in params.stop):
            return "stop"
    return None


def _result(
    worker_id: str,
    job: ActiveJob,
    rec: dict | None,
    prompt_ids: list[int],
    ids: list[int],
    text: str,
    reason: str,
    out,
    first_token_at: float | None = None,
) -> dict:
    """The task's result. `rec` (the job record) only for a resumed job: its first attempt's
    start and first token; a first attempt knows its own."""
    now = time.time()
    submitted = job.submitted_at or now
    started, first = job.claimed_at, first_token_at
    if rec is not None:
        started = float(rec.get("started_at") or started)
        first = float(rec["first_token_at"]) if rec.get("first_token_at") else first
    timings = {
        "queue_s": round(started - submitted, 6),
        "total_s": round(now - submitted, 6),
        "attempts": job.attempt,
    }
    if first is not None:
        timings["ttft_s"] = round(first - submitted, 6)
    if out is not None and out.metrics.e2e_latency is not None:
        timings["runtime_s"] = round(out.metrics.e2e_latency, 6)  # in the Runtime: its queue and steps
    if out is not None and out.metrics.decode_tokens_per_s:
        timings["decode_tokens_per_s"] = round(out.metrics.decode_tokens_per_s, 3)
    return {
        "job_id": job.job_id,
        "worker": worker_id,
        "text": text,
        "token_ids": ids,
        "finish_reason": reason,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt_ids) + len(ids),
        },
        "timings": timings,
    }
