"""Ledger rows with exact numbers for the operator-view tests: runs, items in any state,
registered servers and pause/resume events, written straight into the tables."""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, insert, update

from app.core.contracts import SamplingParams
from app.ledger import common, reads, registry, run_queries


def make_run(conn: Connection, name: str, *, max_new_tokens: int = 512) -> run_queries.RunInfo:
    info, _ = run_queries.get_or_create_run(
        conn,
        run_queries.RunSpec(
            name=name,
            tokenizer_path="/models/fixture",
            tokenizer_hash="a" * 64,
            chat_template_hash="b" * 64,
            chat_template_kwargs={},
            sampling=SamplingParams(max_new_tokens=max_new_tokens, seed=1),
            samples_per_prompt=1,
            think_end_id=163607,
            eos_token_ids=[163586],
        ),
    )
    return info


def add_item(
    conn: Connection,
    run_id: int,
    key: str,
    *,
    status: str = "done",
    server: str | None = "gpu-a",
    prompt_tokens: int = 10,
    completion_tokens: int | None = None,
    finish_reason: str | None = None,
    latency_s: float | None = None,
    started_at: datetime | None = None,
    finished_at: datetime | None = None,
    error: str | None = None,
) -> None:
    """One item; a done item defaults to finish_reason stop, a failed one to no tokens."""
    done = status == "done"
    values: dict[str, Any] = {
        "run_id": run_id,
        "item_key": key,
        "sample_index": 0,
        "prompt_ids": [1] * prompt_tokens,
        "prompt_tokens": prompt_tokens,
        "status": status,
        "attempts": 1 if status in ("done", "failed", "leased") else 0,
        "server": server if status != "pending" else None,
        "created_at": (started_at or finished_at or common.utcnow()) - timedelta(seconds=1),
        "started_at": started_at,
        "finished_at": finished_at,
        "error": error,
    }
    if status == "leased":
        values["lease_owner"] = f"{server}-worker"
        values["lease_expires_at"] = common.utcnow() + timedelta(hours=1)
    if done:
        values["output_ids"] = [2] * (completion_tokens or 0)
        values["completion_tokens"] = completion_tokens or 0
        values["finish_reason"] = finish_reason or "stop"
        values["latency_s"] = latency_s
    conn.execute(insert(common.items).values(**values))


def add_server(
    conn: Connection,
    name: str,
    *,
    state: str = "healthy",
    paused_by: str | None = None,
    workers: list[str] | None = None,
    probe_at: datetime | None = None,
    probe_ok: bool = True,
    error: str | None = None,
) -> None:
    registry.upsert_server(conn, name, f"http://{name}:30000")
    if workers:
        registry.set_workers(conn, name, workers)
    if paused_by:
        registry.set_paused(conn, name, True, by=paused_by, reason="test")
    if probe_at is not None or error is not None or state != "unknown":
        registry.record_probe(
            conn,
            name,
            state=state,
            failures=0 if probe_ok else 3,
            successes=2 if probe_ok else 0,
            ok=probe_ok,
            latency_s=0.05,
            error=error,
        )
        if probe_at is not None:
            conn.execute(
                update(common.servers)
                .where(common.servers.c.name == name)
                .values(last_probe_at=probe_at)
            )


def add_event(
    conn: Connection, kind: str, server: str | None, at: datetime, message: str | None = None
) -> None:
    conn.execute(
        insert(common.events).values(
            at=at, kind=kind, server=server, message=message or f"{server} {kind}", run_id=None
        )
    )


def _ago(now: datetime, seconds: float) -> datetime:
    return now - timedelta(seconds=seconds)


