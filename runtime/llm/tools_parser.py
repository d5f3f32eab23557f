"""The streaming tool-call parser: the model's text, delta by delta, into content and calls.

A format's calls are JSON objects {"name": ..., "<args_key>": {...}} between an open and a close
tag (Hermes, Qwen2.5 and the generic format: <tool_call>...</tool_call>), or one bare object that
starts the message (Llama 3.1's JSON calls: no tags). The parser

  - holds back text that may be the start of the open tag, so no tag prefix leaks into content;
  - holds back trailing whitespace, which is dropped where a call follows it;
  - opens a call (index, id, name) as soon as `{"name": "<a known tool>", "<args_key>": {` is
    seen, then sends the arguments object's text in fragments as it comes: the fragments of a
    call joined are its `arguments`, the model's own text (no re-serialising between stream
    and final message);
  - reads the JSON structurally (strings, depth), so a close tag inside a string argument does
    not end the call.

Under a tool grammar every call parses. Without one (tool_choice none, the auto grammar switched
off) a call that does not parse, names an unknown tool or never closes is listed in
`ParsedMessage.malformed`, raw; if its start was already streamed, its index is skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from runtime.llm.tools_types import ParsedMessage, ToolCall, ToolDelta, new_call_id


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """How a format writes calls. open_tag "" means one bare JSON object opening the message."""

    open_tag: str
    close_tag: str
    args_key: str = "arguments"
    pad: str = ""  # what the format writes inside the tags, around the JSON
    separator: str = "\n"  # between two calls
    multiple: bool = True  # whether the format can hold several calls

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (arguments: the JSON text of the object)."""
        body = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.args_key}": {arguments}}}'
        return f"{self.open_tag}{self.pad}{body}{self.pad}{self.close_tag}"


_START = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')


