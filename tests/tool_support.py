"""What the tool-calling tests share: the tools they offer, a JSON-Schema check for the subset
those schemas use (jsonschema is not among the test dependencies), chat templates written for
the tiny random models, and the rule that says whether an answer is good."""

from __future__ import annotations

import json
import shutil

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
# $defs and a $ref: the grammar hoists them to each call's schema root.
BOOK = {
    "type": "function",
    "function": {
        "name": "book_table",
        "parameters": {
            "$defs": {
                "Date": {
                    "type": "object",
                    "properties": {
                        "month": {"type": "integer", "minimum": 1, "maximum": 12},
                        "day": {"type": "integer", "minimum": 1, "maximum": 31},
                    },
                    "required": ["month", "day"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "when": {"$ref": "#/$defs/Date"},
                "guests": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            },
            "required": ["when", "guests"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping", "description": "No arguments"}}
TOOLS = [WEATHER, ADD, BOOK, PING]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
NO_EXTRA = {"ping"}  # a tool without parameters takes no arguments at all

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def _is_type(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def validate(schema: dict, value, root: dict | None = None, at: str = "$") -> list[str]:
    """The ways `value` breaks `schema` (empty: valid), for type, enum, const, properties,
    required, additionalProperties, string lengths, numeric bounds, items, array lengths and
    local $refs."""
    root = schema if root is None else root
    if "$ref" in schema:
        node = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        return validate(node, value, root, at)
    errors = []
    t = schema.get("type")
    if t is not None and not any(_is_type(value, n) for n in ([t] if isinstance(t, str) else t)):
        return [f"{at}: {value!r} is not of type {t}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{at}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{at}: {value!r} is not {schema['const']!r}")
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)) or len(value) < schema.get("minLength", 0):
            errors.append(f"{at}: length {len(value)} out of bounds")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            errors.append(f"{at}: {value} out of bounds")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)) or len(value) < schema.get("minItems", 0):
            errors.append(f"{at}: {len(value)} items out of bounds")
        for i, item in enumerate(value):
            errors += validate(schema.get("items", {}), item, root, f"{at}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{at}: missing {k!r}" for k in schema.get("required", ()) if k not in value]
        for k, v in value.items():
            if k in props:
                errors += validate(props[k], v, root, f"{at}.{k}")
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{at}: unexpected {k!r}")
    return errors


def call_errors(call, offered: set[str]) -> list[str]:
    """Why a parsed ToolCall is not a valid call to one of `offered` (empty: it is)."""
    if call.name not in offered:
        return [f"{call.name!r} is not an offered tool"]
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError as e:
        return [f"{call.name}: arguments are not JSON: {e}"]
    if call.name in NO_EXTRA:
        return [] if args == {} else [f"{call.name}: takes no arguments, got {args!r}"]
    return [f"{call.name}: {e}" for e in validate(SCHEMAS[call.name], args)]


def answer_errors(message, offered: set[str], tag: str = "<tool_call>") -> list[str]:
    """Why an auto answer is bad: it is good when it is plain text without the open tag, or
    calls (after optional text) that all parse and validate."""
    errors = [f"malformed call {raw[:80]!r}" for raw in message.malformed]
    if tag and message.content and tag in message.content:
        errors.append(f"tag in content {message.content[:80]!r}")
    for call in message.tool_calls:
        errors += call_errors(call, offered)
    return errors


# A Hermes / Qwen2.5-style ChatML template that renders tools (written for these tests).
# Hugging Face renders templates with trim_blocks: a newline right after a block tag is
# dropped, so the newlines that matter follow text or come from {{ "\n" }}.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\n\n' }}# Tools\n\nYou may call functions. Their signatures are within <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "For each call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>{{ '\n' }}"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% if message.content %}{{ '\n' + message.content }}{% endif %}"
    "{% for tc in message.tool_calls %}{{ '\n' }}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>{{ '\n' }}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\n' }}{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# SmolLM2's own template (ChatML, no tools): what a template without tool support looks like.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A Llama 3.1-style template with JSON calls (headers as text: SmolLM2's vocabulary has no
# Llama special tokens; the family is told by them all the same).
LLAMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>{{ '\n\n' }}"
    "{% for tc in message.tool_calls %}"
    '{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}'
    "{% endfor %}<|eot_id|>"
    "{% elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>{{ '\n\n' + message.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>{{ '\n\n' }}"
    "{% if loop.last and tools %}Given the following functions, respond with a JSON for a function call "
    'in the format {"name": function name, "parameters": dictionary of argument name and its value}.\n\n'
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n\n' }}{% endfor %}{% endif %}"
    "{{ message.content }}<|eot_id|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\n\n' }}{% endif %}"
)


def with_template(model_dir: str, out: str, template: str) -> str:
    """A copy of the HF folder `model_dir` whose tokenizer has `template` as its chat template."""
    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = template
    tok.save_pretrained(out)
    return out
