"""Tool calling without a model: the request's checks, the streaming parser, and the grammars
run through llguidance on SmolLM2's tokenizer (strings accepted and refused, and random walks
through the mask, which is what a random-weight model does under the grammar)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from tool_support import BOOK, PING, TOOLS, WEATHER, answer_errors, call_errors, validate

from runtime.llm import tools_grammar
from runtime.llm.tools import (
    ParsedMessage,
    ToolCall,
    ToolCallParser,
    ToolDelta,
    ToolFormat,
    ToolRequest,
    parse_tools,
)
from runtime.llm.tools_formats import SYNTAXES

# -- the request -----------------------------------------------------------------------------------


def test_parse_tools_defaults_and_round_trip():
    req = parse_tools(TOOLS)
    assert req.tool_choice == "auto" and req.parallel_tool_calls is False and req.function_name is None
    assert [t.name for t in req.tools] == ["get_weather", "add", "book_table", "ping"]
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    assert named.tool_choice == "function" and named.names == {"add"} and named.parallel_tool_calls is False
    for r in (req, named, parse_tools(TOOLS, "none"), parse_tools(TOOLS, "required")):
        data = json.loads(json.dumps(r.to_dict()))  # plain JSON, as over the broker
        assert ToolRequest.from_dict(data) == r
    assert parse_tools(TOOLS, "none").names == frozenset()
    assert parse_tools(None) is None and parse_tools([], "none") is None


@pytest.mark.parametrize(
    "tools, choice, parallel, prefix",
    [
        ("x", None, None, "tools must be a list"),
        ([{"type": "code"}], None, None, "tools[0].type must be 'function'"),
        ([WEATHER, {"type": "function"}], None, None, "tools[1].function must be an object"),
        ([{"type": "function", "function": {"name": "a b"}}], None, None, "tools[0].function.name must be"),
        ([WEATHER, WEATHER], None, None, "tools[1].function.name 'get_weather' is already"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            None,
            "tools[0].function.parameters.type must be 'object'",
        ),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, None, "tools[0].function.strict"),
        ([{"type": "function", "function": {"name": "f", "extra": 1}}], None, None, "tools[0].function has unknown"),
        ([WEATHER], "sometimes", None, "tool_choice must be one of"),
        ([WEATHER], {"type": "function", "function": {"name": "x"}}, None, "tool_choice.function.name 'x' is not one"),
        ([WEATHER], {"type": "tool"}, None, "tool_choice.type must be 'function'"),
        ([WEATHER], {"type": "function"}, None, "tool_choice.function must be an object"),
        ([WEATHER], None, "yes", "parallel_tool_calls must be a boolean"),
        (None, "required", None, "tool_choice must be absent or 'none' when no tools"),
        ([WEATHER] * 129, None, None, "tools must hold at most 128"),
    ],
)
def test_parse_tools_errors_name_the_field(tools, choice, parallel, prefix):
    with pytest.raises(ValueError) as e:
        parse_tools(tools, choice, parallel)
    assert str(e.value).startswith(prefix), str(e.value)


def test_tools_module_imports_without_torch():
    code = "import sys, runtime.llm.tools; print(sorted(m for m in ('torch', 'llguidance', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_schema_check_itself_fails_bad_arguments():
    # The tests' JSON-Schema check must be able to say no, or the validations below prove nothing.
    weather = WEATHER["function"]["parameters"]
    assert validate(weather, {"city": "Paris", "unit": "celsius"}) == []
    assert validate(weather, {"city": "Paris"})  # missing unit
    assert validate(weather, {"city": "Paris", "unit": "kelvin"})
    assert validate(weather, {"city": "Paris", "unit": "celsius", "x": 1})
    assert validate(weather, {"city": "P" * 21, "unit": "celsius"})
    book = BOOK["function"]["parameters"]
    assert validate(book, {"when": {"month": 2, "day": 3}, "guests": []}) == []
    assert validate(book, {"when": {"month": 13, "day": 3}, "guests": []})
    assert call_errors(ToolCall("c", "ping", '{"a": 1}'), {"ping"})
    assert call_errors(ToolCall("c", "add", '{"a": 1, "b": 2}'), {"ping"})


# -- the parser ------------------------------------------------------------------------------------

NAMES = {"get_weather", "add", "book_table", "ping"}
CALL1 = '{"name": "get_weather", "arguments": {"city": "Pa</tool_call>ris", "unit": "celsius"}}'
CALL2 = '{"name": "add", "arguments": {"a": 1, "b": -2}}'
HERMES_TEXT = f"Let me look.\n<tool_call>\n{CALL1}\n</tool_call>\n<tool_call>\n{CALL2}\n</tool_call>"


def feed_all(parser: ToolCallParser, pieces) -> tuple[list[ToolDelta], ParsedMessage]:
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.flush()
    return deltas, parser.finish()


def chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 1000])
def test_parser_tags_split_across_deltas(size):
    deltas, msg = feed_all(ToolCallParser(SYNTAXES["hermes"], NAMES), chunks(HERMES_TEXT, size))
    assert msg.content == "Let me look."
    assert [c.name for c in msg.tool_calls] == ["get_weather", "add"]
    assert json.loads(msg.tool_calls[0].arguments) == {"city": "Pa</tool_call>ris", "unit": "celsius"}
    assert msg.tool_calls[1].arguments == '{"a": 1, "b": -2}'
    assert msg.malformed == []
    # No tag prefix leaks: the content deltas are exactly the text before the first tag.
    assert "".join(d.content for d in deltas if d.is_content) == "Let me look."
    # Each call: a first delta with id, name and arguments "", then fragments that join to arguments.
    for i, call in enumerate(msg.tool_calls):
        mine = [d for d in deltas if d.index == i]
        assert (mine[0].id, mine[0].name, mine[0].arguments) == (call.id, call.name, "")
        assert all(d.id is None and d.name is None for d in mine[1:])
        assert "".join(d.arguments for d in mine[1:]) == call.arguments
        assert call.id.startswith("call_") and len(call.id) == 29
    assert msg.tool_calls[0].id != msg.tool_calls[1].id
    if size == 1:
        assert len([d for d in deltas if d.index == 0]) > 10  # streamed in fragments, not at the close


def test_parser_holds_back_a_tag_prefix_only_while_it_may_be_a_tag():
    p = ToolCallParser(SYNTAXES["generic"], NAMES)
    assert [d.content for d in p.feed("Hello <tool")] == ["Hello"]
    assert p.feed("_ca") == []
    assert [d.content for d in p.feed("t is not a tag")] == [" <tool_cat is not a tag"]
    assert [d.content for d in p.feed(" <")] == []
    assert [d.content for d in p.flush()] == [" <"]
    assert p.finish().content == "Hello <tool_cat is not a tag <"


def test_parser_generic_calls_and_whitespace():
    text = f"<tool_call>{CALL2}</tool_call>\n<tool_call>" + '{"name": "ping", "arguments": {}}</tool_call>\n'
    deltas, msg = feed_all(ToolCallParser(SYNTAXES["generic"], NAMES), chunks(text, 4))
    assert msg.content is None and [c.name for c in msg.tool_calls] == ["add", "ping"]
    assert msg.tool_calls[1].arguments == "{}"
    assert not [d for d in deltas if d.is_content]
    assert [d.to_openai() for d in deltas if d.index == 1][0] == {
        "index": 1,
        "id": msg.tool_calls[1].id,
        "type": "function",
        "function": {"name": "ping", "arguments": ""},
    }


def test_parser_malformed_calls_are_listed_not_called():
    parser = ToolCallParser(SYNTAXES["generic"], NAMES)
    bad_json = '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    cut = '<tool_call>{"name": "add", "argu'
    _, msg = feed_all(parser, chunks(bad_json + unknown + "ok " + cut, 3))
    assert msg.tool_calls == []
    assert msg.malformed == [bad_json, unknown, cut]
    assert msg.content == "ok"
    assert answer_errors(msg, NAMES)


def test_parser_reads_arguments_in_any_key_order_without_streaming_them_early():
    text = '<tool_call>{"arguments": {"a": 3, "b": 4}, "name": "add"}</tool_call>'
    deltas, msg = feed_all(ToolCallParser(SYNTAXES["generic"], NAMES), [text])
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [("add", {"a": 3, "b": 4})]
    assert "".join(d.arguments or "" for d in deltas) == msg.tool_calls[0].arguments


def test_parser_llama3_bare_json():
    syntax = SYNTAXES["llama3_json"]
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    _, msg = feed_all(ToolCallParser(syntax, NAMES), chunks("\n" + call, 2))
    assert msg.content is None and [(c.name, c.arguments) for c in msg.tool_calls] == [("add", '{"a": 1, "b": 2}')]
    _, msg = feed_all(ToolCallParser(syntax, NAMES), chunks("The sum is {a}.", 2))
    assert msg.content == "The sum is {a}." and msg.tool_calls == []


def test_parser_disabled_is_plain_text():
    _, msg = feed_all(ToolCallParser(SYNTAXES["generic"], NAMES, enabled=False), chunks(HERMES_TEXT, 3))
    assert msg.content == HERMES_TEXT and msg.tool_calls == []


def test_plain_data_round_trips():
    delta = ToolDelta(index=2, arguments='{"a"')
    assert ToolDelta.from_dict(json.loads(json.dumps(delta.to_dict()))) == delta
    assert delta.to_openai() == {"index": 2, "function": {"arguments": '{"a"'}}
    with pytest.raises(ValueError):
        ToolDelta(content="x").to_openai()
    msg = ParsedMessage("hi", [ToolCall("call_1", "add", '{"a": 1}')], ["<tool_call>{"])
    assert ParsedMessage.from_dict(json.loads(json.dumps(msg.to_dict()))) == msg
    assert msg.to_openai()["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    ]


# -- the grammars ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    from runtime.llm.structured import GrammarCompiler

    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])


def grammar(fmt: str, choice, parallel=None, tools=TOOLS) -> dict:
    spec = ToolFormat(fmt).structured_outputs(parse_tools(tools, choice, parallel))
    assert spec is not None and set(spec) == {"grammar"}
    return spec


def accepts(compiler, tokenizer, spec: dict, text: str) -> bool:
    """Whether the grammar takes `text` whole, as a complete answer."""
    m = compiler.compile(spec).matcher()
    return all(m.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting


W = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
A = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


def test_grammar_required_and_named(compiler, tokenizer):
    req = grammar("generic", "required", parallel=True)
    ok = [f"<tool_call>{W}</tool_call>", f"<tool_call>{W}</tool_call>\n<tool_call>{A}</tool_call>"]
    bad = [
        "Sure.",
        f"Sure. <tool_call>{W}</tool_call>",  # no text under required
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',  # b is required
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2000}}</tool_call>',  # maximum 1000
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}</tool_call>',
        '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>',  # not the format's spacing
        f"<tool_call>{A}</tool_call> done",
    ]
    assert [accepts(compiler, tokenizer, req, t) for t in ok] == [True, True]
    assert [accepts(compiler, tokenizer, req, t) for t in bad] == [False] * len(bad)
    single = grammar("generic", "required", parallel=False)
    assert accepts(compiler, tokenizer, single, ok[0]) and not accepts(compiler, tokenizer, single, ok[1])
    named = grammar("generic", {"type": "function", "function": {"name": "add"}})
    assert accepts(compiler, tokenizer, named, f"<tool_call>{A}</tool_call>")
    assert not accepts(compiler, tokenizer, named, ok[0])
    assert not accepts(compiler, tokenizer, named, f"<tool_call>{A}</tool_call>\n<tool_call>{A}</tool_call>")
    hermes = grammar("hermes", "required")
    assert accepts(compiler, tokenizer, hermes, f"<tool_call>\n{A}\n</tool_call>")
    assert not accepts(compiler, tokenizer, hermes, f"<tool_call>{A}</tool_call>")


def test_grammar_auto_is_text_or_calls(compiler, tokenizer):
    auto = grammar("generic", "auto", parallel=True)
    assert accepts(compiler, tokenizer, auto, "It is sunny, I think.\n\nBye.")
    assert accepts(compiler, tokenizer, auto, f"<tool_call>{W}</tool_call>")
    assert accepts(compiler, tokenizer, auto, f"Checking. <tool_call>{W}</tool_call>\n<tool_call>{A}</tool_call>")
    assert not accepts(compiler, tokenizer, auto, "Checking. <tool_call> the weather")
    assert not accepts(compiler, tokenizer, auto, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    assert not accepts(compiler, tokenizer, auto, f"<tool_call>{W}</tool_call> and some text after")


def test_grammar_llama3_json(compiler, tokenizer):
    auto = grammar("llama3_json", "auto")
    call = '{"name": "add", "parameters": {"a": 5, "b": 6}}'
    assert accepts(compiler, tokenizer, auto, call)
    assert accepts(compiler, tokenizer, auto, "No call needed: 11.")
    assert not accepts(compiler, tokenizer, auto, '{"name": "add", "arguments": {"a": 5, "b": 6}}')
    assert not accepts(compiler, tokenizer, auto, f"{call}\n{call}")  # one call a message in this family
    assert accepts(compiler, tokenizer, grammar("llama3_json", "required"), call)
    assert not accepts(compiler, tokenizer, grammar("llama3_json", "required"), "11")


def test_grammar_defs_and_refs(compiler, tokenizer):
    spec = grammar("generic", "required", tools=[BOOK, PING])
    good = '{"name": "book_table", "arguments": {"when": {"month": 2, "day": 29}, "guests": ["ana", "bo"]}}'
    assert accepts(compiler, tokenizer, spec, f"<tool_call>{good}</tool_call>")
    assert accepts(compiler, tokenizer, spec, '<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    assert not accepts(compiler, tokenizer, spec, f"<tool_call>{good.replace('2,', '13,')}</tool_call>")
    assert not accepts(compiler, tokenizer, spec, '<tool_call>{"name": "ping", "arguments": {"x": 1}}</tool_call>')


def test_no_grammar_for_none_or_with_auto_switched_off(monkeypatch):
    fmt = ToolFormat("generic")
    assert fmt.structured_outputs(parse_tools(TOOLS, "none")) is None
    assert fmt.structured_outputs(None) is None
    assert fmt.structured_outputs(parse_tools(TOOLS), auto_grammar=False) is None
    monkeypatch.setattr(tools_grammar, "AUTO_GRAMMAR", False)
    assert fmt.structured_outputs(parse_tools(TOOLS)) is None
    assert fmt.structured_outputs(parse_tools(TOOLS, "required")) is not None  # only auto is switched


def random_walk(compiler, tokenizer, spec: dict, prefix: str, seed: int, limit: int = 600) -> str:
    """Text sampled uniformly among the tokens the mask allows, after a forced prefix: a
    random-weight model's behaviour under the grammar, without the model."""
    rng = np.random.default_rng(seed)
    m = compiler.compile(spec).matcher()
    ids = tokenizer.encode(prefix, add_special_tokens=False)
    assert all(m.accept_token(t) for t in ids)
    mask = compiler.allocate_bitmask(1)
    eos = tokenizer.eos_token_id
    for _ in range(limit):
        if m.is_terminated:
            break
        m.fill_bitmask(mask, 0)
        bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[: len(tokenizer)]
        token = int(rng.choice(np.flatnonzero(bits)))
        if token == eos:
            break
        assert m.accept_token(token)
        ids.append(token)
    else:
        pytest.fail(f"random walk {seed} did not end in {limit} tokens")
    return tokenizer.decode(ids)


@pytest.mark.parametrize("fmt", ["generic", "hermes"])
def test_random_walks_after_the_tag_are_valid_calls(compiler, tokenizer, fmt):
    spec = grammar(fmt, "auto")
    for seed in range(12):
        text = random_walk(compiler, tokenizer, spec, "Let me check that. <tool_call>", seed)
        msg = ToolFormat(fmt).parse(text, parse_tools(TOOLS))
        assert msg.tool_calls and answer_errors(msg, NAMES) == [], (seed, text)
        assert msg.content == "Let me check that."
