"""Tool formats on tiny random-weight Llamas whose chat templates the tests write: one that
renders tools (Hermes / Qwen2.5 style), one that does not (SmolLM2's ChatML), one of Llama 3.1's
JSON calls. The family is read from the template, the prompt renders tools and follow-up turns,
and under each tool_choice a random model's output at temperature 1.0 parses, its calls
validating against the tools' schemas (the grammar does all the work: the weights are noise)."""

from __future__ import annotations

import json

import pytest
from tool_support import (
    HERMES_TEMPLATE,
    LLAMA3_TEMPLATE,
    PLAIN_TEMPLATE,
    TOOLS,
    answer_errors,
    call_errors,
    with_template,
)

from runtime.llm.api import LLM, ChatResult
from runtime.llm.sampling_params import SamplingParams
from runtime.llm.tools import parse_tools, tool_format_for

NAMES = {t["function"]["name"] for t in TOOLS}
TEMPLATES = {"hermes": HERMES_TEMPLATE, "plain": PLAIN_TEMPLATE, "llama3": LLAMA3_TEMPLATE}
FOLLOW_UP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add 1 and 2, and ping."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
            {"id": "call_p", "type": "function", "function": {"name": "ping", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_a", "content": "3"},
    {"role": "tool", "tool_call_id": "call_p", "content": "pong"},
]


@pytest.fixture(scope="module")
def model_dirs(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-models")
    return {name: with_template(tiny_llama_dir, str(root / name), t) for name, t in TEMPLATES.items()}


@pytest.fixture(scope="module")
def tokenizers(model_dirs):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(d) for name, d in model_dirs.items()}


def test_family_is_read_from_the_template(tokenizers):
    found = {name: tool_format_for(tok) for name, tok in tokenizers.items()}
    assert {n: (f.name, f.native) for n, f in found.items()} == {
        "hermes": ("hermes", True),
        "plain": ("generic", False),
        "llama3": ("llama3_json", True),
    }
    # An override names the format; one that is not the template's family is prompted generically.
    assert not tool_format_for(tokenizers["hermes"], "generic").native
    assert not tool_format_for(tokenizers["plain"], "hermes").native
    assert tool_format_for(tokenizers["llama3"], "llama3_json").native
    with pytest.raises(ValueError, match="^tool_format must be one of hermes, llama3_json, generic"):
        tool_format_for(tokenizers["plain"], "mistral")


def test_hermes_template_renders_tools_and_follow_ups(tokenizers):
    tok = tokenizers["hermes"]
    fmt = tool_format_for(tok)
    prompt = fmt.render(tok, FOLLOW_UP, parse_tools(TOOLS))
    for tool in TOOLS:  # the template's own rendering: each tool as its JSON, in <tools>
        assert json.dumps(tool, ensure_ascii=False) in prompt
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in prompt
    assert '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call><|im_end|>' in prompt
    assert (
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\npong\n</tool_response><|im_end|>"
        in prompt
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    none = fmt.render(tok, FOLLOW_UP, parse_tools(TOOLS, "none"))
    assert "# Tools" not in none and "<tool_response>\n3" in none  # tools left out, the history kept


def test_plain_template_gets_the_generic_prompt(tokenizers):
    tok = tokenizers["plain"]
    fmt = tool_format_for(tok)
    prompt = fmt.render(tok, FOLLOW_UP, parse_tools(TOOLS, "required"))
    # Merged into the conversation's system message, after its own text.
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert prompt.count("<|im_start|>system") == 1
    for tool in TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in prompt
    assert "within <tool_call></tool_call> tags" in prompt and "Answer with a function call." in prompt
    calls = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    )
    assert f"<|im_start|>assistant\n{calls}<|im_end|>" in prompt
    assert "<|im_start|>tool\n3<|im_end|>\n<|im_start|>tool\npong<|im_end|>" in prompt  # ChatML writes any role
    # Without a system message, the section is one (the template's default one is then not added).
    alone = fmt.render(tok, [{"role": "user", "content": "hi"}], parse_tools(TOOLS))
    assert alone.startswith("<|im_start|>system\n# Tools") and "helpful AI assistant" not in alone
    assert "If no function fits, answer in plain text instead." in alone
    assert "# Tools" not in fmt.render(tok, [{"role": "user", "content": "hi"}], parse_tools(TOOLS, "none"))


def test_generic_prompt_on_a_template_that_knows_only_user_and_assistant(tokenizers):
    import copy

    tok = copy.deepcopy(tokenizers["plain"])
    tok.chat_template = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
        "[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    prompt = tool_format_for(tok).render(tok, FOLLOW_UP[1:], parse_tools(TOOLS))
    # No system role: the section leads the first user turn; the results are one user turn.
    assert prompt.startswith("[user] # Tools\n")
    assert "\n\nAdd 1 and 2, and ping.\n" in prompt
    assert "[user] <tool_response>\n3\n</tool_response>\n<tool_response>\npong\n</tool_response>\n" in prompt


def test_llama3_template_renders_json_calls(tokenizers):
    tok = tokenizers["llama3"]
    prompt = tool_format_for(tok).render(tok, FOLLOW_UP[:3] + FOLLOW_UP[3:4], parse_tools(TOOLS))
    assert '{"name": "add", "parameters": {"a": 1, "b": 2}}' in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n3<|eot_id|>" in prompt


def test_messages_are_checked_naming_the_field(tokenizers):
    tok = tokenizers["plain"]
    fmt = tool_format_for(tok)
    bad_args = [FOLLOW_UP[1], {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{"}}]}]
    with pytest.raises(ValueError, match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"):
        fmt.render(tok, bad_args, None)
    with pytest.raises(ValueError, match=r"^messages\[1\]\.tool_call_id must be"):
        fmt.render(tok, [FOLLOW_UP[1], {"role": "tool", "content": "3"}], None)
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[0\] must be a text part"):
        fmt.render(tok, [{"role": "user", "content": [{"type": "image_url"}]}], None)


@pytest.fixture(scope="module")
def engines(model_dirs):
    return {name: LLM(model=d, device="cpu", dtype="float32", max_model_len=1024) for name, d in model_dirs.items()}


CHOICES = {
    "required": ("required", None),
    "required-single": ("required", False),
    "named": ({"type": "function", "function": {"name": "book_table"}}, None),
    "auto": ("auto", None),
    "none": ("none", None),
}


@pytest.mark.parametrize("model", ["hermes", "plain", "llama3"])
@pytest.mark.parametrize("choice", list(CHOICES))
def test_random_model_output_parses_under_each_tool_choice(engines, model, choice):
    tool_choice, parallel = CHOICES[choice]
    llm = engines[model]
    msgs = [{"role": "user", "content": "Book a table, then tell me the weather."}]
    # Free text from random weights rarely ends: auto and none stop at 48 tokens.
    max_tokens = 48 if choice in ("auto", "none") else 300
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed) for seed in range(4)]
    outs = llm.chat(
        [msgs] * 4, params, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel, use_tqdm=False
    )
    single = model == "llama3" or choice in ("required-single", "named")
    for seed, out in enumerate(outs):
        assert isinstance(out, ChatResult)
        where = f"seed {seed}: {out.text[:200]!r}"
        if choice == "none":
            assert out.tool_calls == [] and out.content == (out.text or None), where
            continue
        assert answer_errors(out.message, NAMES, tag="<tool_call>" if model != "llama3" else "") == [], where
        if choice == "auto":
            assert out.finish_reason in ("stop", "length", "tool_calls"), where
            continue
        assert out.finish_reason == "tool_calls" and out.content is None and out.tool_calls, where
        assert all(call_errors(c, NAMES) == [] for c in out.tool_calls), where
        if single:
            assert len(out.tool_calls) == 1, where
        if choice == "named":
            assert out.tool_calls[0].name == "book_table", where


def test_chat_without_tools_is_unchanged_and_tools_refuse_a_second_grammar(engines):
    from runtime.llm.outputs import RequestOutput

    llm = engines["hermes"]
    msgs = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=6, temperature=0)
    (plain,) = llm.chat(msgs, params)
    assert type(plain) is RequestOutput
    assert plain.prompt == llm.apply_chat_template(msgs) and "# Tools" not in plain.prompt
    (ours,) = llm.chat(msgs, params, tools=TOOLS, tool_choice="none")
    assert isinstance(ours, ChatResult) and ours.text == plain.text and ours.tool_calls == []
    assert ours.finish_reason == plain.finish_reason and ours.metrics is ours.output.metrics
    json_params = SamplingParams(max_tokens=6, structured_outputs={"json_object": True})
    with pytest.raises(ValueError, match="^structured_outputs cannot be combined with tools"):
        llm.chat(msgs, json_params, tools=TOOLS, tool_choice="required")
    with pytest.raises(ValueError, match=r"^tool_choice\.function\.name 'nope' is not one of the tools"):
        llm.chat(msgs, params, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
