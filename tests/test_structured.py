"""Structured output (runtime/llm/structured.py): specs and their errors, the bitmask and its
application, EOS / termination / rollback, and a reference integration that runs the real
SmolLM2 token by token under each kind of constraint (the loop the engine should follow)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch

from runtime.llm import structured
from runtime.llm.structured import (
    GrammarCompiler,
    StructuredSpec,
    apply_token_bitmask,
    structured_outputs_from_response_format,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
CITIES = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "population": {"type": "integer", "minimum": 0},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}


def validate(value, schema: dict, path: str = "$") -> None:
    """The JSON-schema subset these tests use (jsonschema is not a dependency)."""
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), f"{path}: not an object"
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key}"
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: extra keys {set(value) - set(props)}"
        for key, sub in props.items():
            if key in value:
                validate(value[key], sub, f"{path}.{key}")
    elif kind == "array":
        assert isinstance(value, list), f"{path}: not an array"
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30), f"{path}: length"
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{path}[{i}]")
    elif kind == "string":
        assert isinstance(value, str), f"{path}: not a string"
        assert len(value) <= schema.get("maxLength", 1 << 30), f"{path}: too long"
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: not an integer"
        assert schema.get("minimum", -(1 << 62)) <= value <= schema.get("maximum", 1 << 62), f"{path}: range"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id])


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = bitmask[row].tolist()
    return {t for t in range(vocab) if (bits[t // 32] >> (t % 32)) & 1}


# ---- specs -------------------------------------------------------------------------------


def test_spec_parsing_and_errors_name_the_field():
    s = StructuredSpec.parse({"json": json.dumps(PERSON)})
    assert s.kind == "json" and s.value == PERSON
    assert s.key == StructuredSpec.parse({"json": PERSON}).key  # text and dict: one cache entry
    reordered = dict(reversed(list(PERSON["properties"].items())))
    assert s.key != StructuredSpec.parse({"json": {**PERSON, "properties": reordered}}).key  # order matters
    assert StructuredSpec.parse({"choice": ["a", "b"]}).value == ("a", "b")
    bad = [
        ({}, "structured_outputs must be an object with exactly one key"),
        ({"json": PERSON, "regex": "a"}, "structured_outputs must be an object with exactly one key"),
        ("json", "structured_outputs must be an object"),
        ({"structural_tag": "x"}, "structured_outputs key must be one of"),
        ({"json": "{nope"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1]}, "structured_outputs.json must be a JSON-schema object"),
        ({"json_object": False}, "structured_outputs.json_object must be true"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"grammar": 3}, "structured_outputs.grammar must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list"),
        ({"regex": "a" * 300_000}, "structured_outputs.regex must be at most"),
    ]
    for spec, message in bad:
        with pytest.raises(ValueError) as e:
            StructuredSpec.parse(spec)
        assert str(e.value).startswith(message), (spec, str(e.value))


def test_spec_parsing_imports_neither_torch_nor_the_grammar_engine():
    code = (
        "from runtime.llm.structured import StructuredSpec, structured_outputs_from_response_format as f\n"
        "StructuredSpec.parse({'json': {'type': 'object'}}); f({'type': 'json_object'})\n"
        "import sys; print(' '.join(sys.modules))"
    )
    mods = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert "torch" not in mods and "llguidance" not in mods


def test_response_format_translation():
    f = structured_outputs_from_response_format
    assert f(None) is None and f({"type": "text"}) is None
    assert f({"type": "json_object"}) == {"json_object": True}
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    assert f(rf) == {"json": PERSON}
    bad = [
        ({"type": "xml"}, "response_format.type must be one of"),
        ({"type": "json_schema"}, "response_format.json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "p"}}, "response_format.json_schema.schema is required"),
        ({"type": "json_schema", "json_schema": {"name": "p", "schema": 1}}, "response_format.json_schema.schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "x": 1}},
            "response_format.json_schema has",
        ),
        ({"type": "json_object", "json_schema": {}}, "response_format.json_schema is only allowed"),
        ({"type": "text", "extra": 1}, "response_format has unknown fields"),
    ]
    for rf, message in bad:
        with pytest.raises(ValueError) as e:
            f(rf)
        assert str(e.value).startswith(message), (rf, str(e.value))


def test_compile_errors_carry_the_engines_message_and_cache_hits(compiler):
    cases = [
        ({"json": {"$ref": "#/definitions/nope"}}, "structured_outputs.json could not be compiled", "nope"),
        ({"json": {"type": "strange"}}, "structured_outputs.json could not be compiled", "strange"),
        ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json could not", "uniqueItems"),
        ({"regex": "[a-z"}, "structured_outputs.regex could not be compiled", "unclosed character class"),
        ({"grammar": "start: missing_rule"}, "structured_outputs.grammar could not be compiled", "missing_rule"),
    ]
    for spec, prefix, detail in cases:
        with pytest.raises(ValueError) as e:
            compiler.compile(spec)
        assert str(e.value).startswith(prefix) and detail in str(e.value), str(e.value)
    assert compiler.compile({"json": PERSON}) is compiler.compile({"json": json.dumps(PERSON)})


# ---- bitmask -----------------------------------------------------------------------------


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for k, r in enumerate(rows):
        for t in range(logits.shape[1]):
            word = t // 32
            if word >= bitmask.shape[1] or not (int(bitmask[k, word]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab,words", [(100, 4), (96, 3), (130, 4)])  # ragged, exact, logits wider
def test_apply_token_bitmask_matches_bit_by_bit_reference(vocab, words):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    bitmask[0, 0] = -1  # all 32 bits, the sign bit included
    for rows in ([0, 1, 2], [4, 1, 3], torch.tensor([2, 0, 4])):
        got = apply_token_bitmask(logits.clone(), bitmask, rows)
        ref = reference_apply(logits, bitmask, rows.tolist() if isinstance(rows, torch.Tensor) else rows)
        assert torch.equal(got, ref), rows
    # The device path (shifts) and the host path (numpy's unpackbits) unpack alike.
    assert torch.equal(structured._unpack_torch(bitmask), structured._unpack(bitmask))
    untouched = logits.clone()
    assert torch.equal(apply_token_bitmask(untouched, bitmask, []), logits)


def test_model_vocab_wider_than_tokenizer_never_allows_the_padding(tokenizer):
    wide = len(tokenizer) + 100
    c = GrammarCompiler(tokenizer, vocab_size=wide, eos_token_ids=[tokenizer.eos_token_id])
    assert c.words == (wide + 31) // 32
    m = c.matcher({"json_object": True})
    mask = c.allocate_bitmask(1)
    m.fill_bitmask(mask, 0)
    ok = allowed(mask, 0, wide)
    assert ok and max(ok) < len(tokenizer)
    logits = apply_token_bitmask(torch.zeros(1, wide), mask, [0])
    assert torch.isinf(logits[0, len(tokenizer) :]).all()
    with pytest.raises(ValueError, match="^vocab_size must be at least"):
        GrammarCompiler(tokenizer, vocab_size=len(tokenizer) - 1)


def test_eos_is_forced_when_complete_and_rollback_replays(compiler, tokenizer):
    eos = tokenizer.eos_token_id
    m = compiler.matcher({"json": COLOR})
    mask = compiler.allocate_bitmask(2)
    ids = tokenizer.encode('{"color": "green"}', add_special_tokens=False)
    masks = []
    for t in ids:
        m.fill_bitmask(mask, 0)
        masks.append(allowed(mask, 0, compiler.vocab_size))
        assert t in masks[-1] and eos not in masks[-1] and not m.is_terminated
        assert m.accept_token(t)
    assert m.is_terminated and m.is_accepting
    m.fill_bitmask(mask, 0)
    assert allowed(mask, 0, compiler.vocab_size) == {eos}  # complete: EOS only
    assert not compiler.matcher({"json": COLOR}).accept_token(eos)  # EOS is no JSON
    assert m.accept_token(eos) and m.is_terminated and m.num_tokens == len(ids) + 1
    assert not m.accept_token(ids[0])  # nothing after the end
    m.rollback(1 + 3)  # the EOS and three tokens
    assert not m.is_terminated and m.num_tokens == len(ids) - 3
    m.fill_bitmask(mask, 0)
    assert allowed(mask, 0, compiler.vocab_size) == masks[len(ids) - 3]
    assert m.replay(ids) and m.is_terminated
    m.reset()
    m.fill_bitmask(mask, 1)
    assert allowed(mask, 1, compiler.vocab_size) == masks[0]
    # A regex that may go on is accepting but not terminated: EOS and more digits both allowed.
    d = compiler.matcher({"regex": r"\d+"})
    assert d.accept_token(tokenizer.encode("7", add_special_tokens=False)[0])
    d.fill_bitmask(mask, 0)
    ok = allowed(mask, 0, compiler.vocab_size)
    assert d.is_accepting and not d.is_terminated and eos in ok and len(ok) > 1
    assert d.accept_token(eos) and d.is_terminated


def test_batch_fill_equals_one_by_one(compiler, tokenizer):
    prefixes = ['{"name": "Al', '{"name": "Bo", "age": 4', "", '{"name": "Cy", "age": 7}']
    matchers = []
    for p in prefixes:
        m = compiler.matcher({"json": PERSON})
        assert m.replay(tokenizer.encode(p, add_special_tokens=False))
        matchers.append(m)
    together = compiler.allocate_bitmask(6)
    compiler.fill_bitmasks([(m, 5 - i) for i, m in enumerate(matchers)], together)
    for i, m in enumerate(matchers):
        alone = compiler.allocate_bitmask(1)
        m.fill_bitmask(alone, 0)
        assert torch.equal(together[5 - i], alone[0])
    assert allowed(together, 2, compiler.vocab_size) == {tokenizer.eos_token_id}  # the complete one


def test_fill_and_apply_cost_one_row(compiler, tokenizer):
    """Median CPU cost of one row at SmolLM2's 49152 tokens (printed; see the report / -s)."""
    assert compiler.vocab_size == 49152
    m = compiler.matcher({"json": PERSON})
    mask = compiler.allocate_bitmask(1)
    logits = torch.randn(1, compiler.vocab_size)
    figures = {}
    for label, prefix in (("object start", ""), ("inside a string", '{"name": "Ali')):
        assert m.replay(tokenizer.encode(prefix, add_special_tokens=False))
        times = []
        for _ in range(300):
            t0 = time.perf_counter()
            m.fill_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
        figures[f"fill ({label})"] = statistics.median(times)
    times = []
    for _ in range(300):
        x = logits.clone()
        t0 = time.perf_counter()
        apply_token_bitmask(x, mask, [0])
        times.append(time.perf_counter() - t0)
    figures["apply_token_bitmask"] = statistics.median(times)
    assert int(torch.isfinite(x).sum()) == len(allowed(mask, 0, compiler.vocab_size))
    print("\nstructured output, one row of 49152 tokens, CPU median:")
    for k, v in figures.items():
        print(f"  {k}: {v * 1e6:.1f} us")


