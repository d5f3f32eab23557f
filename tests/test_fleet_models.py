"""Several models in one fleet: a real `tandem serve` over two real `tandem worker` processes on one
Redis, one serving SmolLM2 as "smollm2", the other the tiny random Llama as "tiny" (beside the
shipped detector): the session's ModelsFleet (tests/fleet_support.py), which test_serve's SmolLM2
tests share. Each request is routed by the model it names, to that model's queue: its answer is
what that model alone gives (greedy token ids compared with an in-process engine of it),
/v1/models lists both, /health says who serves what, /metrics labels every series with the model
it measures."""

from __future__ import annotations

import httpx
import openai
import pytest
from fleet_support import MODELS_SMOL, MODELS_SMOL_WORKER, MODELS_TINY, MODELS_TINY_WORKER, ModelsFleet
from test_jobs_support import wait_for
from test_serve import metric, scrape

from workers.settings import model_queue
from workers.store import job_key

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8
WORKERS = {MODELS_SMOL: MODELS_SMOL_WORKER, MODELS_TINY: MODELS_TINY_WORKER}


@pytest.fixture(scope="module")
def fleet(models_fleet) -> ModelsFleet:
    return models_fleet.start()


def _client(fleet: ModelsFleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _reference(model_dir: str) -> list[list[int]]:
    """Greedy token ids of the prompts from an in-process engine of that model alone."""
    from runtime import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", max_model_len=512, max_num_seqs=2)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _jobs_on(fleet: ModelsFleet, queue: str, before: set[str]) -> list[tuple[str, dict]]:
    """(job id, record) of the jobs submitted to `queue` since `before` (the job ids then: the
    fleet is the session's), in submission order."""
    r = fleet.redis_client()
    jobs = [(k[len(job_key("")) :], r.hgetall(k)) for k in r.scan_iter(match=job_key("*"), count=1000)]
    mine = ((j, rec) for j, rec in jobs if rec.get("queue") == queue and j not in before)
    return sorted(mine, key=lambda jr: int(jr[1]["seq"]))


def test_each_request_runs_on_the_model_it_names(fleet, smollm2_dir, tiny_llama_dir):
    import json

    reference = {MODELS_SMOL: _reference(smollm2_dir), MODELS_TINY: _reference(tiny_llama_dir)}  # while they load
    fleet.ready()
    url = fleet.server.url
    assert sorted(m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]) == [
        MODELS_SMOL,
        MODELS_TINY,
    ]
    before = fleet.job_ids()
    client = _client(fleet)
    texts = {}
    for name in (MODELS_TINY, MODELS_SMOL, MODELS_TINY, MODELS_SMOL):  # interleaved: each to its model's queue
        for prompt in PROMPTS:
            out = client.completions.create(
                model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            assert out.model == name and out.usage.completion_tokens == MAX_TOKENS
            texts.setdefault(name, []).append(out.choices[0].text)
    r = fleet.redis_client()
    for name, worker in WORKERS.items():
        jobs = _jobs_on(fleet, model_queue(name), before)
        assert len(jobs) == 2 * len(PROMPTS), f"{name}: its jobs went to its queue"
        for k, (job_id, rec) in enumerate(jobs):
            assert rec["state"] == "done"
            res = json.loads(r.xrange(f"tandem:end:{job_id}")[0][1]["result"])
            assert res["worker"].startswith(worker), f"{name} ran on {res['worker']}"
            assert res["token_ids"] == reference[name][k % len(PROMPTS)], f"{name}: tokens differ from the model alone"
    assert texts[MODELS_SMOL][:2] != texts[MODELS_TINY][:2]  # two different models, told apart

    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="nobody-serves-this", prompt="Hi", max_tokens=2)
    assert exc.value.body["param"] == "model"
    unnamed = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"  # several: name one


def test_health_says_which_models_live_workers_serve(fleet):
    fleet.ready()
    url = fleet.server.url
    body = wait_for(
        lambda: (lambda b: b if b.get("models") == {MODELS_SMOL: 1, MODELS_TINY: 1} else None)(
            httpx.get(url + "/health", timeout=5).json()
        ),
        30,
        "both models in /health",
    )
    assert body["status"] == "ok" and body["workers"] == 2 and body["vision"] == 1
    assert httpx.get(url + "/health", params={"model": MODELS_SMOL}, timeout=5).status_code == 200
    missing = httpx.get(url + "/health", params={"model": "nobody"}, timeout=5)
    assert missing.status_code == 503 and "nobody" in missing.json()["error"]


def test_metrics_label_each_series_with_the_model_it_measures(fleet):
    fleet.ready()
    before = metric(scrape(fleet.server.url), "tandem:generation_tokens_total", model_name=MODELS_SMOL)
    _client(fleet).completions.create(
        model=MODELS_SMOL, prompt="Count", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )

    def counted():
        f = scrape(fleet.server.url)
        return metric(f, "tandem:generation_tokens_total", model_name=MODELS_SMOL) >= before + 3 and f

    fams = wait_for(counted, 30, "smollm2's tokens in /metrics", interval=0.2)
    for fam in fams.values():
        for s in fam.samples:
            if "model_name" not in s.labels:
                continue
            vision = fam.name.startswith("tandem:vision_")
            instance = s.labels["tandem_instance"]
            if vision:  # only the worker with the detector has vision series, under its name
                assert instance.startswith(MODELS_TINY_WORKER) and s.labels["model_name"] == "shapes_yolo26n", s
            else:
                expected = MODELS_SMOL if instance.startswith(MODELS_SMOL_WORKER) else MODELS_TINY
                assert s.labels["model_name"] == expected, s
