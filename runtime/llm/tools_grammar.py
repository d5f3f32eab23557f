"""The grammars that hold a model's tool calls to the offered tools (llguidance's Lark dialect,
sent as structured_outputs {"grammar": ...} through runtime/llm/structured.py).

Named: the output is that one call. `required`: calls and nothing else, one, or several joined
by the format's separator when parallel_tool_calls is true. Each call's JSON is `%json {schema}`, one
schema per tool ({"name": {"const": <tool>}, "<args_key>": <its parameters>}), so a call names
an offered tool and its arguments validate against that tool's schema.

`auto`, for formats with an open tag: llguidance's lazy lexemes, as its docs' tool-calling
example has them:

    start: TEXT | head call_rest
    TEXT: /(?s:.*)/
    head[lazy]: /(?s:.*)<tool_call>/

While no tag is written, both TEXT and head match, so the mask allows every text token (about
3 us a mask for SmolLM2's 49k tokens, measured) and the model writes freely. The first complete
`<tool_call>` ends the lazy `head` lexeme, and TEXT cannot go on past a tag once head has
matched, so from there the grammar holds the output to valid calls, to the end. Text before the
first call is allowed (it becomes the message's content); text after the calls is not. So an
answer is either plain text with no open tag, or (text, then) calls that parse and validate.
For Llama 3.1's bare JSON calls (no tag) the choice is made at the first character: '{' opens
the one call, anything else is text.

JSON inside calls is written without free whitespace (", " and ": "), as structured.py does for
schemas: a small model given free whitespace spends its tokens on newlines.
"""

from __future__ import annotations

import json
from typing import Any

from runtime.llm.tools_parser import CallSyntax
from runtime.llm.tools_types import FunctionTool, ToolRequest

# False: tool_choice "auto" runs with no grammar, its calls parsed from free text after the fact
# (vLLM's auto): the tests switch it off to show what the grammar prevents.
AUTO_GRAMMAR = True
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


def _lit(text: str) -> str:
    """A Lark string literal (llguidance reads them as JSON strings)."""
    return json.dumps(text, ensure_ascii=False)


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def _rewrite_refs(node: Any, base: str) -> Any:
    """JSON pointers into the parameters schema, moved under `base` (its new place); pointers
    into $defs / definitions stay, as those are hoisted to the call schema's root."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
                keep = v.startswith(("#/$defs/", "#/definitions/"))
                out[k] = v if keep else base + v[1:]
            else:
                out[k] = _rewrite_refs(v, base)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, base) for v in node]
    return node


def call_schema(tool: FunctionTool, args_key: str) -> dict:
    """The JSON Schema of one call to `tool`: {"name": <its name>, args_key: <its arguments>}."""
    params = tool.arguments_schema()
    hoisted = {k: params[k] for k in ("$defs", "definitions") if k in params}
    params = {k: v for k, v in params.items() if k not in hoisted and k not in ("$schema", "$id")}
    params = _rewrite_refs(params, f"#/properties/{args_key}")
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
        **hoisted,
        "x-guidance": JSON_OPTIONS,
    }


def tool_grammar(syntax: CallSyntax, request: ToolRequest | None, auto_grammar: bool | None = None) -> str | None:
    """The Lark grammar for `request`'s calls in `syntax`, or None where nothing is held (no
    tools, tool_choice none, or auto with the auto grammar off)."""
    if request is None or not request.offered:
        return None
    if request.tool_choice == "auto" and not (AUTO_GRAMMAR if auto_grammar is None else auto_grammar):
        return None
    lines = ["%llguidance {}"]
    tools = request.offered
    lines.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        lines.append(f"fn_{i}: %json {json.dumps(call_schema(tool, syntax.args_key), ensure_ascii=False)}")
    # A named tool_choice asks for that one call (as vLLM's); greedy SmolLM2 otherwise repeats it
    # until max_tokens.
    parallel = request.parallel_tool_calls and syntax.multiple and request.tool_choice != "function"
    auto = request.tool_choice == "auto"
    if not syntax.open_tag:
        # Bare JSON calls: one object, or (auto) text whose first non-blank character is not '{'.
        lines.append("start: TEXT | fn" if auto else "start: fn")
        lines.append(r"TEXT: /\s*([^{\s](?s:.*))?/")
        return "\n".join(lines) + "\n"
    inner = f"{_lit(syntax.pad)} fn {_lit(syntax.pad)}" if syntax.pad else "fn"
    close = _lit(syntax.close_tag)
    more = f" ({_lit(syntax.separator + syntax.open_tag)} {inner} {close})*" if parallel else ""
    if auto:
        lines.append(f"start: TEXT | head {inner} {close}{more}")
        lines.append("TEXT: /(?s:.*)/")
        lines.append(f"head[lazy]: /(?s:.*){_regex_escape(syntax.open_tag)}/")
    else:
        lines.append(f"start: {_lit(syntax.open_tag)} {inner} {close}{more}")
    return "\n".join(lines) + "\n"