# ---- reference integration with the real model -------------------------------------------


@pytest.fixture(scope="module")
def model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def generate(model, tokenizer, compiler, spec: dict, prompt: str, max_tokens=60, temperature=0.0, seed=0):
    """What the engine does per request and step, for one request: fill the row, apply it to the
    logits, sample, accept the token, finish when terminated (or on EOS)."""
    matcher = compiler.matcher(spec)
    mask = compiler.allocate_bitmask(1)
    gen = torch.Generator().manual_seed(seed)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    inputs, past, out = torch.tensor([ids]), None, []
    with torch.no_grad():
        for _ in range(max_tokens):
            res = model(input_ids=inputs, past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[:, -1, :].float()
            matcher.fill_bitmask(mask, 0)
            apply_token_bitmask(logits, mask, [0])
            if temperature == 0:
                token = int(logits.argmax(-1))
            else:
                token = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=gen))
            assert matcher.accept_token(token), matcher.error
            if token in compiler.eos_token_ids:
                break
            out.append(token)
            if matcher.is_terminated:
                break
            inputs = torch.tensor([[token]])
    assert matcher.is_terminated, f"unfinished after {max_tokens} tokens: {tokenizer.decode(out)!r}"
    return tokenizer.decode(out)


SCHEMA_CASES = [
    ("person", PERSON, "Describe a fictional person as JSON with a name and an age.", 60),
    ("color", COLOR, "Pick a color for the sky, as JSON.", 60),
    ("cities", CITIES, "List two large cities with their populations as JSON.", 100),  # up to 3 items
]