def seed_fleet(conn: Connection, now: datetime) -> None:
    """r1: 10 items (5 done, one truncated; 1 failed; 3 leased; 1 pending); r2: 1 done.
    gpu-a is registered and paused by the operator, gpu-b is down, gpu-c only appears on
    a lease (an embedded `tokenmill run` does not register its servers)."""
    r1 = make_run(conn, "r1")
    for key, age, tokens, latency in (
        ("a1", 10, 100, 1.0),
        ("a2", 20, 200, 2.0),
        ("a3", 30, 300, 3.0),
        ("a4", 90, 400, 4.0),  # outside the one-minute window
    ):
        add_item(
            conn,
            r1.id,
            key,
            server="gpu-a",
            completion_tokens=tokens,
            latency_s=latency,
            started_at=_ago(now, age + latency),
            finished_at=_ago(now, age),
        )
    add_item(
        conn,
        r1.id,
        "b1",
        server="gpu-b",
        completion_tokens=512,
        finish_reason="length",
        latency_s=10.0,
        finished_at=_ago(now, 5),
    )
    add_item(
        conn, r1.id, "b2", status="failed", server="gpu-b", finished_at=_ago(now, 40), error="400"
    )
    add_item(conn, r1.id, "l1", status="leased", server="gpu-a", started_at=_ago(now, 3))
    add_item(conn, r1.id, "l2", status="leased", server="gpu-a", started_at=_ago(now, 2))
    add_item(conn, r1.id, "l3", status="leased", server="gpu-c", started_at=_ago(now, 1))
    add_item(conn, r1.id, "p1", status="pending")
    r2 = make_run(conn, "r2")
    add_item(
        conn,
        r2.id,
        "x1",
        server="gpu-a",
        completion_tokens=50,
        latency_s=0.5,
        finished_at=_ago(now, 15),
    )
    add_server(
        conn, "gpu-a", paused_by="operator", workers=["w1@h", "w2@h"], probe_at=_ago(now, 12)
    )
    add_server(
        conn,
        "gpu-b",
        state="down",
        probe_ok=False,
        probe_at=_ago(now, 3),
        error="connection refused\nsecond line",
    )
    for i in range(10):
        add_event(conn, "state", "gpu-b", _ago(now, 100 - i), f"gpu-b event {i}")
    add_event(conn, "paused", "gpu-a", _ago(now, 50), "gpu-a paused by operator: maintenance")


def seed_report_run(conn: Connection, start: datetime, *, items_per_server: int = 300) -> None:
    """Run "rep" (max_new_tokens 2048): 20 minutes of work on gpu-a and gpu-b with heavy-tailed
    output lengths, truncations, a few failures, and gpu-b paused from minute 8 to minute 12
    (nothing of it finishes then); gpu-a is paused at minute 18 and never resumed."""
    rng = random.Random(7)
    run = make_run(conn, "rep", max_new_tokens=2048)
    span_s = 20 * 60.0
    pause = (8 * 60.0, 12 * 60.0)
    n = 0
    for server in ("gpu-a", "gpu-b"):
        for i in range(items_per_server):
            offset = span_s * (i + rng.random()) / items_per_server
            if server == "gpu-b" and pause[0] <= offset < pause[1]:
                offset = pause[1] + (offset - pause[0]) / 4  # it catches up after the pause
            if server == "gpu-a" and offset >= 18 * 60:
                offset = 18 * 60 - rng.random() * 30
            prompt = int(rng.lognormvariate(5, 0.8)) + 1
            length = int(rng.lognormvariate(6, 1.0)) + 1
            latency = 0.4 + length / (90.0 if server == "gpu-a" else 60.0)
            n += 1
            key = f"{server}-{i}"
            finished = start + timedelta(seconds=offset)
            if n % 97 == 0:
                add_item(
                    conn,
                    run.id,
                    key,
                    status="failed",
                    server=server,
                    prompt_tokens=prompt,
                    finished_at=finished,
                    error="HTTP 400: the prompt is longer than the context length"
                    if n % 2
                    else "retries exhausted: read timeout",
                )
                continue
            truncated = length >= 2048
            add_item(
                conn,
                run.id,
                key,
                server=server,
                prompt_tokens=prompt,
                completion_tokens=min(length, 2048),
                finish_reason="length" if truncated else "stop",
                latency_s=latency,
                started_at=finished - timedelta(seconds=latency),
                finished_at=finished,
            )
    add_event(conn, "paused", "gpu-b", start + timedelta(seconds=pause[0]))
    add_event(conn, "state", "gpu-b", start + timedelta(seconds=pause[0] + 5))
    add_event(conn, "resumed", "gpu-b", start + timedelta(seconds=pause[1]))
    add_event(conn, "paused", "gpu-a", start + timedelta(seconds=18 * 60))


def make_counts(**counts: int) -> reads.RunCounts:
    """RunCounts of run "r" with the given numbers and zero elsewhere."""
    fields = ("total", "pending", "queued", "leased", "done", "failed", "truncated")
    values = {name: counts.get(name, 0) for name in fields}
    return reads.RunCounts(run="r", output_tokens=0, prompt_tokens=0, **values)
