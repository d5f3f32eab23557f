"""`tandem bench chaos` links chats to their jobs by the ticket in the prompt: a ticket that
two jobs carry is one request run twice, and must count as duplicated (once), not be dropped
from the count because the link keeps only one of them."""

from __future__ import annotations

import json

from benchmarks.chaos import link_tickets
from benchmarks.chaos_accounting import account, audit_job, ticket

PROMPTS = {(1,): f"Hi {ticket('c3')}", (2,): f"Hi again {ticket('c3')}", (3,): f"Other {ticket('c4')}", (4,): "none"}


def _decode(ids: list[int]) -> str:
    return PROMPTS[tuple(ids)]


def _job(job_id: str, prompt_ids: list[int]) -> dict:
    record = {"state": "done", "attempt": "1", "task": "tandem.generate", "prompt_token_ids": json.dumps(prompt_ids)}
    events = [("0-0", {"type": "token", "index": "0", "token_ids": "[5]"}), ("1-0", {"type": "done", "text": ""})]
    end = [("1-0", {"state": "done", "result": json.dumps({"token_ids": [5], "text": "abc"}), "error": ""})]
    return audit_job(job_id, record, events, end)


def _chat(request_id: str) -> dict:
    return {
        "id": request_id,
        "kind": "chat",
        "accepted": True,
        "done": True,
        "dropped": False,
        "error": "",
        "job_id": None,
        "text": "abc",
        "token_ids": [],
        "result_token_ids": [],
        "indices": [],
    }


def _audits() -> dict[str, dict]:
    return {"j-b": _job("j-b", [2]), "j-a": _job("j-a", [1]), "j-c": _job("j-c", [3]), "j-d": _job("j-d", [4])}


def test_a_ticket_two_jobs_carry_is_one_duplicated_request():
    audits = _audits()
    tickets = link_tickets(audits, _decode)
    assert tickets == {"c3": "j-a", "c4": "j-c"}  # the first by job id, however Redis listed them
    assert audits["j-a"]["duplicate"] == ["2 jobs carry ticket c3: j-a, j-b"]
    assert audits["j-b"]["duplicate"] == [] and audits["j-c"]["duplicate"] == []
    counts = account([_chat("c3"), _chat("c4")], audits, tickets)
    assert (counts["duplicated"], counts["completed_once"]) == (1, 1), counts


def test_a_refused_requests_ticket_on_two_jobs_still_counts_once():
    audits = _audits()
    tickets = link_tickets(audits, _decode)
    counts = account([{**_chat("c3"), "accepted": False}, _chat("c4")], audits, tickets)
    assert (counts["duplicated"], counts["completed_once"], counts["refused"]) == (1, 1, 1), counts
    assert counts["redis"]["duplicated_unlinked"] == ["j-a"]