@pytest.mark.slow
# Greedy decoding under a grammar runs through the engine in test_llm_structured_engine.py; here the
# sampled path, token by token on HF, so that both paths are covered once.
@pytest.mark.parametrize("temperature", [0.7])
@pytest.mark.parametrize("name,schema,prompt,max_tokens", SCHEMA_CASES, ids=[c[0] for c in SCHEMA_CASES])
def test_smollm2_follows_json_schemas(model, tokenizer, compiler, name, schema, prompt, max_tokens, temperature):
    spec = {"json": schema}
    text = generate(model, tokenizer, compiler, spec, prompt, max_tokens, temperature=temperature, seed=3)
    validate(json.loads(text), schema)


@pytest.mark.slow
def test_smollm2_json_object_regex_choice_and_grammar(model, tokenizer, compiler):
    prompt = 'Reply with a JSON object such as {"animal": "cat", "legs": 4}.'
    text = generate(model, tokenizer, compiler, {"json_object": True}, prompt)
    assert isinstance(json.loads(text), dict)
    date = r"\d{4}-\d{2}-\d{2}"
    text = generate(
        model, tokenizer, compiler, {"regex": date}, "When did Apollo 11 land on the moon?", temperature=0.7
    )
    assert re.fullmatch(date, text), text
    choices = ["positive", "negative", "neutral"]
    text = generate(model, tokenizer, compiler, {"choice": choices}, "Sentiment of 'I love this movie!'?")
    assert text in choices
    gbnf = 'root ::= "The answer is " [0-9]+ "."'
    text = generate(model, tokenizer, compiler, {"grammar": gbnf}, "What is 2 + 3?", max_tokens=20)
    assert re.fullmatch(r"The answer is [0-9]+\.", text), text
