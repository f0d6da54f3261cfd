"""Compaction on real Postgres: arrays leave the ledger, every reader still sees them, exports
are unchanged, a rerun changes nothing, a crash between shard and ledger heals, unfinished
multi-turn chains keep their arrays, and the periodic task takes a real Redis lock."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, func, insert, select, update

from app.core.locks import exclusive
from app.core.settings import Settings
from app.ledger import common, compaction, reads, run_queries
from app.ledger import compaction as ledger_compaction
from app.outputs.export import export_run
from app.outputs.parquet_export import check_export, export_parquet
from tests.support.done_runs import make_done_run
from tests.support.procs import clean_env, tokenmill
from workers.control import compaction as control_compaction
from workers.control.compaction import compact_due, compact_run, compaction_location


def settings_for(tmp_path: Path, **extra: object) -> Settings:
    values: dict[str, object] = {
        "data_dir": tmp_path / "data",
        "storage_url": (tmp_path / "storage").as_uri(),
        "compact_min_items": 10,
        "shard_rows": 25,
    }
    values.update(extra)
    return Settings(**values)  # type: ignore[arg-type]


def exports(db: Engine, run: run_queries.RunInfo, folder: Path) -> tuple[bytes, list[object]]:
    """SpecForge JSONL bytes and the Parquet rows (without the shard names) of run."""
    folder.mkdir(parents=True, exist_ok=True)
    jsonl = folder / "sf.jsonl"
    export_run(db, run, "specforge", jsonl)
    report = export_parquet(db, run, str(folder / "pq"), shard_rows=1000)
    rows = [pq.read_table(folder / "pq" / s.path).to_pylist() for s in report.shards]
    return jsonl.read_bytes(), rows


def test_compaction_moves_arrays_and_readers_do_not_notice(
    pg_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # shards of 25 gathered from id pages of 4, read in pages of 3 rows and marked in
    # statements of 7: the last page and statement of each shard are partial
    monkeypatch.setattr(ledger_compaction, "MARK_ROWS", 7)
    monkeypatch.setattr(control_compaction, "ID_PAGE_ITEMS", 4)
    monkeypatch.setattr(control_compaction, "READ_PAGE_ITEMS", 3)
    limits: list[int] = []
    read_ids = ledger_compaction.compactable_ids

    def paged(*args: object, limit: int, **kwargs: object) -> list[int]:
        limits.append(limit)
        return read_ids(*args, limit=limit, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ledger_compaction, "compactable_ids", paged)
    settings = settings_for(tmp_path)
    run = make_done_run(pg_engine, "cmp", 30)
    before = exports(pg_engine, run, tmp_path / "before")
    with pg_engine.connect() as conn:
        stored_before = list(reads.iter_items(conn, run.id))

    report = compact_run(pg_engine, settings, run)
    assert report.compacted == 60 and report.skipped is None
    # 25 = 4 x 6 + 1 a shard; the third shard's 10 ids end in a short page, then one empty read
    assert limits == [4] * 6 + [1] + [4] * 6 + [1] + [4, 4, 4] + [4]
    ids = [i.id for i in stored_before]
    assert report.shards == [
        f"items-{ids[0]}-{ids[24]}.parquet",
        f"items-{ids[25]}-{ids[49]}.parquet",
        f"items-{ids[50]}-{ids[59]}.parquet",
    ]
    with pg_engine.connect() as conn:
        rows = conn.execute(
            select(
                common.items.c.id,
                common.items.c.shard_uri,
                common.items.c.shard_row,
                common.items.c.status,
            )
            .where(common.items.c.run_id == run.id)
            .order_by(common.items.c.id)
        ).all()
    done = [r for r in rows if r.status == "done"]
    assert [r.shard_row for r in done] == list(range(25)) * 2 + list(range(10))
    assert all(r.shard_uri for r in done)
    assert all(r.shard_uri is None for r in rows if r.status != "done")

    with pg_engine.connect() as conn:
        stored_after = list(reads.iter_items(conn, run.id))
    assert [(i.id, i.prompt_ids, i.output_ids) for i in stored_after] == [
        (i.id, i.prompt_ids, i.output_ids) for i in stored_before
    ]
    assert exports(pg_engine, run, tmp_path / "after") == before
    with pg_engine.connect() as conn:
        assert check_export(conn, run.id, str(tmp_path / "after" / "pq")).problems == []

    # the ledger holds empty arrays now
    with pg_engine.connect() as conn:
        sizes = conn.execute(
            select(
                common.items.c.status,
                func.sum(func.octet_length(common.items.c.prompt_ids)),
                func.sum(func.coalesce(func.octet_length(common.items.c.output_ids), 0)),
            )
            .where(common.items.c.run_id == run.id)
            .group_by(common.items.c.status)
        ).all()
    assert {s: (int(p), int(o)) for s, p, o in sizes}["done"] == (0, 0)

    # a second compaction changes nothing
    shards = sorted(p.name for p in (tmp_path / "storage/runs/cmp/compacted").iterdir())
    again = compact_run(pg_engine, settings, run, force=True)
    assert (again.compacted, again.shards, again.orphans_removed) == (0, [], [])
    assert sorted(p.name for p in (tmp_path / "storage/runs/cmp/compacted").iterdir()) == shards


def test_a_crash_between_shard_and_ledger_heals(
    pg_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(tmp_path)
    run = make_done_run(pg_engine, "heal", 20, extra=False)
    before = exports(pg_engine, run, tmp_path / "before")
    folder = tmp_path / "storage/runs/heal/compacted"

    def crash(*_: object, **__: object) -> int:
        raise ConnectionError("database went away")

    monkeypatch.setattr(compaction, "mark_compacted", crash)
    with pytest.raises(ConnectionError):
        compact_run(pg_engine, settings, run)
    monkeypatch.undo()
    written = sorted(p.name for p in folder.iterdir())
    assert len(written) == 1  # the first shard made it, the ledger never heard of it
    with pg_engine.connect() as conn:
        assert compaction.compacted_count(conn, run.id) == 0

    # other batch boundaries now: the crashed shard is an orphan and goes
    healed = compact_run(pg_engine, settings, run, shard_rows=15)
    assert healed.orphans_removed == written
    assert healed.compacted == 40
    assert sorted(p.name for p in folder.iterdir()) == sorted(healed.shards)
    with pg_engine.connect() as conn:
        assert compaction.shard_uris(conn, run.id) == {
            compaction_location(settings, "heal").uri(n) for n in healed.shards
        }
    assert exports(pg_engine, run, tmp_path / "after") == before


def test_a_crash_then_the_same_batch_rewrites_the_same_key(
    pg_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(tmp_path)
    run = make_done_run(pg_engine, "same", 10, extra=False)
    folder = tmp_path / "storage/runs/same/compacted"
    monkeypatch.setattr(compaction, "mark_compacted", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        compact_run(pg_engine, settings, run)
    monkeypatch.undo()
    crashed = sorted(p.name for p in folder.iterdir())
    report = compact_run(pg_engine, settings, run)
    assert report.shards == crashed and report.compacted == 20
    assert sorted(p.name for p in folder.iterdir()) == crashed


def test_unfinished_chains_and_small_runs_wait(pg_engine: Engine, tmp_path: Path) -> None:
    settings = settings_for(tmp_path, compact_min_items=100)
    run = make_done_run(pg_engine, "chain", 5, extra=False)
    with pg_engine.begin() as conn:
        first, second = compaction.compactable_ids(conn, run.id, limit=2)
        for prev, status in ((first, "waiting"), (second, "failed")):
            conn.execute(
                insert(common.items).values(
                    run_id=run.id,
                    item_key=f"turn2-{prev}",
                    sample_index=0,
                    turn_index=1,
                    prev_item_id=prev,
                    prompt_ids=[],
                    prompt_tokens=0,
                    status=status,
                    attempts=0,
                    created_at=common.utcnow(),
                )
            )
    small = compact_run(pg_engine, settings, run)
    assert small.compacted == 0 and "fewer than TOKENMILL_COMPACT_MIN_ITEMS (100)" in (
        small.skipped or ""
    )
    report = compact_run(pg_engine, settings, run, force=True)
    assert report.compacted == 9  # all done items but the one a waiting turn still reads
    with pg_engine.connect() as conn:
        kept = conn.execute(
            select(common.items.c.id, common.items.c.output_ids).where(
                common.items.c.run_id == run.id,
                common.items.c.status == "done",
                common.items.c.shard_uri.is_(None),
            )
        ).all()
    assert [k.id for k in kept] == [first] and kept[0].output_ids
    with pg_engine.begin() as conn:
        conn.execute(
            update(common.items).where(common.items.c.prev_item_id == first).values(status="failed")
        )
    assert compact_run(pg_engine, settings, run, force=True).compacted == 1


def test_periodic_compaction_under_a_redis_lock(
    pg_engine: Engine, tmp_path: Path, redis_url: str
) -> None:
    settings = settings_for(tmp_path, broker_url=redis_url, compact_min_items=30)
    big = make_done_run(pg_engine, "big", 20)
    make_done_run(pg_engine, "small", 5)
    with exclusive(settings, f"compact-{big.id}", ttl_s=60) as held:
        assert held
        reports = compact_due(pg_engine, settings)
    assert [(r.run, r.compacted, r.skipped) for r in reports] == [
        ("big", 0, "another compaction of this run is running")
    ]
    reports = compact_due(pg_engine, settings)
    assert [(r.run, r.compacted) for r in reports] == [("big", 40)]
    assert compact_due(pg_engine, settings) == []


def test_compact_command(pg_engine: Engine, pg_url: str, tmp_path: Path) -> None:
    run = make_done_run(pg_engine, "cmd", 6)
    env = clean_env(
        tmp_path / "data",
        TOKENMILL_DATABASE_URL=pg_url,
        TOKENMILL_STORAGE_URL=str(tmp_path / "storage"),
        TOKENMILL_COMPACT_MIN_ITEMS="100",
    )
    waiting = tokenmill(["compact", "cmd"], env)
    assert waiting.returncode == 0, waiting.stderr
    assert "0 items compacted" in waiting.stderr and "use --all" in waiting.stderr
    # the setting as the user sets it, not the field behind it
    assert "12 finished items wait, fewer than TOKENMILL_COMPACT_MIN_ITEMS (100)" in waiting.stderr
    done = tokenmill(["compact", "cmd", "--all", "--json"], env)
    assert done.returncode == 0, done.stderr
    assert '"compacted": 12' in done.stdout
    with pg_engine.connect() as conn:
        assert compaction.compacted_count(conn, run.id) == 12
