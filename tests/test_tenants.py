"""Tenants of `tandem serve` (server/tenants.py, server/admission.py), with no model: the tenants
file's errors name the file, the tenant and the field; the buckets refill on a fake clock (no
sleeps); a key is its tenant, and a request cannot name another; the tenant and tier reach the
job (what the workers and the engine process read); per-tenant series render under tandem:."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from runtime.errors import FieldError
from server.admission import CONCURRENT, QUEUED, RPM, TPM, Rejected, TenantAdmission, TokenBucket
from server.app import create_app
from server.common import ServeConfig
from server.metrics import render
from server.tenants import DEFAULT_TENANT, Tenant, TenantTable, key_tenant_name, load_tenants, parse_tenants
from workers.events import JobEvent
from workers.jobspec import parse_generate, tenancy_kwargs


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the tenants file ------------------------------------------------------------------------


def test_a_tenants_file_parses_to_tenants_with_their_keys_weights_and_limits(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(
        '[tenants.alice]\nkeys = ["sk-a1", "sk-a2"]\nweight = 2\nrequests_per_minute = 600\n'
        'tokens_per_minute = 200000\nmax_concurrent = 16\nmax_queued = 64\n\n[tenants.bob]\nkeys = ["sk-b"]\n'
    )
    alice, bob = load_tenants(str(path))
    assert alice == Tenant("alice", ("sk-a1", "sk-a2"), 2, 600, 200000, 16, 64)
    assert bob == Tenant("bob", ("sk-b",))


@pytest.mark.parametrize(
    "body, words",
    [
        ({"tenants": {"a": {"keys": ["k"], "weight": 0}}}, ["tenant 'a'", "weight", "> 0"]),
        ({"tenants": {"a": {"keys": ["k"], "weight": "2"}}}, ["tenant 'a'", "weight"]),
        ({"tenants": {"a": {"keys": ["k"], "max_queued": 0}}}, ["tenant 'a'", "max_queued", ">= 1"]),
        ({"tenants": {"a": {"keys": ["k"], "requests_per_minute": 1.5}}}, ["tenant 'a'", "requests_per_minute"]),
        ({"tenants": {"a": {"keys": ["k"], "tokens_per_minute": True}}}, ["tenant 'a'", "tokens_per_minute"]),
        ({"tenants": {"a": {"keys": ["k"], "burst": 3}}}, ["tenant 'a'", "unknown field 'burst'"]),
        ({"tenants": {"a": {"weight": 1}}}, ["tenant 'a'", "keys"]),
        ({"tenants": {"a": {"keys": []}}}, ["tenant 'a'", "keys"]),
        ({"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}, ["tenant 'b'", "tenant 'a'"]),
        ({"tenants": {"default": {"keys": ["k"]}}}, ["tenant 'default'", "reserved"]),
        ({"tenants": {"a b": {"keys": ["k"]}}}, ["tenant name", "a b"]),
        ({"tenants": {"a": {"keys": ["k1,k2"]}}}, ["tenant 'a'", "keys"]),
        ({"tenants": {"a": 3}}, ["tenant 'a'", "table"]),
        ({"tenant": {"a": {"keys": ["k"]}}}, ["unknown top-level key(s) ['tenant']"]),
        ({"tenants": {}}, ["names no tenant"]),
    ],
)
def test_a_bad_tenants_file_is_an_error_naming_the_tenant_and_field(body, words):
    with pytest.raises(ValueError) as err:
        parse_tenants(body, "--tenants t.toml")
    message = str(err.value)
    assert message.startswith("--tenants t.toml: "), message
    for word in words:
        assert word in message, message


def test_a_tenants_file_that_is_no_toml_or_missing_says_so(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants.a\nkeys = 1")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_tenants(str(bad))
    with pytest.raises(ValueError, match="cannot read it"):
        load_tenants(str(tmp_path / "none.toml"))


def test_the_cli_refuses_weights_the_engine_would_not_read(tmp_path):
    from tandem.serve_cli import tenant_table

    path = tmp_path / "t.toml"
    path.write_text('[tenants.a]\nkeys = ["k"]\nweight = 3\n')
    args = argparse.Namespace(tenants=str(path), api_key=None, embedded=True, policy="fair")
    with pytest.raises(ValueError, match="tenant 'a' has a weight.*--policy fair.*got --policy fcfs"):
        tenant_table(argparse.Namespace(**{**vars(args), "policy": None}))
    assert tenant_table(args).weights() == {"a": 3.0}
    # Over workers the weights are the workers' engines' (`tandem worker --tenants` reads the
    # same file and checks their --policy, tests/test_worker_tenants.py): the server takes the
    # file whatever its own --policy, which no engine of its reads.
    for policy in (None, "fair"):
        table = tenant_table(argparse.Namespace(**{**vars(args), "embedded": False, "policy": policy}))
        assert table.weights() == {"a": 3.0}


def test_serve_embedded_gives_its_engine_the_files_weights_as_a_worker_does(tmp_path):
    from tandem.serve_cli import add_serve_arguments
    from workers.worker import worker_plan

    path = tmp_path / "t.toml"
    path.write_text('[tenants.a]\nkeys = ["k"]\nweight = 3\n\n[tenants.b]\nkeys = ["k2"]\n')
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--embedded", "--tenants", str(path), "--policy", "fair", "--queues", "llm"])
    config, _, _ = worker_plan(args)  # build_backend's plan (workers/worker.py tenants_option)
    assert config["llm"]["tenant_weights"] == {"a": 3.0}


# ---- keys and tenants --------------------------------------------------------------------------


def test_each_key_is_its_tenant_and_bare_keys_are_tenants_of_their_own():
    alice = Tenant("alice", ("sk-a1", "sk-a2"), weight=2)
    table = TenantTable.build([alice], ("sk-a1", "sk-x"))
    assert table.tenant_of("sk-a1").name == table.tenant_of("sk-a2").name == "alice"
    x = table.tenant_of("sk-x")
    assert x.name == key_tenant_name("sk-x") and "sk-x" not in x.name and x.weight == 1
    assert table.tenant_of("sk-a") is None and table.tenant_of("") is None
    assert [t.name for t in table.tenants] == ["alice", key_tenant_name("sk-x")]
    anonymous = TenantTable.build()
    assert not anonymous.keyed and [t.name for t in anonymous.tenants] == [DEFAULT_TENANT]


class _Stream:
    def __init__(self, rid: str) -> None:
        self.id = rid

    async def events(self):
        yield JobEvent("token", "a", [1])
        yield JobEvent("done", "", finish_reason="length")

    async def usage(self) -> dict:
        return {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}

    async def cancel(self) -> None:
        pass


class _Backend:
    """Records each generation's job: what JobsBackend queues for the workers and the engine
    process reads (server/embedded.py start_generation)."""

    mode = "jobs"

    def __init__(self) -> None:
        self.jobs: list[dict] = []

    async def workers(self) -> list[dict]:
        return [{"kind": "runtime", "serves": ["llm"], "models": [{"name": "smol", "max_model_len": 512}]}]

    async def payloads(self) -> list[dict]:
        return []

    async def generate(self, gen, deadline_s, owner=None):
        self.jobs.append(dict(gen.job))
        return _Stream(f"job-{len(self.jobs)}")

    async def close(self) -> None:
        pass


def _as(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_the_key_names_the_tenant_and_a_request_cannot_name_another():
    backend = _Backend()
    config = ServeConfig(api_key="sk-x", tenants=(Tenant("alice", ("sk-a",)),))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with TestClient(create_app(backend, config)) as client:
        assert client.post("/v1/chat/completions", json=chat, headers=_as("sk-a")).status_code == 200
        assert client.post("/v1/chat/completions", json=chat, headers=_as("sk-x")).status_code == 200
        own = client.post("/v1/chat/completions", json={**chat, "tenant": "alice"}, headers=_as("sk-a"))
        assert own.status_code == 200, own.text
        batch = client.post("/v1/completions", json={"prompt": "hi", "tier": "batch"}, headers=_as("sk-a"))
        assert batch.status_code == 200, batch.text
        other = client.post("/v1/chat/completions", json={**chat, "tenant": "alice"}, headers=_as("sk-x"))
        assert other.status_code == 400 and other.json()["error"]["param"] == "tenant", other.text
        tier = client.post("/v1/chat/completions", json={**chat, "tier": "bulk"}, headers=_as("sk-a"))
        assert tier.status_code == 400 and tier.json()["error"]["param"] == "tier", tier.text
        assert client.post("/v1/chat/completions", json=chat, headers=_as("sk-b")).status_code == 401
    tenants = [(j.get("tenant"), j.get("tier")) for j in backend.jobs]
    x = key_tenant_name("sk-x")
    assert tenants == [("alice", None), (x, None), ("alice", None), ("alice", "batch")]


def test_without_keys_every_request_is_the_default_tenant_and_names_no_other():
    backend = _Backend()
    with TestClient(create_app(backend, ServeConfig())) as client:
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        named = client.post("/v1/completions", json={"prompt": "hi", "tenant": "alice"})
        assert named.status_code == 400 and named.json()["error"]["param"] == "tenant", named.text
        tenants = client.app.state.tandem.admission.payload()
    metrics = render([{"instance": "server", "kind": "tenants", "tenants": tenants}])
    assert backend.jobs == [{"prompt": "hi", "max_tokens": 1}]  # the engine's anonymous tenant: no field
    assert 'tandem:tenant_generation_tokens_total{tandem_instance="server",tenant="default"} 1.0' in metrics.decode()


def test_a_jobs_tenant_and_tier_reach_the_runtime_call():
    spec = parse_generate({"prompt": "hi", "tenant": "alice", "tier": "batch"})
    assert (spec.tenant, spec.tier) == ("alice", "batch")
    assert tenancy_kwargs(spec.tenant, spec.tier) == {"tenant": "alice", "tier": "batch"}
    plain = parse_generate({"prompt": "hi"})
    assert tenancy_kwargs(plain.tenant, plain.tier) == {}  # the Runtime's defaults: nothing new asked
    for field, value in (("tier", "bulk"), ("tenant", ""), ("tenant", 3), ("tenant", "a b")):
        with pytest.raises(FieldError) as err:
            parse_generate({"prompt": "hi", field: value})
        assert err.value.field == field


def test_the_engine_process_passes_tenant_and_tier_to_submit_generate():
    """server/embedded.py start_generation, which the engine process runs on the job it is sent."""
    from server.embedded import start_generation

    class _Load:
        num_waiting = 0

    class _Handle:
        request_id = "r"

    class _Runtime:
        llm, tokenizer = object(), None
        calls: list = []

        def llm_load(self):
            return _Load()

        def submit_generate(self, prompt, params, priority, deadline_s, **kw):
            self.calls.append(kw)
            return _Handle()

    rt = _Runtime()
    start_generation(rt, {"prompt": "hi", "max_tokens": 2, "tenant": "alice", "tier": "batch"}, None, 8)
    start_generation(rt, {"prompt": "hi", "max_tokens": 2}, None, 8)
    assert rt.calls == [{"tenant": "alice", "tier": "batch"}, {}]


# ---- buckets and caps, on a fake clock ---------------------------------------------------------


def test_a_bucket_refills_at_its_rate_per_minute():
    clock = Clock()
    b = TokenBucket(60, clock)  # one a second
    assert b.wait_s(60) == 0
    b.take(60)
    assert b.wait_s(1) == pytest.approx(1.0)
    clock.now += 30
    assert b.wait_s(30) == 0 and b.wait_s(31) == pytest.approx(1.0)
    clock.now += 1000
    assert b.level == 30 and b.wait_s(60) == 0 and b.level == 60  # never past its capacity


def test_a_request_larger_than_a_minute_runs_from_a_full_bucket_and_leaves_it_in_debt():
    clock = Clock()
    b = TokenBucket(60, clock)
    assert b.wait_s(100) == 0
    b.take(100)
    assert b.wait_s(100) == pytest.approx(100.0)  # 40 of debt, then a full bucket


def test_each_limit_refuses_with_its_reason_and_retry_after_and_other_tenants_go_on():
    clock = Clock()
    tenants = (
        Tenant("rpm", ("k1",), requests_per_minute=2),
        Tenant("tpm", ("k2",), tokens_per_minute=100),
        Tenant("conc", ("k3",), max_concurrent=1),
        Tenant("queue", ("k4",), max_queued=1),
        Tenant("free", ("k5",)),
    )
    a = TenantAdmission(tenants, clock)

    def refused(tenant: str, num_tokens: int = 1) -> Rejected:
        with pytest.raises(Rejected) as err:
            a.admit(tenant, num_tokens)
        return err.value

    a.admit("rpm", 1), a.admit("rpm", 1)
    r = refused("rpm")
    assert (r.reason, r.retry_after_s) == (RPM, 30)  # one request back every 30 s
    a.admit("tpm", 80)
    r = refused("tpm", 50)
    assert (r.reason, r.retry_after_s) == (TPM, 18)  # 30 tokens short at 100/60 a second
    first = a.admit("conc", 1)
    assert refused("conc").reason == CONCURRENT and refused("conc").retry_after_s == 1
    first.finish()
    a.admit("conc", 1)
    waiting = a.admit("queue", 1)
    assert refused("queue").reason == QUEUED
    waiting.started()  # its first event came: it waits no more
    a.admit("queue", 1)
    for _ in range(100):
        a.admit("free", 1000)
    clock.now += 30
    a.admit("rpm", 1)
    payload = a.payload()
    assert payload["rpm"]["rejections"] == {RPM: 1} and payload["conc"]["rejections"] == {CONCURRENT: 2}
    assert payload["free"]["rejections"] == {} and payload["free"]["running"] == 100


def test_tokens_not_used_go_back_to_the_bucket_and_count_as_served():
    clock = Clock()
    a = TenantAdmission((Tenant("t", ("k",), tokens_per_minute=100),), clock)
    ticket = a.admit("t", 90)
    clock.now += 0.5
    ticket.token()
    ticket.finish(prompt_tokens=5, completion_tokens=5)
    ticket.finish(prompt_tokens=5, completion_tokens=5)  # once only
    a.admit("t", 90)  # the 80 unused came back
    p = a.payload()["t"]
    assert (p["prompt_tokens"], p["completion_tokens"], p["running"], p["queued"]) == (5, 5, 1, 1)
    assert p["ttft"]["sum"] == pytest.approx(0.5) and p["queue_time"]["sum"] == pytest.approx(0.5)
    assert p["share"] == 1.0


def test_per_tenant_series_render_under_the_tandem_namespace():
    clock = Clock()
    a = TenantAdmission((Tenant("a", ("k1",), weight=2, max_concurrent=1), Tenant("b", ("k2",))), clock)
    a.admit("a", 10).finish(3, 7)
    t = a.admit("b", 10)
    t.token()
    t.finish(10, 20)
    a.admit("a", 1)
    with pytest.raises(Rejected):
        a.admit("a", 1)
    text = render([{"instance": "server", "kind": "tenants", "tenants": a.payload()}]).decode()
    lines = [
        'tandem:tenant_prompt_tokens_total{tandem_instance="server",tenant="a"} 3.0',
        'tandem:tenant_generation_tokens_total{tandem_instance="server",tenant="b"} 20.0',
        'tandem:tenant_share{tandem_instance="server",tenant="b"} 0.75',
        'tandem:tenant_weight{tandem_instance="server",tenant="a"} 2.0',
        'tandem:tenant_requests_running{tandem_instance="server",tenant="a"} 1.0',
        'tandem:tenant_rejections_total{reason="max_concurrent",tandem_instance="server",tenant="a"} 1.0',
        'tandem:tenant_time_to_first_token_seconds_count{tandem_instance="server",tenant="b"} 1.0',
        'tandem:tenant_queue_time_seconds_count{tandem_instance="server",tenant="b"} 1.0',
    ]
    for line in lines:
        assert line in text, line
