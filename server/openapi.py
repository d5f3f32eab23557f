"""JSON schemas of the request bodies, for the OpenAPI document (GET /openapi.json). The routes
read their bodies themselves (protocol.py checks them, with errors that name the field), so
FastAPI cannot infer these; they are written here and attached with `openapi_extra`. They say
what is accepted; what they cannot say (min_tokens <= max_tokens, one of url/path/image) the
checks answer with a 400, which the schemas list too."""

from __future__ import annotations

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

_SAMPLING = {
    "max_tokens": {
        "type": "integer",
        "minimum": 0,
        "description": "0 scores the prompt: with echo, or prompt_logprobs",
    },
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "min_tokens": {"type": "integer", "minimum": 0},
    "seed": _INT,
    "stop": {"oneOf": [_STR, {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 64}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 64},
    "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL,
    "include_stop_str_in_output": _BOOL,
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "priority": _INT,
    # Fair shares (server/tenants.py): batch runs in the slots interactive traffic leaves.
    "tier": {"enum": ["interactive", "batch"]},
    "tenant": {"type": "string", "minLength": 1, "description": "absent, or the API key's own tenant"},
}
_OPENAI = {
    "model": {"type": "string", "minLength": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 16},
    "best_of": {
        "type": "integer",
        "minimum": 1,
        "maximum": 16,
        "description": "at least n: the n of highest cumulative logprob are returned (not with stream)",
    },
    "prompt_logprobs": {
        "type": "integer",
        "minimum": 0,
        "maximum": 20,
        "description": "vLLM's: each prompt token's logprob and k alternatives (not with stream)",
    },
    "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}, "additionalProperties": False},
    "request_timeout": {"type": "number", "exclusiveMinimum": 0},
    "user": _STR,
    "response_format": {
        "type": "object",
        "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}, "json_schema": {"type": "object"}},
        "required": ["type"],
    },
    "structured_outputs": {"type": "object", "minProperties": 1, "maxProperties": 1},
    "guided_json": {"oneOf": [{"type": "object"}, _STR]},
    "guided_regex": _STR,
    "guided_choice": {"type": "array", "items": _STR, "minItems": 1},
    "guided_grammar": _STR,
}
_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "developer", "tool"]},
        "content": {
            "oneOf": [
                _STR,
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"type": {"const": "text"}, "text": _STR},
                        "required": ["type", "text"],
                    },
                },
            ]
        },
        "name": _STR,
        "tool_calls": {  # an assistant's calls, sent back: its content may then be null
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string", "minLength": 1},
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "properties": {"name": {"type": "string", "minLength": 1}, "arguments": _STR},
                        "required": ["name", "arguments"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "function"],
                "additionalProperties": False,
            },
        },
        "tool_call_id": {"type": "string", "minLength": 1, "description": "a tool message: the call it answers"},
    },
    "required": ["role"],
    "additionalProperties": False,
}
_MESSAGES = {"type": "array", "items": _MESSAGE, "minItems": 1}
_FUNCTION = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": _STR,
        "parameters": {"type": "object", "description": "the arguments' JSON Schema (an object)"},
        "strict": _BOOL,
    },
    "required": ["name"],
    "additionalProperties": False,
}
_TOOLS = {
    "tools": {
        "type": "array",
        "maxItems": 128,
        "items": {
            "type": "object",
            "properties": {"type": {"const": "function"}, "function": _FUNCTION},
            "required": ["type", "function"],
            "additionalProperties": False,
        },
    },
    "tool_choice": {
        "oneOf": [
            {"enum": ["auto", "required", "none"]},
            {
                "type": "object",
                "properties": {
                    "type": {"const": "function"},
                    "function": {"type": "object", "properties": {"name": _STR}, "required": ["name"]},
                },
                "required": ["type", "function"],
                "additionalProperties": False,
            },
        ]
    },
    "parallel_tool_calls": _BOOL,
}

SCHEMAS: dict[str, dict] = {
    "Completion": {
        "type": "object",
        "properties": {
            "prompt": {"oneOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]},
            "echo": _BOOL,
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            **_OPENAI,
            **_SAMPLING,
        },
        "required": ["prompt"],
        "additionalProperties": False,
    },
    "ChatCompletion": {
        "type": "object",
        "properties": {
            "messages": _MESSAGES,
            "max_completion_tokens": {"type": "integer", "minimum": 0, "description": "0 only with prompt_logprobs"},
            "logprobs": _BOOL,
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            **_TOOLS,
            **_OPENAI,
            **_SAMPLING,
        },
        "required": ["messages"],
        "additionalProperties": False,
    },
    "Job": {
        "type": "object",
        "description": "task generate: prompt or messages, and SamplingParams fields; task detect: image, url or path",
        "properties": {
            "task": {"enum": ["generate", "detect"]},
            "model": {"type": "string", "minLength": 1},
            "job_id": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
            "prompt": {"oneOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]},
            "messages": _MESSAGES,
            "deadline_s": {"type": "number", "exclusiveMinimum": 0},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            "image": {"type": "string", "minLength": 1, "contentEncoding": "base64"},
            "url": {"type": "string", "minLength": 1},
            "path": {"type": "string", "minLength": 1},
            **_TOOLS,
            "tool_call_parser": {"enum": ["hermes", "llama3_json", "generic"]},
            **_SAMPLING,
        },
        "additionalProperties": False,
    },
    "Detect": {
        "type": "object",
        "description": "exactly one of url, path or image (base64)",
        "properties": {
            "url": {"type": "string", "minLength": 1},
            "path": {"type": "string", "minLength": 1},
            "image": {"type": "string", "minLength": 1, "contentEncoding": "base64"},
        },
        "additionalProperties": False,
    },
}

ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": _STR,
                "type": _STR,
                "param": {"type": ["string", "null"]},
                "code": {"type": ["integer", "string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}
_ERRORS = {
    str(code): {"description": what, "content": {"application/json": {"schema": ERROR}}}
    for code, what in (
        (400, "a bad field, named in error.param"),
        (401, "a missing or wrong API key"),
        (404, "no such model or job"),
        (408, "the body did not arrive in time"),
        (409, "a job id reused with other arguments"),
        (413, "the body is too large"),
        (429, "the API key's tenant is past one of its limits; Retry-After says when to retry"),
        (501, "the job API without workers"),
        (503, "overloaded or the job store unreachable; Retry-After says when to retry"),
        (504, "past the request's timeout"),
    )
}


def request_body(name: str, *, required: bool = True, extra_content: dict | None = None) -> dict:
    """`openapi_extra` for a route whose JSON body is SCHEMAS[name], with the error answers."""
    content = {"application/json": {"schema": SCHEMAS[name]}, **(extra_content or {})}
    return {"requestBody": {"required": required, "content": content}, "responses": _ERRORS}


def errors_only() -> dict:
    return {"responses": _ERRORS}
