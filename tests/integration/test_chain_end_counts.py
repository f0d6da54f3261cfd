"""Agentic chains' endings as counters, on SQLite and Postgres: `status` reads them in O(reasons)
and they equal a count of the ended rows through a recorded ending (once however often it is
recorded), a rollback, compaction, an interrupted and a finished archive, and a run's delete;
reconcile's catch-up finds exactly the marked done last turns with no ending; migration 0020
counts the endings already recorded and marks existing agentic runs' unended last turns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Connection, Engine, func, select, text, update

from app.core.models import chain_end_counts
from app.core.settings import Settings
from app.ledger import archive, common, counters, database, migrate, queue, reads, removal, turns
from tests.conftest import private_database
from tests.support.done_runs import make_done_run
from tests.support.runs import add_item, make_run
from workers.control.compaction import compact_run

COMPLETE, NO_CALL = "complete", "no_call"


def endings(conn: Connection, run_id: int) -> dict[str, int]:
    """What status shows, checked against a count of the rows."""
    shown = reads.chain_endings(conn, run_id)
    assert shown == reads.scanned_chain_endings(conn, run_id)
    return shown


def counted(conn: Connection, run_id: int) -> dict[str, int]:
    """The counters alone, summed over their shards, checked against a count of the rows of
    both tables (as the counters count them: a row in both counts twice)."""
    found = counters.counted_endings(conn, run_id)
    assert found == counters.scanned_endings(conn, run_id)
    return {key.chain_end: n for key, n in found.items()}


def done_ids(conn: Connection, run_id: int) -> list[int]:
    stmt = select(common.items.c.id).where(
        common.items.c.run_id == run_id, common.items.c.status == "done"
    )
    return list(conn.execute(stmt.order_by(common.items.c.id)).scalars())


def test_the_counters_follow_every_change_of_an_ending(db: Engine, tmp_path: Path) -> None:
    storage = (tmp_path / "storage").as_uri()
    settings = Settings(data_dir=tmp_path / "data", storage_url=storage, shard_rows=16)
    run = make_done_run(db, "agent", 6, extra=False)  # 12 done items
    with db.begin() as conn:
        ids = done_ids(conn, run.id)
        assert turns.record_chain_end(conn, ids[0], COMPLETE)
        assert not turns.record_chain_end(conn, ids[0], NO_CALL)  # recorded once
        assert turns.end_chain(conn, ids[1], run.id, "p0", 1, 1, NO_CALL) == 0
        assert turns.record_chain_end(conn, ids[2], COMPLETE)
    with db.begin() as conn:
        turns.record_chain_end(conn, ids[3], NO_CALL)
        conn.rollback()
    want = {COMPLETE: 2, NO_CALL: 1}
    with db.begin() as conn:
        assert endings(conn, run.id) == counted(conn, run.id) == want
        assert counters.fold_shards(conn)
        assert counted(conn, run.id) == want
    assert compact_run(db, settings, run, force=True).compacted == 12
    with db.connect() as conn:
        assert endings(conn, run.id) == counted(conn, run.id) == want

    # an archive that died with every row copied and a few deleted: the counters hold the rows
    # in both tables twice, so the read counts the rows
    with db.begin() as conn:
        archive.mark_archived(conn, run.id)
        assert archive.copy_items(conn, ids) == 12
        assert archive.delete_archived(conn, ids[:2]) == 2
        assert counted(conn, run.id) == {COMPLETE: 3, NO_CALL: 1}
        assert endings(conn, run.id) == want
    assert archive.archive_run(db, settings, run).deleted == 10
    with db.connect() as conn:
        assert endings(conn, run.id) == counted(conn, run.id) == want

    with db.begin() as conn:
        while removal.delete_items_page(conn, run.id, limit=5):
            pass
        assert endings(conn, run.id) == counted(conn, run.id) == {}
        removal.delete_run_row(conn, run.id, run.name)
        assert conn.execute(select(func.count()).select_from(chain_end_counts)).scalar_one() == 0


def test_verify_counts_finds_drifted_endings_and_repairs_them(db: Engine) -> None:
    run = make_done_run(db, "drift", 2, extra=False)
    with db.begin() as conn:
        ids = done_ids(conn, run.id)
        turns.record_chain_end(conn, ids[0], COMPLETE)
        conn.execute(
            update(chain_end_counts)
            .where(chain_end_counts.c.run_id == run.id)
            .values(chain_count=chain_end_counts.c.chain_count + 5)
        )
    drift = counters.check(db, run.id, repair_drift=True)
    assert [d.describe() for d in drift] == [
        f"run {run.id} chain ending {COMPLETE}: counters 6, items 1"
    ]
    with db.connect() as conn:
        assert counters.find_drift(conn, run.id) == []
        assert endings(conn, run.id) == counted(conn, run.id) == {COMPLETE: 1}


def test_the_catch_up_reads_the_marked_unended_last_turns_alone(db: Engine) -> None:
    with db.begin() as conn:
        run = make_run(conn, "marks")
        new = [queue.NewItem(f"k{i}", 0, i, None, [1, 2], ends_chain=i % 2 == 0) for i in range(8)]
        assert queue.insert_items(conn, run.id, new) == 8
        ids = list(
            conn.execute(
                select(common.items.c.id)
                .where(common.items.c.run_id == run.id)
                .order_by(common.items.c.id)
            ).scalars()
        )
        marked = ids[0::2]  # k0, k2, k4, k6
        assert turns.unended_last_turns(conn, run_id=run.id) == []  # none done yet
        conn.execute(
            update(common.items).where(common.items.c.id.in_(ids[:6])).values(status="done")
        )
        assert [i for i, _ in turns.unended_last_turns(conn, run_id=run.id)] == marked[:3]
        turns.record_chain_end(conn, marked[0], COMPLETE)
        assert turns.unmark_plain_chains(conn, [marked[1]]) == 1
        assert turns.unended_last_turns(conn, run_id=run.id) == [(marked[2], run.id)]
        assert turns.unended_last_turns(conn, run_id=run.id, after_id=marked[2]) == []
        assert turns.unended_last_turns(conn, prev_ids=ids) == [(marked[2], run.id)]
        assert turns.unended_last_turns(conn, prev_ids=ids[:4]) == []


def old_run(conn: Connection, name: str) -> int:
    """A run as a ledger at 0019 holds it (the columns of the time), by its id."""
    conn.execute(
        text(
            "INSERT INTO runs (name, tokenizer_path, tokenizer_hash, chat_template_hash, "
            "chat_template_kwargs, sampling_params, samples_per_prompt, eos_token_ids, "
            "created_at) VALUES (:n, '/t', 'a', 'b', '{}', '{}', 1, '[]', CURRENT_TIMESTAMP)"
        ),
        {"n": name},
    )
    return int(conn.execute(text("SELECT id FROM runs WHERE name = :n"), {"n": name}).scalar_one())


@pytest.fixture(params=["sqlite", "postgresql"])
def at_0019(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """A ledger at the revision before the chain ending counters."""
    if request.param == "sqlite":
        engine = database.make_engine(f"sqlite:///{tmp_path / 'old.sqlite3'}")
        migrate.upgrade(engine, "0019")
        yield engine
        engine.dispose()
        return
    with private_database("tokenmill_chain_ends") as url:
        engine = database.make_engine(url)
        config = migrate.alembic_config(url)
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, "0019")
        yield engine
        engine.dispose()


def _item_id(conn: Connection, run_id: int, key: str, turn: int = 0) -> int:
    stmt = select(common.items.c.id).where(
        common.items.c.run_id == run_id,
        common.items.c.item_key == key,
        common.items.c.turn_index == turn,
    )
    return int(conn.execute(stmt).scalar_one())


def test_the_migration_counts_endings_and_marks_unended_last_turns(at_0019: Engine) -> None:
    engine = at_0019
    postgres = engine.dialect.name == "postgresql"
    with engine.begin() as conn:
        agent, plain = old_run(conn, "agent"), old_run(conn, "plain")
        pins = '{"tool_call_parser": "kimi_k2"}'
        turns_all = (
            'CAST(CAST(sampling_params AS jsonb) || \'{"turns": "all"}\' AS json)'
            if postgres
            else "json_set(sampling_params, '$.turns', 'all')"
        )
        conn.execute(
            text(f"UPDATE runs SET sampling_params = {turns_all}, chat_pins = :p WHERE id = :r"),
            {"p": pins, "r": agent},
        )
        for key in ("chain", "ended", "single", "archived"):
            add_item(conn, agent, key)
        add_item(conn, plain, "plain")
        # "chain" has a second turn that builds on its first
        first = _item_id(conn, agent, "chain")
        conn.execute(
            text(
                "INSERT INTO items (run_id, item_key, sample_index, turn_index, prev_item_id, "
                "prompt_ids, prompt_tokens, status, attempts, created_at) SELECT run_id, "
                "item_key, 0, 1, id, prompt_ids, prompt_tokens, 'waiting', 0, created_at "
                "FROM items WHERE id = :i"
            ),
            {"i": first},
        )
        for key in ("ended", "archived"):
            conn.execute(
                text("UPDATE items SET chain_end = :e WHERE id = :i"),
                {"e": COMPLETE, "i": _item_id(conn, agent, key)},
            )
        # an archived ending (as 0019 archives: the same columns, then gone from items)
        moved = _item_id(conn, agent, "archived")
        columns = "id, run_id, item_key, sample_index, turn_index, prompt_ids, prompt_tokens, "
        columns += "status, attempts, created_at, chain_end"
        conn.execute(
            text(
                f"INSERT INTO items_archive ({columns}) SELECT {columns} FROM items WHERE id = :i"
            ),
            {"i": moved},
        )
        conn.execute(text("DELETE FROM items WHERE id = :i"), {"i": moved})
    migrate.upgrade(engine)
    with engine.begin() as conn:
        assert counted(conn, agent) == {COMPLETE: 2}
        assert endings(conn, agent) == {COMPLETE: 2}
        marks = dict(
            conn.execute(
                text("SELECT item_key || '/' || turn_index, ends_chain FROM items ORDER BY id")
            ).all()
        )
        assert {k for k, v in marks.items() if v} == {"chain/1", "single/0"}
        # the single turn is done and waits for its ending; the chain's last is not done yet
        single = _item_id(conn, agent, "single")
        assert turns.unended_last_turns(conn, run_id=agent) == [(single, agent)]
        # the triggers count what is recorded from now on
        assert turns.record_chain_end(conn, single, NO_CALL)
        assert endings(conn, agent) == counted(conn, agent) == {COMPLETE: 2, NO_CALL: 1}
        assert endings(conn, plain) == {}
    config = migrate.alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0019")
    with engine.begin() as conn:
        add_item(conn, plain, "after")
