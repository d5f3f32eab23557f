"""The accounting of `tandem bench chaos`, pure: it reads the evidence a run leaves (what each
client saw, and what Redis holds for each job) and counts outcomes. No processes, no HTTP, no
Redis connection: benchmarks/chaos.py gathers the evidence, tests/test_bench_chaos.py hands
these functions records made by hand.

The evidence

    request   one client call, as a dict (`dataclasses.asdict` of benchmarks.chaos.Op): `id`
              (its ticket, "c12" for a chat, "j7" for a job, "d3" for a detect), `kind`,
              `accepted`, `done`, `dropped`, `error`, `job_id` (jobs only: chats are linked to
              their job by `tickets`), `text` (a chat's streamed text), `indices` ((index, number
              of tokens) of every token event a job's client received), `token_ids` (the tokens
              it received), `result_token_ids` (those of GET /v1/jobs/{id}), `start`, `end`,
              `ttft` (seconds from the start of the load)
    audit     one job in Redis, from `audit_job`: its record (HGETALL), its event stream and its
              end stream (XRANGE), as Redis holds them (every field a string)

The terms, exactly as `classify` and `account` apply them

    accepted     the server acknowledged the request before doing it: a job's POST /v1/jobs
                 answered 202; a chat's streamed POST answered 200 (its stream began). A detect
                 has no acknowledgment before its answer: it is accepted when it answered 200
                 with a record of boxes and no error, so its error answers are refusals, and an
                 accepted detect is completed exactly once (no job of it stays in Redis to check).
                 Every other request is `refused` and has no outcome below.

    Each accepted request has exactly one outcome, the first of these that applies:

    dropped      a chat whose stream the bench itself closed mid-stream (a `drop` fault); its
                 job is not checked.
    duplicated   its job's audit shows work done or delivered twice: more than one entry in its
                 end stream (two final results), more than one final event (done, failed,
                 cancelled) in its event stream, or a token event whose index is below the
                 tokens already streamed; or its client received a token index below the
                 tokens it had already received (a resumed SSE stream that replayed); or a chat
                 received more text than its job's result holds. attempts > 1 alone is no
                 duplicate: that is a job resumed on another worker.
    lost         accepted and never completed: its client ended without a final answer or
                 recorded an error (a stream broken without [DONE], an error chunk, no final
                 event by the end of the drain, a job that ended failed or cancelled); or a
                 job's record is not in Redis; or its job's state is not done.
    unverified   a chat that completed but whose ticket no job in Redis carries, so nothing can
                 be compared.
    mismatched   completed, but what was delivered differs from the job's result: its event
                 stream skipped a token index (a gap) or streamed other token ids than its
                 result's; a job's client received other token ids than the result's, or GET
                 /v1/jobs/{id} answered other token ids; a chat's text is not its job's result's.
    completed exactly once (`completed_once`)
                 none of the above: accepted, its job done with one final result and at most
                 one final event, no token index delivered twice in Redis or to its client, and
                 what its client received equal to that result.

`account`'s `duplicated` also counts every job in Redis with duplicate evidence that no accepted
request accounts for (a refused submit that Redis recorded, or the job of a chat the bench
dropped): a duplicate anywhere counts.
"""

from __future__ import annotations

import json
import re

from benchmarks.common import percentile

KINDS = ("chat", "job", "detect")
FINAL = ("done", "failed", "cancelled")
OUTCOMES = ("completed_once", "lost", "duplicated", "mismatched", "dropped", "unverified")
TICKET = re.compile(r"\(ticket ([cj]\d+)\)")


def ticket(request_id: str) -> str:
    """The text a chat's or a job's prompt carries, so its job can be found in Redis."""
    return f"(ticket {request_id})"


