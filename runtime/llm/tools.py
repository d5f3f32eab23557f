"""Tool calling, as OpenAI's chat completions define it: the request's tools checked, the
prompt rendered per chat-template family, a grammar that holds the calls to the tools' schemas,
and a streaming parser that turns the model's text into content and calls. I/O-free, no torch:
the server, the workers and the job events import it.

    parse_tools(tools, tool_choice, parallel_tool_calls) -> ToolRequest | None
    fmt = tool_format_for(tokenizer, override)        # "hermes", "llama3_json" or "generic"
    prompt = fmt.render(tokenizer, messages, request)  # the chat prompt, tools included
    params.structured_outputs = fmt.structured_outputs(request)   # {"grammar": <Lark>} or None
    parser = fmt.parser(request)
    for delta_text in stream: deltas = parser.feed(delta_text)   # list[ToolDelta]
    deltas = parser.flush()                            # what was held back, at the end
    message = parser.finish()                          # ParsedMessage(content, tool_calls)

Every error is a ValueError whose message starts with the field's path (`tools[1].function.name
must be ...`), so the HTTP layer can name the `param`. What crosses Redis (ToolRequest,
ToolDelta, ToolCall, ParsedMessage) has to_dict / from_dict over plain JSON values.

The request and the plain data live in tools_types.py, the formats, grammars and parser in
tools_formats.py, tools_grammar.py and tools_parser.py; this module is their one public face.
"""

from __future__ import annotations

from runtime.llm.tools_formats import TOOL_FORMATS, ToolFormat, render_generic, tool_format_for
from runtime.llm.tools_grammar import tool_grammar
from runtime.llm.tools_parser import CallSyntax, ToolCallParser
from runtime.llm.tools_types import (
    CHOICES,
    FunctionTool,
    ParsedMessage,
    ToolCall,
    ToolDelta,
    ToolRequest,
    new_call_id,
    parse_tools,
)

__all__ = [
    "CHOICES",
    "TOOL_FORMATS",
    "CallSyntax",
    "FunctionTool",
    "ParsedMessage",
    "ToolCall",
    "ToolCallParser",
    "ToolDelta",
    "ToolFormat",
    "ToolRequest",
    "new_call_id",
    "parse_tools",
    "render_generic",
    "tool_format_for",
    "tool_grammar",
]
