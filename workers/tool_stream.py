"""A tool job, run alike by a worker (workers/jobs.py) and by `tandem serve --embedded`
(server/backends.py): the prompt rendered in the model's tool format, the tool grammar set as
its structured_outputs, and the model's text turned into JobEvents as it streams: content for
the token events, tool_call and tool_args events for the calls. Nothing downstream re-parses
text: the events are the calls.

    job = ToolJob.from_kwargs(kwargs)            # the job's tools fields, checked (None: no tools)
    prompt, params, fmt = job.prepare(tokenizer, messages, params)
    stream = ToolStream(fmt, job.request)        # or resumed from the events already written
    content, tool_events = stream.feed(delta_text)
    content, tool_events, message = stream.finish()

The stream keeps what it has sent (content, each call's id, name and arguments so far) and
sends the difference between that and what the parser has read: so an attempt that resumes a
job (its worker died) feeds the parser the text of the tokens already streamed and sends only
what the earlier attempt had not, whatever the deltas' boundaries were, with the call ids that
were sent. Content that a step's text adds after a call is sent with that step's tokens, before
the step's tool events (OpenAI's message keeps content and calls apart anyway).

No I/O here; runtime/llm/tools.py does the formats, grammars and parsing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from runtime import errors
from runtime.errors import FieldError
from runtime.llm.tools import ParsedMessage, ToolCall, ToolFormat, ToolRequest, parse_tools, tool_format_for
from workers.events import TOOL_ARGS, TOOL_CALL, JobEvent

# The job fields of tool calling: OpenAI's three, and the format override (`--tool-call-parser`).
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "tool_call_parser")


def has_tool_turns(messages: Any) -> bool:
    """Does the conversation hold tool turns (an assistant's tool_calls, a tool's result)?"""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages
    )


def _field_error(exc: ValueError) -> FieldError:
    """runtime/llm/tools.py raises plain ValueErrors whose message starts with the field's path
    (`tools[1].function.name must ...`): their field, until it raises FieldError itself."""
    if isinstance(exc, FieldError):
        return exc
    text = str(exc)
    return FieldError(text.split(" ", 1)[0].rstrip(":,") or "tools", text)


@dataclass(slots=True)
class ToolJob:
    """A job's tool calling: the checked request (None: the conversation has tool turns but no
    tools are offered now), and the format override, if any."""

    request: ToolRequest | None
    tool_call_parser: str | None = None

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> ToolJob | None:
        """The job's tools fields checked (FieldError naming the field); None for a job with no
        tools fields and no tool turns in its messages (it runs as before)."""
        if not any(kwargs.get(f) is not None for f in TOOL_FIELDS) and not has_tool_turns(kwargs.get("messages")):
            return None
        if kwargs.get("messages") is None:
            name = next(f for f in TOOL_FIELDS if kwargs.get(f) is not None)
            raise FieldError(name, f"{name}: tools need chat messages, not a prompt", errors.CONFLICT)
        try:
            request = parse_tools(kwargs.get("tools"), kwargs.get("tool_choice"), kwargs.get("parallel_tool_calls"))
        except ValueError as exc:
            raise _field_error(exc) from None
        parser = kwargs.get("tool_call_parser")
        if parser is not None and not isinstance(parser, str):
            raise FieldError("tool_call_parser", f"tool_call_parser must be a string, got {parser!r}")
        return cls(request, parser)

    def to_kwargs(self) -> dict:
        """The job fields again (plain JSON; what crosses the broker)."""
        out: dict[str, Any] = self.request.to_dict() if self.request is not None else {}
        if self.tool_call_parser is not None:
            out["tool_call_parser"] = self.tool_call_parser
        return out

    def format(self, tokenizer: Any) -> ToolFormat:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise FieldError("messages", "messages: this model has no chat template; use plain prompts")
        try:
            return tool_format_for(tokenizer, self.tool_call_parser)
        except ValueError as exc:
            raise FieldError("tool_call_parser", f"tool_call_parser: {exc}") from None

    def prepare(self, tokenizer: Any, messages: list[dict], params) -> tuple[str, Any, ToolFormat]:
        """(prompt text, SamplingParams with the tool grammar, the format)."""
        fmt = self.format(tokenizer)
        try:
            prompt = fmt.render(tokenizer, messages, self.request)
        except ValueError as exc:
            raise _field_error(exc) from None
        grammar = fmt.structured_outputs(self.request)
        if grammar is not None:
            self.check_params(params)
            params = dataclasses.replace(params, structured_outputs=grammar)
        return prompt, params, fmt

    def check_params(self, params) -> None:
        """A grammar of the request's own (response_format and the like) cannot share the
        output with the tools': refused unless tool_choice is none. A tool job makes one choice:
        its stream is one parser's over one text (n > 1 with tools is refused, not run as n=1)."""
        if params.num_choices > 1:
            name = "n" if params.n > 1 else "best_of"
            raise FieldError(
                name,
                f"{name} must be 1 for a tool job (tools offered, or tool turns in messages): its calls are parsed "
                f"from one choice's text; send n requests for n answers",
                errors.CONFLICT,
            )
        offered = self.request is not None and self.request.tool_choice != "none"
        if offered and params.structured_outputs is not None:
            raise FieldError(
                "structured_outputs",
                "structured_outputs cannot be combined with tools (the tool grammar holds the output); "
                "use tool_choice 'none' for a structured answer",
                errors.CONFLICT,
            )


