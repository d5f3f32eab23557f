"""`tandem bench chaos`: its accounting on hand-made Redis records (a clean job, a resumed one,
two final results, tokens streamed twice, a job never finished), then a real, tiny run: two
workers on the tiny random Llama, a worker SIGKILLed and Redis SIGKILLed early at fixed times,
a stream dropped; nothing accepted may be lost or run twice."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_jobs_support import REPO

from benchmarks import cli
from benchmarks.chaos import fault_schedule, parse_faults
from benchmarks.chaos_accounting import (
    TICKET,
    account,
    audit_job,
    classify,
    latency_table,
    load_seconds,
    ticket,
    without_a_live_worker,
)


def _token(index: int, ids: list[int], attempt: int = 1) -> tuple[str, dict]:
    return (f"{index}-0", {"type": "token", "index": str(index), "token_ids": json.dumps(ids), "attempt": str(attempt)})


def _done(ids: list[int]) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    final = ("99-0", {"type": "done", "token_ids": "[]", "text": "", "finish_reason": "length"})
    end = ("99-0", {"state": "done", "result": json.dumps({"token_ids": ids, "text": "abc"}), "error": ""})
    return [final], [end]


def _record(state: str = "done", attempt: int = 1) -> dict:
    return {"state": state, "attempt": str(attempt), "task": "tandem.generate", "prompt_token_ids": "[1, 2]"}


def _op(job_id: str, tokens: list[int], indices: list[tuple[int, int]] | None = None, **kw) -> dict:
    op = {
        "id": job_id,
        "kind": "job",
        "accepted": True,
        "done": True,
        "dropped": False,
        "error": "",
        "job_id": job_id,
        "text": "",
        "token_ids": tokens,
        "result_token_ids": tokens,
        "indices": indices if indices is not None else [(0, 2), (2, 1)],
    }
    return {**op, **kw}


def test_a_clean_job_and_a_resumed_one_are_completed_once():
    final, end = _done([5, 6, 7])
    clean = audit_job("a", _record(), [_token(0, [5, 6]), _token(2, [7]), *final], end)
    restarted = ("2-1", {"type": "restarted", "attempt": "2", "resumed_from": "2", "token_ids": "[]"})
    resumed = audit_job("b", _record(attempt=2), [_token(0, [5, 6]), restarted, _token(2, [7], 2), *final], end)
    assert clean["duplicate"] == [] and clean["mismatch"] == "" and clean["stream_token_ids"] == [5, 6, 7]
    assert resumed["duplicate"] == [] and resumed["attempts"] == 2  # attempts > 1 alone is no duplicate
    counts = account([_op("a", [5, 6, 7]), _op("b", [5, 6, 7])], {"a": clean, "b": resumed}, {})
    assert (counts["completed_once"], counts["lost"], counts["duplicated"]) == (2, 0, 0)
    assert counts["redis"]["resumed"] == 1


def test_two_final_results_or_repeated_indices_are_duplicates():
    final, end = _done([5, 6, 7])
    second_end = ("100-0", end[0][1])
    two_results = audit_job("a", _record(), [_token(0, [5, 6]), _token(2, [7]), *final, *final], [*end, second_end])
    assert "2 final results" in two_results["duplicate"] and "2 final events" in two_results["duplicate"]
    again = audit_job("b", _record(attempt=2), [_token(0, [5, 6]), _token(1, [6, 7]), *final], end)
    assert again["duplicate"] and again["stream_token_ids"] == [5, 6, 7]  # the overlap is not counted twice
    # A client that received index 0 twice (a resumed SSE stream that replayed) is a duplicate too.
    clean = audit_job("c", _record(), [_token(0, [5, 6]), _token(2, [7]), *final], end)
    replayed = _op("c", [5, 6, 5, 6, 7], indices=[(0, 2), (0, 2), (2, 1)])
    assert classify(replayed, clean)[0] == "duplicated"
    # A job in Redis that no accepted request names still counts.
    counts = account([_op("a", [5, 6, 7]), replayed], {"a": two_results, "b": again, "c": clean}, {})
    assert counts["duplicated"] == 3 and counts["redis"]["duplicated_unlinked"] == ["b"]
    assert counts["redis"]["duplicated_unlinked_why"] == {"b": "; ".join(again["duplicate"])}


def test_accepted_and_never_done_is_lost_and_a_dropped_chat_is_not():
    running = audit_job("a", _record("running"), [_token(0, [5])], [])
    counts = account(
        [
            _op("a", [5], done=False, error="no final event by the end of the drain"),
            _op("gone", [], done=False, error="no final event by the end of the drain"),
            {**_op("c1", [], done=False), "job_id": None, "kind": "chat", "dropped": True},
            {**_op("j9", []), "accepted": False, "done": False},  # refused: neither accepted nor lost
        ],
        {"a": running},
        {},
    )
    assert counts["lost"] == 2 and counts["dropped"] == 1 and counts["refused"] == 1
    assert counts["redis"]["unfinished"] == ["a"]
    assert {d["request"] for d in counts["details"]} == {"a", "gone"}


def test_a_chat_is_linked_to_its_job_by_ticket_and_checked_against_its_result():
    final, end = _done([5, 6, 7])
    audit = audit_job("x", _record(), [_token(0, [5, 6, 7]), *final], end)
    chat = {**_op("c3", []), "job_id": None, "kind": "chat", "text": "abc", "indices": []}
    assert account([chat], {"x": audit}, {"c3": "x"})["completed_once"] == 1
    assert account([{**chat, "text": "abcabc"}], {"x": audit}, {"c3": "x"})["duplicated"] == 1
    assert account([{**chat, "text": "ab"}], {"x": audit}, {"c3": "x"})["mismatched"] == 1


def test_the_accounting_is_pure_and_finds_the_ticket_the_load_writes():
    # The split's promise: the accounting imports no process, HTTP or Redis machinery, so it
    # can be read and tested alone.
    code = "import sys, benchmarks.chaos_accounting; print(sorted({'redis', 'httpx', 'asyncio'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    assert TICKET.search(f"What is 2 + 2? {ticket('c12')}").group(1) == "c12"


def test_latency_is_split_at_the_first_and_the_last_fault():
    ops = [
        {"kind": "chat", "start": t, "end": t + 0.5, "done": True, "error": "", "ttft": 0.1}
        for t in (1.0, 5.0, 9.0, 12.0)
    ]
    table = latency_table([*ops, {**ops[0], "error": "HTTP 503"}], [{"t": 5.0}, {"t": 9.0}, {"t": None}])
    assert [table[p]["n"] for p in ("before", "during", "after")] == [1, 2, 1]  # errors are not timed
    assert table["during"]["chat"]["p50_ms"] == 500 and table["before"]["chat_ttft"]["p99_ms"] == pytest.approx(100)
    assert table["after"]["job"]["n"] == 0


def test_faults_parse_and_the_random_plan_is_seeded_and_covers_each_kind():
    assert parse_faults("kill@4,redis-kill@9") == (["kill", "redis-kill"], [(4.0, "kill"), (9.0, "redis-kill")])
    with pytest.raises(ValueError, match="^--faults"):
        parse_faults("kill,redis@3")
    with pytest.raises(ValueError, match="^--faults"):
        parse_faults("explode")
    plan = fault_schedule(["kill", "redis", "drop"], 300, 10, seed=1)
    assert plan == fault_schedule(["kill", "redis", "drop"], 300, 10, seed=1)
    assert {k for _, k in plan} == {"kill", "redis", "drop"} and all(30 <= t <= 210 for t, _ in plan)


@pytest.mark.slow
def test_a_tiny_chaos_run_loses_nothing_and_runs_nothing_twice(tmp_path, tiny_llama_dir, capsys):
    # The bench in this process; its fleet (Redis, two workers, the server) in their own, as
    # always. Every fault in 8 s of load: a worker's job outlives its 3 s lease, Redis comes
    # back from its append-only file, and both streams are dropped while the load runs.
    out = tmp_path / "chaos"
    argv = ["chaos", "--duration-s", "8", "--workers", "2", "--model", tiny_llama_dir]
    argv += ["--faults", "kill@2,drop@3,redis-kill@4,drop@5", "--lease-s", "3"]
    argv += ["--clients", "3", "--max-tokens", "16", "--drain-s", "60", "--out", str(out)]
    rc = cli.main(argv)
    stdout = capsys.readouterr().out
    assert (out / "chaos.json").exists(), stdout[-3000:]
    report = json.loads((out / "chaos.json").read_text())
    for key in ("cpu", "faults", "accepted", "completed_once", "lost", "duplicated", "token_equality", "latency"):
        assert key in report, key
    assert report["cpu"]["flags"] and report["rss_mb"] and (out / "chaos.png").exists()
    kinds = [f["kind"] for f in report["faults"] if f["t"] is not None]
    assert "kill" in kinds and "redis-kill" in kinds, report["faults"]
    assert report["accepted"] > 0 and report["completed_once"] > 0
    assert report["lost"] == 0, report["details"]
    assert report["duplicated"] == 0, (report["details"], report["redis"])
    assert report["token_equality"]["differ"] == 0 and report["token_equality"]["compared"] > 0
    assert rc == 0, stdout[-2000:]


def test_the_longest_interval_without_a_live_worker_is_read_from_health_samples():
    samples = [(0, 2, 2), (1, 1, 0), (2, 1, -1), (3, 2, 0), (5, 2, 1), (6, 2, -1), (7, 2, 2), (8, 2, 0)]
    # 1..5 s: no worker seen (the -1 inside extends it); 6 s alone (Redis down, workers
    # registered) opens none; the stretch open at the end runs to the last sample.
    assert without_a_live_worker(samples) == {"seconds": 4.0, "from": 1, "to": 5}
    assert without_a_live_worker([(0, 1, 1), (3, 1, -1), (9, 1, 1)])["seconds"] == 0.0
    assert without_a_live_worker([(0, 0, 0), (7.5, 1, 0)]) == {"seconds": 7.5, "from": 0, "to": 7.5}
    assert load_seconds("x\nworker w: runtime ready in 12.5 s\n... runtime ready in 3.0 s") == [12.5, 3.0]
