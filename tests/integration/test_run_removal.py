"""A run deleted from the ledger (`tokenmill delete`'s queries), the leases of a dead
`tokenmill run` taken back by its rerun (SQLite and Postgres), and the error of a broker that
fails mid-enqueue, which says how many items wait unpublished."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from sqlalchemy import Connection, Engine, Table, func, insert, select, update

from app.ledger import common, counters, event_log, reads, registry, removal, run_queries
from tests.support.runs import add_item, add_server, make_run
from workers.engine.orphans import EMBEDDED_OWNER_PREFIX, take_back


def _count(conn: Connection, table: Table, run_id: int) -> int:
    stmt = select(func.count()).select_from(table).where(table.c.run_id == run_id)
    return int(conn.execute(stmt).scalar_one())


def test_a_deleted_run_leaves_nothing_and_touches_no_other_run(db: Engine) -> None:
    with db.begin() as conn:
        gone = make_run(conn, "gone")
        kept = make_run(conn, "kept")
        for i in range(12):
            add_item(conn, gone.id, f"g{i}", completion_tokens=3)
        add_item(conn, kept.id, "k0", completion_tokens=3)
        conn.execute(insert(common.tool_sets).values(run_id=gone.id, tools_hash="t" * 64, tools=[]))
        event_log.record_event(conn, "enqueued", "twelve items", run_id=gone.id)
        event_log.record_event(conn, "enqueued", "one item", run_id=kept.id)
        add_server(conn, "gpu-a")
        registry.record_parity(conn, "gpu-a", "gone", {"status": "equal"})
        registry.record_parity(conn, "gpu-a", "kept", {"status": "differs"})
    deleted = 0
    while True:
        with db.begin() as conn:
            page = removal.delete_items_page(conn, gone.id, limit=5)  # pages of 5, 5, 2
        if not page:
            break
        deleted += page
    with db.begin() as conn:
        removal.delete_run_row(conn, gone.id, gone.name)
    assert deleted == 12
    with db.connect() as conn:
        assert [r.name for r in run_queries.list_runs(conn)] == ["kept"]
        for table in (common.items, common.events, common.tool_sets, counters.item_counts):
            assert _count(conn, table, gone.id) == 0, table
        assert _count(conn, common.items, kept.id) == 1
        assert _count(conn, common.events, kept.id) == 1
        assert reads.run_counts(conn, kept).done == 1
        parity = conn.execute(select(common.servers.c.parity)).scalar_one()
        assert parity == {"kept": {"status": "differs"}}


def test_a_rerun_takes_back_only_its_dead_predecessor_s_leases(db: Engine) -> None:
    here = socket.gethostname()
    dead = f"{here}:{_dead_pid()}:{EMBEDDED_OWNER_PREFIX}127.0.0.1:30000:aaaa"
    alive = f"{here}:{os.getppid()}:{EMBEDDED_OWNER_PREFIX}127.0.0.1:30000:bbbb"
    worker = f"{here}:{_dead_pid()}:gpu-a:cccc"  # a Celery worker's: its lease expires
    with db.begin() as conn:
        run = make_run(conn, "r")
        for i, owner in enumerate([dead, dead, alive, worker]):
            add_item(conn, run.id, f"k{i}", status="leased")
            conn.execute(
                update(common.items)
                .where(common.items.c.item_key == f"k{i}")
                .values(lease_owner=owner, hedge_owner=dead if i == 2 else None)
            )
    taken = take_back(db, run.id)
    assert taken.items == 2 and len(taken.pids) == 1
    with db.connect() as conn:
        rows = conn.execute(
            select(
                common.items.c.item_key,
                common.items.c.status,
                common.items.c.lease_owner,
                common.items.c.hedge_owner,
                common.items.c.attempts,
            ).order_by(common.items.c.item_key)
        ).all()
        counts = reads.run_counts(conn, run)
    assert [(r.item_key, r.status, r.lease_owner) for r in rows] == [
        ("k0", "queued", None),
        ("k1", "queued", None),
        ("k2", "leased", alive),
        ("k3", "leased", worker),
    ]
    assert rows[2].hedge_owner is None  # the dead one's hedge mark is gone too
    assert [r.attempts for r in rows] == [1, 1, 1, 1]  # no attempt spent
    assert (counts.queued, counts.leased) == (2, 2)
    assert take_back(db, run.id).items == 0  # nothing more to take


def _dead_pid() -> int:
    """The id of a process that has exited."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(child.stdout)


def test_a_broker_that_fails_mid_enqueue_is_named_with_what_waitsunpublished_error(
    sqlite_engine: Engine,
) -> None:
    from kombu.exceptions import OperationalError

    from app.core.errors import BrokerUnavailable
    from app.core.settings import Settings
    from ops.pipeline_cmd import unpublished_error

    with sqlite_engine.begin() as conn:
        run = make_run(conn, "r")
        for i in range(3):
            add_item(conn, run.id, f"k{i}", status="pending")
    settings = Settings(broker_url="redis://:secret@127.0.0.1:1/0")
    failure = OperationalError("Error 111 connecting")
    error = unpublished_error(failure, sqlite_engine, "r", settings)
    assert isinstance(error, BrokerUnavailable)
    assert str(error) == (
        "the broker redis://:***@127.0.0.1:1/0 failed: Error 111 connecting; 3 items of run r "
        "are in the ledger but not queued: `tokenmill reconcile r` queues them once the broker "
        "answers"
    )
    other = ValueError("not the broker's")
    assert unpublished_error(other, sqlite_engine, "r", settings) is other
