"""Several models in one fleet: a real `tandem serve` over two real `tandem worker` processes on one
Redis, one serving SmolLM2 as "smol", the other the tiny random Llama as "tiny" (beside the
shipped detector). Each request is routed by the model it names, to that model's queue: its
answer is what that model alone gives (greedy token ids compared with an in-process engine of
it), /v1/models lists both, /health says who serves what, /metrics labels every series with
the model it measures."""

from __future__ import annotations

import httpx
import openai
import pytest
import redis
from fleet_support import ServeProcess
from test_jobs_support import RedisServer, WorkerProcess, wait_for
from test_serve import metric, scrape

from workers.app import make_app
from workers.settings import JobSettings, model_queue
from workers.store import job_key

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 8
WORKER_ENV = {"TANDEM_HEARTBEAT_S": "0.5"}


def _llm_args(name: str, path: str) -> list[str]:
    return [
        "--dtype",
        "float32",
        "--model",
        f"{name}={path}",
        "--max-num-seqs",
        "2",
        "--concurrency",
        "2",
        "--max-model-len",
        "512",
        "--kv-cache-bytes",
        str(32 << 20),
    ]


class Fleet:
    def __init__(self, tmp, smol_dir: str, tiny_dir: str) -> None:
        self.redis = RedisServer(tmp).start()
        self.r = redis.Redis.from_url(self.redis.url, decode_responses=True)
        self.celery = make_app(JobSettings(redis_url=self.redis.url))
        self.smol = WorkerProcess(
            "smol@fleet", self.redis.url, tmp, ["--queues", "llm", *_llm_args("smol", smol_dir)], WORKER_ENV
        )
        self.tiny = WorkerProcess(
            "tiny@fleet",
            self.redis.url,
            tmp,
            ["--queues", "llm,vision", "--imgsz", "160", "--vision-max-batch-size", "1", *_llm_args("tiny", tiny_dir)],
            WORKER_ENV,
        )
        self.server = ServeProcess("serve-fleet", tmp, ["--redis-url", self.redis.url])

    def ready(self) -> Fleet:
        for w in (self.smol, self.tiny):
            w.wait_ready(self.celery, timeout=240)
        self.server.wait_ready()
        return self

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        self.server.stop()
        for w in (self.smol, self.tiny):
            w.stop()
        self.r.close()
        self.redis.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, smollm2_dir, tiny_llama_dir):
    f = Fleet(tmp_path_factory.mktemp("fleet"), smollm2_dir, tiny_llama_dir)
    try:
        yield f
    finally:
        f.stop()


def _reference(model_dir: str) -> list[list[int]]:
    """Greedy token ids of the prompts from an in-process engine of that model alone."""
    from runtime import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", max_model_len=512, max_num_seqs=2)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _jobs_on(r: redis.Redis, queue: str) -> list[tuple[str, dict]]:
    """(job id, record) of the jobs submitted to `queue`, in submission order."""
    jobs = [(k[len(job_key("")) :], r.hgetall(k)) for k in r.scan_iter(match=job_key("*"), count=1000)]
    return sorted(((j, rec) for j, rec in jobs if rec.get("queue") == queue), key=lambda jr: int(jr[1]["seq"]))


def test_each_request_runs_on_the_model_it_names(fleet, smollm2_dir, tiny_llama_dir):
    import json

    reference = {"smol": _reference(smollm2_dir), "tiny": _reference(tiny_llama_dir)}  # while the workers load
    fleet.ready()
    url = fleet.server.url
    ids = wait_for(
        lambda: (lambda ms: ms if ms == ["smol", "tiny"] else None)(
            sorted(m["id"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"])
        ),
        30,
        "both models in /v1/models",
    )
    assert ids == ["smol", "tiny"]
    client = fleet.client()
    texts = {}
    for name in ("tiny", "smol", "tiny", "smol"):  # interleaved: each goes to its own model's queue
        for prompt in PROMPTS:
            out = client.completions.create(
                model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            assert out.model == name and out.usage.completion_tokens == MAX_TOKENS
            texts.setdefault(name, []).append(out.choices[0].text)
    for name, worker in (("smol", "smol@fleet"), ("tiny", "tiny@fleet")):
        jobs = _jobs_on(fleet.r, model_queue(name))
        assert len(jobs) == 2 * len(PROMPTS), f"{name}: its jobs went to its queue"
        for k, (job_id, rec) in enumerate(jobs):
            assert rec["state"] == "done"
            res = json.loads(fleet.r.xrange(f"tandem:end:{job_id}")[0][1]["result"])
            assert res["worker"].startswith(worker), f"{name} ran on {res['worker']}"
            assert res["token_ids"] == reference[name][k % len(PROMPTS)], f"{name}: tokens differ from the model alone"
    assert texts["smol"][:2] != texts["tiny"][:2]  # two different models, told apart

    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="nobody-serves-this", prompt="Hi", max_tokens=2)
    assert exc.value.body["param"] == "model"
    unnamed = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"  # several: name one


def test_health_says_which_models_live_workers_serve(fleet):
    fleet.ready()
    url = fleet.server.url
    body = wait_for(
        lambda: (lambda b: b if b.get("models") == {"smol": 1, "tiny": 1} else None)(
            httpx.get(url + "/health", timeout=5).json()
        ),
        30,
        "both models in /health",
    )
    assert body["status"] == "ok" and body["workers"] == 2 and body["vision"] == 1
    assert httpx.get(url + "/health", params={"model": "smol"}, timeout=5).status_code == 200
    missing = httpx.get(url + "/health", params={"model": "nobody"}, timeout=5)
    assert missing.status_code == 503 and "nobody" in missing.json()["error"]


def test_metrics_label_each_series_with_the_model_it_measures(fleet):
    fleet.ready()
    client = fleet.client()
    client.completions.create(
        model="smol", prompt="Count", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )

    def counted():
        f = scrape(fleet.server.url)
        return metric(f, "tandem:generation_tokens_total", model_name="smol") >= 3 and f

    fams = wait_for(counted, 30, "smol's tokens in /metrics", interval=0.2)
    for fam in fams.values():
        for s in fam.samples:
            if "model_name" not in s.labels:
                continue
            vision = fam.name.startswith("tandem:vision_")
            instance = s.labels["tandem_instance"]
            if vision:  # only the worker with the detector has vision series, under its name
                assert instance.startswith("tiny@fleet") and s.labels["model_name"] == "shapes_yolo26n", s
            else:
                expected = "smol" if instance.startswith("smol@fleet") else "tiny"
                assert s.labels["model_name"] == expected, s
