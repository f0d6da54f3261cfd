"""Keyset pages and archived runs, on SQLite and Postgres: pages across compacted and
uncompacted rows read every item once in id order; archiving a finished, compacted run moves
its rows out of items, and export, verify and report read it exactly as before."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, func, select

from app.core.errors import ArchiveRefused, RunArchived
from app.core.settings import Settings
from app.ledger import archive, common, dashboard_queries, outcomes, queue, reads, run_queries
from app.outputs.export import export_run
from app.outputs.parquet_export import export_parquet
from app.outputs.verify import verify_run
from ops.views.report_page import build_report
from tests.support.done_runs import make_done_run, spec
from tests.support.procs import clean_env, tokenmill
from workers.control.compaction import compact_ids, compact_run, compaction_location

FINAL = ("done", "failed")


def settings_for(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path / "data",
        storage_url=(tmp_path / "storage").as_uri(),
        compact_min_items=1,
        shard_rows=16,
    )


def stored(db: Engine, run: run_queries.RunInfo, page_size: int) -> list[reads.StoredItem]:
    with db.connect() as conn:
        return list(reads.iter_items(conn, run.id, statuses=FINAL, page_size=page_size))


def test_keyset_pages_cross_compacted_and_uncompacted_rows(db: Engine, tmp_path: Path) -> None:
    run = make_done_run(db, "ks", 20)  # 40 done, one failed, one pending
    whole = stored(db, run, 1000)
    assert len(whole) == 41 and [i.id for i in whole] == sorted(i.id for i in whole)
    # compact two separate stretches of the done items: pages then mix shards and ledger rows
    done_ids = [i.id for i in whole if i.status == "done"]
    loc = compaction_location(settings_for(tmp_path), run.name)
    assert compact_ids(db, loc, done_ids[3:11]) == 8
    assert compact_ids(db, loc, done_ids[20:33]) == 13
    for size in (1, 4, 7, 1000):
        paged = stored(db, run, size)
        assert [(i.id, i.status, i.prompt_ids, i.output_ids) for i in paged] == [
            (i.id, i.status, i.prompt_ids, i.output_ids) for i in whole
        ]
    shards = {i.id: i.shard_uri for i in stored(db, run, 5)}
    assert sum(1 for uri in shards.values() if uri) == 21
    with db.connect() as conn:
        stats = list(dashboard_queries.iter_item_stats(conn, run.id, page_size=3))
    assert [s.id for s in stats] == [i.id for i in whole]


def test_merged_pages_take_a_row_in_both_tables_once() -> None:
    @dataclasses.dataclass
    class Row:
        id: int

    def pages(*ids: list[int]) -> object:
        return iter([[Row(i) for i in page] for page in ids])

    merged = reads.merged_pages([pages([1, 4], [6]), pages([2, 4, 5]), pages()], 2)  # type: ignore[list-item]
    assert [[r.id for r in page] for page in merged] == [[1, 2], [4, 5], [6]]


def everything(db: Engine, run: run_queries.RunInfo, out: Path) -> dict[str, object]:
    """What export, verify and report make of the run."""
    jsonl = out / "sf.jsonl"
    out.mkdir(parents=True)
    export_run(db, run, "specforge", jsonl)
    parquet = export_parquet(db, run, str(out / "pq"), shard_rows=1000)
    verified = verify_run(db, run, None).to_json()
    report = build_report(db, run.name, out / "report")
    with db.connect() as conn:
        counts = reads.run_counts(conn, run).to_json()
        stats = list(dashboard_queries.iter_item_stats(conn, run.id))
        ranges = dashboard_queries.item_ranges(conn, run.id)
        reasons = dashboard_queries.failure_reasons(conn, run.id)
        # what `tokenmill parity` re-renders
        prompts = reads.stored_prompts(conn, reads.prompt_item_ids(conn, run.id))
    assert prompts, "the run has rendered prompts to check"
    return {
        "prompts": [(i.id, i.prompt_ids, i.messages) for i in prompts],
        "specforge": jsonl.read_bytes(),
        "parquet": [pq.read_table(out / "pq" / s.path).to_pylist() for s in parquet.shards],
        "verify": verified,
        "report_items": report.items,
        "counts": counts,
        "stats": stats,
        "ranges": ranges,
        "reasons": reasons,
    }


def rows_in(db: Engine, run: run_queries.RunInfo) -> tuple[int, int]:
    with db.connect() as conn:
        hot = conn.execute(select(func.count()).where(common.items.c.run_id == run.id)).scalar_one()
        cold = conn.execute(
            select(func.count()).where(common.items_archive.c.run_id == run.id)
        ).scalar_one()
    return int(hot), int(cold)


def test_archive_round_trip(db: Engine, tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    run = make_done_run(db, "arc", 12)  # 24 done, one failed, one pending
    other = make_done_run(db, "other", 3, seed=2)
    with pytest.raises(ArchiveRefused, match="unfinished"):
        archive.archive_run(db, settings, run)
    with db.begin() as conn:
        (pending,) = queue.pending_ids(conn, run.id)
        outcomes.record_outcomes(conn, [outcomes.Failed(pending, "HTTP 400")], owner="t", lease_s=1)
    with pytest.raises(ArchiveRefused, match="not compacted"):
        archive.archive_run(db, settings, run)
    assert compact_run(db, settings, run, force=True).compacted == 24
    before = everything(db, run, tmp_path / "before")

    report = archive.archive_run(db, settings, run)
    assert (report.copied, report.deleted) == (26, 26)
    assert rows_in(db, run) == (0, 26)
    assert rows_in(db, other) == (8, 0)
    # the counts were kept when the rows left (status reads them, never counting the archive)
    with db.connect() as conn:
        kept = conn.execute(
            select(common.runs.c.archived_counts).where(common.runs.c.id == run.id)
        ).scalar_one()
    assert kept == {k: v for k, v in before["counts"].items() if k != "run"}
    assert everything(db, run, tmp_path / "after") == before

    # archiving again changes nothing; compaction leaves the archived run (and its shards) be
    assert archive.archive_run(db, settings, run).deleted == 0
    again = compact_run(db, settings, run, force=True)
    assert again.skipped == "the run is archived" and again.orphans_removed == []
    assert everything(db, run, tmp_path / "again") == before
    with db.begin() as conn, pytest.raises(RunArchived, match="new --run name"):
        run_queries.get_or_create_run(conn, spec("arc"))


def test_an_interrupted_archive_reads_each_row_once_and_finishes(
    db: Engine, tmp_path: Path
) -> None:
    settings = settings_for(tmp_path)
    run = make_done_run(db, "half", 10, extra=False)
    compact_run(db, settings, run, force=True)
    before = stored(db, run, 1000)
    with db.begin() as conn:  # died after copying every row and deleting a few
        archive.mark_archived(conn, run.id)
        ids = [i.id for i in before]
        assert archive.copy_items(conn, ids) == 20
        assert archive.delete_archived(conn, ids[:5]) == 5
        assert reads.run_counts(conn, run).done == 20
    assert rows_in(db, run) == (15, 20)
    assert [(i.id, i.output_ids) for i in stored(db, run, 3)] == [
        (i.id, i.output_ids) for i in before
    ]
    assert archive.archive_run(db, settings, run).deleted == 15
    assert rows_in(db, run) == (0, 20)


def test_archive_command(pg_url: str, pg_engine: Engine, tmp_path: Path) -> None:
    run = make_done_run(pg_engine, "cli", 5, extra=False)
    env = clean_env(
        tmp_path, TOKENMILL_DATABASE_URL=pg_url, TOKENMILL_STORAGE_URL=(tmp_path / "s").as_uri()
    )
    done = tokenmill(["archive", "cli", "--json"], env)
    assert done.returncode == 0, done.stderr
    assert '"deleted": 10' in done.stdout and '"compacted": 10' in done.stdout
    assert rows_in(pg_engine, run) == (0, 10)
    with pg_engine.begin() as conn:
        assert run_queries.run_archived(conn, run.id)