class _Call:
    """An open call: its text after the open tag, and a scan of its JSON structure."""

    __slots__ = ("text", "pos", "depth", "in_str", "esc", "obj_end", "close_at", "child_ends")
    __slots__ += ("index", "id", "args_start", "args_sent")

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # scanned up to here
        self.depth = 0
        self.in_str = self.esc = False
        self.obj_end: int | None = None  # just past the top-level value
        self.close_at: int | None = None  # where the close tag starts
        self.child_ends: list[int] = []  # just past each container directly inside the top object
        self.index: int | None = None  # set once the call's start is streamed
        self.id = ""
        self.args_start = self.args_sent = 0

    def scan(self, close_tag: str) -> None:
        text, i, n = self.text, self.pos, len(self.text)
        while i < n and self.close_at is None:
            ch = text[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif close_tag and ch == close_tag[0]:
                if text.startswith(close_tag, i):
                    self.close_at = i
                    break
                if close_tag.startswith(text[i:]):
                    break  # perhaps the close tag, split across deltas: wait for the rest
            elif self.obj_end is not None:
                pass  # past the object: only the close tag matters
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self.child_ends.append(i + 1)
                elif self.depth <= 0:
                    self.obj_end = i + 1
                    if not close_tag:
                        i += 1
                        break
            i += 1
        self.pos = i

    @property
    def args_end(self) -> int | None:
        return next((e for e in self.child_ends if e > self.args_start), None)


class ToolCallParser:
    """feed(delta_text) -> deltas; flush() at the end of the text -> the deltas held back;
    finish() -> the whole message. `tool_names`: the tools a call may name (None: any);
    enabled=False: every character is content (tool_choice none)."""

    def __init__(self, syntax: CallSyntax, tool_names: Iterable[str] | None = None, enabled: bool = True) -> None:
        self.syntax = syntax
        self.names = None if tool_names is None else frozenset(tool_names)
        self._mode = "text" if enabled else "plain"
        self._buf = ""  # text held back: a possible open-tag prefix (or Llama's undecided start)
        self._ws = ""  # trailing whitespace held back
        self._last: str | None = None  # "content" or "call": what was emitted last
        self._call: _Call | None = None
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._malformed: list[str] = []
        self._next_index = 0
        self._flushed = False

    def feed(self, text: str) -> list[ToolDelta]:
        if self._flushed:
            raise RuntimeError("feed after flush: the text has ended")
        out: list[ToolDelta] = []
        if text:
            self._feed(text, out)
        return out

    def flush(self) -> list[ToolDelta]:
        """The text has ended: release what was held back (a partial tag is content after all);
        a call still open is malformed (cut by max_tokens or a stop string)."""
        out: list[ToolDelta] = []
        if self._flushed:
            return out
        self._flushed = True
        if self._call is not None:
            self._malformed.append(self.syntax.open_tag + self._call.text)
            self._call = None
        elif self._buf:
            self._content_out(self._buf, out)
            self._buf = ""
        if self._ws and self._last == "content":
            self._emit(self._ws, out)
        self._ws = ""
        return out

    def finish(self) -> ParsedMessage:
        self.flush()
        content = "".join(self._content)
        return ParsedMessage(content or None, list(self._calls), list(self._malformed))

    # -- text -----------------------------------------------------------------------------------

    def _feed(self, text: str, out: list[ToolDelta]) -> None:
        while text:
            if self._mode == "plain":
                self._emit(text, out)
                return
            if self._mode == "call":
                text = self._feed_call(text, out)
            elif self.syntax.open_tag:
                text = self._feed_tagged(text, out)
            else:
                text = self._feed_bare(text, out)

    def _feed_tagged(self, text: str, out: list[ToolDelta]) -> str:
        buf = self._buf + text
        tag = self.syntax.open_tag
        at = buf.find(tag)
        if at >= 0:
            self._buf = ""
            self._content_out(buf[:at], out)
            self._ws = ""  # whitespace before a call is the format's, not the answer's
            self._open_call()
            return buf[at + len(tag) :]
        keep = next((k for k in range(min(len(tag) - 1, len(buf)), 0, -1) if tag.startswith(buf[-k:])), 0)
        self._content_out(buf[: len(buf) - keep], out)
        self._buf = buf[len(buf) - keep :]
        return ""

    def _feed_bare(self, text: str, out: list[ToolDelta]) -> str:
        """Llama-style: the message is one call iff its first non-blank character is '{'."""
        buf = self._buf + text
        body = buf.lstrip()
        if not body:
            self._buf = buf
            return ""
        self._buf = ""
        if body[0] == "{":
            self._open_call()
            return body
        self._mode = "plain"
        return buf

    def _content_out(self, text: str, out: list[ToolDelta]) -> None:
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        self._emit(self._ws + body, out)
        self._ws = text[len(body) :]

    def _emit(self, text: str, out: list[ToolDelta]) -> None:
        out.append(ToolDelta(content=text))
        self._content.append(text)
        self._last = "content"

    # -- calls ----------------------------------------------------------------------------------

    def _open_call(self) -> None:
        self._mode = "call"
        self._call = _Call()

    def _feed_call(self, text: str, out: list[ToolDelta]) -> str:
        c = self._call
        c.text += text
        c.scan(self.syntax.close_tag)
        if c.index is None:
            m = _START.match(c.text)
            if m:
                name = json.loads(m.group(1))
                if self.names is None or name in self.names:
                    c.index, c.id = self._next_index, new_call_id()
                    self._next_index += 1
                    c.args_start = c.args_sent = m.end() - 1
                    out.append(ToolDelta(index=c.index, id=c.id, name=name, arguments=""))
        if c.index is not None:
            upto = c.args_end if c.args_end is not None else c.pos
            if upto > c.args_sent:
                out.append(ToolDelta(index=c.index, arguments=c.text[c.args_sent : upto]))
                c.args_sent = upto
        tagged = bool(self.syntax.close_tag)
        if (c.close_at if tagged else c.obj_end) is None:
            return ""
        return self._close_call(c, out)

    def _close_call(self, c: _Call, out: list[ToolDelta]) -> str:
        syntax = self.syntax
        end = c.close_at + len(syntax.close_tag) if syntax.close_tag else c.obj_end
        raw_end = c.close_at if syntax.close_tag else c.obj_end
        self._call = None
        call = self._parse_call(c.text[:raw_end])
        if call is None:
            self._malformed.append(syntax.open_tag + c.text[:end])
        else:
            name, arguments = call
            if c.index is None:
                c.index, c.id = self._next_index, new_call_id()
                self._next_index += 1
                out.append(ToolDelta(index=c.index, id=c.id, name=name, arguments=""))
                out.append(ToolDelta(index=c.index, arguments=arguments))
            else:
                arguments = c.text[c.args_start : c.args_end]
            self._calls.append(ToolCall(c.id, name, arguments))
            self._last = "call"
        rest = c.text[end:]
        if syntax.open_tag:
            self._mode = "text"  # another call may follow (the grammar decides whether one can)
            return rest
        self._mode = "plain"  # a bare call is the whole message: what follows is content
        return rest.lstrip() if call is not None else rest

    def _parse_call(self, raw: str) -> tuple[str, str] | None:
        """(name, arguments JSON text) of a call's JSON, or None if it is not a call to a known
        tool with an object of arguments."""
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if self.names is not None and obj["name"] not in self.names:
            return None
        args = obj.get(self.syntax.args_key, obj.get("arguments", obj.get("parameters")))
        if not isinstance(args, dict):
            return None
        return obj["name"], json.dumps(args, ensure_ascii=False)
