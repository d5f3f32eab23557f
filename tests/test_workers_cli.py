"""`tandem worker` flags and the worker's configuration, without starting anything."""

from __future__ import annotations

import argparse
import json

import pytest

from runtime.vision.detector import WEIGHTS
from workers.app import celery_config
from workers.host import runtime_config
from workers.message import broker_list, task_message
from workers.settings import JobSettings
from workers.worker import add_worker_arguments, worker_plan


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_worker_arguments(p)
    return p.parse_args(list(argv))


def test_a_worker_with_no_flags_serves_both_queues_on_the_embedded_defaults():
    runtime, queues, concurrency = worker_plan(_args())
    assert queues == ["llm", "vision"]
    assert runtime["llm"] == {"dtype": "auto"} and runtime["vision"]["model"] == str(WEIGHTS)  # the shipped detector
    assert runtime["vision"]["imgsz"] == 320  # at its training size
    assert concurrency == 16 + 8 + 2 * 8  # the CPU batch, half again waiting, and two vision batches


def test_queues_decide_which_workloads_load_and_prefetch_follows_max_num_seqs():
    runtime, queues, concurrency = worker_plan(_args("--queues", "llm", "--max-num-seqs", "32", "--dtype", "bfloat16"))
    assert runtime["vision"] is None and runtime["llm"]["max_num_seqs"] == 32 and runtime["llm"]["dtype"] == "bfloat16"
    assert concurrency == 32 + 16
    runtime, _, concurrency = worker_plan(_args("--queues", "vision", "--vision-max-batch-size", "4"))
    assert runtime["llm"] is None and concurrency == 8
    assert worker_plan(_args("--queues", "llm", "--concurrency", "5"))[2] == 5


@pytest.mark.parametrize(
    "argv, flag",
    [(("--queues", "gpu"), "--queues"), (("--queues", ""), "--queues"), (("--concurrency", "0"), "--concurrency")],
)
def test_bad_flags_are_named(argv, flag):
    with pytest.raises(ValueError, match=flag):
        worker_plan(_args(*argv))


def test_runtime_config_comes_from_the_environment_when_given():
    env = {"TANDEM_WORKER_RUNTIME": json.dumps({"llm": {"max_num_seqs": 4}, "vision": None, "profile": False})}
    assert runtime_config(["llm", "vision"], env) == {"llm": {"max_num_seqs": 4}, "vision": None, "profile": False}
    assert runtime_config(["vision"], {}) == {"llm": None, "vision": {}}
    with pytest.raises(ValueError, match="TANDEM_WORKER_RUNTIME"):
        runtime_config(None, {"TANDEM_WORKER_RUNTIME": "{llm"})
    with pytest.raises(ValueError, match="TANDEM_WORKER_RUNTIME"):
        runtime_config(None, {"TANDEM_WORKER_RUNTIME": '{"gpu": {}}'})


def test_celery_accepts_json_only_and_routes_each_task_to_its_queue():
    conf = celery_config(JobSettings(redis_url="redis://example:6379/1"))
    assert conf["accept_content"] == conf["result_accept_content"] == ["json"]
    assert conf["task_serializer"] == conf["result_serializer"] == "json"
    assert conf["task_routes"] == {"tandem.generate": {"queue": "llm"}, "tandem.detect": {"queue": "vision"}}
    assert conf["broker_url"] == conf["result_backend"] == "redis://example:6379/1"
    assert conf["worker_prefetch_multiplier"] == 1 and conf["task_acks_late"] is False


def test_task_messages_follow_celery_protocol_2_on_kombu_priority_lists():
    msg = json.loads(task_message("tandem.generate", "j-1", {"prompt": "hi"}, "llm", 3, ignore_result=True))
    assert msg["content-type"] == "application/json" and msg["properties"]["body_encoding"] == "base64"
    assert msg["headers"]["id"] == msg["headers"]["root_id"] == msg["properties"]["correlation_id"] == "j-1"
    assert msg["headers"]["ignore_result"] is True
    assert msg["properties"]["delivery_info"] == {"exchange": "", "routing_key": "llm"}
    assert [broker_list("llm", p) for p in (0, 2, 3, 9)] == ["llm", "llm", "llm\x06\x163", "llm\x06\x169"]


def test_model_name_equals_path_names_the_served_model_and_one_model_per_worker(tmp_path):
    from workers.settings import model_queue

    args = _args("--queues", "llm", "--model", f"smol={tmp_path}")
    runtime, queues, _ = worker_plan(args)
    assert runtime["llm"]["model"] == str(tmp_path) and args.served_model_name == "smol" and queues == ["llm"]
    assert model_queue("smol") == "llm.smol"
    plain = _args("--queues", "llm", "--model", str(tmp_path))  # today's single --model PATH
    assert worker_plan(plain)[0]["llm"]["model"] == str(tmp_path) and plain.served_model_name is None
    with pytest.raises(ValueError, match="^--model: one worker process serves one model"):
        worker_plan(_args("--model", f"a={tmp_path}", "--model", f"b={tmp_path}"))
    with pytest.raises(ValueError, match="^--model must be PATH or NAME=PATH"):
        worker_plan(_args("--model", "=nothing"))
    with pytest.raises(ValueError, match="^--served-model-name"):
        worker_plan(_args("--model", f"a={tmp_path}", "--served-model-name", "b"))


def test_vision_series_carry_the_detector_name_and_llm_series_the_llm_name():
    from prometheus_client.parser import text_string_to_metric_families

    from runtime import metrics
    from server.metrics import render

    m = metrics.ServingMetrics()
    m.observe_vision_batch(2, [0.01, 0.02])
    snap = m.snapshot({"num_requests_running": 1, "vision_queue_depth": 3})
    both = {"instance": "w1", "serves": ["llm", "vision"], "model_name": "smol", "vision_model_name": "yolo"}
    vision_only = {"instance": "w2", "serves": ["vision"], "vision_model_name": "yolo"}
    text = render([{**both, "metrics": snap}, {**vision_only, "metrics": snap}]).decode()
    seen = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "model_name" in s.labels:
                vision = fam.name.startswith("tandem:vision_")
                assert s.labels["model_name"] == ("yolo" if vision else "smol"), s
                assert vision or s.labels["tandem_instance"] == "w1", f"an LLM series for a vision-only worker: {s}"
                seen.add((fam.name, s.labels["tandem_instance"]))
    assert ("tandem:vision_batches", "w2") in seen and ("tandem:num_requests_running", "w1") in seen
