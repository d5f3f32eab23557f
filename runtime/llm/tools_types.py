"""The plain data of tool calling: the request's tools checked (parse_tools -> ToolRequest), and
what the parser gives back (ToolDelta, ToolCall, ParsedMessage), each with to_dict / from_dict
over plain JSON values, as they cross Redis. The interface is runtime/llm/tools.py."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import OUT_OF_RANGE, FieldError

CHOICES = ("auto", "required", "none")
MAX_TOOLS = 128  # OpenAI's limit on `tools`
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def new_call_id() -> str:
    """An id for a tool call, as OpenAI spells them (call_ + 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One entry of `tools`. `parameters` is the JSON Schema of the arguments object, as given
    (None: the function takes no arguments)."""

    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def to_openai(self) -> dict:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}

    def arguments_schema(self) -> dict:
        """The schema the call's arguments object is held to: `parameters`, an object."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        if "type" not in self.parameters:
            return {**self.parameters, "type": "object"}
        return self.parameters


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools, checked. tool_choice is "auto", "required", "none" or "function"
    (then `function_name` names the one tool the model must call)."""

    tools: tuple[FunctionTool, ...]
    tool_choice: str = "auto"
    function_name: str | None = None
    parallel_tool_calls: bool = False  # parse_tools says why

    @property
    def offered(self) -> tuple[FunctionTool, ...]:
        """The tools the model may call: all of them, the named one, or none."""
        if self.tool_choice == "none":
            return ()
        if self.tool_choice == "function":
            return tuple(t for t in self.tools if t.name == self.function_name)
        return self.tools

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.offered)

    def to_dict(self) -> dict:
        """Plain JSON, in OpenAI's request shapes; from_dict checks it again."""
        choice: Any = self.tool_choice
        if choice == "function":
            choice = {"type": "function", "function": {"name": self.function_name}}
        return {
            "tools": [t.to_openai() for t in self.tools],
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
        }

    @classmethod
    def from_dict(cls, data: dict) -> ToolRequest:
        if not isinstance(data, dict):
            raise FieldError(
                "tools", f"tools must be an object with tools, tool_choice, parallel_tool_calls, got {data!r}"
            )
        request = parse_tools(data.get("tools"), data.get("tool_choice"), data.get("parallel_tool_calls"))
        if request is None:
            raise FieldError("tools", "tools must be a non-empty list")
        return request


def _check_function(i: int, item: object, seen: set[str]) -> FunctionTool:
    at = f"tools[{i}]"
    if not isinstance(item, dict):
        raise FieldError(at, f"{at} must be an object {{'type': 'function', 'function': {{...}}}}, got {item!r}")
    if item.get("type") != "function":
        raise FieldError(f"{at}.type", f"{at}.type must be 'function', got {item.get('type')!r}")
    extra = set(item) - {"type", "function"}
    if extra:
        raise FieldError(at, f"{at} has unknown fields {sorted(extra)}")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise FieldError(
            f"{at}.function", f"{at}.function must be an object with name, description, parameters, strict, got {fn!r}"
        )
    extra = set(fn) - _FUNCTION_KEYS
    if extra:
        raise FieldError(f"{at}.function", f"{at}.function has unknown fields {sorted(extra)}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise FieldError(
            f"{at}.function.name", f"{at}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}"
        )
    if name in seen:
        raise FieldError(f"{at}.function.name", f"{at}.function.name {name!r} is already the name of another tool")
    seen.add(name)
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise FieldError(
            f"{at}.function.description", f"{at}.function.description must be a string, got {description!r}"
        )
    parameters = fn.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise FieldError(
                f"{at}.function.parameters",
                f"{at}.function.parameters must be a JSON Schema object, got {type(parameters).__name__}",
            )
        if parameters.get("type", "object") != "object":
            raise FieldError(
                f"{at}.function.parameters.type",
                f"{at}.function.parameters.type must be 'object', got {parameters['type']!r}",
            )
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FieldError(f"{at}.function.strict", f"{at}.function.strict must be a boolean, got {strict!r}")
    return FunctionTool(name, description, parameters, strict)


def parse_tools(tools: object, tool_choice: object = None, parallel_tool_calls: object = None) -> ToolRequest | None:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, checked. None when no tools
    are given (tool_choice then may only be absent or "none", as OpenAI has it). tool_choice
    defaults to "auto", as OpenAI's; parallel_tool_calls to false, as llama.cpp's (OpenAI's
    default is true): a small model allowed several calls tends to repeat one until max_tokens
    (SmolLM2 under `required` did, 6 of 50 under `auto`), and an agent loop gets the next call
    in its next turn anyway. Send true to allow several."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise FieldError("parallel_tool_calls", f"parallel_tool_calls must be a boolean, got {parallel_tool_calls!r}")
    if tools is None or (isinstance(tools, list) and not tools):
        if tool_choice not in (None, "none"):
            raise FieldError(
                "tool_choice", f"tool_choice must be absent or 'none' when no tools are given, got {tool_choice!r}"
            )
        return None
    if not isinstance(tools, list):
        raise FieldError("tools", f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, got {tools!r}")
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"tools must hold at most {MAX_TOOLS} tools, got {len(tools)}", OUT_OF_RANGE)
    seen: set[str] = set()
    checked = tuple(_check_function(i, item, seen) for i, item in enumerate(tools))
    function_name = None
    if tool_choice is None:
        choice = "auto"
    elif isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise FieldError(
                "tool_choice", f"tool_choice must be one of {', '.join(CHOICES)} or a function, got {tool_choice!r}"
            )
        choice = tool_choice
    elif isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise FieldError(
                "tool_choice.type", f"tool_choice.type must be 'function', got {tool_choice.get('type')!r}"
            )
        extra = set(tool_choice) - {"type", "function"}
        if extra:
            raise FieldError("tool_choice", f"tool_choice has unknown fields {sorted(extra)}")
        fn = tool_choice.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise FieldError(
                "tool_choice.function", f"tool_choice.function must be an object with a string name, got {fn!r}"
            )
        function_name = fn["name"]
        if function_name not in seen:
            raise FieldError(
                "tool_choice.function.name",
                f"tool_choice.function.name {function_name!r} is not one of the tools ({', '.join(sorted(seen))})",
            )
        choice = "function"
    else:
        raise FieldError(
            "tool_choice", f"tool_choice must be one of {', '.join(CHOICES)} or a function, got {tool_choice!r}"
        )
    parallel = False if parallel_tool_calls is None else parallel_tool_calls
    return ToolRequest(checked, choice, function_name, parallel)


@dataclass(slots=True)
class ToolCall:
    """One parsed call. `arguments` is the JSON text of the arguments object (OpenAI's shape)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    @classmethod
    def from_dict(cls, data: dict) -> ToolCall:
        return cls(str(data["id"]), str(data["name"]), str(data["arguments"]))


@dataclass(slots=True)
class ToolDelta:
    """One piece of a streamed answer: plain `content` text, or part of call `index`. A call's
    first delta carries its `id` and `name` (and arguments ""); the next ones carry `arguments`
    fragments whose concatenation is the call's arguments JSON text."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    @property
    def is_content(self) -> bool:
        return self.index is None

    def to_openai(self) -> dict:
        """The entry of OpenAI's `delta.tool_calls` for a call delta."""
        if self.index is None:
            raise ValueError("a content delta has no tool_calls entry")
        entry: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            entry["id"] = self.id
            entry["type"] = "function"
            function["name"] = self.name
        if self.arguments is not None:
            function["arguments"] = self.arguments
        entry["function"] = function
        return entry

    def to_dict(self) -> dict:
        return {
            k: getattr(self, k) for k in ("content", "index", "id", "name", "arguments") if getattr(self, k) is not None
        }

    @classmethod
    def from_dict(cls, data: dict) -> ToolDelta:
        return cls(data.get("content"), data.get("index"), data.get("id"), data.get("name"), data.get("arguments"))


@dataclass(slots=True)
class ParsedMessage:
    """The assistant message the model wrote: `content` (None when it wrote no text) and the
    calls that parsed. `malformed` holds the raw text of calls that opened a tag but did not
    parse (invalid JSON, an unknown tool, cut by max_tokens): always empty under a tool grammar
    unless the output was cut."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)

    def to_openai(self) -> dict:
        """OpenAI's `message` (without the role's siblings: refusal, annotations)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return message

    def to_dict(self) -> dict:
        return {
            "content": self.content,
            "tool_calls": [c.to_dict() for c in self.tool_calls],
            "malformed": list(self.malformed),
        }

    @classmethod
    def from_dict(cls, data: dict) -> ParsedMessage:
        calls = [ToolCall.from_dict(c) for c in data.get("tool_calls", ())]
        return cls(data.get("content"), calls, list(data.get("malformed", ())))
