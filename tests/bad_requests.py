"""Hand-written bad requests for `tandem serve`, each with the status it must get and the field
its error must name (tests/test_bad_requests.py sends them to a real server over a real worker).

A case is (id, method, path, body, status, param): `body` is a Python value sent as JSON
(NaN, Infinity and lone surrogates included, as a careless client's json.dumps writes them), or
bytes sent as they are. `param` None: the error names no field (or any field; see the case).
Paths with {job} use a job the test submits first. Status 200/202 cases are inputs that look odd
but are fine, and must stay fine.
"""

from __future__ import annotations

NAN, INF = float("nan"), float("inf")
C = "/v1/completions"
CH = "/v1/chat/completions"
J = "/v1/jobs"
D = "/v1/detect"
HI = [{"role": "user", "content": "Hi"}]


def comp(**change) -> dict:
    return {"prompt": "Hi", "max_tokens": 2, **change}


def chat(**change) -> dict:
    return {"messages": HI, "max_tokens": 2, **change}


def job(**change) -> dict:
    return {"prompt": "Hi", "max_tokens": 2, **change}


CASES: list[tuple[str, str, str, object, int, str | None]] = [
    # ---- completions: sampling fields -----------------------------------------------------------
    ("max_tokens-negative", "POST", C, comp(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens-string", "POST", C, comp(max_tokens="10"), 400, "max_tokens"),
    ("max_tokens-huge", "POST", C, comp(max_tokens=10**30), 400, "max_tokens"),
    ("max_tokens-past-context", "POST", C, comp(max_tokens=100_000), 400, "max_tokens"),
    ("max_tokens-float", "POST", C, comp(max_tokens=1.5), 400, "max_tokens"),
    ("max_tokens-bool", "POST", C, comp(max_tokens=True), 400, "max_tokens"),
    ("temperature-nan", "POST", C, comp(temperature=NAN), 400, "temperature"),
    ("temperature-infinity", "POST", C, comp(temperature=INF), 400, "temperature"),
    ("temperature-negative", "POST", C, comp(temperature=-1), 400, "temperature"),
    ("temperature-string", "POST", C, comp(temperature="hot"), 400, "temperature"),
    ("top_p-zero", "POST", C, comp(top_p=0), 400, "top_p"),
    ("top_p-nan", "POST", C, comp(top_p=NAN), 400, "top_p"),
    ("top_k-float", "POST", C, comp(top_k=1.5), 400, "top_k"),
    ("top_k-negative", "POST", C, comp(top_k=-5), 400, "top_k"),
    ("top_k-huge", "POST", C, comp(top_k=10**30), 400, "top_k"),
    ("min_p-above-one", "POST", C, comp(min_p=2), 400, "min_p"),
    ("min_tokens-above-max", "POST", C, comp(min_tokens=99), 400, "min_tokens"),
    ("seed-string", "POST", C, comp(seed="x"), 400, "seed"),
    ("seed-past-64-bits", "POST", C, comp(seed=2**64), 400, "seed"),
    ("stop-number", "POST", C, comp(stop=5), 400, "stop"),
    ("stop-10000-strings", "POST", C, comp(stop=[f"s{i}" for i in range(10_000)]), 400, "stop"),
    ("stop-empty-string", "POST", C, comp(stop=[""]), 400, "stop"),
    ("stop-too-long", "POST", C, comp(stop=["x" * 1000]), 400, "stop"),
    ("stop_token_ids-negative", "POST", C, comp(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stop_token_ids-huge", "POST", C, comp(stop_token_ids=[2**70]), 400, "stop_token_ids"),
    ("stop_token_ids-out-of-vocab", "POST", C, comp(stop_token_ids=[1_000_000]), 400, "stop_token_ids"),
    ("repetition_penalty-zero", "POST", C, comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("presence_penalty-big", "POST", C, comp(presence_penalty=5), 400, "presence_penalty"),
    ("frequency_penalty-infinity", "POST", C, comp(frequency_penalty=INF), 400, "frequency_penalty"),
    ("priority-string", "POST", C, comp(priority="high"), 400, "priority"),
    ("priority-huge", "POST", C, comp(priority=10**30), 400, "priority"),
    # ---- completions: OpenAI fields -------------------------------------------------------------
    ("n-zero", "POST", C, comp(n=0), 400, "n"),
    ("n-hundred", "POST", C, comp(n=100), 400, "n"),
    ("best_of-below-n", "POST", C, comp(n=3, best_of=2), 400, "best_of"),
    ("best_of-streamed", "POST", C, comp(n=1, best_of=2, stream=True), 400, "best_of"),
    ("logprobs-fifty", "POST", C, comp(logprobs=50), 400, "logprobs"),
    ("logprobs-bool", "POST", C, comp(logprobs=True), 400, "logprobs"),
    ("echo-string", "POST", C, comp(echo="yes"), 400, "echo"),
    ("prompt_logprobs-streamed", "POST", C, comp(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    ("max_tokens-zero-no-echo", "POST", C, comp(max_tokens=0), 400, "max_tokens"),
    ("echo-token-ids", "POST", C, comp(prompt=[1, 2, 3], echo=True), 400, "echo"),
    ("suffix", "POST", C, comp(suffix="tail"), 400, "suffix"),
    ("logit_bias", "POST", C, comp(logit_bias={"5": 10}), 400, "logit_bias"),
    ("use_beam_search", "POST", C, comp(use_beam_search=True), 400, "use_beam_search"),
    ("response_format-xml", "POST", C, comp(response_format={"type": "xml"}), 400, "response_format"),
    (
        "response_format-and-guided",
        "POST",
        C,
        comp(response_format={"type": "json_object"}, guided_regex="a"),
        400,
        "guided_regex",
    ),
    ("guided_choice-empty", "POST", C, comp(guided_choice=[]), 400, "guided_choice"),
    ("stream-string", "POST", C, comp(stream="yes"), 400, "stream"),
    ("stream_options-without-stream", "POST", C, comp(stream_options={"include_usage": True}), 400, "stream_options"),
    ("stream_options-unknown", "POST", C, comp(stream=True, stream_options={"x": 1}), 400, "stream_options.x"),
    ("request_timeout-zero", "POST", C, comp(request_timeout=0), 400, "request_timeout"),
    ("request_timeout-nan", "POST", C, comp(request_timeout=NAN), 400, "request_timeout"),
    ("deadline_s-not-openai", "POST", C, comp(deadline_s=5), 400, "deadline_s"),
    ("unknown-field", "POST", C, comp(frobnicate=1), 400, "frobnicate"),
    ("unknown-field-long-name", "POST", C, comp(**{"x" * 5000: 1}), 400, None),
    ("model-empty", "POST", C, comp(model=""), 400, "model"),
    ("model-unknown-with-nul", "POST", C, comp(model="nope\x00" + "y" * 1000), 404, "model"),
    # ---- completions: prompts -------------------------------------------------------------------
    ("prompt-missing", "POST", C, {"max_tokens": 2}, 400, "prompt"),
    ("prompt-empty", "POST", C, comp(prompt=""), 400, "prompt"),
    ("prompt-number", "POST", C, comp(prompt=5), 400, "prompt"),
    ("prompt-negative-id", "POST", C, comp(prompt=[-1]), 400, "prompt"),
    ("prompt-id-past-64-bits", "POST", C, comp(prompt=[2**64]), 400, "prompt"),
    ("prompt-id-out-of-vocab", "POST", C, comp(prompt=[10**9]), 400, "prompt"),
    ("prompt-batch", "POST", C, comp(prompt=["a", "b"]), 400, "prompt"),
    ("prompt-lone-surrogate", "POST", C, comp(prompt="a\ud800b"), 400, "prompt"),
    ("prompt-100k-chars", "POST", C, comp(prompt="a " * 50_000), 400, "prompt"),
    ("prompt-too-many-ids", "POST", C, comp(prompt=[1] * 5000), 400, "prompt"),
    ("prompt-nul-bytes-are-text", "POST", C, comp(prompt="a\x00b\x00"), 200, None),
    ("prompt-emoji-and-rtl-are-text", "POST", C, comp(prompt="héllo 🙂 \u202e"), 200, None),
    # ---- bodies ---------------------------------------------------------------------------------
    ("body-array", "POST", C, [], 400, "body"),
    ("body-string", "POST", C, "hi", 400, "body"),
    ("body-not-json", "POST", C, b"prompt=hi", 400, "body"),
    ("body-empty", "POST", C, b"", 400, "body"),
    ("body-invalid-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', 400, "body"),
    ("body-100k-nested-brackets", "POST", C, b"[" * 100_000, 400, "body"),
    ("body-lone-surrogate-key", "POST", C, b'{"prompt": "hi", "\\udc00": 1}', 400, None),
    ("body-trailing-garbage", "POST", C, b'{"prompt": "hi"} x', 400, "body"),
    ("body-too-large", "POST", C, comp(prompt="z" * (2 << 20)), 413, None),
    # ---- chat -----------------------------------------------------------------------------------
    ("messages-empty", "POST", CH, chat(messages=[]), 400, "messages"),
    ("messages-string", "POST", CH, chat(messages="hi"), 400, "messages"),
    ("role-bogus", "POST", CH, chat(messages=[{"role": "bogus", "content": "hi"}]), 400, "messages[0].role"),
    ("role-missing", "POST", CH, chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("content-number", "POST", CH, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (
        "content-image-part",
        "POST",
        CH,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages[0].content[0]",
    ),
    (
        "content-lone-surrogate",
        "POST",
        CH,
        chat(messages=[{"role": "user", "content": "\udfff"}]),
        400,
        "messages[0].content",
    ),
    (
        "message-extra-key",
        "POST",
        CH,
        chat(messages=[{"role": "user", "content": "hi", "images": []}]),
        400,
        "messages[0].images",
    ),
    (
        "tools-name",
        "POST",
        CH,
        chat(tools=[{"type": "function", "function": {"name": "f g"}}]),
        400,
        "tools[0].function.name",
    ),
    ("tools-object", "POST", CH, chat(tools={"type": "function"}), 400, "tools"),
    ("tool_choice-required-without-tools", "POST", CH, chat(tool_choice="required"), 400, "tool_choice"),
    (
        "tool-message-without-call",
        "POST",
        CH,
        chat(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c", "content": "1"}]),
        400,
        "messages[1].tool_call_id",
    ),
    ("top_logprobs-without-logprobs", "POST", CH, chat(top_logprobs=5), 400, "top_logprobs"),
    ("top_logprobs-thirty", "POST", CH, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    ("chat-logprobs-int", "POST", CH, chat(logprobs=3), 400, "logprobs"),
    ("max_completion_tokens-zero", "POST", CH, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("chat_template", "POST", CH, chat(chat_template="{{ x }}"), 400, "chat_template"),
    ("add_generation_prompt-false", "POST", CH, chat(add_generation_prompt=False), 400, "add_generation_prompt"),
    ("chat-temperature-infinity", "POST", CH, chat(temperature=INF), 400, "temperature"),
    ("chat-messages-too-big", "POST", CH, chat(messages=[{"role": "user", "content": "q" * 300_000}]), 400, "messages"),
    # ---- the job API: the same checks -----------------------------------------------------------
    ("job-role-bogus", "POST", J, {"messages": [{"role": "bogus", "content": "hi"}]}, 400, "messages[0].role"),
    ("job-temperature-infinity", "POST", J, job(temperature=INF), 400, "temperature"),
    ("job-deadline_s-infinity", "POST", J, job(deadline_s=INF), 400, "deadline_s"),
    ("job-deadline_s-negative", "POST", J, job(deadline_s=-1), 400, "deadline_s"),
    ("job-max_tokens-huge", "POST", J, job(max_tokens=10**30), 400, "max_tokens"),
    ("job-max_tokens-past-context", "POST", J, job(max_tokens=100_000), 400, "max_tokens"),
    ("job-prompt-lone-surrogate", "POST", J, job(prompt="\ud83d"), 400, "prompt"),
    ("job-task-unknown", "POST", J, job(task="paint"), 400, "task"),
    ("job-id-with-space", "POST", J, job(job_id="no spaces"), 400, "job_id"),
    ("job-id-too-long", "POST", J, job(job_id="k" * 300), 400, "job_id"),
    ("job-id-number", "POST", J, job(job_id=5), 400, "job_id"),
    ("job-unknown-field", "POST", J, job(max_tokenz=3), 400, "max_tokenz"),
    ("job-prompt-and-messages", "POST", J, job(messages=HI), 400, "prompt"),
    ("job-detect-url-crlf", "POST", J, {"task": "detect", "url": "http://x/a.jpg\r\nHost: evil"}, 400, "url"),
    ("job-body-array", "POST", J, [1], 400, "body"),
    ("job-status-bad-id", "GET", "/v1/jobs/bad%20id", None, 400, "job_id"),
    ("job-status-missing", "GET", "/v1/jobs/no-such-job", None, 404, "job_id"),
    ("job-events-after-garbage", "GET", "/v1/jobs/{job}/events?after=garbage", None, 400, "after"),
    ("job-events-after-past-u64", "GET", "/v1/jobs/{job}/events?after=99999999999999999999-0", None, 400, "after"),
    ("job-events-after-seq-past-u64", "GET", "/v1/jobs/{job}/events?after=1-99999999999999999999", None, 400, "after"),
    ("job-events-after-negative", "GET", "/v1/jobs/{job}/events?after=-1", None, 400, "after"),
    ("job-delete-bad-id", "DELETE", "/v1/jobs/%00", None, 400, "job_id"),
    # ---- detect -----------------------------------------------------------------------------------
    ("detect-url-crlf", "POST", D, {"url": "http://127.0.0.1/a.jpg\r\nX-Injected: 1"}, 400, "url"),
    ("detect-path-nul", "POST", D, {"path": "/tmp/a\x00.jpg"}, 400, "path"),
    ("detect-conf", "POST", D, {"url": "http://127.0.0.1/a.jpg", "conf": 0.5}, 400, "conf"),
    ("detect-url-and-path", "POST", D, {"url": "http://x/a.jpg", "path": "/a.jpg"}, 400, "body"),
    ("detect-image-not-base64", "POST", D, {"image": "%%%"}, 400, "image"),
    ("detect-url-number", "POST", D, {"url": 5}, 400, "url"),
]