def audit_job(job_id: str, record: dict, events: list[tuple[str, dict]], ends: list[tuple[str, dict]]) -> dict:
    """One job's evidence from Redis: its record (HGETALL), its event stream and its end stream
    (XRANGE entries of string fields, as Redis holds them)."""
    tokens, repeated, gaps, expected = [], 0, 0, 0
    finals = 0
    for _, f in events:
        kind = f.get("type")
        if kind in FINAL:
            finals += 1
        if kind != "token":
            continue
        index, ids = int(f.get("index", 0)), json.loads(f.get("token_ids") or "[]")
        if index < expected:
            repeated += 1  # these tokens were streamed already
            ids = ids[expected - index :]
        elif index > expected:
            gaps += 1
        tokens.extend(ids)
        expected = max(expected, index + len(json.loads(f.get("token_ids") or "[]")))
    result = None
    if ends and ends[0][1].get("result"):
        result = json.loads(ends[0][1]["result"])
    duplicate = []
    if len(ends) > 1:
        duplicate.append(f"{len(ends)} final results")
    if finals > 1:
        duplicate.append(f"{finals} final events")
    if repeated:
        duplicate.append(f"{repeated} token events repeat indices")
    mismatch = ""
    if gaps:
        mismatch = f"{gaps} gaps in the token indices"
    elif result is not None and "token_ids" in result and result["token_ids"] != tokens:
        mismatch = "the result's token ids differ from its stream"
    prompt = record.get("prompt_token_ids")
    return {
        "job_id": job_id,
        "task": record.get("task", ""),
        "state": record.get("state") or "missing",
        "attempts": int(record.get("attempt") or 0),
        "num_results": len(ends),
        "num_final_events": finals,
        "duplicate": duplicate,
        "mismatch": mismatch,
        "stream_token_ids": tokens,
        "result": result,
        "prompt_token_ids": json.loads(prompt) if prompt else None,
    }


def classify(op: dict, audit: dict | None) -> tuple[str, str]:
    """(outcome, why) of one accepted request: dropped, duplicated, lost, mismatched,
    unverified or completed_once (the first that applies)."""
    if op["kind"] == "chat" and op["dropped"]:
        return "dropped", "the bench closed the stream"
    if audit is not None and audit["duplicate"]:
        return "duplicated", "; ".join(audit["duplicate"])
    indices, seen = op.get("indices") or [], 0
    for index, n in indices:
        if index < seen:
            return "duplicated", f"the client received index {index} again"
        seen = max(seen, index + n)
    if op["kind"] == "detect":
        return "completed_once", ""
    if op["kind"] == "chat" and audit is not None and audit["result"] is not None:
        if len(op["text"]) > len(audit["result"].get("text", "")):
            return "duplicated", "the chat received more text than its job made"
    if not op["done"] or op["error"]:
        return "lost", op["error"] or "never completed"
    if audit is None:
        return ("lost", "no job record") if op["kind"] == "job" else ("unverified", "no job found for its ticket")
    if audit["state"] != "done":
        return "lost", f"its job ended {audit['state']}"
    if audit["mismatch"]:
        return "mismatched", audit["mismatch"]
    result = audit["result"] or {}
    if op["kind"] == "job" and op["token_ids"] != result.get("token_ids"):
        return "mismatched", "the client's streamed tokens differ from the result"
    if op["kind"] == "job" and op["result_token_ids"] != result.get("token_ids"):
        return "mismatched", "GET /v1/jobs/{id} answered another result"
    if op["kind"] == "chat" and op["text"] != result.get("text"):
        return "mismatched", "the chat's text differs from its job's result"
    return "completed_once", ""


def ticket_of(audit: dict, decode) -> str | None:
    if not audit.get("prompt_token_ids"):
        return None
    m = TICKET.search(decode(audit["prompt_token_ids"]))
    return m.group(1) if m else None


