"""Archiving: a finished, compacted run's rows leave the hot `items` table for `items_archive`.

The hot table then holds only what is active, so its indexes and scans stay small. Reads of a
run (export, verify, report) page through both tables and merge them by id, so an archived
run, or one being archived, reads exactly as before; enqueueing into it is refused.

Order and crash safety: the run is marked archived first (no enqueue from then on), then every
row is copied (`ON CONFLICT DO NOTHING`), then the copied rows are deleted from items. Copying
everything before deleting anything matters: deleting an earlier turn of a conversation
cascades to its later turns, which must already be in the archive. A crash at any point
leaves each row in items, in the archive, or in both (readers take it once); archiving again
finishes the job.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite

from app.core.constants import EVENT_ARCHIVED
from app.core.errors import ArchiveRefused
from app.core.locks import exclusive
from app.core.models import UNFINISHED, ItemStatus
from app.core.settings import Settings
from app.ledger import claims, common, database, event_log, queue, reads, run_queries

log = logging.getLogger(__name__)

PAGE_ITEMS = 5000
# the compaction lock of the run: an archive never runs beside a compaction of the same run
LOCK_TTL_S = 3600.0
FINAL = (ItemStatus.DONE.value, ItemStatus.FAILED.value)


@dataclass
class ArchiveReport:
    run: str
    copied: int = 0
    deleted: int = 0
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "copied": self.copied,
            "deleted": self.deleted,
            "skipped": self.skipped,
        }


def archive_blockers(conn: Connection, run_id: int) -> list[str]:
    """Why the run cannot be archived yet (empty when it can): indexed probes only."""
    found = []
    if claims.run_has_items(conn, run_id, [s.value for s in UNFINISHED]):
        found.append("it still has unfinished items")
    uncompacted = select(common.items.c.id).where(
        common.items.c.run_id == run_id,
        common.items.c.status == ItemStatus.DONE.value,
        common.items.c.shard_uri.is_(None),
    )
    if conn.execute(
        uncompacted.order_by(common.items.c.run_id, common.items.c.id).limit(1)
    ).first():
        found.append("some done items are not compacted (run `tokenmill compact RUN --all`)")
    return found


def mark_archived(conn: Connection, run_id: int) -> None:
    conn.execute(
        update(common.runs)
        .where(common.runs.c.id == run_id, common.runs.c.archived_at.is_(None))
        .values(archived_at=common.utcnow())
    )


def _page(conn: Connection, run_id: int, status: str, after: int) -> list[int]:
    """The next page of the run's item ids of one status: a keyset range of (run_id, status,
    id)."""
    database.pin_index_plans(conn)
    stmt = (
        select(common.items.c.id)
        .where(common.run_status_range(conn, common.items, run_id, status, after))
        .order_by(*common.run_status_order(common.items))
        .limit(PAGE_ITEMS)
    )
    return list(conn.execute(stmt).scalars())


def copy_items(conn: Connection, ids: Sequence[int]) -> int:
    """Copy these items into the archive (rows already there are left alone)."""
    names = [c.name for c in common.items_archive.columns]
    source = select(*(common.items.c[n] for n in names)).where(common.items.c.id.in_(list(ids)))
    if conn.dialect.name == "postgresql":
        stmt: Any = postgresql.insert(common.items_archive).from_select(names, source)
    else:
        stmt = sqlite.insert(common.items_archive).from_select(names, source)
    stmt = stmt.on_conflict_do_nothing(index_elements=["id"]).returning(common.items_archive.c.id)
    return len(conn.execute(stmt).all())


def delete_archived(conn: Connection, ids: Sequence[int]) -> int:
    """Delete from items those of these ids that are in the archive."""
    copied = select(common.items_archive.c.id).where(common.items_archive.c.id.in_(list(ids)))
    return int(conn.execute(delete(common.items).where(common.items.c.id.in_(copied))).rowcount)


def archive_run(db: Engine, settings: Settings, run: run_queries.RunInfo) -> ArchiveReport:
    """Move a finished, compacted run's items to items_archive; ArchiveRefused if it is not
    finished or not compacted. Running it again finishes an interrupted archive."""
    report = ArchiveReport(run=run.name)
    with exclusive(settings, f"compact-{run.id}", ttl_s=LOCK_TTL_S) as held:
        if not held:
            report.skipped = "a compaction of this run is running; try again when it ends"
            return report
        with db.begin() as conn:
            blockers = archive_blockers(conn, run.id)
            if blockers:
                raise ArchiveRefused(f"run {run.name!r} cannot be archived: " + "; ".join(blockers))
            mark_archived(conn, run.id)
        for status in FINAL:
            after = 0
            while ids := _read(db, run.id, status, after):
                with db.begin() as conn:
                    report.copied += copy_items(conn, ids)
                after = ids[-1]
        for status in FINAL:
            after = 0
            while ids := _read(db, run.id, status, after):
                with db.begin() as conn:
                    report.deleted += delete_archived(conn, ids)
                after = ids[-1]
        with db.begin() as conn:
            # counted once, now that every row is in the archive: status reads these from now on
            kept = reads.scanned_run_counts(conn, run).tallies()
            conn.execute(
                update(common.runs).where(common.runs.c.id == run.id).values(archived_counts=kept)
            )
            queue.refresh_statistics(conn)
            event_log.record_event(
                conn,
                EVENT_ARCHIVED,
                f"run {run.name} archived: {report.deleted} items left the hot table",
                run_id=run.id,
                details=report.to_json(),
            )
    log.info(
        "archived run %s: %d copied, %d deleted",
        run.name,
        report.copied,
        report.deleted,
        extra={"action": "archived"},
    )
    return report


def _read(db: Engine, run_id: int, status: str, after: int) -> list[int]:
    with db.connect() as conn:
        return _page(conn, run_id, status, after)
