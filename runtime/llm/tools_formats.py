"""Tool formats, one per chat-template family: how the prompt shows the tools, how the model
writes calls, the grammar that holds them, the parser that reads them.

    hermes       Hermes 2 Pro, Qwen2.5, Qwen3: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3_json  Llama 3.1 / 3.2 / 3.3 JSON calls: the message is {"name": ..., "parameters": {...}}
    generic      templates that do not render tools (SmolLM2):
                 <tool_call>{"name": ..., "arguments": {...}}</tool_call>

tool_format_for(tokenizer) reads the chat template: where it renders `tools`, the prompt is the
template's own (tokenizer.apply_chat_template(messages, tools=...)) and the format is its
family's (a `<tool_call>` tag: hermes; Llama 3's header tokens: llama3_json). Where it does
not, or its family is none of these, the prompt is GENERIC_PROMPT, a section added to the
conversation's system message, and the calls are written as `generic`. An override (a flag)
names the format; a format that is not the template's own family is then prompted generically.

Follow-up turns: assistant messages with `tool_calls` (content may be null) and `role: "tool"`
messages with `tool_call_id`. A template that renders tools gets them as Hugging Face's chat
templates take them (arguments as objects, the tool's name beside its result); otherwise the
assistant turn is its calls' text in the format, and a tool result is a turn of role "tool"
where the template writes that role as it is (ChatML's, SmolLM2's), else the results become one
user turn of <tool_response> blocks (every template takes a user turn). Measured on SmolLM2
(auto, no grammar, 24 seeds at temperature 1.0, one call and its result in the history): as
user turns of <tool_response>, the model answered with a <tool_response> of its own a third of
the time and opened a call once; as tool turns, it opened calls 5 times.
"""

from __future__ import annotations

import json
import re
from typing import Any

from runtime.llm.tools_grammar import tool_grammar
from runtime.llm.tools_parser import CallSyntax, ToolCallParser
from runtime.llm.tools_types import ParsedMessage, ToolRequest

SYNTAXES = {
    "hermes": CallSyntax("<tool_call>", "</tool_call>", "arguments", pad="\n"),
    "llama3_json": CallSyntax("", "", "parameters", multiple=False),
    "generic": CallSyntax("<tool_call>", "</tool_call>", "arguments"),
}

GENERIC_PROMPT = """# Tools

You can call the functions below. Each is described as JSON within <tools></tools>:
<tools>
{tools}
</tools>

To call a function, write its name and arguments as one JSON object{where}:
{example}
{choice}The results of your calls come back to you in the next turn."""

_CHOICE_LINES = {
    "auto": "If no function fits, answer in plain text instead.\n",
    "required": "Answer with a function call.\n",
}


def template_text(tokenizer: Any) -> str:
    """The chat template's text (every named template, where there are several)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(str(v) for v in t.values())
    if isinstance(t, list):
        return "\n".join(str(e.get("template", "")) for e in t if isinstance(e, dict))
    return t or ""


def template_family(template: str) -> str | None:
    """The family of a template that renders tools, or None where it does not render them."""
    if not re.search(r"\btools\b", template):
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|start_header_id|>" in template:
        return "llama3_json"
    return "generic"  # renders tools in a way no format here parses: prompted generically


def _text(content: Any, at: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{at}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}, got {part!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{at}.content must be a string, a list of text parts or null, got {type(content).__name__}")


def _calls(message: dict, at: str) -> list[tuple[str, str, dict]]:
    """An assistant message's tool_calls as (id, name, arguments object)."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ValueError(f"{at}.tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        cat = f"{at}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{cat}.function must be an object with a string name, got {call!r}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"{cat}.function.arguments is not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise ValueError(f"{cat}.function.arguments must be a JSON object, got {args!r}")
        out.append((str(call.get("id") or ""), fn["name"], args))
    return out


