"""What a caller of the Runtime holds while a generation runs: a `GenerationHandle`, fed by
the Runtime's loop thread and read from any other.

    handle = runtime.submit_generate("Hello", SamplingParams(max_tokens=32))
    for out in handle:              # streamed RequestOutputs as tokens arrive
        print(out.delta_text, end="")
    final = handle.result(timeout=30)

Outputs a reader has not taken yet are merged (their deltas joined), so a handle that is
never iterated holds one pending output, not one per token (n > 1: one per choice, since two
choices' deltas are never joined).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future

from runtime.llm.outputs import RequestOutput


class RequestError(RuntimeError):
    """The request was accepted but could not complete; the message says why."""


class DeadlineExceededError(RequestError, TimeoutError):
    """The request's deadline passed while it waited in the queue."""


class RuntimeClosedError(RequestError):
    """The Runtime closed (or broke) before this request completed."""


ERRORS_BY_CODE: dict[str, type[RequestError]] = {
    "deadline_exceeded": DeadlineExceededError,
    "runtime_closed": RuntimeClosedError,
}


def error_for(out: RequestOutput) -> RequestError:
    return ERRORS_BY_CODE.get(out.error_code or "", RequestError)(out.error)


def _choice(out) -> int | None:
    """The choice a streamed output of an n > 1 request moves (it holds that one alone); None
    for a request of one choice, and for the final output of n (it holds them all)."""
    completions = getattr(out, "completions", None)
    return completions[0].index if completions is not None and len(completions) == 1 else None


def _mergeable(pending: list[RequestOutput], out: RequestOutput) -> int | None:
    """Where in `pending` the output that `out` continues is: the last unfinished one of the same
    choice. Outputs of two choices are never joined (their deltas are two texts); so a handle
    never read holds one pending output per choice, not one per token."""
    k = _choice(out)
    for at in range(len(pending) - 1, -1, -1):
        prev = pending[at]
        if prev.finished:
            return None
        if _choice(prev) == k:
            return at
        if k is None:
            return None
    return None


def _join_deltas(prev, out) -> None:
    """out's deltas become prev's and its own, in order (a RequestOutput or a CompletionOutput)."""
    out.delta_text = prev.delta_text + out.delta_text
    out.delta_token_ids = prev.delta_token_ids + out.delta_token_ids
    prev_lp, lp = getattr(prev, "delta_logprobs", None), getattr(out, "delta_logprobs", None)
    if prev_lp is not None and lp is not None:  # contract B: aligned with delta_token_ids
        out.delta_logprobs = prev_lp + lp
    if getattr(prev, "prompt_logprobs", None) is not None and out.prompt_logprobs is None:
        out.prompt_logprobs = prev.prompt_logprobs  # a stream's first output carries them: the merged one is first


class GenerationHandle:
    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._cond = threading.Condition()
        self._pending: list[RequestOutput] = []  # not yet taken by an iterator; merged
        self._final: RequestOutput | None = None
        self._error: BaseException | None = None
        self._cancel_requested = False
        self._callbacks: list[Callable[[GenerationHandle], None]] = []
        self._listener: Callable[[], None] | None = None  # told after every change (an event loop's wake-up)

    # ---- the Runtime's side (its loop thread) -----------------------------------------------

    def _push(self, out: RequestOutput) -> None:
        with self._cond:
            if self._final is not None or self._error is not None:
                return
            at = _mergeable(self._pending, out)
            if at is not None:
                prev = self._pending.pop(at)
                _join_deltas(prev, out)
                if _choice(out) is not None:  # the choice's own CompletionOutput carries them too
                    _join_deltas(prev.completions[0], out.completions[0])
            self._pending.append(out)
            if out.finished:
                self._final = out
                if out.error is not None:
                    self._error = error_for(out)
                elif self._cancel_requested and out.finish_reason == "abort":
                    self._error = CancelledError(f"request {self.request_id!r} was cancelled")
            self._cond.notify_all()
            listener = self._listener
        if listener is not None:
            listener()
        if out.finished:
            self._run_callbacks()

    def _fail(self, error: BaseException) -> None:
        """End the request with `error` (it never reached the engine, or the Runtime broke)."""
        with self._cond:
            if self._final is not None or self._error is not None:
                return
            self._error = error
            self._cond.notify_all()
            listener = self._listener
        if listener is not None:
            listener()
        self._run_callbacks()

    def _run_callbacks(self) -> None:
        with self._cond:
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - a caller's callback never breaks the loop
                pass

    # ---- the caller's side (any thread) -----------------------------------------------------

    def done(self) -> bool:
        with self._cond:
            return self._final is not None or self._error is not None

    def cancelled(self) -> bool:
        with self._cond:
            return isinstance(self._error, CancelledError)

    def cancel(self) -> bool:
        """Abort the request; its KV blocks are freed within one engine step. False if it
        had already finished."""
        with self._cond:
            if self._final is not None or self._error is not None:
                return False
            self._cancel_requested = True
        self._cancel(self.request_id)
        return True

    def add_done_callback(self, fn: Callable[[GenerationHandle], None]) -> None:
        """Call fn(handle) once the request ends (at once if it has); from the Runtime's thread."""
        with self._cond:
            if self._final is None and self._error is None:
                self._callbacks.append(fn)
                return
        fn(self)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final RequestOutput. Raises CancelledError, a RequestError (the message says
        why it failed) or TimeoutError."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._final is not None or self._error is not None, timeout):
                raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
            if self._error is not None:
                raise self._error
            return self._final  # type: ignore[return-value]

    def __iter__(self) -> Iterator[RequestOutput]:
        """Streamed outputs until the final one; raises as `result` does if it failed."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._error is not None)
                if not self._pending:
                    raise self._error  # type: ignore[misc]
                out = self._pending.pop(0)
            if out.finished and self._error is not None:
                raise self._error
            yield out
            if out.finished:
                return

    def set_listener(self, fn: Callable[[], None]) -> None:
        """Call fn() (on the Runtime's thread, so keep it short: e.g. loop.call_soon_threadsafe)
        whenever an output or an error arrives; at once if something is pending already."""
        with self._cond:
            self._listener = fn
            ready = bool(self._pending) or self._error is not None
        if ready:
            fn()

    def poll(self) -> tuple[list[RequestOutput], BaseException | None]:
        """Take every pending output without waiting, and the error the request ended with
        (None while it runs or if it succeeded). For callers that wait by `set_listener`."""
        with self._cond:
            outs, self._pending = self._pending, []
            return outs, self._error

    def as_future(self) -> Future:
        """A concurrent.futures.Future of the final output (for `asyncio.wrap_future`);
        cancelling it cancels the request."""
        future: Future = Future()

        def settle(handle: GenerationHandle) -> None:
            try:
                out = handle.result(0)
            except CancelledError:
                future.cancel()
            except BaseException as exc:  # noqa: BLE001 - handed to the future
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(out)

        future.add_done_callback(lambda f: f.cancelled() and self.cancel())
        self.add_done_callback(settle)
        return future

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until done; False if the timeout passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            return self._cond.wait_for(
                lambda: self._final is not None or self._error is not None,
                None if deadline is None else max(0.0, deadline - time.monotonic()),
            )