def account(ops: list[dict], audits: dict[str, dict], tickets: dict[str, str]) -> dict:
    """The report's counts. `audits`: job id -> audit_job(...) of every job in Redis;
    `tickets`: request id -> job id (chats are linked by the ticket in their prompt)."""
    outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
    details, linked = [], set()
    for op in ops:
        if not op["accepted"]:
            continue
        job_id = op["job_id"] or tickets.get(op["id"])
        outcome, why = classify(op, audits.get(job_id) if job_id else None)
        if outcome != "dropped":  # a dropped chat's job is still audited below: a duplicate anywhere counts
            linked.add(job_id)
        outcomes[outcome] += 1
        if outcome not in ("completed_once", "dropped"):
            details.append({"request": op["id"], "job_id": job_id, "outcome": outcome, "why": why})
    # Jobs no accepted request accounts for (a refused submit that Redis recorded, a chat the
    # bench dropped) are checked too: a duplicate anywhere counts.
    dup_jobs = sorted(j for j, a in audits.items() if a["duplicate"] and j not in linked)
    unfinished = sorted(j for j, a in audits.items() if a["state"] not in FINAL)
    states: dict[str, int] = {}
    for a in audits.values():
        states[a["state"]] = states.get(a["state"], 0) + 1
    return {
        "accepted": sum(op["accepted"] for op in ops),
        "accepted_by_kind": {k: sum(op["accepted"] and op["kind"] == k for op in ops) for k in KINDS},
        **outcomes,
        "duplicated": outcomes["duplicated"] + len(dup_jobs),
        "requests": len(ops),
        "refused": sum(not op["accepted"] for op in ops),
        "details": details[:50],
        "redis": {
            "jobs": len(audits),
            "states": states,
            "resumed": sum(a["attempts"] > 1 for a in audits.values()),
            "unfinished": unfinished[:50],
            "duplicated_unlinked": dup_jobs[:50],
            # what each one's audit found (final results, final events, repeated token indices)
            "duplicated_unlinked_why": {j: "; ".join(audits[j]["duplicate"]) for j in dup_jobs[:50]},
        },
    }


def latency_table(ops: list[dict], faults: list[dict]) -> dict:
    """p50/p99 of end-to-end latency (and chats' TTFT) by phase: before the first fault, from
    the first to the last (during), after the last."""
    times = [f["t"] for f in faults if f.get("t") is not None]
    first, last = (min(times), max(times)) if times else (float("inf"), float("inf"))

    def phase(t: float) -> str:
        return "before" if t < first else "during" if t <= last else "after"

    table: dict = {}
    for name in ("before", "during", "after"):
        done = [op for op in ops if op["done"] and not op["error"] and phase(op["start"]) == name]
        row = {"n": len(done)}
        for kind in (*KINDS, "all"):
            e2e = [op["end"] - op["start"] for op in done if kind in ("all", op["kind"])]
            row[kind] = {"n": len(e2e), "p50_ms": 1000 * percentile(e2e, 50), "p99_ms": 1000 * percentile(e2e, 99)}
        ttft = [op["ttft"] for op in done if op["kind"] == "chat" and op["ttft"] is not None]
        row["chat_ttft"] = {"p50_ms": 1000 * percentile(ttft, 50), "p99_ms": 1000 * percentile(ttft, 99)}
        table[name] = row
    return table


def without_a_live_worker(samples: list[tuple[float, int, int]]) -> dict:
    """The longest stretch in which `tandem serve` saw no live worker, from the bench's samples
    (t, worker processes alive, /health's live workers; -1 when /health could not say, Redis
    being down). A stretch opens at a sample that sees 0 workers and closes at the next that
    sees one; samples that could not say, inside a stretch, extend it (no worker was seen), but
    alone they open none (a Redis restart with the workers registered is not a fleet without
    workers). One still open at the last sample ends there."""
    longest = {"seconds": 0.0, "from": None, "to": None}
    start = None
    for t, _, seen in samples:
        if seen == 0 and start is None:
            start = t
        elif seen > 0 and start is not None:
            if t - start > longest["seconds"]:
                longest = {"seconds": round(t - start, 2), "from": start, "to": t}
            start = None
    if start is not None and samples and samples[-1][0] - start > longest["seconds"]:
        longest = {"seconds": round(samples[-1][0] - start, 2), "from": start, "to": samples[-1][0]}
    return longest


def load_seconds(log_text: str) -> list[float]:
    """Each model load a worker's log reports ("runtime ready in X s")."""
    return [float(x) for x in re.findall(r"runtime ready in ([0-9.]+) s", log_text)]