def normalize_messages(messages: object) -> list[dict]:
    """The conversation checked: {"role", "content"} dicts, with content as text ("" for null),
    `calls` on assistant messages with tool_calls, `tool_call_id` and `name` on tool results."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
    names: dict[str, str] = {}
    out = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{at} must be a dict with a string 'role', got {m!r}")
        role = m["role"]
        entry: dict[str, Any] = {"role": role, "content": _text(m.get("content"), at)}
        if role == "assistant":
            calls = _calls(m, at)
            if calls:
                entry["calls"] = calls
                names.update((cid, name) for cid, name, _ in calls if cid)
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise ValueError(f"{at}.tool_call_id must be the id of a call of an earlier assistant message")
            entry["tool_call_id"] = cid
            entry["name"] = m.get("name") or names.get(cid, "")
        elif m.get("content") is None:
            raise ValueError(f"{at}.content must be a string or a list of text parts, got None")
        out.append(entry)
    return out


class ToolFormat:
    """One family's tool calling. `native`: the chat template renders the tools itself."""

    def __init__(self, name: str, native: bool = False) -> None:
        if name not in SYNTAXES:
            raise ValueError(f"tool_format must be one of {', '.join(SYNTAXES)}, got {name!r}")
        self.name = name
        self.syntax = SYNTAXES[name]
        self.native = native

    def __repr__(self) -> str:
        return f"ToolFormat({self.name!r}, native={self.native})"

    def render(self, tokenizer: Any, messages: list[dict], tool_request: ToolRequest | None) -> str:
        """The prompt: the conversation and the tools (none for tool_choice none), ending with
        the assistant's generation prompt."""
        msgs = normalize_messages(messages)
        show = tool_request is not None and tool_request.tool_choice != "none"
        if self.native:
            return self._render_native(tokenizer, msgs, tool_request if show else None)
        return render_generic(tokenizer, msgs, self.syntax, tool_request if show else None)

    def _render_native(self, tokenizer: Any, msgs: list[dict], request: ToolRequest | None) -> str:
        conv = []
        for m in msgs:
            entry = {"role": m["role"], "content": m["content"]}
            if "calls" in m:
                entry["tool_calls"] = [
                    {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                    for cid, name, args in m["calls"]
                ]
            if m["role"] == "tool":
                entry["tool_call_id"], entry["name"] = m["tool_call_id"], m["name"]
            conv.append(entry)
        kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": False}
        if request is not None:
            kwargs["tools"] = [t.to_openai() for t in request.tools]
        return tokenizer.apply_chat_template(conv, **kwargs)

    def structured_outputs(self, tool_request: ToolRequest | None, auto_grammar: bool | None = None) -> dict | None:
        """SamplingParams.structured_outputs for the request: {"grammar": <Lark>}, or None where
        nothing is held (no tools, tool_choice none, the auto grammar switched off)."""
        grammar = tool_grammar(self.syntax, tool_request, auto_grammar)
        return None if grammar is None else {"grammar": grammar}

    def parser(self, tool_request: ToolRequest | None) -> ToolCallParser:
        enabled = tool_request is not None and tool_request.tool_choice != "none"
        names = tool_request.names if enabled else None
        return ToolCallParser(self.syntax, names, enabled)

    def parse(self, text: str, tool_request: ToolRequest | None) -> ParsedMessage:
        """The whole answer at once (the parser fed one delta)."""
        parser = self.parser(tool_request)
        parser.feed(text)
        return parser.finish()


def generic_section(syntax: CallSyntax, request: ToolRequest) -> str:
    tools = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in request.tools)
    where = f" within {syntax.open_tag}{syntax.close_tag} tags" if syntax.open_tag else ", and nothing else"
    example = syntax.call_text("<function name>", "{<arguments as JSON>}")
    if request.tool_choice == "function":
        choice = f'Answer by calling the function "{request.function_name}".\n'
    else:
        choice = _CHOICE_LINES[request.tool_choice]
    if request.parallel_tool_calls and syntax.multiple and request.tool_choice != "function":
        choice = "You may call several functions, one call after another.\n" + choice
    return GENERIC_PROMPT.format(tools=tools, where=where, example=example, choice=choice)


_ROLE_PROBES: dict[tuple[str, str], bool] = {}


def _renders_role(tokenizer: Any, role: str) -> bool:
    """Whether the chat template writes a turn of `role` with its name and content (ChatML's
    templates write any role; others raise on, or drop, roles they do not know)."""
    from jinja2 import TemplateError  # transformers' templates are jinja; it raises this

    key = (template_text(tokenizer), role)
    if key not in _ROLE_PROBES:
        mark = "\u2063probe\u2063"
        try:
            conv = [{"role": "user", "content": "q"}, {"role": role, "content": mark}]
            text = tokenizer.apply_chat_template(conv, tokenize=False)
            _ROLE_PROBES[key] = mark in text and role in text.replace(mark, "")
        except (TemplateError, TypeError, KeyError, ValueError):  # raise_exception, or a template's own error
            _ROLE_PROBES[key] = False
    return _ROLE_PROBES[key]


def render_generic(tokenizer: Any, msgs: list[dict], syntax: CallSyntax, request: ToolRequest | None) -> str:
    """The prompt for a template without tools: GENERIC_PROMPT added to the system message,
    calls and results as text. `msgs` are normalize_messages' output."""
    conv: list[dict] = []
    tool_role = _renders_role(tokenizer, "tool")
    for m in msgs:
        if m["role"] == "tool" and tool_role:
            conv.append({"role": "tool", "content": m["content"]})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if conv and conv[-1].get("_results"):
                conv[-1]["content"] += "\n" + block
            else:
                conv.append({"role": "user", "content": block, "_results": True})
        elif "calls" in m:
            text = syntax.separator.join(
                syntax.call_text(name, json.dumps(args, ensure_ascii=False)) for _, name, args in m["calls"]
            )
            conv.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text})
        else:
            conv.append({"role": m["role"], "content": m["content"]})
    conv = [{"role": c["role"], "content": c["content"]} for c in conv]
    if request is not None:
        section = generic_section(syntax, request)
        if conv[0]["role"] == "system":
            conv[0] = {"role": "system", "content": f"{conv[0]['content']}\n\n{section}"}
        else:
            conv.insert(0, {"role": "system", "content": section})
    try:
        return tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    except Exception:
        # A template without a system role (it raises on one): the section leads the first user turn.
        if request is None or conv[0]["role"] != "system" or len(conv) < 2:
            raise
        first, rest = conv[0], conv[1:]
        rest[0] = {"role": rest[0]["role"], "content": f"{first['content']}\n\n{rest[0]['content']}"}
        return tokenizer.apply_chat_template(rest, add_generation_prompt=True, tokenize=False)


TOOL_FORMATS = tuple(SYNTAXES)


def tool_format_for(tokenizer: Any, override: str | None = None) -> ToolFormat:
    """The format for a tokenizer's chat template, or the one `override` names (hermes,
    llama3_json, generic); ValueError "tool_format must be one of ..." for another name."""
    family = template_family(template_text(tokenizer))
    if override is not None:
        if override not in SYNTAXES:
            raise ValueError(f"tool_format must be one of {', '.join(SYNTAXES)}, got {override!r}")
        return ToolFormat(override, native=family == override and override != "generic")
    if family is None or family == "generic":
        return ToolFormat("generic")
    return ToolFormat(family, native=True)
