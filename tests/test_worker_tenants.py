"""`tandem worker --tenants FILE` (workers/worker.py tenants_option), with no model: the file of
`tandem serve --tenants` gives the worker's LLM engine its tenant weights; a weight the engine
would not read (no --policy fair, no llm queue) is an error naming the file, the tenant and the
flag; the file's keys and limits, the server's admission, are accepted and left to the server,
so that both read one file. The engine really weighs them: tests/test_worker_tenants_e2e.py."""

from __future__ import annotations

import argparse
import json

import pytest

from workers.host import runtime_config
from workers.worker import add_worker_arguments, run_worker, worker_plan

FILE = """
[tenants.gold]
keys = ["sk-gold"]
weight = 3
requests_per_minute = 600
max_concurrent = 8

[tenants.silver]
keys = ["sk-silver"]
weight = 1.5

[tenants.bronze]
keys = ["sk-bronze-1", "sk-bronze-2"]
"""


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_worker_arguments(p)
    return p.parse_args(["--queues", "llm", "--no-profile", *argv])


@pytest.fixture
def tenants(tmp_path) -> str:
    path = tmp_path / "tenants.toml"
    path.write_text(FILE)
    return str(path)


def test_the_files_weights_are_the_llm_engines_tenant_weights(tenants):
    runtime, queues, _ = worker_plan(_args("--tenants", tenants, "--policy", "fair"))
    # Weight 1 (bronze, by default) is what the scheduler gives an unnamed tenant: left out.
    assert runtime["llm"]["tenant_weights"] == {"gold": 3.0, "silver": 1.5}
    assert runtime["llm"]["policy"] == "fair" and queues == ["llm"]
    # What the host reads back in the worker process (TANDEM_WORKER_RUNTIME, workers/host.py).
    back = runtime_config(["llm"], {"TANDEM_WORKER_RUNTIME": json.dumps(runtime)})
    assert back["llm"]["tenant_weights"] == {"gold": 3.0, "silver": 1.5}


def test_without_tenants_the_engine_gets_no_weights(tmp_path):
    runtime, _, _ = worker_plan(_args("--policy", "fair"))
    assert "tenant_weights" not in runtime["llm"]
    flat = tmp_path / "flat.toml"  # every tenant weight 1: nothing to weigh, any policy
    flat.write_text('[tenants.a]\nkeys = ["k"]\nmax_queued = 4\n')
    runtime, _, _ = worker_plan(_args("--tenants", str(flat)))
    assert "tenant_weights" not in runtime["llm"]


@pytest.mark.parametrize("policy", [None, "fcfs", "priority"])
def test_a_weight_without_policy_fair_is_an_error_naming_the_file_tenant_and_flag(tenants, policy):
    argv = ["--tenants", tenants] + (["--policy", policy] if policy else [])
    with pytest.raises(ValueError) as err:
        worker_plan(_args(*argv))
    message = str(err.value)
    for word in (f"--tenants {tenants}", "tenant 'gold'", "--policy fair", f"--policy {policy or 'fcfs'}"):
        assert word in message, message


def test_a_weight_on_a_worker_without_the_llm_queue_is_an_error(tenants):
    with pytest.raises(ValueError) as err:
        worker_plan(_args("--tenants", tenants, "--policy", "fair", "--queues", "vision"))
    message = str(err.value)
    for word in (f"--tenants {tenants}", "tenant 'gold'", "--queues vision", "llm"):
        assert word in message, message


@pytest.mark.parametrize(
    "body, words",
    [
        ('[tenants.a]\nkeys = ["k"]\nburst = 3\n', ["tenant 'a'", "unknown field 'burst'"]),
        ('[tenants.a]\nkeys = ["k"]\nweight = 0\n', ["tenant 'a'", "weight", "> 0"]),
        ("[tenants.a]\nweight = 2\n", ["tenant 'a'", "keys"]),
        ('[tenants.default]\nkeys = ["k"]\n', ["tenant 'default'", "reserved"]),
        ("[tenants.a\n", ["not valid TOML"]),
    ],
)
def test_a_bad_tenants_file_stops_the_worker_naming_the_file_tenant_and_field(tmp_path, capsys, body, words):
    path = tmp_path / "t.toml"
    path.write_text(body)
    # run_worker returns before Celery starts (nothing is listening: a start would hang or fail).
    assert run_worker(_args("--tenants", str(path), "--policy", "fair")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tandem worker: error: --tenants {path}: "), err
    for word in words:
        assert word in err, err


def test_a_missing_tenants_file_is_an_error_naming_it(tmp_path, capsys):
    missing = tmp_path / "none.toml"
    assert run_worker(_args("--tenants", str(missing), "--policy", "fair")) == 2
    assert f"--tenants {missing}: cannot read it" in capsys.readouterr().err
