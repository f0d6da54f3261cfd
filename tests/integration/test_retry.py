"""Failed items on the real ledger: their reasons as stored, counted by reason (status, verify),
retried by reason, server and time (fresh attempts, never a done item, chains resumed from the
retried turn), and the item_failed events of a worker summed per reason."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import Connection, Engine, select, update

from app.core.constants import EVENT_ITEM_FAILED
from app.core.failures import failure_reason
from app.ledger import common, outcomes, queue, reads, registry, retries, run_queries, turns
from app.outputs.verify import verify_run
from tests.support.runs import add_item, make_run
from workers.engine.failure_digest import FailureDigest

TOO_LONG = (
    "permanent: HTTP 400: The input ({n} tokens) is longer than the model's context length "
    "(4096 tokens)."
)
MISSING = "permanent: image images/{sha}.png is missing from file:///srv/a/.tokenmill/storage"


def fail(conn: Connection, item_id: int, error: str, *, server: str | None = None) -> None:
    """An item failed as a worker records it (through record_outcomes)."""
    values = {"status": "leased", "started_at": common.utcnow()}
    if server is not None:
        values["server"] = server
    conn.execute(update(common.items).where(common.items.c.id == item_id).values(**values))
    outcomes.record_outcomes(conn, [outcomes.Failed(item_id, error)], owner="w", lease_s=30)


def ids_by_key(conn: Connection, run_id: int) -> dict[str, int]:
    rows = conn.execute(
        select(common.items.c.item_key, common.items.c.id).where(common.items.c.run_id == run_id)
    )
    return {str(k): int(i) for k, i in rows}


def row(conn: Connection, item_id: int) -> dict[str, object]:
    return dict(
        conn.execute(select(common.items).where(common.items.c.id == item_id)).one()._mapping
    )


def seed(db: Engine) -> tuple[int, dict[str, int]]:
    """Run r: 3 done, 4 failed on a too-long prompt (gpu-a), 2 on a missing image (gpu-b)."""
    with db.begin() as conn:
        run = make_run(conn, "r")
        for i in range(3):
            add_item(conn, run.id, f"done{i}", completion_tokens=5)
        for i in range(6):
            add_item(conn, run.id, f"bad{i}", status="pending")
        ids = ids_by_key(conn, run.id)
        for i in range(4):
            fail(conn, ids[f"bad{i}"], TOO_LONG.format(n=5000 + i), server="gpu-a")
        for i in (4, 5):
            fail(conn, ids[f"bad{i}"], MISSING.format(sha=f"{i:02x}" * 32), server="gpu-b")
    return run.id, ids


def test_items_of_one_cause_share_a_reason_and_are_counted_by_it(pg_engine: Engine) -> None:
    run_id, ids = seed(pg_engine)
    with pg_engine.connect() as conn:
        stored = row(conn, ids["bad0"])
        by_reason = retries.failed_by_reason(conn, run_id)
    assert stored["error"] == TOO_LONG.format(n=5000)
    too_long = (
        "HTTP 400: The input (N tokens) is longer than the model's context length (N tokens)."
    )
    assert stored["fail_reason"] == too_long
    missing = "image images/….png is missing from file:///srv/a/.tokenmill/storage"
    assert by_reason == [(too_long, 4), (missing, 2)]


def test_verify_names_the_failed_items_by_reason_and_is_not_clean(pg_engine: Engine) -> None:
    run_id, _ = seed(pg_engine)
    with pg_engine.connect() as conn:
        run = run_queries.get_run_by_id(conn, run_id)
    report = verify_run(pg_engine, run, None)
    assert not report.clean
    assert report.failed_items == 6
    data = report.to_json()
    assert data["clean"] is False
    assert data["failed"]["items"] == 6
    assert sorted(data["failed"]["by_reason"].values()) == [2, 4]


def test_retry_by_reason_requeues_those_with_fresh_attempts_and_no_done_item(
    pg_engine: Engine,
) -> None:
    run_id, ids = seed(pg_engine)
    with pg_engine.connect() as conn:
        before_done = {k: row(conn, i) for k, i in ids.items() if k.startswith("done")}
        dry = retries.plan_retry(conn, run_id, retries.RetrySelection(reason="CONTEXT LENGTH"))
    assert sorted(dry.pending) == sorted(ids[f"bad{i}"] for i in range(4))
    assert dry.to_json()["by_reason"] == {
        "HTTP 400: The input (N tokens) is longer than the model's context length (N tokens).": 4
    }
    with pg_engine.begin() as conn:
        done = retries.apply_retry(conn, dry)
        again = retries.apply_retry(conn, dry)  # a second retry at once takes nothing twice
    assert done.retried == 4 and again.retried == 0
    with pg_engine.connect() as conn:
        for i in range(4):
            r = row(conn, ids[f"bad{i}"])
            assert (r["status"], r["attempts"], r["error"], r["fail_reason"]) == (
                "pending",
                0,
                None,
                None,
            )
            assert r["server"] is None and r["finished_at"] is None
        assert row(conn, ids["bad4"])["status"] == "failed"
        assert {k: row(conn, i) for k, i in ids.items() if k.startswith("done")} == before_done
        counts = reads.run_counts(conn, run_queries.get_run_by_id(conn, run_id))
        # the counters follow the change (the triggers), and the pending ones are published
        assert (counts.done, counts.failed, counts.pending) == (3, 2, 4)
        assert sorted(queue.pending_ids(conn, run_id)) == sorted(done.pending)


def test_retry_by_server_and_time(pg_engine: Engine) -> None:
    run_id, ids = seed(pg_engine)
    with pg_engine.begin() as conn:
        old = common.utcnow() - timedelta(hours=3)
        conn.execute(
            update(common.items).where(common.items.c.id == ids["bad0"]).values(finished_at=old)
        )
        by_server = retries.plan_retry(conn, run_id, retries.RetrySelection(server="gpu-b"))
        since = retries.plan_retry(
            conn, run_id, retries.RetrySelection(since=common.utcnow() - timedelta(hours=1))
        )
    assert sorted(by_server.pending) == [ids["bad4"], ids["bad5"]]
    assert ids["bad0"] not in since.pending and len(since.pending) == 5


def chain(conn: Connection, run_id: int, key: str, turns_n: int = 3) -> list[int]:
    """A `--turns all` chain of key: turn 0 pending with a prompt, the later turns waiting."""
    new = [queue.NewItem(key, 0, 1, [{"role": "user", "content": "q0"}], [1, 2, 3])]
    new += [
        queue.NewItem(
            key, 0, 1, [{"role": "user", "content": f"q{t}"}], [], turn_index=t, waiting=True
        )
        for t in range(1, turns_n)
    ]
    queue.insert_items(conn, run_id, new)
    turns.link_turns(conn, run_id, [key])
    stmt = select(common.items.c.id).where(
        common.items.c.run_id == run_id, common.items.c.item_key == key
    )
    return list(conn.execute(stmt.order_by(common.items.c.turn_index)).scalars())


def finish_done(conn: Connection, item_id: int, finish_reason: str = "stop") -> None:
    conn.execute(
        update(common.items)
        .where(common.items.c.id == item_id)
        .values(
            status="done",
            finish_reason=finish_reason,
            output_ids=[7, 8],
            completion_tokens=2,
            started_at=common.utcnow(),
            finished_at=common.utcnow(),
        )
    )


def statuses(conn: Connection, ids: list[int]) -> list[str]:
    return [str(row(conn, i)["status"]) for i in ids]


def test_a_chain_resumes_from_the_retried_turn(pg_engine: Engine) -> None:
    with pg_engine.begin() as conn:
        run = make_run(conn, "chains")
        # a: turn 0 failed at the server, its later turns failed with it
        a = chain(conn, run.id, "a")
        fail(conn, a[0], "permanent: HTTP 400: bad request")
        turns.fail_waiting_chain(conn, run.id, "a", 0, 1, "turn 0 failed: permanent: HTTP 400")
        # b: turn 0 done, turn 1 failed at the server, turn 2 failed with it
        b = chain(conn, run.id, "b")
        finish_done(conn, b[0])
        conn.execute(update(common.items).where(common.items.c.id == b[1]).values(status="pending"))
        fail(conn, b[1], "permanent: HTTP 400: bad request")
        turns.fail_waiting_chain(conn, run.id, "b", 0, 2, "turn 1 failed: permanent: HTTP 400")
        # c: turn 0 done, turn 1 failed as its prompt was built (never sent)
        c = chain(conn, run.id, "c")
        finish_done(conn, c[0])
        turns.fail_waiting_chain(conn, run.id, "c", 0, 1, "turn 1: prompt has 9000 tokens")
        # d: turn 0 truncated (done), so its chain failed: retrying cannot help
        d = chain(conn, run.id, "d")
        finish_done(conn, d[0], "length")
        turns.fail_waiting_chain(conn, run.id, "d", 0, 1, "turn 0 was truncated at max_new_tokens")
        plan = retries.apply_retry(conn, retries.plan_retry(conn, run.id, retries.RetrySelection()))
        assert statuses(conn, a) == ["pending", "waiting", "waiting"]
        assert statuses(conn, b) == ["done", "pending", "waiting"]
        assert statuses(conn, c) == ["done", "waiting", "waiting"]
        assert statuses(conn, d) == ["done", "failed", "failed"]
    assert sorted(plan.pending) == [a[0], b[1]]
    assert plan.waiting == [c[1]]
    assert sorted(plan.followers) == sorted([a[1], a[2], b[2], c[2]])
    assert plan.skipped == {retries.SKIP_TRUNCATED: 2}  # d's turns 1 and 2
    with pg_engine.connect() as conn:
        # the retried later turn that never had a prompt is ready for the advancer again
        ready = turns.ready_turns(conn, run_id=run.id)
    assert [t.id for t in ready] == [c[1]]


def failed_items(db: Engine, run_id: int, n: int, error: str) -> list[int]:
    """n items of the run, failed with error as a worker records them; their ids."""
    with db.begin() as conn:
        keys = [f"k{run_id}-{len(ids_by_key(conn, run_id)) + i}" for i in range(n)]
        for key in keys:
            add_item(conn, run_id, key, status="pending")
        ids = ids_by_key(conn, run_id)
        for key in keys:
            fail(conn, ids[key], error)
    return [ids[k] for k in keys]


def test_a_workers_failures_are_one_event_per_reason_and_interval(pg_engine: Engine) -> None:
    now = [0.0]
    with pg_engine.begin() as conn:
        run = make_run(conn, "digest")
    too_long = failed_items(pg_engine, run.id, 199, TOO_LONG.format(n=5001))
    (missing,) = failed_items(pg_engine, run.id, 1, MISSING.format(sha="ab" * 32))
    (later,) = failed_items(pg_engine, run.id, 1, TOO_LONG.format(n=7000))
    digest = FailureDigest(pg_engine, "gpu-a", interval_s=60.0, clock=lambda: now[0])
    digest.add(run.id, too_long[0], TOO_LONG.format(n=5001))
    for i in too_long[1:]:
        digest.add(run.id, i, TOO_LONG.format(n=5000 + i))
    digest.add(run.id, missing, MISSING.format(sha="ab" * 32))
    now[0] = 30.0
    digest.flush()  # the interval is not over: nothing more
    with pg_engine.connect() as conn:
        first = registry.list_events(conn, run_id=run.id)
    assert [(e.kind, e.details and e.details["count"]) for e in first] == [
        (EVENT_ITEM_FAILED, 1),
        (EVENT_ITEM_FAILED, 1),
    ]
    assert f"item {too_long[0]} of run digest " in first[0].message
    assert "5001 tokens" in first[0].message
    now[0] = 61.0
    digest.flush()
    now[0] = 200.0
    digest.flush()  # quiet for an interval: forgotten, so the next one is reported at once
    digest.add(run.id, later, TOO_LONG.format(n=7000))
    with pg_engine.connect() as conn:
        events = registry.list_events(conn, run_id=run.id)
    summed = [e for e in events if e.details and e.details["count"] > 1]
    assert len(events) == 4 and len(summed) == 1
    assert summed[0].details is not None
    assert summed[0].details["count"] == 198
    assert summed[0].details["reason"] == failure_reason(TOO_LONG.format(n=1))
    assert summed[0].message.startswith("198 more items of run digest failed on gpu-a")
    assert f"item {later} of run digest" in events[-1].message


def test_a_digest_counts_only_the_failures_no_retry_put_back(pg_engine: Engine) -> None:
    """A sum reported after `tokenmill retry` names the items still failed; none left, none."""
    now = [0.0]
    with pg_engine.begin() as conn:
        run = make_run(conn, "agents")
    first, *rest = failed_items(pg_engine, run.id, 244, TOO_LONG.format(n=5001))
    digest = FailureDigest(pg_engine, "gpu-a", interval_s=30.0, clock=lambda: now[0])
    for i in [first, *rest]:
        digest.add(run.id, i, TOO_LONG.format(n=5001))
    with pg_engine.begin() as conn:  # the operator retries them all
        retries.apply_retry(conn, retries.plan_retry(conn, run.id, retries.RetrySelection()))
    now[0] = 31.0
    digest.flush()
    with pg_engine.connect() as conn:
        events = registry.list_events(conn, run_id=run.id)
    assert [e.details and e.details["count"] for e in events] == [1]  # the first, at once
    assert events[0].message.startswith(f"item {first} of run agents failed on gpu-a")
    # failures of the next interval, some of them retried before it is reported
    again = failed_items(pg_engine, run.id, 10, TOO_LONG.format(n=5001))
    for i in again:
        digest.add(run.id, i, TOO_LONG.format(n=5001))
    with pg_engine.begin() as conn:
        retries.apply_retry(conn, retries.plan_retry(conn, run.id, retries.RetrySelection()))
    for i in again[:3]:
        with pg_engine.begin() as conn:
            fail(conn, i, TOO_LONG.format(n=5001))
    now[0] = 62.0
    digest.flush()
    with pg_engine.connect() as conn:
        events = registry.list_events(conn, run_id=run.id)
    assert len(events) == 2
    assert events[-1].message.startswith("3 more items of run agents failed on gpu-a")
    assert events[-1].details is not None and events[-1].details["items"] == again[:3]