@dataclass(slots=True)
class _Sent:
    """What a tool job's stream has sent so far."""

    content: str = ""
    calls: dict[int, list] = field(default_factory=dict)  # call_index -> [call_id, name, arguments]
    num_events: int = 0  # tool events (their seq for lua_events.APPEND)


class ToolStream:
    """The parser's view of the model's text, sent as JobEvents. `sent`: the events an earlier
    attempt of the job wrote (a resumed job), in order; then feed the text of its tokens first."""

    def __init__(self, fmt: ToolFormat, request: ToolRequest | None, sent: list[JobEvent] = ()) -> None:
        self.parser = fmt.parser(request)
        self._sent = _Sent()
        for ev in sent:
            if ev.type == TOOL_CALL:
                self._sent.calls[ev.call_index] = [ev.call_id, ev.name, ""]
                self._sent.num_events += 1
            elif ev.type == TOOL_ARGS:
                self._sent.calls[ev.call_index][2] += ev.arguments
                self._sent.num_events += 1
            elif ev.has_text:
                self._sent.content += ev.text
        self._content = ""  # what the parser has read, cumulative
        self._calls: dict[int, list] = {}  # call_index -> [id, name, arguments], as parsed
        self._index_of: dict[str, int] = {}  # a parsed call's id -> its index

    @property
    def num_events(self) -> int:
        """Tool events sent so far: the next one's seq."""
        return self._sent.num_events

    def feed(self, delta_text: str) -> tuple[str, list[JobEvent]]:
        """(content to send with this step's tokens, tool events to send after them)."""
        self._read(self.parser.feed(delta_text))
        return self._diff()

    def finish(self, finish_reason: str | None) -> tuple[str, list[JobEvent], ParsedMessage, str | None]:
        """At the end of the text: (content held back until now, the last tool events, the
        message with the ids that were sent, OpenAI's finish_reason: tool_calls when the model
        stopped after calling)."""
        self._read(self.parser.flush())
        content, events = self._diff()
        parsed = self.parser.finish()
        calls = []
        for call in parsed.tool_calls:
            index = self._index_of.get(call.id)
            sent = self._sent.calls.get(index) if index is not None else None
            calls.append(ToolCall(sent[0], call.name, call.arguments) if sent else call)
        message = ParsedMessage(self._sent.content or None, calls, parsed.malformed)
        reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
        return content, events, message, reason

    def _read(self, deltas) -> None:
        for d in deltas:
            if d.index is None:
                self._content += d.content or ""
                continue
            call = self._calls.setdefault(d.index, [None, None, ""])
            if d.id is not None:
                call[0], call[1] = d.id, d.name
                self._index_of[d.id] = d.index
            call[2] += d.arguments or ""

    def _diff(self) -> tuple[str, list[JobEvent]]:
        sent = self._sent
        content = ""
        if self._content.startswith(sent.content) and len(self._content) > len(sent.content):
            content = self._content[len(sent.content) :]
            sent.content = self._content
        events = []
        for index in sorted(self._calls):
            call_id, name, arguments = self._calls[index]
            if call_id is None:
                continue
            have = sent.calls.get(index)
            if have is None:
                have = sent.calls[index] = [call_id, name, ""]
                events.append(JobEvent(TOOL_CALL, call_index=index, call_id=call_id, name=name))
            if arguments.startswith(have[2]) and len(arguments) > len(have[2]):
                events.append(JobEvent(TOOL_ARGS, call_index=index, arguments=arguments[len(have[2]) :]))
                have[2] = arguments
        sent.num_events += len(events)
        return content, events


def tool_result(message: ParsedMessage) -> dict:
    """A tool job's result fields: content (None without text) and OpenAI's tool_calls."""
    return {"content": message.content, "tool_calls": [c.to_openai() for c in message.tool_calls]}
