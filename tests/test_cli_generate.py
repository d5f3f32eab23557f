"""`tandem generate`: the API's knobs as flags, errors that name the flag to change, a prompt
from standard input, a bad --device caught before the model loads, --version and help texts
that show defaults. Runs on the tiny random Llama (tests/conftest.py)."""

from __future__ import annotations

import io

import pytest

from runtime.llm import api
from tandem.cli import build_parser, main


@pytest.fixture()
def spy(monkeypatch):
    """Records the LLM's constructor arguments and every SamplingParams it streams with."""
    seen = {"init": None, "params": []}
    real_init, real_stream = api.LLM.__init__, api.LLM.stream

    def init(self, *args, **kwargs):
        seen["init"] = kwargs
        real_init(self, *args, **kwargs)

    def stream(self, prompt, params=None):
        seen["params"].append((prompt, params))
        return real_stream(self, prompt, params)

    monkeypatch.setattr(api.LLM, "__init__", init)
    monkeypatch.setattr(api.LLM, "stream", stream)
    return seen


def _generate(capsys, tiny_llama_dir, *argv):
    code = main(["generate", "--model", tiny_llama_dir, "--no-chat-template", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_sampling_and_engine_flags_reach_the_api(capsys, spy, tiny_llama_dir):
    code, out, err = _generate(
        capsys,
        tiny_llama_dir,
        "Once upon a time",
        "--max-tokens",
        "6",
        "--min-tokens",
        "3",
        "--stop",
        "\n\n",
        "--stop",
        "END",
        "--ignore-eos",
        "--repetition-penalty",
        "1.2",
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "-0.5",
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "3",
        "--max-num-batched-tokens",
        "64",
    )
    assert code == 0, err
    init = spy["init"]
    assert (init["max_model_len"], init["max_num_seqs"], init["max_num_batched_tokens"]) == (128, 3, 64)
    ((_, p),) = spy["params"]
    assert (p.max_tokens, p.min_tokens, p.stop, p.ignore_eos) == (6, 3, ["\n\n", "END"], True)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.2, 0.5, -0.5)
    assert "finish_reason=" in err


def test_prompt_from_standard_input(capsys, monkeypatch, spy, tiny_llama_dir):
    monkeypatch.setattr("sys.stdin", io.StringIO("a prompt\nover two lines\n"))
    code, _, err = _generate(capsys, tiny_llama_dir, "-", "--max-tokens", "2")
    assert code == 0, err
    assert spy["params"][0][0] == "a prompt\nover two lines\n"


def test_a_prompt_over_max_model_len_says_which_flag_lifts_it(capsys, tiny_llama_dir):
    code, out, err = _generate(capsys, tiny_llama_dir, "word " * 40, "--max-model-len", "16")
    assert code == 2 and out == ""
    (line,) = err.replace("loading model ...\n", "").strip().splitlines()
    assert "--max-model-len is 16" in line
    assert "raise the limit with --max-model-len (this model takes up to 1024)" in line


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_max_tokens_past_the_context_is_a_usage_error_naming_the_flag(capsys, monkeypatch, tiny_llama_dir, command):
    # The engine refuses what it used to cut silently (the answer ended "length" early); the
    # CLI says which flag to lower, and chat takes the next line instead of exiting.
    argv = ["--model", tiny_llama_dir, "--max-model-len", "128", "--max-tokens", "500"]
    if command == "generate":
        code = main(["generate", *argv, "--no-chat-template", "hi there"])
    else:
        monkeypatch.setattr("sys.stdin", io.StringIO("hi there\n"))
        code = main(["chat", *argv])
    out, err = capsys.readouterr()
    assert code == (2 if command == "generate" else 0), err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert "--max-tokens must be at most" in line and "got 500" in line and "max_tokens" not in line, line
    assert "lower --max-tokens" in line and "--max-model-len (this model takes up to 1024)" in line, line
    assert "finish_reason" not in err  # nothing was generated


def test_max_model_len_beyond_the_model_names_the_flag(capsys, tiny_llama_dir):
    code, _, err = _generate(capsys, tiny_llama_dir, "hi", "--max-model-len", "5000")
    assert code == 2 and "--max-model-len must be <= the model's 1024" in err


def test_bad_sampling_flag_names_the_flag_before_loading(capsys, monkeypatch):
    monkeypatch.setattr(api, "LLM", lambda **kw: pytest.fail("must not load the model"))
    assert main(["generate", "hi", "--repetition-penalty", "0"]) == 2
    assert "--repetition-penalty must be a number > 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "device, message",
    [
        ("gpu", "--device must be cpu, cuda, cuda:N or mps, got 'gpu'"),
        ("cuda:99", "--device cuda:99"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_device_is_one_line_before_anything_loads(capsys, monkeypatch, command, device, message):
    monkeypatch.setattr(api, "LLM", lambda **kw: pytest.fail("must not load the model"))
    argv = [command, "hi"] if command == "generate" else [command]
    assert main([*argv, "--device", device]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err and "this machine has: cpu" in err


def test_missing_model_path_names_the_flag_and_not_none(capsys, tmp_path):
    code, _, err = _generate(capsys, str(tmp_path / "nope"), "hi")
    assert code == 2 and "--model" in err and "None" not in err


def test_version_and_help_with_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("tandem ")
    sub = build_parser()._subparsers._group_actions[0].choices
    for name, flag in (("generate", "--max-tokens"), ("chat", "--temperature"), ("detect", "--conf")):
        text = " ".join(sub[name].format_help().split())
        assert "(default: " in text, name
        action = next(a for a in sub[name]._actions if flag in a.option_strings)
        assert f"(default: {action.default})" in text, (name, flag)


def test_chat_takes_a_string_as_one_user_message(tiny_llama_dir):
    llm = api.LLM(model=tiny_llama_dir, max_model_len=128)
    params = api.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    (as_string,) = llm.chat("hi", params)
    (as_list,) = llm.chat([{"role": "user", "content": "hi"}], params)
    assert as_string.prompt_token_ids == as_list.prompt_token_ids and as_string.token_ids == as_list.token_ids
    with pytest.raises(ValueError, match="messages must be a string .* got list of strings"):
        llm.chat(["hi", "there"], params)


def test_a_stopped_answer_aborts_its_request(capsys, tiny_llama_dir):
    # What chat's Ctrl-C does: the flag stops the stream between tokens and the request goes.
    import threading

    from runtime.llm import cli

    llm = api.LLM(model=tiny_llama_dir, max_model_len=128)
    stop = threading.Event()
    stop.set()
    params = api.SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    text, finished = cli._stream(llm, "Once upon a time", params, stop)
    assert not finished and "[stopped]" in capsys.readouterr().err
    assert not llm.engine.has_unfinished()
    (after,) = llm.generate(["Once upon a time"], params)  # the engine serves on
    assert len(after.token_ids) == 50
