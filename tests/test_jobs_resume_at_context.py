"""A resumed generation that its previous attempt had already finished by filling the context
(max_tokens None, the chat default) ends done/length without reaching the engine, which would
refuse a prompt of max_model_len tokens. workers/jobs.py's generate_body over a fake host and
Runtime: no Redis, no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from workers.host import ActiveJob
from workers.jobs import generate_body

MAX_MODEL_LEN = 8
PROMPT = [5, 6, 7]


class _Reached(Exception):
    """The fake engine was asked to generate."""


def _submit(prompt, params, **kw):
    if len(prompt) >= MAX_MODEL_LEN:  # as runtime/llm/engine.py refuses it
        raise ValueError(f"prompt has {len(prompt)} tokens, but max_model_len is {MAX_MODEL_LEN}")
    raise _Reached(prompt, params.max_tokens, kw.get("num_resumed_outputs"))


def _resumed(num_done: int, max_tokens: int | None):
    outputs = list(range(10, 10 + num_done))  # no EOS among them
    rt = SimpleNamespace(
        llm=SimpleNamespace(eos_token_ids={0}), tokenizer=None, max_model_len=MAX_MODEL_LEN, submit_generate=_submit
    )
    store = SimpleNamespace(
        record=lambda job_id: {"started_at": "1.0"}, prefix=lambda job_id: (outputs, "x" * num_done, None)
    )
    host = SimpleNamespace(runtime=rt, model_name="smol", worker_id="w2", store=store)
    claim = SimpleNamespace(attempt=2, num_tokens=num_done, submitted_at=0.5, prompt_token_ids=PROMPT)
    job = ActiveJob("job-1", "tok", claim)
    job.queue = "llm"
    kwargs = {"prompt": PROMPT, "max_tokens": max_tokens}
    return host, job, kwargs, outputs


def test_a_resumed_job_that_filled_the_context_is_done_with_length():
    host, job, kwargs, outputs = _resumed(MAX_MODEL_LEN - len(PROMPT), None)
    result, trailing = generate_body(host, job, kwargs)
    assert result["finish_reason"] == "length" and result["token_ids"] == outputs, result
    assert result["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert result["stop_reason"] is None and trailing == ""


@pytest.mark.parametrize("max_tokens", [None, 6])
def test_a_resumed_job_with_room_left_goes_on_in_the_engine(max_tokens):
    host, job, kwargs, outputs = _resumed(MAX_MODEL_LEN - len(PROMPT) - 1, max_tokens)
    with pytest.raises(_Reached) as info:
        generate_body(host, job, kwargs)
    prompt, asked, resumed = info.value.args
    # The job's own max_tokens, and the engine told how many of the prompt's tokens are outputs.
    assert prompt == PROMPT + outputs and asked == max_tokens and resumed == len(outputs)
